"""Model invariants on tiny(): outputs and statistics, jit == eager, packing, causality, dtypes, bad input."""

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.layout import to_per_layer
from k3jax.model import Transformer
from tests.tolerances import BF16_MODEL_RTOL, F32_RTOL, rel_rmse

B, T = 2, 16


def _tokens(seed, shape=(B, T), vocab=256):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, vocab, dtype=jnp.int32)


def test_outputs_and_stats(tiny_model):
    cfg = tiny_model.cfg
    (logits, hidden), mut = tiny_model.forward(_tokens(0))
    chex.assert_shape([logits, hidden], [(B, T, cfg.vocab_size), (B, T, cfg.hidden)])
    chex.assert_type([logits, hidden], jnp.float32)
    chex.assert_tree_all_finite((logits, hidden))
    stats = to_per_layer({"stats": mut["stats"]}, cfg)["stats"]  # tiny() scans layers 2-5
    for i, (kind, is_moe) in enumerate(zip(cfg.layer_kinds, cfg.moe_layers)):
        layer = stats.get(f"layers_{i}", {})
        if is_moe:
            (loads,), (hist,) = layer["moe"]["loads"], layer["moe"]["hist"]
            assert int(loads.sum()) == B * T * cfg.moe.top_k
            chex.assert_shape(hist, (cfg.moe.num_experts, cfg.balance.num_bins))
            assert int(hist.sum()) == B * T * cfg.moe.num_experts
        else:
            assert "moe" not in layer
        assert ("mla" in layer) == (kind is config.LayerKind.MLA)
        if kind is config.LayerKind.MLA:
            (max_logit,) = layer["mla"]["max_logit"]
            chex.assert_shape(max_logit, (cfg.mla.num_heads,))
            chex.assert_tree_all_finite(max_logit)
    bias = tiny_model.variables["balance"]["layers_1"]["moe"]["bias"]
    assert bias.shape == (cfg.moe.num_experts,) and not bias.any()
    assert "stats" not in tiny_model.variables


def test_jit_equals_eager(tiny_model):
    """Eager dispatch is slow, so compare on a 2-layer model (KDA + dense, MLA + MoE) cut from tiny()."""
    cfg = dataclasses.replace(tiny_model.cfg, num_layers=2, mla_layers=(1,))
    per_layer = to_per_layer(tiny_model.variables, tiny_model.cfg)
    params, balance = per_layer["params"], per_layer["balance"]
    variables = {
        "params": {**{k: v for k, v in params.items() if not k.startswith("layers_")},
                   "layers_0": params["layers_0"], "layers_1": params["layers_3"]},  # tiny()'s layer 3 is MLA + MoE
        "balance": {"layers_1": balance["layers_3"]},
    }
    model = Transformer(cfg)
    tokens = _tokens(1, (1, 8))
    with jax.default_matmul_precision("highest"):
        jitted = jax.jit(model.apply)(variables, tokens)
        eager = model.apply(variables, tokens)
    assert rel_rmse(eager, jitted) <= F32_RTOL


def test_packed_documents_equal_separate_runs(tiny_model):
    """A row packing documents A and B (segment_ids) equals A and B each run alone.

    "Alone" is the prefix of an unsegmented row (causality makes the suffix irrelevant), so
    every run shares one compiled [2, 16] forward.
    """
    a, b = _tokens(2, (9,)), _tokens(3, (7,))
    packed = jnp.stack([jnp.concatenate([a, b]), jnp.concatenate([b, a])])
    seg = jnp.asarray([[0] * 9 + [1] * 7, [0] * 7 + [1] * 9], jnp.int32)
    (out, _), _ = tiny_model.forward(packed, seg)
    (alone, _), _ = tiny_model.forward(packed, jnp.zeros_like(seg))  # row 0 starts with A, row 1 with B
    assert rel_rmse(out[0, :9], alone[0, :9]) <= F32_RTOL
    assert rel_rmse(out[0, 9:], alone[1, :7]) <= F32_RTOL  # B after A == B alone
    assert rel_rmse(out[1, 7:], alone[0, :9]) <= F32_RTOL  # A after B == A alone
    assert rel_rmse(out[1, :7], alone[1, :7]) <= F32_RTOL
    assert rel_rmse(alone[0, 9:], out[0, 9:]) > 1e-3  # without segment_ids, B does see A


