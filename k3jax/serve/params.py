"""Per-request sampling parameters, validated before a request is queued (``ValueError`` naming
the field and what it must be, which the server turns into an HTTP 400)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Sequence

MAX_STOP_IDS = 8  # stop ids per request, checked on the device


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# It checks its own fields (``__post_init__``) with errors that name the field, which is what an
# HTTP client sees as a 400: the run-time annotation checks must not pre-empt them.
@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM spells it): off
    stop: tuple[str, ...] = ()  # strings that end the output (not included in it)
    stop_token_ids: tuple[int, ...] = ()  # ids that end the output (included in the token ids)
    seed: int = 0

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature={self.temperature!r} must be a number in [0, 100] (0: greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1, or 0 / -1 for no limit")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop) \
                or len(self.stop) > 16:
            raise ValueError(f"stop={self.stop!r} must be at most 16 non-empty strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids) \
                or len(self.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be at most {MAX_STOP_IDS} non-negative ints "
                             "(end-of-text ids included)")
        if not _is_int(self.seed) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**32)")

    @property
    def k(self) -> int:
        """top_k as the device wants it (0: off)."""
        return max(self.top_k, 0)

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must lie in [0, vocab_size={vocab_size}), got {bad}")


def as_tuple(value, name: str) -> tuple:
    """A JSON field that may be one item, a list or null, as a tuple."""
    if value is None:
        return ()
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return tuple(value)
    raise ValueError(f"{name}={value!r} must be a string / id or a list of them")
