"""Statistics the forward pass sows (router loads, QB histograms or margins, MLA max logits), combined
over calls and micro-batches, and what the step does with them: Quantile Balancing (SPEC §6) and
expert-load metrics (``k3jax.balance``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from k3jax import balance as qb


# Statistics combined by max over calls and micro-batches (the rest add up or concatenate).
MAX_STATS = ("max_logit", "ep_received_max_mean")


def stat_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def combine_stats(stats: Any) -> Any:
    """One value per statistic from the sown tuples: loads/hist summed, max logits max-ed, margins joined."""

    def reduce(path, values):
        name = stat_name(path)
        values = values if isinstance(values, tuple) else (values,)
        if name in MAX_STATS:
            return jnp.max(jnp.stack(values), axis=0)
        if name == "margins":  # [..., T, E]: the scanned stack's layer axis leads
            return jnp.concatenate(values, axis=-2)
        return sum(values[1:], values[0])

    return jax.tree_util.tree_map_with_path(reduce, stats, is_leaf=lambda x: isinstance(x, tuple))


def accumulate_stats(total: Any, new: Any) -> Any:
    """Fold one micro-batch's combined statistics into the running ones (margins excluded)."""

    def fold(path, a, b):
        name = stat_name(path)
        return jnp.maximum(a, b) if name in MAX_STATS else a + b

    return jax.tree_util.tree_map_with_path(fold, total, new)


def split_margins(stats: Any) -> tuple[Any, Any]:
    """(stats without margins, margins only) — margins are concatenated, not summed, over micro-batches."""
    is_margin = lambda path: stat_name(path) == "margins"
    flat, treedef = jax.tree_util.tree_flatten_with_path(stats)
    rest = [None if is_margin(p) else v for p, v in flat]
    margins = [v if is_margin(p) else None for p, v in flat]
    return jax.tree.unflatten(treedef, rest), jax.tree.unflatten(treedef, margins)


def merge_margins(rest: Any, margins: Any) -> Any:
    return jax.tree.map(lambda a, b: b if a is None else a, rest, margins, is_leaf=lambda x: x is None)


def update_balance(cfg, bias_tree: Any, stats: Any) -> Any:
    """New router biases: ``k3jax.balance.update_bias`` for every ``…/bias`` from the stats beside it."""

    def update(bias, stats):
        if bias.ndim > 1:  # the scanned stack: one bias per layer on a leading axis
            return jax.vmap(update)(bias, stats)
        return qb.update_bias(cfg.balance, bias, stats, cfg.moe.top_k)

    def walk(bias_node, stats_node):
        if "bias" in bias_node and not isinstance(bias_node["bias"], dict):
            return {**bias_node, "bias": update(bias_node["bias"], stats_node)}
        return {k: walk(v, stats_node[k]) for k, v in bias_node.items()}

    return walk(bias_tree, stats)


def balance_metrics(stats: Any) -> dict[str, jax.Array]:
    """Worst-layer max/mean load, mean coefficient of variation, experts without tokens (all layers)."""
    loads = [v for p, v in jax.tree_util.tree_flatten_with_path(stats)[0]
             if stat_name(p) == "loads"]
    if not loads:
        return {}
    m = qb.load_metrics(jnp.concatenate([x.reshape(-1, x.shape[-1]) for x in loads]))  # each [layers]
    return {"load_max_mean": jnp.max(m["max_mean_ratio"]), "load_cv": jnp.mean(m["cv"]),
            "load_zero_experts": jnp.sum(m["zero_experts"])}
