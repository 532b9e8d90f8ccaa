"""What a scanned run saves for its backward on a mesh (the Trainer's context, even on one device).

A scan writes every residual autodiff names as a stacked loop output, one copy per repetition; the
unrolled program's backward fusions recompute cheap fp32 terms from their bf16 sources instead. On a
mesh the MoE runs through ``sharding.ep`` and the KDA short conv through its context-parallel path,
whose plain autodiff kept fp32 terms (SiTU-GLU's seven ``[T·k, F]`` intermediates, the conv's shifted
inputs, sums and SiLU pieces, ``ep._weighted_sum``'s fp32 copy of y): small()'s H200 step stacked
99 GB of residuals, over the memory limit, so XLA's rematerialisation recomputed the head (38.7 GB
now, nothing recomputed). The mesh paths now take the custom VJPs of the one-device paths
(``split_gated_activation``; ``short_convs`` when the sequence is not split), so a one-device mesh
saves what no mesh saves, with no fp32 value of either op among the stacked residuals.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from k3jax import config
from k3jax.layout import scan_plan
from k3jax.model import Transformer

B, T = 2, 64


def _forward_scans(jaxpr) -> list:
    """The forward (non-reverse) scans of a grad's jaxpr, looking through calls but not into scans."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            found += [] if e.params["reverse"] else [e]
            continue
        for key in ("jaxpr", "call_jaxpr"):
            if key in e.params:
                found += _forward_scans(getattr(e.params[key], "jaxpr", e.params[key]))
    return found


def _stacked_residuals(cfg, mesh) -> list[jax.core.ShapedArray]:
    """The stacked outputs (one row per repetition) of the layer runs' forward scans in the loss
    gradient of ``cfg`` (bf16 compute), traced inside ``sharding.use_mesh(mesh)`` when ``mesh``."""
    model = Transformer(cfg)
    variables = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    loss = lambda p, v, t: jnp.sum(model.apply({**v, "params": p}, t).astype(jnp.float32))
    trace = lambda: jax.make_jaxpr(jax.grad(loss))(variables["params"], variables,
                                                   jax.ShapeDtypeStruct((B, T), jnp.int32)).jaxpr
    if mesh is None:
        jaxpr = trace()
    else:
        with sharding.use_mesh(mesh):
            jaxpr = trace()
    scans = [e for e in _forward_scans(jaxpr) if str(e.source_info.name_stack).endswith("Transformer._layers")]
    assert len(scans) == len(scan_plan(cfg).runs)
    return [out.aval for e in scans for out, inner in zip(e.outvars, e.params["jaxpr"].jaxpr.outvars)
            if out.aval.ndim == inner.aval.ndim + 1]


def _bytes(avals, dtype=None) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals if dtype is None or a.dtype == dtype)


@pytest.fixture(scope="module")
def residuals():
    cfg = config.tiny()
    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])  # every axis, size 1
    return cfg, _stacked_residuals(cfg, None), _stacked_residuals(cfg, mesh)


def test_a_one_device_mesh_saves_no_more_than_no_mesh(residuals):
    """Before the mesh paths took the custom VJPs, tiny() on a one-device mesh stacked 1.71× the bytes
    (3.0× the fp32 bytes) of the same model without a mesh."""
    _, plain, meshed = residuals
    assert _bytes(meshed) <= 1.05 * _bytes(plain), (_bytes(meshed), _bytes(plain))
    assert _bytes(meshed, jnp.float32) <= 1.05 * _bytes(plain, jnp.float32)


def test_no_fp32_moe_activation_or_short_conv_terms_are_stacked(residuals):
    """No fp32 ``[T·k, F]`` (the routed experts' activation) and no fp32 ``[B, T, H·K]`` (the short
    conv's channels) among the stacked residuals on a one-device mesh."""
    cfg, _, meshed = residuals
    moe = (B * T * cfg.moe.top_k, cfg.moe.expert_intermediate)
    conv = (B, T, cfg.kda.num_heads * cfg.kda.head_dim)
    wide = [a.shape for a in meshed if a.dtype == jnp.float32 and a.shape[1:] in (moe, conv)]
    assert not wide, wide
