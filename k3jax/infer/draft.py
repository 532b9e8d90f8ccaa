"""The EAGLE-3 style speculative draft of K3 (SPEC §8; EAGLE-3, arXiv 2503.01840; the K3 report).

1. Features: the target's hidden states after the 1st and 4th AttnRes blocks and the final one
   (the final-norm input), ``[B,T,3,D]``; block indices past the model's last stored block are
   clipped to it, and a model without AttnRes uses its final hidden state thrice.
2. ``h = W_fuse [f_1; f_4; f_final]`` with ``W_fuse ∈ R^{D×3D}`` initialised ``[0 0 I]``, so at
   init the draft sees exactly the final hidden state, as the MTP layer did.
3. MTP-style input ``x = M [RMSNorm(h); RMSNorm(Emb(t_{i+1}))]`` (the target's embedding).
4. One block: ``x += GatedMLA(Norm(x)); x += SiTU-MLP(Norm(x))`` (no KDA, experts or AttnRes).
5. ``logits = FinalNorm(x) W_head`` with the target's (frozen) head; ``x`` is also returned: on
   the draft's own steps it stands in for the next position's ``h`` (training-time test).

Training (``train_draft``): the target frozen, a 7-step unroll on
``L = −log Σ_x min(p(x), q(x))`` (the negative log acceptance rate at temperature 1).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from k3jax.config import ModelConfig
from k3jax.infer.cache import MLACache
from k3jax.layers.linear import einsum, proj
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import MLP
from k3jax.layers.norm import norm
from k3jax.model import Transformer

FEATURE_BLOCKS = (1, 4)  # AttnRes block indices fused with the final hidden state
UNROLL = 7


def draft_features(cfg: ModelConfig, hidden: Float[Array, "B T D"],
                   blocks: Float[Array, "N B T D"] | None) -> Float[Array, "B T 3 D"]:
    """The fused sources of step 1: stored block sums 1 and 4 (clipped) and the final hidden."""
    if blocks is None:
        picked = [hidden, hidden]
    else:
        last = blocks.shape[0] - 1
        picked = [blocks[min(i, last)] for i in FEATURE_BLOCKS]
    return jnp.stack([*picked, hidden], axis=2).astype(hidden.dtype)


def _fuse_init(key, shape, dtype):
    """``[0 0 I]``: the 3D→D fusion starts as the selection of the final hidden state."""
    three_d, d = shape
    return jnp.zeros(shape, dtype).at[three_d - d:].set(jnp.eye(d, dtype=dtype))


class Draft(nn.Module):
    """The one-block draft; the target's embedding table and head are passed in, not owned."""

    cfg: ModelConfig

    def setup(self):
        cfg, D = self.cfg, self.cfg.hidden
        self.fuse_proj = self.param("fuse", nn.with_logical_partitioning(_fuse_init, ("mlp", "embed")),
                                    (3 * D, D), cfg.param_dtype)
        self.hidden_norm, self.embed_norm = norm(cfg, None), norm(cfg, None)
        # [2D, D]: "mlp" for the 2D input axis (a tensor may not name one logical axis twice).
        self.inp = proj(cfg, "BTC,CD->BTD", (2 * D, D), ("mlp", "embed"), None)
        self.attn_norm, self.mlp_norm, self.final_norm = norm(cfg, None), norm(cfg, None), norm(cfg, None)
        self.mla = MLA(cfg)
        self.mlp = MLP(cfg, cfg.mlp.dense_intermediate)

    def fuse(self, features: Float[Array, "B T 3 D"]) -> Float[Array, "B T D"]:
        B, T = features.shape[:2]
        dt = self.cfg.compute_dtype
        return einsum("BTC,CD->BTD", features.reshape(B, T, -1).astype(dt), self.fuse_proj.astype(dt))

    def __call__(self, h: Float[Array, "B T D"], emb: Float[Array, "B T D"], head: Float[Array, "D V"], *,
                 cache: MLACache | None = None, valid=None):
        """``(logits [B,T,V], x [B,T,D], cache)`` for inputs ``h`` (fused or the draft's own) and the
        embedding of the token after each position."""
        cfg = self.cfg
        x = self.inp(jnp.concatenate([self.hidden_norm(h), self.embed_norm(emb)], axis=-1))
        if cache is None:
            y = self.mla(self.attn_norm(x))
        else:
            y, cache = self.mla(self.attn_norm(x), cache=cache, valid=valid)
        x = x + y
        x = x + self.mlp(self.mlp_norm(x))
        logits = einsum("BTD,DV->BTV", self.final_norm(x).astype(cfg.compute_dtype), head.astype(cfg.compute_dtype),
                        preferred_element_type=cfg.fp32_dtype)
        return logits, x, cache


