"""failed_replay_study.py: the report of the real-model replay study's failed configuration (docs/study/real_replay):
replay at B/R = 4 (R = 8) on cpu-smollm2, run again on the same seeds as it was (the baseline) and in variants
(--skip-zero-signal, --max-drift TAU, --lr-reuse-exponent 1), each paired seed by seed with the baseline. Per run:
held-out greedy accuracy at each evaluation, the steps with a zero gradient and those skipped, evictions by reason,
entropy early and late, and how far the weights moved per generated rollout; per variant, whether it holds the
configuration by the rule.

    python tools/failed_replay_study.py --runs runs/real-replay-failed --report-dir docs/study/real_replay/failed
    python tools/failed_replay_study.py --records docs/study/real_replay/failed/records.json.xz --report-dir /tmp/again

--runs reads every VARIANT/SEED/run folder under it (seed_table.py's layout; a seed is finished when
VARIANT/seed_table.json holds its wall time), VARIANT one of VARIANTS, and writes records.json.xz (what the report
needs of each run, the weights' distance included: it is measured from the run's final checkpoint, which the records
do not keep), table.md, summary.json and accuracy_vs_generated.png; --records computes the same files again from
those records alone.

"Holds", as the rule has it: each seed's end accuracy at least HOLD_GAIN above the baseline run of its seed, and no
seed falling HOLD_FALL or more between two consecutive evaluations.
"""

import argparse
from pathlib import Path

import numpy as np
import real_replay_study as rrs
from studylib import fmt, report, runner

VARIANTS = ("baseline", "skip-zero-signal", "max-drift", "lr-reuse-exponent")
BASELINE = "baseline"
FLAGS = {"skip-zero-signal": "skip_zero_signal", "max-drift": "max_drift", "lr-reuse-exponent": "lr_reuse_exponent"}
SEEDS = (7, 8, 9)  # the rule's, paired seed by seed with the committed runs
HOLD_GAIN, HOLD_FALL = 0.10, 0.10  # the rule's 10 points, each way
TOL = 1e-9  # an accuracy difference equal to a bound up to float rounding meets it
EARLY_LATE = 10  # entropy: the mean over the first and over the last this many steps
FIGURE = "accuracy_vs_generated.png"


# ===== Reading the run folders ========================================================================================


def weight_distance(run_dir: Path, cfg: dict, base_cache: dict) -> float:
    """||theta_end - theta_0|| (L2 over every tensor the final checkpoint saves, in fp32): theta_0 is --model as the
    trainer loads it (the tiny model built from its seed, or the pretrained one), theta_end the checkpoint's weights.
    The net displacement, not the path length: steps that undo each other do not add to it."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from infra.models import load_base_policy
    from infra.run_folder import UserError

    if cfg.get("sft_warmup_steps"):
        raise runner.Damaged(f"{run_dir}: a warm-started run starts from its warm start, not --model")
    if not isinstance(cfg.get("model"), str) or (cfg["model"] == "tiny" and type(cfg.get("seed")) is not int):
        raise runner.Damaged(f"{run_dir}/config.json: no --model (and for the tiny model, no integer seed)")
    key = (cfg["model"], cfg.get("seed") if cfg["model"] == "tiny" else None)
    if key not in base_cache:
        try:
            model, _ = load_base_policy(argparse.Namespace(model=key[0], seed=key[1]), torch.device("cpu"))
        except UserError as e:
            raise runner.Damaged(f"{run_dir}: {e}") from None
        base_cache[key] = model.state_dict()
    base, files = base_cache[key], sorted((run_dir / "checkpoint").glob("*.safetensors"))
    if not files:
        raise runner.Damaged(f"{run_dir}: no checkpoint/*.safetensors, the final weights the distance is measured on")
    total = 0.0
    for path in files:
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as e:
            raise runner.Damaged(f"{path}: not a whole safetensors file ({e})") from None
        for name, tensor in tensors.items():
            if name not in base or base[name].shape != tensor.shape:
                raise runner.Damaged(f"{path}: {name} is not a tensor of --model {cfg['model']} of that shape")
            total += float(((tensor.float() - base[name].float()) ** 2).sum())
    return total**0.5


def compact(run_dir: Path, variant: str, seed: int, seconds: float, base_cache: dict) -> dict:
    """real_replay_study's record of the run, with entropy early and late, the mean clipped fraction, the mean age at
    eviction and the weights' distance moved."""
    records = runner.read_metrics(run_dir / "metrics.jsonl")
    cfg = runner.read_json(run_dir / "config.json")
    entropy = [r["entropy"] for r in records if runner.is_number(r.get("entropy"))]
    clip = [r["clip_frac"] for r in records if runner.is_number(r.get("clip_frac"))]
    run = rrs.compact(run_dir, variant, seed, seconds) | {
        "entropy": [rrs.mean_or_none(entropy[:EARLY_LATE]), rrs.mean_or_none(entropy[-EARLY_LATE:])],
        "clip_frac": rrs.mean_or_none(clip),
        "evicted_age_mean": records[-1].get("evicted_age_mean") if records else None,
        "distance": 0.0,
    }
    if why := problem(run):  # what --records would leave out stops the report here: a folder to mend
        raise SystemExit(f"error: --runs {run_dir}: {why}")
    return run | {"distance": weight_distance(run_dir, cfg, base_cache)}


