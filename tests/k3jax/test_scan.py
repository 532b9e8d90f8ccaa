"""The scanned layer stack (k3jax.layout, k3jax.layers.stack) against the unrolled one.

1. Plans: which runs each preset scans; none when nothing repeats or ``scan_layers`` is off; on random
   kind sequences (hypothesis) the dynamic program's plan is valid and no plan (brute force) beats it.
2. ``to_scanned`` / ``to_per_layer``: inverse, the scanned init's tree, clear errors (the one-run
   layout of earlier k3jax named as such).
3. The real K3 oracle checkpoint (its 10 layers scan layers 1-8 as two units, block pushes traced):
   float64 logits ≤ 1e-12 apart (default suite), gradients ≤ 1e-10 (slow). A 9-layer tiny() of three
   runs (K3's tail pattern): float64 logits ≤ 1e-12 apart, cached decode and its caches equal (slow).
4. A whole train step (per-head Muon, QK-Clip, Quantile Balancing) of tiny(): same loss and
   parameters to fp32 noise. Decode == forward on the scanned stack: tests/k3jax/infer (tiny()
   scans by default); here, that decode updates the stacked caches in place.
"""

import dataclasses
import re

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.convert import load_hf
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_step
from k3jax.layout import ScanPlan, ScanRun, plan_runs, scan_plan, to_per_layer, to_scanned, unrolled
from k3jax.model import Transformer
from tests.tolerances import F32_RTOL, rel_rmse

ORACLE = "/work/shared/oracle/tiny_a"
# K3's tail in miniature: dense KDA, then KDA KDA | MLA | KDA KDA KDA | MLA MLA as three runs of one layer
# (stack_1, stack_4, stack_7) around the unrolled layers 0 and 3; AttnRes blocks of 2 start inside each run.
THREE_RUNS = dataclasses.replace(config.tiny(), num_layers=9, mla_layers=(3, 7, 8))


# K3: layer 0 (dense MLP), 22 units (KDA, KDA, MLA, KDA), then KDA, KDA and MLA, MLA as two runs of one.
@pytest.mark.parametrize("name, runs, traced", [
    ("kimi_k3", [(1, 4, 22), (89, 1, 2), (91, 1, 2)], 7), ("kimi_k2", [(1, 1, 60)], 2),
    ("kimi_linear_48b", [(1, 4, 6)], 7), ("small", [(1, 4, 2), (9, 1, 2)], 7), ("tiny", [(2, 2, 2)], 4)])
def test_preset_plans(name, runs, traced):
    cfg = dataclasses.replace(config.preset(name), scan_layers=True)  # small() is unrolled by default
    plan = scan_plan(cfg)
    assert plan == ScanPlan(tuple(ScanRun(*r) for r in runs), cfg.num_layers) and plan.traced == traced
    assert scan_plan(unrolled(cfg)) is None
    _check_runs(list(zip(cfg.layer_kinds, cfg.moe_layers)), plan.runs)
    assert sorted(l for e in plan.entries for l in ([e] if isinstance(e, int) else range(e.start, e.stop))) \
        == list(range(cfg.num_layers))


def test_no_plan_without_a_repeat():
    assert scan_plan(dataclasses.replace(config.tiny(), num_layers=2)) is None


def _check_runs(kinds, runs):
    """Runs in layer order, disjoint, ≥ 2 repeats, each offset one kind."""
    for run in runs:
        assert run.repeats >= 2 and run.unit >= 1 and 0 <= run.start and run.stop <= len(kinds)
        for r in range(1, run.repeats):
            unit = kinds[run.start:run.start + run.unit]
            assert kinds[run.start + r * run.unit:run.start + (r + 1) * run.unit] == unit
    assert all(a.stop <= b.start for a, b in zip(runs, runs[1:]))


