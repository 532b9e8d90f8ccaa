"""A request's life on the host: its tokens, where its cache lives, and its output stream.

The engine thread appends tokens (``push``); whoever submitted the request reads ``events``
(a thread-safe queue of `Delta` items ending with one whose ``finish_reason`` is set). Text is
decoded incrementally when the engine has a tokenizer: a delta holds back a trailing partial
UTF-8 character and any suffix that could still grow into a stop string, and the output ends
*before* a stop string (OpenAI's rule), which never appears in the text.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import queue
import time
from typing import Callable

from k3jax.serve.params import SamplingParams
from k3jax.serve.radix import Node

_ids = itertools.count()


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclasses.dataclass
class Delta:
    tokens: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "cancelled", or an error message's kind


class Request:
    def __init__(self, prompt: list[int], params: SamplingParams, decode: Callable[[list[int]], str] | None):
        self.id = next(_ids)
        self.prompt, self.params, self._decode = prompt, params, decode
        self.tokens = list(prompt)  # prompt + generated; the first ``length`` are in the cache
        self.generated: list[int] = []
        self.length = 0
        self.device_length = 0  # tokens the slot's device state has consumed (> length: ran past a stop string)
        self.state = State.WAITING
        self.slot: int | None = None
        self.pages: list[int] = []  # the page table (index i: tokens [i·page, (i+1)·page))
        self.owned: set[int] = set()  # pages freed when the request ends (the rest belong to the index)
        self.refs: list[Node] = []  # index nodes pinned while the request runs
        self.node: Node | None = None  # the deepest full-page index node of its cached tokens
        self.hit = 0  # prompt tokens reused from the prefix index
        self.draft_pending = 0  # speculative decoding: positions the slot's draft has still to read
        self.cancelled = False
        self.finish_reason: str | None = None
        self.events: queue.Queue[Delta] = queue.Queue()
        self.text = ""  # the output text so far (up to any stop string)
        self._shown = 0
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None

    def push(self, token: int) -> bool:
        """Append a sampled token and stream what is new; True when the request is finished."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.generated.append(token)
        self.tokens.append(token)
        reason = None
        if token in self.params.stop_token_ids:
            reason = "stop"
        elif len(self.generated) >= self.params.max_tokens:
            reason = "length"
        if self._decode is not None:
            text = self._decode([t for t in self.generated if t not in self.params.stop_token_ids])
            cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
            self.text = text
        self.finish_reason = reason
        self._emit(token, reason)
        return reason is not None

    def _emit(self, token: int, reason: str | None) -> None:
        if self._decode is None:
            self.events.put(Delta([token], "", reason))
            return
        end = len(self.text) if reason else len(self.text) - self._held_back(self.text)
        delta = self.text[self._shown:end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        self.events.put(Delta([token], delta, reason))

    def _held_back(self, text: str) -> int:
        """Characters kept back: a trailing U+FFFD and the longest suffix that begins a stop string."""
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held

    def finish(self, reason: str) -> None:
        """Close the stream (a cancelled or failed request; ``push`` closes finished ones)."""
        self.finish_reason = reason
        self.state = State.DONE
        self.events.put(Delta([], "", reason))

    def wait(self, timeout: float | None = None) -> list[int]:
        """Block until done; the generated token ids."""
        while True:
            if self.events.get(timeout=timeout).finish_reason is not None:
                return self.generated
