"""Hypothesis strategies shared by the property tests: document layouts of a packed row.

Shapes stay fixed inside a test (each new shape is one more XLA compile, and compiles dominate the
suite); what varies is the data a compiled function sees: where documents start, token values.
"""

import numpy as np
from hypothesis import strategies as st


def doc_starts(length: int, chunk: int, max_docs: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    """Sorted start positions of the 2nd.. documents of a row of ``length`` tokens, drawn to hit
    chunk edges (a multiple of ``chunk``) and the tokens on either side of one."""
    edges = {c + d for c in range(chunk, length, chunk) for d in (-1, 0, 1)} | {1, length - 1}
    candidates = st.one_of(st.sampled_from(sorted(e for e in edges if 0 < e < length)), st.integers(1, length - 1))
    return st.lists(candidates, max_size=max_docs - 1, unique=True).map(lambda s: tuple(sorted(s)))


def segment_row(length: int, starts: tuple[int, ...]) -> np.ndarray:
    """int32 ``[length]`` segment ids, a new id at each start."""
    return np.searchsorted(np.asarray(starts, np.int64), np.arange(length), side="right").astype(np.int32)


def documents(length: int, starts: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the documents of the row."""
    bounds = (0, *starts, length)
    return list(zip(bounds[:-1], bounds[1:]))
