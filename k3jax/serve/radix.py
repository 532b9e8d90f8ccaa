"""The prefix index: a radix tree over token pages whose nodes own MLA pages and KDA snapshots.

Each edge below the root is one **full page** of tokens (``page_size`` ids) and its node owns the
page of latent rows for them; a node may also own a KDA **snapshot**, the recurrent state after
its last token. A **tail** node is a leaf with fewer than ``page_size`` tokens (the end of an
earlier request, mid-page): it owns a private copy of that partial page and always a snapshot,
so prompts that share less than a page with an earlier conversation still hit (vLLM's
"no hits below one block" problem) and a later request copies the page before writing into it.

A match may only resume where a KDA state exists (SGLang's rule): the deepest node on the
prompt's path with a snapshot, at most ``limit`` tokens deep. Pages of the full-page nodes above
it are shared, pinned by reference counts while requests use them; leaves with no references
are evicted least recently used first (their page and snapshot go back to the allocator), and
snapshots alone can be dropped from inner nodes (matches then stop at an earlier snapshot).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

_clock = itertools.count()


class Node:
    __slots__ = ("key", "page", "snapshot", "children", "parent", "refs", "last_used", "depth")

    def __init__(self, key: tuple, page: int | None, parent: "Node | None", depth: int):
        self.key, self.page, self.parent, self.depth = key, page, parent, depth
        self.snapshot: int | None = None
        self.children: dict[tuple, Node] = {}
        self.refs = 0
        self.last_used = next(_clock)

    def touch(self) -> None:
        self.last_used = next(_clock)


@dataclasses.dataclass
class Match:
    """Where a prompt resumes: ``length`` cached tokens, the shared full-page ``nodes`` (their pages
    are the first ``len(nodes)`` entries of the page table), the ``snapshot`` to load (None: the
    zero state, ``length == 0``) and a ``tail`` whose partial page must be copied."""

    length: int
    nodes: list[Node]
    snapshot: int | None
    tail: Node | None


class PrefixIndex:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size={page_size!r} must be >= 1")
        self.page_size = page_size
        self.root = Node((), None, None, 0)

    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """The deepest resumable point of ``tokens`` at most ``limit`` tokens deep."""
        P, best = self.page_size, Match(0, [], None, None)
        node, path = self.root, []
        while True:
            for tail in self._tails(node, tokens, limit):
                if tail.depth > best.length:
                    best = Match(tail.depth, list(path), tail.snapshot, tail)
            if node.snapshot is not None and node.depth > best.length and node.depth <= limit:
                best = Match(node.depth, list(path), node.snapshot, None)
            child = node.children.get(tuple(tokens[node.depth:node.depth + P]))
            if child is None or child.depth > limit or len(child.key) < P:
                break
            node = child
            path.append(child)
        for n in best.nodes + ([best.tail] if best.tail else []):
            n.touch()
        return best

    def _tails(self, node: Node, tokens: Sequence[int], limit: int):
        for key, child in node.children.items():
            if len(key) < self.page_size and child.snapshot is not None and node.depth + len(key) <= limit \
                    and tuple(tokens[node.depth:node.depth + len(key)]) == key:
                yield child

    def child(self, parent: Node, key: tuple) -> Node | None:
        return parent.children.get(key)

    def add(self, parent: Node, key: tuple, page: int) -> Node:
        """A new child of ``parent`` for ``key`` (a full page, or a tail) owning ``page``."""
        if key in parent.children:
            raise ValueError(f"the index already holds a node for this key under depth {parent.depth}")
        node = Node(key, page, parent, parent.depth + len(key))
        parent.children[key] = node
        return node

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evictable_leaf(self) -> Node | None:
        """The least recently used leaf that no request references."""
        leaves = [n for n in self.nodes() if not n.children and n.refs == 0]
        return min(leaves, key=lambda n: n.last_used, default=None)

    def remove(self, node: Node) -> None:
        if node.children or node.refs:
            raise ValueError("only unreferenced leaves can be removed")
        del node.parent.children[node.key]

    def oldest_snapshot(self) -> Node | None:
        """The least recently used node holding a snapshot (snapshots are copied when used, never pinned)."""
        return min((n for n in self.nodes() if n.snapshot is not None), key=lambda n: n.last_used, default=None)