def _all_plans(kinds, start=0):
    """Every plan of ``kinds[start:]`` (brute force): ``(unrolled layers, runs)``."""
    if start == len(kinds):
        yield 0, ()
        return
    for unrolled_, runs in _all_plans(kinds, start + 1):
        yield unrolled_ + 1, runs
    for unit in range(1, (len(kinds) - start) // 2 + 1):
        for repeats in range(2, (len(kinds) - start) // unit + 1):
            run = ScanRun(start, unit, repeats)
            if all(kinds[l] == kinds[start + (l - start) % unit] for l in range(start, run.stop)):
                for unrolled_, runs in _all_plans(kinds, run.stop):
                    yield unrolled_, (run,) + runs


def _key(kinds, runs):
    """The documented order of plans: traced layers, runs, then runs in order by (start, −length, unit)."""
    plan = ScanPlan(runs, len(kinds))
    return plan.traced, len(runs), [(r.start, -(r.stop - r.start), r.unit) for r in runs]


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(st.lists(st.sampled_from("KMD"), max_size=10))
def test_plan_is_a_best_plan(kinds):
    """On random layer kinds: the runs are valid and cover each layer at most once, and no plan of the
    brute force traces fewer layers or ranks before it."""
    runs = plan_runs(tuple(kinds))
    _check_runs(kinds, runs)
    best = min((runs for _, runs in _all_plans(kinds)), key=lambda r: _key(kinds, r))
    assert _key(kinds, runs) == _key(kinds, best) and runs == best


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
    assert scanned["params"]["stack_2"]["offset_1"]["mla"]["kv_b"]["kernel"].shape[0] == 2
    np.testing.assert_array_equal(scanned["balance"]["stack_2"]["offset_0"]["moe"]["bias"][1],
                                  per_layer["balance"]["layers_4"]["moe"]["bias"])
    back = to_per_layer(scanned, cfg)
    assert set(back["params"]) == set(per_layer["params"])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, per_layer))
    with pytest.raises(ValueError, match="already has a 'stack_2'"):
        to_scanned(scanned, cfg)
    broken = {"params": {k: v for k, v in per_layer["params"].items() if k != "layers_4"}}
    with pytest.raises(ValueError, match="lacks 'layers_4'"):
        to_scanned(broken, cfg)
    legacy = {"params": {("stack" if k == "stack_2" else k): v for k, v in scanned["params"].items()}}
    for convert in (to_scanned, to_per_layer):
        with pytest.raises(ValueError, match=r"holds 'stack'/offset_\{j\}: the one-run scanned layout .* stack_2"):
            convert(legacy, cfg)
    with pytest.raises(ValueError, match="holds 'stack_3', not a scanned run of this model"):
        to_per_layer({"params": {"stack_3": {}}}, cfg)


@pytest.fixture(scope="module")
def oracle64():
    with jax.enable_x64(True):
        cfg, v = load_hf(f"{ORACLE}/hf_bf16", dtype=jnp.float64, param_dtype=jnp.float64)
    tokens = jnp.asarray(np.load(f"{ORACLE}/reference.npz")["input_ids"], jnp.int32)
    return cfg, v, tokens


def test_oracle_scanned_equals_unrolled_fp64(oracle64):
    cfg, v, tokens = oracle64
    assert scan_plan(cfg).runs == (ScanRun(1, 4, 2),) and "stack_1" in v["params"]
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
    stacked = {"stack_1": {"offset_0": {"mla": jax.tree.map(lambda x: jnp.stack([x, x]), mla)}}}
    clip = jax.jit(qk_clip, static_argnums=(2, 3))  # one program, not hundreds of eager ops
    new, gammas = clip(stacked, {("stack_1", "offset_0", "mla"): logits}, cfg, 100.0)
    assert gammas[("stack_1", "offset_0", "mla")].shape == (2, 4)
    for r in range(2):
        alone, _ = clip({"layers_1": {"mla": mla}}, {("layers_1", "mla"): logits[r]}, cfg, 100.0)
        got = jax.tree.map(lambda x: x[r], new["stack_1"]["offset_0"]["mla"])
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


def _three_runs_fp64():
    cfg = config.to_float64(THREE_RUNS)
    per_layer = jax.tree.map(lambda x: 0.3 * x, _random_variables(unrolled(cfg)))  # tame activations
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    return cfg, per_layer, tokens


def test_three_runs_scanned_equals_unrolled_fp64():
    """Several runs, AttnRes blocks starting inside each: float64 logits ≤ 1e-12 from the unrolled model."""
    assert [run.start for run in scan_plan(THREE_RUNS).runs] == [1, 4, 7] and scan_plan(THREE_RUNS).unrolled == (0, 3)
    with jax.enable_x64(True):
        cfg, per_layer, tokens = _three_runs_fp64()
        run = lambda c, v: jax.jit(lambda v, t: Transformer(c).apply(v, t))(v, tokens)
        gap = jnp.max(jnp.abs(run(cfg, to_scanned(per_layer, cfg)) - run(unrolled(cfg), per_layer)))
    assert float(gap) <= 1e-12


