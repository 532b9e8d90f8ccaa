"""The training step: one jitted, donated ``train_step(state, batch) -> (state, metrics)``.

1. Split the global batch into ``micro_batches`` and accumulate gradients with ``lax.scan``; each
   micro-batch's loss is normalised by the *whole* batch's target count, so the summed gradient is
   exactly the gradient of the big batch.
2. Loss = CE(logits, labels) + λ/D · Σ_j CE_j (MTP depth j; SPEC §8), fp32, masked by ``loss_mask``;
   every CE applies the shared head itself, chunk by chunk (``k3jax.train.loss``).
3. Statistics sown by the forward (router loads, QB histograms or margins, MLA max logits) are
   combined over micro-batches (`k3jax.train.stats`).
4. A non-finite loss or gradient norm skips the update, QK-Clip and QB, and is counted.
5. Optimizer (clip → per-head Muon / AdamW) → QK-Clip from the max logits (SPEC §7) → Quantile
   Balancing of every router bias from the step's statistics (SPEC §6).

A batch is ``{tokens, segment_ids, labels: [B, T] int32, loss_mask: [B, T]}`` with ``labels[:, i]``
the target at position i (the next token) and ``loss_mask`` 0 where there is none.
"""

from __future__ import annotations

import contextlib
import math
import typing
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from k3jax.model import Transformer
from k3jax.train import stats as st
from k3jax.train.batched_calls import batch_random_draws, batch_scans
from k3jax.train.config import TrainConfig, xla_compiler_options
from k3jax.train.loss import head_cross_entropy
from k3jax.train.metrics import ep_metrics
from k3jax.train.mtp import MTP, mtp_targets
from k3jax.train.optimizer import logical_axes, make_optimizer
from k3jax.train.qk_clip import max_logits_from_stats, qk_clip
from k3jax.train.schedule import Horizon, learning_rate, make_horizon

BATCH_KEYS = ("tokens", "segment_ids", "labels", "loss_mask")
_INIT_TOKENS = 64  # parameter shapes do not depend on T; keep init cheap


# A pytree that JAX rebuilds with other leaves (numpy after device_get, ShapeDtypeStructs, shardings):
# the field annotations document it and are not checked when one is built (pytest's run-time checks).
@typing.no_type_check
class TrainState(flax.struct.PyTreeNode):
    """Everything that changes during training (the data iterator's position lives with the host)."""

    step: jax.Array  # int32: batches consumed
    params: Any  # {"model": docs/params.md tree, "mtp": MTP tree (when cfg.mtp.num_layers > 0)}
    opt_state: Any
    balance: Any  # {"model": router biases, "mtp": …}
    nonfinite_streak: jax.Array  # int32: consecutive skipped steps
    nonfinite_total: jax.Array  # int32: skipped steps so far


def _matmul_precision(precision: str | None, tree):
    """Newton–Schulz's matmul precision (``OptimizerConfig.ns_precision``); float64 runs keep the default."""
    wide = any(x.dtype == jnp.float64 for x in jax.tree.leaves(tree))
    return contextlib.nullcontext() if precision is None or wide else jax.default_matmul_precision(precision)


