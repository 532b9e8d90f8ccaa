"""accounting.py reproduces the published K3 totals and agrees with the inference cache's bytes."""

import jax
import pytest

from experiments import accounting
from k3jax.config import kimi_k2, kimi_k3, kimi_linear_48b
from k3jax.infer.cache import KDACache, MLACache, init_cache, tree_bytes


def cache_bytes_from_inference_code(cfg, tokens: int) -> int:
    """Bytes of what ``init_cache`` allocates per sequence (states, conv tails, latents; the int32
    lengths are bookkeeping, not cache), from shapes only."""
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, tokens))
    # The scanned run's caches are one entry stacked over its repeats (k3jax.infer.cache).
    layers = jax.tree.leaves(cache.layers, is_leaf=lambda c: isinstance(c, (KDACache, MLACache)))
    return sum(tree_bytes((c.state, c.conv)) if isinstance(c, KDACache) else tree_bytes(c.latent) for c in layers)


def test_k3_published_totals():
    p = accounting.parameters(kimi_k3())
    assert round(p["total"] / 1e9, 2) == 2779.48  # SPEC §1: 2,779.48 B
    assert round(p["active"] / 1e9, 2) == 104.19  # 104.19 B active per token
    assert 0.96 <= p["inactive_fraction"] < 0.965  # "≈ 96 % inactive"
    assert p["sparsity"] == 56 and accounting.parameters(kimi_k2())["sparsity"] == 48


def test_components_add_up():
    for make in (kimi_k3, kimi_k2, kimi_linear_48b):
        p = accounting.parameters(make())
        assert sum(c["total"] for c in p["by_component"].values()) == p["total"]
        assert sum(c["active"] for c in p["by_component"].values()) == p["active"]
        assert p["by_component"]["embedding"]["active"] == 0


@pytest.mark.parametrize("tokens", accounting.MEMORY_CONTEXTS)
def test_memory_table_matches_init_cache(tokens):
    k3 = kimi_k3()
    assert accounting.cache_bytes(k3, tokens) == cache_bytes_from_inference_code(k3, tokens)
    assert accounting.cache_bytes(k3, tokens, "mla_every_layer") == cache_bytes_from_inference_code(accounting.all_mla(k3), tokens)
    kl = kimi_linear_48b()
    assert accounting.cache_bytes(kl, tokens) == cache_bytes_from_inference_code(kl, tokens)
    k2 = accounting.all_mla(kimi_k2())  # K2 is all-MLA already; only its max_position grows to 1 M
    assert accounting.cache_bytes(kimi_k2(), tokens) == cache_bytes_from_inference_code(k2, tokens)


def test_hybrid_cache_is_smaller_and_gqa_formula():
    k3, t = kimi_k3(), 1 << 20
    hybrid, mla, gqa = (accounting.cache_bytes(k3, t, layout) for layout in ("released", "mla_every_layer", "gqa"))
    assert hybrid < mla < gqa
    assert gqa == 93 * 2 * 8 * 128 * t * 2
    with pytest.raises(ValueError, match="layout"):
        accounting.cache_bytes(k3, t, "mqa")


def test_writes_json_md_png(tmp_path):
    accounting.main(["--out", str(tmp_path)])
    assert {p.name for p in tmp_path.iterdir()} >= {"accounting.json", "accounting.md"}
    text = (tmp_path / "accounting.md").read_text()
    assert "2,779.48 B / 104.19 B" in text and "896/16 = 56" in text and "384/8 = 48" in text
