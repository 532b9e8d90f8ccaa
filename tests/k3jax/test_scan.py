"""The scanned layer stack (k3jax.layout, k3jax.layers.stack) against the unrolled one.

1. Plans: which run each preset scans; none when nothing repeats or ``scan_layers`` is off.
2. ``to_scanned`` / ``to_per_layer``: inverse, the scanned init's tree, clear errors.
3. The real K3 oracle checkpoint (its 10 layers scan layers 1-8 as two units, block pushes traced):
   float64 logits ≤ 1e-12 apart (default suite), gradients ≤ 1e-10 (slow).
4. A whole train step (per-head Muon, QK-Clip, Quantile Balancing) of tiny(): same loss and
   parameters to fp32 noise. Decode == forward on the scanned stack: tests/k3jax/infer (tiny()
   scans by default); here, that decode updates the stacked caches in place.
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.convert import load_hf
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_step
from k3jax.layout import ScanPlan, scan_plan, to_per_layer, to_scanned, unrolled
from k3jax.model import Transformer
from tests.tolerances import F32_RTOL, rel_rmse

ORACLE = "/work/shared/oracle/tiny_a"


@pytest.mark.parametrize("name, plan", [("kimi_k3", ScanPlan(1, 4, 22)), ("kimi_k2", ScanPlan(1, 1, 60)),
                                        ("kimi_linear_48b", ScanPlan(1, 4, 6)), ("small", ScanPlan(1, 4, 2)),
                                        ("tiny", ScanPlan(2, 2, 2))])
def test_preset_plans(name, plan):
    cfg = config.preset(name)
    assert scan_plan(cfg) == plan
    assert scan_plan(unrolled(cfg)) is None
    kinds = list(zip(cfg.layer_kinds, cfg.moe_layers))
    for j in range(plan.unit):
        assert len({kinds[l] for l in plan.layers(j)}) == 1  # one kind per offset


def test_no_plan_without_a_repeat():
    assert scan_plan(dataclasses.replace(config.tiny(), num_layers=2)) is None


def _random_variables(cfg):
    """Random values in the tree of ``cfg``'s init (no init compile)."""
    shapes = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), shapes)


def test_layout_round_trip():
    cfg = config.tiny()
    per_layer = _random_variables(unrolled(cfg))
    scanned = to_scanned(per_layer, cfg)
    want = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
    assert shapes(scanned) == shapes(nn.unbox(want))
    assert scanned["params"]["stack"]["offset_1"]["mla"]["kv_b"]["kernel"].shape[0] == 2
    np.testing.assert_array_equal(scanned["balance"]["stack"]["offset_0"]["moe"]["bias"][1],
                                  per_layer["balance"]["layers_4"]["moe"]["bias"])
    back = to_per_layer(scanned, cfg)
    assert set(back["params"]) == set(per_layer["params"])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, per_layer))
    with pytest.raises(ValueError, match="already has a 'stack'"):
        to_scanned(scanned, cfg)
    broken = {"params": {k: v for k, v in per_layer["params"].items() if k != "layers_4"}}
    with pytest.raises(ValueError, match="lacks 'layers_4'"):
        to_scanned(broken, cfg)


@pytest.fixture(scope="module")
def oracle64():
    with jax.enable_x64(True):
        cfg, v = load_hf(f"{ORACLE}/hf_bf16", dtype=jnp.float64, param_dtype=jnp.float64)
    tokens = jnp.asarray(np.load(f"{ORACLE}/reference.npz")["input_ids"], jnp.int32)
    return cfg, v, tokens


def test_oracle_scanned_equals_unrolled_fp64(oracle64):
    cfg, v, tokens = oracle64
    assert scan_plan(cfg) == ScanPlan(1, 4, 2) and "stack" in v["params"]
    with jax.enable_x64(True):
        run = lambda c: jax.jit(lambda v, t: Transformer(c).apply(v, t))
        scanned = run(cfg)(v, tokens)
        per_layer = run(unrolled(cfg))(to_per_layer(v, cfg), tokens)
    assert scanned.dtype == jnp.float64
    assert float(jnp.max(jnp.abs(scanned - per_layer))) <= 1e-12


@pytest.mark.slow
def test_oracle_scanned_gradients_equal_unrolled_fp64(oracle64):
    cfg, v, tokens = oracle64
    with jax.enable_x64(True):
        # Non-zero AttnRes queries, so that every mix (and its masked slots) carries a gradient.
        v = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 * jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
            if "query" in jax.tree_util.keystr(p) else x, v)
        loss = lambda c: jax.jit(jax.grad(lambda v, t: jnp.sum(jnp.sin(Transformer(c).apply(v, t)))))
        scanned = loss(cfg)(v, tokens)
        per_layer = to_scanned(loss(unrolled(cfg))(to_per_layer(v, cfg), tokens), cfg)
    # Per leaf, the largest difference relative to the leaf's largest gradient: the loss sums over every
    # position and vocab entry, so absolute gaps grow with the gradients (measured ≤ 3.6e-9 absolute).
    gaps = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / max(float(jnp.max(jnp.abs(b))), 1e-30)),
                        scanned, per_layer)
    assert max(jax.tree.leaves(gaps)) <= 1e-10, gaps


