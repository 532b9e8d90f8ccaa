"""Golden Kimi K3: the tiny real checkpoint (shared/oracle/tiny_a) against NeMo AutoModel's outputs.

1. float64 (``jax_enable_x64``, ``to_float64``): logits and every stored per-layer array (embeddings,
   mixer and MLP outputs, layer outputs, AttnRes block sums, output mix, final norm, router weights)
   to ``F64_RTOL``; the oracle's own independent float64 port agrees with NeMo to ~1e-13.
2. float32 with full-precision matmuls: logits within ``F32_GOLDEN_GAP_FACTOR`` times NeMo's own
   float32-vs-float64 gap (manifest ``self_checks``).
Both checkpoint variants (BF16 and MXFP4 experts) load to the same parameters bit for bit.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import LayerKind
from k3jax.convert import load_hf
from k3jax.layers.moe import route
from k3jax.layout import to_per_layer, unrolled
from k3jax.model import Transformer
from tests.tolerances import F32_GOLDEN_GAP_FACTOR, F64_RTOL, rel_rmse

ORACLE = "/work/shared/oracle/tiny_a"
NOISE = "nemo_fp32_vs_nemo_fp64 (float32 noise floor)"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(f"{ORACLE}/reference.npz"))


def _call(inter: dict) -> object:
    return inter["__call__"][0]  # capture_intermediates keeps each module's output as a 1-tuple


def _router_weights(cfg, v, inter, layer: int) -> np.ndarray:
    """Top-k weights from the captured router logits through the model's ``route``, sorted by expert id."""
    logits = _call(inter[f"layers_{layer}"]["moe"]["router"])  # [B·T, E]
    bias = v["balance"][f"layers_{layer}"]["moe"]["bias"]
    ids, w = route(jax.nn.sigmoid(logits), bias, cfg.moe.top_k, renormalize=cfg.moe.renormalize,
                   scaling=cfg.moe.routed_scaling_factor)
    order = jnp.argsort(ids, axis=-1)  # the reference lists experts ascending
    return np.asarray(jnp.take_along_axis(w, order, axis=-1)), np.asarray(jnp.take_along_axis(ids, order, axis=-1))


def _per_layer(cfg, v, inter) -> dict[str, np.ndarray]:
    L, out = cfg.num_layers, {}
    layers = [inter[f"layers_{i}"] for i in range(L)]
    mixers = ["kda" if k is LayerKind.KDA else "mla" for k in cfg.layer_kinds]
    ffns = ["moe" if m else "mlp" for m in cfg.moe_layers]
    out["embeddings"] = _call(inter["embed"])
    out["attn_out"] = np.stack([_call(layers[i][mixers[i]]) for i in range(L)])
    out["mlp_out"] = np.stack([_call(layers[i][ffns[i]]) for i in range(L)])
    out["layer_out"] = np.stack([_call(layers[i]).partial for i in range(L)])
    last = _call(layers[-1])
    out["block_residual"] = np.asarray(last.blocks[:last.count])
    out["final_mix"] = _call(inter["out_res"])
    out["final_norm"] = _call(inter["final_norm"])
    moe = [i for i in range(L) if cfg.moe_layers[i]]
    routed = [_router_weights(cfg, v, inter, i) for i in moe]
    out["router_topk_weight"] = np.stack([w for w, _ in routed]).reshape(len(moe), 2, -1, cfg.moe.top_k)
    out["router_topk_idx"] = np.stack([ids for _, ids in routed]).reshape(len(moe), 2, -1, cfg.moe.top_k)
    return out


@pytest.fixture(scope="module")
def fp64_run(reference):
    with jax.enable_x64(True):
        cfg, v = load_hf(f"{ORACLE}/hf_bf16", dtype=jnp.float64, param_dtype=jnp.float64)
        cfg4, v4 = load_hf(f"{ORACLE}/hf_mxfp4", dtype=jnp.float64, param_dtype=jnp.float64)
        same = jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), v, v4))
        # Per-layer intermediates need the layers one by one (tests/k3jax/test_scan.py: scanned == this).
        cfg, v = unrolled(cfg), to_per_layer(v, cfg)
        tokens = jnp.asarray(reference["input_ids"], jnp.int32)
        run = jax.jit(lambda v, t: Transformer(cfg).apply(v, t, capture_intermediates=True,
                                                         mutable=["intermediates", "stats"]))
        logits, state = run(v, tokens)
        arrays = jax.tree.map(np.asarray, _per_layer(cfg, v, state["intermediates"]))
    return cfg, unrolled(cfg4), same, np.asarray(logits), arrays


def test_both_variants_load_the_same_model(fp64_run):
    cfg, cfg4, same, _, _ = fp64_run
    assert cfg == cfg4 and same


def test_fp64_logits(fp64_run, reference):
    _, _, _, logits, _ = fp64_run
    assert logits.dtype == np.float64
    assert rel_rmse(logits, reference["logits_fp64"]) <= F64_RTOL


@pytest.mark.parametrize("name", ["embeddings", "attn_out", "mlp_out", "layer_out", "block_residual",
                                  "final_mix", "final_norm", "router_topk_weight"])
def test_fp64_intermediates(fp64_run, reference, name):
    ours, want = fp64_run[4][name], reference[f"{name}_fp64"]
    assert ours.shape == want.shape
    if ours.ndim == 4:  # per layer (or per block): each must match on its own
        for i in range(len(want)):
            assert rel_rmse(ours[i], want[i]) <= F64_RTOL, f"{name}[{i}]"
    assert rel_rmse(ours, want) <= F64_RTOL


def test_fp64_routing_identical(fp64_run, reference):
    np.testing.assert_array_equal(fp64_run[4]["router_topk_idx"], reference["router_topk_idx"])


def test_fp32_logits_within_reference_noise(reference):
    with open(f"{ORACLE}/manifest.json") as f:
        gap = json.load(f)["self_checks"][NOISE]["max_abs_logits_diff"]
    cfg, v = load_hf(f"{ORACLE}/hf_bf16", dtype=jnp.float32, param_dtype=jnp.float32)  # scanned layers 1-8
    tokens = jnp.asarray(reference["input_ids"], jnp.int32)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(jax.jit(lambda v, t: Transformer(cfg).apply(v, t))(v, tokens))
    assert logits.dtype == np.float32
    want, exact = reference["logits"], reference["logits_fp64"]
    assert np.max(np.abs(logits - want)) <= F32_GOLDEN_GAP_FACTOR * gap
    assert rel_rmse(logits, want) <= F32_GOLDEN_GAP_FACTOR * rel_rmse(want, exact)
