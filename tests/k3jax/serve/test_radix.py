"""The prefix index and the allocator on the host alone: deepest resumable match, tails, LRU
eviction that never takes a pinned page, snapshots dropped before pages."""

import pytest

from k3jax.serve.allocator import Allocator, Budget
from k3jax.serve.radix import PrefixIndex


def _index(page=4, pages=6, snaps=3):
    index = PrefixIndex(page)
    return index, Allocator(Budget(num_pages=pages + 1, num_snapshots=snaps), index)


def _chain(index, alloc, tokens, snap_at=()):
    node = index.root
    for d in range(0, len(tokens) - len(tokens) % index.page_size, index.page_size):
        node = index.add(node, tuple(tokens[d:d + index.page_size]), alloc.pages(1)[0])
        if node.depth in snap_at:
            node.snapshot = alloc.snapshot()
    return node


def test_match_resumes_at_the_deepest_snapshot_within_the_limit():
    index, alloc = _index()
    tokens = list(range(12))
    _chain(index, alloc, tokens, snap_at=(4, 12))
    m = index.match(tokens + [99], limit=12)
    assert (m.length, len(m.nodes), m.tail) == (12, 3, None)
    assert index.match(tokens, limit=11).length == 4  # the node at 8 has no snapshot
    assert index.match([0, 1, 2, 7, 8], limit=4).length == 0  # diverges inside the first page
    assert index.match(tokens, limit=3).snapshot is None


def test_tails_match_mid_page_and_below_one_page():
    index, alloc = _index()
    tail = index.add(index.root, (1, 2), alloc.pages(1)[0])
    tail.snapshot = alloc.snapshot()
    m = index.match([1, 2, 3], limit=2)
    assert (m.length, m.nodes, m.tail) == (2, [], tail)
    assert index.match([1, 2], limit=1).length == 0  # at least one prompt token is left to feed
    assert index.match([1, 3, 3], limit=2).length == 0


def test_eviction_is_lru_and_spares_referenced_nodes():
    index, alloc = _index(pages=3)
    a = _chain(index, alloc, [1, 1, 1, 1])
    b = _chain(index, alloc, [2, 2, 2, 2])
    c = _chain(index, alloc, [3, 3, 3, 3])
    a.refs = 1  # a running request uses it
    b.touch()
    assert alloc.pages(2) is not None  # evicts c (least recently used unpinned), then b
    assert [n.key[0] for n in index.nodes()] == [1]
    assert alloc.pages(1) is None  # only the pinned page is left
    assert alloc.stats.evicted_pages == 2


def test_snapshot_pressure_drops_snapshots_and_useless_tails():
    index, alloc = _index(snaps=1)
    full = _chain(index, alloc, [1, 1, 1, 1], snap_at=(4,))
    assert alloc.snapshot() is not None  # the only snapshot moved from the page node
    assert full.snapshot is None and alloc.stats.dropped_snapshots == 1
    tail = index.add(full, (5,), alloc.pages(1)[0])
    tail.snapshot = 0
    alloc.drop_snapshot(tail)
    assert (5,) not in full.children  # a tail without a state can never be matched


def test_double_release_is_an_error():
    index, alloc = _index()
    (p,) = alloc.pages(1)
    alloc.release_pages([p])
    with pytest.raises(ValueError, match="released twice"):
        alloc.release_pages([p])
