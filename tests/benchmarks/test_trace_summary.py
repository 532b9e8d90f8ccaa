"""benchmarks/trace_summary.py on a synthetic perfetto trace."""

import gzip
import json

import pytest

from benchmarks.trace_summary import load_events, summarise


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