def test_causality_by_gradient(tiny_model):
    """d logits[:, t] / d embeddings[:, s] == 0 exactly for every s > t."""
    model = Transformer(tiny_model.cfg)
    x = model.apply(tiny_model.variables, _tokens(4), method=lambda m, t: m.embed(t))

    @jax.jit
    def embedding_grad(x, t):
        f = lambda x: model.apply(tiny_model.variables, x, method=Transformer.from_embeddings)
        logits, vjp = jax.vjp(f, x)
        cot = jnp.zeros_like(logits).at[:, t].set(1.0)
        return vjp(cot)[0]  # [B, T, D]

    for t in (0, 6, 13):
        g = np.asarray(embedding_grad(x, t))
        assert np.all(g[:, t + 1:] == 0.0), f"logits at {t} depend on later tokens"
        assert np.abs(g[:, t]).max() > 0 and (t == 0 or np.abs(g[:, :t]).max() > 0)


def test_bf16_long_sequence_close_to_fp32(tiny_model):
    """tiny() at T=4096: the default bf16 compute is finite and tracks float32."""
    tokens = _tokens(5, (1, 4096))
    bf16 = config.tiny()
    assert jnp.dtype(bf16.dtype) == jnp.bfloat16
    run = lambda cfg: jax.jit(lambda v, t: Transformer(cfg).apply(v, t))(tiny_model.variables, tokens)
    lo, hi = run(bf16), run(tiny_model.cfg)
    chex.assert_tree_all_finite(lo)
    assert rel_rmse(lo, hi) <= BF16_MODEL_RTOL


def _float_dtypes(jaxpr) -> set:
    found = set()
    for eqn in jaxpr.eqns:
        for var in list(eqn.invars) + list(eqn.outvars):
            dtype = getattr(getattr(var, "aval", None), "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                found.add(jnp.dtype(dtype))
        for sub in _sub_jaxprs(eqn.params):
            found |= _float_dtypes(sub)
    return found


def _sub_jaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def test_float64_model_stays_float64():
    """to_float64: every floating intermediate of the forward pass (and the outputs) is float64."""
    with jax.enable_x64(True):
        cfg = config.to_float64(config.tiny())
        model = Transformer(cfg)
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        variables = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens))
        assert {jnp.dtype(v.dtype) for v in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float64)}
        fwd = lambda v, t: model.apply(v, t, return_hidden=True, mutable=["stats"])
        closed = jax.make_jaxpr(fwd)(variables, tokens)
        assert _float_dtypes(closed.jaxpr) == {jnp.dtype(jnp.float64)}


@pytest.mark.unchecked
def test_bad_inputs_raise_value_error():
    cfg = config.tiny()
    model = Transformer(cfg)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 4), jnp.int32))
    ok = jnp.zeros((1, 4), jnp.int32)
    cases = {
        "integer dtype": jnp.zeros((1, 4), jnp.float32),
        r"\[B, T\]": jnp.zeros((4,), jnp.int32),
        "max_position=8192": jnp.zeros((1, cfg.max_position + 1), jnp.int32),
        "vocab_size=256": jnp.asarray([[0, 1, 256, 3]], jnp.int32),
    }
    for match, tokens in cases.items():
        with pytest.raises(ValueError, match=match):
            model.apply(variables, tokens)
    with pytest.raises(ValueError, match="vocab_size=256"):
        model.apply(variables, -ok - 1)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\] = \(1, 4\)"):
        model.apply(variables, ok, segment_ids=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must have an integer dtype"):
        model.apply(variables, ok, segment_ids=jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="remat='everything' must be one of"):
        Transformer(cfg, remat="everything").apply(variables, ok)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["layer", "moe"])
def test_remat_equals_no_remat(tiny_model, remat):
    """Loss and gradients (and the sown statistics) do not depend on rematerialisation."""
    tokens, v = _tokens(6), tiny_model.variables

    def loss_and_grad(model):
        def loss(params):
            logits, stats = model.apply({"params": params, "balance": v["balance"]}, tokens, mutable=["stats"])
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), stats
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(v["params"])

    (l0, s0), g0 = loss_and_grad(Transformer(tiny_model.cfg))
    (l1, s1), g1 = loss_and_grad(Transformer(tiny_model.cfg, remat=remat))
    assert float(l0) == pytest.approx(float(l1), rel=1e-6)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):  # loads/histograms exact, max logits rounded
        assert np.array_equal(a, b) if jnp.issubdtype(a.dtype, jnp.integer) else rel_rmse(b, a) <= F32_RTOL
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert rel_rmse(b, a) <= F32_RTOL