class Trainer:
    """Model, MTP, optimizer and the jitted step for one ``TrainConfig`` (and optional mesh)."""

    def __init__(self, cfg: TrainConfig, mesh=None):
        self.cfg = cfg
        self.model = Transformer(cfg.model, remat=cfg.remat)
        self.mtp = MTP(cfg.model, remat=cfg.remat) if cfg.model.mtp.num_layers else None
        # The run length is an argument of the jitted step, not a constant in it (k3jax.train.schedule).
        self.horizon = make_horizon(cfg.schedule, cfg.steps)
        self.mesh = mesh
        with self._init_target():
            boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        self.axes = {"params": logical_axes(boxed["params"]), "balance": logical_axes(boxed["balance"])}
        self.abstract = nn.unbox(boxed)
        self.tx = self.optimizer(self.horizon)
        self.shardings = None
        if mesh is not None:
            from k3jax.train.parallel import state_and_batch_shardings

            self.shardings = state_and_batch_shardings(self, mesh)
        self._jit_step = self._build_step()

    def schedule(self, step, horizon: Horizon | None = None) -> jax.Array:
        """The learning rate at optimizer step ``step`` (``horizon``: default this run's)."""
        horizon = self.horizon if horizon is None else horizon
        return learning_rate(self.cfg.schedule, self.cfg.optimizer.learning_rate, horizon, step)

    def optimizer(self, horizon: Horizon) -> optax.GradientTransformation:
        """The optimizer on the schedule of ``horizon`` (its state does not depend on it)."""
        return make_optimizer(self.cfg.optimizer, lambda step: self.schedule(step, horizon), self.abstract["params"],
                              self.axes["params"])

    # ---------------------------------------------------------------- init
    def _init_boxed(self, rng):
        cfg = self.cfg.model
        tokens = jnp.zeros((1, min(self.cfg.seq_len, _INIT_TOKENS)), jnp.int32)
        k_model, k_mtp = jax.random.split(rng)
        variables = self.model.init(k_model, tokens)
        params, balance = {"model": variables["params"]}, {"model": variables.get("balance", {})}
        if self.mtp is not None:
            unboxed = nn.unbox(variables["params"])
            hidden = jnp.zeros(tokens.shape + (cfg.hidden,), cfg.compute_dtype)
            mtp_vars = self.mtp.init(k_mtp, hidden, tokens, unboxed["embed"]["embedding"], None)
            params["mtp"], balance["mtp"] = mtp_vars["params"], mtp_vars.get("balance", {})
        return {"params": params, "balance": balance}

    @staticmethod
    def _head(model_params):
        return model_params["head"]["kernel"] if "head" in model_params else model_params["embed"]["embedding"].T

    def _init(self, rng: jax.Array) -> TrainState:
        # One vmapped draw per distinct parameter shape instead of one per parameter: the values of the
        # op-by-op flax init bit for bit, at a fraction of the compile time (k3jax.train.batched_calls).
        v = nn.unbox(batch_random_draws(self._init_boxed)(rng))
        zero = jnp.zeros([], jnp.int32)
        return TrainState(step=zero, params=v["params"], opt_state=self.tx.init(v["params"]),
                          balance=v["balance"], nonfinite_streak=zero, nonfinite_total=zero)

    def init_state(self, rng: jax.Array) -> TrainState:
        """A fresh state (sharded on the mesh when there is one)."""
        # Traced outside the parallel context: init runs the model on one short row, which the
        # expert- and context-parallel paths would reject; parameters land sharded all the same.
        # Without a mesh the state is committed to the first device, as a restored one is: the step
        # then lowers to one program for both, which the persistent compilation cache serves on resume.
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        out = one if self.shardings is None else self.shardings["state"]
        with self._init_target():
            return jax.jit(self._init, out_shardings=out)(rng)

    def abstract_state(self) -> TrainState:
        """``ShapeDtypeStruct`` tree of the state (with shardings on a mesh): the restore target."""
        with self._init_target():
            abstract = jax.eval_shape(self._init, jax.random.key(0))
        if self.shardings is None:
            return abstract
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, self.shardings["state"])

    def _init_target(self):
        """Init is traced outside the mesh context, but for the mesh's devices: the kernel ops pick
        their implementation for those (an ahead-of-time compile for TPUs on a CPU host)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        from pallas_kernels.target import compile_for

        return compile_for(self.mesh.devices.flat[0])

    def _context(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        import sharding

        return sharding.use_mesh(self.mesh, self.shardings["rules"])

    # ---------------------------------------------------------------- loss
    def _head_ce(self, features, model_params, labels, mask, narrow_head=None):
        """The fused head + CE sum; on a mesh each device walks only its own tokens (under plain
        jit XLA would gather the token-sharded features and run the head for the whole batch on
        every device). ``narrow_head``: the head already in the compute dtype (`_narrow_head`)."""
        head = self._head(model_params)
        if self.mesh is None:
            return head_cross_entropy(features, head, labels, mask, self.cfg.loss_chunk, self.cfg.loss_logits_dtype,
                                      self.cfg.loss_implementation, False, narrow_head)
        from sharding.reduce import head_cross_entropy_sharded

        return head_cross_entropy_sharded(features, head, labels, mask, self.cfg.loss_chunk,
                                          logits_dtype=self.cfg.loss_logits_dtype,
                                          implementation=self.cfg.loss_implementation)

    def _narrow_head(self, params):
        """The head in the compute dtype, cast once per step for every micro-batch's loss (without a
        mesh; None on one: the sharded loss casts its own). No gradient flows through it: the
        loss's gradient reaches the fp32 head itself (`head_cross_entropy`)."""
        if self.mesh is not None:
            return None
        return jax.lax.stop_gradient(self._head(params["model"]).astype(self.cfg.model.compute_dtype))

    def loss(self, params, balance, batch, denom, mtp_denoms, narrow_head=None):
        """(objective, aux) of one micro-batch; the objective is pre-divided by the global counts.
        ``narrow_head``: `_narrow_head` of ``params`` (None: cast here)."""
        mcfg = self.cfg.model
        seg = batch["segment_ids"]
        mask = batch["loss_mask"].astype(jnp.float32)
        variables = {"params": params["model"], "balance": balance["model"]}
        (features, hidden), mut = self.model.apply(variables, batch["tokens"], segment_ids=seg,
                                                   method="features", mutable=["stats"])
        ce = self._head_ce(features, params["model"], batch["labels"], mask, narrow_head)
        stats = {"model": st.combine_stats(mut.get("stats", {}))}
        objective = ce / denom
        mtp_ce = []
        if self.mtp is not None:
            mtp_vars = {"params": params["mtp"], "balance": balance["mtp"]}
            all_features, mut = self.mtp.apply(mtp_vars, hidden, batch["labels"],
                                               params["model"]["embed"]["embedding"], seg, mutable=["stats"])
            weight = mcfg.mtp.loss_weight / mcfg.mtp.num_layers
            for j, depth_features in enumerate(all_features, start=1):
                _, target, depth_mask = mtp_targets(batch["labels"], mask, seg, j)
                mtp_ce.append(self._head_ce(depth_features, params["model"], target, depth_mask, narrow_head))
                objective = objective + weight * mtp_ce[-1] / mtp_denoms[j - 1]
            stats["mtp"] = st.combine_stats(mut.get("stats", {}))
        aux = {"ce": ce, "mtp_ce": jnp.stack(mtp_ce) if mtp_ce else jnp.zeros([0]), "stats": stats}
        return objective, aux

    def _grads(self, state: TrainState, batch):
        """Summed gradients and aux over the micro-batches (``lax.scan``)."""
        cfg = self.cfg
        mask = batch["loss_mask"].astype(jnp.float32)
        denom = jnp.maximum(jnp.sum(mask), 1.0)
        mtp_denoms = [jnp.maximum(jnp.sum(mtp_targets(batch["labels"], mask, batch["segment_ids"], j)[2]), 1.0)
                      for j in range(1, cfg.model.mtp.num_layers + 1)]
        grad_fn = jax.grad(self.loss, has_aux=True)
        narrow_head = self._narrow_head(state.params)  # outside the micro-batch scan: one cast a step

        def one(mb):
            grads, aux = grad_fn(state.params, state.balance, mb, denom, mtp_denoms, narrow_head)
            return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params), aux

        if cfg.micro_batches == 1:
            return one(batch), denom, mtp_denoms
        micro = jax.tree.map(lambda x: x.reshape((cfg.micro_batches, -1) + x.shape[1:]), batch)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(one, first)
        rest_shape, _ = st.split_margins(shapes[1]["stats"])

        def zero(path, s):
            fill = -jnp.inf if st.stat_name(path) == "max_logit" else 0
            return jnp.full(s.shape, fill, s.dtype)

        init = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0]),
                {"ce": jnp.zeros([], jnp.float32), "mtp_ce": jnp.zeros(shapes[1]["mtp_ce"].shape, jnp.float32),
                 "stats": jax.tree_util.tree_map_with_path(zero, rest_shape)})

        def body(carry, mb):
            grads, aux = one(mb)
            rest, margins = st.split_margins(aux["stats"])
            acc_g, acc = carry
            acc = {"ce": acc["ce"] + aux["ce"], "mtp_ce": acc["mtp_ce"] + aux["mtp_ce"],
                   "stats": st.accumulate_stats(acc["stats"], rest)}
            return (jax.tree.map(jnp.add, acc_g, grads), acc), margins

        (grads, aux), margins = jax.lax.scan(body, init, micro)
        # [M, ..., T, E] -> [..., M·T, E]: micro-batches join along the tokens (scanned layers lead).
        margins = jax.tree.map(lambda m: jnp.moveaxis(m, 0, -3).reshape(m.shape[1:-2] + (-1, m.shape[-1])),
                               margins)
        aux["stats"] = st.merge_margins(aux["stats"], margins)
        return (grads, aux), denom, mtp_denoms

    # ---------------------------------------------------------------- step
    def train_step(self, state: TrainState, batch, horizon: Horizon | None = None
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step (un-jitted; `step` is the jitted, donated version). ``horizon``: the
        schedule's boundaries (default: this run's, as constants; `step` passes them traced)."""
        cfg = self.cfg
        horizon = self.horizon if horizon is None else horizon
        tx = self.optimizer(horizon)
        (grads, aux), denom, mtp_denoms = self._grads(state, batch)
        grad_norm = optax.tree.norm(grads)
        loss = aux["ce"] / denom
        mtp_loss = sum((aux["mtp_ce"][j] / d for j, d in enumerate(mtp_denoms)), jnp.zeros([]))
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(mtp_loss)
        # One Newton–Schulz scan per distinct weight shape, not per weight (k3jax.train.batched_calls);
        # on a mesh the stack would mix shardings, so there each weight keeps its own.
        update = tx.update if self.mesh is not None else batch_scans(tx.update)
        with _matmul_precision(cfg.optimizer.ns_precision, grads):
            updates, opt_state = update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        max_logits = max_logits_from_stats(aux["stats"])
        metrics = {}
        if cfg.optimizer.qk_clip_tau is not None and max_logits:
            params, gammas = qk_clip(params, max_logits, cfg.model.mla, cfg.optimizer.qk_clip_tau)
            metrics["qk_clipped_heads"] = sum(jnp.sum(g < 1) for g in gammas.values())
        balance = st.update_balance(cfg.model, state.balance, aux["stats"])
        if cfg.model.moe.redundant_experts and self.mesh is not None:  # MoonEP: re-plan the replicas
            from sharding.moonep_placement import update_placements

            balance = update_placements(balance, aux["stats"], state.step + 1, every=cfg.model.moe.placement_every,
                                        ep=self._expert_size())
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        streak = jnp.where(ok, 0, state.nonfinite_streak + 1)
        new_state = TrainState(
            step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
            balance=keep(balance, state.balance), nonfinite_streak=streak,
            nonfinite_total=state.nonfinite_total + (~ok).astype(jnp.int32))
        metrics.update(loss=loss, grad_norm=grad_norm, tokens=denom, skipped=~ok, nonfinite_streak=streak,
                       lr=self.schedule(state.step - state.nonfinite_total, horizon))
        if mtp_denoms:
            metrics["mtp_loss"] = mtp_loss
        if max_logits:
            metrics["max_logit"] = jnp.max(jnp.stack([m.max() for m in max_logits.values()]))
        metrics.update(st.balance_metrics(aux["stats"]))
        metrics.update(ep_metrics(aux["stats"], new_state.balance, cfg.model, self._expert_size()))
        return new_state, metrics

    def _expert_size(self) -> int:
        if self.mesh is None:
            return 1
        from sharding.rules import mesh_axes_of

        return int(math.prod(self.mesh.shape[a] for a in mesh_axes_of(self.shardings["rules"], "experts")))

    @property
    def compiler_options(self) -> dict[str, bool | int | float | str]:
        """XLA options the train step compiles with (``TrainConfig.excess_precision``, ``xla_options``)."""
        return xla_compiler_options(self.cfg.excess_precision, self.cfg.xla_options)

    def _build_step(self):
        """``jit(train_step)(state, batch, horizon)``: one program for every run length."""
        if self.shardings is None:
            return jax.jit(self.train_step, donate_argnums=0, compiler_options=self.compiler_options)
        s = self.shardings
        return jax.jit(self.train_step, donate_argnums=0, in_shardings=(s["state"], s["batch"], s["replicated"]),
                       out_shardings=(s["state"], s["replicated"]), compiler_options=self.compiler_options)

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """The jitted, donated step; ``state`` must not be used afterwards."""
        check_batch(batch, self.cfg)
        with self._context():
            return self._jit_step(state, batch, self.horizon)

    def model_variables(self, state: TrainState) -> dict[str, Any]:
        """``{"params", "balance"}`` of the main model (for evaluation and inference)."""
        return {"params": state.params["model"], "balance": state.balance["model"]}


def check_batch(batch, cfg: TrainConfig) -> None:
    """``ValueError`` naming the key when a batch does not match the config or holds ids outside the
    vocabulary (before any compute)."""
    want = (cfg.batch_size, cfg.seq_len)
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; a batch has keys {BATCH_KEYS}")
    for key in BATCH_KEYS:
        shape = tuple(batch[key].shape)
        if shape != want:
            raise ValueError(f"batch[{key!r}] has shape {shape}; expected [batch_size, seq_len] = {want}")
    vocab = cfg.model.vocab_size
    for key in ("tokens", "labels"):
        low, high = _id_range(batch[key])
        if low < 0 or high >= vocab:
            raise ValueError(f"batch[{key!r}] holds ids in [{low}, {high}]; they must lie in [0, vocab_size={vocab}) "
                             "(under jit an out-of-range id gives NaN, not an error)")


def _id_range(ids) -> tuple[int, int]:
    """Smallest and largest id: on the host for numpy batches (the loader's), one small reduction for
    device arrays."""
    if isinstance(ids, np.ndarray) or not hasattr(ids, "addressable_shards"):
        ids = np.asarray(ids)
        return (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    return tuple(int(v) for v in jax.device_get(_min_max(ids)))


@jax.jit
def _min_max(ids):
    return jnp.min(ids), jnp.max(ids)
