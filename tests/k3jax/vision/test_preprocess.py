"""Preprocessing: token counts per image and clip (odd sizes too), the packed layout, bad input."""

import io

import numpy as np
import pytest
from PIL import Image

from k3jax.config import tiny
from k3jax.vision import MultimodalConfig, build_inputs, image_media, pack_media, tiny_vision, video_media
from k3jax.vision.config import moonvit_v2
from k3jax.vision.preprocess import resize_plan

V = tiny_vision()
CFG = MultimodalConfig(text=tiny(), vision=V, media_token_id=5)


def _img(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("h,w", [(1, 1), (13, 27), (28, 28), (29, 57), (57, 29), (55, 83), (100, 3)])
def test_image_tokens_follow_the_merge_rule(h, w):
    m = image_media(_img(h, w), V)
    H, W = -(-h // 28) * 28, -(-w // 28) * 28  # no downscale at these sizes: pad to multiples of 28
    assert m.pixels.shape == (1, H, W, 3)
    assert m.num_tokens(V) == (H // 28) * (W // 28)
    assert m.patch_grid(V) == (1, H // 14, W // 14)
    # The padding is zero pixels, normalised: (0 - 0.5) / 0.5.
    assert np.all(m.pixels[0, h:] == -1.0) and np.all(m.pixels[0, :, w:] == -1.0)


def test_patch_budget_scales_down_like_the_release():
    cfg = moonvit_v2()
    new_w, new_h, pw, ph = resize_plan(4000, 3000, cfg)
    assert (pw // 14) * (ph // 14) <= cfg.max_patches + 2 * (pw // 14 + ph // 14)  # pad adds at most a strip
    assert (new_w // 14) * (new_h // 14) <= cfg.max_patches
    assert pw % 28 == 0 and ph % 28 == 0 and abs(new_w / new_h - 4 / 3) < 0.01
    assert resize_plan(100, 50, cfg) == (100, 50, 112, 56)  # small images are never upscaled


@pytest.mark.parametrize("frames", [1, 3, 4, 5, 9])
def test_clip_tokens_pool_over_time(frames):
    chunks = video_media([_img(41, 70, i) for i in range(frames)], V, 4)
    assert [c.pixels.shape[0] for c in chunks] == [4] * (frames // 4) + ([frames % 4] if frames % 4 else [])
    per_chunk = (56 // 28) * (84 // 28)
    assert all(c.num_tokens(V) == per_chunk for c in chunks)  # 4 frames cost what one image costs
    tokens, lengths, batch = build_inputs([[1, 5, 2]], [[chunks]], CFG)
    assert lengths[0] == 2 + per_chunk * len(chunks)
    assert int(batch.merged_valid.sum()) == per_chunk * len(chunks)
    # One window per (merged token, frame): the temporal mean weights sum to 1 per merged token.
    w = np.zeros(batch.num_merged + 1)
    np.add.at(w, batch.window_target[0], batch.window_weight[0])
    np.testing.assert_allclose(w[:-1][batch.merged_valid[0]], 1.0, rtol=1e-6)


def test_packed_layout_and_placeholders():
    a, b = image_media(_img(30, 60), V), image_media(_img(28, 28), V)
    tokens, lengths, batch = build_inputs([[5, 1, 5], [2, 3]], [[[a], [b]], []], CFG)
    assert list(lengths) == [a.num_tokens(V) + 1 + b.num_tokens(V), 2]
    assert (tokens[0] == 5).sum() == a.num_tokens(V) + b.num_tokens(V) and tokens[0, a.num_tokens(V)] == 1
    n_a, n_b = 4 * a.num_tokens(V), 4 * b.num_tokens(V)
    assert list(batch.segments[0, :n_a + n_b]) == [1] * n_a + [2] * n_b and not batch.segments[1].any()
    # Four consecutive patches form one 2x2 window of one merged token.
    r, c = batch.rows[0, :4], batch.cols[0, :4]
    assert list(r) == [0, 0, 1, 1] and list(c) == [0, 1, 0, 1]
    assert batch.pixels.shape == (2, n_a + n_b, 3 * 14 * 14)


def _png_bytes(h=20, w=30):
    buf = io.BytesIO()
    Image.fromarray(_img(h, w)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images_raise_naming_the_sample(tmp_path):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not an image at all")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(_png_bytes(30, 30)[:200])
    cases = [(str(corrupt), "cannot read image"), (str(truncated), "corrupt or truncated"),
             (np.zeros((0, 5, 3), np.uint8), "zero-size"), (Image.new("RGB", (0, 4)), "zero-size"),
             (_img(40, 40), "above max_input_pixels")]
    small = tiny_vision(max_input_pixels=1000)
    for source, message in cases:
        with pytest.raises(ValueError, match=f"^sample 3 image 1: .*{message}"):
            image_media(source, small, "sample 3 image 1")
    assert image_media(_png_bytes(), V).pixels.shape == (1, 28, 56, 3)


def test_clip_frames_of_different_sizes_raise():
    with pytest.raises(ValueError, match=r"sample 2 video: all frames of a clip must have one size"):
        video_media([_img(20, 20), _img(20, 21)], V, 4, "sample 2 video")
    with pytest.raises(ValueError, match="at least one frame"):
        video_media([], V, 4, "sample 0 video")


@pytest.mark.parametrize("prompt,n_media", [([1, 2], 1), ([5, 5], 1), ([5], 2)])
def test_placeholder_count_mismatch_raises(prompt, n_media):
    m = image_media(_img(28, 28), V)
    with pytest.raises(ValueError, match=r"sample 1: the prompt has \d+ media placeholders .* for \d+ images"):
        build_inputs([[1], prompt], [[], [[m]] * n_media], CFG)


def test_pack_budget_raises():
    m = image_media(_img(56, 56), V)
    with pytest.raises(ValueError, match="sample 0: its media need 16 patches"):
        pack_media([[m]], V, num_patches=8)


class _FakeK3Tokenizer:
    vocab_size, bos_id, eos_id, pad_id = 163840, 163584, 163585, 163839

    def encode(self, text):
        return np.frombuffer(text.encode(), np.uint8).astype(np.int64) + 1000


def test_prepare_with_the_k3_template_and_without(tmp_path):
    from pathlib import Path

    from k3jax.config import kimi_k3
    from k3jax.vision.config import MEDIA_BEGIN_ID, MEDIA_CONTENT_ID, MEDIA_END_ID, MEDIA_PAD_ID
    from k3jax.vision.prompt import prepare

    path = tmp_path / "a.png"
    Image.fromarray(_img(30, 45)).save(path)
    frames = [_img(28, 28, i) for i in range(5)]
    k3 = MultimodalConfig(text=kimi_k3(), vision=V)
    tokens, lengths, batch = prepare([["hi ", Path(path), frames]], k3, _FakeK3Tokenizer())
    row = tokens[0, :lengths[0]].tolist()
    tok = _FakeK3Tokenizer()
    n_img = image_media(_img(30, 45), V).num_tokens(V)
    want = ([k3.text.bos_token_id] + tok.encode("hi ").tolist() + [MEDIA_BEGIN_ID] + tok.encode("image 45x30").tolist()
            + [MEDIA_CONTENT_ID] + [MEDIA_PAD_ID] * n_img + [MEDIA_END_ID])
    video_block = [MEDIA_BEGIN_ID] + tok.encode("video").tolist() + [MEDIA_CONTENT_ID, MEDIA_PAD_ID, MEDIA_END_ID]
    assert row == want + video_block * 2  # 5 frames: two chunks, one block each (1 merged token per 28x28 chunk)
    assert int(batch.merged_valid.sum()) == n_img + 2
    tokens, lengths, _ = prepare([[Path(path), frames]], CFG, None, bos=False)
    assert tokens[0, :lengths[0]].tolist() == [5] * (n_img + 2)
    with pytest.raises(ValueError, match="sample 0 part 0: text parts need a tokenizer"):
        prepare([["hi"]], CFG)
    with pytest.raises(ValueError, match=r"sample 0 part 1 \(video\): all frames"):
        prepare([[Path(path), [_img(28, 28), _img(56, 28)]]], CFG)
