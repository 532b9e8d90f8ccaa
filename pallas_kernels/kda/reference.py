"""Kimi Delta Attention (KDA) in pure JAX: the step recurrence and the chunkwise algorithm.

KDA (Kimi Linear, arXiv:2510.26692, Eq. 1) is a gated delta rule with a per-channel decay.
Per head, with a state ``S`` of shape ``[K, V]`` and, for each token t, in this order:

1. ``S <- Diag(exp(g_t)) S``                       (per-channel forgetting, ``g_t <= 0``)
2. ``S <- S + beta_t k_t (v_t - S^T k_t)^T``       (delta-rule write on the decayed state)
3. ``o_t = S^T (scale * q_t)``                     (inclusive read)

i.e. ``S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T``.

Packed documents (``segment_ids``): a change of id at token t zeroes the state before token t;
``initial_state`` is the state entering token 0 (so it only reaches the first segment).

The chunkwise form (SPEC §2, the paper's Eq. 6-9) is what kernels compute; this module keeps an
exact, gate-agnostic XLA version of it. Intra-chunk tiles of 16 rows are anchored causally (at
their first row) so cross-tile factors only ever see exponents <= 0; inside a tile every exponent
is masked *before* ``exp`` so no ``inf`` reaches a gradient; and the cumulative log-decay is never
reset at document boundaries (a reset cumsum makes ``exp`` overflow before the mask).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax import lax
from jaxtyping import Array, Float, Int

# Reference numerics: full-precision matmuls even where the backend defaults to bf16 passes.
_HIGHEST = lax.Precision.HIGHEST
_einsum = functools.partial(jnp.einsum, precision=_HIGHEST)


def compute_dtype(*arrays) -> jnp.dtype:
    """float64 when any input is float64 (x64 end-to-end tests), else float32; never downcast f64."""
    if any(a is not None and jnp.asarray(a).dtype == jnp.float64 for a in arrays):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def decay_gate(z: Float[Array, "B T H K"], a_log: Float[Array, "H"],
               lower_bound: float | None) -> Float[Array, "B T H K"]:
    """Per-channel log decay ``g <= 0`` from the gate pre-activation ``z`` (in ``z``'s wide dtype):
    K3's ``lower_bound · sigmoid(exp(A_log) · z)``, Kimi-Linear's ``−exp(A_log) · softplus(z)`` (None)."""
    rate = jnp.exp(a_log.astype(z.dtype))[:, None]  # [H, 1]
    if lower_bound is None:
        return -rate * jax.nn.softplus(z)
    return lower_bound * jax.nn.sigmoid(rate * z)


def segment_index(segment_ids: Int[Array, "B T"] | None, batch: int, length: int) -> Int[Array, "B T"]:
    """Running count of document starts: equal values <=> same document (ids may repeat later)."""
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    zero = jnp.zeros((batch, 1), jnp.int32)
    return jnp.concatenate([zero, jnp.cumsum(change, axis=1)], axis=1)


def _zero_state(batch: int, heads: int, k_dim: int, v_dim: int, initial_state, dtype):
    if initial_state is None:
        return jnp.zeros((batch, heads, k_dim, v_dim), dtype)
    return initial_state.astype(dtype)


def naive_recurrent_kda(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B H K V"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]:
    """The defining token-by-token recurrence (``lax.scan`` over T); returns ``(o, final_state)``.

    ``o`` has ``v.dtype``; the state is fp32 (float64 when any input is float64).
    q and k are used as given (the layer L2-normalises them).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    sidx = segment_index(segment_ids, B, T)
    reset = jnp.concatenate([jnp.zeros((B, 1), bool), sidx[:, 1:] != sidx[:, :-1]], axis=1)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs  # [B,H,K] x4 (v: [B,H,V]), [B,H], [B]
        S = jnp.where(r_t[:, None, None, None], jnp.zeros_like(S), S)
        S = S * jnp.exp(g_t)[..., None]
        err = v_t - _einsum("BHK,BHKV->BHV", k_t, S)
        S = S + _einsum("BHK,BHV->BHKV", b_t[..., None] * k_t, err)
        return S, _einsum("BHK,BHKV->BHV", scale * q_t, S)

    time_major = lambda x: jnp.moveaxis(x.astype(dt), 1, 0)
    xs = tuple(map(time_major, (q, k, v, g, beta))) + (jnp.moveaxis(reset, 1, 0),)
    S, o = lax.scan(step, _zero_state(B, H, K, V, initial_state, dt), xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


SUB_TILE = 16  # rows per intra-chunk tile (chunks that are not a multiple use one dense tile)
PREPARE_GROUP = 16  # chunks prepared at once


def _intra_scores(xs, k, G, sub: int):
    """``sum_c x_ic k_jc e^{G_ic - G_jc}`` for each x in ``xs``, valid for j <= i (0 above).

    Across tiles, rows of tile t meet earlier columns through one matmul anchored at t's first
    row a (``e^{G_i - G_a}``, ``e^{G_a - G_j}``: both exponents <= 0, any gate). Inside a tile the
    exponent is taken per pair, masked before ``exp`` (an overflowed ``inf`` would poison grads).
    """
    B, H, C, K = k.shape
    n = C // sub
    tiled = lambda x: x.reshape(B, H, n, sub, K)
    G_t = tiled(G)
    anchor = G_t[:, :, :, :1, :]  # [B,H,n,1,K]
    before = jnp.arange(C)[None, :] < (jnp.arange(n) * sub)[:, None]  # [n,C]
    m = before[:, :, None]
    k_out = jnp.where(m, k[:, :, None] * jnp.exp(jnp.where(m, anchor - G[:, :, None], 0.0)), 0.0)
    tri = jnp.tril(jnp.ones((sub, sub), bool))[:, :, None]
    decay = jnp.where(tri, jnp.exp(jnp.where(tri, G_t[..., :, None, :] - G_t[..., None, :, :], 0.0)), 0.0)
    place = jnp.eye(C, dtype=k.dtype).reshape(n, sub, C)  # tile column j -> chunk column t*sub+j
    scores = []
    for x in xs:
        cross = _einsum("BHNIK,BHNJK->BHNIJ", tiled(x) * jnp.exp(G_t - anchor), k_out)  # [B,H,n,sub,C]
        diag = _einsum("BHNIK,BHNJK,BHNIJK->BHNIJ", tiled(x), tiled(k), decay)  # [B,H,n,sub,sub]
        scores.append((cross + _einsum("BHNIJ,NJC->BHNIC", diag, place)).reshape(B, H, C, C))
    return scores


def _chunk_prepare(xs, *, scale: float, with_output: bool):
    """Everything of one chunk that does not depend on its entering state (SPEC §2, WY form).

    Inputs are head-major ``[B,H,C,·]``; ``sidx [B,C]`` is the document index and ``sprev [B]``
    the document index of the token before the chunk (the one the entering state belongs to).
    Returns ``(w, u, k_end, s_decay, q_dec, a_qk)`` (the last two None without output).
    """
    q, k, v, g, beta, sidx, sprev = xs
    C = g.shape[-2]
    G = jnp.cumsum(g, axis=-2)  # [B,H,C,K], inclusive, never reset at documents
    same = sidx[:, :, None] == sidx[:, None, :]  # [B,C,C]
    causal = same & jnp.tril(jnp.ones((C, C), bool))
    strict = causal & ~jnp.eye(C, dtype=bool)
    fresh = (sidx == sprev[:, None])[:, None, :, None]  # [B,1,C,1]: the state still reaches token i
    sub = SUB_TILE if C % SUB_TILE == 0 else C
    scores = _intra_scores((k, scale * q) if with_output else (k,), k, G, sub)
    a_kk = jnp.where(strict[:, None], beta[..., None] * scores[0], 0.0)
    eye = jnp.eye(C, dtype=a_kk.dtype)
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * k * jnp.exp(G) * fresh], axis=-1)
    sol = jsl.solve_triangular(eye + a_kk, rhs, lower=True, unit_diagonal=True)
    u, w = sol[..., : v.shape[-1]], sol[..., v.shape[-1] :]

    G_last = G[:, :, -1, :]  # [B,H,K]
    to_end = (sidx == sidx[:, -1:])[:, None, :, None]  # [B,1,C,1]: token j's write survives
    k_end = jnp.where(to_end, k * jnp.exp(G_last[:, :, None, :] - G), 0.0)
    s_decay = jnp.where(fresh[:, :, -1], jnp.exp(G_last), 0.0)  # [B,H,K]
    if not with_output:
        return w, u, k_end, s_decay, None, None
    q_dec = scale * q * jnp.exp(G) * fresh
    return w, u, k_end, s_decay, q_dec, jnp.where(causal[:, None], scores[1], 0.0)


