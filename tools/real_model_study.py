"""real_model_study.py: the report of the cpu-smollm2 runs (docs/study/real_model): per seed, held-out greedy
accuracy at step 0 and at the end, wall time, steps, rollouts and tokens generated, greedy answers before and after;
the figure of accuracy against generated tokens and against the seconds spent generating and training.

    python tools/seed_table.py --preset cpu-smollm2 --seeds 7 8 9 --out-dir runs/real-lr1e5/on-policy   # twice, at once
    python tools/seed_table.py --preset cpu-smollm2 --seeds 7 8 9 --out-dir runs/real-lr1e5/replay \
        --extra --prompts-per-step 1 --buffer-size 64 --total-steps 80 --eval-every 20
    python tools/real_model_study.py --runs runs/real-lr1e5 --report-dir docs/study/real_model/lr1e5
    python tools/real_model_study.py --records docs/study/real_model/lr1e5/records.json.xz --report-dir /tmp/again

--runs reads every ARM/SEED/run folder under it (seed_table.py's layout, its wall times in ARM/seed_table.json)
and writes records.json.xz (what the report needs of each run), table.md, summary.json and accuracy.png;
--records computes the same files again from those records alone. A run records its greedy accuracy as a mean
score only, so --runs also answers every held-out question greedily (HF generate, fp32) with the base model and
with the run's final checkpoint, and keeps the answers and their scores: the shares fully right and partly
credited (the data set's own score, whatever credit the run trained on) come from them. With an on-policy and a
replay arm, the report compares them as the study's rule says (compare).
"""

import dataclasses
import functools
import json
from pathlib import Path

from studylib import report, runner

TARGET_GAIN, MAX_MINUTES = 15.0, 60.0  # the preset's rule: each seed gains this many points within this wall time
SAMPLES = 6  # greedy answers shown for each run, at step 0 and at the end
SAME_END = 1.05  # the arms' ends are compared when their rollouts generated differ by at most 5%


@functools.cache  # every seed of a setting starts from the same weights and questions: answered once
def held_out_answers(config: str, weights: str) -> list[dict]:
    """Greedy answers of every held-out question (HF generate, fp32) of a run's settings (`config`: its config.json
    as JSON, less the seed and the folder: the held-out questions and shots do not depend on them) by the weights at
    `weights` (--model, or a run's checkpoint folder), and their scores: a run records the mean only, and partial
    credit hides in it."""
    import torch

    import replay_grpo as rg
    from infra import generation, models, tasks

    cfg = json.loads(config) | {"rg_credit": "partial"}  # the data set's own score, whichever the run was rewarded by
    args = rg.Args(**{f.name: cfg[f.name] for f in dataclasses.fields(rg.Args) if f.name in cfg})
    task = tasks.make_task(args)
    model, tok = models.load_pretrained(weights, torch.float32)
    prompts = [models.render_prompt(tok, ex.prompt, task.shots) for ex in task.eval]
    with torch.no_grad():
        groups = generation.HFGenerator(model, tok).generate(prompts, 1, args.max_new_tokens, 0.0, logprobs=False)
    texts = [tok.decode(g[0].completion_ids, skip_special_tokens=True) for g in groups]
    verifier = rg.VERIFIERS[task.verifier]
    return [
        {"question": ex.prompt.splitlines()[0], "gold": json.loads(ex.answer)["answer"], "completion": text}
        | {"score": tasks.score(verifier, text, ex.answer)[0]}
        for ex, text in zip(task.eval, texts)
    ]


