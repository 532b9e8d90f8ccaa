"""Quantile Balancing (QB) of MoE router biases, and the DeepSeek-V3 sign baseline.

Kimi K3 report §2.3.3 (QB); J. Su, "MoE环游记 6: 最优分配促均衡" (kexue.fm/archives/11619) for
the dual derivation; DeepSeek-V3 (arXiv 2412.19437 §2.1.2) for the sign update it replaces.
SPEC.md §4 (router) and §6 (QB).

The router picks the top-k of `s + b` (s = sigmoid scores [T, E] in fp32, b = bias [E]). QB wants
every expert to receive its share `q = k·T/E` of a step's tokens. One update:
  1. Route with the current bias using top-(k+1) of `s + b`; the (k+1)-th biased score is token
     i's cutoff `c_i`.
  2. Margins `m_ij = s_ij − c_i`; here carried relative to the bias, `m_ij + b_j`, which makes
     the ties at each token's (k+1)-th expert exactly 0 (`routing_margins`).
  3. `b_j ← −θ_j`, θ_j the threshold between expert j's q-th and (q+1)-th largest margin (the
     midpoint), so q tokens clear it given the cutoffs (up to ties, `quantile_thresholds`).
     Centre b (a uniform shift of b changes no top-k).
The update is one step of dual coordinate ascent: the cutoffs move when all biases move, so balance
is reached over successive (warm-started) updates. The new bias routes the *next* batch, never the
batch it was computed from.

At scale (`qb_hist`) every device bins its margins into a fixed per-expert histogram, the counts
are psum-ed over every mesh axis that carries tokens and summed over micro-batches, and the quantile
is read from the pooled counts with in-bin interpolation.

Everything here is a pure function that runs inside `jit`/`shard_map`; the bias lives in the
non-trainable linen collection "balance" (one [E] fp32 vector per MoE layer), owned by the model.
"""

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jaxtyping import Array, Float, Int

Method = Literal["qb_hist", "qb_exact", "sign", "none"]
METHODS: tuple[str, ...] = ("qb_hist", "qb_exact", "sign", "none")


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
    """How router biases are updated after each optimizer step.

    `margin_range` is the range of the histogram of *biased* margins `s_ij + b_j − c_i` (the margin
    relative to the current bias, whose quantile is 0 once balanced). Values outside it are
    clipped into the edge bins, so one update moves a bias by at most ~max(|lo|, |hi|): the range
    doubles as a trust region. [ours] 512 bins over (−1/8, 1/8): bin width 2^-11 in sigmoid-score
    units (SPEC §6 leaves range and bin count open). In experiments/balance_qb_vs_sign.py (E=896,
    k=16, 4096 fixed tokens) a bin width of 2^-9 left the load CV at 0.017 against 0.005 for exact
    QB; widths of 0.0004–0.0005 gave 0.011. 0 must be a bin edge (lo < 0 < hi, −lo a whole
    number of bins).
    """

    method: Method = "qb_hist"
    num_bins: int = 512
    margin_range: tuple[float, float] = (-0.125, 0.125)
    sign_rate: float = 1e-3

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"{self.method=} must be one of {METHODS}")
        _check_hist_args(self.num_bins, self.margin_range)
        if not (math.isfinite(self.sign_rate) and self.sign_rate >= 0):
            raise ValueError(f"{self.sign_rate=} must be a finite number >= 0")


def _check_hist_args(num_bins, margin_range) -> tuple[float, int]:
    """(bin width, index of the bin edge at 0) after checking the histogram arguments."""
    if not isinstance(num_bins, (int, np.integer)) or num_bins < 2:
        raise ValueError(f"num_bins={num_bins!r} must be an int >= 2")
    lo, hi = margin_range
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < 0 < hi):
        raise ValueError(f"margin_range={margin_range!r} must be finite (lo, hi) with lo < 0 < hi")
    width = (hi - lo) / num_bins
    zero_edge = round(-lo / width)
    if abs(-lo / width - zero_edge) > 1e-6:
        raise ValueError(
            f"margin_range={margin_range!r} with num_bins={num_bins} must put 0 on a bin edge "
            "(e.g. symmetric with an even num_bins)"
        )
    return width, zero_edge


