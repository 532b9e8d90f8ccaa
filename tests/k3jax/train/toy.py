"""Toy parameter trees boxed with the model's logical axis names (docs/params.md), for tests that
must not wait for the model."""

import flax.linen as nn
import jax
import jax.numpy as jnp

D, H, K, V, E, L, F, W = 16, 4, 8, 32, 4, 8, 12, 4
DN, DR, DV, RQ, RKV = 8, 4, 8, 12, 10


def boxed_params(key=0):
    """A tree with one leaf of each kind the optimizer has to route."""
    shapes = {
        "embed": {"embedding": ((V, D), ("vocab", "embed"))},
        "layers_0": {
            "attn_norm": {"scale": ((D,), ("embed",))},
            "attn_res": {"query": ((D,), ("embed",)), "norm": ((D,), ("embed",))},
            "kda": {
                "q_proj": {"kernel": ((D, H, K), ("embed", "heads", "head_dim"))},
                "o_proj": {"kernel": ((H, K, D), ("heads", "head_dim", "embed"))},
                "b_proj": {"kernel": ((D, H), ("embed", "heads"))},
                "q_conv": ((W, H, K), ("conv", "heads", "head_dim")),
                "dt_bias": ((H, K), ("heads", "head_dim")),
                "A_log": ((H,), ("heads",)),
                "o_norm": {"scale": ((K,), ("head_dim",))},
            },
            "moe": {
                "router": {"kernel": ((D, E), ("embed", "experts"))},
                "w1": ((E, L, F), ("experts", "latent", "expert_mlp")),
                "w2": ((E, F, L), ("experts", "expert_mlp", "latent")),
            },
        },
        "layers_1": {"mla": {
            "q_b": {"kernel": ((RQ, H, DN + DR), ("q_lora", "heads", "head_dim"))},
            "kv_a": {"kernel": ((D, RKV + DR), ("embed", "kv_lora"))},
            "kv_b": {"kernel": ((RKV, H, DN + DV), ("kv_lora", "heads", "head_dim"))},
        }},
        "head": {"kernel": ((D, V), ("embed", "vocab"))},
    }
    is_spec = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_spec)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    boxed = [nn.LogicallyPartitioned(0.1 * jax.random.normal(k, s, jnp.float32), names)
             for k, (s, names) in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, boxed)


def micro_train_config(**changes):
    """A two-layer K3-shaped model (KDA + dense, MLA + MoE, Block AttnRes) and a short recall task."""
    import dataclasses

    from k3jax.config import tiny
    from k3jax.train.config import DataConfig, RecallConfig, ScheduleConfig, TrainConfig

    model = dataclasses.replace(tiny(), num_layers=2, vocab_size=64)
    base = TrainConfig(model=model, batch_size=4, seq_len=32, steps=20, log_every=5,
                       schedule=ScheduleConfig(warmup_fraction=0.1),
                       data=DataConfig(source="recall", recall=RecallConfig(num_pairs=6, num_queries=6,
                                                                            num_keys=24, num_values=24)))
    return dataclasses.replace(base, **changes)


def use_compilation_cache(path=None):
    """Share compiled steps between the processes of one test (same executable, same bits).

    ``path`` defaults to ``$K3JAX_TEST_JAX_CACHE``, else /tmp/k3jax_test_jax_cache (point it at an empty
    folder to time a cold run)."""
    import os

    from k3jax.compile_cache import enable_compilation_cache

    path = path or os.environ.get("K3JAX_TEST_JAX_CACHE", "/tmp/k3jax_test_jax_cache")
    enable_compilation_cache(path, min_compile_seconds=0.0)
