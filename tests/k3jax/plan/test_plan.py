"""Ahead-of-time plans on a TPU slice from this CPU host (libtpu, installed by ``make test``).

The default tests compile a one-layer K3 of reduced widths (the real KDA and MoE kernel paths) for
v5p:2x2x1 on a data × expert mesh and check that the Pallas TPU kernels are in the program; the
real-width version is ``slow``. Bad input (topology, mesh, fit) must read as one clear message.
"""

import dataclasses
import re
import time

import jax
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu compiles for TPU on a CPU host: pip install -e '.[tpu]'")

from k3jax import config  # noqa: E402
from k3jax.plan.__main__ import main, parse_mesh  # noqa: E402
from k3jax.plan.programs import Shape, lower  # noqa: E402
from k3jax.plan.report import _out_of_memory, compile_plan, format_plan  # noqa: E402
from k3jax.plan.topology import CHIPS, get_topology  # noqa: E402

TPU_KERNELS = ("kda_chunk_fwd_tpu", "kda_chunk_bwd_tpu", "moe_gmm_tpu", "moe_tgmm_tpu")


def _one_kda_moe_layer(cfg):
    """The first KDA layer with an MoE, Pallas kernels named explicitly (a CPU host has none)."""
    return dataclasses.replace(
        cfg, num_layers=1, mla_layers=(), mlp=dataclasses.replace(cfg.mlp, first_dense_layers=0),
        kda=dataclasses.replace(cfg.kda, implementation="pallas"),
        moe=dataclasses.replace(cfg.moe, implementation="pallas"))


def _plan(cfg, step, mesh, shape, topology="v5p:2x2x1"):
    topo = get_topology(topology)
    axes = parse_mesh(mesh, len(topo.devices), topology)
    lowered, mesh = lower(step, cfg, axes, topo.devices, shape)
    return compile_plan(lowered, step, topology, mesh, topo.chip, flops_total=1.0)


def _kernel_names(plan_kernels_text: str) -> set[str]:
    return {name for name in TPU_KERNELS if name in plan_kernels_text}


def test_train_step_compiles_the_tpu_kernels():
    cfg = _one_kda_moe_layer(dataclasses.replace(config.tiny(), vocab_size=512))
    topo = get_topology("v5p:2x2x1")
    lowered, mesh = lower("train", cfg, parse_mesh("data=2,expert=2", 4, "v5p"), topo.devices,
                          Shape(batch=4, seq=128, remat="none"))
    compiled = lowered.compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text
    assert _kernel_names(text) == set(TPU_KERNELS), _kernel_names(text)
    mem = compiled.memory_analysis()
    assert 0 < mem.argument_size_in_bytes < CHIPS["v5p"].hbm


def test_report_names_memory_comm_and_fit():
    cfg = _one_kda_moe_layer(dataclasses.replace(config.tiny(), vocab_size=512))
    plan = _plan(cfg, "decode", "data=2,expert=2", Shape(batch=4, seq=256))
    assert plan.fits and plan.devices == 4 and plan.arguments > 0
    assert plan.comm and all(v > 0 for v in plan.comm.values())  # the expert all-to-alls at least
    assert any("expert" in axes for axes in plan.comm), plan.comm
    text = format_plan(plan)
    assert "FITS" in text and "arguments" in text and "temporaries" in text


def test_decode_lowers_for_the_scanned_stack():
    """The scanned stack's caches are a tuple of stacked caches (leading ``layers`` axis): the plan's
    cache shardings followed only the per-layer form (full-depth K3 decode failed with a pytree error)."""
    from k3jax.layout import scan_plan

    cfg = dataclasses.replace(config.tiny(), vocab_size=512)
    assert scan_plan(cfg) is not None
    topo = get_topology("v5p:2x2x1")
    lowered, _ = lower("decode", cfg, parse_mesh("data=2,expert=2", 4, "v5p"), topo.devices, Shape(batch=4, seq=256))
    stacked = [a for a in lowered.args_info[0][2].layers if isinstance(a, tuple)]
    assert stacked and stacked[0][0].state.shape[:2] == (scan_plan(cfg).runs[0].repeats, 4)


