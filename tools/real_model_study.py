"""real_model_study.py: the report of the cpu-smollm2 runs (docs/study/real_model): per seed, held-out greedy
accuracy at step 0 and at the end, wall time, steps, rollouts and tokens generated, greedy answers before and after;
the figure of accuracy against generated tokens and against the seconds spent generating and training.

    python tools/seed_table.py --preset cpu-smollm2 --seeds 1 2 3 --out-dir runs/real/on-policy   # twice, at once
    python tools/real_model_study.py --runs runs/real --report-dir docs/study/real_model
    python tools/real_model_study.py --records docs/study/real_model/records.json.xz --report-dir /tmp/again

--runs reads every ARM/SEED/run folder under it (seed_table.py's layout, its wall times in ARM/seed_table.json)
and writes records.json.xz (what the report needs of each run), table.md, summary.json and accuracy.png;
--records computes the same files again from those records alone.
"""

import argparse
import json
import sys
from pathlib import Path

from studylib import report, runner

TARGET_GAIN, MAX_MINUTES = 15.0, 60.0  # the preset's rule: each seed gains this many points within this wall time
SAMPLES = 4  # greedy answers kept per run, at step 0 and at the end


def compact(run_dir: Path, arm: str, seed: int, seconds: float) -> dict:
    """What the report needs of one run: its evaluations with the generated tokens, rollouts and seconds so far,
    its step count, and a few greedy answers at its first and last evaluation."""
    records = runner.read_metrics(run_dir / "metrics.jsonl")
    cfg = runner.read_json(run_dir / "config.json")
    evals, tokens, rollouts, busy = [], 0, 0, 0.0
    for r in records:
        tokens += r.get("generated_tokens", 0)
        rollouts += r.get("generated_rollouts", 0)
        busy += r.get("gen_seconds", 0.0) + r.get("train_seconds", 0.0)
        if "eval/greedy_acc" in r:
            row = {k.removeprefix("eval/"): r[k] for k in ("eval/greedy_acc", "eval/pass@1", "eval/acc_t1")}
            evals.append({"step": r["step"], "tokens": tokens, "rollouts": rollouts, "seconds": busy, **row})
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    greedy = [s for s in samples if s["source"] == "eval (greedy)"]
    ends = (evals[0]["step"], evals[-1]["step"])
    kept = [
        {k: s[k] for k in ("step", "prompt", "completion", "reward")} | {"answer": json.loads(s["gold"])["answer"]}
        for end in ends
        for s in [s for s in greedy if s["step"] == end][:SAMPLES]
    ]
    keys = ("prompts_per_step", "group_size", "batch_size", "buffer_size", "total_steps", "lr", "rg_config")
    config = {k: cfg[k] for k in keys}
    return {"arm": arm, "seed": seed, "wall_seconds": seconds, "config": config, "evals": evals, "samples": kept}


def collect(runs: Path) -> dict:
    """Every finished seed (its wall time in seed_table.json) of every ARM folder under `runs`."""
    out = []
    for arm in sorted(p for p in runs.iterdir() if p.is_dir()):
        times = runner.read_json(arm / "seed_table.json")
        seeds = sorted(int(p.name) for p in arm.iterdir() if p.name.isdigit() and str(int(p.name)) in times)
        out += [compact(arm / str(s) / "run", arm.name, s, times[str(s)]) for s in seeds]
    return {"runs": out}


def problem(run: dict) -> str | None:
    """Why a recorded run cannot be reported (None: it can)."""
    evals = run.get("evals")
    if not isinstance(evals, list) or not evals or not all(isinstance(e, dict) for e in evals):
        return "no evaluations"
    keys = ("step", "tokens", "rollouts", "seconds", "greedy_acc")
    if not all(isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool) for e in evals for k in keys):
        return f"an evaluation without a number for one of {', '.join(keys)}"
    if not isinstance(run.get("wall_seconds"), (int, float)) or not isinstance(run.get("samples"), list):
        return "no wall time or samples"
    return None


