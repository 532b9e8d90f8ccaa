"""Sharded QB: psum-ed histograms on 8 fake CPU devices == the unsharded update on the whole batch,
for generated score matrices (hypothesis: seeds, expert popularity, bias spread; one compiled
sharded update per mesh serves every example).

The checks run in a subprocess that makes its 8 devices with ``chex.set_n_cpu_devices`` before JAX
starts a backend, so the default suite runs them whatever devices the parent process already has.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (mesh shape, mesh axis names, how the [B, S, E] scores are split, axes that carry tokens)
CASES = [
    ((8,), ("data",), (("data",), None), ("data",)),
    ((8,), ("expert",), (("expert",), None), ("expert",)),
    ((8,), ("sequence",), (None, ("sequence",)), ("sequence",)),
    (
        (2, 2, 2),
        ("data", "expert", "sequence"),
        (("data", "expert"), ("sequence",)),
        ("data", "expert", "sequence"),
    ),
]


def test_psum_histogram_matches_unsharded_on_8_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == len(CASES), proc.stdout
    assert "caught: no psum over 'sequence'" in proc.stdout, proc.stdout


def _inputs(seed, popularity_scale, bias_scale, num_experts):
    import jax
    import jax.numpy as jnp

    key_s, key_b, key_bias = jax.random.split(jax.random.PRNGKey(seed), 3)
    popularity = popularity_scale * jax.random.normal(key_b, (num_experts,))
    scores = jax.nn.sigmoid(jax.random.normal(key_s, (8, 256, num_experts)) + popularity)
    bias = bias_scale * jax.random.normal(key_bias, (num_experts,))
    return scores, bias - bias.mean()


def _check_case(mesh_shape, axis_names, split, token_axes, reduce_over=None):
    """``reduce_over``: the axes the update sums over (default ``token_axes``; a mutation passes fewer)."""
    import chex
    import jax
    import jax.numpy as jnp
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from jax.sharding import Mesh, PartitionSpec as P

    from k3jax import balance

    num_experts, k = 64, 8
    cfg = balance.BalanceConfig(method="qb_hist", num_bins=256, margin_range=(-0.5, 0.5))
    sign_cfg = balance.BalanceConfig(method="sign")
    devices = np.array(jax.devices()[:8]).reshape(mesh_shape)
    mesh = Mesh(devices, axis_names)
    token_axes = token_axes if reduce_over is None else reduce_over

    def per_device(local_scores, bias):
        local = local_scores.reshape(-1, num_experts)
        new_bias = balance.quantile_bias_hist(
            local, bias, k, num_bins=cfg.num_bins, margin_range=cfg.margin_range, axis_names=token_axes,
        )
        stats = balance.step_statistics(cfg, local, bias, k)
        pooled = jax.lax.psum(stats["hist"], token_axes)
        via_stats = balance.update_bias(cfg, bias, stats, k, axis_names=token_axes)
        sign = balance.update_bias(sign_cfg, bias, stats, k, axis_names=token_axes)
        return new_bias, via_stats, pooled, sign

    # The mutation's outputs do vary over the axis it leaves out: JAX would reject them statically,
    # so its check is off there and the property has to catch them by value.
    sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(*split, None), P()),
                                    out_specs=(P(), P(), P(), P()), check_vma=reduce_over is None))

    @jax.jit
    def unsharded(scores, bias):
        flat = scores.reshape(-1, num_experts)  # [B·S, E]
        want = balance.quantile_bias_hist(flat, bias, k, num_bins=cfg.num_bins, margin_range=cfg.margin_range)
        hist = balance.margin_histogram(flat, bias, k, num_bins=cfg.num_bins, margin_range=cfg.margin_range)
        sign = balance.update_bias(sign_cfg, bias, balance.step_statistics(cfg, flat, bias, k), k)
        return want, hist, sign

    @settings(max_examples=3, deadline=None, database=None)
    @given(seed=st.integers(0, 2**16), popularity=st.sampled_from([0.0, 1.0, 3.0]), spread=st.sampled_from([0.0, 0.05]))
    def check(seed, popularity, spread):
        scores, bias = _inputs(seed, popularity, spread, num_experts)
        want, want_hist, want_sign = unsharded(scores, bias)
        got, via_stats, pooled, sign = sharded(scores, bias)
        chex.assert_trees_all_equal(pooled, want_hist)
        chex.assert_trees_all_close(got, want, rtol=0, atol=1e-6)
        chex.assert_trees_all_close(via_stats, want, rtol=0, atol=1e-6)
        chex.assert_trees_all_close(sign, want_sign, rtol=0, atol=1e-7)

    check()
    scores, bias = _inputs(0, 1.0, 0.05, num_experts)
    assert float(jnp.abs(sharded(scores, bias)[0] - bias).max()) > 1e-3  # the update does move the bias


def _main():
    import chex

    chex.set_n_cpu_devices(8)  # before JAX starts its CPU backend
    import jax

    assert jax.device_count() == 8, jax.devices()
    for case in CASES:
        _check_case(*case)
        print("ok", case[1])
    try:  # the property catches an update that forgets to psum over one token axis
        _check_case(*CASES[-1][:3], ("data", "expert", "sequence"), reduce_over=("data", "expert"))
    except AssertionError:
        print("caught: no psum over 'sequence'")


if __name__ == "__main__":
    _main()