def test_forward_splits_each_row_over_the_sequence_axis():
    """``--step forward`` (a long prompt's prefill without its cache): the rows' tokens are split over
    ``sequence``, so KDA hands its state across shards and MLA gathers the latent over that axis; the
    program returns the last token's logits per row."""
    cfg = dataclasses.replace(config.first_layers(dataclasses.replace(config.tiny(), vocab_size=512), 4),
                              kda=dataclasses.replace(config.tiny().kda, implementation="pallas"))
    topo = get_topology("v5p:2x2x1")
    lowered, _ = lower("forward", cfg, parse_mesh("expert=2,sequence=2", 4, "v5p"), topo.devices,
                          Shape(batch=2, seq=256))
    assert lowered.out_info.shape == (2, 512)
    text = lowered.compile().as_text()
    assert "kda_chunk_fwd_tpu" in text and "kda_chunk_bwd_tpu" not in text  # no backward
    # MLA's latent (16) and rope key (8) of one whole row, gathered over the sequence axis
    whole_rows = re.findall(r"= bf16\[1,256,(\d+)\].* all-gather\(.*\{'sequence'\}, dimensions=\{1\}", text)
    assert sorted(set(whole_rows)) == ["16", "8"], whole_rows


def test_attn_res_block_buffer_keeps_the_token_split_between_runs():
    """The scanned runs hand their ``[N, B, T, D]`` block buffer on through the static stream; left to
    XLA's propagation the restacked buffer lost its split over ``sequence`` (K3 at 1 M tokens on
    sequence=256: whole-length bf16[8,1,1048576,7168] buffers, 1.4 TiB per device in all)."""
    import jax
    import jax.numpy as jnp

    import sharding
    from k3jax.layers.attn_res import ResidualStream, StackedStream

    mesh = sharding.make_mesh(expert=2, sequence=2, devices=get_topology("v5p:2x2x1").devices)
    handoff = lambda x: StackedStream.of(ResidualStream(x, (x,), 4)).push_if(True).unstack(2).blocks
    with sharding.use_mesh(mesh):
        text = jax.jit(handoff).lower(jax.ShapeDtypeStruct((2, 64, 8), jnp.bfloat16)).as_text()
    split = re.findall(r'sharding_constraint .*\[\{\}, \{"data", "fsdp", "expert"\}, \{"sequence"\}, \{\}\]> : '
                       r"tensor<4x2x64x8xbf16>", text)
    assert len(split) == 3, text  # restacked (of), written (push_if), restacked again (blocks)


def test_attn_res_mix_backward_keeps_the_buffer_split_over_tokens():
    """The stacked mix's ``dd = Σ (ℓ r)ᵀ v`` flattened the ``[N, B, T, D]`` buffer into rows, merging
    the token axis split over ``sequence`` with the others: XLA gathered the buffer (K3 at 1 M tokens:
    whole-length fp32 copies, 240 GB per device). Contracted in place, only ``dd`` is all-reduced."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import sharding
    from k3jax.layers.attn_res import _mix_stacked

    mesh = sharding.make_mesh(expert=2, sequence=2, devices=get_topology("v5p:2x2x1").devices)
    N, B, T, D = 4, 2, 1024, 512
    batch = ("data", "fsdp", "expert")
    placed = lambda shape, *spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16 if spec else jnp.float32,
                                                       sharding=NamedSharding(mesh, PartitionSpec(*spec)))
    mix = lambda buf, partial, d: jnp.sum(_mix_stacked(buf, jnp.int32(3), partial, d, 1e-6, jnp.dtype(jnp.float32)))
    with sharding.use_mesh(mesh):
        text = jax.jit(jax.grad(mix, argnums=(0, 2))).lower(
            placed((N, B, T, D), None, batch, "sequence", None), placed((B, T, D), batch, "sequence", None),
            placed((D,))).compile().as_text()
    # a collective's result: one array or a tuple of them (dd's bf16 sources contract as [3, D] terms)
    collectives = re.findall(r"= \(?([^=]*?)\)? (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(", text)
    assert collectives and {kind for _, kind in collectives} == {"all-reduce"}, collectives
    shapes = {s for result, _ in collectives for s in re.findall(r"(\w+\[[\d,]*\])", result)}
    assert shapes <= {"f32[512]", "f32[3,512]"}, shapes


@pytest.mark.slow
def test_prefill_runs_the_kda_kernel_per_shard():
    """The cached prefill's chunked KDA scan runs inside shard_map (XLA cannot partition a kernel)."""
    cfg = _one_kda_moe_layer(dataclasses.replace(config.tiny(), vocab_size=512))
    topo = get_topology("v5p:2x2x1")
    lowered, _ = lower("prefill", cfg, parse_mesh("data=2,expert=2", 4, "v5p"), topo.devices,
                       Shape(batch=4, seq=128, chunk=64))
    assert "kda_chunk_fwd_tpu" in lowered.compile().as_text()


