"""corrections_study.py: the stale-data corrections study (its grid and report), its rule fixed before its runs.

    python tools/sweep.py run --grid corrections --out-dir runs/corrections --tune-seeds 120 121 \
        --seeds $(seq 400 411)                                                              # the runs (resumable)
    python tools/corrections_study.py --out-dir runs/corrections --report-dir docs/study/corrections
    python tools/corrections_study.py --records docs/study/corrections/records.json.xz \
        --report-dir docs/study/corrections

The question: which --correction does a replay buffer need when its rollouts are many policy versions old? The
setting is the cpu preset with a buffer that holds each rollout for N/R = 16 or 32 steps (R = 16 fresh rollouts a
step, B = 128) and a generator that gets the weights every 4 steps (--publish-every 4), so the trained policy drifts
from the behaviour policy that made a rollout by up to N/R + 3 versions. Every --correction (none, tis, seq-mask,
m2po, decoupled; each at its flags' defaults) runs in both settings at each lr of CORRECTIONS_LRS on the tune seeds;
the lr with the best median final greedy accuracy there (sweep.py's pick) is the one run on the reported seeds.

The rule, fixed before any run:
  * a run's score: its held-out greedy accuracy averaged over its last LATE_EVALS evaluations (steps 150, 175, 200);
  * per setting and correction c != none, the effect: the mean over the reported seeds of score(c) - score(none),
    each seed paired with itself (a seed fixes the warm start every configuration of it shares);
  * its interval: percentiles of the effect over 2,000 paired bootstrap resamples of the seeds; the 8 comparisons
    share a 10% error rate (Bonferroni): each is read at its 0.625th and 99.375th percentiles;
  * the decision per comparison: "helps" when that interval lies above 0, "hurts" when below, else "no difference
    shown"; a setting "needs a correction" when at least one correction helps there.
Reported without deciding: each comparison's plain 90% interval (5th-95th), each configuration's median score and
IQR, the lrs the tune seeds picked, and per staleness bucket the diagnostics every record carries (offpolicy_by_
staleness: the share of tokens the correction masked or truncated, mean (log r)^2, and the behaviour-to-policy KL).

The report's input is every run's compact record (records.json.xz: settings, evaluations, diagnostics), written beside
the report; --records recomputes the whole report from that file alone.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro
from studylib import fmt, report, runner
from studylib.report import bucket_order, save_figure

CORRECTIONS = ("none", "tis", "seq-mask", "m2po", "decoupled")
SETTINGS = {"N256": 256, "N512": 512}  # buffer sizes: N/R = 16 and 32 at R = 16
CORRECTIONS_LRS = [3e-6, 1e-5]
LATE_EVALS = 3
FAMILY = 8  # comparisons sharing one error rate
PS = (100 * 0.05 / FAMILY, 5, 95, 100 - 100 * 0.05 / FAMILY)  # Bonferroni's two-sided 90% and the plain 90%
# The cpu preset's flags as of this study, pinned so that the study reruns as it ran whatever the preset becomes.
PINNED = (
    "--preset cpu --generator hf --arith-max-operand 49 --arith-demo-error 0.75 --sft-warmup-steps 650 "
    "--sft-lr 1e-3 --sft-lr-decay --sft-imitation 0 --max-new-tokens 6 --group-size 16 --batch-size 128 "
    "--total-steps 200 --eval-every 25"
).split()


def config_name(setting: str, correction: str) -> str:
    return f"{setting}-R16-k4-{correction}"


CORRECTIONS_GRID = (
    PINNED,
    [
        dict(
            name=config_name(setting, c),
            buffer_size=n,
            prompts_per_step=1,
            publish_every=4,
            correction=c,
            lr=CORRECTIONS_LRS,
        )
        for setting, n in SETTINGS.items()
        for c in CORRECTIONS
    ],
)


@dataclass
class Args(report.Args):
    """The corrections study's table (table.md), summary.json, records.json.xz and figure."""

    out_dir: str = "runs/corrections"
    seeds: list[int] | None = None
    """the seeds reported (default: every seed not in sweep.json's tune seeds that finished every configuration)."""
    replicates: int = 2000
    """paired bootstrap resamples of the seeds."""


