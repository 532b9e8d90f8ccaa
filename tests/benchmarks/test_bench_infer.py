"""benchmarks/bench_infer.py: the decode variants' split into XLA options, model overrides and module constants;
the HBM bandwidth its rooflines use; the cache bytes a step reads and writes; one loop program for any step count
and each variant's call time split into a step's and its own."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from benchmarks import decode_loop
from benchmarks.bench_infer import cache_read_bytes, cache_write_bytes, hbm_tbps
from benchmarks.decode_loop import compile_loop, decode_variants, loop_args, split_call_time, without_loop_graphs
from k3jax import config
from k3jax.config import LayerKind
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import DECODE_XLA_OPTIONS


def _tiny_decode():
    """tiny()'s decode config, ``decode_layout``'s weights and two 4-token prompts."""
    from k3jax.infer.decode import decode_layout
    from k3jax.model import Transformer

    cfg = config.tiny()
    tokens = jax.random.randint(jax.random.key(0), (2, 4), 0, cfg.vocab_size)
    variables = nn.meta.unbox(Transformer(cfg).init(jax.random.key(1), tokens))
    variables, dcfg = decode_layout({k: variables[k] for k in ("params", "balance")}, cfg)
    return dcfg, variables, tokens


def _tiny_loop_args(steps: int):
    """tiny()'s decode config and a loop's arguments (``decode_loop.loop_args``): the two prompts prefilled, room
    for ``steps`` steps."""
    dcfg, variables, tokens = _tiny_decode()
    return dcfg, loop_args(dcfg, variables, tokens, steps)


def test_decode_variants_split_xla_options_from_model_overrides():
    """``xla_…`` keys are compile options of the variant's decode loop (typed, no excess-precision
    default added) over the decode programs' ``DECODE_XLA_OPTIONS``, ``head`` picks the loop's tokens (the
    greedy head by default, or the logits' argmax), any other key overrides the variant's ModelConfig; base
    keeps the config, the decode options and the greedy head; a malformed spec, override or head is named."""
    cfg = config.tiny()
    variants = decode_variants(cfg, ["x:moe.decode_implementation=xla,xla_gpu_autotune_level=0",
                                     "y:xla_gpu_enable_command_buffer=FUSION", "h:head=logits"])
    assert variants["base"] == (cfg, DECODE_XLA_OPTIONS, "greedy", ())
    assert variants["h"] == (cfg, DECODE_XLA_OPTIONS, "logits", ())
    x_cfg, x_options, x_head, _ = variants["x"]
    assert x_cfg.moe.decode_implementation == "xla" and cfg.moe.decode_implementation is None
    assert x_options == {**DECODE_XLA_OPTIONS, "xla_gpu_autotune_level": 0} and x_head == "greedy"
    assert variants["y"] == (cfg, {**DECODE_XLA_OPTIONS, "xla_gpu_enable_command_buffer": "FUSION"}, "greedy", ())
    exact = decode_variants(cfg, ["e:xla_allow_excess_precision=false"])["e"]
    assert exact[:2] == (cfg, {**DECODE_XLA_OPTIONS, "xla_allow_excess_precision": False})  # asked for, so kept
    serial = decode_variants(cfg, ["s:xla_gpu_command_buffer_scheduling_mode=SERIALIZE"])["s"][1]
    assert serial == {**DECODE_XLA_OPTIONS, "xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"}
    with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
        decode_variants(cfg, ["base:xla_gpu_autotune_level=0"])
    with pytest.raises(ValueError, match="no field 'nope'"):
        decode_variants(cfg, ["z:moe.nope=1"])
    with pytest.raises(ValueError, match="head must be 'greedy' or 'logits'"):
        decode_variants(cfg, ["z:head=top"])


def test_module_constants_are_the_variants_own():
    """``@package.module.NAME=VALUE`` sets a module constant while that variant compiles: its program holds the
    value though ``decode_step``'s jit had traced the same config for base (the trace caches cleared), the module
    keeps its own after, and a build compiled later does not inherit it; a missing module, name or literal is named."""
    import k3jax.layers.kda as kda

    cfg = config.tiny()
    variants = decode_variants(cfg, ["eps:@k3jax.layers.kda.QK_L2_EPS=0.125,head=logits"])
    eps = variants["eps"]
    assert eps == (cfg, DECODE_XLA_OPTIONS, "logits", ((kda, "QK_L2_EPS", 0.125),))
    dcfg, args = _tiny_loop_args(steps=2)
    variants = decode_variants(dcfg, ["eps:@k3jax.layers.kda.QK_L2_EPS=0.4375"])
    texts = [compile_loop(variants[n], 2, args).as_text() for n in ("base", "eps", "base")]
    assert ["constant(0.4375)" in t for t in texts] == [False, True, False]
    assert kda.QK_L2_EPS == 1e-6
    for spec, match in [("a:@k3jax.nope.X=1", "no module 'k3jax.nope'"),
                        ("a:@k3jax.layers.kda.NOPE=1", "has no 'NOPE'"),
                        ("a:@k3jax.layers.kda.QK_L2_EPS=one", "'one' is not a Python literal")]:
        with pytest.raises(ValueError, match=match):
            decode_variants(cfg, [spec])


def test_hbm_bandwidth_follows_the_device():
    """The datasheet figure of the GPU the run is on (an H100's 3.35 TB/s, not the H200's 4.8), unless given."""
    assert hbm_tbps("NVIDIA H100 80GB HBM3", None) == (3.35, "H100 datasheet")
    assert hbm_tbps("NVIDIA H200", None) == (4.8, "H200 datasheet")
    assert hbm_tbps("NVIDIA H100 80GB HBM3", 3.0) == (3.0, "--hbm-tbps")
    tbps, source = hbm_tbps("cpu", None)
    assert tbps == 4.8 and "pass --hbm-tbps" in source


def test_the_traced_loop_leaves_out_the_loop_graphs():
    """``--profile`` compiles the loop without ``WHILE`` / ``CONDITIONAL`` command buffers (under them the
    profiler sees one event for the whole loop), every other option kept."""
    traced = without_loop_graphs(DECODE_XLA_OPTIONS)
    assert traced["xla_gpu_enable_command_buffer"] == "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
    assert {k: v for k, v in traced.items() if k != "xla_gpu_enable_command_buffer"} == {
        k: v for k, v in DECODE_XLA_OPTIONS.items() if k != "xla_gpu_enable_command_buffer"}


def test_cache_bytes_a_step_reads_and_writes():
    """tiny() at batch 3: the KDA float32 states and conv tails are read and written whole; MLA reads its
    latents up to the length and writes one row a sequence."""
    cfg = config.tiny()
    cache = init_cache(cfg, 3, 40)
    kda, mla = cfg.kda, cfg.mla
    C = kda.num_heads * kda.head_dim
    per_kda = 3 * kda.num_heads * kda.head_dim * kda.head_dim * 4 + 3 * 3 * (kda.conv_size - 1) * C * 4
    latent_bytes = jnp.dtype(cfg.compute_dtype).itemsize
    row = 3 * (mla.kv_lora_rank + mla.qk_rope_head_dim) * latent_bytes
    n_kda = sum(kind == LayerKind.KDA for kind in cfg.layer_kinds)
    n_mla = cfg.num_layers - n_kda
    assert n_kda and n_mla
    assert cache_write_bytes(cache) == n_kda * per_kda + n_mla * row
    assert cache_read_bytes(cfg, cache, 10) == n_kda * per_kda + n_mla * 10 * row


def test_one_loop_program_runs_any_step_count():
    """``compile_loop(…, None, …)`` takes the step count as an argument: after 2 and after 3 steps its tokens are
    those of the programs compiled for 2 and for 3 steps; a call's time splits into the slope and the intercept."""
    dcfg, args = _tiny_loop_args(steps=3)
    base = decode_variants(dcfg, [])["base"]
    any_count = compile_loop(base, None, args + (jnp.int32(2),))
    for n in (2, 3):
        assert (any_count(*args, jnp.int32(n)) == compile_loop(base, n, args)(*args)).all()
    assert (any_count(*args, jnp.int32(2)) != any_count(*args, jnp.int32(3))).any()
    assert split_call_time({64: 39.3, 256: 148.02}, 64, 256) == pytest.approx((0.56625, 3.06))
    with pytest.raises(ValueError, match="long_steps=64 must exceed steps=64"):
        split_call_time({64: 39.3}, 64, 64)


def test_every_variant_splits_its_own_call_time(monkeypatch):
    """``step_and_call_ms`` splits each variant's calls, not only the base's: every variant's one loop program is
    timed at both lengths in one round-robin (here a stand-in timer that runs each call once and reports a time
    made of a per-variant step and call cost), and each split recovers its own variant's pair."""
    dcfg, variables, tokens = _tiny_decode()
    variants = decode_variants(dcfg, ["x:xla_gpu_autotune_level=0"])
    made = {"base": (0.5, 3.0), "x": (0.25, 1.0)}
    timed = {}

    def timer(calls, **_):
        for key, (fn, args) in calls.items():
            timed[key] = jax.block_until_ready(fn(*args))
        return {(name, n): n * made[name][0] + made[name][1] for name, n in calls}

    monkeypatch.setattr(decode_loop, "timeit_interleaved", timer)
    split = decode_loop.step_and_call_ms(variants, variables, tokens, 2, 3)
    assert set(timed) == {("base", 2), ("base", 3), ("x", 2), ("x", 3)}
    assert (timed["base", 2] == timed["x", 2]).all() and (timed["base", 3] != timed["base", 2]).any()
    assert split == {name: pytest.approx(pair) for name, pair in made.items()}
