"""GPU kernels per decode step, counted in the optimized HLO of a device-less H200 compile (no GPU).

Compiles what ``bench_infer.py`` times — ``--steps`` greedy steps of ``decode_step`` in one loop
shaped as ``generate``'s on ``decode_layout``'s weights (per layer, KDA inputs packed, output
projections output axis first), random-init bf16 ``small()`` after a ``--prompt``-token cache — for
``h200:1x1`` (``k3jax.plan.topology``: needs the jax CUDA plugin, no driver), then counts the kernels
one step launches: every instruction of ENTRY and of the loop bodies / conditions it reaches, weighted
by the loops' trip counts (XLA's known ones; the greedy loop's, which XLA cannot know since its end
depends on the tokens, as ``--steps``), that is not free (parameters, tuples, get-tuple-element,
bitcasts, constants, control flow and ``*-done`` halves are not counted; fusions, custom calls, copies
and ``*-start`` halves are), and the bytes their outputs take (written, and read back by their
consumers). Printed by layer kind and module (from each kernel's ``op_name``) and by kernel kind;
``--list PATTERN`` prints the kernels whose ``op_name`` matches, ``--hlo FILE`` keeps the optimized
HLO text.

The device-less compile runs no autotuning (GEMMs stay Triton fusions), so counts compare
between trees compiled this way, not with a profile's kernel names one for one.

    PYTHONPATH=$PWD:/path/to/cuda/plugin JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python3 benchmarks/decode_kernels.py --batch 1 --list 'layers_1/'
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re
import sys
from pathlib import Path

from k3jax.plan.collectives import shape_bytes

FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "while", "conditional", "call",
        "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
HEADER = re.compile(r"^(ENTRY )?%(\S+) ")


@dataclasses.dataclass(frozen=True)
class Kernel:
    count: float  # launches per run of the program
    kind: str  # "fusion:kLoop", "fusion:kInput" (reductions), "fusion:kCustom" (Triton), "gemm", "copy", ...
    op_name: str
    shape: str


def computations(text: str) -> tuple[dict[str, list], str]:
    """``{name: [(name, opcode, rest of line, shape)]}`` and the ENTRY computation's name."""
    comps: dict[str, list] = {}
    current, entry = None, None
    for line in text.splitlines():
        if current is None:
            m = HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif m := INSTRUCTION.match(line):
            comps[current].append((m.group(1), m.group(3), m.group(4), m.group(2)))
    return comps, entry


def _kind(op: str, rest: str, comps: dict) -> str:
    if op == "custom-call":
        return "custom-call:" + re.search(r'custom_call_target="([^"]*)"', rest).group(1)
    if op != "fusion":
        return op
    backend = re.search(r'"fusion_backend_config":\{"kind":"(\w+)"', rest)
    body = comps.get(re.search(r"calls=%([\w.-]+)", rest).group(1), [])
    if any(o in ("dot", "scaled-dot") for _, o, _, _ in body) or (backend and "gemm" in backend.group(1)):
        return "gemm"
    if backend and backend.group(1) == "__triton":
        return "fusion:triton"  # XLA's Triton emitter for a non-GEMM fusion (kCustom)
    return "fusion:" + re.search(r"kind=(k\w+)", rest).group(1)


def _trips(rest: str, unknown: int) -> int:
    """A while instruction's trip count: XLA's ``known_trip_count``, else ``unknown``."""
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    return int(trips.group(1)) if trips else unknown


def kernels(comps: dict, name: str, weight: float = 1, unknown_trips: int = 1) -> list[Kernel]:
    """The kernels of computation ``name`` and of the loops / branches it runs, ``weight`` times each; a loop
    of ``name`` itself whose trip count XLA does not know runs ``unknown_trips`` times (inner ones once)."""
    out = []
    for _, op, rest, shape in comps[name]:
        if op == "while":
            trips = _trips(rest, unknown_trips)
            out += kernels(comps, re.search(r"body=%([\w.-]+)", rest).group(1), weight * trips)
            out += kernels(comps, re.search(r"condition=%([\w.-]+)", rest).group(1), weight * (trips + 1))
        elif op == "conditional":  # every branch counted: an upper bound
            for branch in re.findall(r"%([\w.-]+)", re.search(r"branch_computations=\{([^}]*)\}", rest).group(1)):
                out += kernels(comps, branch, weight)
        elif op == "call":
            out += kernels(comps, re.search(r"to_apply=%([\w.-]+)", rest).group(1), weight)
        elif op not in FREE and not op.endswith("-done") and op != "async-update":
            op_name = re.search(r'op_name="([^"]*)"', rest)
            out.append(Kernel(weight, _kind(op, rest, comps), op_name.group(1) if op_name else "", shape))
    return out