def collect(runs: Path) -> dict:
    """Every finished seed (its wall time in VARIANT/seed_table.json) of each variant's folder under `runs`."""
    base_cache = {}  # the base model, loaded once for every run
    found = runner.finished_seeds(runs, VARIANTS, "variant")
    out = [compact(run_dir, variant, seed, seconds, base_cache) for variant, seed, run_dir, seconds in found]
    runner.refuse_non_finite(out, lambda run, i: f"--runs {runs}: {run['arm']} seed {run['seed']}")
    return {"runs": out}


def problem(run: dict) -> str | None:
    """Why a recorded run cannot be reported (None: it can)."""
    if run.get("arm") not in VARIANTS:
        return f"no variant of {', '.join(VARIANTS)}"
    if why := rrs.problem(run | {"arm": rrs.ARMS[1]}):
        return why
    if not runner.is_number(run.get("distance")) or run["distance"] < 0:
        return "no distance the weights moved"
    if not run["evals"][-1]["generated_rollouts"] > 0:
        return "no generated rollouts at its last evaluation"
    if any(run.get(k) is not None and type(run[k]) is not int for k in rrs.COUNTS[1:3]):
        return f"one of {', '.join(rrs.COUNTS[1:3])} is not a whole number"
    entropy = run.get("entropy")
    if not (isinstance(entropy, list) and len(entropy) == 2 and all(e is None or runner.is_number(e) for e in entropy)):
        return "no entropy early and late"
    if any(run.get(k) is not None and not runner.is_number(run[k]) for k in ("clip_frac", "evicted_age_mean")):
        return "a clipped fraction or an age at eviction that is not a number"
    return None


# ===== The analysis ===================================================================================================


def largest_fall(acc: list[float]) -> float:
    """The largest drop in accuracy from one evaluation to the next (0 when it never falls)."""
    return max([0.0, *(a - b for a, b in zip(acc, acc[1:]))])


def seed_row(run: dict, baseline: dict | None) -> dict:
    acc = [e["greedy_acc"] for e in run["evals"]]
    generated = run["evals"][-1]["generated_rollouts"]
    evicted = run.get("evicted") or {}
    base_end = None if baseline is None else baseline["evals"][-1]["greedy_acc"]
    return {
        "seed": run["seed"],
        "lr": rrs.trained_lr(run["cfg"]),
        "acc": {str(e["step"]): e["greedy_acc"] for e in run["evals"]},
        "end": acc[-1],
        "baseline_end": base_end,
        "end_over_baseline": None if baseline is None else acc[-1] - base_end,
        "largest_fall": largest_fall(acc),
        "zero_signal_steps": run.get("zero_signal_steps"),
        "zero_signal_skipped_steps": run.get("zero_signal_skipped_steps"),
        "evicted": run.get("evicted"),
        "evicted_by_drift": None if run.get("evicted") is None else evicted.get("drift", 0),
        "evicted_age_mean": run.get("evicted_age_mean"),
        "entropy": run["entropy"],
        "clip_frac": run.get("clip_frac"),
        "distance": run["distance"],
        "distance_per_generated": run["distance"] / generated,
        "minutes": run["wall_seconds"] / 60,
        "made": run.get("made"),
        "max_drift": run["cfg"].get("max_drift"),
    }


