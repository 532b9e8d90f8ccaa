"""``python -m k3jax.train --config experiments/<name>.py [--set key=value …]``.

The experiment file's ``get_config()`` returns a ``TrainConfig``; ``--set`` overrides any field by
its dotted path (``--set optimizer.learning_rate=1e-3 --set model.num_layers=4``), the value parsed
as the field's type. ``--init-from PATH`` starts a fresh run from a model's parameters (a Hugging
Face folder, a run folder or a checkpoints folder). Progress goes to a tqdm bar, metrics to
``<log_dir>/metrics.jsonl`` (and TensorBoard when installed). A user error is one ``error:`` line
and exit status 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

from k3jax import cli
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


PARSER = cli.make_parser("python -m k3jax.train", __doc__)
PARSER.add_argument("--config", required=True, help="experiment file (experiments/<name>.py)")
PARSER.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field by dotted path, typed by the field; repeatable")
PARSER.add_argument("--init-from", default=None, metavar="PATH",
                    help="start from these model parameters (Hugging Face folder, run folder or checkpoints "
                         "folder) with a fresh optimizer; ignored when the run resumes from its own checkpoint")
PARSER.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_args(argv=None) -> argparse.Namespace:
    return PARSER.parse_args(argv)


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.assignments)
    if args.init_from is not None:
        if not Path(args.init_from).exists():
            raise ValueError(f"--init-from {args.init_from!r} does not exist")
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=args.init_from))
    from k3jax.compile_cache import enable_compilation_cache
    from k3jax.train.loop import train

    enable_compilation_cache()
    result = train(cfg, progress=not args.no_progress)
    summary = {k: float(v) for k, v in result.last_metrics.items() if getattr(v, "ndim", 0) == 0}
    summary["step"] = int(result.state.step)
    summary["interrupted"] = result.interrupted
    print(json.dumps(summary))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return cli.run(lambda: _train(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
