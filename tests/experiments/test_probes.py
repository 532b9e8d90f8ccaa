"""The KDA-gate probe: tile sums, the bf16 overflow line, and the bound the K3 gate guarantees."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments import probes
from k3jax.layers.kda import decay_gate


def test_tile_log_decay_sums_each_tile_and_drops_a_partial_tail():
    g = -jnp.arange(2 * 35 * 1 * 1, dtype=jnp.float32).reshape(2, 35, 1, 1) / 100
    G = probes.tile_log_decay(g)
    assert G.shape == (2, 2, 1, 1)
    np.testing.assert_allclose(G[0, 1, 0, 0], np.sum(g[0, 16:32, 0, 0]), rtol=1e-6)


def test_bounded_gate_stays_inside_bf16_exponent_range_softplus_does_not():
    z = 50.0 * jax.random.normal(jax.random.key(0), (1, 64, 2, 4))  # extreme gate pre-activations
    a_log = jnp.log(jnp.array([1.0, 16.0]))
    bounded = probes._decay(decay_gate(z, a_log, -5.0))
    softplus = probes._decay(decay_gate(z, a_log, None))
    assert bounded["min_tile_log_decay"] >= -5.0 * probes.TILE > -probes.BF16_EXP_LIMIT
    assert bounded["overflow_fraction"] == 0
    assert softplus["min_tile_log_decay"] < -probes.BF16_EXP_LIMIT and softplus["overflow_fraction"] > 0
    assert jnp.isinf(jnp.exp(-softplus["min_tile_log_decay"]).astype(jnp.bfloat16))  # what overflow means


def test_probes_read_every_layer_of_a_scanned_model():
    """The probes keep values from inside layers, so they run the model unrolled: on a scanned
    baseline they return one summary per layer (inside the scan they would leak its tracers)."""
    import types

    from experiments import families
    from k3jax.layout import scan_plan
    from k3jax.model import Transformer

    cfg = families.k3_baseline(64)
    assert scan_plan(cfg) is not None
    model = Transformer(cfg)
    tokens = jnp.ones((1, 32), jnp.int32)
    variables = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens))
    out = probes.make_probe()(types.SimpleNamespace(model=model))(variables["params"], variables["balance"], tokens)
    assert sorted(out["hidden"]) == [f"layers_{i}" for i in range(cfg.num_layers)]
    assert len(out["decay"]) == 3 and len(out["experts"]) == cfg.num_layers - 1
