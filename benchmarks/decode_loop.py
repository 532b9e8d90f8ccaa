"""The greedy decode loop ``bench_infer.py`` times and ``decode_kernels.py`` counts, and its variants.

``greedy_loop`` runs ``steps`` greedy steps of ``decode_step`` in one loop shaped as ``generate``'s;
``decode_variants`` reads ``--variant NAME:KEY=VALUE,…`` specs into ``Variant`` s (config, XLA options, head,
module constants); ``compile_loop`` compiles one (``traced=True``: in the form a profiler can see into,
``without_loop_graphs``); ``step_and_call_ms`` splits each variant's loop call time into a step's and the call's own.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from benchmarks.bench_layer import parse_variant
from benchmarks.timing import timeit_interleaved
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import DECODE_XLA_OPTIONS, decode_step, prefill_jit
from k3jax.train.config import override, xla_compiler_options


def greedy_loop(variables, tok, cache, steps, *, cfg, head="greedy"):
    """``steps`` greedy decode steps in one ``while_loop`` shaped as ``generate``'s: it would also end once
    every row had emitted a stop token (-1 here, never), so its end depends on the tokens. Returns the
    last tokens. ``steps`` is a Python int (bound by keyword: a constant of the program) or an int32 scalar
    argument (one program for any number of steps, which ``bench_infer.py --long-steps`` times at two).
    ``head="greedy"`` takes each token from ``decode_step(greedy=True)`` as ``generate`` does at temperature 0
    (the greedy head: no logits stored); ``"logits"``, the argmax of the step's logits. (With
    WHILE / CONDITIONAL command buffers a ``fori_loop`` of known length ran level with this form at batch 1
    and 1.2 % slower at batch 64 on an H100; benchmarks/RESULTS.md, stop 67.)"""
    def cond(carry):
        i, _, alive, _ = carry
        return (i < steps) & jnp.any(alive)

    def body(carry):
        i, tok, alive, cache = carry
        if head == "greedy":
            tok, cache = decode_step(variables, cfg, tok, cache, greedy=True)
        else:
            logits, cache = decode_step(variables, cfg, tok, cache)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return i + 1, tok, alive & (tok[:, 0] != -1), cache

    alive = jnp.ones(tok.shape[:1], bool)
    return jax.lax.while_loop(cond, body, (jnp.int32(0), tok, alive, cache))[1]


class Variant(NamedTuple):
    """One build of the decode loop: its ``ModelConfig``, its XLA options, where its tokens come from (``"greedy"``:
    the greedy head, ``"logits"``: the logits' argmax) and the module constants set while it compiles
    (``((module, name, value), …)``: a kernel's tiling, a threshold)."""

    cfg: Any
    options: dict
    head: str = "greedy"
    constants: tuple = ()


def _constant(assignment: str, spec: str) -> tuple:
    """``@package.module.NAME=VALUE`` -> ``(module, NAME, VALUE)``, VALUE a Python literal; ``ValueError`` naming
    the module, the name or the value that is not there."""
    target, _, text = assignment[1:].partition("=")
    path, _, name = target.rpartition(".")
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"--variant={spec!r}: no module {path!r} to set {name!r} in") from e
    if not hasattr(module, name):
        raise ValueError(f"--variant={spec!r}: module {path} has no {name!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--variant={spec!r}: {text!r} is not a Python literal (@{target}=VALUE)") from e
    return module, name, value


def decode_variants(cfg, specs: list[str]) -> dict[str, Variant]:
    """``{"base": Variant(cfg, DECODE_XLA_OPTIONS), NAME: Variant(…), …}`` for each ``--variant NAME:KEY=VALUE,…``:
    a KEY ``xla_…`` is an XLA option of the decode loop's compile (over ``DECODE_XLA_OPTIONS``, which ``generate``
    and the serving engine compile with; ``serial:xla_gpu_command_buffer_scheduling_mode=SERIALIZE`` undoes it),
    ``head=logits`` takes each token from the logits (``greedy_loop``), ``@package.module.NAME`` a module constant
    set while the variant compiles (``@pallas_kernels.mla_attention.kernel_gpu_decode.NUM_STAGES=2``), any other a
    ``ModelConfig`` override (``moe.decode_implementation=xla``). ``ValueError`` names a malformed spec."""
    variants = {"base": Variant(cfg, dict(DECODE_XLA_OPTIONS))}
    for spec in specs:
        name, assignments = parse_variant(spec, variants)
        heads = [a.partition("=")[2] for a in assignments if a.startswith("head=")]
        if any(h not in ("greedy", "logits") for h in heads):
            raise ValueError(f"--variant={spec!r}: head must be 'greedy' or 'logits', got {heads}")
        xla = [a for a in assignments if a.startswith("xla_")]
        constants = tuple(_constant(a, spec) for a in assignments if a.startswith("@"))
        model = [a for a in assignments if not a.startswith(("xla_", "head=", "@"))]
        options = xla_compiler_options(False, xla)
        if not any(a.startswith("xla_allow_excess_precision=") for a in xla):
            del options["xla_allow_excess_precision"]  # the decode loop keeps XLA's default unless asked
        variants[name] = Variant(override(cfg, model) if model else cfg, {**DECODE_XLA_OPTIONS, **options},
                                 heads[-1] if heads else "greedy", constants)
    return variants


@contextlib.contextmanager
def _constants_set(constants: tuple):
    """The module constants set, then restored; JAX's trace caches cleared on the way in and out: ``decode_step``'s
    jit and the kernels' own keep a trace per argument list, so a constant they read would otherwise be the first
    compile's in every later one (stop 69's scratch A/Bs measured one program four times so)."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in constants]
    jax.clear_caches()
    try:
        for module, name, value in constants:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        jax.clear_caches()


def without_loop_graphs(options: dict) -> dict:
    """``options`` less the ``WHILE`` / ``CONDITIONAL`` command buffers: in one CUDA graph with conditional
    nodes the profiler records the whole loop as one event (stop 68: a 38.6 ms ``loop_broadcast_fusion``),
    so ``--profile`` traces the loop compiled so, its steps graphs of their own."""
    kinds = options.get("xla_gpu_enable_command_buffer", "").split(",")
    kinds = [k for k in kinds if k not in ("WHILE", "CONDITIONAL")]
    return {**options, "xla_gpu_enable_command_buffer": ",".join(kinds)}


def compile_loop(variant: Variant, steps: int | None, args: tuple, traced: bool = False):
    """``greedy_loop`` of ``steps`` steps for a ``decode_variants`` entry, compiled for ``args``
    (``(variables, tokens [B, 1], cache)``, and the int32 step count when ``steps`` is None) with the variant's
    XLA options (``traced``: less the loop graphs) and, while it compiles, its module constants."""
    fixed = {} if steps is None else {"steps": steps}
    loop = jax.jit(functools.partial(greedy_loop, cfg=variant.cfg, head=variant.head, **fixed))
    options = without_loop_graphs(variant.options) if traced else variant.options
    with _constants_set(variant.constants) if variant.constants else contextlib.nullcontext():
        return loop.lower(*args).compile(compiler_options=options)


def loop_args(cfg, variables, tokens, steps: int) -> tuple:
    """``(variables, last tokens [B, 1], cache)`` for a loop of up to ``steps`` steps after the prompts ``tokens
    [B, P]``: the cache has room for ``P + steps + 1`` tokens and holds the prefilled prompts."""
    B, P = tokens.shape
    _, cache = prefill_jit(variables, cfg, tokens, jnp.full((B,), P, jnp.int32), init_cache(cfg, B, P + steps + 1))
    return variables, tokens[:, -1:], cache


def split_call_time(ms: dict, steps: int, long_steps: int) -> tuple[float, float]:
    """``(ms a step, ms a call)`` from one loop program's time at ``steps`` and ``long_steps`` (``ms[steps]``,
    ``ms[long_steps]``): the slope and the intercept of a call's time against its step count."""
    if long_steps <= steps:
        raise ValueError(f"long_steps={long_steps} must exceed steps={steps}: the split needs two lengths")
    step = (ms[long_steps] - ms[steps]) / (long_steps - steps)
    return step, ms[steps] - steps * step


