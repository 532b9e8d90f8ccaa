"""Decode on a mesh of 8 devices vs one device (run by test_decode_sharded.py in a subprocess):
prefill and greedy steps of tiny() (every layer kind) on data × tensor, MLA's decode attention alone
(``mla.sharded_cached_attention``: each device's rows and heads in ``shard_map``), and which
``shard_map`` calls the decode step makes (the KDA steps' and the MLA attention's, by output shape)."""

import dataclasses

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from k3jax.config import tiny  # noqa: E402
from k3jax.infer.cache import init_cache  # noqa: E402
from k3jax.infer.decode import decode_step, prefill  # noqa: E402
from k3jax.layers import mla  # noqa: E402
from k3jax.model import Transformer  # noqa: E402
from sharding import make_mesh, use_mesh  # noqa: E402
from tests.sharding.multidevice import emit  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

B, T, STEPS = 4, 12, 3


def _decode(cfg, variables, tokens):
    lengths = jnp.full((B,), T, jnp.int32)
    last, cache = prefill(variables, cfg, tokens, lengths, init_cache(cfg, B, T + STEPS + 1))
    outs, tok = [last], jnp.argmax(last, -1).astype(jnp.int32)[:, None]
    for _ in range(STEPS):
        logits, cache = decode_step(variables, cfg, tok, cache)
        outs.append(logits[:, -1])
        tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    return jnp.stack(outs, 1)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def main():
    cfg = dataclasses.replace(tiny(), dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, cfg.vocab_size)
    variables = Transformer(cfg).init(jax.random.PRNGKey(0), tokens[:, :8])
    want = _decode(cfg, variables, tokens)
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    q_c, q_r = jax.random.normal(ks[0], (B, 2, 8, 16)), jax.random.normal(ks[1], (B, 2, 8, 8))
    latent = jax.random.normal(ks[2], (B, 40, 24))
    last = jnp.asarray([[3, 4], [10, 11], [38, 39], [0, 1]], jnp.int32)
    ref = mla.cached_attention(q_c, q_r, latent, last, 0.3)
    mesh = make_mesh(data=2, tensor=4)
    with use_mesh(mesh):
        got = _decode(cfg, variables, tokens)
        attend = jax.jit(lambda *a: mla.sharded_cached_attention(*a, 0.3))
        sharded = attend(q_c, q_r, latent, last)
        text = attend.lower(q_c, q_r, latent, last).as_text()
        cache = init_cache(cfg, B, T + STEPS + 1)
        step = jax.make_jaxpr(lambda v, t, c: decode_step(v, cfg, t, c))(variables, tokens[:, :1], cache)
    outs = [tuple(tuple(o.aval.shape) for o in e.outvars) for e in _equations(step.jaxpr)
            if e.primitive.name == "shard_map"]
    kda, m = cfg.kda, cfg.mla
    emit({"decode_rel": float(rel_rmse(got, want)), "attention_rel": float(rel_rmse(sharded, ref)),
          "shard_map": "manual_computation" in text, "shape": list(got.shape),
          "kda_steps_per_shard": sum((B, kda.num_heads, kda.head_dim, kda.head_dim) in o for o in outs),
          "mla_attention_per_shard": sum(o == ((B, 1, m.num_heads, m.kv_lora_rank),) for o in outs),
          "kda_layers": sum(k.name == "KDA" for k in cfg.layer_kinds),
          "mla_layers": sum(k.name == "MLA" for k in cfg.layer_kinds)})


if __name__ == "__main__":
    main()
