"""KDA short convs (steps 1-2 of the layer) on one GPU: the formulation before issue 7 vs the candidates.

What is timed: ``q, k, v = SiLU(conv(x_q)), ...`` with q and k L2-normalised per head, from the bf16
projections ``[B, T, H, K]`` and fp32 conv weights ``[W, H, K]`` to the bf16 kernel inputs, forward
alone and forward+backward (``jax.vjp`` w.r.t. the inputs and the conv weights with a bf16 cotangent,
i.e. the gradient of ``sum(out * cotangent)``, returning the outputs too so the forward stays alive),
with and without ``segment_ids`` (packed documents).
Each time is the median over ``--bursts`` bursts of ``--calls`` back-to-back calls of one jitted
function. GB/s counts the bytes a two-pass design must move: forward reads x and writes the outputs
(bf16), backward reads x and the cotangent and writes dx (bf16): 4 and 4 + 6 bytes per element per
tensor. Before timing, every variant is checked against "before" with fp32 and with bf16 inputs and
outputs: ``max|a - b| / max|b|`` of the outputs and of every gradient (fp32: rounding, ~1e-7).

Variants:
- ``before``: the formulation before issue 7, copied here so it survives the change: per tensor a
  concatenate of the zero history, W shifted multiply-adds each with a ``same_doc`` mask from
  ``segment_index``, SiLU, then the L2 norm; autodiff. XLA fused the q/k convs, SiLU and norms into
  one multi-output reduction (``input_convert_multiply_reduce_fusion``, 1.9 ms per layer).
- ``repo``: what ``k3jax.layers.kda`` runs now (``short_conv_qkv``: one ``custom_vjp`` op for q, k, v
  with one shared document mask; on a CUDA GPU the Pallas-Triton kernels of
  ``pallas_kernels/kda/kernel_gpu_conv.py`` (with documents too since stop 40), else stages fenced by
  ``optimization_barrier``).
- ``repo_xla`` / ``repo_pallas``: the same op with ``implementation`` forced to ``"xla"`` (the stages)
  or ``"pallas"`` (the kernels, with documents too).
- ``repo_per_tensor``: the same op called once per tensor (three ops instead of one).
- ``pad_mask``: pad instead of concatenate and one shared ``[B, T, W-1]`` mask; plain autodiff.
- ``split``: ``pad_mask`` with the fp32 conv+SiLU output fenced off (``optimization_barrier``)
  from the L2 norm's reduction; plain autodiff.

On the H200, from the repo root: ``PYTHONPATH=$PWD python3 benchmarks/bench_kda_conv.py --out $OUT/conv.json``
(``--fusions`` also lists each compiled variant's kernels). On a CPU: ``--small`` (tiny shapes).
Without a GPU, ``--aot-h200`` compiles every variant for an H200 (XLA's GPU pipeline, no device:
needs the ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` wheels of the pinned jax version) and lists
the kernels XLA emits, with the bytes of their operands and outputs; nothing is run or timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.kda import QK_L2_EPS, short_conv_qkv
from k3jax.plan.topology import H200_TARGET
from k3jax.layers.norm import l2_normalize
from pallas_kernels.kda.conv import same_document_taps, short_convs
from pallas_kernels.kda.reference import segment_index

HBM_GBPS = 4800.0  # H200 datasheet


# --- variants: (xs [B,T,H,K] x3, ws [W,H,K] x3, segment_ids, out_dtype) -> (q, k, v) ------------


def _before_conv(x, weight, segment_ids):
    """``causal_conv1d`` as it was before issue 7 (no initial state), the output only."""
    B, T, C = x.shape
    W = weight.shape[1]
    dt = jnp.promote_types(jnp.float32, jnp.promote_types(x.dtype, weight.dtype))
    x_ext = jnp.concatenate([jnp.zeros((B, W - 1, C), dt), x.astype(dt)], axis=1)
    sidx = segment_index(segment_ids, B, T)
    sidx_ext = jnp.concatenate([jnp.zeros((B, W - 1), sidx.dtype), sidx], axis=1)
    w = weight.astype(dt)
    y = jnp.zeros((B, T, C), dt)
    for j in range(W):
        same_doc = (sidx_ext[:, j : j + T] == sidx)[..., None]
        y = y + jnp.where(same_doc, x_ext[:, j : j + T] * w[:, j], 0.0)
    return y


def before(xs, ws, segment_ids, out_dtype):
    """The layer before issue 7: ``_short_conv`` per tensor, then ``l2_normalize`` on q and k."""
    B, T, H, K = xs[0].shape
    wide = jnp.promote_types(jnp.float32, xs[0].dtype)
    out = []
    for i, (x, w) in enumerate(zip(xs, ws)):
        w = w.reshape(w.shape[0], H * K).T.astype(wide)
        y = jax.nn.silu(_before_conv(x.reshape(B, T, H * K).astype(wide), w, segment_ids)).reshape(B, T, H, K)
        if i < 2:  # l2_normalize as it was
            y = y * jax.lax.rsqrt(jnp.sum(jnp.square(y), axis=-1, keepdims=True) + QK_L2_EPS)
        out.append(y.astype(out_dtype))
    return tuple(out)


def repo(xs, ws, segment_ids, out_dtype):
    wide = jnp.promote_types(jnp.float32, xs[0].dtype)
    return short_conv_qkv(xs, ws, segment_ids, wide_dtype=wide, out_dtype=out_dtype)


def _layout(xs, ws, segment_ids):
    """``(B, T, H, K, W, keep, wide)``: the shapes, the shared document mask and the wide dtype."""
    B, T, H, K = xs[0].shape
    W = ws[0].shape[0]
    return B, T, H, K, W, same_document_taps(segment_ids, W), jnp.promote_types(jnp.float32, xs[0].dtype)


def _repo_with(implementation, xs, ws, segment_ids, out_dtype):
    """``repo`` with ``short_convs(implementation=...)`` forced: ``"xla"`` its staged XLA formulation,
    ``"pallas"`` the Pallas-Triton kernels of ``pallas_kernels/kda/kernel_gpu_conv.py`` (which ``repo``
    takes on a CUDA GPU)."""
    B, T, H, K, W, keep, wide = _layout(xs, ws, segment_ids)
    flat = tuple(x.reshape(B, T, H * K) for x in xs)
    ws = tuple(w.reshape(W, H * K).T.astype(wide) for w in ws)
    ys = short_convs(flat, ws, keep, l2_groups=(K, K, None), eps=QK_L2_EPS, out_dtype=out_dtype,
                     implementation=implementation)
    return tuple(y.reshape(B, T, H, K) for y in ys)


def repo_per_tensor(xs, ws, segment_ids, out_dtype):
    B, T, H, K, W, keep, wide = _layout(xs, ws, segment_ids)
    out = []
    for i, (x, w) in enumerate(zip(xs, ws)):
        (y,) = short_convs((x.reshape(B, T, H * K),), (w.reshape(W, H * K).T.astype(wide),), keep,
                           l2_groups=(K if i < 2 else None,), eps=QK_L2_EPS, out_dtype=out_dtype)
        out.append(y.reshape(B, T, H, K))
    return tuple(out)


def _pad_conv_silu(x, w, keep):
    """SiLU of the conv with ``jnp.pad`` for the history and the shared ``[B, T, W-1]`` mask."""
    W, T = w.shape[1], x.shape[1]
    x_ext = jnp.pad(x.astype(w.dtype), ((0, 0), (W - 1, 0), (0, 0)))
    y = None
    for j in range(W):
        term = x_ext[:, j : j + T] * w[:, j]
        if keep is not None and j < W - 1:
            term = jnp.where(keep[..., j : j + 1], term, 0.0)
        y = term if y is None else y + term
    return jax.nn.silu(y)


def _plain(xs, ws, segment_ids, out_dtype, fence):
    B, T, H, K, W, keep, wide = _layout(xs, ws, segment_ids)
    out = []
    for i, (x, w) in enumerate(zip(xs, ws)):
        y = _pad_conv_silu(x.reshape(B, T, H * K), w.reshape(W, H * K).T.astype(wide), keep)
        if i < 2 and fence:
            y = jax.lax.optimization_barrier(y)
        y = y.reshape(B, T, H, K)
        out.append((l2_normalize(y, QK_L2_EPS) if i < 2 else y).astype(out_dtype))
    return tuple(out)


VARIANTS = {
    "before": before,
    "repo": repo,
    "repo_xla": functools.partial(_repo_with, "xla"),
    "repo_pallas": functools.partial(_repo_with, "pallas"),
    "repo_per_tensor": repo_per_tensor,
    "pad_mask": lambda *a: _plain(*a, fence=False),
    "split": lambda *a: _plain(*a, fence=True),
}


# --- inputs, functions, checks -----------------------------------------------------------------


def make_inputs(seed, B, T, H, K, W, dtype, docs_per_row=6):
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    xs = tuple(jax.random.normal(ks[i], (B, T, H, K), jnp.float32).astype(dtype) for i in range(3))
    ws = tuple(jax.random.uniform(ks[3 + i], (W, H, K), jnp.float32, -0.5, 0.5) for i in range(3))
    cts = tuple(jax.random.normal(ks[6 + i], (B, T, H, K), jnp.float32).astype(dtype) for i in range(3))
    rng = np.random.default_rng(seed)
    starts = np.zeros((B, T), np.int32)
    for b in range(B):  # documents of random lengths, some shorter than W
        starts[b, rng.choice(np.arange(1, T), size=min(T - 1, docs_per_row - 1), replace=False)] = 1
    seg = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
    return xs, ws, cts, seg


@functools.lru_cache(maxsize=None)
def functions(name, out_dtype, with_segments):
    """Jitted ``fwd(xs, ws, seg) -> outs`` and ``fwdbwd(xs, ws, seg, cts) -> (outs, (dxs, dws))``: the
    gradient of ``sum(outs * cts)``, as a VJP that also returns the outputs (as in the layer, where
    they are the kernel's inputs), so no loss reduction gets fused into the variant's kernels."""
    def fwd(xs, ws, seg):
        return VARIANTS[name](xs, ws, seg if with_segments else None, out_dtype)

    def fwdbwd(xs, ws, seg, cts):
        outs, vjp = jax.vjp(lambda xs, ws: fwd(xs, ws, seg), xs, ws)
        return outs, vjp(tuple(c.astype(o.dtype) for c, o in zip(cts, outs)))

    return jax.jit(fwd), jax.jit(fwdbwd)


def max_abs_errors(name, with_segments, xs, ws, cts, seg, out_dtype):
    """``(outputs, grads)``: the largest ``max|a - b| / max|b|`` against "before" over q, k, v (and
    over their six gradients)."""
    got = [functions(n, out_dtype, with_segments) for n in (name, "before")]
    outs = [f(xs, ws, seg) for f, _ in got]
    grads = [g(xs, ws, seg, cts)[1] for _, g in got]
    f32 = lambda a: a.astype(jnp.float32)
    err = lambda a, b: max(float(jnp.max(jnp.abs(f32(x) - f32(y))) / jnp.max(jnp.abs(f32(y))))
                           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return err(outs[0], outs[1]), err(grads[0], grads[1])


def median_ms(fn, args, bursts, calls):
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def fusion_summary(fn, args, top=6):
    """Kernels of the compiled function: ``(count, [(name, MB of outputs, shape)])`` largest first."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "f64": 8, "f16": 2}
    rows = []
    for m in re.finditer(r"\n\s*(?:ROOT )?%(\S+) = (.*?) (fusion|custom-call)\(", entry):
        mb = sum(sizes.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                 for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(2))) / 1e6
        rows.append((m.group(1), mb, m.group(2)[:80]))
    return len(rows), sorted(rows, key=lambda r: -r[1])[:top]


