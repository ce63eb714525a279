"""fmt.py: the pieces of a study's table.md. Each formatter takes a value as summary.json holds it: a number, "never"
(a level never reached: +-inf) or None (undefined, or nan)."""

from __future__ import annotations

import math


def amount(x) -> str:
    """Token and compute amounts: 58.24, 6896, 13.3k, 1.25M."""
    if x is None:
        return "—"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def cost(x) -> str:
    """A cost to a level, as amount: never reached is "never"."""
    return "never" if x in ("never", math.inf) else amount(x)


def saving(x, digits: int = 0) -> str:
    """A saving in percent with its sign: never reached is "never", undefined "—"."""
    if x is None or x != x:  # None or nan
        return "—"
    return "never" if x in ("never", -math.inf) else f"{x:+.{digits}f}%"


def acc(x) -> str:
    """An accuracy (or another value in [0, 1]): 0.815."""
    return "—" if x is None else f"{x:.3f}"


def mu(x) -> str:
    """A generation/training cost ratio mu: 1.37."""
    return "—" if x is None else f"{x:.2f}"


def diff(x) -> str:
    """A difference of accuracies, with its sign: +0.012."""
    return "—" if x is None else f"{x:+.3f}"


def quartiles(q) -> str:
    """Quartiles over seeds (25th, 50th, 75th) as 'median [25th–75th]'."""
    return f"{q[1]:.3f} [{q[0]:.3f}–{q[2]:.3f}]"


def interval(value, ci, one) -> str:
    """A value and its bootstrap interval [5th, 95th percentile] (the first and last of ci) as 'value [5th, 95th]',
    each formatted by `one`."""
    return f"{one(value)} [{one(ci[0])}, {one(ci[-1])}]"
