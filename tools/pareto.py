"""pareto.py: the Pareto study, its grid and its report. Replay against on-policy over a learning-rate sweep, as the
paper compares configurations (its Fig. 4): per configuration, the frontier over learning rates of held-out greedy
accuracy against generated rollouts and against compute.

    python tools/sweep.py run --grid pareto --out-dir runs/pareto --seeds 0 1 2       # the runs (resumable)
    python tools/pareto.py --out-dir runs/pareto --report-dir docs/study/pareto      # table.md, summary.json, PNGs

Every configuration generates about the same rollouts and is evaluated every 256 of them, so curves are compared
at nearly the same x without interpolating (a replay run's first step fills its buffer to B, which puts its
evaluations B - R rollouts later: its costs are read at its own x). Compute, in the paper's accounting: training
on a rollout costs 1, generating one costs mu; compute = trained rollouts + mu x generated rollouts, at the mu
measured on this machine (median of the runs' logged mu) and at the paper's mu = 5.28.

What is computed, each point estimate on all seeds and each 90% interval over bootstrap resamples of the seeds
(one resample for every configuration and learning rate alike: a seed fixes the warm start they all share):
  * frontier(x): the best median accuracy (over seeds) any learning rate reached at cost <= x;
  * the target: on-policy's best median accuracy (over learning rates and evaluations), and 90% of it;
  * a configuration's cost to a level: the first x where its frontier reaches it; the saving: 1 - cost / on-policy's;
  * the same at one learning rate (--same-lr), against on-policy's best median at that learning rate;
  * per learning rate: final and best median accuracy, and the trained batch's entropy at the end.
The decision, fixed before the runs: a replay configuration meets the claim when its saving to 90% of the target
is at least --saving-target percent, with the 90% interval's lower end above 0, in generated rollouts and in
compute at the paper's mu alike. The claim holds on this grid when the planner's configuration meets it
(--primary: the one the paper's recipe picks for mu = 5.28 without seeing any run).
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro
from studylib import fmt, report, runner
from studylib.report import PAPER_MU, costs, frontier, meets, save_figure, savings
from studylib.runner import EVAL_ROLLOUTS

AXES = {
    "rollouts": "generated rollouts",
    "compute_measured_mu": "compute at the measured mu",
    "compute_paper_mu": "compute at the paper's mu",
}
LEVELS = {"90%": 0.9, "100%": 1.0}  # fractions of on-policy's best median accuracy
DECISION_AXES = ("rollouts", "compute_paper_mu")
REFERENCE = "onpolicy"  # the configuration savings are measured against

# The Pareto study on --preset cpu: on-policy against replay with N = 512 at B/R = 2, 4, 8 and the planner's
# suggestion for the paper's mu = 5.28 (`plan --mu 5.28 --batch 128`: N = 240, R = 16), each at every lr of
# PARETO_LRS, the report keeping the frontier over them. Every configuration generates PARETO_ROLLOUTS rollouts
# and is evaluated every EVAL_ROLLOUTS of them (on-policy every 2 steps), so that all curves share their x values.
PARETO_LRS = [1e-5, 3e-5, 1e-4]
PARETO_ROLLOUTS = 3840  # on-policy: 30 steps of R = 128


def pareto_entry(buffer_size: int, prompts_per_step: int) -> dict:
    R = prompts_per_step * 16  # the cpu preset's G
    schedule = dict(total_steps=PARETO_ROLLOUTS // R, eval_every=EVAL_ROLLOUTS // R)
    return dict(buffer_size=buffer_size, prompts_per_step=prompts_per_step, **schedule, lr=PARETO_LRS)


PARETO_GRID = (
    runner.CPU_AS_STUDIED,
    [
        pareto_entry(buffer_size=128, prompts_per_step=8),  # on-policy GRPO: N = B = R = 128
        pareto_entry(buffer_size=512, prompts_per_step=4),  # B/R = 2
        pareto_entry(buffer_size=512, prompts_per_step=2),  # B/R = 4, the README's replay example
        pareto_entry(buffer_size=512, prompts_per_step=1),  # B/R = 8
        pareto_entry(buffer_size=240, prompts_per_step=1),  # the planner's N/R = 15, B/R = 8 at mu = 5.28
    ],
)


@dataclass
class Args(report.Args):
    """The Pareto study's table (table.md), summary.json, records.json.xz and figures from the runs in --out-dir."""

    out_dir: str = "runs/pareto"
    primary: str = "N240-R16-grpo"
    """the configuration whose verdict decides the claim (the planner's suggestion for mu = 5.28)."""
    same_lr: float = 3e-5
    """the learning rate of the same-learning-rate comparison."""
    saving_target: float = 30.0
    """the saving (percent) to 90% of the target that the decision asks for."""
    replicates: int = 2000
    """bootstrap resamples of the seeds."""