@pytest.mark.slow
def test_train_step_scanned_equals_unrolled():
    from k3jax.train.loop import make_data
    from k3jax.train.step import Trainer, TrainState
    from tests.k3jax.train import toy

    toy.use_compilation_cache()
    model = dataclasses.replace(config.tiny(), vocab_size=64, dtype=jnp.float32)
    cfg = toy.micro_train_config(model=model, batch_size=2)
    flat, stacked = Trainer(dataclasses.replace(cfg, model=unrolled(model))), Trainer(cfg)
    rng = np.random.default_rng(0)  # random values, not the init: its compile would dominate the test
    params = jax.tree_util.tree_map_with_path(
        lambda p, s: jnp.asarray((p[-1].key == "scale") + 0.1 * rng.normal(size=s.shape), s.dtype),
        flat.abstract["params"])
    balance = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), flat.abstract["balance"])

    def state(trainer, params, balance):  # distinct buffers: the step donates its state
        zero = jnp.zeros([], jnp.int32)
        return jax.tree.map(jnp.copy, TrainState(step=zero, params=params, opt_state=trainer.tx.init(params),
                                                 balance=balance, nonfinite_streak=zero, nonfinite_total=zero))

    scan = lambda tree, name: {"model": to_scanned({name: tree["model"]}, model)[name]}
    batch = next(make_data(cfg))
    with jax.default_matmul_precision("highest"):
        new, metrics = flat.step(state(flat, params, balance), batch)
        new_s, metrics_s = stacked.step(state(stacked, scan(params, "params"), scan(balance, "balance")), batch)
    np.testing.assert_allclose(metrics_s["loss"], metrics["loss"], rtol=F32_RTOL)
    np.testing.assert_allclose(metrics_s["grad_norm"], metrics["grad_norm"], rtol=10 * F32_RTOL)
    want = {"params": scan(new.params, "params"), "balance": scan(new.balance, "balance")}
    got = {"params": new_s.params, "balance": new_s.balance}
    flat_leaves = lambda t: jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)])
    assert rel_rmse(flat_leaves(got), flat_leaves(want)) <= 10 * F32_RTOL


def test_qk_clip_on_stacked_layers():
    """QK-Clip of a stacked MLA ``[R, …]`` with max logits ``[R, H]`` clips each layer as on its own."""
    from k3jax.train.qk_clip import qk_clip
    from tests.k3jax.train.test_qk_clip import MLA as cfg
    from tests.k3jax.train import toy

    mla = nn.unbox(toy.boxed_params())["layers_1"]["mla"]
    logits = jnp.asarray([[1.0, 1.0, 1.0, 1.0], [1.0, 400.0, 1.0, 1.0]])
    stacked = {"stack": {"offset_0": {"mla": jax.tree.map(lambda x: jnp.stack([x, x]), mla)}}}
    clip = jax.jit(qk_clip, static_argnums=(2, 3))  # one program, not hundreds of eager ops
    new, gammas = clip(stacked, {("stack", "offset_0", "mla"): logits}, cfg, 100.0)
    assert gammas[("stack", "offset_0", "mla")].shape == (2, 4)
    for r in range(2):
        alone, _ = clip({"layers_1": {"mla": mla}}, {("layers_1", "mla"): logits[r]}, cfg, 100.0)
        got = jax.tree.map(lambda x: x[r], new["stack"]["offset_0"]["mla"])
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, alone["layers_1"]["mla"]))


def test_muon_treats_the_layer_axis_as_batch():
    from k3jax.train.optimizer import muon_dimension_numbers

    params = {"q_proj": {"kernel": jnp.zeros((2, 8, 4, 3))}, "b_proj": {"kernel": jnp.zeros((2, 8, 4))},
              "norm": {"scale": jnp.zeros((2, 8))}}
    axes = {"q_proj": {"kernel": ("layers", "embed", "heads", "head_dim")},
            "b_proj": {"kernel": ("layers", "embed", "heads")}, "norm": {"scale": ("layers", "embed")}}
    dims = muon_dimension_numbers(params, axes)
    q, b = dims["q_proj"]["kernel"], dims["b_proj"]["kernel"]
    assert (tuple(q.reduction_axis), tuple(q.output_axis)) == ((1,), (3,))  # per layer, per head
    assert (tuple(b.reduction_axis), tuple(b.output_axis)) == ((1,), (2,))  # per layer, [D, H] whole
    assert dims["norm"]["scale"] is None


def test_decode_updates_the_stacked_caches_in_place():
    """Decode steps on the scanned stack write their caches' new rows in place: a compiled loop of
    steps (as `generate` runs them) holds no copy of a stacked KDA state, conv tail or MLA latent.
    As scanned outputs they were rewritten whole every step; carried without the stack's barrier,
    fusions re-reading an old slice stayed unordered against its write and every stacked cache was
    copied twice per repetition (the H200 decode profile's `memcpy` kernels)."""
    cfg = config.tiny()
    plan = scan_plan(cfg)
    variables = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 64))

    def steps(v, tok, c):
        def body(_, carry):
            logits, c = decode_step(v, cfg, carry[0], carry[1])
            return jnp.argmax(logits, -1).astype(jnp.int32), c
        return jax.lax.fori_loop(0, 2, body, (tok, c))

    hlo = jax.jit(steps, donate_argnums=(2,)).lower(
        variables, jax.ShapeDtypeStruct((2, 1), jnp.int32), cache).compile().as_text()
    big = {tuple(x.shape) for x in jax.tree.leaves(cache.layers) if x.ndim >= 3 and x.shape[0] == plan.repeats}
    assert big, "the tiny() cache has stacked leaves"
    copied = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"\[([0-9,]+)\]\{[^}]*\} copy\(", hlo)}
    assert not big & copied, f"stacked caches copied whole: {sorted(big & copied)}"
