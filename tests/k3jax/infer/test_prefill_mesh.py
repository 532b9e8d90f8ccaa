"""Prefill on a mesh: the cached chunked KDA scan runs per shard (k3jax.layers.kda.chunk_from_state)
and gives what the single-device prefill gives."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from k3jax import config
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import prefill
from k3jax.model import Transformer


def test_prefill_on_a_mesh_matches_one_device():
    cfg = dataclasses.replace(config.tiny(), dtype=jnp.float32, num_layers=2)
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)
    variables = Transformer(cfg).init(jax.random.key(0), tokens[:, :8])
    lengths = jnp.array([40, 23], jnp.int32)
    run = jax.jit(lambda v, t, n: prefill(v, cfg, t, n, init_cache(cfg, 2, 64), chunk=32))
    want, want_cache = run(variables, tokens, lengths)
    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
    with sharding.use_mesh(mesh):
        got, got_cache = jax.jit(lambda v, t, n: prefill(v, cfg, t, n, init_cache(cfg, 2, 64), chunk=32))(
            variables, tokens, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_cache.layers[0].state, want_cache.layers[0].state, rtol=1e-5, atol=1e-5)
