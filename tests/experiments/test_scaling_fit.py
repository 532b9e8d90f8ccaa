"""The scaling study's analysis: power-law fit, multiplier, bootstrap, the run plan and resume."""

import math

import numpy as np
import pytest

from experiments import common, scaling_fit
from experiments.scaling_k3_vs_k2 import Study, analyse, best_rates, plan, run_name


def family(compute, a, b, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    loss = np.exp(a + b * np.log(compute))
    batches = [list(l * (1 + noise * rng.standard_normal(8))) for l in loss]
    return {"compute": list(compute), "loss": [float(np.mean(x)) for x in batches], "batch_losses": batches}


def test_exact_power_laws_give_the_known_multiplier():
    c = np.geomspace(1e12, 1e14, 4)
    # K3-style reaches every loss with 2.5x less compute: L_k3(C) = L_k2(2.5 C).
    runs = {"k2": family(c, 2.0, -0.1), "k3": family(c, 2.0 - 0.1 * math.log(2.5), -0.1)}
    s = scaling_fit.summary(runs, draws=200)
    assert s["multiplier"] == pytest.approx(2.5, rel=1e-9)
    assert s["interval_95"] == pytest.approx([2.5, 2.5], rel=1e-9)  # no noise, no residuals
    assert not s["target_extrapolated"]


def test_noise_widens_the_interval_around_the_estimate():
    c = np.geomspace(1e12, 1e14, 4)
    runs = {"k2": family(c, 2.0, -0.1, 0.02, 1), "k3": family(c, 1.9, -0.1, 0.02, 2)}
    s = scaling_fit.summary(runs, draws=300)
    lo, hi = s["interval_95"]
    assert lo < s["multiplier"] < hi and hi / lo > 1.05


def test_target_loss_flags_extrapolation_and_fit_rejects_bad_input():
    assert scaling_fit.target_loss({"k2": np.array([3.0, 2.0]), "k3": np.array([2.5, 1.5])}) == (math.sqrt(5.0), False)
    assert scaling_fit.target_loss({"k2": np.array([3.0, 2.8]), "k3": np.array([2.0, 1.5])})[1]
    with pytest.raises(ValueError, match="distinct compute"):
        scaling_fit.fit_power_law([1.0, 1.0], [2.0, 1.0])
    assert scaling_fit.compute_at((1.0, 0.1), 2.0) == math.inf  # a loss that grows with compute


def _record(family, width, lr, loss):
    return {"family": family, "width": width, "held_out_loss": loss, "held_out_losses": [loss, loss],
            "compute": width ** 3 * 1e6, "recipe": {"learning_rate": lr}}


def test_plan_sweeps_first_then_scales_with_the_best_rate_and_resumes():
    study = Study(widths=(64, 96, 128), lrs=(1e-3, 2e-3))
    assert [p[1] for p in plan(study, {})] == [64] * 4
    done = {run_name("k2", 64, lr): _record("k2", 64, lr, loss) for lr, loss in ((1e-3, 2.0), (2e-3, 1.9))}
    assert best_rates(study, done) == {"k2": 2e-3}
    todo = [p for p in plan(study, best_rates(study, done)) if run_name(*p) not in done]
    assert todo[:2] == [("k3", 64, 1e-3), ("k3", 64, 2e-3)] and ("k2", 96, 2e-3) in todo
    for lr, loss in ((1e-3, 1.8), (2e-3, 1.85)):
        done[run_name("k3", 64, lr)] = _record("k3", 64, lr, loss)
    for w, l2, l3 in ((96, 1.7, 1.6), (128, 1.5, 1.4)):
        done[run_name("k2", w, 2e-3)] = _record("k2", w, 2e-3, l2)
        done[run_name("k3", w, 1e-3)] = _record("k3", w, 1e-3, l3)
    a = analyse(study, done)
    assert a["complete"] and a["best_lr"] == {"k2": 2e-3, "k3": 1e-3} and a["fit"]["multiplier"] > 1


def test_run_store_and_budget(tmp_path):
    store = common.RunStore(tmp_path / "runs")
    assert store.get("a") is None and store.all() == {}
    store.put("a", {"x": 1.0, "y": float("inf")})
    assert store.get("a") == {"x": 1.0, "y": None} and list(store.all()) == ["a"]
    budget = common.Budget(10.0)
    assert budget.allows(1e9)  # nothing measured yet
    budget.record(seconds=4.0, units=100, fixed=2.0)
    assert budget.allows(100) and not budget.allows(1000)
    with pytest.raises(ValueError, match="budget"):
        common.Budget(0)


def test_run_study_trains_the_plan_once_and_redoes_runs_of_another_recipe(tmp_path, monkeypatch):
    import dataclasses

    from experiments import runs, scaling_k3_vs_k2

    study = Study(widths=(64, 96), lrs=(1e-3, 2e-3), tokens_per_param=0.001, batch=2, seq=64, eval_batches=1)
    calls = []

    def fake_train(model, recipe, data, held):
        calls.append((model.name, recipe.learning_rate))
        loss = 3.0 - model.hidden / 100 - 10 * recipe.learning_rate
        return {"recipe": dataclasses.asdict(recipe), "held_out_loss": loss, "held_out_losses": [loss],
                "flops_per_token": 1e6 * model.hidden, "tokens": recipe.tokens, "seconds": 1.0, "compile_seconds": 0.5}

    monkeypatch.setattr(runs, "train", fake_train)
    monkeypatch.setattr(runs, "cached_batches", lambda *args: None)
    done = scaling_k3_vs_k2.run_study(study, tmp_path, tmp_path, None, tiny=False)
    assert len(calls) == 6 and len(done) == 6  # the 2 × 2 sweep, then width 96 at each family's best rate
    assert ("k3_style_d96", 2e-3) in calls
    calls.clear()
    assert scaling_k3_vs_k2.run_study(study, tmp_path, tmp_path, None, tiny=False).keys() == done.keys()
    assert calls == []  # resumed: nothing left
    store = common.RunStore(tmp_path / "scaling_runs")
    stale = store.get(run_name("k2", 96, 2e-3))
    stale["recipe"]["steps"] += 1
    store.put(run_name("k2", 96, 2e-3), stale)
    scaling_k3_vs_k2.run_study(study, tmp_path, tmp_path, None, tiny=False)
    assert calls == [("k2_style_d96", 2e-3)]
