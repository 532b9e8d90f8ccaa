"""experiments/notebooks/quickstart.ipynb runs headless on the CPU (nbclient), so it cannot rot:
train, plot, save, convert, inspect, reload (equal to the trained weights), generate."""

import os
import pathlib

import pytest

nbclient = pytest.importorskip("nbclient", reason="the test extra installs nbclient (setup.cfg)")
nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat (setup.cfg)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "experiments" / "notebooks" / "quickstart.ipynb"


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            stream = o.get("output_type") == "stream"
            out.append(o.get("text", "") if stream else str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


def test_quickstart_notebook_runs_headless(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # Compiling tiny()'s train step dominates the run: cheaper LLVM passes, as tests/sharding/multidevice.py.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_llvm_disable_expensive_passes=true".strip()
    monkeypatch.setenv("XLA_FLAGS", flags)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _text(nb)
    assert "final loss" in text and "reloaded == trained up to bfloat16 rounding: True" in text, text[-3000:]
    assert "wrote " in text and "keys: every expected tensor present" in text, text[-3000:]
    assert "recall accuracy after" in text
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])), "no loss plot"
    first = nb.cells[1].source
    assert "/work" not in first and "pip" in first  # the install cell names no local path


def test_install_cell_installs_the_clone_or_asks_for_k3jax_repo(tmp_path, monkeypatch):
    """Where k3jax is not importable, the first cell pip-installs the clone the notebook sits in, else
    K3JAX_REPO, and without either stops with a message saying to set K3JAX_REPO (no made-up URL)."""
    import importlib.util
    import subprocess
    import sys

    cell = nbformat.read(NOTEBOOK, as_version=4).cells[1].source
    installs = []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "k3jax" else find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda args, check: installs.append(args))
    monkeypatch.delenv("K3JAX_REPO", raising=False)
    monkeypatch.chdir(NOTEBOOK.parent)  # Jupyter's working folder: the notebook's own
    exec(cell, {})
    assert installs == [[sys.executable, "-m", "pip", "install", "-q", str(ROOT)]]
    monkeypatch.chdir(tmp_path)  # outside any clone
    with pytest.raises(RuntimeError, match="not inside a k3jax clone: set K3JAX_REPO"):
        exec(cell, {})
    monkeypatch.setenv("K3JAX_REPO", str(ROOT))
    exec(cell, {})
    assert installs[-1][-1] == str(ROOT) and len(installs) == 2
