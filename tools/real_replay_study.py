"""real_replay_study.py: the report of the real-model replay study (docs/study/real_replay): on-policy against replay
on cpu-smollm2, held-out greedy accuracy against compute at the paper's mu, each arm's cost to on-policy's accuracy
levels, their ratio with its bootstrap interval and the rule's verdict, and beside them what the rule reports without
deciding.

    python tools/real_replay_study.py --runs runs/real-replay --report-dir docs/study/real_replay/results
    python tools/real_replay_study.py --records docs/study/real_replay/results/records.json.xz --report-dir /tmp/again

--runs reads every ARM/SEED/run folder under it for ARM in on-policy and replay (seed_table.py's layout; a seed is
finished when ARM/seed_table.json holds its wall time) and writes records.json.xz (what the report needs of each run),
table.md, summary.json and accuracy_vs_compute.png; --records computes the same files again from those records alone.

The statistic, as the rule has it: levels at 84, 88, 92 and 96% of on-policy's mean best accuracy (the mean over its
seeds of each seed's largest evaluation); a seed's cost to a level, the compute (trained rollouts + mu x generated
rollouts) where its accuracy first reaches the level (reaching it exactly counts), linear between the evaluations
around the crossing, and 1.5 x the budget (on-policy's final compute, the mean over its seeds) where it never does; an
arm's cost, the mean over its seeds; the ratio, replay's cost over on-policy's, geometric mean over the levels; its 90%
interval, percentiles 5 and 95 of 10,000 bootstrap resamples of each arm's seeds apart, the levels computed again from
each resample's on-policy seeds (the budget stays the full sample's, a constant of the schedule).
"""

import json
from pathlib import Path

import numpy as np
from studylib import fmt, report, runner
from studylib.report import PAPER_MU

ARMS = ("on-policy", "replay")
REFERENCE = "on-policy"
FRACTIONS = np.array([0.84, 0.88, 0.92, 0.96])  # of on-policy's mean best accuracy
LEVEL_NAMES = [f"{f:.0%}" for f in FRACTIONS]
CENSOR = 1.5  # a level never reached costs this many budgets
REPLICATES, BOOTSTRAP_SEED, PERCENTILES = 10_000, 0, (5, 95)
SAVES_BELOW, CONTRADICTED_ABOVE = 1.0, 0.85  # the verdict's bounds on the ratio's interval
MU_RANGE, BISECTIONS = (0.0, 1000.0), 60  # where the break-even mu is looked for, and halvings of that range
REACH_TOL = 1e-9  # an accuracy equal to a level up to float rounding reaches it
AXES = ("trained", "generated", "tokens")  # the cumulative counts a cost is read on at a crossing
CONFIG_KEYS = (
    "preset",
    "lr",
    "prompts_per_step",
    "group_size",
    "batch_size",
    "buffer_size",
    "total_steps",
    "eval_every",
    "skip_zero_signal",
    "max_drift",
    "lr_reuse_exponent",
)
SIZES = ("prompts_per_step", "group_size", "batch_size")  # R and B, which --lr-reuse-exponent scales the lr by
COUNTS = ("mu", "zero_signal_steps", "zero_signal_skipped_steps", "evicted")  # read from a run's last record
EVAL_KEYS = ("step", "generated_rollouts", "trained_rollouts", "total_generated_tokens", "greedy_acc")
FIGURE = "accuracy_vs_compute.png"


# ===== Reading the run folders ========================================================================================


def folder_made(path: Path) -> str | None:
    """The time the run folder was made: the first line's "time" of its machines.jsonl (None without one)."""
    if not path.exists():
        return None
    try:
        first = path.read_text().split("\n", 1)[0]
        time = json.loads(first).get("time") if first.strip() else None
    except (OSError, ValueError, AttributeError) as e:
        raise runner.Damaged(f"{path}: its first line is not a JSON object ({type(e).__name__})") from None
    return time if isinstance(time, str) else None


