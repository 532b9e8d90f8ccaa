"""The README's commands run as written: every ``python …`` line of a fenced shell block of
README.md, in order, from a scratch working directory (so ``runs/`` lands there), with tiny
settings appended (later flags win) so that the whole README takes minutes, not hours.

The commands are read at test time, so README edits are picked up; a command this file has no
tiny settings for runs exactly as written. ``K3JAX_README=FILE`` checks another file (a draft).
"""

import os
import re
import shlex
from pathlib import Path

import pytest

from tests.k3jax.cli_run import run_cli

ROOT = Path(__file__).resolve().parents[1]
TRAIN_TINY = ["--no-progress", "--set", "steps=2", "--set", "model.num_layers=2", "--set", "batch_size=4",
              "--set", "checkpoint.every_steps=1"]
# How to make each kind of command tiny (appended to the README's arguments).
TINY = {
    ("-m", "k3jax.train"): TRAIN_TINY,
    ("-m", "k3jax.train.demo"): ["--set", "steps=2", "--set", "model.num_layers=2", "--eval-batches", "1"],
    ("-m", "k3jax.generate"): ["--max-new-tokens", "4"],
    ("experiments/balance_qb_vs_sign.py",): ["--steps", "3", "--tokens_896", "64", "--tokens_64", "64"],
}


def readme_commands(text: str) -> list[list[str]]:
    """The argument lists (after ``python``) of the README's shell commands, in order."""
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if lang not in ("", "sh", "bash", "shell", "console"):
            continue
        for line in body.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("python "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def _tiny(args: list[str]) -> list[str]:
    for prefix, extra in TINY.items():
        if tuple(args[: len(prefix)]) == prefix:
            return args + extra
    return args


def test_readme_commands_are_found():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands and all(c[0] in ("-m",) or c[0].endswith(".py") for c in commands), commands


@pytest.mark.slow  # trains, generates and simulates: several minutes on 2 CPU cores
def test_readme_commands_run_as_written(tmp_path):
    readme = Path(os.environ.get("K3JAX_README", ROOT / "README.md"))
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    for args in readme_commands(readme.read_text()):
        proc = run_cli(_tiny(args), cwd=tmp_path)  # the suite's compilation cache (tests/conftest.py)
        shown = "python " + shlex.join(args)
        assert proc.returncode == 0, f"{shown}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"{shown}\n{proc.stderr[-3000:]}"
