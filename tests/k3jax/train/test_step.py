"""The train step: accumulation == one batch, non-finite skip, MTP targets, mixed precision."""

import dataclasses

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import MTPConfig
from k3jax.train.config import DataConfig, xla_compiler_options
from k3jax.train.loop import NonFiniteLossError, make_data, train
from k3jax.train.mtp import mtp_targets
from k3jax.train.step import Trainer
from tests.k3jax.train import toy
from tests.tolerances import F32_RTOL, rel_rmse

toy.use_compilation_cache()


def _f32(cfg):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=jnp.float32))


def test_micro_batch_accumulation_equals_one_batch():
    cfg = _f32(toy.micro_train_config())
    batch = next(make_data(cfg))
    results = []
    for micro in (1, 2):
        trainer = Trainer(dataclasses.replace(cfg, micro_batches=micro))
        state = trainer.init_state(jax.random.key(0))
        (grads, aux), _, _ = jax.jit(trainer._grads)(state, batch)
        results.append((grads, aux))
    (g1, a1), (g2, a2) = results
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert rel_rmse(y, x) < 10 * F32_RTOL
    s1, s2 = a1["stats"]["model"]["layers_1"], a2["stats"]["model"]["layers_1"]
    moe = lambda s: (s["moe"]["loads"], s["moe"]["hist"])
    chex.assert_trees_all_equal(moe(s1), moe(s2))  # integer statistics add exactly
    chex.assert_trees_all_close((a1["ce"], s1["mla"]), (a2["ce"], s2["mla"]), rtol=1e-5)


def test_nonfinite_step_is_skipped_and_counted():
    cfg = toy.micro_train_config()
    trainer = Trainer(cfg)
    state = trainer.init_state(jax.random.key(0))
    bad = state.replace(params={**state.params, "model": {**state.params["model"], "final_norm": {
        "scale": state.params["model"]["final_norm"]["scale"].at[0].set(jnp.nan)}}})
    before = jax.device_get(bad)
    new, metrics = trainer.step(bad, next(make_data(cfg)))
    new = jax.device_get(new)
    assert bool(metrics["skipped"]) and int(new.nonfinite_streak) == 1 and int(new.nonfinite_total) == 1
    assert int(new.step) == 1
    chex.assert_trees_all_equal((before.params, before.opt_state, before.balance),
                                (new.params, new.opt_state, new.balance))


def test_training_stops_after_n_nonfinite_steps():
    cfg = dataclasses.replace(toy.micro_train_config(), max_consecutive_nonfinite=2, steps=6)
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, learning_rate=1e30,
                                                                 grad_clip_norm=None))
    with pytest.raises(NonFiniteLossError, match="2 consecutive"):
        train(cfg, progress=False)


def test_mtp_targets_respect_documents_and_mask():
    labels = jnp.asarray([[11, 12, 13, 14, 15, 16]])
    mask = jnp.asarray([[1, 1, 1, 1, 1, 0]])
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2]])
    inputs, target, m = mtp_targets(labels, mask, seg, 1)
    np.testing.assert_array_equal(inputs, labels)
    np.testing.assert_array_equal(target, [[12, 13, 14, 15, 16, 0]])
    np.testing.assert_array_equal(m, [[1, 1, 0, 1, 0, 0]])  # no target across the document border
    _, target2, m2 = mtp_targets(labels, mask, seg, 2)
    np.testing.assert_array_equal(target2[0, :3], [13, 14, 15])
    np.testing.assert_array_equal(m2, [[1, 0, 0, 0, 0, 0]])


