"""Golden Kimi-Linear reference: a tiny random ``KimiLinearForCausalLM`` (transformers, PyTorch, CPU, fp32).

Run in the reference venv (``tests/reference/env.py: reference_python()``):
    python tests/reference/make_kimi_linear.py OUT_DIR
Writes ``OUT_DIR/hf/`` (``save_pretrained``: config.json + safetensors in the original Kimi-Linear key
layout) and ``OUT_DIR/reference.npz`` (``input_ids [B, T]``, fp32 ``logits [B, T, V]``, router margins).

The model exercises what K3 does not: the softplus KDA decay gate (no lower bound), the low-rank
KDA output gate, MLA without q LoRA and without output gate, the plain pre-norm residual, SwiGLU,
full-width (non-latent) MoE with a non-zero ``e_score_correction_bias`` and routed scaling 2.446.

KDA runs transformers' pure-torch path (no fla installed); the script checks its chunked form
against transformers' step-by-step recurrent form (fla's ``naive_recurrent_kda`` order) on the
same weights. Parameters are redrawn at O(1) scales (transformers' init uses std 0.02, which would
leave every nonlinearity in its linear range), and the token batch is redrawn until every
(MoE layer, token) top-k choice has a margin >= MIN_MARGIN, far above float32 noise, so a port's
routing cannot flip.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM
from transformers.models.kimi_linear import modeling_kimi_linear as mkl

SEED = 20260131
BATCH, SEQ = 2, 29  # T not a multiple of the chunk (64), so padding is exercised
MIN_MARGIN = 2e-3
CHUNK_VS_RECURRENT_RTOL = 1e-5

CONFIG = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_token=2,
    num_shared_experts=1, routed_scaling_factor=2.446, hidden_act="silu", rms_norm_eps=1e-5,
    first_k_dense_replace=1, tie_word_embeddings=False, bos_token_id=248, eos_token_id=250, pad_token_id=255,
    # 3 KDA + 2 MLA (1-based 4, 5: the hybrid rule with the final layer MLA).
    linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4, 5], "num_heads": 4, "head_dim": 16,
                        "short_conv_kernel_size": 4},
)


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Redraw every tensor at a scale that keeps activations O(1)."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus, as fla initialises it
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(torch.empty_like(p).uniform_(0.6, 1.4, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # Linear [.., out, in] and expert stacks: unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def router_margins(model, input_ids) -> float:
    """Smallest gap between the k-th and (k+1)-th biased choice score over all MoE layers and tokens."""
    margins = []

    def hook(module, args, _out):
        x = args[0].reshape(-1, module.hidden_dim).float()
        choice = torch.sigmoid(x @ module.weight.float().T) + module.e_score_correction_bias
        top = torch.topk(choice, module.top_k + 1, dim=-1).values
        margins.append((top[:, -2] - top[:, -1]).min().item())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, mkl.KimiLinearTopkRouter)]
    model(input_ids=input_ids)
    for h in handles:
        h.remove()
    return min(margins)


def recurrent_logits(model, input_ids) -> torch.Tensor:
    """The logits with KDA computed step by step (transformers' recurrent form) instead of chunked."""

    def recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        return mkl.recurrent_kimi_delta_attention(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                                  output_final_state=output_final_state,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    chunked = mkl.chunk_kimi_delta_attention
    mkl.chunk_kimi_delta_attention = recurrent
    try:
        return model(input_ids=input_ids).logits
    finally:
        mkl.chunk_kimi_delta_attention = chunked


def main(out_dir: str) -> None:
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    config = KimiLinearConfig(**CONFIG)
    model = KimiLinearForCausalLM(config).float().eval()
    randomize(model, gen)
    with torch.no_grad():
        for attempt in range(50):
            input_ids = torch.randint(0, config.vocab_size - 8, (BATCH, SEQ), generator=gen)
            input_ids[:, 0] = config.bos_token_id
            margin = router_margins(model, input_ids)
            if margin >= MIN_MARGIN:
                break
        else:
            raise RuntimeError(f"no token batch with router margin >= {MIN_MARGIN} in 50 draws")
        logits = model(input_ids=input_ids).logits.float()
        logits_rec = recurrent_logits(model, input_ids).float()
    gap = (torch.linalg.norm(logits - logits_rec) / torch.linalg.norm(logits_rec)).item()
    if not 0 < gap <= CHUNK_VS_RECURRENT_RTOL:  # 0 would mean the swap did not take effect
        raise RuntimeError(f"transformers' chunked KDA disagrees with its recurrent form: rel RMSE {gap:.3g}")
    hf_dir = os.path.join(out_dir, "hf")
    model.save_pretrained(hf_dir)
    np.savez(os.path.join(out_dir, "reference.npz"), input_ids=input_ids.numpy(), logits=logits.numpy(),
             min_router_margin=np.float64(margin))
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump({"seed": SEED, "token_batch_attempt": attempt, "min_router_margin": margin,
                   "chunk_vs_recurrent_rel_rmse": gap, "torch": torch.__version__,
                   "transformers": transformers.__version__}, f, indent=2)
    print(f"wrote {out_dir}: margin {margin:.3g}, chunk vs recurrent {gap:.3g}, "
          f"logits rms {logits.pow(2).mean().sqrt().item():.3g}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT_DIR")
    main(sys.argv[1])