def aot_h200(names, shape):
    """Compile each variant for a device-less H200 and print its kernels (``--aot-h200``)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    on_gpu = jax.sharding.SingleDeviceSharding(topo.devices[0])
    B, T, H, K, W = shape
    spec = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=on_gpu)
    xs = (spec((B, T, H, K), jnp.bfloat16),) * 3
    ws, seg = (spec((W, H, K), jnp.float32),) * 3, spec((B, T), jnp.int32)
    for with_segments in (False, True):
        for name in names:
            fwd, fwdbwd = functions(name, jnp.bfloat16, with_segments)
            for label, fn, a in (("fwd", fwd, (xs, ws, seg)), ("fwd+bwd", fwdbwd, (xs, ws, seg, xs))):
                rows = _kernels(fn.trace(*a).lower(lowering_platforms=("cuda",)).compile().as_text())
                big = [r for r in rows if r[1] + r[2] > 1e6]
                print(f"{name} seg={'yes' if with_segments else 'no'} {label}: {len(rows)} kernels, operands+outputs "
                      f"{sum(r[1] + r[2] for r in rows) / 1e6:.0f} MB")
                for kname, mb_in, mb_out, out_shape in big:
                    print(f"    {kname:44s} in {mb_in / 1e6:7.1f} MB  out {mb_out / 1e6:7.1f} MB  {out_shape[:70]}")


def _kernels(hlo_text):
    """``(name, operand bytes, output bytes, output shape)`` of each fusion / custom call of the entry."""
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "f64": 8, "f16": 2, "s8": 1, "u32": 4}
    nbytes = lambda shape: sum(sizes.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                               for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape))
    defs, rows = {}, []
    for m in re.finditer(r"\n\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)", hlo_text[hlo_text.index("\nENTRY"):]):
        name, shape, op, rest = m.groups()
        defs[name] = shape
        if op in ("fusion", "custom-call"):
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            rows.append((name, sum(nbytes(defs.get(o, "")) for o in operands), nbytes(shape), shape))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--bursts", type=int, default=25)
    ap.add_argument("--calls", type=int, default=10, help="calls per burst")
    ap.add_argument("--fusions", action="store_true", help="list each compiled variant's largest kernels")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--aot-h200", action="store_true", help="no GPU: list the kernels XLA emits for an H200")
    args = ap.parse_args()
    B, T, H, K, W = (2, 64, 2, 16, 4) if args.small else (8, 4096, 8, 128, 4)
    if args.aot_h200:
        return aot_h200(args.variants.split(","), (B, T, H, K, W))
    if args.small:
        args.bursts, args.calls = max(20, min(args.bursts, 20)), min(args.calls, 2)
    names = args.variants.split(",")
    print(f"{jax.devices()[0].device_kind}: B={B} T={T} H={H} K={K} W={W}, bf16 inputs, "
          f"median of {args.bursts} bursts x {args.calls} calls", flush=True)

    xs32, ws, cts32, seg = make_inputs(0, B, T, H, K, W, jnp.float32)
    xs, cts = (tuple(a.astype(jnp.bfloat16) for a in t) for t in (xs32, cts32))
    n = B * T * H * K
    bytes_fwd, bytes_fwdbwd = 3 * n * 4, 3 * n * 10
    print(f"\n{'variant':16s} {'seg':>4s} {'fwd ms':>8s} {'GB/s':>7s} {'fwd+bwd ms':>11s} {'GB/s':>7s}"
          f" {'fp32 rel out':>13s} {'rel grad':>9s} {'bf16 rel out':>13s} {'rel grad':>9s}")
    results = []
    for with_segments in (False, True):
        for name in names:
            e32 = max_abs_errors(name, with_segments, xs32, ws, cts32, seg, jnp.float32)
            e16 = max_abs_errors(name, with_segments, xs, ws, cts, seg, jnp.bfloat16)
            fwd, fwdbwd = functions(name, jnp.bfloat16, with_segments)
            t_f = median_ms(fwd, (xs, ws, seg), args.bursts, args.calls)
            t_fb = median_ms(fwdbwd, (xs, ws, seg, cts), args.bursts, args.calls)
            row = dict(variant=name, segments=with_segments, fwd_ms=t_f, fwd_gbps=bytes_fwd / t_f / 1e6,
                       fwdbwd_ms=t_fb, fwdbwd_gbps=bytes_fwdbwd / t_fb / 1e6, err_fp32=e32, err_bf16=e16)
            results.append(row)
            print(f"{name:16s} {'yes' if with_segments else 'no':>4s} {t_f:8.3f} {row['fwd_gbps']:7.1f}"
                  f" {t_fb:11.3f} {row['fwdbwd_gbps']:7.1f} {e32[0]:13.2e} {e32[1]:9.2e}"
                  f" {e16[0]:13.2e} {e16[1]:9.2e}", flush=True)
            if args.fusions:
                for label, fn, a in (("fwd", fwd, (xs, ws, seg)), ("fwd+bwd", fwdbwd, (xs, ws, seg, cts))):
                    count, top = fusion_summary(fn, a)
                    row[f"kernels_{label}"] = count
                    print(f"    {label}: {count} kernels; largest outputs: "
                          + "; ".join(f"{r[0]} {r[1]:.2f} MB" for r in top))
    print(f"\nbytes: fwd {bytes_fwd / 1e6:.2f} MB, fwd+bwd {bytes_fwdbwd / 1e6:.2f} MB "
          f"(HBM peak {HBM_GBPS:.0f} GB/s: {bytes_fwd / HBM_GBPS / 1e6:.3f} / {bytes_fwdbwd / HBM_GBPS / 1e6:.3f} ms)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, shape=dict(B=B, T=T, H=H, K=K, W=W),
                           bursts=args.bursts, calls=args.calls, results=results), f, indent=1)


if __name__ == "__main__":
    main()
