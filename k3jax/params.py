"""Parameter counts from the parameter tree itself (SPEC §11), without allocating it.

``jax.eval_shape`` of ``Transformer.init`` gives every leaf's shape and logical axis names. The
active count is what one token touches: everything except the input-embedding lookup and, in
each MoE layer, the ``E − k`` routed experts it does not use (the leaves with the ``experts`` axis,
the router excluded, scaled by ``k/E``). The balancing bias counts (SPEC §11 includes it).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig, ParamCount
from k3jax.layout import is_stack_name
from k3jax.model import Transformer

# A short sequence is enough: parameter shapes do not depend on T.
_PROBE_TOKENS = 4

COMPONENTS = ("embedding", "head", "KDA", "MLA", "dense MLP", "routed experts", "MoE non-expert",
              "norms + AttnRes")


@functools.lru_cache(maxsize=8)
def _abstract_variables(cfg: ModelConfig):
    tokens = jax.ShapeDtypeStruct((1, _PROBE_TOKENS), jnp.int32)
    return jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), tokens)


def _leaves(cfg: ModelConfig) -> list[tuple[tuple[str, ...], int, tuple[str, ...] | None]]:
    """``(path, size, logical axis names)`` of every parameter and balance leaf."""
    out = []
    is_boxed = lambda x: isinstance(x, nn.Partitioned)
    for path, leaf in jax.tree_util.tree_flatten_with_path(_abstract_variables(cfg), is_leaf=is_boxed)[0]:
        keys = tuple(str(getattr(p, "key", p)) for p in path)
        axes = leaf.names if isinstance(leaf, nn.Partitioned) else None
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        out.append((keys, int(np.prod(value.shape)), axes))
    return out


def _is_routed_expert(path: tuple[str, ...], axes) -> bool:
    return path[0] == "params" and axes is not None and "experts" in axes and "router" not in path


def _component(path: tuple[str, ...], axes) -> str:
    if len(path) > 2 and is_stack_name(path[1]):  # params/stack_s/offset_j/…: a stacked layer, as layers_i/…
        path = path[:1] + path[2:]
    if path[0] == "balance":
        return "MoE non-expert"
    if path[1] == "embed":
        return "embedding"
    if path[1] == "head":
        return "head"
    if path[1] in ("final_norm", "out_res") or path[2] in ("attn_norm", "mlp_norm", "attn_res", "mlp_res"):
        return "norms + AttnRes"
    kind = path[2]
    if kind == "moe":
        return "routed experts" if _is_routed_expert(path, axes) else "MoE non-expert"
    return {"kda": "KDA", "mla": "MLA", "mlp": "dense MLP"}[kind]


def param_table(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """``(component, total, active)`` per component, in ``COMPONENTS`` order."""
    unused = (cfg.moe.num_experts - cfg.moe.top_k) / cfg.moe.num_experts
    totals = dict.fromkeys(COMPONENTS, 0)
    inactive = dict.fromkeys(COMPONENTS, 0.0)
    for path, size, axes in _leaves(cfg):
        comp = _component(path, axes)
        totals[comp] += size
        if comp == "embedding":
            inactive[comp] += size
        elif _is_routed_expert(path, axes):
            inactive[comp] += size * unused
    return [(c, totals[c], totals[c] - round(inactive[c])) for c in COMPONENTS]


def count_params(cfg: ModelConfig) -> ParamCount:
    """Total and per-token active parameters (SPEC §11)."""
    table = param_table(cfg)
    return ParamCount(total=sum(t for _, t, _ in table), active=sum(a for _, _, a in table))