def step_and_call_ms(variants: dict, variables, tokens, steps, long_steps) -> dict[str, tuple[float, float]]:
    """``{name: split_call_time(…)}`` for each of ``variants`` (``decode_variants``' entries): its loop compiled once
    with the step count an argument, on a cache with room for ``long_steps``, every variant at ``steps`` and at
    ``long_steps`` timed round-robin. The intercept is what every call of ``generate`` pays once besides its steps,
    host time before the GPU starts: jax's dispatch of the ~330 arrays, the loop graph's ``cuGraphLaunch`` (~1.2 ms
    on an H100), the last sync (stop 74, H100: 2.5 ms a call at batch 1, 4.7 ms while the model's id check still
    made the program effectful and jax dispatched it in Python); a variant of other XLA options shows what they
    change of either."""
    args = loop_args(variants["base"].cfg, variables, tokens, long_steps)
    loops = {name: compile_loop(v, None, args + (jnp.int32(steps),)) for name, v in variants.items()}
    ms = timeit_interleaved({(name, n): (loop, args + (jnp.int32(n),)) for name, loop in loops.items()
                             for n in (steps, long_steps)}, reps=10, warmup=1, min_ms=50.0)
    return {name: split_call_time({n: ms[name, n] for n in (steps, long_steps)}, steps, long_steps)
            for name in loops}


__all__ = ["Variant", "compile_loop", "decode_variants", "greedy_loop", "loop_args", "split_call_time",
           "step_and_call_ms", "without_loop_graphs"]