def compact(run_dir: Path, arm: str, seed: int, seconds: float) -> dict:
    """What the report needs of one run: its evaluations with the tokens, rollouts and seconds (generating and
    training) so far, its settings, and the greedy answers of every held-out question at step 0 and at the end."""
    records = runner.read_metrics(run_dir / "metrics.jsonl")
    cfg = runner.read_json(run_dir / "config.json")
    evals, tokens, rollouts, busy = [], 0, 0, 0.0
    for r in records:
        tokens, rollouts = r.get("total_generated_tokens", tokens), r.get("generated_rollouts", rollouts)  # totals
        busy += r.get("gen_seconds", 0.0) + r.get("train_seconds", 0.0)
        if "eval/greedy_acc" in r:
            row = {k.removeprefix("eval/"): r[k] for k in ("eval/greedy_acc", "eval/pass@1", "eval/acc_t1")}
            evals.append({"step": r["step"], "tokens": tokens, "rollouts": rollouts, "seconds": busy, **row})
    keys = ("prompts_per_step", "group_size", "batch_size", "buffer_size", "total_steps", "lr", "rg_config")
    config = {k: cfg[k] for k in keys} | {"rg_credit": cfg.get("rg_credit", "partial")}  # older runs: partial
    setting = json.dumps({k: v for k, v in cfg.items() if k not in ("seed", "out_dir", "run_name")}, sort_keys=True)
    last = str(run_dir / "checkpoint")
    answers = {"first": held_out_answers(setting, cfg["model"]), "last": held_out_answers(setting, last)}
    return {"arm": arm, "seed": seed, "wall_seconds": seconds, "config": config, "evals": evals, "answers": answers}


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
    answers = run.get("answers")
    if not isinstance(answers, dict) or not all(
        isinstance(answers.get(k), list) and answers[k] for k in ("first", "last")
    ):
        return "no held-out answers at step 0 and at the end"
    if not all(isinstance(a, dict) and isinstance(a.get("score"), (int, float)) for k in answers for a in answers[k]):
        return "a held-out answer without a score"
    if not isinstance(run.get("wall_seconds"), (int, float)):
        return "no wall time"
    return None


def by_arm(records: dict) -> dict[str, list[dict]]:
    arms = {}
    for r in records["runs"]:
        arms.setdefault(r["arm"], []).append(r)
    return arms


def shares(answers: list[dict]) -> dict:
    """The mean score, the share fully right and the share given partial credit (an answer holding the gold and
    more, which the data set's default scorer credits len(gold) / len(answer))."""
    n = len(answers)
    return {
        "mean": sum(a["score"] for a in answers) / n,
        "right": sum(a["score"] >= 1 for a in answers) / n,
        "partial": sum(0 < a["score"] < 1 for a in answers) / n,
    }


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
                | {f"hf_{k}": shares(r["answers"][k]) for k in ("first", "last")}
            )
    samples = [  # each run's first held-out answers, at step 0 and at the end
        {"arm": r["arm"], "seed": r["seed"], "pairs": list(zip(r["answers"]["first"], r["answers"]["last"]))[:SAMPLES]}
        for r in records["runs"]
    ]
    out = {"real_model": {"gain_points": TARGET_GAIN, "minutes": MAX_MINUTES}, "runs": rows, "samples": samples}
    arms = by_arm(records)
    return out | (
        {"comparison": compare(arms["on-policy"], arms["replay"])} if {"on-policy", "replay"} <= set(arms) else {}
    )


def accuracy_at(evals: list[dict], tokens: float) -> float:
    """Greedy accuracy at `tokens` generated, linear between the evaluations around it (a run that ended before
    `tokens` is read at its end)."""
    for a, b in zip(evals, evals[1:]):
        if a["tokens"] <= tokens <= b["tokens"]:
            w = (tokens - a["tokens"]) / (b["tokens"] - a["tokens"]) if b["tokens"] > a["tokens"] else 1.0
            return a["greedy_acc"] + w * (b["greedy_acc"] - a["greedy_acc"])
    return evals[-1]["greedy_acc"]


def verdict(on: list[float], replay: list[float]) -> str:
    """An arm is better only when every one of its seeds beats every one of the other's (3 against 3: p = 1/20)."""
    return "replay" if min(replay) > max(on) else "on-policy" if min(on) > max(replay) else "undecided"


