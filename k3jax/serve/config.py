"""The engine's sizes: slots, pages, the prefill chunk, the per-step token budget, cache memory."""

from __future__ import annotations

import dataclasses

from k3jax.layers.mla import KEY_BLOCK


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8  # requests decoding at once (the decode program's batch)
    page_size: int = 256  # tokens per MLA page (a power of two <= KEY_BLOCK)
    max_context: int = 8192  # prompt + output tokens of one request
    chunk: int = 2048  # prefill tokens per lane per step (a multiple of page_size)
    prefill_lanes: int = 1  # requests prefilled side by side per step
    decode_steps: int = 8  # decode steps per device call while no prompt waits to be prefilled
    step_tokens: int | None = None  # token budget per step (default: every slot decoding + full chunks)
    cache_bytes: int | None = None  # pages + snapshots (default: every slot's full context, twice)
    snapshot_share: float = 0.25  # at most this part of cache_bytes holds KDA snapshots
    snapshot_every: int = 4  # KDA snapshot every this many pages along a sequence (plus at its end)
    prefix_cache: bool = True  # reuse cached prefixes across requests
    buckets: tuple[int, ...] = ()  # pages gathered per lane, one program each (empty: powers of two)
    draft_tokens: int = 0  # speculative decoding: tokens the draft proposes per slot and step (0: off)

    def __post_init__(self):
        for name in ("num_slots", "page_size", "max_context", "chunk", "prefill_lanes", "decode_steps",
                     "snapshot_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if not isinstance(self.draft_tokens, int) or isinstance(self.draft_tokens, bool) or self.draft_tokens < 0:
            raise ValueError(f"draft_tokens={self.draft_tokens!r} must be an int >= 0 (0: no speculative decoding)")
        if self.page_size & (self.page_size - 1) or self.page_size > KEY_BLOCK:
            raise ValueError(f"page_size={self.page_size} must be a power of two <= {KEY_BLOCK}")
        if self.chunk % self.page_size:
            raise ValueError(f"chunk={self.chunk} must be a multiple of page_size={self.page_size}")
        if self.buckets and (list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1
                             or self.buckets[-1] != self.max_pages
                             or any(b * self.page_size > KEY_BLOCK and b * self.page_size % KEY_BLOCK
                                    for b in self.buckets)):
            raise ValueError(f"buckets={self.buckets} must increase, end at max_pages={self.max_pages}, and each "
                             f"hold <= {KEY_BLOCK} tokens or a multiple of {KEY_BLOCK}")
        if self.step_tokens is not None and self.step_tokens < self.decode_tokens + 1:
            raise ValueError(f"step_tokens={self.step_tokens} must be >= num_slots * (draft_tokens + 1) + 1 = "
                             f"{self.decode_tokens + 1} (every slot decoding, and prefill still progressing)")

    @property
    def decode_tokens(self) -> int:
        """Tokens the decode program feeds per step: one per slot, or the draft's plus one to verify."""
        return self.num_slots * (self.draft_tokens + 1)

    @property
    def budget_tokens(self) -> int:
        return self.step_tokens or self.decode_tokens + self.chunk * self.prefill_lanes

    @property
    def max_pages(self) -> int:
        """Page-table width: the longest context (plus the draft tokens a verification feeds past a
        request's last token), rounded so the gathered length is a valid cache length."""
        pages = -(-(self.max_context + self.draft_tokens) // self.page_size)
        per_block = KEY_BLOCK // self.page_size
        return pages if pages <= per_block else -(-pages // per_block) * per_block

    @property
    def page_buckets(self) -> tuple[int, ...]:
        """Pages gathered per lane: ``buckets``, or powers of two up to ``max_pages`` (one program each)."""
        if self.buckets:
            return self.buckets
        out, n = [], 1
        while n < self.max_pages:
            out.append(n)
            n *= 2
        return (*out, self.max_pages)

    def bucket(self, pages: int) -> int:
        return next(b for b in self.page_buckets if b >= pages)
