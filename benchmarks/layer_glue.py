"""The XLA glue of ``bench_layer.py``'s fwd+bwd step, read from the optimized HLO of a device-less H200
compile (no GPU): every fusion / copy / reduction that is neither a GEMM nor a custom call (cuBLAS,
the Pallas kernels), with the bytes it reads and writes (its operands' shapes, looked up by
instruction name, and its output's) and the time that traffic takes at ``--bandwidth`` bytes/s,
largest first.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=$PWD:/path/to/cuda/plugin \\
        JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu \\
        python3 benchmarks/layer_glue.py --kinds kda,mla --tokens 8192 --top 40 --hlo /tmp/layer

Bytes are the operands' and outputs' sizes: an upper bound on the traffic where a fusion reads only
part of an operand (a plain slice fusion is counted at the bytes it writes, twice), so the table
ranks the glue; the profile's device time is the measurement. GEMMs are cuBLAS calls only under
``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`` (the H200 profile's choice: nvjet kernels); the
device-less default keeps them as Triton fusions that absorb their elementwise neighbours.
``--from-hlo`` re-reads HLO files written by ``--hlo``.

``--train small`` lists instead the glue of the trainer's gradient accumulation (``Trainer._grads``:
the ``lax.scan`` over ``--micro`` micro-batches of ``jax.grad`` of ``Trainer.loss``, fp32 parameters
as the trainer holds them, ``segment_ids`` as its batches carry) for ``--batch`` rows of ``--seq``
tokens: the glue of bench_train's step without the optimizer, reported per micro-batch.

    ... python3 benchmarks/layer_glue.py --train small --batch 64 --seq 4096 --micro 8 --hlo /tmp/train
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from k3jax.plan.collectives import shape_bytes

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernels import FREE, _kind, computations  # noqa: E402


def _operands(rest: str) -> str:
    """The operand list of an instruction line (the text up to its matching closing parenthesis)."""
    depth = 1
    for i, c in enumerate(rest):
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return rest[:i]
    return rest


def _read_bytes(body: list) -> dict[int, int]:
    """``{parameter number: bytes}`` for a fusion's parameters that only gathers and dynamic slices
    read (as their first operand): those read what they return, not the whole operand (the head's
    ``take_along_axis`` of one logit a row from ``[4096, 163840]`` fp32 logits)."""
    params = {inst: int(re.match(r"(\d+)", rest).group(1)) for inst, op, rest, _ in body if op == "parameter"}
    users: dict[str, list] = {inst: [] for inst in params}
    for _, op, rest, shape in body:
        for i, o in enumerate(re.findall(r"%([\w.-]+)", _operands(rest))):
            if o in users:
                users[o].append((op, i, shape))
    return {params[inst]: sum(shape_bytes(shape) for _, _, shape in uses) for inst, uses in users.items()
            if uses and all(op in ("gather", "dynamic-slice") and i == 0 for op, i, _ in uses)}


def glue(text: str) -> list[dict]:
    """The non-GEMM, non-custom-call kernels of ENTRY and the loops it runs, with bytes, largest first."""
    comps, entry = computations(text)
    shapes = {inst: shape for body in comps.values() for inst, _, _, shape in body}
    rows = []

    def walk(name: str, weight: int) -> None:
        for inst, op, rest, shape in comps[name]:
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                walk(re.search(r"body=%([\w.-]+)", rest).group(1), weight * (int(trips.group(1)) if trips else 1))
            elif op in ("call", "conditional"):
                # a predicate's conditional: its true branch (the loss's shifted form, the one taken
                # unless a loss passes CLAMP); an indexed one: every branch
                subs = re.findall(r"(?:to_apply|true_computation)=%([\w.-]+)", rest)
                if not subs and (branches := re.search(r"branch_computations=\{([^}]*)\}", rest)):
                    subs = re.findall(r"%([\w.-]+)", branches.group(1))
                for sub in subs:
                    walk(sub, weight)
            elif op in FREE or op.endswith("-done") or op == "async-update":
                continue
            else:
                kind = _kind(op, rest, comps)
                body = comps.get(m.group(1), []) if (m := re.search(r"calls=%([\w.-]+)", rest)) else []
                if kind == "gemm" or kind.startswith("custom-call") or any(o == "custom-call" for _, o, _, _ in body):
                    continue  # GEMMs, kernels, and fusions around them (a cuBLAS call in a dynamic-slice fusion)
                operands = re.findall(r"%([\w.-]+)", _operands(rest))
                read = _read_bytes(body)
                out_b = shape_bytes(shape)
                in_b = sum(read.get(i, shape_bytes(shapes.get(o, ""))) for i, o in enumerate(operands))
                if body and {o for _, o, _, _ in body} <= {"parameter", "slice", "bitcast"}:
                    in_b = out_b  # a slice reads only what it writes
                op_name = re.search(r'op_name="([^"]*)"', rest)
                rows.append({"name": inst, "kind": kind, "count": weight, "out": shape, "bytes": weight * (out_b + in_b),
                             "operands": ", ".join(shapes.get(o, "?") for o in operands), "op_name": op_name.group(1) if op_name else ""})
    walk(entry, 1)
    return sorted(rows, key=lambda r: -r["bytes"])


def compile_layer(kind: str, tokens: int, local_experts: int, top_k: int, param_dtype: str, remat: str) -> str:
    """Optimized HLO of bench_layer's ``value_and_grad`` step for a device-less H200."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from bench_layer import compiler_variants, layer_config, make_case
    from k3jax.plan.topology import get_topology
    from pallas_kernels.target import compile_for

    device = get_topology("h200:1x1").devices[0]
    cfg = layer_config("kimi_k3", local_experts, top_k, param_dtype)
    with compile_for(device):
        loss, inputs, _ = make_case(cfg, kind, tokens, remat, jax.random.key(0), abstract=True)
        inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)),
                              inputs)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        with jax.default_device(device):  # Pallas-Triton kernels (MLA flash) read their target from it
            return step.lower(*inputs).compile(compiler_options=compiler_variants([])["base"]).as_text()


