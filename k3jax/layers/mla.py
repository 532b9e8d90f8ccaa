"""Gated multi-head latent attention (SPEC §3).

MLA: DeepSeek-V2 (arXiv:2405.04434) §2.1; output gate and NoPE: the K3 technical report.

1. Query: ``q = W_qb RMSNorm(W_qa x)`` (LoRA, norm eps 1e-6) or ``q = W_q x`` → ``[B,T,H,dn+dr]``.
2. Keys/values: ``[c, k_r] = W_kva x``; ``[k_nope, v] = W_kvb RMSNorm(c)`` per head (eps 1e-6);
   ``k = [k_nope, k_r]`` with the "rope" key ``k_r`` shared by all heads (MQA).
3. Positions: none (NoPE, K3 / Kimi-Linear) or RoPE+YaRN on the rope slices (K2).
4. Causal softmax attention in fp32 with scale ``(dn+dr)^-1/2``, masked across documents.
5. Optional output gate ``o ⊙ sigmoid(W_g x)`` per head·channel (K3), then ``W_o``.

Sows ``max_logit [H]`` (the largest scaled pre-softmax logit per head) for QK-Clip.
Decode (SPEC §3): with ``cache`` (any pytree with ``latent [B,Tmax,Rkv+dr]`` and ``lengths [B]``;
``k3jax.infer.cache``) the layer writes its new ``[RMSNorm(c), k_r]`` rows at each sequence's
length, attends over the compressed cache with ``W_kvb`` absorbed into the query and the output
(the cache is never expanded per head; on a CUDA GPU by a Pallas kernel, see
:func:`sharded_cached_attention`), and returns ``(y, new_cache)``. A call of many new tokens
(chunked prefill, ``PREFILL_FLASH_TOKENS``) runs the flash kernel instead where it can
(:func:`flash_cached_attention`). With the decode glue kernels (``ModelConfig.decode_glue_implementation``,
1-64 rows on one CUDA GPU) the absorbed query is one kernel from the packed input projections
(:meth:`MLA._absorbed_query`) and the attention's output, ``W_v`` and the gate one more (:meth:`MLA._gated_output`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from k3jax.config import ModelConfig
from k3jax.layers import attention as attention_lib
from k3jax.layers.gates import sigmoid_gate
from k3jax.layers.mixed_input import MixedInput, kernel_runs
from k3jax.layers import rope as rope_lib
from k3jax.layers.linear import einsum, packed_product, proj, split_packed
from k3jax.layers.norm import norm
from pallas_kernels.mla_attention import KEY_BLOCK, cached_attention, mla_attention
from pallas_kernels.mla_attention import kernel_gpu_decode, kernel_gpu_output, kernel_gpu_query
from sharding import current as parallel_context
from sharding.cp_attention import mla_attention_cp

# KEY_BLOCK (imported): cached keys per block of the decode attention's reference; the cache's length
# rounds up to it (``k3jax.infer.cache.cache_length``).
# Query rows per attention block when T is long: bounds the [B,H,C,T] logits in memory.
QUERY_BLOCK = 512
# New tokens per row from which a cached call (chunked prefill) runs the flash kernel where it can.
PREFILL_FLASH_TOKENS = 256
# Rows (B·T) from which decoding runs the query kernel (``_absorbed_query``): where the output kernel runs.
# On the H200 the query kernel alone did not pay (batch 1: 0.609 ms a small() step without it, 0.615 with;
# batch 64 with the output kernel off: 1.495 / 1.497 ms), the output kernel beside it did (batch 64
# 1.495 → 1.456 ms; benchmarks/RESULTS.md, stop 62). Since stop 66 the output kernel runs without it too.
QUERY_KERNEL_ROWS = kernel_gpu_output.GROUP


def attention_mask(segment_ids: Int[Array, "B T"] | None, batch: int, length: int) -> Bool[Array, "B T S"]:
    """Causal mask, restricted to the query's own document when ``segment_ids`` is given."""
    causal = jnp.tril(jnp.ones((length, length), bool))[None]  # [1, T, S]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, length, length))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal & same


def _attend_block(q, k, v, mask, scale):
    """Softmax attention of one query block in ``q``'s (wide) dtype; returns (out, max logit per head)."""
    logits = einsum("BTHK,BSHK->BHTS", q, k) * scale  # [B, H, C, S]
    masked = jnp.where(mask[:, None], logits, -jnp.inf)
    max_logit = jnp.max(masked, axis=(0, 2, 3))  # [H]
    p = jax.nn.softmax(masked, axis=-1)
    return einsum("BHTS,BSHV->BTHV", p, v), max_logit


