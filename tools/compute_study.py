"""compute_study.py: the compute study (its grid and report), a test of the paper's claim with its rule fixed first.

    python tools/sweep.py run --grid compute --out-dir runs/compute --seeds 20 21 ... 59   # the runs (resumable)
    python tools/compute_study.py --out-dir runs/compute --report-dir docs/study/compute  # table.md, summary.json

The hypotheses, at the paper's mu = 5.28 (compute = trained rollouts + 5.28 x generated rollouts):
  H1: replay with N = 512, R = 32, B = 128 (B/R = 4, GRPO) reaches on-policy's accuracy levels with at least 30%
      less compute. H2, tested only when H1 is met (so that the pair keeps one 5% error rate): the same for the
      planner's N = 240, R = 16 (`replay_grpo.py plan --mu 5.28 --batch 128`).
The statistic, on each set of seeds (all of them, and each of 2,000 paired bootstrap resamples of them: one
resample of the seeds for every configuration and learning rate, as a seed fixes the warm start they share):
  * a curve: the interquartile mean (IQM) over seeds of held-out greedy accuracy at each evaluation, per
    configuration and learning rate;
  * a configuration's frontier: the running maximum over evaluations of the maximum over its learning rates;
  * the levels: 7 fractions, evenly from 84% to 96%, of on-policy's best IQM (its frontier's last value), computed
    again in each resample;
  * a cost to a level: the compute where the frontier first reaches it, interpolated linearly between the two
    evaluations around the crossing; a frontier that never reaches it costs its run's final compute (censored: a
    lower bound of the true cost, charged to the arm that misses);
  * the saving: 1 - exp(mean over the levels of log(cost_replay / cost_on-policy)), in percent.
The decision: met when the saving is at least 30% and the 5th percentile of its bootstrap is above 0.
Reported without deciding: the frontier gap at equal compute (the paper's Fig. 4: best accuracy at each compute),
the earlier study's rule (pareto.py: 90% of on-policy's best median, cost at the first evaluation past it) on these
seeds, and an A/A check: on-policy's seeds in two halves compared by this statistic, where nothing differs.
"""

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pareto
import tyro
from studylib import fmt, report, runner
from studylib.report import PAPER_MU, first_crossing, frontier, frontier_at, iqm, level_saving, save_figure
from studylib.runner import EVAL_ROLLOUTS

REFERENCE, SAVING_TARGET = "onpolicy", 30.0  # the configuration savings are measured against; the decision's saving
LEVELS = np.linspace(0.84, 0.96, 7)  # fractions of on-policy's best IQM
BUDGETS = (0.125, 0.25, 0.5, 1.0)  # fractions of on-policy's final compute where the frontier gap is read
AXIS = "compute_paper_mu"
LEVEL_NAMES = [f"{f:.0%}" for f in LEVELS]
BUDGET_NAMES = [f"{b:g}" for b in BUDGETS]

# The grid: on-policy against the replay buffers of the two hypotheses, N = 512, R = 32 and the planner's N = 240,
# R = 16 (both B = 128), each at every lr of COMPUTE_LRS.
# Every configuration runs to about on-policy's final compute at the paper's mu (trained rollouts + PAPER_MU x
# generated rollouts, a replay run's first step generating B to fill its buffer) and ends on an evaluation; all are
# evaluated every EVAL_ROLLOUTS generated rollouts.
COMPUTE_LRS = [3e-6, 1e-5, 3e-5]
COMPUTE_ROLLOUTS = 7680  # on-policy's generated rollouts (60 steps): chosen on pilot seeds 0-5 (docs/study/compute)


