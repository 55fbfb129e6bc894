"""Statistics for pass/fail benchmarks whose items every variant answers: a recall with its
interval, and two variants compared on the same items (paired), so that a loss of a few points is
told apart from the noise of a hundred needles.

* :func:`wilson_interval` — the Wilson score interval of a proportion (sound at 0 % and 100 %,
  where the textbook ``p ± 1.96 sqrt(p(1-p)/n)`` collapses to a point).
* :func:`compare_paired` — the items both variants answered: how many each alone got right (the
  discordant pairs carry all the information), the difference in points with the Agresti–Min
  interval (the Wald interval of a paired difference after adding ½ to each of the four cells,
  which keeps its coverage near 95 % at small counts), and McNemar's exact two-sided p-value (a
  binomial test of the discordant pairs against an even split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson_interval(hits: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The 95 % Wilson score interval of ``hits / n``, as fractions; (0, 1) when ``n`` is 0."""
    if not 0 <= hits <= n:
        raise ValueError(f"hits must be in [0, n], got {hits} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At 0 or n hits the bound is exactly 0 or 1 (computed, it would be off by a rounding error)
    return (0.0 if hits == 0 else centre - half), (1.0 if hits == n else centre + half)


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: the chance of a split of the ``only_a + only_b`` discordant
    pairs at least this uneven if each pair were a fair coin."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class PairedComparison:
    """Variant B against baseline A on the items both answered."""

    items: int
    both: int  # right in both
    only_baseline: int  # right in A, wrong in B: what B lost
    only_variant: int  # wrong in A, right in B
    difference: float  # B's recall minus A's, as a fraction
    low: float  # 95 % interval of the difference (Agresti–Min)
    high: float
    p_value: float  # McNemar's exact test

    def describe(self) -> str:
        """e.g. ``-3.0 points [-7.1, +1.2], lost 5 / gained 2, p = 0.45``."""
        return (f"{100 * self.difference:+.1f} points [{100 * self.low:+.1f}, {100 * self.high:+.1f}], "
                f"lost {self.only_baseline} / gained {self.only_variant}, p = {self.p_value:.2g}")


def compare_paired(baseline: list[bool], variant: list[bool], z: float = Z95) -> PairedComparison:
    """``variant`` against ``baseline``, item i of one paired with item i of the other."""
    if len(baseline) != len(variant):
        raise ValueError(f"paired lists differ in length: {len(baseline)} and {len(variant)}")
    n = len(baseline)
    both = sum(a and b for a, b in zip(baseline, variant))
    only_a = sum(a and not b for a, b in zip(baseline, variant))
    only_b = sum(b and not a for a, b in zip(baseline, variant))
    # Agresti–Min: ½ added to each of the four cells (n grows by 2), then the Wald interval.
    n_adj, a_adj, b_adj = n + 2, only_a + 0.5, only_b + 0.5
    diff_adj = (b_adj - a_adj) / n_adj
    var = ((a_adj + b_adj) - (b_adj - a_adj) ** 2 / n_adj) / n_adj ** 2
    half = z * math.sqrt(max(var, 0.0))
    return PairedComparison(items=n, both=both, only_baseline=only_a, only_variant=only_b,
                            difference=(only_b - only_a) / n if n else 0.0,
                            low=max(-1.0, diff_adj - half), high=min(1.0, diff_adj + half),
                            p_value=mcnemar_exact_p(only_a, only_b))