def causal_attention(q: Float[Array, "B T H K"], k: Float[Array, "B S H K"], v: Float[Array, "B S H V"],
                     mask: Bool[Array, "B T S"], scale: float) -> tuple[Float[Array, "B T H V"], Float[Array, "H"]]:
    """Exact masked softmax attention; long sequences go query block by query block."""
    T = q.shape[1]
    if T <= QUERY_BLOCK or T % QUERY_BLOCK:
        return _attend_block(q, k, v, mask, scale)
    n = T // QUERY_BLOCK
    blocks = lambda a: jnp.moveaxis(a.reshape(a.shape[0], n, QUERY_BLOCK, *a.shape[2:]), 1, 0)
    # Rematerialised per block: the backward pass keeps q, k, v, not n blocks of [B,H,C,T] probabilities.
    attend = jax.checkpoint(lambda qm: _attend_block(qm[0], k, v, qm[1], scale))
    out, max_logit = jax.lax.map(attend, (blocks(q), blocks(mask)))
    out = jnp.moveaxis(out, 0, 1).reshape(q.shape[:3] + v.shape[-1:])
    return out, jnp.max(max_logit, axis=0)


def sharded_cached_attention(q_c: Float[Array, "B T H R"], q_r: Float[Array, "B T H K"],
                             latent: Float[Array, "B S C"], last: Int[Array, "B T"], scale: float, *,
                             implementation: str | None = None) -> Float[Array, "B T H R"]:
    """``cached_attention`` (decode's absorbed attention); on a mesh each device attends with its own
    rows and heads inside ``shard_map``: XLA cannot partition the decode kernel (a custom call: it
    would gather every row and head onto each device first), and no row or head reads another's. A
    mesh that splits the sequence leaves the call to XLA's partitioner; an axis that does not divide
    its dimension is left whole."""
    run = lambda q_c, q_r, latent, last: cached_attention(q_c, q_r, latent, last, scale,
                                                          implementation=implementation)
    ctx = parallel_context()
    if ctx is None or ctx.sequence_parallel:
        return run(q_c, q_r, latent, last)
    from sharding.init import _fit

    b, _, h, _ = _fit(ctx.spec("batch", None, "heads", None), q_c.shape, ctx.mesh)  # one entry a dimension
    P = jax.sharding.PartitionSpec
    rows, args = P(b, None, h, None), (q_c, q_r, latent, last)
    fn = jax.shard_map(run, mesh=ctx.mesh, in_specs=ctx.in_specs((rows, rows, P(b, None, None), P(b, None)), *args),
                       out_specs=rows, check_vma=False)
    return fn(*args)


def flash_cached_attention(q: Float[Array, "B T H Dq"], latent: Float[Array, "B S C"], kv_b: Float[Array, "R H Dkv"],
                           start: Int[Array, "B"], scale: float, *, nope_dim: int,
                           interpret: bool = False) -> Float[Array, "B T H V"]:
    """Chunked prefill's attention: row ``b``'s queries at positions ``start[b] + t`` over the cache.

    Every cached latent row is expanded into per-head ``[k_nope, v]`` once per chunk (one read of
    each cache page), then the flash kernel runs with each row's offset and skips the key blocks
    past its last query. Expanded, a query-key pair costs ``2·(dn+dr) + 2·dv`` FLOPs per head
    against ``2·(Rkv+dr) + 2·Rkv`` absorbed (640 vs 1152 for K3): over a chunk of thousands of
    queries the expansion (``2·Rkv·(dn+dv)`` per key and head) is the cheaper side. The operands
    are in ``latent``'s dtype (bf16), and so is the output, ``W_v`` applied.
    """
    R, dt = kv_b.shape[0], latent.dtype
    c = latent[..., :R]
    k_nope = einsum("BSR,RHK->BSHK", c, kv_b[..., :nope_dim].astype(dt))  # [B, S, H, dn]
    v = einsum("BSR,RHV->BSHV", c, kv_b[..., nope_dim:].astype(dt))  # [B, S, H, dv]
    o, _ = mla_attention(q[..., :nope_dim].astype(dt), q[..., nope_dim:].astype(dt), k_nope, latent[..., R:], v,
                         scale=scale, implementation="pallas", interpret=interpret, q_start=start)
    return o


