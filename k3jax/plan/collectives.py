"""Communication volume per mesh axis, read from a compiled program's HLO.

Every collective of the partitioned program (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute, in their sync or async ``-start`` forms) names its device groups; a group's
devices differ in the mesh coordinates of the axes it communicates over. The bytes one device
sends are the ring-algorithm volumes of its operand ``S`` in a group of ``n``:
all-reduce ``2(n-1)/n·S``, all-gather ``(n-1)·S``, reduce-scatter and all-to-all ``(n-1)/n·S``,
collective-permute ``S`` (from the result's size: compiled HLO prints operands without shapes). A collective inside a loop counts once per iteration: the layer scan,
the micro-batch scan and the prefill chunks are ``while`` loops with a known trip count (XLA's
``known_trip_count``, or, where XLA:TPU drops it, a condition ``counter < constant``). A loop
of unknown trip count counts once (expert parallel's overflow rounds: none when nothing overflows,
so one round there is an upper bound); both branches of a conditional count.
"""

from __future__ import annotations

import collections
import math
import re

import numpy as np

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "f4e2m1fn": 1}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"\s(" + "|".join(_KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")
_LESS_THAN = re.compile(r"ROOT .*compare\(%[\w.\-#]+, %([\w.\-]+)\), direction=LT")  # x#0: a tuple element


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (``bf16[8,128]{1,0}``, a tuple, an operand list)."""
    return sum(_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _SHAPE.findall(text))


def _result_bytes(kind: str, result: str) -> int:
    """Bytes of the collective's result (compiled HLO prints operands without shapes). The async
    ``-start`` forms return tuples: all-gather's output is its largest element, a permute's first."""
    if not result.startswith("("):
        return shape_bytes(result)
    sizes = [shape_bytes(f"{dt}[{dims}]") for dt, dims in _SHAPE.findall(result)]
    sizes = [b for b in sizes if b > 4]  # drop the u32[] / s32[] sync flags
    if not sizes:
        return 0
    return max(sizes) if kind == "all-gather" else sizes[0] if kind == "collective-permute" else sum(sizes)


def _mesh_groups(line: str, mesh_shape: dict[str, int]) -> tuple[tuple[str, ...], int] | None:
    """``replica_groups=mesh['a'=2,'b'=4] {'b'}`` (XLA:TPU's form): the named axes of our mesh, or
    of a factorisation of the same devices in the same order, and the group size."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if not m:
        return None
    sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    named = re.findall(r"'(\w+)'", m.group(2))
    n = math.prod(sizes[a] for a in named)
    if all(a in mesh_shape for a in sizes):
        return tuple(a for a in named if mesh_shape[a] > 1), n
    ids = np.arange(math.prod(sizes.values())).reshape(tuple(sizes.values()))
    index = tuple(slice(None) if a in named else 0 for a in sizes)
    return _axes_of(ids[index].reshape(-1).tolist(), mesh_shape), n


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


def _sent(kind: str, out_bytes: int, n: int) -> float:
    """Ring-algorithm bytes one device sends, from the collective's result size."""
    if kind == "all-reduce":
        return 2 * (n - 1) / n * out_bytes
    if kind == "reduce-scatter":
        return (n - 1) * out_bytes
    if kind == "collective-permute":
        return out_bytes
    return (n - 1) / n * out_bytes  # all-gather (result = n inputs), all-to-all


def _trip_count(line: str, lines: dict[str, list[str]]) -> int:
    """Iterations of the ``while`` on ``line``: XLA's ``known_trip_count``, else the bound of a
    condition ``counter < constant`` (a scan counts from 0; the TPU compiler's loops carry no
    trip count: the scanned stack's layers counted once each), else 1 (a data-dependent loop)."""
    if m := _TRIPS.search(line):
        return int(m.group(1))
    condition = lines.get(m.group(1), []) if (m := _CONDITION.search(line)) else []
    constants = dict(_CONSTANT.findall("\n".join(condition)))
    for cond_line in condition:
        if (m := _LESS_THAN.search(cond_line)) and m.group(1) in constants:
            return int(constants[m.group(1)])
    return 1


def _multipliers(hlo: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Times each computation runs per call of the entry, and each computation's lines."""
    lines: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        # A computation starts at column 0 ("%name (params) -> shape {" or "ENTRY %name …{") and
        # ends with a "}" at column 0 (TPU7x: "}, execution_thread=…"); its instructions are indented.
        if current is None and not line.startswith(" ") and line.rstrip().endswith("{") and (
                m := _COMP.match(line)):
            current = m.group(1)
            lines[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and line.startswith("}"):  # "}" or "}, execution_thread=…"
            current = None
        elif current is not None:
            lines[current].append(line)
    times: dict[str, int] = collections.defaultdict(int)

    def visit(comp: str, mult: int, depth: int = 0) -> None:
        times[comp] += mult
        for line in lines.get(comp, ()):
            trips = _trip_count(line, lines) if " while(" in line else 1
            callees = _CALLS.findall(line) + [c.strip().lstrip("%") for b in _BRANCHES.findall(line)
                                              for c in b.split(",")]
            for callee in callees:
                if callee in lines and depth < 50:
                    visit(callee, mult * (trips if f"body={callee}" in line.replace("%", "") else 1), depth + 1)

    if entry is not None:
        visit(entry, 1)
    return times, lines


def volume_per_axis(hlo: str, mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes each device sends per call, by the mesh axes a collective spans ("data", "data+expert", …)."""
    times, lines = _multipliers(hlo)
    total: dict[str, float] = collections.defaultdict(float)
    num_devices = math.prod(mesh_shape.values())
    for comp, body in lines.items():
        for line in body:
            if "=" not in line or not (m := _OP.search(line)) or times.get(comp, 0) == 0:
                continue
            kind = m.group(1)
            result = re.sub(r"\{[^{}]*\}", "", line[line.index("=") + 1:m.start()]).strip()  # no layouts
            if (named := _mesh_groups(line, mesh_shape)) is not None:
                axes, n = named
            else:
                groups = _groups(line, num_devices)
                axes, n = _axes_of(groups[0], mesh_shape), len(groups[0])
            n = 2 if kind == "collective-permute" else n
            if n < 2:
                continue
            total["+".join(axes) or "none"] += times[comp] * _sent(kind, _result_bytes(kind, result), n)
    return dict(total)