def test_mtp_step_trains_its_module_with_shared_embedding_and_head():
    model = dataclasses.replace(toy.micro_train_config().model, mtp=MTPConfig(num_layers=1, loss_weight=0.3))
    cfg = toy.micro_train_config(model=model, data=DataConfig(source="random"))  # dense targets
    trainer = Trainer(cfg)
    state = trainer.init_state(jax.random.key(0))
    assert set(state.params) == {"model", "mtp"} and "embed" not in state.params["mtp"]["depth_1"]
    old = jax.device_get(state.params["mtp"])
    data = make_data(cfg)
    new, metrics = trainer.step(state, next(data))  # lr 0 on the first step (warmup from 0)
    new, metrics = trainer.step(new, next(data))
    assert np.isfinite(float(metrics["mtp_loss"])) and 0.5 * np.log(64) < float(metrics["mtp_loss"]) < 2 * np.log(64)
    new_mtp = jax.device_get(new.params["mtp"])
    depth_old, depth_new = old["depth_1"], new_mtp["depth_1"]
    for path in (("fuse", "kernel"), ("embed_norm", "scale"), ("block", "mla", "q_b", "kernel"), ("block", "moe", "w1")):
        a, b = depth_old, depth_new
        for k in path:
            a, b = a[k], b[k]
        assert not np.array_equal(a, b), path
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new_mtp))]
    assert sum(changed) > len(changed) // 2


def test_mixed_precision_fp32_master_params_bf16_matmuls():
    cfg = toy.micro_train_config()
    trainer = Trainer(cfg)
    abstract = trainer.abstract_state()
    floats = {x.dtype for x in jax.tree.leaves((abstract.params, abstract.opt_state)) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {jnp.dtype(jnp.float32)}
    batch = jax.tree.map(jnp.asarray, next(make_data(cfg)))
    jaxpr = jax.make_jaxpr(lambda s: trainer._grads(s, batch))(abstract)
    dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    bf16 = [e for e in dots if all(v.aval.dtype == jnp.bfloat16 for v in e.invars)]
    # the ~22 projection kernels each give a bf16 forward and two bf16 backward matmuls; the fp32
    # islands (KDA chunk algebra, router, softmax, AttnRes) account for the rest
    kernels = [p for p, _ in jax.tree_util.tree_flatten_with_path(abstract.params)[0] if "kernel" in jax.tree_util.keystr(p)]
    assert len(bf16) >= 2 * len(kernels), (len(bf16), len(kernels), len(dots))
    grads = jax.eval_shape(lambda s: trainer._grads(s, batch)[0][0], abstract)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("precision, expect_bf16", [("BF16_BF16_F32", True), (None, False)])
def test_newton_schulz_matmul_precision_follows_config(precision, expect_bf16):
    cfg = toy.micro_train_config()
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, ns_precision=precision))
    trainer = Trainer(cfg)
    abstract = trainer.abstract_state()
    batch = jax.tree.map(jnp.asarray, next(make_data(cfg)))
    text = jax.jit(trainer.train_step).lower(abstract, batch).as_text()
    algo = [line for line in text.splitlines() if "dot_general" in line and "lhs_precision_type = bf16" in line]
    assert bool(algo) == expect_bf16, len(algo)


def test_bf16_logits_option_reaches_the_loss():
    """``loss_logits_dtype="bfloat16"``: the step's loss and gradients stay close to the fp32-logits ones,
    and the head's matmul in the step's jaxpr stores bf16."""
    cfg = toy.micro_train_config()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=80))  # ≠ hidden, to spot the head
    batch = next(make_data(cfg))
    out = {}
    for logits_dtype in (None, "bfloat16"):
        trainer = Trainer(dataclasses.replace(cfg, loss_logits_dtype=logits_dtype))
        state = trainer.init_state(jax.random.key(0))
        (grads, aux), denom, _ = jax.jit(trainer._grads)(state, batch)
        out[logits_dtype] = (aux["ce"] / denom, grads)
        dots = [e.params["preferred_element_type"] for e in _eqns(jax.make_jaxpr(trainer._grads)(state, batch).jaxpr)
                if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == cfg.model.vocab_size]
        assert (jnp.dtype(jnp.bfloat16) in dots) == (logits_dtype == "bfloat16"), dots
    (l32, g32), (l16, g16) = out[None], out["bfloat16"]
    assert abs(float(l16) - float(l32)) < 1e-2 * abs(float(l32))
    assert rel_rmse(jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(g16)]),
                    jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(g32)])) < 2e-2