def packed_inputs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """What ``decode_layout`` packs into one kernel (``linear.packed_products``): the query's first
    projection (``q_a``, or ``q_proj`` without a query LoRA) and ``kv_a``. Not the output gate
    ``g_proj``: its own product runs beside the attention, off the step's chain (``decode_layout``)."""
    m = cfg.mla
    query = [("q_a", (m.q_lora_rank,))] if m.q_lora_rank is not None else [("q_proj", (m.num_heads, m.qk_head_dim))]
    return query + [("kv_a", (m.kv_lora_rank + m.qk_rope_head_dim,))]


class MLA(nn.Module):
    """Gated MLA over pre-normed ``x``; ``segment_ids`` masks attention across documents."""

    cfg: ModelConfig

    def _query(self, x, split: bool = False, packed=None):
        """``q [B,T,H,dn+dr]``, or with ``split`` ``(q_nope, q_rope)`` as two products (`Proj`);
        ``packed``: ``packed_products``' outputs (decode layout)."""
        cfg, m = self.cfg, self.cfg.mla
        D, H, Dq = cfg.hidden, m.num_heads, m.qk_head_dim
        at = m.qk_nope_head_dim if split else None
        if m.q_lora_rank is None:
            if packed:
                return packed["q_proj"]
            return proj(cfg, "BTD,DHK->BTHK", (D, H, Dq), ("embed", "heads", "head_dim"), "q_proj")(x, split=at)
        R = m.q_lora_rank
        c = packed["q_a"] if packed else proj(cfg, "BTD,DR->BTR", (D, R), ("embed", "q_lora"), "q_a")(x)
        c = norm(cfg, "q_norm", eps=m.lora_norm_eps, axis="q_lora")(c)
        return proj(cfg, "BTR,RHK->BTHK", (R, H, Dq), ("q_lora", "heads", "head_dim"), "q_b")(c, split=at)

    def _keys_values(self, x, packed=None):
        """The normalised latent ``c [B,T,Rkv]``, the shared rope key ``[B,T,dr]`` and the ``kv_b``
        projection that expands ``c`` into per-head ``[k_nope, v]``."""
        cfg, m = self.cfg, self.cfg.mla
        D, H, R, dn, dv = cfg.hidden, m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
        ckr = packed["kv_a"] if packed else proj(
            cfg, "BTD,DR->BTR", (D, R + m.qk_rope_head_dim), ("embed", "kv_lora"), "kv_a")(x)
        c, k_rope = ckr[..., :R], ckr[..., R:]  # [B, T, Rkv], [B, T, dr]
        c = norm(cfg, "kv_norm", eps=m.lora_norm_eps, axis="kv_lora")(c)
        kv_b = proj(cfg, "BTR,RHK->BTHK", (R, H, dn + dv), ("kv_lora", "heads", "head_dim"), "kv_b")
        return c, k_rope, kv_b

    def _attend_cp(self, q, c, k_rope, kv_b, segment_ids, scale):
        """Sequence-parallel attention: shards all-gather only ``[c, k_rope]`` and run the flash
        kernel where ``use_flash`` says so, else the XLA attention (sharding/cp_attention.py)."""
        m, dt = self.cfg.mla, self.cfg.compute_dtype
        flash = attention_lib.use_flash(m.attention_implementation, dt, q.shape[0], q.shape[2])
        kv_b(c[:, :0])  # creates or binds the kernel; each shard expands the gathered latent itself
        kernel = nn.unbox(kv_b.variables["params"]["kernel"]).astype(dt)
        return mla_attention_cp(q, c.astype(dt), k_rope[:, :, 0], kernel, scale=scale, nope_dim=m.qk_nope_head_dim,
                                segment_ids=segment_ids, implementation="pallas" if flash else "xla")

    def _attend_cached(self, q_nope, q_rope, c, k_rope, kv_b, cache, scale, absorbed: bool = False, gate=None):
        """Absorbed decode attention (SPEC §3): write ``[c, k_r]`` at each row's length, then
        ``q_nope W_k`` attends over the latent and ``W_v`` expands only the weighted latent
        (``absorbed``: ``q_nope`` is ``q_nope W_k`` already, :meth:`_absorbed_query`); ``gate``: the
        output gate's logits, applied here."""
        m, wide = self.cfg.mla, self.cfg.fp32_dtype
        B, T = q_nope.shape[:2]
        dn = m.qk_nope_head_dim
        latent = cache.latent
        rows = jnp.concatenate([c, k_rope[:, :, 0]], axis=-1).astype(latent.dtype)  # [B, T, Rkv+dr]
        pos = cache.lengths[:, None] + jnp.arange(T)[None]  # [B, T]
        latent = latent.at[jnp.arange(B)[:, None], pos].set(rows, mode="drop")  # past Tmax: dropped
        kv_b(c[:, :0])  # creates or binds the kernel
        kernel = nn.unbox(kv_b.variables["params"]["kernel"])  # [Rkv, H, dn+dv]
        dt = self.cfg.compute_dtype
        gated = lambda o: o if gate is None else sigmoid_gate(o, gate, wide, dt)
        if not absorbed and T >= PREFILL_FLASH_TOKENS and parallel_context() is None and attention_lib.use_flash(
                m.attention_implementation, dt, B, m.num_heads):
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            o = flash_cached_attention(q, latent, kernel.astype(dt), cache.lengths, scale, nope_dim=dn)
            return gated(o), cache.replace(latent=latent)
        # W_k absorbed into the query
        q_c = q_nope if absorbed else einsum("BTHK,RHK->BTHR", q_nope, kernel[..., :dn].astype(wide))
        o = self._gated_output(q_c, q_rope, latent, pos, scale, kernel, gate)
        if o is None:
            o_c = sharded_cached_attention(q_c, q_rope, latent, pos, scale,  # [B, T, H, Rkv]
                                           implementation=m.attention_implementation)
            o = gated(einsum("BTHR,RHV->BTHV", o_c, kernel[..., dn:].astype(wide)))  # W_v absorbed into the output
        return o, cache.replace(latent=latent)

    def _gated_output(self, q_c, q_rope, latent, pos, scale, kernel, gate):
        """Where the glue kernels run (``kernel_runs``) and the decode attention kernel takes the call: its key
        splits merged, ``W_v`` and the output gate in one kernel (``kernel_gpu_output.gated_output``, where XLA
        runs five at batch 64), in the compute dtype; else None."""
        m = self.cfg.mla
        if (gate is None or m.attention_implementation == "xla" or not kernel_runs(self.cfg.decode_glue_implementation)
                or not kernel_gpu_decode.accepts(q_c, q_rope, latent, pos)):
            return None
        shape = kernel_gpu_decode.split_shape(q_c, latent)
        f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        kw = dict(nope_dim=m.qk_nope_head_dim)
        if not kernel_gpu_output.accepts(f32(shape), f32(shape[:3]), f32(shape[:3]), kernel, gate, **kw):
            return None
        splits = kernel_gpu_decode.split_outputs(q_c, q_rope, latent, pos, scale=float(scale))
        return kernel_gpu_output.gated_output(*splits, kernel, gate, **kw)

    def _absorbed_query(self, y):
        """Decoding a few tokens on one device with the glue kernels (``kernel_runs``): ``(q_nope W_k,
        q_rope)`` in float32 by one kernel from the packed input projections ``y [B, T, N]``
        (``kernel_gpu_query.absorbed_query``: the norm, ``q_b`` and ``W_k``, where XLA runs three
        kernels on the step's chain); None where it does not apply (no query LoRA or packed kernel, fewer
        than ``QUERY_KERNEL_ROWS`` or more than ``MAX_ROWS`` rows, widths the kernel does not take)."""
        cfg, m = self.cfg, self.cfg.mla
        if y is None or m.q_lora_rank is None or not kernel_runs(cfg.decode_glue_implementation):
            return None
        B, T = y.shape[:2]
        if B * T < QUERY_KERNEL_ROWS:
            return None
        stored = lambda name: nn.meta.unbox(self.get_variable("params", name))
        # q_b in the compute dtype, as its projection reads it; W_k as stored, widened in the kernel
        args = (y.reshape(B * T, -1), stored("q_norm")["scale"], stored("q_b")["kernel"].astype(cfg.compute_dtype),
                stored("kv_b")["kernel"])
        kw = dict(offset=0, nope_dim=m.qk_nope_head_dim)  # q_a: packed_inputs' first output
        if not kernel_gpu_query.accepts(*args, **kw):
            return None
        q_c, q_rope = kernel_gpu_query.absorbed_query(*args, **kw, eps=m.lora_norm_eps)
        return q_c.reshape(B, T, *q_c.shape[1:]), q_rope.reshape(B, T, *q_rope.shape[1:])

    def _attend_full(self, q_nope, q_rope, c, kv_b, k_rope, segment_ids, scale, flash: bool):
        """Training / prefill attention: the flash kernel (``flash``, k3jax/layers/attention.py), else
        the XLA attention above; ``kv_b(c) = [k_nope, v]`` per head, ``k_rope [B,T,1,dr]`` shared."""
        cfg, m = self.cfg, self.cfg.mla
        B, T, H = q_nope.shape[:3]
        dn, wide, dt = m.qk_nope_head_dim, cfg.fp32_dtype, cfg.compute_dtype
        if flash:
            # The kernel takes q, k and v apart, so they are separate products (`Proj(split=)`): a
            # packed output would be copied into the parts forward and joined back backward (K3's
            # MLA layer at 8 K tokens: 2.5 GB of copies a step, benchmarks/RESULTS.md stop 39).
            k_nope, v = kv_b(c, split=dn)
            return attention_lib.flash_attention(q_nope.astype(dt), q_rope.astype(dt), k_nope.astype(dt),
                                                 k_rope[:, :, 0].astype(dt), v.astype(dt), segment_ids, scale=scale)
        kv = kv_b(c)
        k_nope, v = kv[..., :dn], kv[..., dn:]  # [B, T, H, dn], [B, T, H, dv]
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope.astype(wide), jnp.broadcast_to(k_rope, (B, T, H, k_rope.shape[-1]))], axis=-1)
        return causal_attention(q, k, v.astype(wide), attention_mask(segment_ids, B, T), scale)

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"] | MixedInput, segment_ids: Int[Array, "B T"] | None = None, *,
                 cache=None, valid: Bool[Array, "B T"] | None = None):
        cfg, m = self.cfg, self.cfg.mla
        B, T, D = x.shape
        H, dn, dv, wide = m.num_heads, m.qk_nope_head_dim, m.v_head_dim, cfg.fp32_dtype
        ctx = parallel_context()
        full = cache is None and not (ctx is not None and ctx.sequence_parallel)
        flash = full and attention_lib.use_flash(m.attention_implementation, cfg.compute_dtype, B, H)
        y = packed_product(self, x, cfg.compute_dtype)  # decode_layout's tree: the input projections, packed
        packed = None if y is None else split_packed(y, packed_inputs(cfg))
        absorbed = None if cache is None else self._absorbed_query(y)
        if flash:
            q_nope, q_rope = (q.astype(wide) for q in self._query(x, split=True))
        elif absorbed is not None:
            q_nope, q_rope = absorbed  # q_nope W_k [B, T, H, Rkv], q_rope [B, T, H, dr]
        else:
            q = self._query(x, packed=packed).astype(wide)  # [B, T, H, dn+dr]
            q_nope, q_rope = q[..., :dn], q[..., dn:]
        c, k_rope, kv_b = self._keys_values(x, packed)
        k_rope = k_rope.astype(wide)[:, :, None, :]  # [B, T, 1, dr]
        if m.rope is not None:
            # RoPE is relative: within a document only differences matter
            positions = jnp.arange(T)[None] if cache is None else cache.lengths[:, None] + jnp.arange(T)[None]
            q_rope = rope_lib.apply_rope(q_rope, positions, m.rope, wide)
            k_rope = rope_lib.apply_rope(k_rope, positions, m.rope, wide)
        scale = m.qk_head_dim ** -0.5 * rope_lib.softmax_scale_factor(m.rope)
        gate = proj(cfg, "BTD,DHV->BTHV", (D, H, dv), ("embed", "heads", "head_dim"), "g_proj")(x) if m.output_gate \
            else None
        if cache is not None:  # the gate applied inside
            o, cache = self._attend_cached(q_nope, q_rope, c, k_rope, kv_b, cache, scale, absorbed is not None, gate)
            num_new = T if valid is None else jnp.sum(valid, axis=1, dtype=cache.lengths.dtype)
            cache = cache.replace(lengths=cache.lengths + num_new)
        elif not full:  # context parallel
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            o, max_logit = self._attend_cp(q, c, k_rope, kv_b, segment_ids, scale)
        else:
            o, max_logit = self._attend_full(q_nope, q_rope, c, kv_b, k_rope, segment_ids, scale, flash)
        if cache is None and not self.is_initializing():
            self.sow("stats", "max_logit", max_logit)
        if cache is None and gate is not None:
            o = sigmoid_gate(o, gate, wide, cfg.compute_dtype)
        o = o.astype(cfg.compute_dtype)  # [B, T, H, dv]
        y = proj(cfg, "BTHV,HVD->BTD", (H, dv, D), ("heads", "head_dim", "embed"), "o_proj")(o)
        return y if cache is None else (y, cache)
