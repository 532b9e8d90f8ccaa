"""experiments/balance_qb_vs_sign.py: an infinite max/min is reported as such (null, "∞"), not as
1e9; the default output is a run folder, not the committed results; every option has help."""

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("balance_qb_vs_sign", ROOT / "experiments" / "balance_qb_vs_sign.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_infinite_ratio_is_null_not_a_stand_in_number():
    m = _module()
    ratio = np.array([5.0, 2.0, 1.05, np.inf, np.inf])
    row = m.summarise(ratio)
    assert row["tail_mean_max_min"] is None and row["tail_zero_expert_steps"] == 1
    assert m.summarise(np.array([5.0, 1.0, 1.0, 1.0, 1.02]))["tail_mean_max_min"] == 1.02
    assert m._ratio_text(None).startswith("∞")


def test_default_output_is_a_run_folder_and_every_option_has_help():
    m = _module()
    args = m.parse_args([])
    assert args.out.parts[0] == "runs" and "results" not in args.out.parts
    helpless = [a.dest for a in m.make_parser()._actions if not a.help]
    assert not helpless, helpless
