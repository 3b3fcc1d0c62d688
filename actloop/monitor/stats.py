"""Significance tests for `actloop compare`: pure functions of plain numbers, written with `math`
alone (no scipy). docs/compare.md says how the comparison uses them.

* `sign_test_p(b, c)` — the exact McNemar test: of the n = b + c discordant pairs (A right and B
  wrong: b; B right and A wrong: c), under "A and B are equally good" each is A's with
  probability 1/2, so min(b, c) ~ Binomial(n, 1/2); two-sided p = min(1, 2 P(X <= min(b, c))).
  Pairs both get right or both get wrong say nothing about which is better and drop out.
* `welch_t_test(xs, ys)` — Welch's unequal-variance t-test on two small samples (per-seed
  success rates): t = (mean x - mean y) / sqrt(s_x^2/n_x + s_y^2/n_y), degrees of freedom from
  the Welch-Satterthwaite equation, two-sided p from Student's t.
* `t_two_sided_p(t, df)` — P(|T| >= |t|) for T ~ Student-t(df) = I_{df/(df+t^2)}(df/2, 1/2),
  the regularized incomplete beta function `betainc`, evaluated by the continued fraction of
  Numerical Recipes (Press et al., 3rd ed., section 6.4, `betacf`).
* `holm(ps)` — Holm's step-down adjustment for testing several pairs at once: a pair is
  significant at level alpha when its adjusted p < alpha, with the family-wise error rate <= alpha.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from actloop.monitor.metrics import mean, std


def sign_test_p(b: int, c: int) -> float:
    """Exact two-sided binomial sign test on b vs c discordant pairs (McNemar's exact test).
    No discordant pair: p = 1 (no evidence either way)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))  # P(X <= min) * 2^n, exact integers
    return min(1.0, 2 * tail / 2 ** n)


def _betacf(a: float, b: float, x: float, max_iter: int = 300, eps: float = 3e-15) -> float:
    """The continued fraction of I_x(a, b) by the modified Lentz method (Numerical Recipes `betacf`)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),            # the even step d_{2m}
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):  # the odd step d_{2m+1}
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b), a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    # x^a (1-x)^b / (a B(a, b)), in logs
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast here; otherwise use I_x(a,b) = 1 - I_{1-x}(b,a)
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def welch_t_test(xs: Sequence[float], ys: Sequence[float]) -> Optional[dict[str, float]]:
    """Welch's t-test of mean(xs) = mean(ys): {"t", "df", "p"} (two-sided), or None when either
    sample has fewer than 2 values (no variance to estimate). When both samples are constant the
    standard error is 0: p = 1 if the means are equal, else 0 (t = +-inf, df = n_x + n_y - 2)."""
    nx, ny = len(xs), len(ys)
    if nx < 2 or ny < 2:
        return None
    diff = mean(xs) - mean(ys)
    vx, vy = std(xs) ** 2 / nx, std(ys) ** 2 / ny  # squared standard errors of the two means
    if vx + vy == 0:
        return {"t": 0.0 if diff == 0 else math.copysign(math.inf, diff), "df": float(nx + ny - 2),
                "p": 1.0 if diff == 0 else 0.0}
    t = diff / math.sqrt(vx + vy)
    df = (vx + vy) ** 2 / (vx ** 2 / (nx - 1) + vy ** 2 / (ny - 1))  # Welch-Satterthwaite
    return {"t": t, "df": df, "p": t_two_sided_p(t, df)}


def holm(ps: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Holm-adjusted p-values, in the input order (None = not tested, left out of the count m):
    the i-th smallest of m gets max over j <= i of min(1, (m - j + 1) p_(j))."""
    order = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    m = len(order)
    out: list[Optional[float]] = [None] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
