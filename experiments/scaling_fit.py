"""Loss-vs-compute fits and the compute multiplier at a target loss, with a bootstrap interval.

Per family, ``log L = a + b · log C`` by least squares over its runs (a power law in compute; with
four to five sizes there is no room for an irreducible-loss term, so the fit is local to the
measured range). The K2-style compute to reach a loss ``L*`` divided by the K3-style compute for
the same loss is the multiplier (> 1: K3-style needs less compute).

Target loss: by default the geometric middle of the range where both families' measured losses
overlap (an interpolation for both fits); ``extrapolated`` says when there is no overlap.

Interval: a bootstrap that redraws (1) every run's held-out loss from its per-batch losses
(evaluation noise) and (2) each family's fit residuals, resampled and inflated by √(n/(n−2)) for
the two fitted parameters (fit scatter); percentile interval of the multiplier. One seed per run:
seed-to-seed variance is not in the interval.
"""

from __future__ import annotations

import math

import numpy as np


def fit_power_law(compute: np.ndarray, loss: np.ndarray) -> tuple[float, float]:
    """``(a, b)`` of ``log L = a + b log C``; needs at least two distinct compute values."""
    compute, loss = np.asarray(compute, np.float64), np.asarray(loss, np.float64)
    if compute.shape != loss.shape or compute.size < 2 or np.unique(compute).size < 2:
        raise ValueError(f"compute {compute} and loss {loss} must be equal-length with >= 2 distinct compute values")
    if np.any(compute <= 0) or np.any(loss <= 0):
        raise ValueError(f"compute {compute} and loss {loss} must be positive")
    b, a = np.polyfit(np.log(compute), np.log(loss), 1)
    return float(a), float(b)


def compute_at(fit: tuple[float, float], loss: float) -> float:
    """The compute at which the fitted power law reaches ``loss`` (inf if the fit does not decrease)."""
    a, b = fit
    if b >= 0:
        return math.inf
    return math.exp((math.log(loss) - a) / b)


def target_loss(losses: dict[str, np.ndarray]) -> tuple[float, bool]:
    """The geometric middle of the overlap of both families' losses; ``(loss, extrapolated)``."""
    lo = max(float(np.min(v)) for v in losses.values())
    hi = min(float(np.max(v)) for v in losses.values())
    return math.sqrt(lo * hi), lo > hi


def multiplier(runs: dict[str, dict], target: float) -> float:
    """``C_k2(L*) / C_k3(L*)`` from ``runs[family] = {"compute": [...], "loss": [...]}``."""
    fits = {f: fit_power_law(r["compute"], r["loss"]) for f, r in runs.items()}
    return compute_at(fits["k2"], target) / compute_at(fits["k3"], target)


def bootstrap(runs: dict[str, dict], target: float, draws: int = 2000, seed: int = 0) -> np.ndarray:
    """Multipliers under resampled evaluation noise and fit residuals (see the module docstring).

    ``runs[family]`` holds ``compute`` [n], ``loss`` [n] and ``batch_losses`` [n][m] (per held-out batch).
    """
    rng = np.random.default_rng(seed)
    out = np.empty(draws)
    prepared = {}
    for f, r in runs.items():
        c, l = np.asarray(r["compute"], np.float64), np.asarray(r["loss"], np.float64)
        a, b = fit_power_law(c, l)
        resid = np.log(l) - (a + b * np.log(c))
        inflate = math.sqrt(len(c) / (len(c) - 2)) if len(c) > 2 else 1.0
        prepared[f] = (c, [np.asarray(x, np.float64) for x in r["batch_losses"]], resid * inflate)
    for i in range(draws):
        fits = {}
        for f, (c, batches, resid) in prepared.items():
            means = np.array([rng.choice(x, x.size).mean() for x in batches])
            logl = np.log(means) + rng.choice(resid, resid.size)
            b, a = np.polyfit(np.log(c), logl, 1)
            fits[f] = (a, b)
        out[i] = compute_at(fits["k2"], target) / compute_at(fits["k3"], target)
    return out


def summary(runs: dict[str, dict], target: float | None = None, draws: int = 2000) -> dict:
    """Fits, the target, the multiplier and its 95 % bootstrap interval."""
    fits = {f: fit_power_law(r["compute"], r["loss"]) for f, r in runs.items()}
    extrapolated = False
    if target is None:
        target, extrapolated = target_loss({f: np.asarray(r["loss"]) for f, r in runs.items()})
    samples = bootstrap(runs, target, draws)
    finite = samples[np.isfinite(samples)]
    lo, hi = (np.percentile(finite, [2.5, 97.5]).tolist() if finite.size else [math.nan, math.nan])
    return {"fits": {f: {"a": a, "b": b} for f, (a, b) in fits.items()}, "target_loss": target,
            "target_extrapolated": extrapolated, "compute_at_target": {f: compute_at(fit, target) for f, fit in fits.items()},
            "multiplier": multiplier(runs, target), "interval_95": [lo, hi], "bootstrap_draws": draws,
            "bootstrap_nonfinite": int(samples.size - finite.size)}
