"""``python -m k3jax.train --config experiments/<name>.py [--set key=value …]``.

The experiment file's ``get_config()`` returns a ``TrainConfig``; ``--set`` overrides any field by
its dotted path (``--set optimizer.learning_rate=1e-3 --set model.num_layers=4``). Progress goes
to a tqdm bar, metrics to ``<log_dir>/metrics.jsonl`` (and TensorBoard when installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from k3jax.train.config import TrainConfig, override


def load_config(path: str, assignments: list[str] | None = None) -> TrainConfig:
    """``get_config()`` of an experiment file, with ``--set`` overrides applied."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path!r} does not exist (expected a Python file with get_config())")
    spec = importlib.util.spec_from_file_location(f"k3jax_experiment_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"--config {path!r} must define get_config() returning a TrainConfig")
    cfg = module.get_config()
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"get_config() in {path!r} returned {type(cfg).__name__}; expected TrainConfig")
    return override(cfg, assignments or [])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3jax.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="experiment file (experiments/<name>.py)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field by dotted path; repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.assignments)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from k3jax.compile_cache import enable_compilation_cache
    from k3jax.train.loop import train

    enable_compilation_cache()

    try:
        result = train(cfg, progress=not args.no_progress)
    except ValueError as err:  # config, data or checkpoint problems found before compute
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {k: float(v) for k, v in result.last_metrics.items() if getattr(v, "ndim", 0) == 0}
    summary["step"] = int(result.state.step)
    summary["interrupted"] = result.interrupted
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