def holds(rows: list[dict], baseline_seeds: list[int]) -> dict:
    """The rule's verdict on a variant: each of SEEDS run both as the variant and as the baseline, each ending
    HOLD_GAIN above its baseline, none falling HOLD_FALL between evaluations. A seed not run leaves it undecided."""
    missing = sorted(set(SEEDS) - ({r["seed"] for r in rows} & set(baseline_seeds)))
    paired = [r for r in rows if r["end_over_baseline"] is not None]
    gains = all(r["end_over_baseline"] >= HOLD_GAIN - TOL for r in paired)
    steady = all(r["largest_fall"] < HOLD_FALL - TOL for r in rows)
    return {"holds": not missing and gains and steady, "missing_seeds": missing, "gains": gains, "steady": steady}


def settings_problem(run: dict, baseline: dict | None) -> str | None:
    """Why a run is not its variant of the baseline seed's settings (None: it is): its own flag set, the other
    variants' flags off, every other setting the baseline's."""
    own = FLAGS.get(run["arm"])
    if any(bool(run["cfg"].get(flag)) != (flag == own) for flag in FLAGS.values()):
        wanted = f"only {own} set" if own else f"none of {', '.join(FLAGS.values())} set"
        return f"its settings are not the {run['arm']} variant's ({wanted})"
    if baseline is not None:
        differ = sorted(
            k
            for k in {*run["cfg"], *baseline["cfg"]} - set(FLAGS.values())
            if run["cfg"].get(k) != baseline["cfg"].get(k)
        )
        if differ:
            return f"its settings differ from baseline seed {run['seed']}'s in {', '.join(differ)}"
    return None


def analyse(records: dict) -> dict:
    runs = {v: sorted((r for r in records["runs"] if r["arm"] == v), key=lambda r: r["seed"]) for v in VARIANTS}
    for variant, rs in runs.items():
        seeds = [r["seed"] for r in rs]
        if len(set(seeds)) < len(seeds):
            raise SystemExit(f"error: the {variant} variant records a seed twice ({seeds}): keep one run per seed")
    if not runs[BASELINE]:
        raise SystemExit("error: the baseline has no finished run: every variant is read against it")
    base = {r["seed"]: r for r in runs[BASELINE]}
    for variant, rs in runs.items():
        for r in rs:
            if why := settings_problem(r, base.get(r["seed"]) if variant != BASELINE else None):
                raise SystemExit(f"error: {variant} seed {r['seed']}: {why}")
    rows = {v: [seed_row(r, base.get(r["seed"]) if v != BASELINE else None) for r in rs] for v, rs in runs.items()}
    variants = {}
    for variant, rs in rows.items():
        if not rs:
            continue
        variants[variant] = {
            "seeds": [r["seed"] for r in rs],
            "lrs": sorted({r["lr"] for r in rs}),
            "max_drift": sorted({r["max_drift"] for r in rs if r["max_drift"] is not None}),
            "end": rrs.mean_or_none([r["end"] for r in rs]),
            "distance_per_generated": rrs.mean_or_none([r["distance_per_generated"] for r in rs]),
        } | ({} if variant == BASELINE else holds(rs, list(base)))
    return {
        "failed_replay": {"hold_gain": HOLD_GAIN, "hold_fall": HOLD_FALL, "entropy_steps": EARLY_LATE},
        "variants": variants,
        "runs": {v: rs for v, rs in rows.items() if rs},
    }


# ===== The report =====================================================================================================


def verdict_cell(v: dict) -> str:
    if "holds" not in v:
        return "(the baseline)"
    if v["missing_seeds"]:
        return f"undecided: seeds {', '.join(map(str, v['missing_seeds']))} not run"
    why = [
        w
        for w, ok in (("an end under baseline + 10 points", v["gains"]), ("a fall of 10 points", v["steady"]))
        if not ok
    ]
    return "**holds**" if v["holds"] else "does not hold (" + "; ".join(why) + ")"