def target_head(cfg: ModelConfig, params: dict) -> Float[Array, "D V"]:
    """The target's output head ``[D, V]`` (the embedding transposed when tied)."""
    if cfg.tie_embeddings:
        return params["embed"]["embedding"].T
    return params["head"]["kernel"]


def embed(params: dict, tokens: Int[Array, "B T"], dtype) -> Float[Array, "B T D"]:
    return jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(dtype)


def init_draft(cfg: ModelConfig, key) -> dict:
    """Draft parameters (unboxed) for the target ``cfg``, stored in float32 (or wider) whatever the
    target's parameter dtype: they are trained, and the layers cast them to the compute dtype."""
    cfg = dataclasses.replace(cfg, param_dtype=jnp.promote_types(cfg.param_dtype, jnp.float32))
    D = cfg.hidden
    h = jnp.zeros((1, 2, D), cfg.compute_dtype)
    head = jnp.zeros((D, cfg.vocab_size), cfg.param_dtype)
    return nn.meta.unbox(Draft(cfg).init(key, h, h, head))["params"]


def check_draft(cfg: ModelConfig, params: dict, name: str = "draft") -> None:
    """``ValueError`` naming ``name`` unless ``params`` have the tree and shapes of a draft for ``cfg``
    (its hidden width and MLA sizes; the vocabulary is the target's own embedding and head)."""
    want = jax.eval_shape(lambda: init_draft(cfg, jax.random.key(0)))
    if jax.tree.structure(params) != jax.tree.structure(want):
        raise ValueError(f"{name} must be the parameters of k3jax.infer.draft.Draft (init_draft / train_draft) "
                         "for this model; got a tree of another structure")
    for (path, exp), got in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(params)):
        if tuple(got.shape) != tuple(exp.shape):
            raise ValueError(f"{name} parameter {jax.tree_util.keystr(path)} has shape {tuple(got.shape)}, expected "
                             f"{tuple(exp.shape)} for the target's hidden={cfg.hidden}")


def save_draft(path: str | Path, params: dict) -> None:
    """Write draft parameters to one ``.npz`` file (keys: the parameter paths joined by ``/``)."""
    flat = flax.traverse_util.flatten_dict(jax.device_get(params), sep="/")
    with open(path, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in flat.items()})


def load_draft(path: str | Path, cfg: ModelConfig) -> dict:
    """Draft parameters written by ``save_draft``, checked against the target ``cfg``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--draft {path} does not exist (a .npz written by k3jax.infer.draft.save_draft)")
    with np.load(path) as f:
        params = flax.traverse_util.unflatten_dict({k: jnp.asarray(f[k]) for k in f.files}, sep="/")
    check_draft(cfg, params, name=f"draft {path}")
    return params


def acceptance_loss(p_logits: Float[Array, "*B V"], q_logits: Float[Array, "*B V"]) -> Float[Array, "*B"]:
    """``−log Σ_x min(p(x), q(x))``: the negative log of the chance that q's sample is accepted."""
    p = jax.nn.softmax(p_logits.astype(jnp.float32), axis=-1)
    q = jax.nn.softmax(q_logits.astype(jnp.float32), axis=-1)
    return -jnp.log(jnp.sum(jnp.minimum(p, q), axis=-1) + 1e-20)