def _operands(rest: str) -> list[str]:
    """The names an instruction reads: the ``%names`` of its operand list (before the closing paren)."""
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch in "({"
        depth -= ch in ")}"
        if depth < 0:
            return re.findall(r"%([\w.-]+)", rest[:i])
    return re.findall(r"%([\w.-]+)", rest)


def chain(comps: dict, name: str, path: bool = False, unknown_trips: int = 1):
    """Kernels on computation ``name``'s longest chain of data dependencies: what a GPU that ran every
    independent kernel at once (CONCURRENT command buffers) would still run one after another. Loops
    count their trip count times their body's chain (``unknown_trips`` for a loop of ``name`` whose count
    XLA does not know), branches their longest. ``path``: the chain's instructions instead, ``(opcode,
    shape, op_name)`` in order (a loop or branch listed once)."""
    depth: dict[str, int] = {}
    prev: dict[str, tuple] = {}
    for iname, op, rest, shape in comps[name]:
        before = max(_operands(rest), key=lambda o: depth.get(o, 0), default=None)
        if op == "while":
            cost = _trips(rest, unknown_trips) * chain(comps, re.search(r"body=%([\w.-]+)", rest).group(1))
        elif op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest).group(1)
            cost = max(chain(comps, b) for b in re.findall(r"%([\w.-]+)", branches))
        elif op == "call":
            cost = chain(comps, re.search(r"to_apply=%([\w.-]+)", rest).group(1))
        else:
            cost = int(op not in FREE and not op.endswith("-done") and op != "async-update")
        depth[iname] = depth.get(before, 0) + cost
        op_name = re.search(r'op_name="([^"]*)"', rest)
        prev[iname] = (before, cost, (op, shape, op_name.group(1) if op_name else ""))
    if not path:
        return max(depth.values(), default=0)
    out, at = [], max(depth, key=depth.get, default=None)
    while at in prev:
        before, cost, row = prev[at]
        out += [row] if cost else []
        at = before
    return out[::-1]


def step_body(comps: dict) -> str:
    """The decode step's computation: the largest loop body (the greedy loop's)."""
    bodies = [re.search(r"body=%([\w.-]+)", rest).group(1) for c in comps.values() for _, op, rest, _ in c
              if op == "while"]
    return max(bodies, key=lambda b: len(comps[b]))


def module_of(op_name: str, layer_kinds: dict[int, str]) -> str:
    """``"kda:moe"``-style group of a kernel: the layer's mixer kind and the module under the layer."""
    if m := re.search(r"/layers_(\d+)/(\w+)", op_name):
        return f"{layer_kinds.get(int(m.group(1)), '?')}:{m.group(2)}"
    for part in ("out_res", "final_norm", "logits", "embed", "/cond/"):
        if part in op_name:
            return "top:" + part.strip("/")
    return "top:other (no op_name: layout copies of loop state, hoisted or unnamed fusions)"


