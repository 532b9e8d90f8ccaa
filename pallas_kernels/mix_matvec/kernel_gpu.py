"""A batch-1 decode projection that computes its own input: the AttnRes mix and the RMSNorm, per program.

At batch 1 every layer input of ``small()`` is ``x = RMSNorm(mix(stream))``, the mix a softmax over the
stored block sums and the partial sum weighted by their projections on a learned direction
(``k3jax.layers.attn_res``). XLA runs it as three dependent kernels before each consumer: the sources'
row reductions (fused with the residual add), the softmax weights of the ``[N]`` logits, then the
projection, a Triton fusion whose programs recompute the mix and the norm from those weights. On the
H200 the first two cost 2.4 + 1.1 µs at each of a step's 24 mixing points (benchmarks/RESULTS.md, stop
49), each one more launch on the step's critical path.

Here one kernel does all of it: program ``j`` owns ``block_n`` output columns of ``W`` (stored output
axis first, ``[N, D]``, as ``decode_layout`` stores the projections), reads its first ``block_d`` columns
of them at once (their trip from HBM overlaps the prologue), with the norm's scale and the gate where they
are one step (:meth:`_Prologue.preload`: every load before the first reduction's barriers), and, for each
of the ``T`` tokens,

1. reduces every source over ``D`` (``block_d`` columns a step): ``v·d`` and ``Σ v²``, so the logits
   ``(v·d)/rms(v)`` and their softmax ``p`` (skipped for a lone source, whose mix is itself) — the
   partial sum taken with the ``addends`` just added to it (the mixer's output; the MoE's routed and
   shared outputs), each ``+`` rounded as the layers round it, so the kernel need not wait for the add;
2. sums ``h = Σ p_n v_n`` in float32, rounds it to the compute dtype (``AttnResMix``'s output) and
   reduces ``Σ h²`` for the norm;
3. streams its ``[block_n, D]`` rows of each weight, recomputing ``h`` a step at a time, normalising and
   scaling it (rounded to the compute dtype, as ``RMSNorm`` returns it), and accumulates ``x · W`` in
   float32.

The sources are a few KB; every program reading them again is cheaper than two launches. With two
weights the products are an MLP's gate and up and the program applies the gated activation (both
products rounded to the projection dtype first, the activation in float32, rounded to the compute
dtype), so the shared experts' input and activation are one kernel; ``epilogue="sigmoid"`` gives the
router's scores. A lone source may instead be normed per group of columns with an output gate (KDA's
per-head output norm before ``o_proj``). Rounding points are the reference's
(``reference.mixed_matvec_reference``); only float32 summation orders differ. For a few tokens only
(``MAX_TOKENS``): each program holds every token's accumulators, and at larger batches the weight rows
would be re-read per token block. ``interpret=True`` runs it in the CPU interpreter.

:func:`mixed_norm` is the prologue alone — the normed input written out, one program a token, for any
token count — where the projections are XLA's matmuls (batch 64: one kernel per mixing point where XLA
runs three). In ``small()``'s decode step (``k3jax.layers.mixed_input``) the two take batch 1 from 277.7
to 224.7 kernels and its longest chain of dependent kernels from 200 to 120, batch 64's chain from 277 to
232 (device-less H200 compile, ``benchmarks/decode_kernels.py``; benchmarks/RESULTS.md, stop 53). On an
H100 the projections of ``small()`` run 1.16-1.41x XLA's mix, norm and product, and with KDA's fused step
the batch-1 step 6 % faster; at K3's widths every program re-reading the sources loses (0.53-0.96x), so
the model takes the matvec only where :func:`pays` (stop 54).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.validate import passes
from pallas_kernels.triton_sums import sums

MAX_TOKENS = 4  # 8 tokens spill registers (ptxas, sm_90a: 255 and 40 spilled at 1024 wide)
# Every program re-reads a token's sources, addends and gate for its prologue: past this many bytes of them
# a token, XLA's kernels win (H100, bench_mix_matvec.py: small()'s <= 10 KB 1.16-1.41x XLA; K3's 9 x 7168
# (129 KB) 0.53-0.74x, its 12288-wide o_proj input with its gate (48 KB) 0.96x; RESULTS.md, stop 54).
MAX_PROLOGUE_BYTES = 16 * 1024
EPILOGUES = (None, "sigmoid")  # applied to the float32 product (the router's scores)
_FLOATS = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MatvecTiles:
    """``block_n`` output columns a program (at most; the largest power of two dividing N below it),
    ``block_d`` input columns a step (at most; the largest power of two >= 16 dividing D below it)."""

    # columns of 16-bit weights (halved for two weights, an MLP's gate and up, and for float32 ones). 8 gives
    # small()'s 1024-wide products 128 programs: its batch-1 step 0.707 ms on an H100 against 0.755 at 16
    # and 0.725 at 4 (RESULTS.md, stop 57)
    block_n: int = 8
    block_d: int = 1024
    num_warps: int = 4


def takes_tokens(T: int) -> bool:
    """Whether the kernel takes ``T`` tokens: a power of two up to ``MAX_TOKENS``."""
    return 1 <= T <= MAX_TOKENS and not T & (T - 1)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    return min(n & -n, 1 << (cap.bit_length() - 1))


def _block_d(D: int, group: int, tiles: MatvecTiles) -> int:
    """Input columns a step: ``tiles.block_d`` or the largest power of two dividing ``D`` below it, whole
    groups of a per-group norm (``group < D``) a step."""
    bd = _pow2_divisor(D, tiles.block_d)
    return max(bd, group) if group != D else bd


def check_inputs(sources: tuple, mix: tuple, scale, weights: tuple, tiles: MatvecTiles = MatvecTiles(),
                 epilogue: str | None = None, addends: tuple = (), gate=None) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    T, D = check_norm_inputs(sources, mix, scale, tiles, addends, gate)
    if not takes_tokens(T):
        raise ValueError(f"the mixed matvec kernel takes T (sources' rows) a power of two <= {MAX_TOKENS}, got {T}")
    if len(weights) not in (1, 2):
        raise ValueError(f"weights must hold one [N, D] weight or a gate and an up weight, got {len(weights)}")
    for n, w in enumerate(weights):
        if w.ndim != 2 or w.shape[1] != D or w.shape != weights[0].shape:
            raise ValueError(f"weights[{n}] must be [N, D] with D={D} (all alike), got {w.shape}")
        if jnp.dtype(w.dtype) not in _FLOATS:
            raise ValueError(f"the mixed matvec kernel takes bfloat16, float16 or float32 inputs, got {w.dtype}")
    if epilogue not in EPILOGUES or (epilogue is not None and len(weights) != 1):
        raise ValueError(f"epilogue must be one of {EPILOGUES} (with one weight), got {epilogue!r} with "
                         f"{len(weights)} weights")


def check_norm_inputs(sources: tuple, mix: tuple, scale, tiles: MatvecTiles = MatvecTiles(), addends: tuple = (),
                      gate=None) -> tuple[int, int]:
    """:func:`check_inputs` of the input alone (``mixed_norm``'s, any number of tokens): ``(T, D)``."""
    if not sources:
        raise ValueError("sources must hold at least the partial sum, got none")
    T, D = sources[0].shape if sources[0].ndim == 2 else (None, None)
    if T is None:
        raise ValueError(f"sources must be [T, D] arrays, got shape {sources[0].shape}")
    for n, v in enumerate(sources):
        if v.shape != (T, D):
            raise ValueError(f"sources[{n}].shape must equal sources[0].shape={(T, D)}, got {v.shape}")
    for n, a in enumerate(addends):
        if a.shape != (T, D) or a.dtype != sources[-1].dtype:
            raise ValueError(f"addends[{n}] must match the partial sum sources[-1] ({(T, D)}, {sources[-1].dtype}), "
                             f"got {a.shape}, {a.dtype}")
    if len(mix) != (2 if len(sources) > 1 else 0):
        raise ValueError(f"mix must be the (query, key norm) pair of the mix of {len(sources)} sources "
                         f"(none for one source), got {len(mix)} arrays")
    for name, a in (("mix[0]", mix[0] if mix else None), ("mix[1]", mix[-1] if mix else None)):
        if a is not None and a.shape != (D,):
            raise ValueError(f"{name}.shape must be (D,)=({D},), got {a.shape}")
    group = scale.shape[0] if scale.ndim == 1 else 0
    if scale.ndim != 1 or D % group or (group != D and (len(sources) > 1 or addends)):
        raise ValueError(f"scale must be [D]=[{D}] (one norm over the row) or, for one source and no addends, [G] "
                         f"with G dividing D (a norm per group of G, as per head), got {scale.shape}")
    if group != D and (group < 16 or group & (group - 1)):
        raise ValueError(f"a norm per group of {group} needs the group a power of two >= 16")
    if gate is not None and gate.shape != (T, D):
        raise ValueError(f"gate must be [T, D]={(T, D)} (the output gate's logits), got {gate.shape}")
    if _pow2_divisor(D, tiles.block_d) < 16:
        raise ValueError(f"D={D} must be a multiple of 16 for the mixed matvec kernel")
    for a in (*sources, *mix, scale, *(() if gate is None else (gate,))):
        if jnp.dtype(a.dtype) not in _FLOATS:
            raise ValueError(f"the mixed matvec kernel takes bfloat16, float16 or float32 inputs, got {a.dtype}")
    return T, D


def accepts(sources, mix, scale, weights, tiles: MatvecTiles = MatvecTiles(), epilogue: str | None = None,
            addends: tuple = (), gate=None) -> bool:
    """Whether :func:`check_inputs` takes these inputs."""
    return passes(check_inputs, sources, mix, scale, weights, tiles, epilogue, addends, gate)


def pays(sources, addends: tuple = (), gate=None) -> bool:
    """Whether a token's prologue inputs are small enough for the matvec to beat XLA's kernels
    (``MAX_PROLOGUE_BYTES``; ``mixed_norm``, one program a token, reads them once and needs no such rule)."""
    row = lambda a: a.shape[-1] * jnp.dtype(a.dtype).itemsize
    return sum(row(a) for a in (*sources, *addends, *(() if gate is None else (gate,)))) <= MAX_PROLOGUE_BYTES


def norm_accepts(sources, mix, scale, addends: tuple = (), gate=None, tiles: MatvecTiles = MatvecTiles()) -> bool:
    """Whether :func:`check_norm_inputs` (``mixed_norm``'s) takes these inputs."""
    return passes(check_norm_inputs, sources, mix, scale, tiles, addends, gate)


class _Prologue:
    """A program's view of the kernel's input ``x``: the sources (the partial sum with its addends), the
    mix weights and the norm, a ``block_d``-column step at a time, on the kernel's refs."""

    def __init__(self, src_refs, add_refs, mix_refs, scale_ref, gate_refs, *, block_d: int, mix_eps: float,
                 norm_eps: float, dtype):
        self.src, self.add, self.mix, self.scale_ref, self.gate = src_refs, add_refs, mix_refs, scale_ref, gate_refs
        self.block_d, self.mix_eps, self.norm_eps, self.dtype = block_d, mix_eps, norm_eps, dtype
        self.D = src_refs[0].shape[1]
        self.steps = self.D // block_d
        self.grouped = scale_ref.shape[0] != self.D  # a norm per group of scale's columns (per head)
        self.scale, self.gates = None, []

    def preload(self, tokens) -> None:
        """Read the norm's scale and the tokens' gates now where they are one step (the whole row, or a per-head
        scale): Triton issues a load where the program reads it, so read inside :meth:`x` they would wait
        behind the prologue's reductions — one more round trip to L2 on the kernel's chain."""
        if self.grouped or self.steps == 1:
            self.scale = self.scale_ref[...].astype(_F32)
        if self.gate and self.steps == 1:
            self.gates = [self.gate[0][t, self.cols(0)].astype(_F32) for t in tokens]

    def cols(self, c):
        bd = self.block_d
        return pl.ds(c * bd if isinstance(c, int) else pl.multiple_of(c * bd, bd), bd)

    def source(self, n, t, c):
        """Source ``n`` over step ``c`` of token ``t`` (the partial sum plus the addends' sum, rounded as each
        ``+`` of the partial's dtype rounds)."""
        v = self.src[n][t, self.cols(c)]
        if n != len(self.src) - 1 or not self.add:
            return v.astype(_F32)
        y = self.add[0][t, self.cols(c)].astype(_F32)
        for a in self.add[1:]:
            y = _rounded(y + a[t, self.cols(c)].astype(_F32), v.dtype)
        return _rounded(v.astype(_F32) + y, v.dtype)

    def h(self, t, p, c):
        """``h`` over step ``c`` of token ``t``: the mix rounded to the compute dtype, or the lone source."""
        if len(self.src) == 1:
            return self.source(0, t, c)
        return _rounded(sum(pn * self.source(n, t, c) for n, pn in enumerate(p)), self.dtype)

    def terms(self, t):
        """Token ``t``'s mix weights ``p`` and the norm's ``1/rms`` (None when normed per group, a step at a
        time): passes over the sources' steps."""
        n_src, D = len(self.src), self.D
        p = [jnp.float32(1.0)]
        if n_src > 1:
            def reduce_sources(c, acc):
                d = self.mix[1][self.cols(c)].astype(_F32) * self.mix[0][self.cols(c)].astype(_F32)  # γ ⊙ w
                vs = [self.source(n, t, c) for n in range(n_src)]
                total = sums(*(v * d for v in vs), *(v * v for v in vs))  # one reduction for all of them
                return (tuple(a + s for a, s in zip(acc[0], total[:n_src])),
                        tuple(a + s for a, s in zip(acc[1], total[n_src:])))

            zeros = (jnp.float32(0.0),) * n_src
            dots, squares = jax.lax.fori_loop(0, self.steps, reduce_sources, (zeros, zeros))
            logits = [s * jax.lax.rsqrt(q / D + self.mix_eps) for s, q in zip(dots, squares)]
            top = functools.reduce(jnp.maximum, logits)
            e = [jnp.exp(lg - top) for lg in logits]
            total = functools.reduce(jnp.add, e)
            p = [x / total for x in e]
        if self.grouped:
            return p, None
        hh = jax.lax.fori_loop(0, self.steps, lambda c, a: a + jnp.sum(jnp.square(self.h(t, p, c))), jnp.float32(0.0))
        return p, jax.lax.rsqrt(hh / D + self.norm_eps)

    def x(self, t, p, inv, c, slot=None):
        """``x`` over step ``c`` of token ``t`` (``slot``: its place in :meth:`preload`'s ``tokens``, by default
        ``t``), normed (and gated), rounded to the compute dtype (in float32)."""
        h, bd = self.h(t, p, c), self.block_d
        scale = self.scale if self.scale is not None else self.scale_ref[self.cols(c)].astype(_F32)
        if self.grouped:  # the step's groups of G columns, each normed on its own
            G = scale.shape[0]
            hg = h.reshape(bd // G, G)
            x = (hg * jax.lax.rsqrt(jnp.mean(hg * hg, axis=1, keepdims=True) + self.norm_eps) * scale[None, :])
            x = x.reshape(bd)
        else:
            x = h * inv * scale
        if self.gate:
            gate = self.gates[t if slot is None else slot] if self.gates else self.gate[0][t, self.cols(c)].astype(_F32)
            x = x * jax.nn.sigmoid(gate)
        return _rounded(x, self.dtype)


def _rounded(a, dt):
    return a.astype(dt).astype(_F32)


def _split_refs(refs, n_src: int, n_add: int, n_gate: int):
    """The kernels' refs: sources, addends, mix pair, scale, gate, then the rest."""
    n_mix = 2 if n_src > 1 else 0
    src_refs, add_refs, refs = refs[:n_src], refs[n_src:n_src + n_add], refs[n_src + n_add:]
    mix_refs, scale_ref, refs = refs[:n_mix], refs[n_mix], refs[n_mix + 1:]
    return src_refs, add_refs, mix_refs, scale_ref, refs[:n_gate], refs[n_gate:]


def _kernel(*refs, n_src: int, n_add: int, n_gate: int, n_w: int, block_d: int, mix_eps: float, norm_eps: float,
            dtype, proj_dtype, out_dtype, activation, epilogue):
    src_refs, add_refs, mix_refs, scale_ref, gate_refs, refs = _split_refs(refs, n_src, n_add, n_gate)
    w_refs, out_ref = refs[:-1], refs[-1]
    pro = _Prologue(src_refs, add_refs, mix_refs, scale_ref, gate_refs, block_d=block_d, mix_eps=mix_eps,
                    norm_eps=norm_eps, dtype=dtype)
    T = src_refs[0].shape[0]
    # the first step's weight rows, read before the prologue so that their trip from HBM overlaps it
    # (read where the products use them, they wait behind the prologue's reductions)
    first = [w_ref[:, pro.cols(0)] for w_ref in w_refs]
    pro.preload(range(T))
    terms = [pro.terms(t) for t in range(T)]  # per token: the mix weights and the norm's 1/rms

    def products(c, acc, ws=None):
        ws = [w_ref[:, pro.cols(c)] for w_ref in w_refs] if ws is None else ws  # [block_n, block_d] each
        ws = [_rounded(w, proj_dtype) for w in ws]
        xs = [_rounded(pro.x(t, p, inv, c), proj_dtype) for t, (p, inv) in enumerate(terms)]
        # every token's products with every weight in one reduction, in acc's order (token-major)
        return tuple(a + s for a, s in zip(acc, sums(*(x[None, :] * w for x in xs for w in ws), axis=1)))

    bn = out_ref.shape[-1]
    acc = products(0, (jnp.zeros((bn,), _F32),) * (T * n_w), first)
    acc = jax.lax.fori_loop(1, pro.steps, products, acc)
    for t in range(T):
        if n_w == 1:
            y = acc[t].astype(out_dtype)
            out_ref[t, :] = y if epilogue is None else jax.nn.sigmoid(y.astype(_F32)).astype(out_dtype)
        else:
            g, u = (_rounded(a, proj_dtype) for a in acc[2 * t:2 * t + 2])
            out_ref[t, :] = gated_activation(g, u, **activation).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("mix_eps", "norm_eps", "dtype", "proj_dtype", "out_dtype", "activation",
                                             "epilogue", "tiles", "interpret"))
def mixed_matvec(sources: tuple, mix: tuple, scale: Float[Array, "G"], weights: tuple, *, mix_eps: float,
                 norm_eps: float, dtype, proj_dtype, out_dtype=None, activation: tuple | None = None,
                 epilogue: str | None = None, addends: tuple = (),
                 gate: Float[Array, "T D"] | None = None, tiles: MatvecTiles = MatvecTiles(),
                 interpret: bool = False) -> Float[Array, "T N"]:
    """``reference.mixed_matvec_reference`` (same arguments, same rounding points) as one kernel.

    ``sources``: ``[T, D]`` each, the stored block sums then the partial sum (alone: no mix, the norm
    only); ``mix``: the mix's pseudo-query ``w`` and key-norm weight ``γ`` (its direction ``γ ⊙ w``,
    multiplied here in float32), ``()`` for one source; ``scale``: the RMSNorm weight, ``[D]`` (the norm
    over the row) or, for one source, ``[G]`` (a norm per group of ``G`` columns: KDA's per-head output
    norm); ``gate``: the norm's output gate logits ``[T, D]`` (``× sigmoid(gate)`` in float32); ``weights``:
    ``(W,)`` or ``(W_gate, W_up)``, ``[N, D]`` each; ``activation``: with two weights,
    ``gated_activation``'s keywords as a tuple of pairs (hashable); ``epilogue``: ``"sigmoid"`` of the
    product (one weight); ``addends``: ``[T, D]`` terms summed and added to the partial sum first (each
    ``+`` rounded to its dtype: ``ResidualStream.add`` of a layer's output, the MoE's the sum of its
    routed and shared experts'), so the kernel need not wait for the residual add. Returns ``[T, N]`` in
    ``out_dtype`` (default: ``proj_dtype``; the activation's result: ``dtype``).
    """
    check_inputs(sources, mix, scale, weights, tiles, epilogue, addends, gate)
    adds, gates = tuple(addends), tuple(g for g in (gate,) if g is not None)
    T, D = sources[0].shape
    N = weights[0].shape[0]
    # block_n 16-bit columns' bytes a program (fewer columns for two weights or float32 ones)
    bn = _pow2_divisor(N, max(1, tiles.block_n * 2 // (len(weights) * jnp.dtype(proj_dtype).itemsize)))
    bd = _block_d(D, scale.shape[0], tiles)
    out_dtype = (dtype if len(weights) == 2 else proj_dtype) if out_dtype is None else out_dtype
    whole = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)
    kernel = functools.partial(_kernel, n_src=len(sources), n_add=len(adds), n_gate=len(gates), n_w=len(weights),
                               block_d=bd, mix_eps=mix_eps, norm_eps=norm_eps, dtype=jnp.dtype(dtype),
                               proj_dtype=jnp.dtype(proj_dtype), out_dtype=jnp.dtype(out_dtype),
                               activation=dict(activation or ()), epilogue=epilogue)
    return pl.pallas_call(
        kernel, grid=(N // bn,),
        in_specs=[whole(v) for v in (*sources, *adds, *mix, scale, *gates)]
        + [pl.BlockSpec((bn, D), lambda j: (j, 0))] * len(weights),
        out_specs=pl.BlockSpec((T, bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((T, N), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="mixed_matvec",
    )(*sources, *adds, *mix, scale, *gates, *weights)


def _norm_kernel(*refs, n_src: int, n_add: int, n_gate: int, block_d: int, mix_eps: float, norm_eps: float, dtype):
    src_refs, add_refs, mix_refs, scale_ref, gate_refs, (out_ref,) = _split_refs(refs, n_src, n_add, n_gate)
    pro = _Prologue(src_refs, add_refs, mix_refs, scale_ref, gate_refs, block_d=block_d, mix_eps=mix_eps,
                    norm_eps=norm_eps, dtype=dtype)
    t = pl.program_id(0)
    pro.preload([t])
    p, inv = pro.terms(t)

    def write(c, carry):
        out_ref[pro.cols(c)] = pro.x(t, p, inv, c, slot=0).astype(out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, pro.steps, write, 0)


@functools.partial(jax.jit, static_argnames=("mix_eps", "norm_eps", "dtype", "tiles", "interpret"))
def mixed_norm(sources: tuple, mix: tuple, scale: Float[Array, "G"], *, mix_eps: float, norm_eps: float, dtype,
               addends: tuple = (), gate: Float[Array, "T D"] | None = None, tiles: MatvecTiles = MatvecTiles(),
               interpret: bool = False) -> Float[Array, "T D"]:
    """The input ``x`` of :func:`mixed_matvec` itself, ``[T, D]`` in ``dtype``, for any number of tokens: one
    program a token (``reference.mixed_input``). Where the matvec does not take the tokens (a batch of 64:
    XLA's matmuls), the layer input is one kernel instead of XLA's three (the sources' reductions, the
    softmax weights, the mix and the norm written out), and it adds the stream's last terms itself."""
    T, D = check_norm_inputs(sources, mix, scale, tiles, addends, gate)
    gates = tuple(g for g in (gate,) if g is not None)
    bd = _block_d(D, scale.shape[0], tiles)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)
    kernel = functools.partial(_norm_kernel, n_src=len(sources), n_add=len(addends), n_gate=len(gates), block_d=bd,
                               mix_eps=mix_eps, norm_eps=norm_eps, dtype=jnp.dtype(dtype))
    return pl.pallas_call(
        kernel, grid=(T,),
        in_specs=[whole(v) for v in (*sources, *addends, *mix, scale, *gates)],
        out_specs=pl.BlockSpec((None, D), lambda t: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((T, D), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="mixed_norm",
    )(*sources, *addends, *mix, scale, *gates)


__all__ = ["EPILOGUES", "MAX_PROLOGUE_BYTES", "MAX_TOKENS", "MatvecTiles", "accepts", "check_inputs",
           "check_norm_inputs", "mixed_matvec", "mixed_norm", "norm_accepts", "pays", "takes_tokens"]
