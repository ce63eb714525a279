"""fmt.py: the pieces of a study's table.md. Each formatter takes a value as summary.json holds it: a number, "never"
(a level never reached: +-inf) or None (undefined, or nan)."""

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
    return "never" if x in ("never", math.inf) else amount(x)


def saving(x, digits: int = 0) -> str:
    """A saving in percent with its sign: never reached is "never", undefined (None or nan) "—"."""
    if x is None or x != x:
        return "—"
    return "never" if x in ("never", -math.inf) else f"{x:+.{digits}f}%"


def number(spec: str):
    """A formatter of a number by a format spec, "—" for None."""
    return lambda x: "—" if x is None else format(x, spec)


acc, mu, diff = number(".3f"), number(".2f"), number("+.3f")  # an accuracy 0.815, a cost ratio mu 1.37, a difference


def quartiles(q) -> str:
    """Quartiles over seeds (25th, 50th, 75th) as 'median [25th–75th]'."""
    return f"{q[1]:.3f} [{q[0]:.3f}–{q[2]:.3f}]"


def bracket(ci, one) -> str:
    """An interval (the first and last of ci) as '[low, high]', each end formatted by `one`."""
    return f"[{one(ci[0])}, {one(ci[-1])}]"


def interval(value, ci, one) -> str:
    return f"{one(value)} {bracket(ci, one)}"


def markdown(blocks: list) -> str:
    """A document of blocks, one blank line apart: a heading or paragraph as a string, a table or list as its lines."""
    return "\n\n".join(b if isinstance(b, str) else "\n".join(b) for b in blocks) + "\n"


def table(head: list, rows) -> list[str]:
    """A markdown table's lines: the header, the rule under it and one line per row (each cell as str())."""
    lines = ["| " + " | ".join(map(str, cells)) + " |" for cells in [head, *rows]]
    return [lines[0], "|" + "---|" * len(head), *lines[1:]]


def config_table(configs: dict, x_column: tuple, n_over_r: bool = False) -> list[str]:
    """The configurations' schedules (report.config_row's) with a column of their cost (x_column: its header, and
    its cell as a function of a configuration's row)."""
    n_r = ["N/R"] if n_over_r else []
    head = ["config", "N", "B", "R", "B/R", *n_r, "steps", "evaluated every", x_column[0], "lrs", "measured mu"]
    rows = []
    for c, k in configs.items():
        ratios = [f"{k['B'] / k['R']:g}", *(f"{k['N'] / k['R']:g}" for _ in n_r)]
        schedule = [k["steps"], f"{k['eval_every']} steps", x_column[1](k)]
        rows.append(
            [c, k["N"], k["B"], k["R"], *ratios, *schedule, ", ".join(f"{lr:g}" for lr in k["lrs"]), mu(k["mu"])]
        )
    return table(head, rows)