def m2_by_staleness(records: list[dict]) -> dict:
    """Per staleness bucket, the run's M2 (mean squared log ratio) per token: each step's bucket weighted by its tokens
    (by_staleness; 1 where a record lacks them), so that the run's mean is over its tokens, not its steps."""
    sums = {}
    for r in records:
        tokens = r.get("by_staleness") or {}
        for bucket, row in (r.get("offpolicy_by_staleness") or {}).items():
            if "m2" in row:
                w = tokens.get(bucket, {}).get("tokens", 1)
                total = sums.setdefault(bucket, [0.0, 0.0, 0])
                total[0], total[1], total[2] = total[0] + w * row["m2"], total[1] + w, total[2] + 1
    return {b: {"m2": m2 / w, "steps": n} for b, (m2, w, n) in sorted(sums.items()) if w > 0}


def compact(run_dir: Path, arm: str, seed: int, seconds: float) -> dict:
    """What the report needs of one run: its settings, when its folder was made, its wall time, its evaluations with
    the run's cumulative counts at each (none before the first step), its M2 by staleness, and the last record's
    measured mu, steps without signal and evictions by reason (None where the run did not count them)."""
    records = runner.read_metrics(run_dir / "metrics.jsonl")
    cfg = runner.read_json(run_dir / "config.json")
    evals = []
    for r in records:
        if "eval/greedy_acc" in r:
            e = {"step": r["step"]} | {k: r.get(k, 0) for k in EVAL_KEYS[1:4]} | {"greedy_acc": r["eval/greedy_acc"]}
            if "eval/greedy_acc_untwinned" in r:
                e["greedy_acc_untwinned"] = r["eval/greedy_acc_untwinned"]
            evals.append(e)
    last = records[-1] if records else {}
    return {
        "arm": arm,
        "seed": seed,
        "made": folder_made(run_dir / "machines.jsonl"),
        "wall_seconds": seconds,
        "cfg": {k: cfg[k] for k in CONFIG_KEYS if k in cfg},
        "evals": evals,
        "m2_by_staleness": m2_by_staleness(records),
    } | {k: last.get(k) for k in COUNTS}


def collect(runs: Path) -> dict:
    """Every finished seed (its wall time in ARM/seed_table.json) of each arm's folder under `runs`."""
    out = []
    for arm, seed, run_dir, seconds in runner.finished_seeds(runs, ARMS):
        out.append(compact(run_dir, arm, seed, seconds))
        if why := problem(out[-1]):  # what --records would leave out stops the report here: a folder to mend
            raise SystemExit(f"error: --runs {run_dir}: {why}")
    runner.refuse_non_finite(out, lambda run, i: f"--runs {runs}: {run['arm']} seed {run['seed']}")
    return {"runs": out}


def problem(run: dict) -> str | None:
    """Why a recorded run cannot be reported (None: it can)."""
    if run.get("arm") not in ARMS or type(run.get("seed")) is not int:
        return f"no arm of {', '.join(ARMS)} or no integer seed"
    if not isinstance(run.get("cfg"), dict) or not runner.is_number(run["cfg"].get("lr")):
        return "no settings with a learning rate"
    if run["cfg"].get("lr_reuse_exponent") and not all(runner.is_number(run["cfg"].get(k)) for k in SIZES):
        return f"a reuse-scaled learning rate without {', '.join(SIZES)}, which scale it"
    evals = run.get("evals")
    if not isinstance(evals, list) or not evals or not all(isinstance(e, dict) for e in evals):
        return "no evaluations"
    if not all(runner.is_number(e.get(k)) for e in evals for k in EVAL_KEYS):
        return f"an evaluation without a number for one of {', '.join(EVAL_KEYS)}"
    if any(b["step"] <= a["step"] for a, b in zip(evals, evals[1:])):
        return "evaluations out of step order"
    if not runner.is_number(run.get("wall_seconds")):
        return "no wall time"
    m2 = run.get("m2_by_staleness")
    if not isinstance(m2, dict) or not all(isinstance(v, dict) and runner.is_number(v.get("m2")) for v in m2.values()):
        return "no M2 by staleness bucket"
    if any(run.get(k) is not None and not runner.is_number(run[k]) for k in ("mu", *COUNTS[1:3])):
        return f"one of {', '.join(('mu', *COUNTS[1:3]))} is not a number"
    if run.get("evicted") is not None and not runner.is_table(run["evicted"]):
        return "evictions not counted by reason"
    if run.get("made") is not None and not isinstance(run["made"], str):
        return "the time its folder was made is not text"
    return None