def table_md(s: dict) -> str:
    rule, variants = s["failed_replay"], s["variants"]
    per_kilo = fmt.number(".4f")
    blocks = [
        "### The failed configuration (B/R = 4, R = 8) and its variants",
        f"A variant holds it when each seed ends at least {rule['hold_gain']:.0%} (points of accuracy) above the "
        f"baseline run of its seed and none falls {rule['hold_fall']:.0%} between evaluations. Distance: "
        "||weights at the end - weights at step 0|| (L2 over every saved tensor), per 1,000 generated rollouts.",
        fmt.table(
            ["variant", "lr", "TAU", "seeds", "mean end", "distance per 1k generated", "verdict"],
            [
                [
                    name,
                    ", ".join(f"{lr:g}" for lr in v["lrs"]),
                    ", ".join(f"{t:g}" for t in v["max_drift"]) or "—",
                    ", ".join(map(str, v["seeds"])),
                    fmt.acc(v["end"]),
                    per_kilo(None if v["distance_per_generated"] is None else 1000 * v["distance_per_generated"]),
                    verdict_cell(v),
                ]
                for name, v in variants.items()
            ],
        ),
    ]
    for variant, rows in s["runs"].items():
        steps = sorted({t for r in rows for t in r["acc"]}, key=int)
        head = ["seed", *(f"step {t}" for t in steps), "baseline's end", "end - baseline", "largest fall"]
        head += ["zero-gradient steps", "skipped", "evicted by drift", "evicted (mean age)"]
        head += [f"entropy, first / last {rule['entropy_steps']} steps"]
        head += ["clipped", "distance per 1k generated", "wall", "folder made"]
        body = []
        for r in rows:
            age = f" ({r['evicted_age_mean']:.1f})" if r["evicted_age_mean"] is not None else ""
            body.append(
                [r["seed"], *(fmt.acc(r["acc"].get(t)) for t in steps), fmt.acc(r["baseline_end"])]
                + [fmt.diff(r["end_over_baseline"]), fmt.acc(r["largest_fall"])]
                + [fmt.number("d")(r["zero_signal_steps"]), fmt.number("d")(r["zero_signal_skipped_steps"])]
                + [fmt.number("d")(r["evicted_by_drift"]), rrs.evicted_cell(r["evicted"]) + age]
                + [" / ".join(fmt.mu(e) for e in r["entropy"]), fmt.number(".1%")(r["clip_frac"])]
                + [per_kilo(None if r["distance_per_generated"] is None else 1000 * r["distance_per_generated"])]
                + [f"{r['minutes']:.1f} min", r["made"] or "—"]
            )
        blocks += [f"### Per seed: {variant}", fmt.table(head, body)]
    return fmt.markdown(blocks)


def plot(s: dict, dest: Path) -> list[Path]:
    """Held-out greedy accuracy against generated rollouts: each seed thin, each variant's mean bold."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = dict(zip(VARIANTS, ("black", "tab:blue", "tab:orange", "tab:green")))
    for variant, curves in s["seed_curves"].items():
        for c in curves:
            ax.plot(c["x"], c["acc"], "-", color=colors[variant], lw=0.7, alpha=0.4)
        n = min(len(c["x"]) for c in curves)
        x, acc = (np.mean([c[k][:n] for c in curves], axis=0) for k in ("x", "acc"))
        ax.plot(x, acc, "o-", color=colors[variant], lw=2.2, ms=4, label=f"{variant} (mean of {len(curves)})")
    report.label_axes(ax, xlabel="generated rollouts", ylabel="held-out greedy accuracy", title="B/R = 4, R = 8")
    ax.legend(loc="lower right", fontsize=8)
    return [report.save_figure(fig, dest / FIGURE)]


def with_seed_curves(s: dict, records: dict) -> dict:
    curves = {}
    for run in sorted(records["runs"], key=lambda r: (VARIANTS.index(r["arm"]), r["seed"])):
        ev = run["evals"]
        curves.setdefault(run["arm"], []).append(
            {"x": [e["generated_rollouts"] for e in ev], "acc": [e["greedy_acc"] for e in ev]}
        )
    return s | {"seed_curves": curves}


def main(argv: list[str] | None = None) -> dict:
    args = runner.seed_study_parser(__doc__, "VARIANT").parse_args(argv)
    records = runner.runs_or_records(args.runs, args.records, collect=collect, check=problem)
    s = with_seed_curves(analyse(records), records)
    report.write_report(args.report_dir, s, private="seed_curves", table_md=table_md, plot=plot, records=records)
    return s


if __name__ == "__main__":
    runner.cli(main)
