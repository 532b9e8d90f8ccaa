"""The fused head + cross-entropy: equal to logits-then-CE in value and gradients, bf16 gradient matmuls."""

import jax
import jax.extend
import jax.numpy as jnp
import optax
import pytest

from k3jax.train.config import TrainConfig
from k3jax.train import loss
from k3jax.train.loss import head_cross_entropy
from pallas_kernels.head_ce.reference import CLAMP
from tests.tolerances import rel_rmse

B, T, D, V = 2, 10, 8, 37


def _inputs(dtype):
    k = jax.random.split(jax.random.key(0), 4)
    f = jax.random.normal(k[0], (B, T, D), dtype)
    w = jax.random.normal(k[1], (D, V), dtype)
    y = jax.random.randint(k[2], (B, T), 0, V)
    m = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(dtype)
    return f, w, y, m


def _unfused(f, w, y, m):
    logits = jnp.einsum("BTD,DV->BTV", f, w)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * m)


@pytest.fixture(params=["plain", "shifted"])
def form(request, monkeypatch):
    """Both gradient forms: XLA's plain softmax − onehot, and the shifted exponentials that the head
    kernel's path takes (here through XLA)."""
    monkeypatch.setattr(loss, "_writes_exponentials", lambda *_: request.param == "shifted")
    return request.param


@pytest.mark.parametrize("chunk", [3, 4, 20, 4096])  # padded last chunk, exact chunks, one chunk
def test_value_and_grads_equal_unfused_in_float64(chunk, form):
    with jax.enable_x64(True):
        f, w, y, m = _inputs(jnp.float64)
        fused = lambda f, w, m: 2.5 * head_cross_entropy(f, w, y, m, chunk)
        plain = lambda f, w, m: 2.5 * _unfused(f, w, y, m)
        assert abs(float(fused(f, w, m) - plain(f, w, m))) < 1e-12
        got = jax.grad(fused, argnums=(0, 1, 2))(f, w, m)
        want = jax.grad(plain, argnums=(0, 1))(f, w, m)
        for a, b in zip(got[:2], want):
            assert a.dtype == jnp.float64
            assert float(jnp.max(jnp.abs(a - b))) < 1e-12
        assert float(jnp.max(jnp.abs(got[2]))) == 0.0  # the mask is not a trained input


def test_a_loss_beyond_the_clamp_takes_the_plain_path_and_stays_exact(monkeypatch):
    """A token whose label logit lies more than CLAMP below its row's max (its exponentials would
    be capped) sends its chunk through softmax − onehot: value and gradients still equal the
    unfused loss in float64, masked rows with any logits included."""
    monkeypatch.setattr(loss, "_writes_exponentials", lambda *_: True)
    with jax.enable_x64(True):
        f, w, y, m = _inputs(jnp.float64)
        w = w.at[:, 5].set(40.0 * jnp.sign(f[0, 0]) * jnp.abs(w[:, 5]))  # row (0, 0): logit 5 is huge
        y = y.at[0, 0].set(6).at[1, 3].set(5)
        m = m.at[0, 0].set(1.0).at[1, 3].set(0.0)
        assert float(jnp.max(f[0, 0] @ w) - f[0, 0] @ w[:, 6]) > CLAMP
        for chunk in (4, 20):  # the plain path for the first chunk only, and for the one chunk
            fused = lambda f, w: head_cross_entropy(f, w, y, m, chunk)
            plain = lambda f, w: _unfused(f, w, y, m)
            assert abs(float(fused(f, w) - plain(f, w))) < 1e-12 * abs(float(plain(f, w)))
            for a, b in zip(jax.grad(fused, argnums=(0, 1))(f, w), jax.grad(plain, argnums=(0, 1))(f, w)):
                assert float(jnp.max(jnp.abs(a - b))) < 1e-12 * float(jnp.max(jnp.abs(b)))


def test_bf16_features_close_to_fp32_and_matmuls_in_bf16(form):
    f, w, y, m = _inputs(jnp.float32)
    fused = lambda f, w: head_cross_entropy(f.astype(jnp.bfloat16), w, y, m, 8)
    got = jax.grad(fused, argnums=(0, 1))(f, w)
    want = jax.grad(lambda f, w: _unfused(f, w, y, m), argnums=(0, 1))(f, w)
    assert got[1].dtype == jnp.float32
    for a, b in zip(got, want):
        assert rel_rmse(a, b) < 2e-2  # bf16 operands (SPEC §10)
    dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(fused, argnums=(0, 1)))(f, w).jaxpr)
    # the logits and the two gradient products (shifted: and the plain fallback's three)
    assert len(dots) == (6 if form == "shifted" else 3), dots
    assert all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots


def test_bf16_logits_close_to_fp32_logits():
    f, w, y, m = _inputs(jnp.float32)
    f = f.astype(jnp.bfloat16)
    loss = {d: jax.value_and_grad(lambda f, w: head_cross_entropy(f, w, y, m, 8, d), argnums=(0, 1))(f, w)
            for d in (None, "bfloat16")}
    (v32, g32), (v16, g16) = loss[None], loss["bfloat16"]
    assert abs(float(v16 - v32)) < 2e-2 * abs(float(v32))  # bf16-rounded logits, fp32 softmax
    assert float(v16) != float(v32)  # the option does round the logits
    for a, b in zip(g16, g32):
        assert a.dtype == b.dtype
        assert rel_rmse(a, b) < 2e-2
    logits_dot = _dot_preferred_dtypes(jax.make_jaxpr(lambda f, w: head_cross_entropy(f, w, y, m, 8, "bfloat16"))(f, w).jaxpr)
    assert logits_dot == [jnp.bfloat16], logits_dot  # the matmul itself stores bf16


def test_bad_logits_dtype_is_named():
    f, w, y, m = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="logits_dtype='float16' must be one of"):
        head_cross_entropy(f, w, y, m, 8, "float16")
    with pytest.raises(ValueError, match="loss_logits_dtype='fp8' must be one of"):
        TrainConfig(loss_logits_dtype="fp8")
    with pytest.raises(ValueError, match="loss_implementation='triton' must be one of"):
        TrainConfig(loss_implementation="triton")
    with pytest.raises(ValueError, match="Hopper GPU or interpret=True"):  # no silent fallback to XLA
        head_cross_entropy(f, w, y, m, 8, None, "pallas")


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs (scan bodies, conditional branches)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _dot_preferred_dtypes(jaxpr) -> list:
    return [e.params["preferred_element_type"] for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]


def _dot_operand_dtypes(jaxpr) -> list:
    """Operand dtypes of every dot_general in ``jaxpr`` and its sub-jaxprs (scan bodies)."""
    return [tuple(v.aval.dtype for v in e.invars) for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]


def test_narrow_head_gives_the_same_bits_and_is_checked():
    """A head cast beforehand (the trainer casts it once per step) gives the loss and the gradients
    of the head cast inside, bit for bit; a head of the wrong dtype is named."""
    f, w, y, m = _inputs(jnp.float32)
    f = f.astype(jnp.bfloat16)
    narrow = w.astype(jnp.bfloat16)
    inside = jax.value_and_grad(lambda f, w: head_cross_entropy(f, w, y, m, 4), argnums=(0, 1))(f, w)
    outside = jax.value_and_grad(lambda f, w: head_cross_entropy(f, w, y, m, 4, narrow_head=narrow),
                                 argnums=(0, 1))(f, w)
    for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(outside)):
        assert a.dtype == b.dtype and bool(jnp.all(a == b))
    assert float(head_cross_entropy(f, w, y, m, 4, narrow_head=narrow)) == float(inside[0])
    with pytest.raises(ValueError, match="narrow_head"):
        head_cross_entropy(f, w, y, m, 4, narrow_head=w)


def test_shifted_form_puts_the_label_term_in_the_exponentials(monkeypatch):
    """The shifted form writes each row's ``1 − exp(lse − x_y)`` into its exponentials' label column
    (times the row's scale: ``m (p_y − 1)``), so both gradient products carry the label term and no
    scatter-add runs over d_head's ``[D, V]`` columns; with bf16 features its gradients stay as close
    to fp32 as the plain form's, rows whose label takes almost all the probability included."""
    f, w, y, m = _inputs(jnp.float32)
    w = w.at[:, y[0, :4]].set(3.0 * f[0, :4].T)  # rows (0, 0..3): p_y close to 1
    want = jax.grad(lambda f, w: _unfused(f, w, y, m), argnums=(0, 1))(f, w)
    errors = {}
    for form in ("plain", "shifted"):
        monkeypatch.setattr(loss, "_writes_exponentials", lambda *_, form=form: form == "shifted")
        fused = lambda f, w: head_cross_entropy(f.astype(jnp.bfloat16), w, y, m, 8)
        errors[form] = [rel_rmse(a, b) for a, b in zip(jax.grad(fused, argnums=(0, 1))(f, w), want)]
        names = [e.primitive.name for e in _eqns(jax.make_jaxpr(jax.grad(fused, argnums=(0, 1)))(f, w).jaxpr)]
        if form == "shifted":  # the plain fallback inside the conditional has none either
            assert "scatter-add" not in names and "scatter" in names, names
    for shifted, plain in zip(errors["shifted"], errors["plain"]):
        assert shifted < 1.5 * plain + 1e-4, errors
