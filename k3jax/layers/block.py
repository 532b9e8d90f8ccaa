"""One decoder layer: token mixer (KDA or MLA) and feed-forward (dense MLP or MoE), each pre-normed.

With Block AttnRes (K3; SPEC §5) each sub-layer reads a softmax mix of the stored block sums and
the current partial sum, and the layer pushes the partial sum as a finished block when
``index % block_size == 0`` (so the embedding is the first stored source):
```
h = MIX_attn(stream)            # layer 0: the embedding itself
if index % S == 0: push         # partial -> blocks, partial = 0
partial += Mixer(Norm1(h)) ; partial += FFN(Norm2(MIX_mlp(stream)))
```
Without it, the plain pre-norm residual ``x += Mixer(Norm1(x)); x += FFN(Norm2(x))``.

Decode: with a mixer ``cache`` the layer returns ``(stream, new_cache)`` (``keep_steps``: a KDA mixer
keeps its state at every new token, see ``k3jax.layers.kda``; MLA rows need no such thing). The AttnRes block sums are
per token, so a decoded token needs only its own stream, never the history of the others.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
from jaxtyping import Array, Bool, Int

from k3jax.config import LayerKind, ModelConfig
from k3jax.layers.attn_res import ResidualStream, StackedStream, attn_res
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.mixed_input import kernel_runs, mixed_input
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE
from k3jax.layers.norm import norm

MIXERS = {LayerKind.KDA: (KDA, "kda"), LayerKind.MLA: (MLA, "mla")}


class DecoderLayer(nn.Module):
    """Decoder layer ``index`` of the stack; ``remat_moe`` rematerialises the MoE in the backward pass.

    In the scanned stack one module stands for every layer at its offset of the unit: ``index`` is
    the first of them (they share the mixer and FFN kind) and ``push`` says, traced, whether this
    repetition's layer starts an AttnRes block (default: ``index % block_size == 0``)."""

    cfg: ModelConfig
    index: int
    remat_moe: bool = False

    def _ffn(self) -> nn.Module:
        cfg = self.cfg
        if not cfg.moe_layers[self.index]:
            return MLP(cfg, cfg.mlp.dense_intermediate, name="mlp")
        moe_cls = nn.remat(MoE) if self.remat_moe else MoE
        return moe_cls(cfg, name="moe")

    @nn.compact
    def __call__(self, stream: ResidualStream | StackedStream, segment_ids: Int[Array, "B T"] | None = None, *,
                 cache=None, valid: Bool[Array, "B T"] | None = None, keep_steps: bool = False,
                 push: bool | Bool[Array, ""] | None = None):
        cfg = self.cfg
        mixer_cls, mixer_name = MIXERS[cfg.layer_kinds[self.index]]
        mixer = mixer_cls(cfg, name=mixer_name)
        ffn = self._ffn()
        attn_norm, mlp_norm = norm(cfg, "attn_norm"), norm(cfg, "mlp_norm")
        if cache is not None and cfg.moe_layers[self.index] and not self.remat_moe:  # k3jax.layers.moe_decode
            ffn = functools.partial(ffn, decode=True)
        if cache is None:
            mix = lambda h: (mixer(h, segment_ids), None)
        else:
            steps = {"keep_steps": keep_steps} if isinstance(mixer, KDA) else {}
            mix = lambda h: mixer(h, cache=cache, valid=valid, **steps)
        if cfg.attn_res is None:
            y, cache = mix(attn_norm(stream.partial))
            stream = stream.add(y)
            stream = stream.add(ffn(mlp_norm(stream.partial)))
            return stream if cache is None else (stream, cache)
        # decoding, the mix and the norm may run inside the kernels of the projections that read them
        # (k3jax.layers.mixed_input), which also add the mixer's output to the stream themselves
        lazy = cache is not None and isinstance(stream, ResidualStream)
        lazy = lazy and kernel_runs(cfg.decode_glue_implementation)
        x = mixed_input(attn_res(cfg, "attn_res"), attn_norm, stream) if lazy else attn_norm(
            attn_res(cfg, "attn_res")(stream))
        stream = stream.push_if(self.index % cfg.attn_res.block_size == 0 if push is None else push)
        y, cache = mix(x)
        x = mixed_input(attn_res(cfg, "mlp_res"), mlp_norm, stream, (y,)) if lazy else None
        stream = stream.add(y)
        if lazy:  # its own early kernel: fused into a later reader (XLA's mix for MLA's g_proj), it waited for
            # that reader's other inputs and held back the next layer's kernels (ResidualStream.add_kept)
            stream = stream.replace(partial=jax.lax.optimization_barrier(stream.partial))
        x = mlp_norm(attn_res(cfg, "mlp_res")(stream)) if x is None else x
        if lazy:  # the next layer's first kernel adds the routed and the shared experts' outputs itself
            stream = stream.add_kept(*(ffn(x, terms=True) if cfg.moe_layers[self.index] else (ffn(x),)))
        else:
            stream = stream.add(ffn(x))
        return stream if cache is None else (stream, cache)
