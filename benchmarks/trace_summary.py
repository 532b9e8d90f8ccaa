"""Where the time goes in a ``jax.profiler`` trace: total time per op or kernel name, largest first.

    python benchmarks/trace_summary.py DIR [--top 30] [--process GPU] [--key tf_op --depth 4] [--marginal]
    python benchmarks/trace_summary.py DIR --timeline MARKER[:K]
    python benchmarks/trace_summary.py DIR --idle

Reads the newest ``perfetto_trace.json.gz`` under ``DIR`` (written by
``jax.profiler.trace(DIR, create_perfetto_trace=True)``, e.g. ``bench_train.py --profile DIR``),
keeps complete events (``ph == "X"``) of the processes whose name contains ``--process`` (on a GPU
trace, the device streams; ``""`` keeps all) and prints per name: total ms, share, calls.

``--marginal`` ranks by what each kernel adds to the timeline instead of by its duration: events sorted by
their end, each is charged from the latest end before it to its own (its wait for its inputs, its launch gap and
its work past its predecessor's end). A decode step's kernels are launched early (programmatic dependent
launch), so a kernel's own duration counts its wait for the kernel before it; its marginal time does not, and
the marginal times of a run add up to its span.

``--timeline MARKER[:K]`` prints one window of the run event by event instead (start, duration and end in µs from
the window's start, the thread, the name): from the end of the K-th event named MARKER (default 1) to the end of the
next, e.g. one decode step between two runs of the head's kernel. Side by side with ``--marginal`` it shows a
step's critical path: which kernel each one waited for, and which ran beside it.

``--idle`` prints how long nothing of the matching processes runs, against the run's span, and where: each idle
stretch under the event that ended last before it and the one that ends it, largest total first (stop 67 found a
decode step's GPU idle 4.4 % of the time this way).

``--hlo DUMP`` names where each XLA fusion comes from: it reads the optimised HLO that
``XLA_FLAGS=--xla_dump_to=DUMP`` wrote (``*after_optimizations.txt``) and prints, under each
kernel named like a fusion instruction, its shape and the ``op_name`` / source line of its metadata.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re


def load_events(directory: str) -> tuple[list[dict], dict[int, str]]:
    """Complete events and ``pid -> process name`` of the newest perfetto trace under ``directory``."""
    traces = sorted(pathlib.Path(directory).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise ValueError(f"directory={directory!r} holds no perfetto_trace.json.gz")
    with gzip.open(traces[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "dur" in e], names


def event_key(event: dict, key: str = "name", depth: int | None = None) -> str:
    """What an event is grouped under: its name, or an ``args`` field such as ``tf_op`` (the JAX
    name stack of the HLO op; on a GPU only outside CUDA command buffers), cut to its first ``depth``
    ``/``-separated parts. Events without the field keep their name."""
    value = event["name"] if key == "name" else (event.get("args") or {}).get(key) or event["name"]
    return value if depth is None else "/".join(value.split("/")[:depth])


def _matching(events: list[dict], names: dict[int, str], process: str) -> list[dict]:
    """The events of the processes whose name contains ``process`` (case-insensitive)."""
    return [e for e in events if process.lower() in names.get(e["pid"], "").lower()]


def _ranked(charges, key: str, depth: int | None) -> list[tuple[str, float, int]]:
    """``(group, ms, calls)`` over ``(event, µs)`` charges, largest total first."""
    total, calls = collections.Counter(), collections.Counter()
    for e, us in charges:
        group = event_key(e, key, depth)
        total[group] += us / 1e3
        calls[group] += 1
    return [(name, ms, calls[name]) for name, ms in total.most_common()]


def summarise(events: list[dict], names: dict[int, str], process: str, key: str = "name",
              depth: int | None = None) -> list[tuple[str, float, int]]:
    """``(group, total ms, calls)`` over events of matching processes, largest total first."""
    return _ranked(((e, e["dur"]) for e in _matching(events, names, process)), key, depth)


def marginal(events: list[dict], names: dict[int, str], process: str, key: str = "name",
             depth: int | None = None) -> list[tuple[str, float, int]]:
    """``(group, ms, calls)`` like :func:`summarise`, each event charged its end minus the latest end of the
    events that end before it (the first event: its duration), largest first."""
    charges, last = [], None
    for e in sorted(_matching(events, names, process), key=lambda e: e["ts"] + e["dur"]):
        end = e["ts"] + e["dur"]
        charges.append((e, end - (e["ts"] if last is None else last)))
        last = end
    return _ranked(charges, key, depth)


def timeline(events: list[dict], names: dict[int, str], process: str, marker: str,
             k: int = 1) -> list[tuple[float, float, float, int, str]]:
    """``(start, duration, end, thread, name)`` in µs from the end of the ``k``-th event named ``marker`` (counted
    from 1, by start) of the matching processes, for the events that end after it, up to the end of the next
    ``marker`` event, by start. ``ValueError`` names ``marker`` and ``k`` when there is no such window."""
    kept = sorted(_matching(events, names, process), key=lambda e: e["ts"])
    ends = [e["ts"] + e["dur"] for e in kept if e["name"] == marker]
    if not 1 <= k < len(ends):
        raise ValueError(f"--timeline needs events named marker={marker!r} at k={k} and after it: found {len(ends)}")
    t0, t1 = ends[k - 1], ends[k]
    return [(e["ts"] - t0, e["dur"], e["ts"] + e["dur"] - t0, e["tid"], e["name"]) for e in kept
            if t0 < e["ts"] + e["dur"] <= t1]


def idle_gaps(events: list[dict], names: dict[int, str], process: str) -> tuple[float, float, list]:
    """``(idle µs, span µs, [(before, after, µs, gaps), ...])``: the stretches where no event of the matching
    processes runs, grouped by the event that ended last before each (``before``) and the one that starts it
    (``after``), largest total first."""
    kept = sorted(_matching(events, names, process), key=lambda e: e["ts"])
    total, count, busy_end, last = collections.Counter(), collections.Counter(), None, None
    for e in kept:
        if busy_end is not None and e["ts"] > busy_end:
            gap = (last["name"], e["name"])
            total[gap] += e["ts"] - busy_end
            count[gap] += 1
        if busy_end is None or e["ts"] + e["dur"] > busy_end:
            busy_end, last = e["ts"] + e["dur"], e
    span = busy_end - kept[0]["ts"] if kept else 0.0
    return float(sum(total.values())), span, [(a, b, us, count[(a, b)]) for (a, b), us in total.most_common()]


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)?) [\w\-]+\(.*?metadata=\{([^}]*)\}")


def hlo_origins(dump_dir: str) -> dict[str, str]:
    """``instruction name -> "shape  op_name  file:line"`` over the optimised HLO modules in a dump."""
    origins = {}
    for path in pathlib.Path(dump_dir).glob("*after_optimizations.txt"):
        for line in path.read_text(errors="replace").splitlines():
            m = _INSTR.match(line)
            if m is None:
                continue
            name, shape, meta = m.groups()
            op = re.search(r'op_name="([^"]*)"', meta)
            src = re.search(r'source_file="([^"]*)" source_line=(\d+)', meta)
            where = f"{src.group(1).split('/')[-1]}:{src.group(2)}" if src else ""
            # kernels are named after their fusion instruction with '.' -> '_' (gemm_fusion_dot.1001)
            origins.setdefault(name.replace(".", "_"), f"{shape.split('{')[0]}  {op.group(1) if op else ''}  {where}")
    return origins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--process", default="GPU", help="substring of the process names to keep ('' = all)")
    ap.add_argument("--key", default="name", help="group by the event name or an args field, e.g. tf_op")
    ap.add_argument("--depth", type=int, default=None, help="keep the first DEPTH '/'-parts of the key")
    ap.add_argument("--marginal", action="store_true", help="charge each event from the previous end to its own")
    ap.add_argument("--timeline", default=None, metavar="MARKER[:K]",
                    help="print the events from the K-th MARKER event's end to the next one's, one a line")
    ap.add_argument("--hlo", default=None, metavar="DUMP", help="an XLA dump directory: print each fusion's origin")
    ap.add_argument("--idle", action="store_true", help="the stretches where nothing runs, by the events around them")
    a = ap.parse_args()
    origins = hlo_origins(a.hlo) if a.hlo else {}
    events, names = load_events(a.directory)
    if a.timeline:
        marker, sep, k = a.timeline.rpartition(":")
        if not (sep and k.isdigit()):  # no K given (a kernel name may hold a colon)
            marker, k = a.timeline, "1"
        try:
            rows = timeline(events, names, a.process, marker, int(k))
        except ValueError as err:
            raise SystemExit(str(err)) from None
        print(f"{rows[-1][2] if rows else 0.0:.2f} us from the end of {marker!r} #{k} to the next")
        for start, dur, end, tid, name in rows:
            print(f"{start:9.2f} {dur:8.2f} {end:9.2f}  {tid!s:>8}  {name[:90]}")
        return
    if a.idle:
        idle, span, gaps = idle_gaps(events, names, a.process)
        print(f"{idle:.1f} us idle of a {span:.1f} us span ({100 * idle / max(span, 1e-9):.1f} %)")
        for before, after, us, n in gaps[: a.top]:
            print(f"{us:10.1f} us {n:6d}x  avg {us / n:7.2f}  {before[:50]} -> {after[:50]}")
        return
    rows = (marginal if a.marginal else summarise)(events, names, a.process, a.key, a.depth)
    if not rows:
        raise SystemExit(f"no events in processes matching --process={a.process!r}; processes: "
                         f"{sorted(set(names.values()))}")
    grand = sum(ms for _, ms, _ in rows)
    print(f"{grand:.1f} ms in {len(rows)} names (processes matching {a.process!r})")
    for name, ms, n in rows[: a.top]:
        print(f"{ms:10.2f} ms {100 * ms / grand:5.1f} % {n:6d}x  {name[:110]}")
        if name in origins:
            print(f"{'':28}{origins[name][:200]}")


if __name__ == "__main__":
    main()