def compact(run: dict) -> dict:
    """One finished run as records.json.xz keeps it: its configuration, lr, seed, evaluations (step, generated
    rollouts, greedy accuracy) and the per-bucket diagnostics averaged over its steps."""
    buckets = report.gather(r.get("offpolicy_by_staleness") or {} for r in run["records"])
    diagnostics = {label: {key: float(np.mean(v)) for key, v in row.items()} for label, row in sorted(buckets.items())}
    evals = [[r["step"], r.get("generated_rollouts", 0), r["eval/greedy_acc"]] for r in report.evals(run)]
    return {
        "config": run["config"],
        "lr": run["cfg"]["lr"],
        "seed": run["seed"],
        "evals": evals,
        "diagnostics": diagnostics,
    }


def run_problem(run: dict) -> str | None:
    """What is wrong with a run of records.json.xz (compact's): its configuration, lr, seed, evaluations or
    diagnostics of another type; None when nothing is."""
    for key, ok, what in (
        ("config", lambda x: isinstance(x, str), "text"),
        ("lr", runner.is_number, "a number"),
        ("seed", lambda x: type(x) is int, "an integer"),
        ("diagnostics", lambda x: runner.is_table(x, 2), "a table of tables of numbers"),
    ):
        if not ok(run.get(key)):
            return f'"{key}" is not {what}'
    evals = run.get("evals")
    if not isinstance(evals, list) or not evals or not all(is_eval(e) for e in evals):
        return '"evals" is not a list of [step, generated rollouts, greedy accuracy]'
    return None


def is_eval(e) -> bool:
    return isinstance(e, list) and len(e) == 3 and type(e[0]) is int and all(map(runner.is_number, e[1:]))


def score(rec: dict) -> float:
    return float(np.mean([acc for _, _, acc in rec["evals"][-LATE_EVALS:]]))


def comparisons() -> list[tuple[str, str, str]]:
    """(setting, correction, its configuration's name) for the 8 comparisons against none."""
    return [(s, c, config_name(s, c)) for s in SETTINGS for c in CORRECTIONS if c != "none"]


def estimates(scores: dict, idx: np.ndarray) -> dict:
    """scores: {config: [seed]} in one seed order; the effects on the seeds at positions idx (may repeat)."""
    return {
        name: float(np.mean(scores[name][idx] - scores[config_name(s, "none")][idx])) for s, _, name in comparisons()
    }


def verdict(low: float | None, high: float | None) -> str:
    if low is None:
        return "not resolvable"
    return "helps" if low > 0 else "hurts" if high < 0 else "no difference shown"


def analyse(data: dict, args: Args) -> dict:
    tune = set(data.get("tune_seeds", []))
    runs = [r for r in data["runs"] if r["seed"] not in tune]
    names = [config_name(s, c) for s in SETTINGS for c in CORRECTIONS]
    by = {name: {r["seed"]: r for r in runs if r["config"] == name} for name in names}
    for name in names:
        if len(by[name]) < sum(r["config"] == name for r in runs):  # two lrs of one seed: the report would pick one
            raise SystemExit(f"error: {name} has several runs of one seed outside the tune seeds: keep one lr per seed")
    seeds = sorted(set.intersection(*(set(b) for b in by.values())))
    if args.seeds is not None:
        if missing := sorted(set(args.seeds) - set(seeds)):
            raise SystemExit(f"error: --seeds: {missing} have not finished every configuration")
        seeds = sorted(args.seeds)
    if len(seeds) < 4:
        raise SystemExit(f"error: {len(seeds)} seed(s) finished every configuration; the statistic needs at least 4")
    scores = {name: np.array([score(by[name][s]) for s in seeds]) for name in names}
    point = estimates(scores, np.arange(len(seeds)))
    ci, _ = report.bootstrap(lambda idx: estimates(scores, idx), len(seeds), args.replicates, ps=PS)
    rows = {}
    for s, c, name in comparisons():
        lo, lo90, hi90, hi = ci[name]
        rows[name] = {"setting": s, "correction": c, "effect": point[name], "interval": [lo, hi]}
        rows[name] |= {"interval_90": [lo90, hi90], "decision": verdict(lo, hi)}
    configs = {}
    for name in names:
        recs = [by[name][s] for s in seeds]
        accs = np.median([[e[2] for e in rec["evals"]] for rec in recs], axis=0)
        diag = sorted(report.gather(rec["diagnostics"] for rec in recs).items(), key=lambda kv: bucket_order(kv[0]))
        configs[name] = {"lr": sorted({rec["lr"] for rec in recs}), "score": list(report.quartiles(scores[name]))}
        configs[name]["curve"] = {str(e[0]): float(acc) for e, acc in zip(recs[0]["evals"], accs)}
        configs[name]["diagnostics"] = {k: {key: float(np.median(v)) for key, v in row.items()} for k, row in diag}
    needs = {s: any(rows[name]["decision"] == "helps" for t, _, name in comparisons() if t == s) for s in SETTINGS}
    out = {"seeds": seeds, "tune_seeds": sorted(tune), "replicates": args.replicates, "late_evals": LATE_EVALS}
    return out | {"family": FAMILY, "comparisons": rows, "configs": configs, "needs_correction": needs}


