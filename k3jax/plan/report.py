"""What a compiled program costs one device: memory by kind, FLOPs, predicted time, and whether it fits.

Memory is the compiler's ``memory_analysis()``: arguments (parameters, optimizer state, cache and
batch shards), outputs, temporaries (activations, gradients in flight, collective buffers) and
generated code; donated outputs alias their arguments and are counted once. FLOPs are the
compiler's ``cost_analysis()`` where the backend gives one (not on a device-less GPU). Pallas kernels
are opaque custom calls to XLA's cost model, so the model's own FLOP count (``k3jax.train.metrics``:
6 per active parameter per trained token, 2 per inferred token, plus attention and the KDA scan) is
reported beside it and the larger of the two predicts the step time at the chip's peak: a lower
bound, reached at 100 % of peak. Communication is the bytes each device sends per mesh axis
(:mod:`k3jax.plan.collectives`), and its time at the chip's link bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

from k3jax.config import LayerKind, ModelConfig
from k3jax.plan.collectives import volume_per_axis
from k3jax.plan.topology import Chip

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Plan:
    step: str
    topology: str
    mesh: dict
    devices: int
    arguments: float  # bytes per device
    outputs: float
    aliased: float
    temporaries: float
    code: float
    compiler_flops: float | None  # per device
    model_flops: float  # per device
    comm: dict  # mesh axes -> bytes sent per device
    chip: Chip
    compile_seconds: float
    kernels: dict  # custom-call target -> count in the compiled program
    largest: tuple = ()  # --memory-only: (bytes, shapes) of the largest temporaries

    @property
    def peak_memory(self) -> float:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.chip.hbm

    @property
    def compute_seconds(self) -> float:
        return max(self.compiler_flops or 0.0, self.model_flops) / self.chip.peak_flops

    @property
    def hbm_seconds(self) -> float:
        """Reading every argument (weights, cache, optimizer state) once: decode's real bound."""
        return self.arguments / self.chip.hbm_bandwidth

    @property
    def comm_seconds(self) -> float:
        return sum(self.comm.values()) / self.chip.link_bandwidth


def model_flops(cfg: ModelConfig, step: str, batch: int, seq: int) -> float:
    """Model FLOPs of one call of the program, all devices together."""
    from k3jax.train.metrics import flops_per_token

    if step == "train":
        return flops_per_token(cfg, seq) * batch * seq
    if step in ("prefill", "forward"):
        return flops_per_token(cfg, seq) / 3 * batch * seq
    # decode: one token per sequence against `seq` cached tokens: every MLA layer reads them all
    mla = sum(k is LayerKind.MLA for k in cfg.layer_kinds)
    per_token = flops_per_token(cfg, 1) / 3 + mla * 2 * seq * cfg.mla.num_heads * (cfg.mla.kv_lora_rank * 2
                                                                                   + cfg.mla.qk_rope_head_dim)
    return per_token * batch


def _kernels(hlo: str) -> dict[str, int]:
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    return {t: targets.count(t) for t in sorted(set(targets))}


def analyse(compiled, step: str, topology: str, mesh, chip: Chip, flops_total: float, seconds: float) -> Plan:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax returned one dict per program
        cost = cost[0] if cost else None
    hlo = compiled.as_text()
    n = math.prod(mesh.shape.values())
    return Plan(step=step, topology=topology, mesh={k: v for k, v in mesh.shape.items() if v > 1}, devices=n,
                arguments=mem.argument_size_in_bytes, outputs=mem.output_size_in_bytes,
                aliased=mem.alias_size_in_bytes, temporaries=mem.temp_size_in_bytes,
                code=mem.generated_code_size_in_bytes,
                compiler_flops=None if not cost else float(cost.get("flops", 0.0)),
                model_flops=flops_total / n, comm=volume_per_axis(hlo, dict(mesh.shape)), chip=chip,
                compile_seconds=seconds, kernels=_kernels(hlo))


def buffers_plan(lowered, step: str, topology: str, mesh, chip: Chip, flops_total: float) -> Plan:
    """The plan from the compiler's buffer assignment alone (:mod:`k3jax.plan.buffers`): memory and
    communication as compiled, no FLOP count from the compiler; the compile is left running."""
    from k3jax.plan.buffers import assign_buffers

    t0 = time.perf_counter()
    try:
        b = assign_buffers(lowered)
    except Exception as err:
        oom = _out_of_memory(err, step, topology, mesh, chip)
        if oom is None:
            raise
        refused = getattr(err, "buffers", None)
        if refused is not None:
            raise ValueError(f"{oom} Arguments {_gb(refused.arguments).strip()}, temporaries "
                             f"{_gb(refused.temporaries).strip()}; the largest temporaries: "
                             + "; ".join(f"{_gb(n).strip()} {s[:120]}" for n, s in refused.largest[:8])) from err
        raise oom from err
    n = math.prod(mesh.shape.values())
    return Plan(step=step, topology=topology, mesh={k: v for k, v in mesh.shape.items() if v > 1}, devices=n,
                arguments=b.arguments, outputs=0.0, aliased=0.0, temporaries=b.temporaries, code=0.0,
                compiler_flops=None, model_flops=flops_total / n, comm=volume_per_axis(b.hlo, dict(mesh.shape)),
                chip=chip, compile_seconds=time.perf_counter() - t0, kernels=_kernels(b.hlo), largest=b.largest)


