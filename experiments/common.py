"""What every experiment script shares: its command line, where results go, resuming, plots.

Each script writes ``<out>/<name>.json`` (every number, every curve), ``<name>.md`` (the table a
reader wants) and ``<name>.png`` (one figure), ``<out>`` defaulting to ``experiments/results``.
Training studies also keep one JSON per finished run under ``<out>/<name>_runs/`` so a study
stopped half-way (a device session ending, ``--budget_s``) resumes where it stopped (on a fresh machine: copy that folder back under ``<out>`` first).
Tokenised data is cached outside the results, in ``--cache`` (default ``~/.cache/k3jax/experiments_data``).

Plots need matplotlib (``pip install -e .[experiments]``); where it is missing (the GPU host) the
JSON and markdown are still written and ``--plot_only`` redraws the figure from the JSON later.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"
DATA_CACHE = Path.home() / ".cache" / "k3jax" / "experiments_data"  # tokenised batches, outside the results


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags every script takes: ``--tiny`` (CPU smoke size), ``--out``, ``--plot_only``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke size (the test suite runs this)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for <name>.{json,md,png} (default %(default)s)")
    p.add_argument("--plot_only", action="store_true", help="redraw <name>.png and .md from <name>.json")
    p.add_argument("--cache", type=Path, default=DATA_CACHE, help="tokenised-data cache folder (default %(default)s)")
    return p


def cli(main: Callable[[], Any]) -> None:
    """Run a training script's ``main`` from the command line with JAX's persistent compilation
    cache on (``k3jax.compile_cache``): a resumed study on the same machine reloads executables."""
    from k3jax.compile_cache import enable_compilation_cache

    enable_compilation_cache()
    main()


def publish(args: argparse.Namespace, name: str, compute: Callable[[], dict], markdown: Callable[[dict], str],
            plot: Callable[[dict, Path], bool]) -> dict:
    """``compute()`` the result (with ``--plot_only``: read ``<out>/<name>.json``), then write
    ``<name>.json``, ``<name>.md`` and ``<name>.png`` and print the table."""
    if args.plot_only:
        result = read_json(args.out / f"{name}.json")
    else:
        result = compute()
        write_json(args.out, name, result)
    text = markdown(result)
    write_text(args.out, name, "md", text)
    plot(result, args.out / f"{name}.png")
    print(text)
    return result


def write_json(out: Path, name: str, data: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_finite(data), indent=1))
    tmp.replace(path)  # a reader never sees half a file, even if the session stops mid-write
    return path


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def write_text(out: Path, name: str, suffix: str, text: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.{suffix}"
    path.write_text(text)
    return path


def _finite(x: Any) -> Any:
    """JSON has no inf/nan: they become None (and say so by being absent numbers)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def save_figure(draw: Callable[[Any], None], path: Path, *, nrows: int = 1, ncols: int = 1,
                size: tuple[float, float] = (6.0, 4.0)) -> bool:
    """``draw(axes)`` on a fresh ``nrows × ncols`` figure saved at ``path``; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: {path.name} not drawn (rerun with --plot_only where it is)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    draw(axes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table; floats in ``rows`` should already be formatted as wanted."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


class RunStore:
    """One JSON per finished training run under ``folder``: what makes a study resumable.

    A run is written only when it has finished, so a run interrupted mid-way is simply redone.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def get(self, name: str) -> dict | None:
        path = self.path(name)
        return read_json(path) if path.exists() else None

    def put(self, name: str, record: dict) -> None:
        write_json(self.folder, name, record)

    def all(self) -> dict[str, dict]:
        if not self.folder.exists():
            return {}
        return {p.stem: read_json(p) for p in sorted(self.folder.glob("*.json"))}


class Budget:
    """Wall-clock budget for one call: runs are started only while the time left is expected to
    suffice (estimated from ``seconds_per_unit`` of the runs done so far; unknown: start anyway)."""

    def __init__(self, seconds: float | None):
        if seconds is not None and seconds <= 0:
            raise ValueError(f"budget seconds={seconds} must be > 0 or None")
        self.seconds, self.start = seconds, time.perf_counter()
        self.rate: float | None = None  # seconds per unit of work, from finished runs
        self.fixed = 0.0  # seconds per run that do not scale with its work (compilation)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def record(self, seconds: float, units: float, fixed: float = 0.0) -> None:
        """A finished run: ``fixed`` seconds (compile) plus ``units`` of work (steps) took ``seconds``."""
        rate = max(seconds - fixed, 0.0) / max(units, 1.0)
        self.rate = rate if self.rate is None else max(self.rate, rate)
        self.fixed = fixed

    def allows(self, units: float) -> bool:
        if self.seconds is None or self.rate is None:
            return True
        expected = self.fixed + self.rate * units
        return self.elapsed() + expected <= self.seconds