def compute_entry(buffer_size: int, prompts_per_step: int, batch_size: int = 128, lrs: list = COMPUTE_LRS) -> dict:
    R, B = prompts_per_step * 16, batch_size  # the cpu preset's G and B
    budget, first, step = COMPUTE_ROLLOUTS * (1 + PAPER_MU), B * (1 + PAPER_MU), B + PAPER_MU * R
    every, steps = EVAL_ROLLOUTS // R, 1 + int((budget - first) // step)
    schedule = dict(total_steps=steps - steps % every, eval_every=every)
    return dict(buffer_size=buffer_size, prompts_per_step=prompts_per_step, **schedule, lr=lrs)


COMPUTE_GRID = (
    runner.CPU_AS_STUDIED,
    [
        compute_entry(buffer_size=128, prompts_per_step=8),  # on-policy GRPO: N = B = R = 128
        compute_entry(buffer_size=512, prompts_per_step=2),  # H1: B/R = 4
        compute_entry(buffer_size=240, prompts_per_step=1),  # H2: the planner's N/R = 15, B/R = 8 at mu = 5.28
    ],
)
# The replication (docs/study/compute/replication.md, its rule): H1 again on seeds 300-339, the same setting and
# schedule, on-policy and N512-R32 only, with 1e-6 below the lowest lr, where both replay buffers did best.
REPLICATION_LRS = [1e-6, 3e-6, 1e-5, 3e-5]
REPLICATION_GRID = (
    runner.CPU_AS_STUDIED,
    [
        compute_entry(buffer_size=128, prompts_per_step=8, lrs=REPLICATION_LRS),
        compute_entry(buffer_size=512, prompts_per_step=2, lrs=REPLICATION_LRS),
    ],
)


@dataclass
class Args(report.Args):
    """The compute study's table (table.md), summary.json, records.json.xz and figure from the runs in --out-dir."""

    out_dir: str = "runs/compute"
    seeds: list[int] | None = None
    """the seeds reported (default: every seed that finished every configuration and learning rate)."""
    h1: str = "N512-R32-grpo"
    """the configuration of the first hypothesis."""
    h2: str | None = "N240-R16-grpo"
    """the configuration of the second, tested only when the first is met (the planner's for mu = 5.28); None:
    H1 alone (the replication)."""
    replicates: int = 2000
    """paired bootstrap resamples of the seeds."""
    pool_records: str | None = None
    """a records.json.xz whose runs are pooled with the finished runs in --out-dir (seeds run in two sessions): a run in
    both, or a configuration whose settings differ between them, stops with one line."""


def estimates(arms: dict, reference: str, idx: np.ndarray) -> dict:
    """The statistic on the seeds at positions idx (a resample may repeat some). arms: {config: {"x": compute at
    each evaluation, "acc": {lr: [seed, evaluation]}}}, every array's seeds in one order."""
    fr = {c: frontier([iqm(acc[idx]) for acc in arm["acc"].values()]) for c, arm in arms.items()}
    best = float(fr[reference][-1])
    levels = LEVELS * best
    ref_x = arms[reference]["x"]
    cost = {c: [first_crossing(arm["x"], fr[c], L) for L in levels] for c, arm in arms.items()}
    ref_at = [frontier_at(ref_x, fr[reference], b * ref_x[-1]) for b in BUDGETS]
    out = {"best": best, "configs": {}}
    for c, arm in arms.items():
        at = [frontier_at(arm["x"], fr[c], b * ref_x[-1]) - r for b, r in zip(BUDGETS, ref_at)]
        out["configs"][c] = {
            "cost": dict(zip(LEVEL_NAMES, cost[c])),
            "ratio": {n: v / r if r > 0 else math.nan for n, v, r in zip(LEVEL_NAMES, cost[c], cost[reference])},
            "reached": {n: float(fr[c][-1] >= L) for n, L in zip(LEVEL_NAMES, levels)},
            "saving": level_saving(cost[c], cost[reference]),
            "gap": dict(zip(BUDGET_NAMES, at)),
            "frontier": {str(i): float(v) for i, v in enumerate(fr[c])},
            "best_iqm": {lr: float(iqm(acc[idx]).max()) for lr, acc in arm["acc"].items()},
        }
    return out