# ===== The statistic ==================================================================================================


def seed_arrays(run: dict) -> dict:
    """A run's evaluations as arrays: accuracy, and the cumulative counts of AXES at each."""
    ev = run["evals"]
    return {
        "acc": np.array([e["greedy_acc"] for e in ev], dtype=float),
        "trained": np.array([e["trained_rollouts"] for e in ev], dtype=float),
        "generated": np.array([e["generated_rollouts"] for e in ev], dtype=float),
        "tokens": np.array([e["total_generated_tokens"] for e in ev], dtype=float),
    }


def crossing(acc: np.ndarray, levels: np.ndarray) -> tuple:
    """Where accuracy (one seed's, at its evaluations) first reaches each level (levels: any shape): the evaluations
    before and at the crossing, the fraction of the way between them (linear in accuracy), and whether it does."""
    hit = acc >= levels[..., None] - REACH_TOL
    hi = hit.argmax(axis=-1)
    lo = np.maximum(hi - 1, 0)
    gap = acc[hi] - acc[lo]  # > 0 wherever hi > 0: acc[lo] is under the level there
    w = np.where(hi > 0, (levels - acc[lo]) / np.where(gap > 0, gap, 1.0), 0.0)
    return lo, hi, np.clip(w, 0.0, 1.0), hit.any(axis=-1)


def at_crossing(column: np.ndarray, cross: tuple, censored: float) -> np.ndarray:
    """A cumulative count read at each crossing (linear between its evaluations), `censored` where none is reached:
    compute is linear in the counts, so the cost at any mu is trained + mu x generated read here."""
    lo, hi, w, reached = cross
    return np.where(reached, column[lo] + w * (column[hi] - column[lo]), censored)


def budget_of(on: list[dict]) -> dict:
    """On-policy's final counts on each axis, the mean over its seeds: the budget, as trained + mu x generated."""
    return {ax: float(np.mean([s[ax][-1] for s in on])) for ax in AXES}


def estimate(arms: dict, idx: dict, budget: dict) -> dict:
    """The statistic's parts on R sets of seeds at once. arms: {arm: [seed_arrays]}; idx: {arm: [R, n] positions of
    its seeds (a resample may repeat one)}. Returns the levels [R, level] and each arm's mean counts at its crossings
    {arm: {axis: [R, level]}}, a level never reached counted CENSOR x the budget's count."""
    best = np.array([s["acc"].max() for s in arms[REFERENCE]])
    levels = best[idx[REFERENCE]].mean(axis=1)[:, None] * FRACTIONS
    rows = np.arange(len(levels))[:, None]
    out = {"levels": levels}
    for arm, seeds in arms.items():
        crosses = [crossing(s["acc"], levels) for s in seeds]
        out[arm] = {}
        for ax in AXES:
            per_seed = np.stack([at_crossing(s[ax], c, CENSOR * budget[ax]) for s, c in zip(seeds, crosses)])
            out[arm][ax] = per_seed[idx[arm], rows].mean(axis=1)  # [R, n, level] -> the mean over the seeds drawn
    return out


def cost_at(counts: dict, mu: float | np.ndarray) -> np.ndarray:
    """An arm's cost to each level on the compute axis of mu (trained + mu x generated)."""
    return counts["trained"] + np.asarray(mu)[..., None] * counts["generated"]