def _check_router_inputs(scores, bias, k, check_values):
    """Shape checks at trace time; finiteness eagerly on concrete arrays, or via checkify."""
    if scores.ndim != 2:
        raise ValueError(f"scores must have shape [T, E], got shape {scores.shape}")
    num_experts = scores.shape[1]
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"scores must be floating point (fp32 sigmoid scores), got {scores.dtype}")
    if bias.shape != (num_experts,):
        raise ValueError(f"bias must have shape [E]=({num_experts},), got {bias.shape}")
    if not isinstance(k, (int, np.integer)) or not 1 <= k < num_experts:
        raise ValueError(f"k={k!r} must be an int with 1 <= k < E={num_experts}")
    _check_finite("scores", scores, check_values)
    _check_finite("bias", bias, check_values)


def _check_finite(name, x, check_values):
    if not isinstance(x, jax.core.Tracer):
        bad = int(np.sum(~np.isfinite(np.asarray(x))))
        if bad:
            raise ValueError(f"{name} must be finite, got {bad} non-finite values")
    elif check_values:
        # Only under checkify.checkify(...): an unfunctionalised check cannot be staged.
        n_bad = jnp.sum(~jnp.isfinite(x))
        checkify.check(n_bad == 0, f"{name} must be finite, got {{n}} non-finite values", n=n_bad)


def biased_topk(
    scores: Float[Array, "T E"], bias: Float[Array, "E"], k: int
) -> tuple[Int[Array, "T k"], Float[Array, "T"]]:
    """Route with the current bias: the top-k experts of `s + b` and the (k+1)-th biased score.

    The cutoff comes from the same top-(k+1) call as the route, so QB costs no extra sort.
    """
    biased, ids = lax.top_k(scores + bias, k + 1)  # [T, k+1]
    # Without the barrier XLA:CPU turns this TopK into a full sort of [T, E] once the ids feed a
    # scatter (the loads) and the values the margins: 1.7 s vs 0.2 s per QB update at T=4096,
    # E=896. A barrier on the (values, ids) pair instead crashes XLA under shard_map.
    return lax.optimization_barrier(ids)[:, :k], biased[:, k]


def expert_loads(ids: Int[Array, "T k"], num_experts: int) -> Int[Array, "E"]:
    """Tokens routed to each expert (additive over devices and micro-batches)."""
    return jnp.zeros(num_experts, jnp.int32).at[ids.reshape(-1)].add(1)


def routing_margins(
    scores: Float[Array, "T E"], bias: Float[Array, "E"], k: int, *, check_values: bool = False
) -> Float[Array, "T E"]:
    """Biased margins `m_ij + b_j = s_ij + b_j − c_i`, with c_i token i's cutoff under `bias`.

    QB's margin is m_ij = s_ij − c_i (SPEC §6); carrying it relative to the current bias makes the
    ties exact: each token's (k+1)-th expert sits at exactly 0 (c_i is bitwise that biased score),
    routed experts at ≥ 0, so "given the cutoffs" reads without rounding. Once balanced every
    expert's threshold is near 0, which is also what lets the histogram use one fixed range.
    """
    _check_router_inputs(scores, bias, k, check_values)
    _, cutoff = biased_topk(scores, bias, k)
    return scores + bias - cutoff[:, None]


def admitted_per_expert(num_tokens: int, num_experts: int, k: int) -> int:
    """n = round(k·T/E) (half up), clamped to [1, T−1]: the count each QB threshold admits.

    When k·T/E is not an integer no per-expert threshold can admit exactly q; loads then settle on
    the two integers around q.
    """
    n = math.floor(k * num_tokens / num_experts + 0.5)
    return min(max(n, 1), num_tokens - 1)


