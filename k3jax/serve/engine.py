"""The continuous-batching engine: requests join and leave between steps over one paged cache.

Each ``step()``:

1. Admit waiting requests (FIFO) while a slot is free: match the prompt in the prefix index,
   pin the shared pages, reserve private pages for the rest of prompt + ``max_tokens`` (evicting
   unreferenced cached prefixes if needed; if that fails the request keeps waiting), copy a
   partial tail page, load the KDA snapshot into the slot.
2. Decode: every decoding slot advances, one program over ``[num_slots]`` lanes. While no prompt
   waits, it runs up to ``decode_steps`` tokens in one device loop (rows stop on the device at a
   stop id, their ``max_tokens`` or the next snapshot boundary), else one token, so prefill is
   never held back by more than a step. With ``draft_tokens`` it is one draft-and-verify step
   instead (``k3jax.serve.speculative``).
3. Prefill: the rest of the step's token budget goes to prompt chunks (``prefill_lanes`` lanes
   of ``chunk`` tokens); a chunk that does not finish its prompt ends on a page boundary, so
   snapshots can be taken there. A finished prompt samples its first token.
4. Cache: every page a request fills joins the prefix index at once (other requests can share it
   while it runs), with a KDA snapshot every ``snapshot_every`` pages; a finished request leaves
   its partial last page and final state as a tail node (the next turn of a conversation resumes
   there), then its slot and private pages are freed.

Shapes are static: lanes are fixed, token widths are 1 and ``chunk``, and pages per lane come in
power-of-two buckets; ``warm_up()`` compiles every program, after which nothing compiles.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Sequence

import jax
import numpy as np

from k3jax.config import ModelConfig
from k3jax.infer.decode import decode_layout
from k3jax.serve import pages as paged_ops
from k3jax.serve.allocator import Allocator, Budget
from k3jax.serve.config import EngineConfig
from k3jax.serve.params import MAX_STOP_IDS, SamplingParams
from k3jax.serve.radix import Match, PrefixIndex
from k3jax.serve.request import Request, State
from k3jax.serve.speculative import Speculator
from k3jax.serve.step import RowSampling, decode_block, model_step

_COMPILES = [0]


def _count_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compilations() -> int:
    """XLA compilations in this process so far (jax's backend-compile monitoring event)."""
    return _COMPILES[0]


class Engine:
    """One model, one paged cache, many requests: ``submit`` from any thread, ``step`` from one
    (the server's engine thread, or ``generate`` here), ``cancel`` to stop a request early."""

    def __init__(self, variables: dict, cfg: ModelConfig, ecfg: EngineConfig = EngineConfig(), *,
                 decode: Callable[[list[int]], str] | None = None, draft: dict | None = None):
        if ecfg.max_context > cfg.max_position:
            raise ValueError(f"max_context={ecfg.max_context} must be <= the model's max_position={cfg.max_position}")
        if (draft is None) != (ecfg.draft_tokens == 0):
            raise ValueError(f"draft_tokens={ecfg.draft_tokens}: speculative decoding needs both draft_tokens >= 1 "
                             "and draft parameters (Engine(draft=...); on the command line --draft FILE)")
        variables, cfg = decode_layout(variables, cfg)  # per-layer weights (scanned slices copy before each matmul)
        self.variables, self.cfg, self.ecfg, self.decode = variables, cfg, ecfg, decode
        probe = paged_ops.init_paged(cfg, num_slots=1, num_pages=1, page_size=ecfg.page_size, num_snapshots=1)
        self.page_bytes, self.snapshot_bytes = paged_ops.page_bytes(probe), paged_ops.snapshot_bytes(probe)
        # Default: every slot's full context twice over, and eight snapshots per slot.
        default = max(2 * ecfg.num_slots * ecfg.max_pages * self.page_bytes / (1 - ecfg.snapshot_share),
                      8 * ecfg.num_slots * self.snapshot_bytes / ecfg.snapshot_share)
        self.budget = Budget.split(int(ecfg.cache_bytes or default), self.page_bytes, self.snapshot_bytes,
                                   ecfg.snapshot_share)
        self.slots: list[Request | None] = [None] * ecfg.num_slots
        self.spec = None if draft is None else Speculator(self, draft)
        self._reset_cache()
        self.waiting: collections.deque[Request] = collections.deque()
        self.incoming: collections.deque[Request] = collections.deque()
        self.wake = threading.Condition()
        # every key up front: /health copies the counter from another thread while steps update it
        self.stats = collections.Counter(dict.fromkeys(
            ("requests", "prompt_tokens", "hit_tokens", "prefill_tokens", "generated_tokens", "steps", "cancelled",
             "draft_verifies", "draft_accepted"), 0))
        self._bucket: int | None = None  # warm_up's forced page bucket

    def _reset_cache(self) -> None:
        """Empty pools, index and page tables (at start, and after a failed step left them unknown)."""
        ecfg = self.ecfg
        self.paged = paged_ops.init_paged(self.cfg, num_slots=ecfg.num_slots, num_pages=self.budget.num_pages,
                                          page_size=ecfg.page_size, num_snapshots=self.budget.num_snapshots)
        self.index = PrefixIndex(ecfg.page_size)
        self.alloc = Allocator(self.budget, self.index)
        self.page_table = np.zeros((ecfg.num_slots + 1, ecfg.max_pages), np.int32)  # last row: scratch slot
        if self.spec is not None:
            self.spec.reset()

    def fail_all(self, message: str) -> None:
        """End every request with ``error: message`` and start from an empty cache."""
        for r in [r for r in self.slots if r is not None]:
            self.slots[r.slot] = None
            r.finish(f"error: {message}")
        while self.waiting:
            self.waiting.popleft().finish(f"error: {message}")
        self._reset_cache()

    # -- requests ----------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int | np.integer] | np.ndarray, params: SamplingParams = SamplingParams()) -> Request:
        """Queue a request (thread-safe); ``ValueError`` for a prompt or parameters it cannot serve."""
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("prompt must be a non-empty list of token ids")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"prompt ids must lie in [0, vocab_size={self.cfg.vocab_size})")
        params.check_vocab(self.cfg.vocab_size)
        if ids.size + params.max_tokens > self.ecfg.max_context:
            raise ValueError(f"the prompt ({ids.size} tokens) plus max_tokens={params.max_tokens} must fit the "
                             f"context of {self.ecfg.max_context} tokens")
        if -(-(ids.size + params.max_tokens) // self.ecfg.page_size) > self.budget.num_pages - 1:
            raise ValueError(f"the prompt plus max_tokens needs more cache pages than the whole budget holds "
                             f"({self.budget.num_pages - 1})")
        req = Request([int(t) for t in ids], params, self.decode)
        with self.wake:
            self.incoming.append(req)
            self.wake.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop ``req`` (thread-safe): its slot and private pages are freed at the next step."""
        req.cancelled = True
        with self.wake:
            self.wake.notify()

    @property
    def busy(self) -> bool:
        return bool(self.incoming or self.waiting or any(self.slots))

    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix index / prompt tokens admitted."""
        return self.stats["hit_tokens"] / max(self.stats["prompt_tokens"], 1)

    def metrics(self) -> dict:
        """Counters and rates (``/health``); ``draft_mean_accepted``: drafts accepted per verification."""
        verifies, accepted = max(self.stats["draft_verifies"], 1), self.stats["draft_accepted"]
        spec = {"draft_mean_accepted": accepted / verifies,
                "draft_acceptance_rate": accepted / (verifies * max(self.ecfg.draft_tokens, 1))}
        return {**self.stats, **spec, "hit_rate": self.hit_rate(), "evicted_pages": self.alloc.stats.evicted_pages,
                "dropped_snapshots": self.alloc.stats.dropped_snapshots, "pages_in_use": self.alloc.pages_in_use,
                "num_pages": self.budget.num_pages - 1, "num_snapshots": self.budget.num_snapshots}

    def generate(self, prompts: Sequence[Sequence[int | np.integer] | np.ndarray], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[list[int]]:
        """Run ``prompts`` to completion on this thread (tests, benchmarks); the generated ids."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.submit(p, q) for p, q in zip(prompts, params)]
        while any(r.state is not State.DONE for r in reqs):
            self.step()
        return [r.generated for r in reqs]

    def warm_up(self) -> None:
        """Compile every program the engine can run (all lanes idle: nothing in the cache changes)."""
        S, L, C = self.ecfg.num_slots, self.ecfg.prefill_lanes, self.ecfg.chunk
        idle = lambda B, T, ids: self._call(ids, np.zeros((B, T), np.int32), np.zeros((B,), np.int32), {})
        for pages in self.ecfg.page_buckets:
            self._bucket = pages
            if self.spec is not None:
                self.spec.decode([])
            else:
                self._call(np.arange(S, dtype=np.int32), np.zeros((S,), np.int32), np.zeros((S,), np.int32), {},
                           np.full((S, MAX_STOP_IDS), -1, np.int32))
            idle(L, C, np.full((L,), S, np.int32))
        self._bucket = None
        scratch, spare = np.int32(S), np.int32(0)
        self.paged = paged_ops.save_snapshot(self.paged, scratch, spare)
        self.paged = paged_ops.load_snapshot(self.paged, spare, scratch, np.bool_(True))
        self.paged = paged_ops.copy_page(self.paged, np.int32(0), np.int32(0))
        jax.block_until_ready(self.paged)

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> None:
        with self.wake:
            self.waiting.extend(self.incoming)
            self.incoming.clear()
        for req in [r for r in self.slots if r is not None and r.cancelled]:
            self._release(req, "cancelled", cache=False)
            self.stats["cancelled"] += 1
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            req.finish("cancelled")
            self.stats["cancelled"] += 1
        while self.waiting and None in self.slots and self._admit(self.waiting[0]):
            self.waiting.popleft()
        # Both programs are dispatched before either's tokens are read: one host sync per step.
        launched = []
        decoding = [r for r in self.slots if r is not None and r.state is State.DECODE]
        if decoding:
            launched.append(self._decode(decoding))
        budget = self.ecfg.budget_tokens - len(decoding) * (self.ecfg.draft_tokens + 1)
        prefilling = [r for r in self.slots if r is not None and r.state is State.PREFILL]
        prefilling.sort(key=lambda r: r.id)
        if prefilling and budget > 0:
            launched.append(self._prefill(prefilling[:self.ecfg.prefill_lanes], budget))
        for out, done in launched:
            done(np.asarray(out))
        self.stats["steps"] += 1

    def _admit(self, req: Request) -> bool:
        P = self.ecfg.page_size
        limit = len(req.prompt) - 1  # at least one prompt token is fed: its logits give the first token
        match = self.index.match(req.prompt, limit) if self.ecfg.prefix_cache else Match(0, [], None, None)
        pinned = match.nodes + ([match.tail] if match.tail else [])
        for n in pinned:  # before allocating: eviction must not take the matched prefix
            n.refs += 1
        need = -(-(len(req.prompt) + req.params.max_tokens - 1) // P) - len(match.nodes)
        private = self.alloc.pages(need)
        if match.tail:
            match.tail.refs -= 1
        if private is None:
            for n in match.nodes:
                n.refs -= 1
            return False
        slot = self.slots.index(None)
        self.slots[slot], req.slot, req.state = req, slot, State.PREFILL
        req.refs, req.owned = list(match.nodes), set(private)
        req.pages = [n.page for n in match.nodes] + private
        req.node = match.nodes[-1] if match.nodes else self.index.root
        req.length = req.hit = match.length
        self.page_table[slot] = 0
        self.page_table[slot, :len(req.pages)] = req.pages
        if match.tail is not None:
            self.paged = paged_ops.copy_page(self.paged, np.int32(match.tail.page), np.int32(private[0]))
        self.paged = paged_ops.load_snapshot(self.paged, np.int32(match.snapshot or 0), np.int32(slot),
                                             np.bool_(match.snapshot is None))
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(req.prompt)
        self.stats["hit_tokens"] += match.length
        return True

    def _decode(self, reqs: list[Request]):
        """Dispatch up to ``decode_steps`` tokens for each of ``reqs`` (one while prompts wait to be
        prefilled): ``(tokens [K, slots] on the device, what to do with them)``."""
        if self.spec is not None:
            return self.spec.decode(reqs)
        S, K = self.ecfg.num_slots, self.ecfg.decode_steps
        quiet = self.quiet()
        tokens, limit = np.zeros((S,), np.int32), np.zeros((S,), np.int32)
        stop = np.full((S, MAX_STOP_IDS), -1, np.int32)
        for r in reqs:
            every = self.ecfg.snapshot_every * self.ecfg.page_size  # blocks end where snapshots are taken
            to_snapshot = (r.length // every + 1) * every - r.length
            limit[r.slot] = min(K, r.params.max_tokens - len(r.generated), to_snapshot) if quiet else 1
            tokens[r.slot] = r.tokens[r.length]
            stop[r.slot, :len(r.params.stop_token_ids)] = r.params.stop_token_ids

        def done(out):
            for r in reqs:
                column = out[:, r.slot]
                new = [int(t) for t in column[column >= 0]]
                r.device_length = r.length + len(new)
                for t in new:
                    r.length += 1
                    if self._advance(r, t):
                        break  # a stop string: the device ran past it, the rest is dropped
        return self._call(np.arange(S, dtype=np.int32), tokens, limit, {r.slot: r for r in reqs}, stop), done

    def quiet(self) -> bool:
        """No prompt waits to be prefilled: decode may run several steps per device call."""
        return not (self.waiting or self.incoming or any(r is not None and r.state is State.PREFILL
                                                         for r in self.slots))

    def _prefill(self, reqs: list[Request], budget: int):
        """Dispatch the next prompt chunk of each of ``reqs``: ``(tokens on the device, what to do with them)``."""
        L, C, P = self.ecfg.prefill_lanes, self.ecfg.chunk, self.ecfg.page_size
        tokens, num_new = np.zeros((L, C), np.int32), np.zeros((L,), np.int32)
        slot_ids = np.full((L,), self.ecfg.num_slots, np.int32)
        lanes = {}
        for lane, r in enumerate(reqs):
            if budget <= 0:
                break
            end = min(len(r.prompt), r.length + C, r.length + budget)
            if end < len(r.prompt) and end // P * P > r.length:
                end = end // P * P  # stop on a page boundary: a snapshot can be taken there
            n = end - r.length
            tokens[lane, :n], num_new[lane], slot_ids[lane] = r.prompt[r.length:end], n, r.slot
            lanes[lane] = r
            budget -= n
        def done(out):
            for lane, r in lanes.items():
                r.length += int(num_new[lane])
                r.device_length = r.length
                self.stats["prefill_tokens"] += int(num_new[lane])
                if r.length == len(r.prompt):
                    r.state = State.DECODE
                    self._advance(r, int(out[lane]))
                else:
                    self._cache_pages(r)
        return self._call(slot_ids, tokens, num_new, lanes), done

    def _call(self, slot_ids, tokens, num_new, lanes: dict, stop=None) -> jax.Array:
        """Dispatch one model program over ``lanes`` (lane -> request): a prefill chunk
        (``tokens [B, C]``), or with ``stop`` a decode block (``tokens [B]``, ``num_new`` the
        lanes' step limits). The sampled tokens, still on the device."""
        lengths, sampling, table = self.lane_rows(slot_ids, num_new, lanes, decode=stop is not None)
        if stop is None and self.spec is not None:
            return self.spec.prefill(tokens, num_new, lanes, slot_ids, table, lengths, sampling)
        if stop is None:
            out, self.paged = model_step(self.variables, self.paged, tokens, num_new, slot_ids, table, lengths,
                                         sampling, cfg=self.cfg)
        else:
            out, self.paged = decode_block(self.variables, self.paged, tokens, num_new, stop, slot_ids, table,
                                           lengths, sampling, cfg=self.cfg, max_steps=self.ecfg.decode_steps)
        return out

    def lane_rows(self, slot_ids, num_new, lanes: dict, *, decode: bool):
        """The lanes' cached lengths, sampling rows and page table (its width the page bucket that
        holds every lane's ``length + num_new`` tokens)."""
        B = len(slot_ids)
        lengths = np.zeros((B,), np.int32)
        temp, top_p = np.zeros((B,), np.float32), np.ones((B,), np.float32)
        top_k, seed, pos = np.zeros((B,), np.int32), np.zeros((B,), np.uint32), np.zeros((B,), np.int32)
        pages = 1
        for lane, r in lanes.items():
            lengths[lane] = r.length
            q = r.params
            temp[lane], top_p[lane], top_k[lane], seed[lane] = q.temperature, q.top_p, q.k, q.seed
            pos[lane] = r.length + (1 if decode else num_new[lane])  # the (first) sampled token's position
            pages = max(pages, -(-(r.length + int(num_new[lane])) // self.ecfg.page_size))
        table = self.page_table[slot_ids, :self._bucket or self.ecfg.bucket(pages)]
        return lengths, RowSampling(temp, top_k, top_p, seed, pos), table

    def _advance(self, r: Request, token: int) -> bool:
        """After the cache grew: index the filled pages, then take the sampled token; True when
        that finished the request."""
        self._cache_pages(r)
        self.stats["generated_tokens"] += 1
        if r.push(token):
            self._release(r, r.finish_reason, cache=True)
            return True
        return False

    # -- the prefix index --------------------------------------------------------------------------

    def _cache_pages(self, r: Request) -> None:
        """Every page ``r`` has filled joins the index (shared from now on), with snapshots."""
        P = self.ecfg.page_size
        while self.ecfg.prefix_cache and r.length >= r.node.depth + P:
            i = r.node.depth // P
            key = tuple(r.tokens[r.node.depth:r.node.depth + P])
            child = self.index.child(r.node, key)
            if child is None:
                child = self.index.add(r.node, key, r.pages[i])
                r.owned.discard(r.pages[i])
            child.refs += 1
            child.touch()
            r.refs.append(child)
            r.node = child
            if r.length == child.depth == r.device_length and child.snapshot is None \
                    and (i + 1) % self.ecfg.snapshot_every == 0:
                self._snapshot(r, child)

    def _snapshot(self, r: Request, node) -> bool:
        snap = self.alloc.snapshot()
        if snap is None:
            return False
        self.paged = paged_ops.save_snapshot(self.paged, np.int32(r.slot), np.int32(snap))
        node.snapshot = snap
        return True

    def _release(self, r: Request, reason: str, *, cache: bool) -> None:
        """Free ``r``'s slot; with ``cache``, its last partial page and final state become a tail node."""
        P = self.ecfg.page_size
        if cache and self.ecfg.prefix_cache and r.length == r.device_length:  # the slot's state is at r.length
            tail = r.length - r.node.depth
            if tail == 0 and r.node.snapshot is None and r.node is not self.index.root:
                self._snapshot(r, r.node)
            elif tail > 0 and self.index.child(r.node, tuple(r.tokens[r.node.depth:r.length])) is None:
                node = self.index.add(r.node, tuple(r.tokens[r.node.depth:r.length]), r.pages[r.node.depth // P])
                r.owned.discard(node.page)
                if not self._snapshot(r, node):
                    self.index.remove(node)
                    r.owned.add(node.page)
        self.alloc.release_pages(sorted(r.owned))
        for n in r.refs:
            n.refs -= 1
        r.owned, r.refs = set(), []
        self.slots[r.slot] = None
        self.page_table[r.slot] = 0
        if r.finish_reason is None:
            r.finish(reason)
        r.state = State.DONE
