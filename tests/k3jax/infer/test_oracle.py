"""Decode on the tiny real K3 checkpoint (shared/oracle/tiny_a), in float64: prefill-then-decode
logits equal our forward and NeMo's float64 reference; the CLI runs on the HF folder."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert import load_hf
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_step, prefill_jit
from k3jax.model import Transformer
from tests.tolerances import F64_RTOL, rel_rmse

ORACLE = "/work/shared/oracle/tiny_a"
pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLE), reason=f"oracle checkpoint {ORACLE} not present")


def test_prefill_then_decode_on_the_real_checkpoint():
    reference = np.load(f"{ORACLE}/reference.npz")
    with jax.enable_x64(True):
        cfg, v = load_hf(f"{ORACLE}/hf_bf16", dtype=jnp.float64, param_dtype=jnp.float64)
        tokens = jnp.asarray(reference["input_ids"], jnp.int32)  # [2, 37]
        B, T, split = *tokens.shape, 30
        ours = np.asarray(jax.jit(Transformer(cfg).apply)(v, tokens))
        last, cache = prefill_jit(v, cfg, tokens[:, :split], jnp.full((B,), split, jnp.int32),
                                  init_cache(cfg, B, T), chunk=16)
        steps = [np.asarray(last)[:, None]]
        for t in range(split, T - 1):
            logits, cache = decode_step(v, cfg, tokens[:, t:t + 1], cache)
            steps.append(np.asarray(logits))
    got = np.concatenate(steps, axis=1)  # logits at positions split-1 .. T-2
    assert got.dtype == np.float64
    assert rel_rmse(got, ours[:, split - 1:T - 1]) <= F64_RTOL
    assert rel_rmse(got, reference["logits_fp64"][:, split - 1:T - 1]) <= F64_RTOL


def test_cli_generates_from_the_hf_folder(capsys):
    from k3jax.generate import main

    main(["--checkpoint", f"{ORACLE}/hf_bf16", "--prompt", "def f(x):", "--prompt", "ab",
          "--max-new-tokens", "3", "--temperature", "0"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("'def f(x):' -> ")