def quantile_thresholds(margins: Float[Array, "T E"], k: int) -> Float[Array, "E"]:
    """θ_j = midpoint of expert j's n-th and (n+1)-th largest margin, n = `admitted_per_expert`.

    Given the cutoffs the margins were computed from, #{i: m_ij > θ_j} ≤ n ≤ #{i: m_ij ≥ θ_j},
    with exactly n above θ_j unless the n-th and (n+1)-th margins tie. They tie when expert j is
    underloaded by fewer tokens than it has at margin exactly 0 (tokens whose (k+1)-th choice it
    is): then θ_j = 0 and its bias stays, and those tokens reach it as the overloaded experts
    raise their thresholds — the dual update needs no move from j for that.
    """
    num_tokens, num_experts = margins.shape
    n = admitted_per_expert(num_tokens, num_experts, k)
    top, _ = lax.top_k(margins.T, n + 1)  # [E, n+1]
    # One slice of the pair, not two column picks: the latter makes XLA:CPU swap TopK for a full
    # sort (measured 9 s vs 1 s at T=16384, E=896).
    return jnp.mean(top[:, n - 1 : n + 1], axis=1)


def bias_from_margins(
    margins: Float[Array, "T E"], k: int, bias: Float[Array, "E"]
) -> Float[Array, "E"]:
    """Exact QB bias `b − θ` (SPEC's −Quantile of m = s − c), centred, from a step's margins.

    `margins` are `routing_margins` under `bias`, with all micro-batches of the step concatenated
    along T: this is the definition, not the scalable path (see `margin_histogram`).
    """
    return _centre(bias - quantile_thresholds(margins, k))


def quantile_bias_exact(
    scores: Float[Array, "T E"], bias: Float[Array, "E"], k: int, *, check_values: bool = False
) -> Float[Array, "E"]:
    """One exact QB update (SPEC §6 steps 1–3); sort/top-k based. See `bias_from_margins`."""
    margins = routing_margins(scores, bias, k, check_values=check_values)
    return bias_from_margins(margins, k, bias)


def margin_histogram(
    scores: Float[Array, "T E"],
    bias: Float[Array, "E"],
    k: int,
    *,
    num_bins: int,
    margin_range: tuple[float, float],
    check_values: bool = False,
) -> Int[Array, "E nbins"]:
    """Per-expert counts of biased margins `s_ij + b_j − c_i` over `num_bins` equal bins.

    `margin_range` must put 0 on a bin edge (e.g. symmetric with an even `num_bins`).

    Binning relative to the current bias keeps the fixed range centred on where the quantile lives
    (0 once balanced) for every expert, whatever its bias. The statistic is additive: sum it over
    micro-batches (same bias within a step) and psum it over devices. Out-of-range values land in
    the edge bins so that counts above every interior edge stay exact.
    """
    _check_hist_args(num_bins, margin_range)
    margins = routing_margins(scores, bias, k, check_values=check_values)  # [T, E]
    return _bin_counts(margins, num_bins, margin_range)


def _bin_counts(margins, num_bins, margin_range):
    num_experts = margins.shape[1]
    width, zero_edge = _check_hist_args(num_bins, margin_range)
    # Bins are (e_i, e_{i+1}] with e_i = (i − zero_edge)·w: each token's (k+1)-th expert has a
    # margin of exactly 0, so with 0 on an edge the routed tokens (> 0) and these ties (= 0) never
    # share a bin, and an expert holding exactly q tokens reads its threshold at exactly 0 (its
    # bias stays put). Anchoring at 0 (not lo) keeps that exact whatever rounding lo has.
    bins = jnp.ceil(margins * (1.0 / width)).astype(jnp.int32) - 1 + zero_edge
    bins = jnp.clip(bins, 0, num_bins - 1) + jnp.arange(num_experts, dtype=jnp.int32) * num_bins
    hist = jnp.zeros(num_experts * num_bins, jnp.int32).at[bins.reshape(-1)].add(1)
    return hist.reshape(num_experts, num_bins)