def bootstrap(arms: dict, reference: str, replicates: int, seed: int) -> tuple[dict, dict]:
    """The point estimates on all seeds and the 5th/95th percentiles of every number over paired resamples; the
    intervals' "reached" is the share of resamples where the frontier reaches each level."""
    n = len(next(iter(next(iter(arms.values()))["acc"].values())))
    ci, reps = report.bootstrap(lambda idx: estimates(arms, reference, idx), n, replicates, seed=seed)
    for c, row in reps["configs"].items():
        ci["configs"][c]["reached"] = {level: float(np.mean(v)) for level, v in row["reached"].items()}
    return estimates(arms, reference, np.arange(n)), ci


def arms_of(cells: dict) -> dict:
    """report.cells_of's cells as this statistic's arms: compute at the paper's mu and accuracy per lr."""
    return {
        c: {"x": cell["x"][AXIS], "acc": {lr: at["acc"] for lr, at in cell["lrs"].items()}} for c, cell in cells.items()
    }


def analyse(runs: list[dict], args: Args) -> dict:
    if args.seeds is not None:
        runs = [r for r in runs if r["seed"] in args.seeds]
    cells, seeds, _ = report.cells_of(runs, PAPER_MU)
    hypotheses = [h for h in (args.h1, args.h2) if h]
    for name in (REFERENCE, *hypotheses):
        if name not in cells:
            raise SystemExit(f"error: {name}: no finished runs in the seeds reported (have: {', '.join(cells)})")
    if args.seeds is not None and sorted(args.seeds) != seeds:
        raise SystemExit(f"error: --seeds: {sorted(set(args.seeds) - set(seeds))} have not finished every run")
    if len(seeds) < 4:
        raise SystemExit(f"error: {len(seeds)} seed(s) finished every run; the statistic needs at least 4")
    cells = {c: cells[c] for c in (REFERENCE, *hypotheses)}
    arms = arms_of(cells)
    point, ci = bootstrap(arms, REFERENCE, args.replicates, seed=0)

    h = len(seeds) // 2  # A/A: on-policy's first half of the seeds against its second, paired by position
    ref = arms[REFERENCE]
    parts = {"first half": slice(0, h), "second half": slice(h, 2 * h)}
    halves = {
        half: {"x": ref["x"], "acc": {lr: a[part] for lr, a in ref["acc"].items()}} for half, part in parts.items()
    }
    aa_point, aa_ci = bootstrap(halves, "first half", args.replicates, seed=1)
    decisions = {}
    for name in hypotheses:
        met = report.meets(point["configs"][name]["saving"], ci["configs"][name]["saving"][0], SAVING_TARGET)
        decisions[name] = "met" if met else "not met"
    if args.h2 and decisions[args.h1] != "met":
        decisions[args.h2] = f"not tested (H1 {decisions[args.h1]}); {decisions[args.h2]} by itself"
    return {
        "seeds": seeds,
        **{"paper_mu": PAPER_MU, "reference": REFERENCE, "h1": args.h1, "h2": args.h2, "saving_target": SAVING_TARGET},
        "replicates": args.replicates,
        "levels": LEVELS.tolist(),
        "budgets": list(BUDGETS),
        "point": point,
        "interval_90": ci,
        "decision": {h: decisions[c] for h, c in zip(("H1", "H2"), hypotheses)},
        "aa": {"seeds": [seeds[:h], seeds[h : 2 * h]], "point": aa_point["configs"]["second half"]["saving"]}
        | {"interval_90": aa_ci["configs"]["second half"]["saving"]},
        "old_rule": old_rule(cells, hypotheses, len(seeds), args.replicates),
        "configs": {c: {**report.config_row(cell), "x": arms[c]["x"].tolist()} for c, cell in cells.items()},
        "start_greedy_acc": {int(s): float(a) for s, a in zip(seeds, next(iter(ref["acc"].values()))[:, 0])},
        "_arms": arms,
    }