def test_v5p_hbm_is_what_its_compiler_allows():
    """Google lists v5p's HBM as 95 GiB (user-allocatable of 96 GiB); the compiler's limit in its
    out-of-memory messages is 95.73 GiB. 95e9 bytes called a program that passed it "does not fit"."""
    assert CHIPS["v5p"].hbm == 95 * 2**30 < 95.73 * 2**30


def test_unknown_topology():
    with pytest.raises(ValueError, match=r"topology='v9z:2x2' is not a known topology.*v5p:16x16x1"):
        get_topology("v9z:2x2")
    with pytest.raises(ValueError, match=r"topology='v5e:1x1': libtpu has no such slice"):
        get_topology("v5e:1x1")


def test_mesh_must_divide_the_devices():
    with pytest.raises(ValueError, match=r"data=3 × expert=2 = 6 devices, but v5p:2x2x1 has 4"):
        parse_mesh("data=3,expert=2", 4, "v5p:2x2x1")
    with pytest.raises(ValueError, match=r"expert=-1: data=3 = 3 does not divide the 4 devices"):
        parse_mesh("data=3,expert=-1", 4, "v5p:2x2x1")
    with pytest.raises(ValueError, match="'pipeline' is not a mesh axis"):
        parse_mesh("pipeline=4", 4, "v5p:2x2x1")
    assert parse_mesh("fsdp=2,expert=-1", 4, "v5p") == (("fsdp", 2), ("expert", 2))