def table_md(s: dict) -> str:
    rows = [
        [r["setting"], r["correction"], fmt.diff(r["effect"]), fmt.bracket(r["interval"], fmt.diff)]
        + [fmt.bracket(r["interval_90"], fmt.diff), r["decision"]]
        for r in s["comparisons"].values()
    ]
    configs = []
    for name, cfg in s["configs"].items():
        diag = [
            f"{k}: {d['corrected_frac']:.3f} / {d['m2']:.4f} / {d['mismatch_kl']:.4f}"
            for k, d in cfg["diagnostics"].items()
        ]
        lrs = ", ".join(f"{lr:g}" for lr in cfg["lr"])
        configs.append([name, lrs, fmt.interval(cfg["score"][1], cfg["score"], fmt.acc), "; ".join(diag)])
    head = ["configuration", "lr", "score median [IQR]", "staleness buckets: corrected share / mean (log r)^2 / KL"]
    blocks = [
        f"Seeds {s['seeds'][0]}-{s['seeds'][-1]} ({len(s['seeds'])}; the lrs were picked on tune seeds "
        f"{s['tune_seeds']}). Score: held-out greedy accuracy averaged over the last {s['late_evals']} evaluations. "
        "Effect: mean over seeds of score(correction) - score(none), paired; interval: Bonferroni over "
        f"{s['family']} comparisons (two-sided 90%), from {s['replicates']} paired bootstrap resamples of the seeds.",
        fmt.table(["setting", "correction", "effect", "interval (Bonferroni)", "90% interval", "decision"], rows),
        "Needs a correction: " + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in s["needs_correction"].items()),
        fmt.table(head, configs),
    ]
    return fmt.markdown(blocks)


def plot(s: dict, dest: Path) -> list[Path]:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(SETTINGS), figsize=(6 * len(SETTINGS), 4), sharey=True)
    for ax, setting in zip(np.atleast_1d(axes), SETTINGS):
        for c in CORRECTIONS:
            curve = s["configs"][config_name(setting, c)]["curve"]
            ax.plot([int(k) for k in curve], list(curve.values()), marker="o", label=c)
        ax.set_title(f"{setting}-R16, publish every 4: median over seeds")
        ax.set_xlabel("step")
        ax.legend()
    np.atleast_1d(axes)[0].set_ylabel("held-out greedy accuracy")
    return [save_figure(fig, dest / "curves.png")]


def main(argv: list[str] | None = None) -> dict:
    def records(runs, out):
        return {"tune_seeds": runner.tune_seeds(out, required=True), "runs": [compact(r) for r in runs]}

    args = tyro.cli(Args, args=argv)
    keys = ("config", "lr", "seed", "evals", "diagnostics")
    return report.study_report(
        args,
        "corrections",
        analyse,
        private=None,
        table_md=table_md,
        plot=plot,
        compact=records,
        keys=keys,
        check=run_problem,
    )


if __name__ == "__main__":
    runner.cli(main)
