"""Compile-time structure: the init draws once per parameter shape, identical kernels lower once."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import tiny
from k3jax.train.batched_calls import batch_random_draws, batch_scans
from k3jax.train.config import DataConfig, TrainConfig
from k3jax.train.step import Trainer
from tests.tolerances import INIT_MAX_ULP

ROOT = pathlib.Path(__file__).resolve().parents[3]
DRAWS = ("random_bits", "random_fold_in", "random_split")


def _count_draws(jaxpr, names=DRAWS) -> int:
    """Equations named ``names`` (default: random primitives, each lowers to its own threefry) in
    ``jaxpr`` and every jaxpr nested in it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in names
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _count_draws(sub, names)
    return n


def _trainer(num_layers=4, first_dense_layers=1, scan_layers=True):
    model = dataclasses.replace(tiny(), num_layers=num_layers, vocab_size=64, scan_layers=scan_layers)
    model = dataclasses.replace(model, mlp=dataclasses.replace(model.mlp, first_dense_layers=first_dense_layers))
    return Trainer(TrainConfig(model=model, batch_size=1, seq_len=16, steps=2, data=DataConfig(source="random")))


def _draws(key):
    """Same-shaped draws from distinct keys, a chained key, and a scale that XLA could fold."""
    keys = [jax.random.fold_in(key, i) for i in range(5)]
    out = [0.02 * jax.random.normal(k, (6, 4)) for k in keys]
    out += [jax.random.uniform(k, (3,), minval=-1.0) for k in keys[:3]]
    out.append(jax.random.truncated_normal(jax.random.split(keys[0])[1], -2.0, 2.0, (5, 2)))
    return out


def test_batched_draws_equal_op_by_op_draws():
    want = _draws(jax.random.key(7))  # un-jitted: every value rounded as the op-by-op program does
    chex.assert_trees_all_equal(jax.jit(batch_random_draws(_draws))(jax.random.key(7)), want, strict=True)
    jaxpr = jax.make_jaxpr(batch_random_draws(_draws))(jax.random.key(7)).jaxpr
    assert _count_draws(jaxpr) < _count_draws(jax.make_jaxpr(_draws)(jax.random.key(7)).jaxpr)


def test_batch_size_cap_splits_batches():
    key = jax.random.key(7)
    want = _draws(key)
    capped = batch_random_draws(_draws, max_batch_bytes=2 * 6 * 4 * 4)  # two of the (6, 4) float32 draws
    chex.assert_trees_all_equal(jax.jit(capped)(key), want, strict=True)
    count = lambda f: _count_draws(jax.make_jaxpr(f)(key).jaxpr)
    assert count(batch_random_draws(_draws)) < count(capped) < count(_draws)


def test_trainer_init_matches_flax_init():
    # One KDA + MoE layer keeps the compile short; its q/k/v/g and w1/w2/w3 still share shapes.
    trainer = _trainer(num_layers=1, first_dense_layers=0)
    flax_init = jax.jit(lambda k: nn.unbox(trainer._init_boxed(k)))(jax.random.key(3))
    state = jax.jit(trainer._init)(jax.random.key(3))
    ours = {"params": state.params, "balance": state.balance}
    chex.assert_trees_all_equal_shapes_and_dtypes(ours, flax_init)
    # Same keys, same draws; the jitted flax init folds the scale into the draw (1 ulp apart).
    jax.tree.map(lambda g, w: np.testing.assert_array_max_ulp(np.asarray(g), np.asarray(w), maxulp=INIT_MAX_ULP),
                 ours, flax_init)


def test_trainer_init_draws_once_per_parameter_shape():
    # Unrolled, every layer's leaves are separate draws that batching merges by shape; the scanned
    # stack's leaves are drawn inside its scan, one draw per stacked leaf, which batching cannot merge.
    trainer = _trainer(scan_layers=False)
    shapes = {leaf.shape for leaf in jax.tree.leaves(trainer.abstract["params"])}
    ours = _count_draws(jax.make_jaxpr(trainer._init)(jax.random.key(0)).jaxpr)
    flax_draws = _count_draws(jax.make_jaxpr(lambda k: trainer._init_boxed(k))(jax.random.key(0)).jaxpr)
    assert flax_draws > 2 * len(shapes)  # the model repeats shapes, so batching has work to do
    assert ours <= len(shapes) + 2  # + the batched fold_in of every key and the root split


def test_batched_muon_update_equals_optax():
    trainer = _trainer(num_layers=2)
    params = jax.jit(trainer._init)(jax.random.key(0)).params
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p + 0.1), params)
    opt_state = trainer.tx.init(params)
    want = jax.jit(trainer.tx.update)(grads, opt_state, params)
    got = jax.jit(batch_scans(trainer.tx.update))(grads, opt_state, params)
    chex.assert_trees_all_equal(got, want, strict=True)
    dots = lambda f: _count_draws(jax.make_jaxpr(f)(grads, opt_state, params).jaxpr, ("dot_general",))
    assert 2 * dots(batch_scans(trainer.tx.update)) < dots(trainer.tx.update)


def test_identical_kernels_lower_once():
    """A 4-layer step (KDA, MLA, KDA, MLA) lowered for CUDA holds one Mosaic GPU module per distinct
    kernel (forward, remat recompute and both layers of a kind share it), so the Mosaic GPU runtime
    compiles each once."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "tests/k3jax/train/cuda_lowering_worker.py"), "128"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # KDA: the fused prep forward, the scan, and the default split prep backward (two kernels);
    # MoE: two shapes of each grouped-matmul kernel, the [W1 | W3] product (width 2F) and W2's (the
    # weight gradient's default tiling is the slot ring, and the forward's at this K of <= 8 steps);
    # MLA: the flash forward (its backward kernels are Pallas-Triton); the loss: the head kernel
    # (``loss_implementation=None`` takes it on Hopper) writing the shifted exponentials, and writing
    # the logits for the plain fallback (a loss beyond CLAMP), one module each for every chunk
    assert result["modules"] == {"kda_prep_fwd": 1, "kda_scan_fwd": 1, "kda_scan_bwd": 1, "kda_prep_bwd_wy": 1,
                                 "kda_prep_bwd_intra": 1, "moe_gmm_ring": 2, "moe_gmm_transposed": 2,
                                 "moe_tgmm_ring": 2, "mla_flash_fwd_mgpu": 1, "head_exps_lse": 1,
                                 "head_logits_lse": 1}
