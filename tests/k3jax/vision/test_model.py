"""The multimodal model: jit == eager, gradients reach the tower, packing invariance, text-only parity,
decode with an image in the prompt == the full forward, and errors before compilation.

The whole-model jit == eager and text-loss gradient tests are ``slow`` (an eager pass and a backward
compile of the language model); ``test_tower.py`` runs both for the tower alone in the default suite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.infer import decode_step, init_cache
from k3jax.model import Transformer
from k3jax.vision import MultimodalTransformer, build_inputs, pack_media, text_variables
from k3jax.vision import infer as vinfer
from tests.k3jax.vision.conftest import MEDIA_ID
from tests.tolerances import F32_RTOL


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.slow
def test_jit_equals_eager(mixed):
    model = MultimodalTransformer(mixed.cfg)
    eager = model.apply(mixed.variables, mixed.tokens, mixed.media)
    jitted = jax.jit(model.apply)(mixed.variables, mixed.tokens, mixed.media)
    assert eager.shape == mixed.tokens.shape + (mixed.cfg.text.vocab_size,)
    assert rel(jitted, eager) < F32_RTOL


@pytest.mark.slow
def test_text_loss_reaches_every_tower_parameter(mixed):
    model = MultimodalTransformer(mixed.cfg)
    after_media = jnp.asarray(mixed.tokens != MEDIA_ID, jnp.float32)  # text positions only

    def loss(params):
        logits = model.apply({**mixed.variables, "params": params}, mixed.tokens, mixed.media)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, jnp.asarray(mixed.tokens)[:, 1:, None], -1)[..., 0]
        return (nll * after_media[:, 1:]).sum()

    grads = jax.jit(jax.grad(loss))(mixed.variables["params"])
    for part in ("vision_tower", "mm_projector"):
        flat = jax.tree_util.tree_flatten_with_path(grads[part])[0]
        assert flat
        for path, g in flat:
            assert jnp.all(jnp.isfinite(g)), path
            assert float(jnp.abs(g).max()) > 0, f"{part}{jax.tree_util.keystr(path)} gets no gradient"
    # Every cell of the position grid is used by the 6 x 6-patch image, so every cell learns.
    pos = grads["vision_tower"]["patch_embed"]["pos_emb"]
    assert bool(jnp.all(jnp.abs(pos).max(-1) > 0))


def test_features_do_not_depend_on_the_rest_of_the_batch(mixed):
    """Segment masking: an image's features are the same packed alone, beside others, or with more padding."""
    model = MultimodalTransformer(mixed.cfg)
    encode = jax.jit(lambda media: model.apply(mixed.variables, media, method=MultimodalTransformer.encode))
    together = encode(mixed.media)
    wide, clip = mixed.items[1][0][0], mixed.items[1][1]
    for row, (alone, n) in enumerate([([wide], wide.num_tokens(mixed.cfg.vision)), (clip, 8)]):
        got = encode(pack_media([alone], mixed.cfg.vision, num_patches=mixed.media.pixels.shape[1] + 8))
        start = 0 if row == 0 else wide.num_tokens(mixed.cfg.vision)
        assert rel(got[0, :n], together[1, start:start + n]) < F32_RTOL


@pytest.mark.slow
def test_text_only_batch_is_the_language_model(mixed):
    tokens = jnp.asarray([[30, 31, 32, 33, 34]])
    got = jax.jit(MultimodalTransformer(mixed.cfg).apply)(mixed.variables, tokens, None)
    want = jax.jit(Transformer(mixed.cfg.text).apply)(text_variables(mixed.variables), tokens)
    assert rel(got, want) < F32_RTOL


def test_decode_with_an_image_in_the_prompt_equals_the_full_forward(mixed):
    cfg, variables = mixed.cfg, mixed.variables
    prompts = [[7, MEDIA_ID, 9], [MEDIA_ID, 20, MEDIA_ID]]
    items = [mixed.items[0], mixed.items[1]]
    continuation = np.array([[41, 42, 43], [51, 52, 53]], np.int32)
    tokens, lengths, media = build_inputs(prompts, items, cfg)
    T = tokens.shape[1]
    full_tokens = np.zeros((2, T + 3), np.int32)
    for b in range(2):  # each row's prompt, then its continuation (the padding sits after it)
        full_tokens[b, :lengths[b]] = tokens[b, :lengths[b]]
        full_tokens[b, lengths[b]:lengths[b] + 3] = continuation[b]
    full = jax.jit(MultimodalTransformer(cfg).apply)(variables, full_tokens, media)

    cache = init_cache(cfg.text, 2, T + 8)
    logits, cache = jax.jit(vinfer.prefill, static_argnums=1)(variables, cfg, tokens, media, cache,
                                                              lengths=jnp.asarray(lengths))
    for b in range(2):
        assert rel(logits[b, :lengths[b]], full[b, :lengths[b]]) < F32_RTOL
    step = jax.jit(decode_step, static_argnums=1)
    text_vars = text_variables(variables)
    for i in range(3):
        logits, cache = step(text_vars, cfg.text, jnp.asarray(continuation[:, i:i + 1]), cache)
        for b in range(2):
            assert rel(logits[b, 0], full[b, lengths[b] + i]) < F32_RTOL, (i, b)


def test_placeholder_mismatch_raises_before_compiling(mixed):
    tokens = np.array(mixed.tokens)
    tokens[2, 0] = MEDIA_ID  # a placeholder in the text-only row
    with pytest.raises(ValueError, match=r"sample 2: 1 media placeholder positions .* yield 0 merged tokens"):
        MultimodalTransformer(mixed.cfg).apply(mixed.variables, tokens, mixed.media)
    with pytest.raises(ValueError, match=r"sample 0: 1 media placeholder positions .* yield 0"):
        MultimodalTransformer(mixed.cfg).apply(mixed.variables, np.array([[MEDIA_ID, 3]]), None)
