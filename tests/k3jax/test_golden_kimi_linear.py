"""Golden Kimi-Linear: Hugging Face transformers' ``KimiLinearForCausalLM`` (PyTorch, CPU, float32).

``tests/reference/make_kimi_linear.py`` runs in the reference venv (``make refvenv``) and caches a tiny
random checkpoint plus its logits under ``$K3JAX_CACHE/golden/kimi_linear`` (rebuilt when the script
changes). This exercises what the K3 oracle cannot: the softplus decay gate, the low-rank KDA output
gate, MLA without q LoRA or output gate, the plain residual, SwiGLU, the full-width MoE with a
non-zero router bias and routed scaling 2.446, and transformers' own save format.
"""

import hashlib
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert import family, load_hf, save_hf
from k3jax.layout import to_per_layer
from k3jax.model import Transformer
from tests.reference.env import golden_dir, reference_python
from tests.tolerances import KIMI_LINEAR_RTOL, rel_rmse

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "reference", "make_kimi_linear.py")


def _script_hash() -> str:
    with open(SCRIPT, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _ensure_reference() -> str:
    """The cached reference folder, generated in the reference venv when missing or stale."""
    out, stamp = golden_dir("kimi_linear"), _script_hash()
    stamp_file = os.path.join(out, "script.sha256")
    if os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
        return out
    python = reference_python()
    if python is None:
        pytest.skip("PyTorch reference venv not found (set K3JAX_REF_PYTHON or run `make refvenv`)")
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    done = subprocess.run([python, SCRIPT, tmp], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{SCRIPT} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    with open(os.path.join(tmp, "script.sha256"), "w") as f:
        f.write(stamp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


@pytest.fixture(scope="module")
def golden():
    out = _ensure_reference()
    cfg, v = load_hf(os.path.join(out, "hf"), dtype=jnp.float32, param_dtype=jnp.float32)
    return cfg, v, dict(np.load(os.path.join(out, "reference.npz")))


def test_config_is_the_kimi_linear_family(golden):
    cfg, v, _ = golden
    assert family(cfg) == "kimi_linear" and cfg.attn_res is None and cfg.mlp.activation == "swiglu"
    assert cfg.kda.gate_lower_bound is None and cfg.kda.output_gate_rank == cfg.kda.head_dim
    assert cfg.mla.q_lora_rank is None and not cfg.mla.output_gate and cfg.moe.latent_dim is None
    assert cfg.moe.routed_scaling_factor == 2.446
    assert [k.value for k in cfg.layer_kinds] == ["kda", "kda", "kda", "mla", "mla"]
    assert np.all(np.asarray(to_per_layer(v, cfg)["balance"]["layers_1"]["moe"]["bias"]) != 0)


def test_logits_match_transformers(golden):
    cfg, v, ref = golden
    tokens = jnp.asarray(ref["input_ids"], jnp.int32)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(jax.jit(lambda v, t: Transformer(cfg).apply(v, t))(v, tokens))
    assert logits.shape == ref["logits"].shape
    assert rel_rmse(logits, ref["logits"]) <= KIMI_LINEAR_RTOL


def test_round_trip_through_our_writer(golden, tmp_path):
    """transformers' spelling (dense layer under ``block_sparse_moe.``) in, the canonical one out, same values."""
    cfg, v, _ = golden
    save_hf(cfg, v, str(tmp_path))
    cfg2, v2 = load_hf(str(tmp_path))
    assert cfg2 == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), v, v2))