def log_ratio(cost: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The mean over the levels of log(cost / reference cost): nan where a cost is 0 (reached before training)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log(cost / reference)
    return np.where((cost > 0) & (reference > 0), r, np.nan).mean(axis=-1)


def ratio(cost: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Replay's cost over on-policy's, geometric mean over the levels (the last axis)."""
    return np.exp(log_ratio(cost, reference))


def break_even(est: dict) -> dict:
    """The mu in MU_RANGE where the ratio, on the compute axis of that mu, is 1, per set of seeds (bisection: one
    crossing where the ratio is on either side of 1 at the range's ends; nan where it is not), and the log ratio at
    the range's ends (which side replay pays on)."""
    on, rep = est[REFERENCE], est["replay"]

    def g(mu):
        return log_ratio(cost_at(rep, mu), cost_at(on, mu))

    low, high = (np.full(len(est["levels"]), m) for m in MU_RANGE)
    g_low, g_high = g(low), g(high)
    crosses = np.sign(g_low) != np.sign(g_high)
    crosses &= np.isfinite(g_low) & np.isfinite(g_high)
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        same = np.sign(g(mid)) == np.sign(g_low)
        low, high = np.where(same, mid, low), np.where(same, high, mid)
    return {"mu": np.where(crosses, (low + high) / 2, np.nan), "g_low": g_low, "g_high": g_high}


def verdict(low: float | None, high: float | None) -> str:
    """The rule's verdict on the ratio's 90% interval (checked in this order)."""
    if low is None:
        return "undecided"
    return "saves compute" if high < SAVES_BELOW else "contradicted" if low > CONTRADICTED_ABOVE else "undecided"


def pays(g_low: float, g_high: float) -> str:
    """Which side of the break-even mu replay pays on, or how the ratio stands where it does not cross 1 in range."""
    span = f"every mu in [{MU_RANGE[0]:g}, {MU_RANGE[1]:g}]"
    if not (np.isfinite(g_low) and np.isfinite(g_high)):
        return "undefined (a cost of 0: a level reached before training)"
    if np.sign(g_low) != np.sign(g_high):
        return "above" if g_high < 0 else "below"
    return f"ratio {'under' if g_high < 0 else 'over' if g_high > 0 else 'equal to'} 1 at {span}"


def by_level(cost: np.ndarray, reference: np.ndarray) -> dict:
    """Replay's cost over on-policy's at each level (nan where on-policy's is 0: reached before training)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return dict(zip(LEVEL_NAMES, np.where(reference > 0, cost / reference, np.nan).tolist()))


def interval(replicates: np.ndarray) -> list:
    return report.intervals_of(np.asarray(replicates, dtype=float), PERCENTILES)


def area_to(x: np.ndarray, acc: np.ndarray, budget: float) -> float:
    """Trapezoid area under accuracy against compute from the first evaluation to `budget`: the last accuracy carried
    flat where a run ends earlier, the curve cut at `budget` where it runs past."""
    keep = x < budget
    xs, ys = np.append(x[keep], budget), np.append(acc[keep], np.interp(budget, x, acc))
    return float(np.sum((ys[1:] + ys[:-1]) / 2 * np.diff(xs)))


def mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def by_arm(records: dict) -> dict[str, list[dict]]:
    """The runs of each arm, by seed; a seed recorded twice in an arm stops the report."""
    arms = {arm: sorted((r for r in records["runs"] if r["arm"] == arm), key=lambda r: r["seed"]) for arm in ARMS}
    for arm, runs in arms.items():
        if not runs:
            raise SystemExit(f"error: the {arm} arm has no finished run: the ratio needs both arms")
        seeds = [r["seed"] for r in runs]
        if len(set(seeds)) < len(seeds):
            raise SystemExit(f"error: the {arm} arm records a seed twice ({seeds}): keep one run per seed")
    return arms


def trained_lr(cfg: dict) -> float:
    """The learning rate a run trained at: the trainer's learning_rate of its settings (--lr when not reuse-scaled)."""
    if not cfg.get("lr_reuse_exponent"):
        return cfg["lr"]
    import replay_grpo as rg

    return rg.learning_rate(rg.Args(**{k: cfg[k] for k in ("lr", "lr_reuse_exponent", *SIZES)}))


def seed_row(run: dict, s: dict, levels: np.ndarray, budget: dict) -> dict:
    """One seed's row of the per-seed table: accuracy at each evaluation, cost to each level at PAPER_MU ("never" when
    not reached), its end, area to the budget, wall time and the counts."""
    cross = crossing(s["acc"], levels)
    reached = cross[3]
    cost = cost_at({ax: at_crossing(s[ax], cross, np.nan) for ax in AXES}, PAPER_MU)
    x = s["trained"] + PAPER_MU * s["generated"]
    last = run["evals"][-1]
    return {
        "seed": run["seed"],
        "lr": trained_lr(run["cfg"]),
        "acc": {str(e["step"]): e["greedy_acc"] for e in run["evals"]},
        "untwinned": {str(e["step"]): e["greedy_acc_untwinned"] for e in run["evals"] if "greedy_acc_untwinned" in e},
        "cost": {n: float(c) if ok else float("inf") for n, c, ok in zip(LEVEL_NAMES, cost, reached)},
        "end": last["greedy_acc"],
        "end_untwinned": last.get("greedy_acc_untwinned"),
        "area": area_to(x, s["acc"], budget["compute"]),
        "minutes": run["wall_seconds"] / 60,
        "made": run.get("made"),
        "mu": run.get("mu"),
        "zero_signal_steps": run.get("zero_signal_steps"),
        "zero_signal_skipped_steps": run.get("zero_signal_skipped_steps"),
        "evicted": run.get("evicted"),
    }


def arm_curve(runs: list[dict], arrays: list[dict]) -> dict:
    """An arm's mean over its seeds of compute at PAPER_MU and accuracy, at the evaluation steps all of them made."""
    steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
    at = [[[e["step"] for e in r["evals"]].index(t) for t in steps] for r in runs]
    x = np.mean([(s["trained"] + PAPER_MU * s["generated"])[i] for s, i in zip(arrays, at)], axis=0)
    acc = np.mean([s["acc"][i] for s, i in zip(arrays, at)], axis=0)
    return {"steps": steps, "x": x.tolist(), "acc": acc.tolist()}


def m2_table(runs: list[dict]) -> dict:
    """Per staleness bucket: the mean over the arm's seeds of each run's M2 per token, and how many seeds had it."""
    buckets = sorted({b for r in runs for b in r["m2_by_staleness"]}, key=report.bucket_order)
    out = {}
    for b in buckets:
        values = [r["m2_by_staleness"][b]["m2"] for r in runs if b in r["m2_by_staleness"]]
        out[b] = {"m2": float(np.mean(values)), "seeds": len(values)}
    return out


def analyse(records: dict, replicates: int = REPLICATES) -> dict:
    """The summary: the rule's figure (costs, ratio, interval, verdict) and what it reports without deciding."""
    arms = by_arm(records)
    arrays = {arm: [seed_arrays(r) for r in runs] for arm, runs in arms.items()}
    budget = budget_of(arrays[REFERENCE])
    budget["compute"] = budget["trained"] + PAPER_MU * budget["generated"]
    point = estimate(arrays, {arm: np.arange(len(s))[None] for arm, s in arrays.items()}, budget)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = {arm: rng.integers(0, len(s), (replicates, len(s))) for arm, s in arrays.items()}
    boot = estimate(arrays, draws, budget)
    on, rep = point[REFERENCE], point["replay"]
    levels = point["levels"][0]

    cost = {arm: cost_at(point[arm], PAPER_MU)[0] for arm in ARMS}
    tokens = {arm: point[arm]["tokens"][0] for arm in ARMS}
    boot_ratio = ratio(cost_at(boot["replay"], PAPER_MU), cost_at(boot[REFERENCE], PAPER_MU))
    low, high = interval(boot_ratio)
    rows = {arm: [seed_row(r, s, levels, budget) for r, s in zip(arms[arm], arrays[arm])] for arm in ARMS}
    reached = {arm: {n: sum(row["cost"][n] != float("inf") for row in rows[arm]) for n in LEVEL_NAMES} for arm in ARMS}
    even, even_boot = break_even(point), break_even(boot)
    per_arm = {}
    for arm, runs in arms.items():
        mus = [r["mu"] for r in runs if r.get("mu") is not None]
        per_arm[arm] = {
            "seeds": [r["seed"] for r in runs],
            "lrs": sorted({trained_lr(r["cfg"]) for r in runs}),
            "end": float(np.mean([row["end"] for row in rows[arm]])),
            "end_untwinned": mean_or_none([row["end_untwinned"] for row in rows[arm]]),
            "end_untwinned_seeds": sum(row["end_untwinned"] is not None for row in rows[arm]),
            "area": float(np.mean([row["area"] for row in rows[arm]])),
            "minutes": float(np.mean([row["minutes"] for row in rows[arm]])),
            "measured_mu": float(np.median(mus)) if mus else None,
            "zero_signal_steps": mean_or_none([row["zero_signal_steps"] for row in rows[arm]]),
            "m2_by_staleness": m2_table(runs),
        }
    curves = {arm: arm_curve(arms[arm], arrays[arm]) for arm in ARMS}
    return {
        "real_replay": {
            "mu": PAPER_MU,
            "fractions": FRACTIONS.tolist(),
            "censor": CENSOR,
            "replicates": replicates,
            "bootstrap_seed": BOOTSTRAP_SEED,
            "percentiles": list(PERCENTILES),
            "saves_below": SAVES_BELOW,
            "contradicted_above": CONTRADICTED_ABOVE,
            "mu_range": list(MU_RANGE),
        },
        "best": float(levels[0] / FRACTIONS[0]),
        "levels": dict(zip(LEVEL_NAMES, levels.tolist())),
        "budget": budget,
        "compute": {
            "cost": {arm: dict(zip(LEVEL_NAMES, cost[arm].tolist())) for arm in ARMS},
            "reached": reached,
            "ratio_by_level": by_level(cost["replay"], cost[REFERENCE]),
            "ratio": float(ratio(cost["replay"], cost[REFERENCE])),
            "interval": [low, high],
            "verdict": verdict(low, high),
        },
        "tokens": {
            "cost": {arm: dict(zip(LEVEL_NAMES, tokens[arm].tolist())) for arm in ARMS},
            "ratio_by_level": by_level(tokens["replay"], tokens[REFERENCE]),
            "ratio": float(ratio(tokens["replay"], tokens[REFERENCE])),
            "interval": interval(ratio(boot["replay"]["tokens"], boot[REFERENCE]["tokens"])),
        },
        "break_even_mu": {
            "mu": float(even["mu"][0]),
            "interval": interval(even_boot["mu"]),
            "resamples_crossing": float(np.mean(np.isfinite(even_boot["mu"]))),
            "replay_pays": pays(float(even["g_low"][0]), float(even["g_high"][0])),
            "ratio_at_zero": float(np.exp(even["g_low"][0])),
            "ratio_at_paper_mu": float(ratio(cost_at(rep, PAPER_MU), cost_at(on, PAPER_MU))[0]),
            "measured_mu": {arm: per_arm[arm]["measured_mu"] for arm in ARMS},
        },
        "arms": per_arm,
        "runs": rows,
        "curves": curves,
    }


# ===== The report =====================================================================================================


def ratio_cell(x) -> str:
    return fmt.number(".3f")(x)


def accuracy_cell(row: dict, step: str) -> str:
    """A seed's accuracy at an evaluation, with its accuracy on the untwinned questions where recorded."""
    if step not in row["acc"]:
        return "—"
    extra = f" ({row['untwinned'][step]:.2f})" if step in row["untwinned"] else ""
    return f"{row['acc'][step]:.2f}{extra}"


def evicted_cell(evicted) -> str:
    if evicted is None:
        return "—"
    return ", ".join(f"{reason} {n}" for reason, n in evicted.items()) or "0"


def seed_table(arm: str, rows: list[dict], budget: float) -> list:
    steps = sorted({step for row in rows for step in row["acc"]}, key=int)
    head = ["seed", "lr", *(f"step {t}" for t in steps), *(f"cost to {n}" for n in LEVEL_NAMES)]
    head += ["end", "area / budget", "wall", "zero-signal steps (skipped)", "evicted", "folder made"]
    body = []
    for row in rows:
        zero = row["zero_signal_steps"]
        skipped = f" ({row['zero_signal_skipped_steps']})" if row["zero_signal_skipped_steps"] is not None else ""
        body.append(
            [row["seed"], f"{row['lr']:g}", *(accuracy_cell(row, t) for t in steps)]
            + [fmt.cost(row["cost"][n]) for n in LEVEL_NAMES]
            + [fmt.acc(row["end"]), fmt.acc(row["area"] / budget), f"{row['minutes']:.1f} min"]
            + ["—" if zero is None else f"{zero}{skipped}", evicted_cell(row["evicted"]), row["made"] or "—"]
        )
    return [f"### Per seed: {arm}", fmt.table(head, body)]


def table_md(s: dict) -> str:
    rule, c, t, b = s["real_replay"], s["compute"], s["tokens"], s["break_even_mu"]
    budget = s["budget"]["compute"]
    seeds = {arm: ", ".join(map(str, s["arms"][arm]["seeds"])) for arm in ARMS}
    n = {arm: len(s["arms"][arm]["seeds"]) for arm in ARMS}
    blocks = [
        f"### Compute to on-policy's accuracy levels, at mu = {rule['mu']:g}",
        f"On-policy's mean best held-out greedy accuracy {s['best']:.3f} (seeds {seeds['on-policy']}; replay: seeds "
        f"{seeds['replay']}). Compute = trained rollouts + {rule['mu']:g} x generated rollouts; the budget, "
        f"on-policy's final compute (mean over its seeds), {fmt.amount(budget)}; a level a seed never reaches costs "
        f"{rule['censor']:g} x budget = {fmt.amount(rule['censor'] * budget)}.",
        fmt.table(
            [
                "level",
                "accuracy",
                "on-policy cost (seeds reaching)",
                "replay cost (seeds reaching)",
                "replay / on-policy",
            ],
            [
                [name, fmt.acc(s["levels"][name])]
                + [f"{fmt.amount(c['cost'][arm][name])} ({c['reached'][arm][name]} of {n[arm]})" for arm in ARMS]
                + [ratio_cell(c["ratio_by_level"][name])]
                for name in LEVEL_NAMES
            ],
        ),
        f"**Replay's cost over on-policy's, geometric mean over the levels: {ratio_cell(c['ratio'])}, 90% interval "
        f"{fmt.bracket(c['interval'], ratio_cell)} ({rule['replicates']:,} bootstrap resamples of each arm's seeds "
        f"apart, the levels computed again in each; percentiles {rule['percentiles'][0]} and "
        f"{rule['percentiles'][1]}): {c['verdict']}.** The rule: saves compute when the interval's upper bound is "
        f"under {rule['saves_below']:g}, contradicted when its lower bound is over {rule['contradicted_above']:g}, "
        "otherwise undecided.",
        "### Reported without deciding",
        "Generated tokens to each level (the same rule on that axis):",
        fmt.table(
            ["level", "on-policy tokens", "replay tokens", "replay / on-policy"],
            [
                [name, *(fmt.amount(t["cost"][arm][name]) for arm in ARMS)] + [ratio_cell(t["ratio_by_level"][name])]
                for name in LEVEL_NAMES
            ],
        ),
        f"Tokens ratio, geometric mean over the levels: {fmt.interval(t['ratio'], t['interval'], ratio_cell)}.",
        break_even_line(b, rule),
        fmt.table(
            ["arm", "lr", "end accuracy", "end, untwinned questions", "area / budget", "wall", "measured mu"]
            + ["zero-signal steps"],
            [arm_row(arm, s["arms"][arm], budget) for arm in ARMS],
        ),
        "Area / budget: the area under accuracy against compute from step 0 to the budget (trapezoids, a run's last "
        "accuracy carried flat to the budget), over the budget: the mean accuracy over that compute. Untwinned: the "
        "held-out questions without a commuted twin among the training questions, where the records carry it (in "
        "brackets in the per-seed tables).",
        "M2 (mean squared log ratio per token) by staleness, the mean over each arm's seeds of the run's value:",
        m2_lines(s),
    ]
    for arm in ARMS:
        blocks += seed_table(arm, s["runs"][arm], budget)
    return fmt.markdown(blocks)


def break_even_line(b: dict, rule: dict) -> str:
    measured = ", ".join(f"{arm} {fmt.mu(b['measured_mu'][arm])}" for arm in ARMS)
    if b["mu"] is None:
        found = f"none in [{rule['mu_range'][0]:g}, {rule['mu_range'][1]:g}]: {b['replay_pays']}"
    else:
        found = f"{fmt.mu(b['mu'])}, replay paying {b['replay_pays']} it"
    share = f"{b['resamples_crossing']:.0%} of the resamples cross in range"
    return (
        f"Break-even mu (the ratio, on the compute axis of that mu, equal to 1; bisection): {found}; 90% interval "
        f"{fmt.bracket(b['interval'], fmt.mu)} over the resamples that cross ({share}). The ratio at mu = 0: "
        f"{ratio_cell(b['ratio_at_zero'])}, at the paper's mu = {rule['mu']:g}: {ratio_cell(b['ratio_at_paper_mu'])}. "
        f"The runs' measured mu (their last records, median): {measured}."
    )


def arm_row(arm: str, a: dict, budget: float) -> list:
    untwinned = (
        f"{fmt.acc(a['end_untwinned'])} ({a['end_untwinned_seeds']} seeds)" if a["end_untwinned"] is not None else "—"
    )
    zero = fmt.number(".1f")(a["zero_signal_steps"])
    lrs = ", ".join(f"{lr:g}" for lr in a["lrs"])
    cells = [fmt.acc(a["end"]), untwinned, fmt.acc(a["area"] / budget), f"{a['minutes']:.1f} min"]
    return [arm, lrs, *cells, fmt.mu(a["measured_mu"]), zero]


def m2_lines(s: dict) -> list:
    buckets = sorted({b for arm in ARMS for b in s["arms"][arm]["m2_by_staleness"]}, key=report.bucket_order)
    if not buckets:
        return ["(no M2 in the records)"]
    rows = []
    for arm in ARMS:
        at = s["arms"][arm]["m2_by_staleness"]
        rows.append([arm, *(f"{at[b]['m2']:.3g} ({at[b]['seeds']})" if b in at else "—" for b in buckets)])
    return fmt.table(["arm", *(f"staleness {b} (seeds)" for b in buckets)], rows)


def plot(s: dict, dest: Path) -> list[Path]:
    """Held-out greedy accuracy against compute at PAPER_MU: each seed thin, each arm's mean over its seeds bold, the
    levels dotted and the budget dashed."""
    plt, c = report.pyplot(), s["compute"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm, color in zip(ARMS, ("tab:blue", "tab:orange")):
        for run in s["seed_curves"][arm]:
            ax.plot(run["x"], run["acc"], "-", color=color, lw=0.7, alpha=0.45)
        mean = s["curves"][arm]
        ax.plot(
            mean["x"],
            mean["acc"],
            "o-",
            color=color,
            lw=2.4,
            ms=4,
            label=f"{arm} (mean of {len(s['arms'][arm]['seeds'])})",
        )
    for name, level in s["levels"].items():
        ax.axhline(level, color="grey", ls=":", lw=0.8)
        ax.annotate(name, (0, level), fontsize=7, color="grey", va="bottom")
    ax.axvline(s["budget"]["compute"], color="grey", ls="--", lw=0.8)
    report.label_axes(
        ax,
        xlabel=f"compute (trained rollouts + {PAPER_MU:g} x generated rollouts)",
        ylabel="held-out greedy accuracy",
        title=f"replay / on-policy cost to the levels: {fmt.interval(c['ratio'], c['interval'], fmt.number('.3f'))}, "
        f"{c['verdict']}",
    )
    ax.legend(loc="lower right")
    return [report.save_figure(fig, dest / FIGURE)]


def with_seed_curves(s: dict, records: dict) -> dict:
    """The summary with each seed's curve (compute at PAPER_MU, accuracy) for the figure: kept out of summary.json."""
    curves = {arm: [] for arm in ARMS}
    for run in sorted(records["runs"], key=lambda r: r["seed"]):
        a = seed_arrays(run)
        curves[run["arm"]].append({"x": (a["trained"] + PAPER_MU * a["generated"]).tolist(), "acc": a["acc"].tolist()})
    return s | {"seed_curves": curves}


def main(argv: list[str] | None = None) -> dict:
    ap = runner.seed_study_parser(__doc__, "ARM")
    ap.add_argument("--replicates", type=int, default=REPLICATES, help="bootstrap resamples (the rule's: 10,000)")
    args = ap.parse_args(argv)
    records = runner.runs_or_records(args.runs, args.records, collect=collect, check=problem)
    s = with_seed_curves(analyse(records, args.replicates), records)
    report.write_report(args.report_dir, s, private="seed_curves", table_md=table_md, plot=plot, records=records)
    return s


if __name__ == "__main__":
    runner.cli(main)