def histogram_thresholds(
    hist: Int[Array, "E nbins"],
    total_tokens: int | Int[Array, ""],
    k: int,
    *,
    margin_range: tuple[float, float],
) -> Float[Array, "E"]:
    """Threshold θ'_j on the biased margins, read from pooled counts with in-bin interpolation.

    Bins are (e_i, e_{i+1}], width w. With G_i = count in bins ≥ i, pick the bin i with
    G_{i+1} ≤ q < G_i (q = k·total/E, fractional allowed) and, treating its count as spread evenly
    over the bin, place θ' where the count above it is q:
        θ' = e_{i+1} − (q − G_{i+1}) / count_i · w.
    With evenly spread values this is the midpoint of the q-th and (q+1)-th largest.

    Error bound vs the exact threshold on the same margins (`quantile_thresholds`):
    the (⌊q⌋+1)-th largest biased margin lies in bin i (G_{i+1} ≤ ⌊q⌋ < ⌊q⌋+1 ≤ G_i), and so does
    θ', so they differ by at most w. The exact threshold is the midpoint of m_(n), m_(n+1)
    (n = round(q)), one of which is that (⌊q⌋+1)-th largest. Hence, whenever bin i is not an edge
    bin holding clipped values,
        |θ'_hist − θ'_exact| ≤ w + (m_(n) − m_(n+1)) / 2.
    Counts are int32 (exact); q and the in-bin offset are fp32, exact below 2^24 tokens.
    """
    width, zero_edge = _check_hist_args(hist.shape[-1], margin_range)
    num_experts, num_bins = hist.shape
    if not isinstance(k, (int, np.integer)) or not 1 <= k < num_experts:
        raise ValueError(f"k={k!r} must be an int with 1 <= k < E={num_experts}")
    q = k * jnp.asarray(total_tokens, jnp.float32) / num_experts
    above = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # [E, nbins]: G_i = count in bins >= i
    i = jnp.clip(jnp.sum(above.astype(jnp.float32) > q, axis=1) - 1, 0, num_bins - 1)  # [E]
    count = jnp.take_along_axis(hist, i[:, None], axis=1)[:, 0]
    above_next = jnp.take_along_axis(above, i[:, None], axis=1)[:, 0] - count
    frac = (q - above_next.astype(jnp.float32)) / jnp.maximum(count, 1).astype(jnp.float32)
    upper_edge = (i + 1 - zero_edge).astype(jnp.float32) * width
    return upper_edge - jnp.clip(frac, 0.0, 1.0) * width


def bias_from_histogram(
    hist: Int[Array, "E nbins"],
    total_tokens: int | Int[Array, ""],
    k: int,
    bias: Float[Array, "E"],
    *,
    margin_range: tuple[float, float],
) -> Float[Array, "E"]:
    """QB bias `b − θ'`, centred, from histograms pooled over the step's micro-batches and devices.

    `bias` is the bias the histograms were binned with; `total_tokens` the tokens they count.
    """
    if bias.shape != (hist.shape[0],):
        raise ValueError(f"bias must have shape [E]=({hist.shape[0]},), got {bias.shape}")
    return _centre(bias - histogram_thresholds(hist, total_tokens, k, margin_range=margin_range))


def quantile_bias_hist(
    scores: Float[Array, "T E"],
    bias: Float[Array, "E"],
    k: int,
    *,
    num_bins: int,
    margin_range: tuple[float, float] = BalanceConfig.margin_range,
    axis_names: tuple[str, ...] = (),
    check_values: bool = False,
) -> Float[Array, "E"]:
    """One histogram QB update; inside `shard_map`, `axis_names` = every axis that carries tokens."""
    hist = margin_histogram(
        scores, bias, k, num_bins=num_bins, margin_range=margin_range, check_values=check_values
    )
    total = scores.shape[0]
    if axis_names:
        hist = lax.psum(hist, axis_names)
        total = lax.psum(total, axis_names)
    return bias_from_histogram(hist, total, k, bias, margin_range=margin_range)