def test_cli_reports_bad_input_in_one_line(capsys):
    assert main(["--preset", "tiny", "--topology", "v5p:2x2x1", "--mesh", "data=8", "--step", "decode"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data=8 = 8 devices, but v5p:2x2x1 has 4" in err


def test_cli_writes_no_topology_program_to_the_persistent_cache(monkeypatch):
    """With jax's persistent cache on (the suite's, or a user's ``JAX_COMPILATION_CACHE_DIR``), the CLI compiles the
    plan's programs but writes none: they could not be loaded back. A CPU program is still written (the cache is on).
    Writes are counted in this process (the other test worker shares the cache folder)."""
    from jax._src import compilation_cache

    if not compilation_cache.is_persistent_cache_enabled():
        pytest.skip("no persistent cache in this process")
    writes, put = [], compilation_cache.put_executable_and_time
    monkeypatch.setattr(compilation_cache, "put_executable_and_time",
                        lambda *a, **k: writes.append(a[0]) or put(*a, **k))
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every compile written, as in the suite
    try:
        assert main(["--preset", "tiny", "--topology", "v5p:2x2x1", "--mesh", "data=4", "--step", "decode"]) == 0
        plan_writes = len(writes)
        fresh = np.int32(time.time_ns() % 2**31)  # a constant no earlier run compiled
        jax.block_until_ready(jax.jit(lambda x: x + fresh)(np.zeros(3, np.int32)))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    assert plan_writes == 0, f"the plan wrote {plan_writes} cache entries"
    assert len(writes) == 1, "a CPU program was not written: the cache is off and this test proves nothing"


def test_out_of_memory_names_the_numbers():
    class FakeMesh:
        shape = {"data": 2, "fsdp": 1, "expert": 2}

    message = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
               "Used 120.53G of 95.74G hbm. Exceeded hbm capacity by 24.79G.")
    err = _out_of_memory(RuntimeError(message), "train", "v5p:2x2x1", FakeMesh(), CHIPS["v5p"])
    assert "needs 120.5 GiB per device against 95.7 GiB of HBM with mesh (data=2, expert=2)" in str(err)
    smem = ("RESOURCE_EXHAUSTED: Allocation (size=1052672) would exceed memory (size=1048576) :: #allocation4 "
            "[shape = 'u8[1052672]{0}', space=smem, size = 0x101000, scoped, tag = 'prefetched SMEM operand 0'] "
            ":: moe_gmm_tpu.21")
    err = _out_of_memory(RuntimeError(smem), "prefill", "v5p:16x16x4", FakeMesh(), CHIPS["v5p"])
    assert "moe_gmm_tpu.21 needs 1,052,672 bytes of SMEM but the chip has 1,048,576" in str(err)
    assert _out_of_memory(RuntimeError("INVALID_ARGUMENT: something else"), "train", "v5p", FakeMesh(),
                          CHIPS["v5p"]) is None


@pytest.mark.slow
def test_real_width_k3_layer_train_step():
    """One KDA + MoE layer of kimi_k3() at its real widths (896 experts, 96 heads) on 64 v5p chips."""
    cfg = _one_kda_moe_layer(config.kimi_k3())
    plan = _plan(cfg, "train", "fsdp=8,expert=8", Shape(batch=64, seq=4096), topology="v5p:4x4x4")
    assert plan.fits, format_plan(plan)
    assert plan.kernels.get("tpu_custom_call", 0) > 0, plan.kernels


@pytest.mark.slow
def test_memory_only_matches_the_finished_compile():
    """--memory-only's buffer-assignment readout equals memory_analysis() of the finished compile."""
    from k3jax.plan.report import buffers_plan

    cfg = _one_kda_moe_layer(dataclasses.replace(config.tiny(), vocab_size=512))
    topo = get_topology("v5p:2x2x1")
    lowered, mesh = lower("train", cfg, parse_mesh("data=2,expert=2", 4, "v5p"), topo.devices,
                          Shape(batch=4, seq=128, remat="none"))
    early = buffers_plan(lowered, "train", "v5p:2x2x1", mesh, topo.chip, flops_total=1.0)
    mem = lowered.compile().memory_analysis()
    assert early.arguments == mem.argument_size_in_bytes
    # The TPU packs temporaries and non-aliased outputs into one allocation; code generation adds
    # scoped buffers after the assignment (15.5 MB on this program): the readout is a lower bound.
    final = mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    assert 0 <= final - early.temporaries <= 32 * 2**20, (early.temporaries, final)
    assert early.largest and early.largest[0][0] <= early.temporaries
    assert "largest temporaries" in format_plan(early) and early.comm


def test_buffer_assignment_parse_names_the_largest():
    from k3jax.plan.buffers import parse

    text = ("allocation 0: size 64, parameter 0, shape |f32[4,4]| at ShapeIndex {}:\n"
            " value: <1 p @0> (size=64,offset=0): f32[4,4]{1,0}\n"
            "allocation 1: size 512, maybe-live-out, preallocated-temp:\n"
            " value: <2 a @0> (size=256,offset=0): bf16[8,16]{1,0}\n"
            " value: <3 b @0> (size=128,offset=0): f32[32]{0}\n"
            " value: <4 c @0> (size=256,offset=256): bf16[8,16]{1,0}\n"
            "allocation 2: size 4096, color 1:\n"
            " value: <5 v @0> (size=4096,offset=0): f32[1024]{0}\n"
            "allocation 3: size 8, thread-local:\n"
            " value: <6 t @0> (size=8,offset=0): f32[2]{0}\n")
    b = parse(text, hlo="")
    assert (b.arguments, b.temporaries) == (64, 512)  # VMEM (colour 1) and thread-local left out
    assert b.largest == ((256, "bf16[8,16], f32[32]"), (256, "bf16[8,16]"))


def test_muon_keeps_the_expert_sharding_of_scanned_expert_leaves():
    """Newton–Schulz of a stacked expert leaf ``[layers, experts, L, F]`` stays split over experts
    (merging layers and experts into one batch axis replicated every expert on every device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from k3jax.train.optimizer import _orthogonalize, MuonDimensionNumbers

    mesh = Mesh(get_topology("v5p:2x2x1").devices, ("expert",))
    x = jax.ShapeDtypeStruct((2, 8, 256, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "expert")))
    dims = MuonDimensionNumbers(reduction_axis=(2,), output_axis=(3,))
    fn = jax.jit(lambda x: _orthogonalize(x, jnp.array([3.4445, -4.7750, 2.0315]), 5, 1e-7, dims, "bfloat16"))
    compiled = fn.lower(x).compile()
    text = compiled.as_text()
    assert "all-gather" not in text and "all-to-all" not in text, [l for l in text.splitlines() if "all-" in l][:3]
    assert compiled.output_shardings.spec[:2] == (None, "expert")


def test_muon_orthogonalizes_each_expert_matrix_once_across_fsdp():
    """Stored, an expert's width is split over fsdp: Newton–Schulz on that layout repeats every
    matrix on each fsdp rank and all-reduces its Gram products. With the logical names, each of the 4
    devices orthogonalises a quarter of the 16 matrices, after one all-to-all."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import sharding
    from k3jax.train.optimizer import _orthogonalize, MuonDimensionNumbers

    mesh = sharding.make_mesh(data=1, expert=2, fsdp=2, devices=get_topology("v5p:2x2x1").devices)
    x = jax.ShapeDtypeStruct((2, 8, 256, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "expert", "fsdp")))
    dims = MuonDimensionNumbers(reduction_axis=(2,), output_axis=(3,))
    names = ("layers", "experts", "latent", "expert_mlp")
    coeffs = jnp.array([3.4445, -4.7750, 2.0315])
    with sharding.use_mesh(mesh, sharding.EXPERT):
        fn = jax.jit(lambda x: _orthogonalize(x, coeffs, 5, 1e-7, dims, "bfloat16", names))
        compiled = fn.lower(x).compile()
    text = compiled.as_text()
    assert "all-to-all" in text and "all-reduce" not in text and "all-gather" not in text
    per_matrix = 5 * (2 * 128 * 128 * 256 * 2 + 2 * 128 ** 3)  # 5 steps: X Xᵀ, A·(bI + cA), (aI + …)·X
    assert compiled.cost_analysis()["flops"] < 1.05 * 16 * per_matrix / 4
    assert compiled.output_shardings.spec[:3] == (None, "expert", "fsdp")