def target_outputs(variables: dict, cfg: ModelConfig, tokens: Int[Array, "B T"]):
    """The frozen target's logits ``[B,T,V]`` and draft features ``[B,T,3,D]`` over whole sequences."""
    from k3jax.infer.cache import init_cache

    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    (logits, hidden, blocks), _ = Transformer(cfg).apply(variables, tokens, cache.layers, return_hidden=True,
                                                         method=Transformer.decode)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(draft_features(cfg, hidden, blocks))


def unroll_loss(draft_params: dict, cfg: ModelConfig, target_params: dict, tokens: Int[Array, "B T"],
                p_logits: Float[Array, "B T V"], features: Float[Array, "B T 3 D"], steps: int = UNROLL):
    """Mean acceptance loss over a ``steps``-step training-time-test unroll.

    Step 1 at position i reads ``fuse(F_i)`` and token ``t_{i+1}`` and predicts ``t_{i+2}`` (target
    ``p_{i+1}``); step s reads the draft's own step s−1 output at position i−1 in place of the
    features (what it sees when drafting), so its predictions run s−1 positions ahead of the truth.
    Returns ``(loss, per-step mean acceptance rate)``.
    """
    draft = Draft(cfg)
    head = target_head(cfg, target_params)
    T = tokens.shape[1]
    emb = embed(target_params, jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1), cfg.compute_dtype)
    p_next = jnp.concatenate([p_logits[:, 1:], p_logits[:, -1:]], axis=1)  # target for t_{i+2}
    mask = (jnp.arange(T) < T - 2).astype(jnp.float32)[None]
    h = draft.apply({"params": draft_params}, features, method=Draft.fuse)
    losses, rates = [], []
    for _ in range(steps):
        q_logits, x, _ = draft.apply({"params": draft_params}, h, emb, head)
        nll = acceptance_loss(p_next, q_logits)  # [B, T]
        denom = jnp.sum(mask) * tokens.shape[0]
        losses.append(jnp.sum(nll * mask) / denom)
        rates.append(jnp.sum(jnp.exp(-nll) * mask) / denom)
        h = jnp.concatenate([h[:, :1], x[:, :-1]], axis=1)  # position i now reads the draft's output at i-1
    return jnp.mean(jnp.stack(losses)), jnp.stack(rates)


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, steps: int = UNROLL):
    """A jitted ``(draft_params, opt_state, variables, tokens) → (params, opt_state, loss, rates)``;
    the target (``variables``) only runs forward."""

    @jax.jit
    def step(draft_params, opt_state, variables, tokens):
        p_logits, features = target_outputs(variables, cfg, tokens)
        grad_fn = jax.value_and_grad(unroll_loss, has_aux=True)
        (loss, rates), grads = grad_fn(draft_params, cfg, variables["params"], tokens, p_logits, features, steps)
        updates, opt_state = optimizer.update(grads, opt_state, draft_params)
        return optax.apply_updates(draft_params, updates), opt_state, loss, rates

    return step


def train_draft(variables: dict, cfg: ModelConfig, batches, *, num_steps: int | None, learning_rate: float = 1e-3,
                seed: int = 0, steps: int = UNROLL, log=None) -> dict:
    """Train a fresh draft on ``batches`` (an iterator of ``[B,T]`` token arrays) for ``num_steps``
    steps, or until the iterator ends when ``num_steps`` is None."""
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 0):
        raise ValueError(f"num_steps={num_steps!r} must be None or an int >= 0")
    params = init_draft(cfg, jax.random.key(seed))
    optimizer = optax.adamw(learning_rate, weight_decay=0.0)
    opt_state = optimizer.init(params)
    train_step = make_train_step(cfg, optimizer, steps)
    for i, tokens in enumerate(batches if num_steps is None else itertools.islice(batches, num_steps)):
        params, opt_state, loss, rates = train_step(params, opt_state, variables, jnp.asarray(tokens))
        if log is not None:
            log(i, float(loss), [float(r) for r in rates])
    return params