def by_arm(records: dict) -> dict[str, list[dict]]:
    arms = {}
    for r in records["runs"]:
        arms.setdefault(r["arm"], []).append(r)
    return arms


def analyse(records: dict) -> dict:
    rows = {}
    for arm, runs in by_arm(records).items():
        rows[arm] = []
        for r in runs:
            first, last = r["evals"][0], r["evals"][-1]
            gain = 100 * (last["greedy_acc"] - first["greedy_acc"])
            minutes = r["wall_seconds"] / 60
            rows[arm].append(
                dict(seed=r["seed"], start=first["greedy_acc"], end=last["greedy_acc"], gain=gain, minutes=minutes)
                | dict(steps=last["step"], rollouts=last["rollouts"], tokens=last["tokens"])
                | dict(holds=gain >= TARGET_GAIN and minutes <= MAX_MINUTES)
            )
    return {"rule": {"gain_points": TARGET_GAIN, "minutes": MAX_MINUTES}, "runs": rows}


def table_md(summary: dict, records: dict) -> str:
    lines = []
    for arm, rows in summary["runs"].items():
        lines += [
            f"### {arm}",
            "",
            "| seed | held-out greedy accuracy, step 0 -> end | gain | wall time | steps | rollouts | tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['seed']} | {r['start']:.3f} -> {r['end']:.3f} | {r['gain']:+.1f} | {r['minutes']:.1f} min "
                f"| {r['steps']} | {r['rollouts']} | {r['tokens']} |"
            )
        held = sum(r["holds"] for r in rows)
        lines += [
            "",
            f"{held} of {len(rows)} seeds gain at least +{TARGET_GAIN:.0f} points within {MAX_MINUTES:.0f} minutes.",
            "",
        ]
    lines += ["### Greedy answers of held-out questions, at step 0 and at the end", ""]
    for arm, runs in by_arm(records).items():
        for r in runs[:1]:
            lines += [
                f"{arm}, seed {r['seed']}:",
                "",
                "| step | question | answer | gold | score |",
                "|---|---|---|---|---|",
            ]
            for s in r["samples"]:
                question = s["prompt"].splitlines()[0]
                lines.append(
                    f"| {s['step']} | {question} | `{s['completion']!r}` | {s['answer']} | {s['reward']:.2f} |"
                )
            lines.append("")
    return "\n".join(lines)


def plot(records: dict, path: Path) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    arms = by_arm(records)
    colors = dict(zip(arms, ("tab:blue", "tab:orange", "tab:green")))
    for arm, runs in arms.items():
        for i, r in enumerate(runs):
            acc = [e["greedy_acc"] for e in r["evals"]]
            label = arm if i == 0 else None
            axes[0].plot([e["tokens"] / 1000 for e in r["evals"]], acc, "o-", color=colors[arm], label=label, ms=3)
            axes[1].plot([e["seconds"] / 60 for e in r["evals"]], acc, "o-", color=colors[arm], label=label, ms=3)
    report.label_axes(axes[0], xlabel="generated tokens (thousands)", ylabel="held-out greedy accuracy")
    report.label_axes(axes[1], xlabel="minutes generating and training (evaluations excluded)")
    axes[0].legend(loc="lower right")
    fig.suptitle("SmolLM2-135M-Instruct on one-digit sums (reasoning-gym), 2-core CPU, one line per seed")
    report.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--runs", type=Path, help="the folder of ARM/SEED/run folders (seed_table.py's)")
    source.add_argument("--records", type=Path, help="a records.json.xz this tool wrote")
    ap.add_argument("--report-dir", type=Path, required=True, help="where the report's files go")
    args = ap.parse_args(argv)
    if args.runs:
        records = collect(args.runs)
    else:
        records = runner.read_records(args.records, keys=("arm", "seed", "evals"), check=problem)
    summary = analyse(records)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    runner.write_records(args.report_dir / runner.RECORDS, records, "--report-dir")
    (args.report_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.report_dir / "table.md").write_text(table_md(summary, records) + "\n")
    plot(records, args.report_dir / "accuracy.png")
    print(table_md(summary, records))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
