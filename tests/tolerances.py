"""Tolerances, set once per dtype and comparison kind; never loosened to make a test pass.

All comparisons use the relative RMSE ``||a - b|| / ||b||`` unless a name says otherwise.
"""

# float64 runs against float64 references (oracle, chunked vs recurrent).
F64_RTOL = 1e-8
# float32 runs with full-precision matmuls against float32/float64 references.
F32_RTOL = 1e-5
# Kernels with bf16 inputs against fp32 references.
BF16_FWD_RTOL = 5e-3
BF16_GRAD_RTOL = 1e-2
# A whole model in bf16 compute against the same weights in float32 (logits; tiny() at T=4096 measured 1.7e-2).
BF16_MODEL_RTOL = 5e-2
# Muon updates with Newton–Schulz stored in bf16 against the same updates in fp32 (whole-tree relative RMSE;
# the toy tree over 10 gradient seeds measured 0.023-0.027 with k3jax's bf16 iteration, whose coefficients stay
# fp32; optax's own bf16 iteration rounds them to bf16 and measured 0.061-0.065; bf16 and fp32 NS both sit
# 0.19 from the exact polar factor).
BF16_NS_RTOL = 0.05
# Golden Kimi-Linear (PyTorch float32 vs ours float32).
KIMI_LINEAR_RTOL = 1e-4
# Golden float32 runs (full-precision matmuls) against a reference's own float32 outputs: at most this
# many times that reference's float32-vs-float64 gap (both float32 runs sit about one gap from the
# exact result, so they differ by up to ~2 gaps).
F32_GOLDEN_GAP_FACTOR = 3.0
# Parameter init with batched random draws against the jitted flax init: the same draws, but XLA folds the
# initialiser's scale into the unbatched draw, so values may differ by one float32 rounding.
INIT_MAX_ULP = 1
# The learning-rate schedule compiled with a traced horizon against the same schedule run eagerly: XLA may
# fuse the cosine's division differently; absolute, as a fraction of the peak LR (two float32 roundings of
# the cosine term, whose cancellation near the end makes ulps of the small final values meaningless).
SCHEDULE_PEAK_ATOL = 2.5e-7


def rel_rmse(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 numpy; 0 when both are zero."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    denom = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / denom) if denom > 0 else float(num)
