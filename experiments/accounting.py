"""Full-scale accounting of Kimi K3 against Kimi K2 and Kimi-Linear-48B: parameters, FLOPs, cache memory.

Hypothesis (the K3 report's arithmetic, SPEC §1 and §11): K3 holds 2.78 T parameters of which a
token touches 104.2 B (≈ 96 % inactive, sparsity E/k = 896/16 = 56 against K2's 384/8 = 48), and
the hybrid stack (69 KDA + 24 MLA layers) keeps the decode cache of a 1 M-token sequence small:
KDA states are constant in length, only every fourth layer stores MLA latents.

What is computed (exact, CPU only, nothing allocated):
  - total and active parameters by component: ``k3jax.params.param_table`` on ``jax.eval_shape``
    of the real parameter tree (active = what one token touches, input embedding excluded);
  - training FLOPs per token at 4 K, 128 K and 1 M context: ``k3jax.train.metrics.flops_per_token``
    (6 · active matmul FLOPs plus the MLA softmax term, which grows with T, and the chunkwise KDA
    term, which does not);
  - decode-cache bytes per sequence at 128 K and 1 M tokens for three layouts of K3's 93 layers:
    as released (KDA state fp32 + MLA latent 576 values bf16 per token), MLA on every layer (the
    K2-style layout at K3's depth) and standard GQA on every layer (8 KV heads × 128, K and V in
    bf16, the Llama-3-70B shape, our choice of a reference point), plus K2 and Kimi-Linear as
    released. The formula is SPEC §2/§3; ``tests/experiments`` checks it against the bytes of
    ``k3jax.infer.cache.init_cache`` built with ``jax.eval_shape``.

Differs from a baseline: no training; the baseline rows are K2 and the alternative cache layouts.
Command (≈ 30 s on one CPU core):
    PYTHONPATH=. python experiments/accounting.py [--out experiments/results]
Writes experiments/results/accounting.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import common
from k3jax.config import LayerKind, ModelConfig, kimi_k2, kimi_k3, kimi_linear_48b
from k3jax.params import param_table
from k3jax.train.metrics import flops_per_token

NAME = "accounting"
MODELS = {"kimi_k3": kimi_k3, "kimi_k2": kimi_k2, "kimi_linear_48b": kimi_linear_48b}
CONTEXTS = (4096, 131072, 1048576)
MEMORY_CONTEXTS = (131072, 1048576)
GQA_KV_HEADS, GQA_HEAD_DIM, CACHE_ITEMSIZE, STATE_ITEMSIZE = 8, 128, 2, 4  # bf16 K/V and latents, fp32 state


def all_mla(cfg: ModelConfig) -> ModelConfig:
    """The same model with MLA on every layer (the K2-style layout) and room for a 1 M context."""
    return dataclasses.replace(cfg, name=f"{cfg.name}_all_mla", kda=None, mla_layers=None,
                               max_position=max(cfg.max_position, max(CONTEXTS)))


def cache_bytes(cfg: ModelConfig, tokens: int, layout: str = "released") -> int:
    """Decode-cache bytes of one sequence of ``tokens`` (SPEC §2 "Decode", §3).

    ``released``: per KDA layer the fp32 state ``H·K·V`` plus the last ``W−1`` conv inputs of q, k, v;
    per MLA layer ``tokens · (Rkv + dr)`` bf16 values. ``gqa``: every layer caches K and V of
    ``GQA_KV_HEADS × GQA_HEAD_DIM`` in bf16.
    """
    if layout == "gqa":
        return cfg.num_layers * 2 * GQA_KV_HEADS * GQA_HEAD_DIM * tokens * CACHE_ITEMSIZE
    if layout == "mla_every_layer":
        cfg = all_mla(cfg)
    elif layout != "released":
        raise ValueError(f"layout={layout!r} must be 'released', 'mla_every_layer' or 'gqa'")
    total = 0
    for kind in cfg.layer_kinds:
        if kind is LayerKind.MLA:
            total += tokens * cfg.mla.cache_width * CACHE_ITEMSIZE
        else:
            k = cfg.kda
            total += (k.num_heads * k.head_dim * k.head_dim + 3 * (k.conv_size - 1) * k.num_heads * k.head_dim) * STATE_ITEMSIZE
    return total


def parameters(cfg: ModelConfig) -> dict:
    """Totals, actives and the inactive fraction, by component (``k3jax.params.param_table``)."""
    rows = param_table(cfg)
    total, active = sum(t for _, t, _ in rows), sum(a for _, _, a in rows)
    return {"by_component": {c: {"total": t, "active": a} for c, t, a in rows},
            "total": total, "active": active, "inactive_fraction": 1 - active / total,
            "experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
            "sparsity": cfg.moe.num_experts / cfg.moe.top_k}


def flops(cfg: ModelConfig, active: int) -> dict[str, dict[str, float]]:
    """Training FLOPs per token (3 × forward) at each context: matmul and token-mixer terms."""
    out = {}
    for t in CONTEXTS:
        total = flops_per_token(cfg, t)
        out[str(t)] = {"total": total, "matmul": 6.0 * active, "mixer": total - 6.0 * active}
    return out


def memory() -> dict[str, dict[str, int]]:
    """Cache bytes per sequence for K3's three layouts and the other two models as released."""
    k3 = kimi_k3()
    rows = {"kimi_k3 (69 KDA + 24 MLA)": (k3, "released"), "K3 depth, MLA every layer (K2-style)": (k3, "mla_every_layer"),
            "K3 depth, GQA 8×128 every layer": (k3, "gqa"), "kimi_k2 (61 MLA)": (kimi_k2(), "released"),
            "kimi_linear_48b (20 KDA + 7 MLA)": (kimi_linear_48b(), "released")}
    return {label: {str(t): cache_bytes(cfg, t, layout) for t in MEMORY_CONTEXTS} for label, (cfg, layout) in rows.items()}