def _chunk_carry(S, prepared):
    """The only sequential part: ``v_new = u - w S``, the output, and the next state."""
    w, u, k_end, s_decay, q_dec, a_qk = prepared
    v_new = u - _einsum("BHCK,BHKV->BHCV", w, S)  # [B,H,C,V]
    S_next = s_decay[..., None] * S + _einsum("BHCK,BHCV->BHKV", k_end, v_new)
    if q_dec is None:
        return S_next, None
    return S_next, _einsum("BHCK,BHKV->BHCV", q_dec, S) + _einsum("BHIJ,BHJV->BHIV", a_qk, v_new)


def _to_chunks(x, n_chunks: int, chunk: int, dt):
    """``[B,T,H,...] -> [N,B,H,C,...]`` (T already padded to N*C)."""
    B, _, H = x.shape[:3]
    x = x.astype(dt).reshape((B, n_chunks, chunk, H) + x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)


def _chunk_scan(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, with_output):
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    n = -(-T // chunk_size)
    pad = n * chunk_size - T
    sidx = segment_index(segment_ids, B, T)
    sprev = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), sidx[:, :-1]], axis=1)
    # Padded tokens (k = v = beta = g = 0, same document as the last token) leave S unchanged.
    padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    sidx = jnp.pad(sidx, [(0, 0), (0, pad)], mode="edge")
    xs = [_to_chunks(padded(x), n, chunk_size, dt) for x in (q if with_output else k, k, v, g)]
    b = padded(beta).astype(dt).reshape(B, n, chunk_size, H)
    xs.append(jnp.moveaxis(jnp.moveaxis(b, 3, 2), 1, 0))  # [N,B,H,C]
    xs.append(jnp.moveaxis(sidx.reshape(B, n, chunk_size), 1, 0))  # [N,B,C]
    xs.append(jnp.moveaxis(sprev[:, ::chunk_size], 1, 0))  # [N,B]

    # Chunks are prepared in parallel, PREPARE_GROUP at a time to bound the pairwise-decay memory,
    # and recomputed in the backward pass; only the state recursion is a scan.
    prepare = jax.checkpoint(functools.partial(_chunk_prepare, scale=scale, with_output=with_output))
    prepared = lax.map(prepare, tuple(xs), batch_size=min(n, PREPARE_GROUP))
    S, o = lax.scan(_chunk_carry, _zero_state(B, H, K, V, initial_state, dt), prepared)
    if with_output:
        o = jnp.moveaxis(o, 0, 1)  # [B,N,H,C,V]
        o = jnp.moveaxis(o, 2, 3).reshape(B, n * chunk_size, H, V)[:, :T]
        o = o.astype(v.dtype)
    return o, S


