"""MLA training attention on one GPU: the XLA path of ``k3jax.layers.mla`` vs the flash kernel.

Shapes of ``small()`` at the train step's size: B=8, T=4096, H=8, q/k head dim 128 nope + 64 rope
(rope key shared by all heads), v head dim 128, segment ids all ones (what the train loop passes).
XLA path: ``mla.causal_attention`` on fp32 q, k, v with the dense [B,T,S] mask, as MLA calls it.
Flash path: ``pallas_kernels.mla_attention.mla_attention`` on bf16 operands. Peer (``--peers
cudnn``): cuDNN's flash attention via ``jax.nn.dot_product_attention``, plain causal with v padded
to the q/k width (it has no document mask or max logit, so it does less than ours); ``--peers
cudnn,mgpu`` adds JAX's Mosaic GPU flash attention, forward only (its backward has no causal mask);
``mgpu-full`` times that one's forward and backward without the causal mask, its TFLOP/s counted on
its own (full) work: how fast Mosaic GPU backward kernels run, next to ours; ``triton-fwd`` times
ours with the Triton forward (``BlockSizes(mosaic_forward=False)``) against the default Mosaic one.

First the flash path is checked against the XLA path at full size (output, max_logit, every
gradient, also with packed documents); then each is timed: forward, and forward+backward
(``grad`` of ``sum(o·w)``), median of ``--iters`` synchronised calls after a warm-up.
``--sweep 1,3`` also times those block configurations of ``SWEEP`` (``--skip-check``: time only).
``--documents N`` times N documents of equal length per row instead of one (packed training rows:
the flash kernels skip the other documents' blocks, the XLA path masks them, cuDNN stays causal
over the whole row); the TFLOP/s columns still count one document's causal work.

Run on the H200 from the repo root: ``PYTHONPATH=$PWD python3 benchmarks/bench_attention.py``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

from k3jax.layers import mla
from pallas_kernels.mla_attention import BlockSizes, mla_attention
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, F32_RTOL, rel_rmse

SWEEP = (  # the forward's tiles (1, 2) are the Triton forward's: the Mosaic one has its own
    BlockSizes(),
    BlockSizes(block_k=128, num_stages=2, mosaic_forward=False),
    BlockSizes(block_q=64, block_k=64, num_warps=4, mosaic_forward=False),
    BlockSizes(block_q_dkv=32, block_k_dkv=128, block_q_dq=128, block_k_dq=32),
    BlockSizes(block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64, num_warps_bwd=4),
    BlockSizes(num_stages_bwd=2),  # the default until stop 34
)


def inputs(B, T, H, N=128, R=64, V=128, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    shapes = [(B, T, H, N), (B, T, H, R), (B, T, H, N), (B, T, R), (B, T, H, V), (B, T, H, V)]
    qn, qr, kn, kr, v, w = (jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16) for k, s in zip(ks, shapes))
    return (qn, qr, kn, kr, v), w.astype(jnp.float32)


def xla_attention(qn, qr, kn, kr, v, seg, scale):
    """The model's XLA path: fp32 operands, rope key broadcast to heads, dense mask."""
    B, T, H, _ = qn.shape
    wide = lambda x: x.astype(jnp.float32)
    q = jnp.concatenate([wide(qn), wide(qr)], axis=-1)
    k = jnp.concatenate([wide(kn), jnp.broadcast_to(wide(kr)[:, :, None], (B, T, H, kr.shape[-1]))], axis=-1)
    return mla.causal_attention(q, k, wide(v), mla.attention_mask(seg, B, T), scale)


def _equal_widths(qn, qr, kn, kr, v):
    """``(q, k, v)`` of one width for the peers that need it: rope parts appended (the rope key
    broadcast to every head), ``v`` zero-padded to the q/k width."""
    B, T, H, _ = qn.shape
    q = jnp.concatenate([qn, qr], axis=-1)
    k = jnp.concatenate([kn, jnp.broadcast_to(kr[:, :, None], (B, T, H, kr.shape[-1]))], axis=-1)
    return q, k, jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - v.shape[-1])])


def cudnn_attention(qn, qr, kn, kr, v, seg, scale):
    """Peer: cuDNN flash attention through ``jax.nn.dot_product_attention`` (plain causal: no
    document mask, no max logit; it needs equal q/k/v widths, so v is zero-padded to 192)."""
    del seg
    q, k, vp = _equal_widths(qn, qr, kn, kr, v)
    o = jax.nn.dot_product_attention(q, k, vp, scale=scale, is_causal=True, implementation="cudnn")
    return o[..., : v.shape[-1]].astype(jnp.float32), jnp.zeros((qn.shape[2],), jnp.float32)


