"""Context-parallel MLA attention on 8 fake CPU devices (run by test_cp_attention.py in a subprocess).

Flash path under the Pallas interpreter, zig-zag balanced and not, on sequence = 4 and 2 meshes,
against the unsharded flash op and the fp32 dense reference; the XLA path; the MLA layer under a
sequence mesh; the flash path's forward + backward lowered for CUDA (Triton custom calls counted,
collectives listed), alone and inside a train step.
"""

import re

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from pallas_kernels.mla_attention import mla_attention  # noqa: E402
from sharding import make_mesh, use_mesh  # noqa: E402
from sharding.cp_attention import mla_attention_cp  # noqa: E402
from tests.pallas_kernels.mla_attention.test_ops import SMALL_BLOCKS  # noqa: E402
from tests.sharding.multidevice import emit, value_error  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

B, T, H, R, DR, DN, DV, SCALE = 4, 64, 2, 16, 8, 16, 16, 0.3


def _segments():
    """Documents that change mid-shard, exactly on a shard boundary and across one; one whole row."""
    t = jnp.arange(T)
    rows = [(t >= 16).astype(jnp.int32) + (t >= T // 2 + 3), jnp.zeros(T, jnp.int32), (t >= 5) + (t >= 45) * 3,
            (t // 7) % 3]
    return jnp.stack(rows).astype(jnp.int32)


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(ks[0], (B, T, H, DN + DR))  # the model's wide (fp32) queries
    c = jax.random.normal(ks[1], (B, T, R)).astype(jnp.bfloat16)
    kr = jax.random.normal(ks[2], (B, T, DR)).astype(jnp.bfloat16)
    kv_b = (0.3 * jax.random.normal(ks[3], (R, H, DN + DV))).astype(jnp.bfloat16)
    return q, c, kr, kv_b


def _unsharded(implementation, seg, wide):
    """The unsharded op on the same operands: bf16 kernel inputs, or everything in fp32 for the reference."""
    def fn(q, c, kr, kv_b):
        dt = jnp.float32 if wide else jnp.bfloat16
        kv = jnp.einsum("BSR,RHK->BSHK", c.astype(dt), kv_b.astype(dt))
        return mla_attention(q[..., :DN].astype(dt), q[..., DN:].astype(dt), kv[..., :DN], kr.astype(dt),
                             kv[..., DN:], seg, scale=SCALE, implementation=implementation, interpret=True,
                             blocks=SMALL_BLOCKS)
    return fn


def _fwd_grad(f, args):
    (o, m), vjp = jax.vjp(f, *args)
    return (o, m), vjp((jnp.cos(o), jnp.zeros_like(m)))


def _grad_rel(g, ref):
    return max(rel_rmse(a.astype(jnp.float32), b.astype(jnp.float32)) for a, b in zip(g, ref))


def check(mesh, seg, args, refs, **kw):
    """CP against the unsharded flash op (o, max_logit) and the fp32 reference (o, gradients)."""
    (o_flash, m_flash), _ = refs["flash"]
    (o_ref, m_ref), g_ref = refs["ref"]
    cp = lambda *a: mla_attention_cp(*a, scale=SCALE, nope_dim=DN, segment_ids=seg, blocks=SMALL_BLOCKS, **kw)
    with use_mesh(mesh):
        (o, m), g = jax.jit(lambda *a: _fwd_grad(cp, a))(*args)
    return {"o_vs_flash": rel_rmse(o, o_flash), "max_logit_vs_flash": rel_rmse(m, m_flash),
            "o_vs_ref": rel_rmse(o, o_ref), "max_logit_vs_ref": rel_rmse(m, m_ref), "grad_vs_ref": _grad_rel(g, g_ref)}


def cuda_lowering(mesh, seg, args, balanced):
    """Triton kernel calls and cross-device collectives of CP forward + backward lowered for CUDA."""
    import pallas_kernels.mla_attention.ops as ops
    from jax._src.pallas.triton import gpu_info

    saved = ops._cuda_gpu, gpu_info.get_gpu_info
    ops._cuda_gpu = lambda: True  # the flash path as on a CUDA GPU (no interpreter)
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    try:
        cp = lambda *a: mla_attention_cp(*a, scale=SCALE, nope_dim=DN, segment_ids=seg, balanced=balanced)
        with use_mesh(mesh):
            traced = jax.jit(lambda *a: _fwd_grad(cp, a)).trace(*args)
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
    finally:
        ops._cuda_gpu, gpu_info.get_gpu_info = saved
    kernels = [re.search(r'name = "(\w+)"', re.sub(r'ir = "[^"]*"', "", line)).group(1)
               for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    collectives = re.findall(r"stablehlo\.(all_gather|collective_permute|reduce_scatter)\b", text)
    return {"kernels": sorted(kernels), "collectives": {c: collectives.count(c) for c in set(collectives)}}


def mla_layer(mesh):
    """The MLA layer (tiny(), bf16, flash forced and interpreted) under a sequence mesh against the
    same layer unsharded: output, max_logit and parameter gradients."""
    import functools

    from k3jax.layers import attention as attention_lib
    from k3jax.layers import mla as mla_lib
    from tests.k3jax.test_attention import _mla_cfg, _run, _setup

    paths = []

    def interpreted_cp(*args, **kwargs):
        paths.append(kwargs["implementation"])
        return mla_attention_cp(*args, **kwargs, interpret=True)

    saved = attention_lib.use_flash, attention_lib.flash_attention, mla_lib.mla_attention_cp
    attention_lib.use_flash = lambda *a: True  # "pallas" on CPU: the interpreter below stands in
    attention_lib.flash_attention = functools.partial(attention_lib.flash_attention, interpret=True)
    mla_lib.mla_attention_cp = interpreted_cp
    try:
        cfg = _mla_cfg("pallas")
        x, params, seg = _setup(cfg, B, T, packed=True)
        want = jax.jit(functools.partial(_run, cfg))(params, x, seg)
        with use_mesh(mesh):
            got = jax.jit(functools.partial(_run, cfg))(params, x, seg)
    finally:
        attention_lib.use_flash, attention_lib.flash_attention, mla_lib.mla_attention_cp = saved
    errors = [rel_rmse(a.astype(jnp.float32), b.astype(jnp.float32))
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return {"y": errors[0], "max_logit": errors[1], "grads": max(errors[2:]), "paths": sorted(set(paths))}


def train_step_lowering():
    """Triton kernels of a 2-layer train step (KDA, then MLA with attention_implementation="pallas",
    remat per layer) on a data 4 × sequence 2 mesh, lowered for CUDA: the real call path, no patches
    besides pretending the host is a Hopper GPU. Run last: the pretence stays."""
    import collections
    import dataclasses

    import pallas_kernels.mla_attention.ops as ops
    from jax._src.pallas.triton import gpu_info
    from k3jax.config import preset
    from k3jax.train.config import DataConfig, TrainConfig
    from k3jax.train.step import Trainer
    from tests.k3jax.train.cuda_lowering_worker import pretend_hopper

    pretend_hopper()
    ops._cuda_gpu = lambda: True
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    m = preset("small")
    m = dataclasses.replace(m, num_layers=2, vocab_size=1024, mla_layers=(1,),
                            mlp=dataclasses.replace(m.mlp, first_dense_layers=0),
                            mla=dataclasses.replace(m.mla, attention_implementation="pallas"))
    cfg = TrainConfig(model=m, batch_size=4, seq_len=256, remat="layer", data=DataConfig(source="random"))
    trainer = Trainer(cfg, make_mesh(data=4, sequence=2))
    batch = {k: jax.ShapeDtypeStruct((4, 256), jnp.int32) for k in ("tokens", "segment_ids", "labels", "loss_mask")}
    state = trainer.abstract_state()  # init traces outside the parallel context
    with trainer._context():
        text = jax.jit(trainer.train_step).trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
    names = [re.search(r'name = "(\w+)"', re.sub(r'ir = "[^"]*"', "", line)).group(1)
             for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    return dict(collections.Counter(names))


def main():
    seg, args = _segments(), _inputs()
    wide = [a.astype(jnp.float32) for a in args]
    refs = {"flash": _fwd_grad(_unsharded("pallas", seg, wide=False), args),
            "ref": _fwd_grad(_unsharded("xla", seg, wide=True), wide)}  # fp32 gradients, not bf16-rounded
    seq4, seq2 = make_mesh(data=2, sequence=4), make_mesh(data=4, sequence=2)
    out = {
        "seq4_balanced": check(seq4, seg, args, refs, interpret=True),
        "seq4_unbalanced": check(seq4, seg, args, refs, interpret=True, balanced=False),
        "seq2_balanced": check(seq2, seg, args, refs, interpret=True, balanced=True),
        "seq2_unbalanced": check(seq2, seg, args, refs, interpret=True, balanced=False),
    }
    out["seq4_xla"] = check(seq4, seg, wide, {"flash": refs["ref"], "ref": refs["ref"]})
    out["lower_balanced"] = cuda_lowering(seq4, seg, args, None)
    out["lower_unbalanced"] = cuda_lowering(seq4, seg, args, False)
    out["mla_layer_seq4"] = mla_layer(seq4)
    cut = [a[:, :40] for a in args[:3]] + [args[3]]  # 40 tokens: 5 per shard, not two equal halves
    with use_mesh(make_mesh(data=1, sequence=8)):
        out["err_balanced"] = value_error(lambda: mla_attention_cp(
            *cut, scale=SCALE, nope_dim=DN, segment_ids=seg[:, :40], interpret=True, balanced=True))
    out["train_step_kernels"] = train_step_lowering()
    emit(out)


if __name__ == "__main__":
    main()
