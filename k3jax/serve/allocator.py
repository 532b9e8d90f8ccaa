"""One allocator for both kinds of serving memory: MLA latent pages and KDA state snapshots.

The two live in separate device arrays (their shapes differ), but they are sized from **one**
byte budget (``budget_bytes``), of which at most ``snapshot_share`` goes to snapshots: a KDA
state is several pages' worth of bytes, and SGLang's experience is that unbounded snapshots
crowd out the pages. When a request needs pages and none is free, the allocator evicts the least
recently used unreferenced leaf of the prefix index (its page, and its snapshot if any); when a
snapshot is wanted and none is free, it drops the least recently used snapshot. Pages pinned by
running requests (reference counts on index nodes, or owned outright) are never evicted, so an
allocation can fail: the engine then keeps the request waiting until others finish.
"""

from __future__ import annotations

import dataclasses

from k3jax.serve.pages import TRASH_PAGE
from k3jax.serve.radix import Node, PrefixIndex


@dataclasses.dataclass(frozen=True)
class Budget:
    """How ``budget_bytes`` splits into pages and snapshots."""

    num_pages: int  # including the trash page
    num_snapshots: int

    @staticmethod
    def split(budget_bytes: int, page_bytes: int, snapshot_bytes: int, snapshot_share: float) -> "Budget":
        if not 0 < snapshot_share < 1:
            raise ValueError(f"snapshot_share={snapshot_share!r} must lie in (0, 1)")
        snaps = int(budget_bytes * snapshot_share) // max(snapshot_bytes, 1)
        pages = (budget_bytes - snaps * snapshot_bytes) // page_bytes
        if snaps < 1 or pages < 2:
            raise ValueError(f"budget_bytes={budget_bytes} must hold at least one KDA snapshot ({snapshot_bytes} "
                             f"bytes at snapshot_share={snapshot_share}) and two pages ({page_bytes} bytes each)")
        return Budget(num_pages=int(pages), num_snapshots=int(snaps))


@dataclasses.dataclass
class Stats:
    evicted_pages: int = 0
    dropped_snapshots: int = 0


class Allocator:
    def __init__(self, budget: Budget, index: PrefixIndex):
        self.budget, self.index = budget, index
        self.free_pages = list(range(budget.num_pages - 1, TRASH_PAGE, -1))  # pop() hands out low ids first
        self.free_snapshots = list(range(budget.num_snapshots - 1, -1, -1))
        self._free = set(self.free_pages)
        self.stats = Stats()

    @property
    def pages_in_use(self) -> int:
        return self.budget.num_pages - 1 - len(self.free_pages)

    def pages(self, n: int) -> list[int] | None:
        """``n`` free pages, evicting unreferenced cached prefixes as needed; None if they cannot be had."""
        while len(self.free_pages) < n:
            leaf = self.index.evictable_leaf()
            if leaf is None:
                return None
            self._evict(leaf)
        out = [self.free_pages.pop() for _ in range(n)]
        self._free.difference_update(out)
        return out

    def snapshot(self) -> int | None:
        """A free snapshot, dropping the least recently used one if none is free."""
        if not self.free_snapshots:
            node = self.index.oldest_snapshot()
            if node is None:
                return None
            self.drop_snapshot(node)
        return self.free_snapshots.pop()

    def release_pages(self, pages) -> None:
        for p in pages:
            if p == TRASH_PAGE or p in self._free:
                raise ValueError(f"page {p} released twice or never allocated")
            self.free_pages.append(p)
            self._free.add(p)

    def release_snapshot(self, snap: int) -> None:
        self.free_snapshots.append(snap)

    def drop_snapshot(self, node: Node) -> None:
        """Free ``node``'s snapshot; a tail without one can never be matched, so it goes too."""
        self.release_snapshot(node.snapshot)
        node.snapshot = None
        self.stats.dropped_snapshots += 1
        if len(node.key) < self.index.page_size and node.refs == 0:
            self._evict(node)

    def _evict(self, node: Node) -> None:
        self.index.remove(node)
        self.release_pages([node.page])
        self.stats.evicted_pages += 1
        if node.snapshot is not None:
            self.release_snapshot(node.snapshot)
            node.snapshot = None