def compare(on: list[dict], replay: list[dict]) -> dict:
    """The rule's comparison: accuracy at the generation budget every run reached (the fewest tokens generated at any
    run's last evaluation, either arm), and at the end where the arms ended on the same generation (within SAME_END
    of rollouts: replay's first batch takes a few more rollouts to fill)."""
    arms = {"on-policy": on, "replay": replay}
    budget = min(r["evals"][-1]["tokens"] for r in on + replay)
    at = {arm: [accuracy_at(r["evals"], budget) for r in runs] for arm, runs in arms.items()}
    out = dict(tokens=budget, at_tokens=at, better_at_tokens=verdict(*at.values()))
    ends = [r["evals"][-1]["rollouts"] for r in on + replay]
    if max(ends) <= SAME_END * min(ends):
        end = {arm: [r["evals"][-1]["greedy_acc"] for r in runs] for arm, runs in arms.items()}
        out |= dict(at_end=end, better_at_end=verdict(*end.values()))
    return out


def table_md(summary: dict) -> str:
    lines = []
    for arm, rows in summary["runs"].items():
        lines += [
            f"### {arm}",
            "",
            "| seed | greedy accuracy (mean score), step 0 -> end | gain | fully right | partly credited "
            "| wall time | steps | rollouts | tokens |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            a, b = r["hf_first"], r["hf_last"]
            lines.append(
                f"| {r['seed']} | {r['start']:.3f} -> {r['end']:.3f} | {r['gain']:+.1f} "
                f"| {a['right']:.2f} -> {b['right']:.2f} | {a['partial']:.2f} -> {b['partial']:.2f} "
                f"| {r['minutes']:.1f} min | {r['steps']} | {r['rollouts']} | {r['tokens']} |"
            )
        held = sum(r["holds"] for r in rows)
        rule = f"{held} of {len(rows)} seeds gain at least +{TARGET_GAIN:.0f} points within {MAX_MINUTES:.0f} minutes."
        lines += ["", rule, ""]
    if c := summary.get("comparison"):
        lines += [
            f"### On-policy against replay (seeds {', '.join(str(r['seed']) for r in summary['runs']['replay'])})",
            "",
        ]
        header = "| held-out greedy accuracy | on-policy, per seed | replay, per seed "
        lines += [header + "| better (each of its seeds beats each of the other's) |", "|---|---|---|---|"]
        for name, key in ((f"at {c['tokens']} generated tokens", "at_tokens"), ("at the end", "at_end")):
            if key in c:
                on, rp = (", ".join(f"{a:.3f}" for a in c[key][arm]) for arm in ("on-policy", "replay"))
                lines.append(f"| {name} | {on} | {rp} | {c['better_' + key]} |")
        if "at_end" not in c:
            lines.append("\nThe arms ended on different generation budgets: their ends are not compared.")
        lines.append("")
    lines += ["### Greedy answers of held-out questions, at step 0 and at the end", ""]
    for shown in summary["samples"]:
        lines += [f"{shown['arm']}, seed {shown['seed']}:", "", "| question | gold | step 0 | score | end | score |"]
        lines.append("|---|---|---|---|---|---|")
        for a, b in shown["pairs"]:
            lines.append(
                f"| {a['question']} | {a['gold']} | `{a['completion']!r}` | {a['score']:.2f} "
                f"| `{b['completion']!r}` | {b['score']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


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
    report.label_axes(axes[0], xlabel="generated tokens (thousands)", ylabel="held-out greedy accuracy (mean score)")
    report.label_axes(axes[1], xlabel="minutes generating and training (evaluations excluded)")
    axes[0].legend(loc="center right")
    fig.suptitle("SmolLM2-135M-Instruct on one-digit sums (reasoning-gym), 2-core CPU, one line per seed")
    report.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = runner.seed_study_parser(__doc__, "ARM").parse_args(argv)
    records = runner.runs_or_records(args.runs, args.records, collect=collect, check=problem)
    summary = analyse(records)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    runner.write_records(args.report_dir / runner.RECORDS, records, "--report-dir")
    (args.report_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary = json.loads(json.dumps(summary))  # as a reader of summary.json has it (tuples as lists)
    (args.report_dir / "table.md").write_text(table_md(summary))
    plot(records, args.report_dir / "accuracy.png")
    print(table_md(summary))
    return summary


if __name__ == "__main__":
    runner.cli(main)