def compile_plan(lowered, step: str, topology: str, mesh, chip: Chip, flops_total: float,
                 hlo_path: str | None = None) -> Plan:
    """Compile ``lowered``; the compiler's out-of-memory becomes a ``ValueError`` naming the numbers.
    ``hlo_path``: where to write the compiled HLO text (None: nowhere)."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA raises its own runtime error type
        oom = _out_of_memory(err, step, topology, mesh, chip)
        if oom is None:
            raise
        raise oom from err
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    return analyse(compiled, step, topology, mesh, chip, flops_total, time.perf_counter() - t0)


def _out_of_memory(err: Exception, step: str, topology: str, mesh, chip: Chip) -> ValueError | None:
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text and "exceeds available" not in text.lower():
        return None
    if m := re.search(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\).*space=(\w+).*:: (\S+)", text):
        return ValueError(
            f"the {step} step does not compile for {topology}: the Pallas kernel {m.group(4)} needs "
            f"{int(m.group(1)):,} bytes of {m.group(3).upper()} but the chip has {int(m.group(2)):,} "
            "(a kernel's tiling or operand size limit, not HBM): shrink the kernel's per-device problem "
            "(more devices on the axis that splits it) or fix its tiling")
    need = re.search(r"(?:Used|used)\s+([\d.]+)([KMGT])", text) or re.search(r"\(([\d.]+)([KMGT])\) exceeds", text)
    have = re.search(r"of\s+([\d.]+)([KMGT]) hbm", text) or re.search(r"available HBM \(([\d.]+)([KMGT])\)", text)
    # the compiler's "G" is GiB (its 160.65G equals the 160.65 GiB of its memory-usage report)
    amount = lambda m: f"{float(m.group(1)):.1f} {m.group(2)}iB" if m else "more than the HBM"
    sizes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device"
    detail = text.splitlines()[0][:300]
    return ValueError(
        f"the {step} step does not fit on {topology} ({chip.name}): it needs {amount(need)} per device "
        f"against {amount(have) if have else f'{chip.hbm / _GB:.0f} GB'} of HBM with mesh ({sizes}). "
        f"Split parameters further (a larger fsdp or expert axis), activations further (sequence, data, or "
        f"--remat layer / more --micro), or use more chips. Compiler: {detail}")


def _gb(x: float) -> str:
    return f"{x / _GB:8.2f} GB"


def _flop(x: float) -> str:
    return f"{x / 1e12:,.1f} TFLOP" if x >= 1e12 else f"{x / 1e9:,.2f} GFLOP"


def format_plan(p: Plan) -> str:
    """The human-readable report of one plan."""
    mesh = " × ".join(f"{k}={v}" for k, v in p.mesh.items()) or "1 device"
    flops = "n/a (no cost analysis)" if p.compiler_flops is None else _flop(p.compiler_flops)
    comm = "\n".join(f"    {axis:24s} {v / _GB:10.3f} GB  ({v / p.chip.link_bandwidth * 1e3:8.2f} ms at link peak)"
                     for axis, v in sorted(p.comm.items(), key=lambda kv: -kv[1]) if v >= 1e6) or "    (none)"
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    return "\n".join([
        f"{p.step} on {p.topology}: {p.devices} × {p.chip.name}, mesh {mesh}  (compiled in {p.compile_seconds:.0f} s)",
        "  memory per device (compiler):",
        f"    arguments    {_gb(p.arguments)}", f"    outputs      {_gb(p.outputs)}  ({_gb(p.aliased).strip()} aliased)",
        f"    temporaries  {_gb(p.temporaries)}", f"    code         {_gb(p.code)}",
        f"    peak         {_gb(p.peak_memory)}  of {p.chip.hbm / _GB:.0f} GB HBM: {verdict}",
        f"  FLOPs per device: compiler {flops}, model {_flop(p.model_flops)}",
        f"  predicted time at {p.chip.peak_flops / 1e12:,.0f} TFLOP/s peak: compute {p.compute_seconds * 1e3:,.3g} ms, "
        f"reading the arguments once {p.hbm_seconds * 1e3:,.3g} ms, communication {p.comm_seconds * 1e3:,.3g} ms "
        "at link peak (lower bounds, not overlapped)",
        "  bytes sent per device by mesh axis:", comm,
        "  kernels: " + (", ".join(f"{k}×{v}" for k, v in p.kernels.items()) or "none"),
    ] + (["  largest temporaries (buffer assignment):"] + [f"    {_gb(b)}  {shapes[:140]}" for b, shapes in p.largest]
         if p.largest else []))
