"""Per-device memory from the compiler's buffer assignment, without waiting for code generation.

At K3's widths the TPU compiler assigns buffers (and checks them against HBM) within a minute or
two, then spends tens of minutes generating code (scheduling the Mosaic kernels and the layer
loop) that changes no allocation. ``--memory-only`` compiles with XLA's dumps switched on, reads
the memory the program needs from the buffer-assignment dump as soon as it is written, and leaves
the compile unfinished (the CLI exits). The numbers are the ones the compiler checks against HBM
(their sum is the total an out-of-memory error quotes):

- ``arguments``: HBM allocations holding entry parameters (parameters, optimizer state, cache, batch;
  donated outputs reuse them);
- ``temporaries``: every other allocation of device memory, outputs that alias no argument included;
- ``largest``: the biggest temporaries with the shapes that share them, to name what allocates.

The optimized HLO dumped beside it gives the communication volumes as the compiled one would.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import tempfile
import threading
import time

_ALLOC = re.compile(r"^allocation \d+: size (\d+), (.*?):?\n((?: value: .*\n)*)", re.M)
_VALUE = re.compile(r"\(size=(\d+),offset=(\d+)\): (\w+\[[\d,]*\])")


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Device memory (default memory space) of one compiled program, in bytes."""

    arguments: int
    temporaries: int
    largest: tuple[tuple[int, str], ...]  # (bytes, the shapes sharing that allocation)
    hlo: str  # the optimized HLO text


def _shapes(shapes: list[str]) -> str:
    """``2×bf16[163840,3584], f32[8192]``: the shapes of the values sharing one buffer."""
    counts: dict[str, int] = {}
    for shape in shapes:
        counts[shape] = counts.get(shape, 0) + 1
    return ", ".join(f"{n}×{s}" if n > 1 else s for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _regions(values: str) -> list[tuple[int, str]]:
    """The buffers inside one allocation (TPU packs all temporaries into one): values at the same
    offset share a buffer, as large as the largest of them."""
    by_offset: dict[int, tuple[int, list[str]]] = {}
    for size, offset, shape in _VALUE.findall(values):
        big, shapes = by_offset.get(int(offset), (0, []))
        by_offset[int(offset)] = (max(big, int(size)), shapes + [shape])
    return [(size, _shapes(shapes)) for size, shapes in by_offset.values()]


def parse(assignment: str, hlo: str, top: int = 12) -> Buffers:
    """``Buffers`` from the dumps' text: the buffer assignment (allocations; colour 0 is HBM, the
    others on-chip memories) and the optimized HLO."""
    args = temps = 0
    largest: list[tuple[int, str]] = []
    for size, rest, values in _ALLOC.findall(assignment):
        colour = re.search(r"color (\d+)", rest)
        if (colour and colour.group(1) != "0") or "thread-local" in rest:
            continue
        if "parameter" in rest:
            args += int(size)
        else:
            temps += int(size)
            largest += _regions(values)
    largest.sort(key=lambda t: -t[0])
    return Buffers(arguments=args, temporaries=temps, largest=tuple(largest[:top]), hlo=hlo)


def _dumped(folder: str, suffix: str) -> str | None:
    found = sorted(glob.glob(os.path.join(folder, f"*{suffix}")), key=os.path.getsize)
    return found[-1] if found else None


def assign_buffers(lowered, poll_seconds: float = 2.0, timeout: float = 3600.0) -> Buffers:
    """Compile ``lowered`` in a background thread and return its buffers as soon as the compiler
    has written them. The thread is left running (a compile cannot be interrupted): callers exit
    the process afterwards. Errors the compile raises first (an out-of-memory) are re-raised, with
    the refused assignment as their ``buffers`` attribute where the compiler wrote one."""
    folder = tempfile.mkdtemp(prefix="k3jax-plan-")
    options = {"xla_dump_to": folder, "xla_dump_hlo_as_text": True}
    failure: list[BaseException] = []

    def compile_it():
        try:
            lowered.compile(compiler_options=options)
        except BaseException as err:  # handed to the caller below
            failure.append(err)

    thread = threading.Thread(target=compile_it, daemon=True, name="k3jax-plan-compile")
    thread.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # the post-assignment HLO is written after the assignment and the report are complete
        done = _dumped(folder, "after_optimizations_after_buffer_assignment.txt")
        if done or failure or not thread.is_alive():
            break
        time.sleep(poll_seconds)
    try:
        names = [_dumped(folder, s) for s in ("after_optimizations-buffer-assignment.txt", "after_optimizations.txt")]
        if failure:  # an out-of-memory: the assignment it refused names what allocates
            failure[0].buffers = parse(*[open(n).read() for n in names]) if all(names) else None
            raise failure[0]
        if not all(names):
            raise ValueError(f"the compiler wrote no buffer assignment within {timeout:.0f} s (this XLA backend "
                             "may not dump one): run without --memory-only")
        return parse(*[open(n).read() for n in names])
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the dumps are large; what is kept is parsed
