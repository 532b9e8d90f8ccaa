"""``MoEConfig.decode_implementation="pallas-fused"`` (k3jax/layers/moe_decode_fused.py): a batch-1 decode
call of the MoE through the router, gather and tail kernels (interpreted on CPU) equals the XLA path,
with ``up_proj`` in either layout; the opt-in's config check and its error off the GPU.

Same rounding points, other fp32 summation orders (and XLA's excess precision): within about a bf16
ulp, as the kernels' own tests bound them.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.component_configs import MoEConfig
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_layout, decode_step
from k3jax.layers import moe_decode_fused, mxfp4
from k3jax.layers.moe import MoE
from pallas_kernels.target import compile_for
from tests.tolerances import F32_RTOL, rel_rmse

BF16_ULP = 2.0 ** -7


def _cfg(impl):
    base = config.tiny()  # bf16 compute, fp32 params
    return dataclasses.replace(base, moe=dataclasses.replace(base.moe, decode_implementation=impl))


def _variables(cfg, x, router_scale=50.0):
    """Initialised variables; ``router_scale``: a router that separates the experts (at tiny()'s width
    init's 0.02 scale leaves every score near 0.5)."""
    variables = nn.meta.unbox(jax.jit(MoE(cfg).init)(jax.random.key(0), x))
    router = variables["params"]["router"]["kernel"]
    variables["params"]["router"]["kernel"] = router * router_scale
    return variables


def _decode_layout(variables):
    """``up_proj`` and the shared ``down`` output axis first in the ``decode`` collection, as
    ``decode_layout`` stores them."""
    params = dict(variables["params"])
    up = params.pop("up_proj")["kernel"]
    params["shared"] = dict(params["shared"])
    down = params["shared"].pop("down")["kernel"]
    first = lambda k: {"kernel_t": jnp.moveaxis(k, -1, 0)}
    return {**variables, "params": params, "decode": {"up_proj": first(up), "shared": {"down": first(down)}}}


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels interpreted; yields the names of those called."""
    called = []

    def interpret(name, fn, *args, **kwargs):
        called.append(name)
        return fn(*args, **kwargs, interpret=True)

    for name in ("route", "latent_moe"):
        monkeypatch.setattr(moe_decode_fused, name, functools.partial(interpret, name, getattr(moe_decode_fused, name)))
    yield called


@pytest.mark.parametrize("layout", ["params", "decode"])
def test_fused_decode_matches_xla(interpreted, layout):
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 1, config.tiny().hidden)), jnp.bfloat16)
    variables = _variables(_cfg("xla"), x)
    if layout == "decode":
        variables = _decode_layout(variables)
    got = MoE(_cfg("pallas-fused")).apply(variables, x, decode=True)
    assert interpreted == ["latent_moe"]
    ref = MoE(_cfg("xla")).apply(variables, x, decode=True)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    bound = BF16_ULP * (np.maximum(np.abs(got), np.abs(ref)) + np.max(np.abs(ref)))
    assert np.all(np.abs(got - ref) <= bound), (np.abs(got - ref) / bound).max()


def test_mxfp4_experts_route_by_kernel_and_stay_on_xla(interpreted):
    """MXFP4 experts: the router kernel, then the XLA experts; same ids, so the same output as "xla"
    up to the router weights' fp32 order."""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 1, config.tiny().hidden)), jnp.bfloat16)
    quantized = mxfp4.quantize_experts(_variables(_cfg("xla"), x))
    got = np.asarray(MoE(_cfg("pallas-fused")).apply(quantized, x, decode=True), np.float32)
    assert interpreted == ["route"]
    ref = np.asarray(MoE(_cfg("xla")).apply(quantized, x, decode=True), np.float32)
    np.testing.assert_allclose(got, ref, rtol=2 * BF16_ULP, atol=2 * BF16_ULP * np.max(np.abs(ref)))


def test_opt_in_checked_and_needs_a_gpu():
    assert MoEConfig(decode_implementation="pallas-fused").decode_implementation == "pallas-fused"
    with pytest.raises(ValueError, match="decode_implementation='fused' must be one of"):
        MoEConfig(decode_implementation="fused")
    cfg = _cfg("pallas-fused")
    x = jnp.zeros((1, 1, cfg.hidden), jnp.bfloat16)
    variables = _variables(cfg, x)
    with compile_for("cpu"), pytest.raises(ValueError, match="'pallas-fused' needs a CUDA GPU"):
        MoE(cfg).apply(variables, x, decode=True)
    # a train-shaped call (no decode) and a decode of many tokens (grouped path) never take the kernels
    MoE(cfg).apply(variables, x)
    MoE(cfg).apply(variables, jnp.zeros((4, 1, cfg.hidden), jnp.bfloat16), decode=True)


def test_decode_step_equals_xla(interpreted, tiny_model):
    """A whole float32 decode step on ``decode_layout``'s variables (every MoE layer fused) equals the
    XLA decode step, which the decode == forward tests hold to the forward."""
    variables, cfg = decode_layout(tiny_model.variables, tiny_model.cfg)
    fused_cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, decode_implementation="pallas-fused"))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, size=(1, 1)), jnp.int32)
    with jax.default_matmul_precision("highest"):
        got, _ = decode_step(variables, fused_cfg, tokens, init_cache(cfg, 1, 4))
        ref, _ = decode_step(variables, cfg, tokens, init_cache(cfg, 1, 4))
    assert interpreted and set(interpreted) == {"latent_moe"}
    assert rel_rmse(got, ref) <= F32_RTOL


@pytest.mark.gpu
def test_compiled_fused_matches_xla():
    """small()'s MoE at batch 1, compiled: the three kernels against the XLA path, decode layout."""
    base = dataclasses.replace(config.small(), param_dtype=jnp.bfloat16)
    cfg = lambda impl: dataclasses.replace(base, moe=dataclasses.replace(base.moe, decode_implementation=impl))
    x = jnp.asarray(np.random.default_rng(4).normal(size=(1, 1, base.hidden)), jnp.bfloat16)
    variables = _decode_layout(_variables(cfg("xla"), x, router_scale=1.0))
    got = jax.jit(lambda v, x: MoE(cfg("pallas-fused")).apply(v, x, decode=True))(variables, x)
    ref = jax.jit(lambda v, x: MoE(cfg("xla")).apply(v, x, decode=True))(variables, x)
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    bound = BF16_ULP * (np.maximum(np.abs(got), np.abs(ref)) + np.max(np.abs(ref)))
    assert np.all(np.abs(got - ref) <= bound), (np.abs(got - ref) / bound).max()
