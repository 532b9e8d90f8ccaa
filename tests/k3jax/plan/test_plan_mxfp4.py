"""Plans with the routed experts as MXFP4 (``--experts mxfp4``), compiled for a v5p slice from this host.

A one-layer K3-shaped model whose expert widths are 4096 (so the TPU pads none of the uint8 arrays:
a scale row of 4096 / 32 = 128 bytes fills its lanes) is compiled for decode with bf16 experts and
with MXFP4 ones on ``expert=2, tensor=2``: the arguments shrink by exactly the experts' bytes times
(1 - 17/64), the encoded bytes (not decoded bf16) travel over ``tensor``, and decoding adds no fp32
copy of the experts. The placement of the ``mxfp4`` collection is checked without compiling.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("libtpu", reason="libtpu compiles for TPU on a CPU host: pip install -e '.[tpu]'")

from k3jax import config  # noqa: E402
from k3jax.plan.__main__ import main, parse_mesh  # noqa: E402
from k3jax.plan.programs import Shape, _variables, lower  # noqa: E402
from k3jax.plan.report import compile_plan  # noqa: E402
from k3jax.plan.topology import get_topology  # noqa: E402

TOPOLOGY = "v5p:2x2x1"
MESH = "expert=2,tensor=2"


def _one_moe_layer(**moe):
    """The first KDA layer with an MoE, bf16 parameters, Pallas kernels named (a CPU host has none)."""
    cfg = dataclasses.replace(config.tiny(), vocab_size=512, param_dtype=jnp.bfloat16, num_layers=1, mla_layers=())
    return dataclasses.replace(
        cfg, mlp=dataclasses.replace(cfg.mlp, first_dense_layers=0),
        kda=dataclasses.replace(cfg.kda, implementation="pallas"),
        moe=dataclasses.replace(cfg.moe, implementation="pallas", **moe))


def _decode_plan(cfg, experts):
    topo = get_topology(TOPOLOGY)
    lowered, mesh = lower("decode", cfg, parse_mesh(MESH, 4, TOPOLOGY), topo.devices, Shape(batch=4, seq=256),
                          experts=experts)
    return compile_plan(lowered, "decode", TOPOLOGY, mesh, topo.chip, flops_total=1.0)


def test_mxfp4_decode_reads_the_encoded_experts():
    E, width = 4, 4096
    cfg = _one_moe_layer(num_experts=E, top_k=2, latent_dim=width, expert_intermediate=width)
    bf16, fp4 = _decode_plan(cfg, "param"), _decode_plan(cfg, "mxfp4")
    # per device: 3 stacks of E experts [width, width], split over expert × tensor = 4 devices
    experts_bf16 = 3 * E * width * width * 2 / 4
    assert bf16.arguments - fp4.arguments == experts_bf16 * (1 - 17 / 64)  # 4.25 of 16 bits a weight
    # the encoded bytes are gathered whole per expert over tensor (17/64 of what bf16 experts send)
    assert fp4.comm["tensor"] <= 17 / 64 * bf16.comm["tensor"] * 1.01, (fp4.comm, bf16.comm)
    # decoding writes bf16 (its interleave one bf16 copy per stack); the table-gather decoder kept
    # fp32 and int32 copies of every stack: 4.50 GB here against 0.20 GB for bf16 experts
    assert fp4.temporaries < 2 * bf16.temporaries, (fp4.temporaries, bf16.temporaries)


def test_mxfp4_collection_is_placed_like_the_experts():
    """E on the expert axis; an expert's width on tensor where the rules split it. Tiny widths (32): w2's
    scale has F / 32 = 1 exponent per row, which tensor=2 cannot split (and its L rows hold fsdp), so
    it is replicated over tensor, and so are its packed bytes, though their F / 2 = 16 would split."""
    import sharding
    from k3jax.train.config import MeshConfig, TrainConfig
    from k3jax.train.parallel import make_train_mesh, train_rules

    cfg = _one_moe_layer()
    topo = get_topology(TOPOLOGY)
    tcfg = TrainConfig(model=cfg, batch_size=4, seq_len=1, mesh=MeshConfig(axes=parse_mesh(MESH, 4, TOPOLOGY)))
    mesh = make_train_mesh(tcfg, topo.devices)
    variables = _variables(cfg, mesh, train_rules(tcfg, mesh), "mxfp4")
    moe = variables["mxfp4"]["layers_0"]["moe"]
    assert "w1" not in variables["params"]["layers_0"]["moe"]
    spec = lambda a: tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
    E, L, F = cfg.moe.num_experts, cfg.moe_width, cfg.moe.expert_intermediate
    for name in ("w1", "w3"):  # [E, F, L/2], [E, F, L/32]: latent is fsdp's (size 1)
        assert moe[name].packed.shape == (E, F, L // 2) and moe[name].packed.dtype == jnp.uint8
        assert spec(moe[name].packed)[:2] == spec(moe[name].scale)[:2] == ("expert", "tensor")
    assert moe["w2"].scale.shape == (E, L, F // 32) == (E, L, 1)
    assert spec(moe["w2"].scale) == spec(moe["w2"].packed) == ("expert", "fsdp", None)
    assert sharding.TENSOR == train_rules(tcfg, mesh)


@pytest.mark.unchecked
def test_mxfp4_is_for_inference_only(capsys):
    topo = get_topology(TOPOLOGY)
    with pytest.raises(ValueError, match=r"experts='mxfp4' is an inference format \(--step prefill or decode\)"):
        lower("train", _one_moe_layer(), parse_mesh(MESH, 4, TOPOLOGY), topo.devices, Shape(batch=4, seq=64),
              experts="mxfp4")
    with pytest.raises(ValueError, match=r"experts='int4' must be one of param, mxfp4"):
        lower("decode", _one_moe_layer(), parse_mesh(MESH, 4, TOPOLOGY), topo.devices, Shape(batch=4, seq=64),
              experts="int4")
    assert main(["--preset", "tiny", "--topology", TOPOLOGY, "--step", "train", "--experts", "mxfp4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "experts='mxfp4' is an inference format" in err


def test_mxfp4_prefill_lowers_with_the_encoded_experts():
    """Prefill takes the same variables: its arguments hold the uint8 stacks, not the bf16 experts."""
    topo = get_topology(TOPOLOGY)
    lowered, _ = lower("prefill", _one_moe_layer(), parse_mesh(MESH, 4, TOPOLOGY), topo.devices,
                       Shape(batch=4, seq=64, chunk=32), experts="mxfp4")
    variables = lowered.args_info[0][0]
    assert "w1" not in variables["params"]["layers_0"]["moe"]
    assert {a.dtype for a in jax.tree.leaves(variables["mxfp4"])} == {jnp.dtype(jnp.uint8)}