def compute() -> dict:
    models = {}
    for name, make in MODELS.items():
        cfg = make()
        p = parameters(cfg)
        models[name] = {"parameters": p, "flops_per_token": flops(cfg, p["active"]),
                        "layers": {"kda": cfg.layer_kinds.count(LayerKind.KDA), "mla": cfg.layer_kinds.count(LayerKind.MLA)}}
    return {"models": models, "memory_bytes_per_sequence": memory(), "contexts": CONTEXTS,
            "gqa_reference": {"kv_heads": GQA_KV_HEADS, "head_dim": GQA_HEAD_DIM}}


def _b(n: float) -> str:
    return f"{n / 1e9:,.2f} B"


def markdown(result: dict) -> str:
    models = result["models"]
    names = list(models)
    comps = list(models[names[0]]["parameters"]["by_component"])
    rows = [[c] + [f"{_b(models[n]['parameters']['by_component'][c]['total'])} / "
                   f"{_b(models[n]['parameters']['by_component'][c]['active'])}" for n in names] for c in comps]
    rows.append(["**total / active**"] + [f"**{_b(models[n]['parameters']['total'])} / {_b(models[n]['parameters']['active'])}**"
                                          for n in names])
    rows.append(["inactive fraction"] + [f"{100 * models[n]['parameters']['inactive_fraction']:.1f} %" for n in names])
    rows.append(["E / k"] + [f"{models[n]['parameters']['experts']}/{models[n]['parameters']['top_k']} = "
                             f"{models[n]['parameters']['sparsity']:.0f}" for n in names])
    text = "# Accounting: parameters, FLOPs, cache memory\n\nParameters (total / active per token):\n\n"
    text += common.markdown_table(["component"] + names, rows)
    f_rows = [[n] + [f"{models[n]['flops_per_token'][str(t)]['total'] / 1e9:,.1f} "
                     f"({100 * models[n]['flops_per_token'][str(t)]['mixer'] / models[n]['flops_per_token'][str(t)]['total']:.0f} % mixer)"
                     for t in result["contexts"]] for n in names]
    text += "\nTraining GFLOPs per token (6 · active matmul + attention/KDA terms; share of the token mixer):\n\n"
    text += common.markdown_table(["model"] + [f"T = {t:,}" for t in result["contexts"]], f_rows)
    mem = result["memory_bytes_per_sequence"]
    m_rows = [[label] + [f"{v / 2**30:,.2f} GiB" for v in by_t.values()] for label, by_t in mem.items()]
    text += "\nDecode cache per sequence (KDA state fp32, MLA latents and GQA K/V bf16):\n\n"
    text += common.markdown_table(["layout"] + [f"{int(t):,} tokens" for t in next(iter(mem.values()))], m_rows)
    return text


def plot(result: dict, path: Path) -> bool:
    models = result["models"]

    def draw(axes):
        ax = axes[0][0]
        comps = list(next(iter(models.values()))["parameters"]["by_component"])
        width = 0.8 / (2 * len(models))
        for i, (name, m) in enumerate(models.items()):
            by = m["parameters"]["by_component"]
            for j, kind in enumerate(("total", "active")):
                x = [c + (2 * i + j) * width - 0.4 for c in range(len(comps))]
                ax.bar(x, [max(by[c][kind], 1) / 1e9 for c in comps], width, align="edge", color=f"C{i}",
                       alpha=1.0 if kind == "active" else 0.35, label=f"{name} {kind}")
        ax.set_xticks(range(len(comps)), comps, rotation=30, ha="right", fontsize=7)
        ax.set(yscale="log", ylim=(1e-4, 5000), ylabel="parameters (B)", title="parameters by component (log)")
        ax.legend(fontsize=6)
        ax = axes[0][1]
        for label, by_t in result["memory_bytes_per_sequence"].items():
            ts = [int(t) for t in by_t]
            ax.plot(ts, [v / 2**30 for v in by_t.values()], "o-", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens in the sequence", ylabel="GiB per sequence",
               title="decode cache per sequence")
        ax.legend(fontsize=6)
        ax = axes[0][2]
        for name, m in models.items():
            ts = [int(t) for t in m["flops_per_token"]]
            ax.plot(ts, [v["total"] / 1e9 for v in m["flops_per_token"].values()], "o-", label=name)
        ax.set(xscale="log", yscale="log", xlabel="context T", ylabel="training GFLOPs per token",
               title="FLOPs per token vs context")
        ax.legend(fontsize=7)

    return common.save_figure(draw, path, ncols=3, size=(5.5, 4.2))


def main(argv=None) -> dict:
    args = common.parser(__doc__).parse_args(argv)
    return common.publish(args, NAME, compute, markdown, plot)

if __name__ == "__main__":
    main()