def estimates(cells: dict, reference: str, idx: np.ndarray, same_lr: float) -> dict:
    """Every number of the report on the seeds at positions idx (a resample may repeat some)."""
    med = {c: {lr: np.median(at["acc"][idx], axis=0) for lr, at in cell["lrs"].items()} for c, cell in cells.items()}
    target = max(float(m.max()) for m in med[reference].values())
    same_target = float(med[reference][same_lr].max()) if same_lr in med[reference] else math.nan
    out = {"target": target, "same_lr_target": same_target, "configs": {}}
    for c, cell in cells.items():
        best = frontier(list(med[c].values()))  # the best median accuracy over lrs at cost <= each evaluation's
        row = out["configs"][c] = {"cost": costs(cell["x"], best, LEVELS, target), "saving": {}, "same_lr_cost": {}}
        if same_lr in cell["lrs"] and same_lr in cells[reference]["lrs"]:
            row["same_lr_cost"] = costs(cell["x"], med[c][same_lr], LEVELS, same_target)
        row |= {"same_lr_saving": {}, "best": float(best[-1]), "lrs": {}}
        row["best_minus_reference"] = row["best"] - target
        row["frontier"] = {axis: {f"{x:g}": float(y) for x, y in zip(cell["x"][axis], best)} for axis in AXES}
        for lr, at in cell["lrs"].items():
            ent = np.median(at["entropy"][idx], axis=0)
            row["lrs"][lr] = {"final": float(med[c][lr][-1]), "best": float(med[c][lr].max())}
            row["lrs"][lr] |= {"entropy_end": float(ent[-1]), "entropy_start": float(ent[0])}
    ref = out["configs"][reference]
    for row in out["configs"].values():
        row["saving"], row["same_lr_saving"] = (savings(row[k], ref[k]) for k in ("cost", "same_lr_cost"))
        for lr, at in row["lrs"].items():
            if lr in ref["lrs"]:
                at["final_minus_reference"] = at["final"] - ref["lrs"][lr]["final"]
    return out


def decide(point: dict, ci: dict, reference: str, saving_target: float, n_seeds: int) -> dict:
    """Per replay configuration: 'met' when, on every DECISION_AXES axis, the saving to 90% of the target meets
    saving_target (report.meets: at least that, its interval's lower end above 0); 'not met' otherwise;
    'undecided' on one seed, where every resample is that seed and the interval is no interval."""
    out = {}
    for c, row in point["configs"].items():
        if c == reference:
            continue
        if n_seeds < 2:
            out[c] = {"axes": {a: "undecided" for a in DECISION_AXES}, "verdict": "undecided"}
            continue
        sv, low = row["saving"], ci["configs"][c]["saving"]
        checks = {a: meets(sv[a]["90%"], low[a]["90%"][0], saving_target) for a in DECISION_AXES}
        out[c] = {"axes": {a: "met" if ok else "not met" for a, ok in checks.items()}}
        out[c]["verdict"] = "met" if all(checks.values()) else "not met"
    return out


def analyse(runs: list[dict], args: Args) -> dict:
    cells, seeds, mu = report.cells_of(runs, PAPER_MU)
    for flag, name in (("", REFERENCE), ("--primary ", args.primary)):
        if name not in cells:
            raise SystemExit(f"error: {flag}{name}: no finished runs (have: {', '.join(cells)})")
    cells = {c: cells[c] for c in sorted(cells, key=lambda c: (c != REFERENCE, c))}  # the reference first
    for c, cell in cells.items():
        mine, theirs = sorted(cell["lrs"]), sorted(cells[REFERENCE]["lrs"])
        if mine != theirs:
            print(f"pareto: {c} ran at lrs {mine}, {REFERENCE} at {theirs}: their frontiers are over different sweeps")
    point = estimates(cells, REFERENCE, np.arange(len(seeds)), args.same_lr)
    ci, _ = report.bootstrap(lambda idx: estimates(cells, REFERENCE, idx, args.same_lr), len(seeds), args.replicates)
    decision = decide(point, ci, REFERENCE, args.saving_target, len(seeds))
    return {
        "seeds": seeds,
        "mu_measured": mu,
        "paper_mu": PAPER_MU,
        "reference": REFERENCE,
        **{k: getattr(args, k) for k in ("primary", "same_lr", "saving_target", "replicates")},
        "point": point,
        "interval_90": ci,
        "decision": decision,
        "claim": decision[args.primary]["verdict"],
        "configs": {c: report.config_row(cell) for c, cell in cells.items()},
        "start_greedy_acc": {
            int(s): float(a) for s, a in zip(seeds, next(iter(cells[REFERENCE]["lrs"].values()))["acc"][:, 0])
        },
        "_cells": cells,
    }


