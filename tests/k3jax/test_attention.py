"""MLA's attention switch (``MLAConfig.attention_implementation``): the flash path against the XLA path.

On CPU the flash kernels run under the Pallas interpreter (``use_flash`` forced, ``interpret=True``);
on the GPU (``-m gpu``) they run compiled through the default switch.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from k3jax import config
from k3jax.layers import MLA
from k3jax.layers import attention as attention_lib
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, F32_RTOL, rel_rmse


def _mla_cfg(impl, dtype=jnp.bfloat16, **dims):
    base = config.tiny()
    return dataclasses.replace(base, dtype=dtype, mla=dataclasses.replace(base.mla, attention_implementation=impl, **dims))


def _run(cfg, params, x, seg):
    """``(y, max_logit, grads of sum(y·w) w.r.t. params)`` of one MLA layer."""
    w = jax.random.normal(jax.random.key(7), x.shape, jnp.float32)

    def loss(p):
        y, state = MLA(cfg).apply({"params": p}, x, seg, mutable=["stats"])
        return jnp.sum(y.astype(jnp.float32) * w), (y, state["stats"]["max_logit"][0])

    (_, (y, max_logit)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return y, max_logit, grads


def _compare(flash, xla):
    (y, mx, g), (ry, rmx, rg) = flash, xla
    assert rel_rmse(y, ry) <= BF16_FWD_RTOL
    assert rel_rmse(mx, rmx) <= F32_RTOL
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree_util.tree_leaves(rg)):
        assert rel_rmse(a, b) <= BF16_GRAD_RTOL, jax.tree_util.keystr(path)


def _setup(cfg, B, T, packed):
    x = jax.random.normal(jax.random.key(0), (B, T, cfg.hidden), jnp.float32).astype(cfg.compute_dtype)
    params = nn.meta.unbox(MLA(cfg).init(jax.random.key(1), x)["params"])
    seg = jnp.ones((B, T), jnp.int32)
    if packed:
        seg = seg.at[:, T // 3:].set(2).at[1:, T - 5:].set(5)
    return x, params, seg


@pytest.mark.parametrize("packed", [False, True])
def test_flash_path_matches_xla_path_interpreted(monkeypatch, packed):
    cfg = _mla_cfg(None)
    x, params, seg = _setup(cfg, 2, 37, packed)
    xla = _run(_mla_cfg("xla"), params, x, seg)
    calls = []
    flash_attention = attention_lib.flash_attention

    def interpreted(*args, **kwargs):
        calls.append(args[0].dtype)
        return flash_attention(*args, **kwargs, interpret=True)

    monkeypatch.setattr(attention_lib, "use_flash", lambda *a: True)
    monkeypatch.setattr(attention_lib, "flash_attention", interpreted)
    flash = _run(cfg, params, x, seg)
    assert calls and calls[0] == jnp.bfloat16  # the flash path ran, on bf16 operands
    _compare(flash, xla)


def test_switch_errors():
    with pytest.raises(ValueError, match="attention_implementation='cudnn' must be one of"):
        config.MLAConfig(num_heads=2, attention_implementation="cudnn")
    x = jnp.zeros((1, 8, config.tiny().hidden), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        MLA(_mla_cfg("pallas", dtype=jnp.float32)).init(jax.random.key(0), x)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            MLA(_mla_cfg("pallas")).init(jax.random.key(0), x.astype(jnp.bfloat16))


def test_default_is_xla_on_cpu_and_for_wide_models():
    assert not attention_lib.use_flash(None, jnp.float32, 2, 4)
    assert not attention_lib.use_flash("xla", jnp.bfloat16, 2, 4)
    assert attention_lib.use_flash(None, jnp.bfloat16, 2, 4) == (jax.default_backend() == "gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_flash_path_matches_xla_path_on_gpu(packed):
    dims = dict(num_heads=4, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128)
    cfg = _mla_cfg(None, **dims)
    assert attention_lib.use_flash(None, cfg.compute_dtype, 2, 4)
    x, params, seg = _setup(cfg, 2, 1024, packed)
    with jax.default_matmul_precision("highest"):
        xla = jax.jit(functools.partial(_run, _mla_cfg("xla", **dims)))(params, x, seg)
    _compare(jax.jit(functools.partial(_run, cfg))(params, x, seg), xla)


def test_flash_path_sharded_over_batch_and_heads_equals_unsharded():
    from tests.sharding.multidevice import run_worker

    results = run_worker("tests.k3jax.attention_sharded_worker")
    assert set(results) == {"data8", "data4_tensor2"}
    assert all(r["exact"] <= F32_RTOL and r["dk_rope"] <= BF16_GRAD_RTOL for r in results.values()), results
