"""Pure-JAX definitions of the MoE dispatch ops: the fallback path and the test oracles.

Two independent formulations (SPEC §4):
1. sort + ``jax.lax.ragged_dot`` — what the XLA implementation runs;
2. a dense one-hot oracle that evaluates every expert on every row and masks, sharing no
   code with the sorted path, so agreement between them checks the permutation logic too.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from pallas_kernels.moe.activations import gated_activation


def accum_dtype(dtype) -> jnp.dtype:
    """Accumulation dtype: float32, or float64 when the inputs are float64."""
    return jnp.promote_types(dtype, jnp.float32)


def group_ids(group_sizes: Int[Array, "E"], m: int) -> Int[Array, "M"]:
    """Group of each row; rows beyond ``sum(group_sizes)`` get ``E`` (no group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(m), side="right").astype(jnp.int32)


def grouped_matmul_ragged(
    lhs: Float[Array, "M K"], rhs: Float[Array, "E K N"], group_sizes: Int[ArrayLike, "E"]
) -> Float[Array, "M N"]:
    """``jax.lax.ragged_dot`` accumulated in >= float32, cast back to ``lhs.dtype``."""
    out = jax.lax.ragged_dot(
        lhs, rhs, jnp.asarray(group_sizes, jnp.int32), preferred_element_type=accum_dtype(lhs.dtype)
    )
    return out.astype(lhs.dtype)


def grouped_matmul_sum_ragged(
    lhss: list[Float[Array, "M _"]], rhss: list[Float[Array, "E _ N"]], group_sizes: Int[ArrayLike, "E"]
) -> Float[Array, "M N"]:
    """``Σ_p lhss[p]·rhss[p][e]`` per group (the Pallas ``gmm_sum``): one ``grouped_matmul_ragged``
    of the operands concatenated along the contraction, so the sum runs in one accumulator."""
    return grouped_matmul_ragged(jnp.concatenate(lhss, axis=1), jnp.concatenate(rhss, axis=1), group_sizes)


def grouped_matmul_dense(
    lhs: Float[Array, "M K"], rhs: Float[Array, "E K N"], group_sizes: Int[ArrayLike, "E"]
) -> Float[Array, "M N"]:
    """One-hot oracle: every row times every expert, masked to its own group."""
    group_sizes = jnp.asarray(group_sizes)
    e = rhs.shape[0]
    dt = accum_dtype(lhs.dtype)
    onehot = jax.nn.one_hot(group_ids(group_sizes, lhs.shape[0]), e, dtype=dt)  # [M, E]
    every = jnp.einsum(
        "MK,EKN->MEN", lhs.astype(dt), rhs.astype(dt), precision=jax.lax.Precision.HIGHEST
    )
    return jnp.einsum("MEN,ME->MN", every, onehot).astype(lhs.dtype)


def dense_combine_weights(
    topk_ids: Int[Array, "T k"], topk_weights: Float[Array, "T k"], num_experts: int
) -> Float[Array, "T E"]:
    """Router weights scattered to a dense ``[T, E]`` table (repeated ids add up)."""
    onehot = jax.nn.one_hot(topk_ids, num_experts, dtype=topk_weights.dtype)  # [T, k, E]
    return jnp.einsum("Tke,Tk->Te", onehot, topk_weights)


def moe_ffn_dense(
    x: Float[Array, "T L"],
    topk_ids: Int[Array, "T k"],
    topk_weights: Float[Array, "T k"],
    w1: Float[Array, "E L F"],
    w3: Float[Array, "E L F"],
    w2: Float[Array, "E F L"],
    *,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> Float[Array, "T L"]:
    """Dense one-hot oracle of the routed expert FFN (SPEC §4), all in >= float32.

    ``out_t = Σ_e c_te · W2_e act(W1_e x_t, W3_e x_t)`` with ``c`` the dense combine weights;
    the router weight is applied after the down projection, as in the model.
    """
    dt = accum_dtype(x.dtype)
    hi = jax.lax.Precision.HIGHEST
    xf = x.astype(dt)
    g = jnp.einsum("TL,ELF->TEF", xf, w1.astype(dt), precision=hi)
    u = jnp.einsum("TL,ELF->TEF", xf, w3.astype(dt), precision=hi)
    a = gated_activation(g, u, activation, situ_beta, situ_linear_beta)
    y = jnp.einsum("TEF,EFL->TEL", a, w2.astype(dt), precision=hi)
    c = dense_combine_weights(topk_ids, topk_weights.astype(dt), w1.shape[0])
    return jnp.einsum("TEL,TE->TL", y, c).astype(x.dtype)