def eval_rollouts(k: dict) -> str:
    """A configuration's generated rollouts at its evaluations, the middle ones left out when there are more than 3."""
    xs = [f"{x:.0f}" for x in k["eval_rollouts"]]
    return ", ".join(xs) if len(xs) <= 3 else f"{xs[0]}, {xs[1]}, ..., {xs[-1]}"


def cost_table(p: dict, ci: dict, cost: str, saving: str) -> list[str]:
    """The rows of costs and savings (keys `cost`, `saving` of each configuration) per level and axis."""
    rows = []
    for c, row in p["configs"].items():
        if not row[cost]:  # the same-lr table: a configuration that did not run at that lr
            continue
        for level in LEVELS:
            cells = [c, level]
            for axis in AXES:
                rci = ci["configs"][c]
                cells.append(fmt.interval(row[cost][axis][level], rci[cost][axis][level], fmt.cost))
                cells.append(fmt.interval(row[saving][axis][level], rci[saving][axis][level], fmt.saving))
            rows.append(cells)
    return fmt.table(["config", "level", *(h for label in AXES.values() for h in (f"{label}: cost", "saving"))], rows)


BEST_COLUMNS = (("best", fmt.acc), ("best_minus_reference", fmt.diff))


def table_md(s: dict) -> str:
    """The Pareto study's table.md from its summary (summary.json's content: lrs and seeds as keys are text)."""
    p, ci, ref = s["point"], s["interval_90"], s["reference"]
    seeds = ", ".join(map(str, s["seeds"]))
    decision = []
    for c, d in s["decision"].items():
        sv, sci = p["configs"][c]["saving"], ci["configs"][c]["saving"]
        by_axis = [fmt.interval(sv[a]["90%"], sci[a]["90%"], fmt.saving) for a in DECISION_AXES]
        decision.append([f"**{c}**" if c == s["primary"] else c, *by_axis, d["verdict"]])
    end, d = [], "final_minus_reference"
    for c, row in p["configs"].items():
        for lr, at in row["lrs"].items():
            aci = ci["configs"][c]["lrs"][lr]
            delta = "—" if c == ref or "final_minus_reference" not in at else fmt.interval(at[d], aci[d], fmt.diff)
            final, best = (fmt.interval(at[k], aci[k], fmt.acc) for k in ("final", "best"))
            ent = f"{at['entropy_start']:.3f} → {at['entropy_end']:.3f}"
            end.append([c, f"{float(lr):g}", final, delta, best, ent])
    best = [
        [c, *(fmt.interval(row[k], ci["configs"][c][k], one) for k, one in BEST_COLUMNS)]
        for c, row in p["configs"].items()
    ]
    start = [["step 0", *(f"{s['start_greedy_acc'][str(k)]:.3f}" for k in s["seeds"])]]
    blocks = [
        "# The Pareto study: replay against on-policy over a learning-rate sweep",
        f"Seeds {seeds} ({len(s['seeds'])}); each number is on all of them, each [interval] the 5th and 95th "
        f"percentiles over {s['replicates']} bootstrap resamples of the seeds. Accuracy: held-out greedy accuracy, "
        "median over seeds. A configuration's frontier: its best median accuracy at a cost, over its learning "
        f"rates. Target: **{ref}'s best median accuracy, {p['target']:.3f}** {fmt.bracket(ci['target'], fmt.acc)}; "
        f"its 90%: {0.9 * p['target']:.3f}. Compute = trained rollouts + mu x generated "
        f"rollouts, at the measured mu = {fmt.mu(s['mu_measured'])} and at the paper's mu = {s['paper_mu']:g}. A point "
        "can lie outside its interval: a cost is the first evaluation where a median curve reaches a level, which "
        "jumps from one evaluation to the next.",
        "## Configurations",
        "A replay run's first step fills its buffer to B (B fresh rollouts), every later one adds R: its "
        "evaluations fall B − R generated rollouts after on-policy's, and its costs are read at its own.",
        fmt.config_table(s["configs"], ("generated rollouts at the evaluations", eval_rollouts), n_over_r=True),
        "## Decision",
        f"Met when the saving to 90% of the target is at least {s['saving_target']:g}% with the interval's lower end "
        "above 0, in generated rollouts and in compute at the paper's mu. The claim holds on this grid when "
        f"**{s['primary']}** (the planner's suggestion for mu = {s['paper_mu']:g}) meets it: "
        f"**{s['claim']}**.",
        fmt.table(["config", "saving to 90%: generated rollouts", "compute at the paper's mu", "verdict"], decision),
        "## Cost to the target and to 90% of it, and the saving against on-policy (frontier over lrs)",
        cost_table(p, ci, "cost", "saving"),
        f"## At one learning rate, {s['same_lr']:g}",
        f"Target: {ref}'s best median accuracy at lr {s['same_lr']:g}, {fmt.acc(p['same_lr_target'])}.",
        cost_table(p, ci, "same_lr_cost", "same_lr_saving"),
        "## The end point: final and best accuracy, entropy",
        "At the end every configuration has generated about the same rollouts (see Configurations). Final: "
        "the median accuracy at the last evaluation; best: the highest median over the evaluations; entropy: "
        "the median over seeds of the policy's mean per-token entropy on the trained batch, at the first and "
        "the last step. The intervals of a best (a maximum) are lopsided, as a percentile bootstrap of a "
        "maximum is: a resample cannot exceed the best value it draws from.",
        fmt.table(
            ["config", "lr", "final", "final − on-policy's at this lr", "best", "entropy first → last step"], end
        ),
        fmt.table(["config", "best over lrs", "− on-policy's best"], best),
        "## Seeds",
        "Held-out greedy accuracy after the warm start (step 0; every configuration of a "
        "seed starts from the same warm start):",
        fmt.table(["seed", *s["seeds"]], start),
    ]
    return fmt.markdown(blocks)