def test_tpu_grouped_matmul_schedule_fits_smem_at_4m_rows():
    """4,194,304 rows (K3 prefill: 4096 tokens × top-16 × 64 expert ranks) needed 1,052,672 bytes of
    SMEM for the [5, W] schedule (rows padded to 8); flat it takes 20 bytes a tile. Real Mosaic compile."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels.moe import kernel_tpu

    at = SingleDeviceSharding(get_topology("v5p:2x2x1").devices[0])
    m, e = 4_194_304, 14
    lhs = jax.ShapeDtypeStruct((m, 128), jnp.bfloat16, sharding=at)
    rhs = jax.ShapeDtypeStruct((e, 128, 128), jnp.bfloat16, sharding=at)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32, sharding=at)
    jax.jit(kernel_tpu.gmm).lower(lhs, rhs, sizes).compile()
    jax.jit(lambda a, d, g: kernel_tpu.tgmm(a, d, g, num_groups=e)).lower(lhs, lhs, sizes).compile()


def test_multi_host_gpu_plans_read_memory_from_the_buffer_assignment(monkeypatch, capsys):
    """jax 0.11.2's memory_analysis() counts a multi-host GPU program's arguments unsharded, so an
    H200 cluster plan always reads the buffer assignment (a one-host plan and TPU slices need not)."""
    from k3jax.plan import report, topology

    tpu = get_topology("v5p:2x2x1")
    assert not tpu.needs_buffer_readout
    assert not dataclasses.replace(tpu, gpu_hosts=1).needs_buffer_readout
    cluster = dataclasses.replace(tpu, name="h200:2x2", chip=CHIPS["h200"], gpu_hosts=2)
    assert cluster.needs_buffer_readout

    class Readout(Exception):
        pass

    def buffers_plan(*args, **kwargs):
        raise Readout

    monkeypatch.setattr(topology, "get_topology", lambda name: cluster)
    monkeypatch.setattr(report, "buffers_plan", buffers_plan)
    with pytest.raises(Readout):
        main(["--preset", "tiny", "--topology", "h200:2x2", "--mesh", "data=4", "--step", "decode",
              "--batch", "4", "--seq", "64", "--layers", "2"])
    assert "buffer assignment" in capsys.readouterr().out