def sign_bias_update(
    bias: Float[Array, "E"], loads: Int[Array, "E"], rate: float
) -> Float[Array, "E"]:
    """DeepSeek-V3: `b ← b − γ·sign(load − mean load)`, centred."""
    loads = loads.astype(jnp.float32)
    return _centre(bias - rate * jnp.sign(loads - jnp.mean(loads)))


def step_statistics(
    cfg: BalanceConfig, scores: Float[Array, "T E"], bias: Float[Array, "E"], k: int
) -> dict[str, Array]:
    """What one micro-batch on one device contributes to the step's bias update.

    "loads" [E] int32 (always; also the metrics' input) and, for qb_hist, "hist" [E, nbins] int32:
    both additive, so sum them over micro-batches (and layers stacked on a leading axis stay
    separate). For qb_exact, "margins" [T, E]: concatenate over micro-batches along T instead.
    """
    _check_router_inputs(scores, bias, k, check_values=False)
    ids, cutoff = biased_topk(scores, bias, k)  # one top-(k+1) for the loads and the margins
    stats = {"loads": expert_loads(ids, scores.shape[1])}
    margins = scores + bias - cutoff[:, None]  # as routing_margins
    if cfg.method == "qb_hist":
        stats["hist"] = _bin_counts(margins, cfg.num_bins, cfg.margin_range)
    elif cfg.method == "qb_exact":
        stats["margins"] = margins
    return stats


def combine_statistics(a: dict[str, Array], b: dict[str, Array]) -> dict[str, Array]:
    """Merge two micro-batches' `step_statistics`: counts add, qb_exact margins concatenate."""
    if a.keys() != b.keys():
        raise ValueError(f"statistics must have the same keys, got {sorted(a)} and {sorted(b)}")
    return {
        name: jnp.concatenate([a[name], b[name]]) if name == "margins" else a[name] + b[name]
        for name in a
    }


def update_bias(
    cfg: BalanceConfig,
    bias: Float[Array, "E"],
    stats: dict[str, Array],
    k: int,
    *,
    axis_names: tuple[str, ...] = (),
) -> Float[Array, "E"]:
    """The bias for the next step, from this step's `step_statistics` (run after the optimizer).

    `axis_names`: inside `shard_map`, the mesh axes that carry tokens (data, expert, sequence);
    per-device statistics are psum-ed over them here, once per step.
    """
    if cfg.method == "none":
        return bias
    if cfg.method == "qb_exact":
        if axis_names:
            raise ValueError(
                f"{axis_names=} must be () for method='qb_exact' (the single-device definition); "
                "use method='qb_hist' under shard_map"
            )
        return bias_from_margins(stats["margins"], k, bias)
    pooled = {name: stats[name] for name in ("loads", "hist") if name in stats}
    if axis_names:
        pooled = lax.psum(pooled, axis_names)
    if cfg.method == "sign":
        return sign_bias_update(bias, pooled["loads"], cfg.sign_rate)
    total = jnp.sum(pooled["loads"]) // k  # every token is routed to exactly k experts
    return bias_from_histogram(pooled["hist"], total, k, bias, margin_range=cfg.margin_range)


def load_metrics(loads: Int[Array, "... E"]) -> dict[str, Array]:
    """Per-layer load balance of a step: reduce over the expert axis only (leading axes kept).

    max_min_ratio is inf when some expert got no tokens; cv = std/mean of the loads.
    """
    loads = jnp.asarray(loads).astype(jnp.float32)
    mean = jnp.mean(loads, axis=-1)
    hi, lo = jnp.max(loads, axis=-1), jnp.min(loads, axis=-1)
    return {
        "max_min_ratio": jnp.where(lo > 0, hi / jnp.where(lo > 0, lo, 1.0), jnp.inf),
        "max_mean_ratio": hi / jnp.maximum(mean, 1e-30),
        "cv": jnp.std(loads, axis=-1) / jnp.maximum(mean, 1e-30),
        "zero_experts": jnp.sum(loads == 0, axis=-1).astype(jnp.int32),
    }


def _centre(bias):
    return bias - jnp.mean(bias)
