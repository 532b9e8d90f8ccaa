"""``python -m k3jax.serve``: bad input is one ``error:`` line and exit status 2; the real command
serves the oracle checkpoint to the ``openai`` client (slow: a fresh process compiles)."""

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3jax.serve.__main__ import main
from tests.k3jax.cli_run import ROOT, assert_one_error_line

ORACLE = Path("/work/shared/oracle/tiny_a/hf_bf16")


def _run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out, err)


@pytest.mark.parametrize("extra, fragments", [
    (["--set", "num_slots=0"], ("num_slots=0", ">= 1")),
    (["--set", "nope=1"], ("nope",)),
    (["--set", "chunk=100"], ("chunk=100", "multiple of page_size")),
    (["--port", "70000"], ("--port=70000",)),
])
def test_bad_arguments(tmp_path, capsys, extra, fragments):
    assert_one_error_line(_run(["--checkpoint", str(tmp_path), *extra], capsys), *fragments)


def test_bad_checkpoint(tmp_path, capsys):
    assert_one_error_line(_run(["--checkpoint", str(tmp_path / "nope")], capsys), "nope", "does not exist")


@pytest.mark.skipif(not ORACLE.is_dir(), reason="the oracle checkpoint is not on this machine")
def test_missing_draft(tmp_path, capsys):
    result = _run(["--checkpoint", str(ORACLE), "--draft", str(tmp_path / "nope.npz")], capsys)
    assert_one_error_line(result, "nope.npz", "does not exist")


@pytest.mark.slow
@pytest.mark.skipif(not ORACLE.is_dir(), reason="the oracle checkpoint is not on this machine")
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft"])
def test_serves_the_oracle_checkpoint(tmp_path, speculative):
    openai = pytest.importorskip("openai")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    sets = ["num_slots=2", "page_size=16", "max_context=64", "chunk=16", "buckets=(4,)"]
    extra = []
    if speculative:  # an untrained draft for the oracle's config; 60 + 4 draft tokens fit the 4 pages
        import jax

        from k3jax.checkpoint_source import load_variables
        from k3jax.infer.draft import init_draft, save_draft

        save_draft(tmp_path / "draft.npz", init_draft(load_variables(ORACLE)[0], jax.random.key(0)))
        sets[2], extra = "max_context=60", ["--draft", str(tmp_path / "draft.npz")]
    proc = subprocess.Popen([sys.executable, "-m", "k3jax.serve", "--checkpoint", str(ORACLE), "--port", "0",
                             *[a for s in sets for a in ("--set", s)], *extra],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = None, time.time() + 900
        while url is None and time.time() < deadline and proc.poll() is None:
            if select.select([proc.stderr], [], [], 5)[0]:
                line = proc.stderr.readline()
                if line.startswith("serving "):
                    url = line.split(" on ")[-1].strip()
        assert url is not None, f"the server did not start (rc {proc.poll()})"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        out = client.completions.create(model="hf_bf16", prompt="hello", max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens == 5 and 1 <= out.usage.completion_tokens <= 4
        chunks = list(client.completions.create(model="hf_bf16", prompt="hello", max_tokens=4, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
        if speculative:
            import httpx

            assert httpx.get(url + "/health").json()["draft_verifies"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
