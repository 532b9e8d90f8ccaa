"""Communication volume per mesh axis, read from a compiled program's HLO.

Every collective of the partitioned program (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute, in their sync or async ``-start`` forms) names its device groups; a group's
devices differ in the mesh coordinates of the axes it communicates over. The bytes one device
sends are the ring-algorithm volumes of its operand (``S``) in a group of ``n``:
all-reduce ``2(n-1)/n·S``, all-gather ``(n-1)·S``, reduce-scatter and all-to-all ``(n-1)/n·S``,
collective-permute ``S``. A collective inside a loop counts once per iteration: the layer scan,
the micro-batch scan and the prefill chunks are ``while`` loops with a known trip count.
"""

from __future__ import annotations

import collections
import math
import re

import numpy as np

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(_KINDS) + r")(?:-start)?\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _shape_bytes(text: str) -> int:
    return sum(_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _SHAPE.findall(text))


def _operand_bytes(args: str) -> int:
    """Bytes of the operands listed before the op's attributes (``f32[8]{0} %x, …), attrs``)."""
    depth, end = 0, len(args)
    for i, ch in enumerate(args):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth < 0:
            end = i
            break
    return _shape_bytes(re.sub(r"\{[\d,:A-Z()]*\}", "", args[:end]))


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """Device groups of one collective (explicit, iota ``[G,S]<=[dims]T(perm)`` or permute pairs)."""
    if m := re.search(r"source_target_pairs=\{(.*?)\}\}", line):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m.group(1) + "}")]
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    if m := re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(num_devices))]  # empty replica_groups: every device


def _axes_of(group: list[int], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    coords = np.array(np.unravel_index(group, tuple(mesh_shape.values()))).T  # [n, axes]
    return tuple(name for i, name in enumerate(mesh_shape) if len(set(coords[:, i])) > 1)


def _sent(kind: str, nbytes: int, n: int) -> float:
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "all-gather":
        return (n - 1) * nbytes
    if kind == "collective-permute":
        return nbytes
    return (n - 1) / n * nbytes


def _multipliers(hlo: str) -> tuple[dict[str, int], list[str]]:
    """Times each computation runs per call of the entry, and its lines."""
    lines: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if current is None and (m := _COMP.match(line.strip())) and "=" not in line.split("{")[0]:
            current = m.group(1)
            lines[current] = []
            entry = current if line.lstrip().startswith("ENTRY") else entry
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            lines[current].append(line)
    times: dict[str, int] = collections.defaultdict(int)

    def visit(comp: str, mult: int, depth: int = 0) -> None:
        times[comp] += mult
        for line in lines.get(comp, ()):
            trips = int(m.group(1)) if (m := _TRIPS.search(line)) and " while(" in line else 1
            callees = _CALLS.findall(line) + [c.strip().lstrip("%") for b in _BRANCHES.findall(line)
                                              for c in b.split(",")]
            for callee in callees:
                if callee in lines and depth < 50:
                    visit(callee, mult * (trips if f"body={callee}" in line.replace("%", "") else 1), depth + 1)

    if entry is not None:
        visit(entry, 1)
    return times, lines


def volume_per_axis(hlo: str, mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes each device sends per call, by the mesh axes a collective spans ("data", "expert+fsdp", …)."""
    times, lines = _multipliers(hlo)
    total: dict[str, float] = collections.defaultdict(float)
    num_devices = math.prod(mesh_shape.values())
    for comp, body in lines.items():
        for line in body:
            if not (m := _OP.search(line)) or times.get(comp, 0) == 0:
                continue
            kind, args = m.group(2), m.group(3)
            groups = _groups(line, num_devices)
            if not groups or len(groups[0]) < 2:
                continue
            axes = _axes_of(groups[0], mesh_shape)
            n = len(groups[0]) if kind != "collective-permute" else 2
            total["+".join(axes) or "none"] += times[comp] * _sent(kind, _operand_bytes(args), n)
    return dict(total)
