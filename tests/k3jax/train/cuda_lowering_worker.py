"""Lowers a 4-layer train step (KDA, MLA, KDA, MLA, each with MoE; Pallas kernels; argv: sequence length,
then optionally the loss implementation) for CUDA on a CPU host and
prints, as JSON, each Mosaic GPU kernel's name with the number of distinct modules (kernel hashes)
lowered for it, the number of kernel call sites and the lowering seconds.

Run in its own process (test_compile.py): it makes JAX believe the default backend is a Hopper GPU.
"""

import collections
import dataclasses
import json
import re
import sys
import time

import jax
import jax.numpy as jnp


def pretend_hopper() -> None:
    from jax._src.pallas.triton import gpu_info

    import pallas_kernels.head_ce.ops as head_ops
    import pallas_kernels.mla_attention.ops as mla_ops
    import pallas_kernels.moe.kernel_gpu_base as moe_kernel
    import pallas_kernels.moe.ops as moe_ops
    from pallas_kernels.target import Target

    jax.default_backend = lambda: "gpu"
    moe_ops._hopper_gpu = lambda: True
    mla_ops._cuda_gpu = lambda: True
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)  # Triton's target
    head_ops.current_target = lambda: Target("gpu", "NVIDIA H200", 132, cuda=True)
    moe_kernel._num_sms = lambda interpret: 132


def layer_config(seq_len: int):
    from k3jax.config import preset
    from k3jax.train.config import DataConfig, TrainConfig

    m = preset("small")
    m = dataclasses.replace(m, num_layers=4, vocab_size=1024, mla_layers=(1, 3),
                            mlp=dataclasses.replace(m.mlp, first_dense_layers=0),
                            kda=dataclasses.replace(m.kda, implementation="pallas"),
                            moe=dataclasses.replace(m.moe, implementation="pallas"))
    return TrainConfig(model=m, batch_size=1, seq_len=seq_len, remat="layer", steps=3,
                       data=DataConfig(source="random"))


def kernel_modules(text: str) -> tuple[dict[str, int], int]:
    """{kernel name: distinct kernel hashes} and the number of Mosaic GPU custom calls in ``text``."""
    hashes = collections.defaultdict(set)
    calls = 0
    for line in text.splitlines():
        if "stablehlo.custom_call @mosaic_gpu" not in line:
            continue
        calls += 1
        # The module's strings hold the kernel function, "<kernel_name>_mosaic_gpu".
        (name,) = set(re.findall(r"\\00(\w+?)_mosaic_gpu\\00", line)) - {"stable"}
        hashes[name].add(re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', line).group(1))
    return {k: len(v) for k, v in hashes.items()}, calls


def main(seq_len: int) -> None:
    pretend_hopper()
    from k3jax.train.step import Trainer

    cfg = layer_config(seq_len)
    trainer = Trainer(cfg)
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, seq_len), jnp.int32)
             for k in ("tokens", "segment_ids", "labels", "loss_mask")}
    t0 = time.perf_counter()
    lowered = jax.jit(trainer.train_step).trace(trainer.abstract_state(), batch).lower(lowering_platforms=("cuda",))
    seconds = time.perf_counter() - t0
    modules, calls = kernel_modules(lowered.as_text())
    print(json.dumps({"modules": modules, "calls": calls, "seconds": round(seconds, 2)}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 128)
