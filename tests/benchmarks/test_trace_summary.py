"""benchmarks/trace_summary.py on a synthetic perfetto trace."""

import gzip
import json

import pytest

from benchmarks.trace_summary import event_key, idle_gaps, load_events, marginal, summarise, timeline


def test_totals_per_name_for_matching_processes(tmp_path):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "name": "gemm", "pid": 1, "dur": 3000},
        {"ph": "X", "name": "gemm", "pid": 1, "dur": 1000},
        {"ph": "X", "name": "kda_scan", "pid": 1, "dur": 5000},
        {"ph": "X", "name": "python", "pid": 2, "dur": 9000},
        {"ph": "i", "name": "marker", "pid": 1},
    ]
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = summarise(*load_events(str(tmp_path)), "gpu")
    assert rows == [("kda_scan", 5.0, 1), ("gemm", 4.0, 2)]
    assert [r[0] for r in summarise(*load_events(str(tmp_path)), "")] == ["python", "kda_scan", "gemm"]


def test_missing_trace_names_the_directory(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        load_events(str(tmp_path))


def test_group_by_an_args_field_cut_to_a_depth():
    ev = lambda tf_op, dur: {"ph": "X", "name": "fusion", "pid": 1, "dur": dur, "args": {"tf_op": tf_op}}
    events = [ev("jit(step)/layers_1/kda/dot", 2000), ev("jit(step)/layers_1/kda/exp", 1000),
              ev("jit(step)/layers_2/moe/gmm", 4000), {"ph": "X", "name": "memcpy", "pid": 1, "dur": 500}]
    names = {1: "/device:GPU:0"}
    rows = summarise(events, names, "GPU", key="tf_op", depth=3)
    assert rows == [("jit(step)/layers_2/moe", 4.0, 1), ("jit(step)/layers_1/kda", 3.0, 2), ("memcpy", 0.5, 1)]
    assert event_key(events[0]) == "fusion"


def test_marginal_time_charges_each_event_past_the_previous_end():
    ev = lambda name, ts, dur: {"ph": "X", "name": name, "pid": 1, "ts": ts, "dur": dur}
    # b launched early (waits on a), c after a gap, d overlaps c and ends first; e on the host
    events = [ev("a", 0, 4000), ev("b", 1000, 5000), ev("c", 8000, 2000), ev("d", 8500, 1000),
              {"ph": "X", "name": "e", "pid": 2, "ts": 0, "dur": 99000}]
    names = {1: "/device:GPU:0", 2: "/host:CPU"}
    rows = marginal(events, names, "GPU")
    assert dict((n, ms) for n, ms, _ in rows) == {"a": 4.0, "b": 2.0, "d": 3.5, "c": 0.5}
    assert sum(ms for _, ms, _ in rows) == 10.0  # the span, first start to last end


def test_timeline_lists_one_window_between_two_markers():
    ev = lambda name, ts, dur, tid=7: {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    events = [ev("head", 0, 10), ev("a", 12, 3), ev("b", 13, 6, tid=8), ev("head", 20, 10), ev("c", 31, 1),
              ev("head", 40, 10)]
    names = {1: "/device:GPU:0"}
    assert timeline(events, names, "GPU", "head") == [(2, 3, 5, 7, "a"), (3, 6, 9, 8, "b"), (10, 10, 20, 7, "head")]
    assert [r[4] for r in timeline(events, names, "GPU", "head", k=2)] == ["c", "head"]
    with pytest.raises(ValueError, match="marker='head' at k=3"):
        timeline(events, names, "GPU", "head", k=3)


def test_idle_gaps_by_the_events_around_them():
    ev = lambda name, ts, dur, pid=1: {"ph": "X", "name": name, "pid": pid, "ts": ts, "dur": dur}
    # a and b overlap (no gap), c after 5 us, c again after 2 us; d after 3; the host event never counts
    events = [ev("a", 0, 10), ev("b", 4, 8), ev("c", 17, 1), ev("c", 20, 1), ev("d", 24, 6),
              ev("c", 35, 1), ev("h", 0, 100, pid=2)]
    names = {1: "/device:GPU:0", 2: "/host:CPU"}
    idle, span, gaps = idle_gaps(events, names, "GPU")
    assert (idle, span) == (15.0, 36.0)
    assert gaps == [("b", "c", 5.0, 1), ("d", "c", 5.0, 1), ("c", "d", 3.0, 1), ("c", "c", 2.0, 1)]
    assert idle_gaps(events, names, "TPU") == (0.0, 0.0, [])