def old_rule(cells: dict, hypotheses: list, n_seeds: int, replicates: int) -> dict:
    """The Pareto study's rule (pareto.estimates and pareto.decide) on these seeds: the saving to 90% of on-policy's
    best median accuracy, read at the first evaluation past it, in generated rollouts and compute at the paper's mu
    (pareto.DECISION_AXES); met when it is at least the target with its interval's lower end above 0 on both."""
    estimate = partial(pareto.estimates, cells, REFERENCE, same_lr=None)
    point, (ci, _) = estimate(np.arange(n_seeds)), report.bootstrap(estimate, n_seeds, replicates)
    decision, out = pareto.decide(point, ci, REFERENCE, SAVING_TARGET, n_seeds), {}
    for c in hypotheses:
        sv, band = point["configs"][c]["saving"], ci["configs"][c]["saving"]
        out[c] = {a: {"saving": sv[a]["90%"], "interval_90": band[a]["90%"]} for a in pareto.DECISION_AXES}
        out[c]["verdict"] = decision[c]["verdict"]
    return out


def table_md(s: dict) -> str:
    """The compute study's table.md from its summary (summary.json's content: lrs and seeds as keys are text)."""
    p, ci, ref = s["point"], s["interval_90"], s["reference"]
    seeds, aa = s["seeds"], s["aa"]
    names = list(p["configs"][ref]["cost"])
    decision = []
    for h, c in zip(s["decision"], (s["h1"], s["h2"])):
        saving = fmt.interval(p["configs"][c]["saving"], ci["configs"][c]["saving"], lambda x: fmt.saving(x, 1))
        decision.append([h, c, saving, f"**{s['decision'][h]}**"])
    costs = []
    for c, row in p["configs"].items():
        for n in names:
            rci = ci["configs"][c]
            ratio = "—" if c == ref else fmt.interval(row["ratio"][n], rci["ratio"][n], fmt.amount)
            reached = f"{'yes' if row['reached'][n] else 'no'}; {rci['reached'][n]:.0%}"
            costs.append([c, n, fmt.interval(row["cost"][n], rci["cost"][n], fmt.cost), ratio, reached])
    gaps = [
        [c, *(fmt.interval(v, ci["configs"][c]["gap"][b], fmt.diff) for b, v in row["gap"].items())]
        for c, row in p["configs"].items()
        if c != ref
    ]
    old = []
    for c, o in s["old_rule"].items():
        by_axis = [fmt.interval(o[a]["saving"], o[a]["interval_90"], fmt.saving) for a in pareto.DECISION_AXES]
        old.append([c, *by_axis, o["verdict"]])
    lrs = list(dict.fromkeys(lr for row in p["configs"].values() for lr in row["best_iqm"]))  # an arm may run more
    best = []
    for c, row in p["configs"].items():
        iqms, band = row["best_iqm"], ci["configs"][c]["best_iqm"]
        best.append([c, *(fmt.interval(iqms[lr], band[lr], fmt.acc) if lr in iqms else "-" for lr in lrs)])
    blocks = [
        "# The compute study: replay against on-policy, the rule fixed before the runs",
        f"Seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}); each number is on all of them, each [interval] the 5th and "
        f"95th percentiles over {s['replicates']} paired bootstrap resamples of the seeds. Accuracy: held-out greedy "
        "accuracy, interquartile mean (IQM) over seeds; a frontier: the running maximum over evaluations of the "
        f"maximum over learning rates. Compute = trained rollouts + {s['paper_mu']:g} x generated rollouts. "
        f"On-policy's best IQM: **{p['best']:.3f}** {fmt.bracket(ci['best'], fmt.acc)}; the "
        f"levels: {', '.join(names)} of it, computed again in each resample.",
        "## Configurations",
        "Final compute: at the paper's mu. Measured mu: this machine's generation/training cost ratio (median over "
        "the configuration's runs), which the decision does not use.",
        fmt.config_table(s["configs"], ("final compute", lambda k: fmt.amount(k["x"][-1]))),
        "## Decision",
        f"Met when the saving is at least {s['saving_target']:g}% and its interval's lower end (5th percentile) is "
        "above 0." + (" H2 is tested only when H1 is met." if s["h2"] else ""),
        fmt.table(["hypothesis", "config", "saving", "decision"], decision),
        "## Cost to each level (compute at the first crossing, interpolated) and its ratio to on-policy's",
        "A level a frontier never reaches costs its run's final compute. Reached: whether the frontier on all seeds "
        "reaches it, and in what share of the resamples.",
        fmt.table(["config", "level", "cost", "ratio to on-policy", "reached: all seeds; resamples"], costs),
        "## Reported without deciding",
        "**The frontier gap at equal compute** (the paper's Fig. 4 reading): replay's frontier minus on-policy's, "
        "at fractions of on-policy's final compute.",
        fmt.table(["config", *(f"at {b} of the compute" for b in p["configs"][ref]["gap"])], gaps),
        "**The earlier study's rule on these seeds** (pareto.py: the saving to 90% of on-policy's best median, read "
        "at the first evaluation past it; met when at least the target with the interval's lower end above 0 on "
        "both axes):",
        fmt.table(["config", "generated rollouts", "compute at the paper's mu", "verdict"], old),
        f"**A/A check**: on-policy on seeds {aa['seeds'][1][0]}-{aa['seeds'][1][-1]} against on-policy on seeds "
        f"{aa['seeds'][0][0]}-{aa['seeds'][0][-1]} by the same statistic (paired by position): saving "
        f"{fmt.interval(aa['point'], aa['interval_90'], lambda x: fmt.saving(x, 1))}, where nothing differs.",
        "## Best IQM per learning rate",
        fmt.table(["config", *(f"lr {float(lr):g}" for lr in lrs)], best),
        "## Seeds",
        "Held-out greedy accuracy after the warm start (step 0, shared by every configuration of a seed):",
        fmt.table(["seed", "step 0"], [[k, f"{s['start_greedy_acc'][str(k)]:.3f}"] for k in seeds]),
    ]
    return fmt.markdown(blocks)