def chunk_kda_reference(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B H K V"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    chunk_size: int = 64,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]:
    """Chunkwise KDA (``lax.scan`` over chunks of ``chunk_size``; any T); returns ``(o, final_state)``.

    Equal to :func:`naive_recurrent_kda` up to rounding, for any gate ``g <= 0`` (bounded or not).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _chunk_scan(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        segment_ids=segment_ids, chunk_size=chunk_size, with_output=True,
    )


def chunk_kda_state(
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    *,
    initial_state: Float[Array, "B H K V"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    chunk_size: int = 64,
) -> Float[Array, "B H K V"]:
    """Final state only (no output): with ``initial_state=None`` this is the context-parallel
    state increment ``N`` of a shard, ``S_final = M @ S_0 + N``."""
    _, S = _chunk_scan(
        None, k, v, g, beta, scale=1.0, initial_state=initial_state,
        segment_ids=segment_ids, chunk_size=chunk_size, with_output=False,
    )
    return S


def kda_transition(
    k: Float[Array, "B T H K"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    segment_ids: Int[Array, "B T"] | None = None,
    *,
    chunk_size: int = 64,
) -> Float[Array, "B H K K"]:
    """``M = prod_t (I - beta_t k_t k_t^T) Diag(alpha_t)`` (later tokens on the left), so that
    ``S_final = M @ S_0 + N`` on the K axis. Computed as the state map with ``v = 0, S_0 = I``
    (SPEC §2, context parallel); any document start inside the span makes ``M = 0``."""
    B, T, H, K = k.shape
    dt = compute_dtype(k, g, beta)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=dt), (B, H, K, K))
    zeros_v = jnp.zeros((B, T, H, K), dt)
    return chunk_kda_state(
        k, zeros_v, g, beta, initial_state=eye, segment_ids=segment_ids, chunk_size=chunk_size
    )