def report(text: str, steps: int, pattern: str | None = None, show_chain: bool = False) -> dict:
    comps, entry = computations(text)
    ks = kernels(comps, entry, unknown_trips=steps)  # the greedy loop, generate's shape, runs ``steps`` times
    layer_kinds = {int(m.group(1)): m.group(2) for m in re.finditer(r"layers_(\d+)____(kda|mla)____", text)}
    by_module, by_kind, by_layer = collections.Counter(), collections.Counter(), collections.Counter()
    for k in ks:
        by_module[module_of(k.op_name, layer_kinds)] += k.count / steps
        by_kind[k.kind] += k.count / steps
        layer = re.search(r"/layers_(\d+)/", k.op_name)
        by_layer[f"{int(layer.group(1)):2d} {layer_kinds.get(int(layer.group(1)))}" if layer else "top"] += k.count / steps
    total = sum(k.count for k in ks) / steps
    written = sum(k.count * shape_bytes(k.shape) for k in ks) / steps
    print(f"kernels per step: {total:.1f}")
    longest = chain(comps, entry, unknown_trips=steps) / steps
    print(f"kernels on the step's longest dependency chain: {longest:.1f}")
    print(f"bytes written per step: {written / 1e6:.1f} MB (all kernels' outputs; "
          f"{sum(k.count * shape_bytes(k.shape) for k in ks if shape_bytes(k.shape) >= 5e5) / steps / 1e6:.1f} MB "
          "by kernels writing >= 0.5 MB)")
    for title, counter in (("by layer", by_layer), ("by layer kind : module", by_module), ("by kernel kind", by_kind)):
        print(f"{title}:")
        for key, n in sorted(counter.items()):
            print(f"  {key:40s} {n:7.2f}")
    if pattern:
        for k in ks:
            if re.search(pattern, k.op_name):
                print(f"{k.count / steps:6.2f} {k.kind:16s} {k.shape[:48]:48s} {k.op_name.split('decode_step)/')[-1]}")
    if show_chain:
        rows = chain(comps, step_body(comps), path=True)
        print(f"the step's longest chain ({len(rows)} kernels):")
        for op, shape, op_name in rows:
            print(f"  {op:12s} {shape[:40]:40s} {op_name.split('decode_step)/')[-1]}")
    return {"total": total, "chain": longest, "by_module": dict(by_module),
            "by_kind": dict(by_kind)}


def compile_decode(batch: int, prompt: int, steps: int, moe_decode: str | None = None, overrides=()) -> str:
    """Optimized HLO text of ``bench_infer``'s decode loop for a device-less H200; ``overrides``:
    ``ModelConfig`` assignments (``attn_res.decode_implementation=pallas``)."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from jax.sharding import SingleDeviceSharding

    from k3jax import config
    from k3jax.infer.cache import init_cache
    from k3jax.infer.decode import decode_layout
    from k3jax.layout import unrolled
    from k3jax.model import Transformer
    from k3jax.plan.topology import get_topology
    from k3jax.train.config import override
    from pallas_kernels.target import compile_for

    from benchmarks.decode_loop import greedy_loop

    device = get_topology("h200:1x1").devices[0]
    place = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)), tree)
    # decode_layout's result (bf16 as bench_infer builds it), abstract
    cfg = unrolled(dataclasses.replace(config.small(), param_dtype=jnp.bfloat16))
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, decode_implementation=moe_decode))
    cfg = override(cfg, list(overrides)) if overrides else cfg
    with compile_for(device):
        init = lambda: decode_layout(nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))),
                                     cfg)[0]
        variables = place(jax.eval_shape(init))
        cache = place(jax.eval_shape(lambda: init_cache(cfg, batch, prompt + steps + 1)))
        tok = place(jax.ShapeDtypeStruct((batch, 1), jnp.int32))
        loop = jax.jit(functools.partial(greedy_loop, cfg=cfg, steps=steps))
        with jax.default_device(device):  # Pallas-Triton kernels (KDA decode) read their target from it
            return loop.lower(variables, tok, cache).compile().as_text()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--list", default=None, help="print the kernels whose op_name matches this regex")
    p.add_argument("--hlo", default=None, help="write the optimized HLO here")
    p.add_argument("--moe-decode", default=None, choices=("xla", "pallas"),
                   help="MoEConfig.decode_implementation (the gather path at batch 1); default: the config's")
    p.add_argument("--chain", action="store_true", help="print the kernels on the step's longest dependency chain")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a ModelConfig override (repeatable), as bench_infer.py's --variant takes them")
    p.add_argument("--from-hlo", default=None, help="count an HLO file written before (no compile)")
    args = p.parse_args(argv)
    text = (Path(args.from_hlo).read_text() if args.from_hlo
            else compile_decode(args.batch, args.prompt, args.steps, args.moe_decode, args.overrides))
    if args.hlo:
        Path(args.hlo).write_text(text)
    report(text, args.steps, args.list, args.chain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
