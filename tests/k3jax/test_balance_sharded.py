"""Sharded QB: psum-ed histograms on 8 fake CPU devices == the unsharded update on the whole batch.

The checks run in a subprocess with XLA_FLAGS set before jax is imported, so the default suite
runs them whatever devices the parent process already has.
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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == len(CASES), proc.stdout


def _check_case(mesh_shape, axis_names, split, token_axes):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from k3jax import balance

    num_experts, k = 64, 8
    cfg = balance.BalanceConfig(method="qb_hist", num_bins=256, margin_range=(-0.5, 0.5))
    key_s, key_b = jax.random.split(jax.random.PRNGKey(0))
    popularity = jax.random.normal(key_b, (num_experts,))
    scores = jax.nn.sigmoid(jax.random.normal(key_s, (8, 256, num_experts)) + popularity)
    bias = 0.05 * jax.random.normal(jax.random.PRNGKey(1), (num_experts,))
    bias = bias - bias.mean()
    flat = scores.reshape(-1, num_experts)  # [B·S, E]

    want = balance.quantile_bias_hist(
        flat, bias, k, num_bins=cfg.num_bins, margin_range=cfg.margin_range
    )
    want_hist = balance.margin_histogram(
        flat, bias, k, num_bins=cfg.num_bins, margin_range=cfg.margin_range
    )
    want_sign = balance.update_bias(
        balance.BalanceConfig(method="sign"), bias, balance.step_statistics(cfg, flat, bias, k), k
    )

    devices = np.array(jax.devices()[:8]).reshape(mesh_shape)
    mesh = Mesh(devices, axis_names)
    scores_spec = P(*split, None)

    def per_device(local_scores, bias):
        local = local_scores.reshape(-1, num_experts)
        new_bias = balance.quantile_bias_hist(
            local, bias, k, num_bins=cfg.num_bins, margin_range=cfg.margin_range,
            axis_names=token_axes,
        )
        stats = balance.step_statistics(cfg, local, bias, k)
        pooled = jax.lax.psum(stats["hist"], token_axes)
        via_stats = balance.update_bias(cfg, bias, stats, k, axis_names=token_axes)
        sign = balance.update_bias(
            balance.BalanceConfig(method="sign"), bias, stats, k, axis_names=token_axes
        )
        return new_bias, via_stats, pooled, sign

    sharded = jax.jit(
        jax.shard_map(
            per_device, mesh=mesh, in_specs=(scores_spec, P()), out_specs=(P(), P(), P(), P())
        )
    )
    got, via_stats, pooled, sign = sharded(scores, bias)
    np.testing.assert_array_equal(pooled, want_hist)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(via_stats, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(sign, want_sign, rtol=0, atol=1e-7)
    assert float(jnp.abs(got - bias).max()) > 1e-3  # the update did move the bias


def _main():
    import jax

    assert jax.device_count() == 8, jax.devices()
    for case in CASES:
        _check_case(*case)
        print("ok", case[1])


if __name__ == "__main__":
    _main()
