"""What the ablations look at inside the model, recorded by intercepting Flax module methods.

``flax.linen.intercept_methods`` sees every module call of one forward pass; each probe reads the
arguments or results it needs and returns small summaries (no model code changes):

- ``hidden``: RMS of the input of every layer's ``attn_norm`` — the residual stream (plain
  pre-norm) or the AttnRes mix (K3) that enters the layer — per layer, averaged over tokens.
- ``experts``: inside the routed experts of every MoE layer, recomputed from the expert input
  ``u`` and the chosen ids, in fp32: the largest |gate pre-activation|, |up pre-activation| and |act(g, u)|
  (SiTU-GLU bounds the last by β1·β2 = 100; SwiGLU does not).
- ``decay``: every KDA layer's log decay ``g`` (fp32), summed over 16-token tiles: the most
  negative cumulative log decay of a tile, its 99th percentile, the fraction of (tile, channel)
  whose anchor-relative factor ``e^{−G}`` overflows bf16/fp32 (|G| > 88.7), and the fraction of
  per-token decays ``e^g`` that round to exactly 1 in bf16 (SPEC §2: never store them in bf16).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from k3jax.layers.routing import route
from k3jax.layout import to_per_layer, unrolled
from k3jax.model import Transformer
from pallas_kernels.moe.activations import gated_activation

TILE = 16
BF16_EXP_LIMIT = math.log(float(jnp.finfo(jnp.bfloat16).max))  # 88.72: e^x overflows bf16 above it
EXPERT_TOKENS = 512  # tokens whose routed-expert activations are recomputed
PROBES = ("hidden", "experts", "decay")


def _hidden(x) -> jax.Array:
    x = x.astype(jnp.float32)
    return jnp.mean(jnp.sqrt(jnp.mean(x * x, axis=-1)))


def _experts(module, u, scores, bias) -> dict[str, jax.Array]:
    """The routed experts' gate, up and activation extremes on the first ``EXPERT_TOKENS`` tokens
    (``MoE._experts``' arguments: the expert input and the router's scores and bias)."""
    cfg = module.cfg
    p = module.variables["params"]
    ids = route(scores[:EXPERT_TOKENS], bias, cfg.moe.top_k, renormalize=cfg.moe.renormalize,
                scaling=cfg.moe.routed_scaling_factor, with_stats=False)[0]  # [T, k]
    u = u[:EXPERT_TOKENS].astype(jnp.float32)  # [T, L]
    g = jnp.einsum("TL,TkLF->TkF", u, p["w1"].astype(jnp.float32)[ids])
    up = jnp.einsum("TL,TkLF->TkF", u, p["w3"].astype(jnp.float32)[ids])
    act = gated_activation(g, up, cfg.mlp.activation, cfg.mlp.situ_beta, cfg.mlp.situ_linear_beta)
    return {"max_gate": jnp.max(jnp.abs(g)), "max_up": jnp.max(jnp.abs(up)), "max_act": jnp.max(jnp.abs(act))}


def tile_log_decay(g: Float[Array, "B T H K"], tile: int = TILE) -> Float[Array, "B N H K"]:
    """Cumulative log decay over each ``tile``-token tile: ``Σ_tile g`` per channel ``[B, T/tile, H, K]``."""
    B, T = g.shape[:2]
    T = T - T % tile
    return jnp.sum(g[:, :T].reshape((B, T // tile, tile) + g.shape[2:]).astype(jnp.float32), axis=2)


def _decay(g) -> dict[str, jax.Array]:
    G = tile_log_decay(g)
    alpha = jnp.exp(g.astype(jnp.float32))
    return {"min_tile_log_decay": jnp.min(G), "p01_tile_log_decay": jnp.quantile(G, 0.01),
            "overflow_fraction": jnp.mean((-G > BF16_EXP_LIMIT).astype(jnp.float32)),
            "bf16_decay_is_one": jnp.mean((alpha.astype(jnp.bfloat16) == 1).astype(jnp.float32)),
            "min_log_decay": jnp.min(g)}


def make_probe(kinds: tuple[str, ...] = PROBES):
    """``probe(trainer) -> jit(params, balance, tokens) -> {kind: {layer: summaries}}`` for ``runs.train``."""
    bad = [k for k in kinds if k not in PROBES]
    if bad:
        raise ValueError(f"kinds={kinds} must be a subset of {PROBES}")

    def build(trainer):
        # The probes keep values from inside each layer's call, so the model runs unrolled: inside the
        # scanned stack they would be tracers of the scan's body.
        cfg = trainer.model.cfg
        model = Transformer(unrolled(cfg))

        def run(params, balance, tokens):
            variables = to_per_layer({"params": params, "balance": balance}, cfg)
            found = {k: {} for k in kinds}

            def intercept(next_fun, args, kwargs, ctx):
                out = next_fun(*args, **kwargs)
                layer, name, method = ctx.module.path[0] if ctx.module.path else None, ctx.module.name, ctx.method_name
                if "hidden" in kinds and name == "attn_norm" and method == "__call__":
                    found["hidden"][layer] = _hidden(args[0])
                elif "experts" in kinds and method == "_experts":
                    found["experts"][layer] = _experts(ctx.module, *args[:3])
                elif "decay" in kinds and method == "_log_decay":
                    found["decay"][layer] = _decay(out)
                return out

            with nn.intercept_methods(intercept):
                model.apply(variables, tokens, method="features", mutable=["stats"])
            return found

        return jax.jit(run)

    return build


def by_layer(records: list[dict], kind: str, key: str | None = None) -> tuple[list[int], list[str], list[list[float]]]:
    """``(steps, layer names in depth order, values[step][layer])`` of one probe summary."""
    layers = sorted(records[0][kind], key=lambda n: int(n.split("_")[-1])) if records else []
    values = [[r[kind][l] if key is None else r[kind][l][key] for l in layers] for r in records]
    return [r["step"] for r in records], layers, values