def plot(s: dict, dest: Path) -> list[Path]:
    from matplotlib.ticker import NullFormatter

    plt = report.pyplot()
    cells, target, written = s["_cells"], s["point"]["target"], []
    colors = {c: f"C{i}" for i, c in enumerate(cells)}
    fig, axes = plt.subplots(1, len(AXES), figsize=(5 * len(AXES), 4), sharey=True)
    for ax, (axis, label) in zip(axes, AXES.items()):
        for c, cell in cells.items():
            for at in cell["lrs"].values():
                ax.scatter(cell["x"][axis], np.median(at["acc"], axis=0), s=6, color=colors[c], alpha=0.25)
            line, band = s["point"]["configs"][c]["frontier"][axis], s["interval_90"]["configs"][c]["frontier"][axis]
            report.frontier_band(ax, [float(x) for x in line], line, band, color=colors[c], label=c, alpha=0.06)
        for frac in LEVELS.values():
            ax.axhline(frac * target, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels overlap
        report.label_axes(ax, xlabel=f"{label} (log scale; step 0 at x = 0 is left out)")
    axes[0].set_ylabel("held-out greedy accuracy (median over seeds)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "Frontier over learning rates (lines; bands: bootstrap 90%) and every learning rate's evaluations (dots)"
    )
    written.append(save_figure(fig, dest / "pareto_frontier.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lr = s["same_lr"]
    for ax, axis in zip(axes, DECISION_AXES):
        for c, cell in cells.items():
            if lr in cell["lrs"]:
                q25, q50, q75 = np.percentile(cell["lrs"][lr]["acc"], [25, 50, 75], axis=0)
                ax.plot(cell["x"][axis], q50, color=colors[c], label=c)
                ax.fill_between(cell["x"][axis], q25, q75, color=colors[c], alpha=0.15)
        report.label_axes(ax, xlabel=AXES[axis], ylabel="held-out greedy accuracy")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"At lr {lr:g}: median and IQR over seeds")
    written.append(save_figure(fig, dest / "same_lr.png"))

    lrs = next(iter(cells.values()))["lrs"]  # the reference's
    fig, axes = plt.subplots(1, len(lrs), figsize=(15, 4), sharey=True, squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for c, cell in cells.items():
            if lr in cell["lrs"]:
                at = cell["lrs"][lr]
                ax.plot(at["entropy_x"], np.median(at["entropy"], axis=0), color=colors[c], label=c)
        report.label_axes(ax, title=f"lr {lr:g}", xlabel="generated rollouts")
    axes[0, 0].set_ylabel("entropy per token of the trained batch (median)")
    axes[0, 0].legend(fontsize=8)
    written.append(save_figure(fig, dest / "entropy.png"))
    return written


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(Args, args=argv)
    return report.study_report(
        args, "pareto", lambda data, args: analyse(data["runs"], args), private="_cells", table_md=table_md, plot=plot
    )


if __name__ == "__main__":
    runner.cli(main)