@pytest.mark.slow
def test_three_runs_decode_equals_unrolled_fp64():
    """A cached decode (prefill from an empty cache) on three runs: the unrolled model's logits, and
    its per-layer caches once each run's stacked caches are split."""
    with jax.enable_x64(True):
        cfg, per_layer, tokens = _three_runs_fp64()
        decode = lambda c, v: decode_step(v, c, tokens, init_cache(c, 2, 16))
        got, scanned_cache = decode(cfg, to_scanned(per_layer, cfg))
        want, flat_cache = decode(unrolled(cfg), per_layer)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-12
    assert len(scanned_cache.layers) == 5  # layers 0 and 3, three runs
    layers = []
    for entry, cache in zip(scan_plan(cfg).entries, scanned_cache.layers):
        if isinstance(entry, int):
            layers.append(cache)
            continue
        rows = {l: jax.tree.map(lambda x, r=r: x[r], cache[j]) for j in range(entry.unit)
                for r, l in enumerate(entry.layers(j))}
        layers += [rows[l] for l in sorted(rows)]
    gaps = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), tuple(layers), flat_cache.layers)
    assert max(jax.tree.leaves(gaps)) <= 1e-12


def test_decode_updates_the_stacked_caches_in_place():
    """Decode steps on the scanned stack write their caches' new rows in place: a compiled loop of
    steps (as `generate` runs them) holds no copy of a stacked KDA state, conv tail or MLA latent, in
    any of its runs. As scanned outputs they were rewritten whole every step; carried without the
    stack's barrier, fusions re-reading an old slice stayed unordered against its write and every
    stacked cache was copied twice per repetition."""
    cfg = THREE_RUNS
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
    stacked = [c for entry, run in zip(cache.layers, plan.entries) if not isinstance(run, int) for c in entry]
    big = {tuple(x.shape) for x in jax.tree.leaves(stacked) if x.ndim >= 3}
    assert len(big) >= 3, "the stacked KDA states and conv tails (2 and 3 repeats) and MLA latents"
    copied = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"\[([0-9,]+)\]\{[^}]*\} copy\(", hlo)}
    assert not big & copied, f"stacked caches copied whole: {sorted(big & copied)}"


@pytest.mark.parametrize("count", [1, 3])
def test_stacked_mix_equals_the_mix_of_its_used_slots_fp64(count):
    """The scanned stream's mix (each term one op on the whole ``[N, B, T, D]`` buffer, unused slots
    masked) against the unrolled mix of the first ``count`` blocks: values and VJP in float64; the
    unused slots get a zero cotangent."""
    from k3jax.layers.attn_res import _mix_stacked, attn_res_mix

    rng = np.random.default_rng(count)
    with jax.enable_x64(True):
        buffer, partial, d, dh = (jnp.asarray(rng.normal(size=s)) for s in ((4, 2, 3, 8), (2, 3, 8), (8,), (2, 3, 8)))
        stacked = lambda b, p, d: _mix_stacked(b, jnp.int32(count), p, d, 1e-5, jnp.float64)
        got, vjp = jax.vjp(stacked, buffer, partial, d)
        want, vjp_want = jax.vjp(lambda b, p, d: attn_res_mix(b, count, p, d, 1e-5, jnp.float64), buffer, partial, d)
        grads, grads_want = vjp(dh), vjp_want(dh)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-13
    for a, b in zip(grads, grads_want):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-12
    assert not jnp.any(grads[0][count:])


def test_first_layers_keeps_the_pattern():
    """``config.first_layers`` (bench_compile / plan ``--layers``): K3's first 11 layers keep their kinds,
    so they scan as K3 does (a unit-of-4 run, then a run of one KDA layer)."""
    cfg = config.first_layers(config.kimi_k3(), 11)
    assert cfg.layer_kinds == config.kimi_k3().layer_kinds[:11] and cfg.hidden == config.kimi_k3().hidden
    assert scan_plan(cfg).runs == (ScanRun(1, 4, 2), ScanRun(9, 1, 2))
    with pytest.raises(ValueError, match=r"n=94 layers must be an int in \[1, num_layers=93\]"):
        config.first_layers(config.kimi_k3(), 94)