def compile_train(model: str, batch: int, seq: int, micro: int, remat: str, assignments=()) -> str:
    """Optimized HLO of ``Trainer._grads`` (the micro-batch scan of the loss gradient) for a device-less H200."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from k3jax.config import preset
    from k3jax.plan.topology import get_topology
    from k3jax.train.config import DataConfig, TrainConfig, override
    from k3jax.train.step import BATCH_KEYS, Trainer
    from pallas_kernels.target import compile_for

    device = get_topology("h200:1x1").devices[0]
    one = SingleDeviceSharding(device)
    cfg = TrainConfig(model=preset(model), batch_size=batch, seq_len=seq, micro_batches=micro, remat=remat,
                      data=DataConfig(source="random"))
    cfg = override(cfg, list(assignments))
    with compile_for(device):
        trainer = Trainer(cfg)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), trainer.abstract_state())
        rows = {k: jax.ShapeDtypeStruct((batch, seq), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=one)
                for k in BATCH_KEYS}
        with jax.default_device(device):
            grads = jax.jit(trainer._grads, compiler_options=trainer.compiler_options)
            return grads.lower(state, rows).compile().as_text()


def report(rows: list[dict], bandwidth: float, top: int, per: int = 1) -> None:
    """The ``top`` rows; bytes and times divided by ``per`` (micro-batches)."""
    total = sum(r["bytes"] for r in rows) / per
    kernels = sum(r["count"] for r in rows) / per
    print(f"{kernels:.0f} glue kernels in {len(rows)} rows, {total / 1e9:.2f} GB, {total / bandwidth * 1e3:.2f} ms at {bandwidth / 1e12:.1f} TB/s"
          + (f" per micro-batch (of {per})" if per > 1 else ""))
    for r in rows[:top]:
        where = re.sub(r"^.*?(jvp\(|transpose\()", r"\1", r["op_name"])[-90:]
        n = f"{len(r['layers'])}L" if "layers" in r else f"{r['count'] // per}x"
        print(f"{r['bytes'] / per / 1e6:9.1f} MB {r['bytes'] / per / bandwidth * 1e3:6.3f} ms {n:>4s} {r['kind'][7:]:7s} "
              f"{r['out'][:44]:44s} {where}")


def groups(rows: list[dict]) -> list[dict]:
    """Rows with the same source (``op_name`` with layer numbers as ``layers_N``), kind and output
    shape summed, largest first: ``count`` kernels, ``layers`` distinct layers."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (re.sub(r"layers_\d+", "layers_N", r["op_name"]), r["kind"], r["out"])
        g = out.setdefault(key, {**r, "op_name": key[0], "bytes": 0, "count": 0, "layers": set()})
        g["bytes"] += r["bytes"]
        g["count"] += r["count"]
        g["layers"].update(re.findall(r"layers_(\d+)", r["op_name"])[:1])
    return sorted(out.values(), key=lambda g: -g["bytes"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="kda,mla")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--local-experts", type=int, default=56)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--remat", default="none")
    p.add_argument("--bandwidth", type=float, default=3e12, help="bytes/s the glue reaches (H200: ~3 of 4.8 TB/s)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--hlo", default=None, help="write the optimized HLO to PREFIX_<kind>.txt")
    p.add_argument("--from-hlo", default=None, help="read PREFIX_<kind>.txt written before (no compile)")
    p.add_argument("--train", default=None, metavar="PRESET", help="the trainer's micro-batch scan of PRESET instead")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="with --train: a TrainConfig override, as bench_train.py's (e.g. excess_precision=true)")
    p.add_argument("--group", action="store_true", help="sum the kernels of one source over the layers")
    a = p.parse_args(argv)
    if a.train:
        path = f"{a.from_hlo or a.hlo}_train_{a.train}.txt"
        text = Path(path).read_text() if a.from_hlo else compile_train(a.train, a.batch, a.seq, a.micro, a.remat,
                                                                                   a.assignments)
        if a.hlo:
            Path(path).write_text(text)
        print(f"== train {a.train}, {a.batch}x{a.seq} tokens in {a.micro} micro-batches, remat {a.remat}")
        rows = glue(text)
        report(groups(rows) if a.group else rows, a.bandwidth, a.top, per=a.micro)
        return 0
    for kind in a.kinds.split(","):
        if a.from_hlo:
            text = Path(f"{a.from_hlo}_{kind}.txt").read_text()
        else:
            text = compile_layer(kind, a.tokens, a.local_experts, a.top_k, a.param_dtype, a.remat)
            if a.hlo:
                Path(f"{a.hlo}_{kind}.txt").write_text(text)
        print(f"== {kind} layer, T={a.tokens}, {a.local_experts} experts top-{a.top_k}, {a.param_dtype} weights")
        report(glue(text), a.bandwidth, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