def mgpu_attention(**config):
    """Peer: JAX's Mosaic GPU flash attention (``attention_mgpu``, warp-specialised wgmma; equal q/k/v
    widths so v is zero-padded to 192; its shared-memory buffers are float16, so it runs on float16
    copies of the operands) with these ``TuningConfig`` fields. Causal it runs forward only (its
    backward has no causal mask in JAX 0.11.2): what a Mosaic GPU port of our forward could reach.
    ``MGPU_FULL``, not causal, runs forward and backward (a dQ kernel and a dK/dV kernel, the same
    split as ours); full attention does twice the causal work and no mask, and its TFLOP/s (counted
    on its own full, v-padded work) says what Mosaic GPU backward kernels reach at these head counts
    and widths: the question before porting ours."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(max_concurrent_steps=2, **config)

    def attend(qn, qr, kn, kr, v, seg, scale):
        del seg
        q, k, vp = _equal_widths(qn * jnp.asarray(scale, qn.dtype), qr * jnp.asarray(scale, qr.dtype), kn, kr, v)
        o = attention_mgpu.attention(*(x.astype(jnp.float16) for x in (q, k, vp)), config)
        return o[..., : v.shape[-1]].astype(jnp.float32), jnp.zeros((qn.shape[2],), jnp.float32)

    return attend


# Blocks sized by a device-less H200 compile (block_kv=128 needs 248,920 bytes of shared memory of 232,448).
MGPU_FULL = dict(block_q=64, block_kv=64, causal=False, compute_wgs_bwd=2, block_q_dkv=64, block_kv_dkv=64,
                 block_q_dq=64, block_kv_dq=64)


INTERPRET = False  # --interpret: the CPU smoke run of this script


def flash_attention(blocks):
    return lambda qn, qr, kn, kr, v, seg, scale: mla_attention(qn, qr, kn, kr, v, seg, scale=scale,
                                                               implementation="pallas", blocks=blocks,
                                                               interpret=INTERPRET)


def programs(attend, seg, w, scale):
    """(forward, forward+backward) over the five operands; ``seg`` and ``w`` go in as arguments
    (captured, XLA would constant-fold them for seconds)."""
    fwd = jax.jit(lambda s, *a: attend(*a, s, scale))
    loss = lambda s, ww, *a: jnp.sum(attend(*a, s, scale)[0] * ww)
    grad = jax.jit(jax.value_and_grad(loss, argnums=range(2, 7)))
    return (lambda *a: fwd(seg, *a)), (lambda *a: grad(seg, w, *a))


def time_ms(fn, args, iters):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check(args, w, seg, scale, blocks):
    """Relative errors of the flash path against the XLA path (output, max_logit, gradients)."""
    with jax.default_matmul_precision("highest"):
        ref_fwd, ref_grad = programs(xla_attention, seg, w, scale)
        (ro, rmx), (_, rg) = ref_fwd(*args), ref_grad(*args)
    fwd, grad = programs(flash_attention(blocks), seg, w, scale)
    (o, mx), (_, g) = fwd(*args), grad(*args)
    errors = {"out": rel_rmse(o, ro), "max_logit": rel_rmse(mx, rmx)}
    errors.update({f"d{n}": rel_rmse(a, b) for n, a, b in zip(("q_nope", "q_rope", "k_nope", "k_rope", "v"), g, rg)})
    ok = errors["out"] <= BF16_FWD_RTOL and errors["max_logit"] <= F32_RTOL and all(
        e <= BF16_GRAD_RTOL for n, e in errors.items() if n.startswith("d"))
    return ok, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sweep", default="", help="also time these SWEEP block configurations, e.g. 1,3")
    parser.add_argument("--skip-check", action="store_true", help="time only (the check compiles the XLA path "
                        "at full precision twice)")
    parser.add_argument("--interpret", action="store_true", help="run the kernels in the CPU interpreter")
    parser.add_argument("--peers", default="cudnn", help="peers to time beside ours: cudnn, mgpu (forward only), "
                        "mgpu-full (not causal, forward and backward), triton-fwd (ours with the Triton "
                        "forward), or ''")
    parser.add_argument("--documents", type=int, default=1, help="documents of equal length per row (timing)")
    parser.add_argument("--out", help="write the results as JSON here")
    a = parser.parse_args()
    if not 1 <= a.documents <= a.length:
        parser.error(f"--documents must be in [1, --length={a.length}], got {a.documents}")
    global INTERPRET
    INTERPRET = a.interpret
    B, T, H, scale = a.batch, a.length, a.heads, 192 ** -0.5
    print(f"device {jax.devices()[0].device_kind}; B={B} T={T} H={H} dqk=128+64 dv=128")
    args, w = inputs(B, T, H)
    ones = jnp.ones((B, T), jnp.int32)
    packed = ones.at[:, T // 3:].set(2).at[:, T - T // 5:].set(3)
    timed = jnp.broadcast_to(1 + jnp.arange(T, dtype=jnp.int32) * a.documents // T, (B, T))
    results = {"shape": dict(B=B, T=T, H=H, documents=a.documents), "checks": {}, "ms": {}}
    for name, seg in () if a.skip_check else (("ones", ones), ("packed", packed)):
        ok, errors = check(args, w, seg, scale, BlockSizes())
        results["checks"][name] = errors
        print(f"check flash vs xla ({name} segments): {'OK' if ok else 'FAILED'} "
              + " ".join(f"{k}={v:.2e}" for k, v in errors.items()), flush=True)
        if not ok:
            raise SystemExit("flash path differs from the XLA path beyond tolerance")
    # Causal flops: half of the T×S products, 2·(dqk + dv) per pair forward, 2.5× that backward.
    fwd_flops = B * H * T * T / 2 * 2 * (192 + 128)
    candidates = {"xla": xla_attention, "flash": flash_attention(BlockSizes())}
    if not a.interpret and "cudnn" in a.peers.split(","):
        candidates["cudnn"] = cudnn_attention
    if "triton-fwd" in a.peers.split(","):  # ours with the Triton forward (the Mosaic one's fallback)
        candidates["flash, Triton fwd"] = flash_attention(BlockSizes(mosaic_forward=False))
    if not a.interpret and "mgpu" in a.peers.split(","):
        for bq, bkv in ((64, 64), (64, 128), (128, 64)):
            candidates[f"mgpu {bq}x{bkv}"] = mgpu_attention(block_q=bq, block_kv=bkv, causal=True)
    flops = {}  # fwd FLOPs of candidates that do other work than one causal document
    if not a.interpret and "mgpu-full" in a.peers.split(","):
        candidates["mgpu-full (not causal)"] = mgpu_attention(**MGPU_FULL)
        flops["mgpu-full (not causal)"] = B * H * T * T * 2 * (192 + 192)
    for i in (int(i) for i in a.sweep.split(",") if i):
        candidates[f"flash {i}: {dataclasses.astuple(SWEEP[i])}"] = flash_attention(SWEEP[i])
    for name, attend in candidates.items():
        ms = []
        for program in programs(attend, timed, w, scale):
            try:
                ms.append(time_ms(program, args, a.iters))
            except Exception:  # a block configuration that does not compile, a peer without a
                # backward: report it, keep going
                print(f"{name}: FAILED\n{traceback.format_exc(limit=3)}", flush=True)
                break
        if not ms:
            continue
        results["ms"][name] = ms
        f = flops.get(name, fwd_flops)
        line = f"{name:>8}: fwd {ms[0]:8.3f} ms ({f / ms[0] / 1e9:6.1f} TFLOP/s)"
        if len(ms) > 1:
            line += f"   fwd+bwd {ms[1]:8.3f} ms ({3.5 * f / ms[1] / 1e9:6.1f} TFLOP/s)"
        print(line, flush=True)
    if "xla" in results["ms"] and "flash" in results["ms"] and len(results["ms"]["xla"]) > 1:
        (xf, xb), (ff, fb) = results["ms"]["xla"], results["ms"]["flash"]
        print(f"speed-up flash over xla: fwd {xf / ff:.1f}x   fwd+bwd {xb / fb:.1f}x")
    if "cudnn" in results["ms"] and "flash" in results["ms"] and len(results["ms"]["cudnn"]) > 1:
        (cf, cb), (ff, fb) = results["ms"]["cudnn"], results["ms"]["flash"]
        print(f"flash vs cuDNN (causal only, v padded): fwd {cf / ff:.2f}x   fwd+bwd {cb / fb:.2f}x (>1 = ours faster)")
    if "flash, Triton fwd" in results["ms"] and "flash" in results["ms"] and len(results["ms"]["flash"]) > 1:
        (tf, tb), (ff, fb) = results["ms"]["flash, Triton fwd"], results["ms"]["flash"]
        print(f"Mosaic forward vs Triton forward: fwd {tf / ff:.2f}x   fwd+bwd {tb / fb:.2f}x (>1 = Mosaic faster)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