def plot(s: dict, dest: Path) -> list[Path]:
    plt = report.pyplot()
    arms, p, ci = s["_arms"], s["point"], s["interval_90"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (c, arm) in enumerate(arms.items()):
        x, row, band = arm["x"], p["configs"][c], ci["configs"][c]["frontier"]
        report.frontier_band(axes[0], x, row["frontier"], band, color=f"C{i}", label=c, alpha=0.12)
        for k, (lr, acc) in enumerate(arm["acc"].items()):  # darker with each lr, however many the arm ran
            alpha = 0.4 + 0.6 * k / max(1, len(arm["acc"]) - 1)
            axes[1].plot(x, iqm(acc), color=f"C{i}", alpha=alpha, label=f"{c} lr {lr:g}")
    for ax in axes:
        ax.axhspan(s["levels"][0] * p["best"], s["levels"][-1] * p["best"], color="gray", alpha=0.12)
        xlabel = f"compute at mu = {s['paper_mu']:g} (trained + mu x generated rollouts)"
        report.label_axes(ax, xlabel=xlabel, ylabel="held-out greedy accuracy (IQM over seeds)")
    axes[0].set_title("Frontier over learning rates (bands: bootstrap 90%; grey: the levels)")
    axes[1].set_title("Every learning rate")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=6, ncol=3)
    return [save_figure(fig, dest / "frontier.png")]


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(Args, args=argv)
    return report.study_report(
        args, "compute", lambda data, args: analyse(data["runs"], args), private="_arms", table_md=table_md, plot=plot
    )


if __name__ == "__main__":
    runner.cli(main)
