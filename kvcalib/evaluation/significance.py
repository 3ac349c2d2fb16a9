"""Is a difference from the unquantised cache real or noise? A paired bootstrap over items.

Each item (an eval sequence, a task's question) is scored unquantised and quantised: the interval is taken on
per-item differences, items resampled whole with replacement. A per-token mean's resample statistic is Σ differences
/ Σ tokens (a ratio estimator). Percentile interval, 2,000 resamples, a fixed seed: same inputs, same interval."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LEVEL", "RESAMPLES", "SEED", "Interval", "paired_bootstrap", "wilson"]

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
MIN_ITEMS = 2  # one item has no spread to resample: no interval rather than a fake one


@dataclass(frozen=True)
class Interval:
    """A paired difference (quantised - unquantised) in a result's JSON: estimate, low, high (its percentile interval at
    `level`), items (resampled), method, significant (excludes 0), outcome ("worse", "better", "indistinguishable")."""

    estimate: float
    low: float
    high: float
    items: int
    level: float = LEVEL
    method: str = f"paired bootstrap over items, {RESAMPLES} resamples, seed {SEED}"
    worse_if_higher: bool = True  # a ΔNLL; an accuracy or a rate: False

    @property
    def significant(self) -> bool:
        return self.low > 0 or self.high < 0

    @property
    def outcome(self) -> str:
        return (
            "indistinguishable"
            if not self.significant
            else "worse"
            if (self.estimate > 0) == self.worse_if_higher
            else "better"
        )

    def verdict(self, fmt: str = "{:+.4f}", cell: bool = False) -> str:
        """The outcome in words: "worse by X ± Y (95% interval [a, b], n items)" (Y: half the interval's width);
        `cell`: without the interval, for a table; `fmt` formats a signed number ("{:+.2%}" for an accuracy)."""
        bounds = f"{self.level:.0%} interval [{fmt.format(self.low)}, {fmt.format(self.high)}], {self.items} items"
        if self.outcome == "indistinguishable":
            return self.outcome + (
                ""
                if cell
                else f" from the unquantised cache ({fmt.format(self.estimate)}, {bounds})"
            )
        size, spread = (
            fmt.format(abs(self.estimate)).lstrip("+"),
            fmt.format((self.high - self.low) / 2).lstrip("+"),
        )
        return f"{self.outcome} by {size} ± {spread}" + ("" if cell else f" ({bounds})")

    JSON = {"worse_if_higher": None, "significant": "significant", "outcome": "outcome"}


def paired_bootstrap(
    differences: Sequence[float],
    weights: Sequence[float] | None = None,
    worse_if_higher: bool = True,
) -> Interval | None:
    """The interval of Σ differences / Σ weights (weights: tokens per item; None: 1 each, a plain mean) over
    items resampled with replacement (RESAMPLES, SEED, LEVEL). None with fewer than MIN_ITEMS items or no weight."""
    d = torch.tensor(differences, dtype=torch.float64)
    n = d.numel()
    w = (
        torch.ones(n, dtype=torch.float64)
        if weights is None
        else torch.tensor(weights, dtype=torch.float64)
    )
    if n < MIN_ITEMS or w.sum() <= 0 or not d.isfinite().all():
        return None
    index = torch.randint(n, (RESAMPLES, n), generator=torch.Generator().manual_seed(SEED))
    totals = w[index].sum(dim=1)
    stats = (d[index].sum(dim=1) / totals)[totals > 0]
    tail = torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)
    low, high = torch.quantile(stats, tail).tolist()
    return Interval(float(d.sum() / w.sum()), low, high, n, worse_if_higher=worse_if_higher)


def wilson(successes: int, trials: int) -> tuple[float, float]:
    """Wilson's score interval (95%: z 1.96) for a rate of successes / trials; (0, 1) with no trial."""
    if trials <= 0:
        return 0.0, 1.0
    p, z = successes / trials, 1.959964
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = (
        z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    )
    return max(0.0, centre - half), min(1.0, centre + half)