def test_pallas_loss_option_reaches_the_loss():
    """``loss_implementation="pallas"`` reaches ``head_cross_entropy``: on this CPU host, which has no
    Hopper GPU, tracing the step names the requirement instead of silently running XLA's loss."""
    cfg = dataclasses.replace(toy.micro_train_config(), loss_implementation="pallas")
    trainer = Trainer(cfg)
    state = trainer.init_state(jax.random.key(0))
    with pytest.raises(ValueError, match="Hopper GPU or interpret=True"):
        jax.make_jaxpr(trainer._grads)(state, next(make_data(cfg)))


@pytest.mark.parametrize("excess, extra", [(False, ()), (True, ("xla_gpu_dot_merger_threshold_mb=0",))])
def test_step_compiles_with_the_configured_xla_options(excess, extra):
    """``excess_precision`` (default False) reaches the step's XLA options: with XLA's default (True) the
    H200 compile of small()'s step keeps fp32 copies of bf16 activations, 17.9 GB more traffic a
    micro-batch (``benchmarks/layer_glue.py --train small``); the CPU backend rounds either way.
    ``xla_options`` (default none) reach them too, their values typed."""
    cfg = toy.micro_train_config()
    if excess:
        cfg = dataclasses.replace(cfg, excess_precision=True, xla_options=extra)
    else:
        assert cfg.excess_precision is False and cfg.xla_options == ()
    trainer = Trainer(cfg)
    batch = jax.tree.map(jnp.asarray, next(make_data(cfg)))
    lowered = trainer._jit_step.trace(trainer.abstract_state(), batch, trainer.horizon).lower()
    options = dict(lowered._lowering._compiler_options_kvs)
    assert options["xla_allow_excess_precision"] is excess
    assert options.get("xla_gpu_dot_merger_threshold_mb") == (0 if extra else None)


def test_xla_options_are_typed_and_malformed_ones_named():
    options = xla_compiler_options(True, ("xla_gpu_enable_cublaslt=true", "xla_gpu_autotune_level=0",
                                          "xla_gpu_auto_spmd_partitioning_memory_budget_ratio=1.5",
                                          "xla_dump_to=/tmp/x"))
    assert options == {"xla_allow_excess_precision": True, "xla_gpu_enable_cublaslt": True,
                       "xla_gpu_autotune_level": 0, "xla_gpu_auto_spmd_partitioning_memory_budget_ratio": 1.5,
                       "xla_dump_to": "/tmp/x"}
    for bad in ("xla_gpu_enable_cublaslt", "enable_cublaslt=true", "xla_gpu_enable_cublaslt="):
        with pytest.raises(ValueError, match="xla_options entry"):
            dataclasses.replace(toy.micro_train_config(), xla_options=(bad,))


def test_head_is_cast_once_per_step_not_per_micro_batch():
    """The fp32 head's cast to the compute dtype sits outside the micro-batch scan (small(): 1.0 GB of
    traffic a micro-batch on the H200, ``benchmarks/layer_glue.py --train small``)."""
    cfg = dataclasses.replace(toy.micro_train_config(), micro_batches=2, loss_chunk=48)  # [D, V] ≠ [chunk, V]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=80))  # ≠ hidden, to spot the head
    trainer = Trainer(cfg)
    batch = jax.tree.map(jnp.asarray, next(make_data(cfg)))
    jaxpr = jax.make_jaxpr(trainer._grads)(trainer.abstract_state(), batch).jaxpr
    head_shape = (cfg.model.hidden, cfg.model.vocab_size)
    casts = lambda eqns: [e for e in eqns if e.primitive.name == "convert_element_type"
                          and e.outvars[0].aval.shape == head_shape and e.outvars[0].aval.dtype == cfg.model.compute_dtype]
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(casts(jaxpr.eqns)) == 1
    assert not casts(_eqns(scan.params["jaxpr"].jaxpr))
