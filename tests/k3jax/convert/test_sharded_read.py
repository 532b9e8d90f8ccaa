"""HFSource reads any block of any leaf exactly as load_hf's leaf holds it, touching only the block's
bytes: every layout is a zero-copy view of the memory-mapped tensor, MXFP4 blocks decode only the
groups they cover."""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert import load_hf
from k3jax.layout import to_per_layer
from k3jax.convert.hf_keys import LAYOUTS
from k3jax.convert.sharded_read import HFSource

ORACLE = "/work/shared/oracle/tiny_a"


@pytest.fixture(scope="module", params=("hf_bf16", "hf_mxfp4"))
def source_and_tree(request):
    path = f"{ORACLE}/{request.param}"
    cfg, variables = load_hf(path, param_dtype=jnp.float32)
    return HFSource(path), to_per_layer(variables, cfg)  # HF entries name per-layer leaves


def _leaf(tree, entry):
    node = tree[entry.collection]
    for name in entry.path:
        node = node[name]
    return np.asarray(node)


def test_every_layout_is_a_view_of_the_mapped_tensor(source_and_tree):
    source, _ = source_and_tree
    for entry in source.table:
        key = entry.expert_key(0) if entry.is_experts else entry.hf
        if key not in source.reader:
            continue  # MXFP4 experts are decoded per block instead
        hf = source.reader.get(key)
        tree = LAYOUTS[entry.layout].to_tree(hf, entry.shape[1:] if entry.is_experts else entry.shape)
        assert np.shares_memory(hf, tree), (entry.hf, entry.layout)


def test_random_blocks_equal_load_hf_and_count_their_bytes(source_and_tree):
    source, tree = source_and_tree
    rng = np.random.default_rng(0)
    for entry in source.table:
        want = _leaf(tree, entry)
        for _ in range(2):
            starts = [int(rng.integers(0, n)) for n in entry.shape]
            index = tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(starts, entry.shape))
            before = source.bytes_read
            got = source.read(entry, index, np.float32)
            assert got.dtype == np.float32 and np.array_equal(got, want[index]), entry.hf
            assert source.bytes_read > before
    whole = HFSource(source.path)
    for entry in whole.table:
        whole.read(entry, (), np.float32)
    padding = sum((i.shape[0] - whole.cfg.kda.num_heads) * 4 for k, i in whole.reader.infos.items()
                  if k.endswith("A_log"))
    assert whole.bytes_read == sum(i.end - i.begin for i in whole.reader.infos.values()) - padding


def test_shard_index_must_be_contiguous(source_and_tree):
    source, _ = source_and_tree
    with pytest.raises(ValueError, match="unit steps"):
        source.read(source.table[0], (slice(0, 8, 2),), np.float32)
