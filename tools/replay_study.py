"""replay_study.py: the replay study (docs/study) and the buffer's rules against uniform sampling
(docs/study/variants): their grids, and their report (`sweep.py report`).

The report groups the finished runs by configuration over seeds (median and IQR), keeps per configuration the
variant (learning rate, delta_V) with the best median final greedy accuracy on the tune seeds, and measures the cost
to the on-policy GRPO configuration's accuracy (N = B = R) in generated tokens and in compute (report.compute) at the
mu measured on this machine and at the paper's.
"""

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from pathlib import Path

import numpy as np
import tyro
from studylib import fmt, report, runner
from studylib.report import PAPER_MU, bucket_order, compute, curve, evals, final, quartiles, save_figure


@dataclass
class Args(report.Args):
    """The table (table.md), summary.json, records.json.xz and figures of the finished runs in --out-dir."""

    tune_seeds: list[int] = field(default_factory=list)
    """seeds that chose a learning rate and are not reported (default: those `run` recorded in sweep.json)."""
    reference: str | None = None
    """configuration that savings are measured against (default: the on-policy GRPO one, N = B = R published
    every step)."""


# The grids (their format: sweep.py's GRIDS).
# --preset cpu: B = 128, G = 16, so R = 16 x prompts_per_step. On this machine mu ~ 0.8, where the
# paper's planner (alpha = rho = 0.1) wants N/R ~ 6, B/R ~ 2: N256-R64 (N/R = 4, B/R = 2) is near it.
# N512-R32 (N/R = 16, B/R = 4) is near its optimum for the paper's mu = 5.28 (14.3, 5.6); the
# paper's refinements (AsymRE, positive bias delta) matter most at large reuse, so they go there.
# lrs: a trial scan of on-policy GRPO at 5e-5, 1e-4, 2e-4 found 2e-4 worse on every seed.
LRS = [5e-5, 1e-4]
DEFAULT_GRID = (
    runner.CPU_AS_STUDIED,
    [
        dict(buffer_size=128, prompts_per_step=8, lr=LRS),  # on-policy GRPO: N = B = R = 128
        dict(buffer_size=256, prompts_per_step=4),  # N/R = 4, B/R = 2
        dict(buffer_size=512, prompts_per_step=2, lr=LRS),  # N/R = 16, B/R = 4
        dict(buffer_size=512, prompts_per_step=2, loss="asymre"),
        dict(buffer_size=512, prompts_per_step=2, positive_bias=0.2),
        dict(buffer_size=512, prompts_per_step=2, positive_bias=0.5),
    ],
)
SMOKE_GRID = (
    (
        "--preset cpu --sft-warmup-steps 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
        "--buffer-size 8 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 3 --eval-every 0"
    ).split(),
    [
        dict(buffer_size=8, prompts_per_step=2),  # on-policy: N = B = R = 8
        dict(buffer_size=16, prompts_per_step=1, lr=[1e-3, 3e-3]),  # N/R = 4, B/R = 2, two lrs
    ],
)
# --preset cpu-study: B = 64 (the paper's 60 in whole groups), G = 16, R = 16 x prompts_per_step. Measured
# mu ~ 1.0 there (HF generation, one thread per run), where the planner (alpha = rho = 0.1) puts the optimum
# at N/R = 6.7, B/R = 2.0: N = 224, R = 32; for the paper's mu = 5.28: N/R = 14.3, B/R = 5.6: N = 240,
# R = 16. Runs with less generated per step get more steps, so that every configuration can generate
# as many tokens as on-policy does, with evaluations at the same generated-token intervals.
STUDY_LRS = [1e-5, 3e-5, 1e-4]
N240 = dict(buffer_size=240, prompts_per_step=1, total_steps=800, eval_every=80)  # the optimum for the paper's mu
STUDY_GRID = (
    ["--preset", "cpu-study"],
    [
        dict(buffer_size=64, prompts_per_step=4, lr=STUDY_LRS),  # on-policy GRPO: N = B = R = 64
        dict(buffer_size=224, prompts_per_step=2, total_steps=400, eval_every=40, lr=STUDY_LRS),  # optimum, measured mu
        dict(**N240, lr=STUDY_LRS),
        # the paper's refinements at the better of the two buffers on the tune seeds (N = 240: median final greedy
        # accuracy 0.837 at lr 1e-5, against 0.825 for N = 224): AsymRE (delta_V scanned too) and positive bias 0.2
        dict(**N240, loss="asymre", lr=[1e-5, 3e-5], asymre_delta_v=[-0.05, -0.1]),
        dict(**N240, positive_bias=0.2, lr=STUDY_LRS),
    ],
)
# The buffer's rules on --preset cpu-study, each against the default (uniform sampling) at one schedule: the
# study's optimum for the measured mu, N = 224, R = 32, B = 64, at the lr that configuration picked there on the
# tune seeds (1e-5), for 400 steps. The queue is the no-buffer baseline: in this loop it trains on each step's
# B = 64 fresh rollouts once. At this size the grid shows what each rule does to the data a step trains on.
VARIANTS_GRID = (
    ("--preset cpu-study --buffer-size 224 --prompts-per-step 2 --total-steps 400 --eval-every 40 --lr 1e-5").split(),
    [
        dict(),  # uniform, the paper's
        dict(sampling="without-replacement"),
        dict(sampling="at-least-once"),
        dict(sampling="fresh-anchored"),
        dict(sampling="priority", priority_alpha=1.0),
        dict(sampling="priority", priority_alpha=1.0, priority_tau=4.0),  # FreshPER's age decay
        dict(max_age=4),
        dict(max_uses=2),
        dict(ratio_level="sequence"),
        dict(sampling="queue"),
    ],
)


def is_on_policy(cfg: dict) -> bool:
    R = cfg["prompts_per_step"] * cfg["group_size"]
    return cfg["buffer_size"] == cfg["batch_size"] == R and cfg.get("publish_every", 1) == 1


def variant_label(cfg: dict, variant: str) -> str:
    return f"lr {cfg['lr']:g}" + (f", delta_V {cfg['asymre_delta_v']:g}" if "-dv" in variant else "")


def pick_variants(runs: list[dict], tune_seeds: list[int] | None = None) -> dict[str, dict]:
    """Per configuration, the variant (learning rate, delta_V) with the best median final greedy
    accuracy over the tune seeds (all seeds when none; ties: pass@1, then the smaller lr)."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in runs:
        if not tune_seeds or r["seed"] in tune_seeds:
            groups.setdefault(r["config"], {}).setdefault(r["variant"], []).append(r)
    picks = {}
    for config, by_variant in groups.items():
        cfg, score = {v: rs[0]["cfg"] for v, rs in by_variant.items()}, {}
        for v, rs in by_variant.items():
            score[v] = [float(np.median(final(rs, f"eval/{k}"))) for k in ("greedy_acc", "pass@1")]
        order = sorted(
            by_variant, key=lambda v: (-score[v][0], -score[v][1], cfg[v]["lr"], abs(cfg[v].get("asymre_delta_v", 0)))
        )
        best = cfg[order[0]]
        choice = {
            "picked": best["lr"],
            "label": variant_label(best, order[0]),
            "asymre_delta_v": best.get("asymre_delta_v"),
        }
        choice["tuned_on"] = sorted({r["seed"] for rs in by_variant.values() for r in rs})
        choice["median_final_greedy_acc"] = {variant_label(cfg[v], v): score[v][0] for v in order}
        picks[config] = {"variant": order[0], "n_variants": len(by_variant), "choice": choice}
    return picks


AXES = ("tokens", "compute_measured_mu", "compute_paper_mu")
FRACS = {"target": 1.0, "90% of target": 0.9}  # the levels: fractions of the reference's final median accuracy
REPLICATES = 2000
SAVING_TARGET = 30.0  # percent of the reference's generated tokens, and of its compute at the paper's mu, decided


def analyse(data: dict, args: Args) -> dict:
    """Per configuration (the variant picked on the tune seeds, args.tune_seeds or those sweep.json records, reported
    on the others): final metrics over seeds, cost to the reference's accuracy, bootstrap intervals, accuracy at
    equal compute."""
    runs, tune_seeds = data["runs"], args.tune_seeds or data.get("tune_seeds", [])
    configs, lr_choice = {}, {}
    for config, p in pick_variants(runs, tune_seeds).items():
        kept = [
            r for r in runs if r["seed"] not in tune_seeds and (r["config"], r["variant"]) == (config, p["variant"])
        ]
        if kept:
            configs[config] = sorted(kept, key=lambda r: r["seed"])
        if kept and p["n_variants"] > 1:
            lr_choice[config] = p["choice"]
    if not configs:
        raise SystemExit(f"error: {report.source(args)} holds finished runs only of the tune seeds {tune_seeds}")
    reference = args.reference
    if reference is None:  # the on-policy GRPO configuration (plain FIFO)
        cands = [c for c, rs in configs.items() if is_on_policy(rs[0]["cfg"]) and rs[0]["cfg"]["loss"] == "grpo"]
        if not cands:
            raise SystemExit(f"error: no on-policy GRPO configuration among {', '.join(configs)}: give --reference")
        reference = min(cands, key=lambda c: (configs[c][0]["cfg"]["positive_bias"], c))
    elif reference not in configs:
        raise SystemExit(f"error: --reference {reference}: no finished runs (have: {', '.join(configs)})")
    target = float(np.median(final(configs[reference], "eval/greedy_acc")))
    mu = report.measured_mu(runs)
    axes = {axis: report.x_of(axis, {"compute_measured_mu": mu, "compute_paper_mu": PAPER_MU}) for axis in AXES}
    estimate = cost_estimate(configs, reference, axes)
    point = estimate({c: np.arange(len(rs)) for c, rs in configs.items()})
    rows = {}
    for config, rs in configs.items():
        cfg, last = rs[0]["cfg"], [r["records"][-1] for r in rs]
        stale = sum((staleness_counts(r) for r in rs), Counter())
        row = rows[config] = {
            "lr": cfg["lr"],
            "seeds": [r["seed"] for r in rs],
            "steps": cfg["total_steps"],
            "N": cfg["buffer_size"],
            "B": cfg["batch_size"],
            "R": cfg["prompts_per_step"] * cfg["group_size"],
            "greedy_acc": quartiles(final(rs, "eval/greedy_acc")),
            "pass@1": quartiles(final(rs, "eval/pass@1")),
            "k": cfg["pass_k"],
            "pass@k": quartiles(final(rs, f"eval/pass@{cfg['pass_k']}")),
            "generated_tokens": float(np.median([rec.get("total_generated_tokens", 0) for rec in last])),
            "mu": float(np.median([rec["mu"] for rec in last])) if all("mu" in rec for rec in last) else None,
            "replay_ratio": float(np.mean([rec.get("replay_ratio", 0) for rec in last])),
            "staleness": sum(s * n for s, n in stale.items()) / max(1, sum(stale.values())),
            "by_staleness": staleness_buckets(rs),
        }
        for what, suffix in (("cost", "to_target"), ("saving", "saving_pct")):  # None: never reached, or no saving
            for axis in axes:
                value = point[config][what][axis]["target"]
                row[f"{axis}_{suffix}"] = value if math.isfinite(value) else None
    order = sorted(configs, key=lambda c: (c != reference, rows[c]["N"], -rows[c]["R"], c))
    out = {
        "reference": reference,
        "target_greedy_acc": target,
        "mu_measured": mu,
        "paper_mu": PAPER_MU,
        "lr_choice": lr_choice,
        "configs": {c: rows[c] for c in order},
        "tune_seeds": sorted(tune_seeds),
        "_runs": {c: configs[c] for c in order},
    }
    draw = {c: len(rs) for c, rs in configs.items()}  # each configuration's seeds resampled apart
    intervals, _ = report.bootstrap(
        estimate, lambda rng: {c: rng.integers(0, n, n) for c, n in draw.items()}, REPLICATES, ps=(5, 50, 95)
    )
    out["bootstrap"] = {"replicates": REPLICATES, "intervals": intervals}
    out["decision"] = decide(intervals, reference, SAVING_TARGET)
    out["saving_target"] = SAVING_TARGET
    out["per_seed"] = {c: [per_seed(r, target, axes) for r in configs[c]] for c in order}
    return out


def cost_estimate(configs: dict, reference: str, axes: dict):
    """The estimate on a resample of each configuration's seeds (draw: {config: the positions of its seeds}): per
    configuration the cost (median x over the resampled seeds) to reach the reference's final median accuracy and 90%
    of it, recomputed from the reference's resample; the saving against the reference; and the median accuracy and
    pass@k at the last evaluation within the reference's final compute (equal compute), on the compute axes."""
    arrays = {}  # per configuration: its runs' accuracy, pass@k and x values at the evaluations all share
    for c, rs in configs.items():
        k = f"eval/pass@{rs[0]['cfg']['pass_k']}"
        columns = {"acc": lambda e: e["eval/greedy_acc"], "pass@k": lambda e, k=k: e.get(k, np.nan), **axes}
        arrays[c] = report.at_shared_steps(rs, columns)

    def estimate(draw: dict) -> dict:
        drawn = {c: {name: v[draw[c]] for name, v in a.items()} for c, a in arrays.items()}
        ref, out = drawn[reference], {}
        level = float(np.median(ref["acc"][:, -1]))
        x = {c: {axis: np.median(a[axis], axis=0) for axis in axes} for c, a in drawn.items()}
        cost = {c: report.costs(x[c], np.median(a["acc"], axis=0), FRACS, level) for c, a in drawn.items()}
        for c, a in drawn.items():
            out[c] = {"cost": cost[c], "saving": report.savings(cost[c], cost[reference]), "at_equal": {}}
            for axis in AXES[1:]:
                within = np.nonzero(x[c][axis] <= float(np.median(ref[axis][:, -1])) + 1e-6)[0]
                pick = {w: float(np.median(a[w][:, within[-1]])) if len(within) else np.nan for w in ("acc", "pass@k")}
                out[c]["at_equal"][axis] = pick
        return out

    return estimate


def decide(intervals: dict, reference: str, saving_target: float) -> dict:
    """Per configuration, each axis's verdict from the saving's interval (report.interval_verdict), and both: met
    when both are, not met when either is not."""
    decision = {}
    for c, iv in intervals.items():
        axes = ("tokens", "compute_paper_mu")
        verdicts = [
            report.interval_verdict(lo, hi, saving_target) for lo, _, hi in (iv["saving"][a]["target"] for a in axes)
        ]
        both = "met" if verdicts == ["met", "met"] else "not met" if "not met" in verdicts else "not resolvable"
        decision[c] = {**dict(zip(axes, verdicts)), "both": both}
    decision.pop(reference)
    return decision


def staleness_buckets(rs: list[dict]) -> dict | None:
    """The metrics by staleness over every step and seed of a configuration: per bucket, its share of the trained
    rollouts and, token-weighted, the clip fraction, mean |log ratio| and ESS per token. None: none logged."""
    by = report.gather(rec.get("by_staleness", {}) for r in rs for rec in r["records"])
    rollouts, out = sum(sum(b["rollouts"]) for b in by.values()), {}
    for label, b in sorted(by.items(), key=lambda kv: bucket_order(kv[0])):
        tokens = sum(b["tokens"])
        weighted = {k: sum(v * n for v, n in zip(b[k], b["tokens"])) / tokens for k in ("clip_frac", "abs_log_ratio")}
        out[label] = {"share": sum(b["rollouts"]) / rollouts, **weighted, "ess_per_token": sum(b["ess"]) / tokens}
    return out or None


def staleness_counts(run: dict) -> Counter:
    """How many rollouts a run trained on at each staleness, over its steps."""
    return sum(
        (Counter({int(k): v for k, v in rec.get("staleness_hist", {}).items()}) for rec in run["records"]), Counter()
    )


def per_seed(run: dict, target: float, axes: dict) -> dict:
    """One run's numbers: the warm start, the final accuracies, and its cost to the target on each axis."""
    first, last = run["records"][0], evals(run)[-1]
    reach = next((r for r in evals(run) if r["eval/greedy_acc"] >= target - 1e-9), None)
    return {
        "seed": run["seed"],
        "name": run["name"],
        "warmstart_reached": first.get("warmstart_reached"),
        "warmstart_pass@k": first.get("warmstart_pass@k"),
        "greedy_acc_start": first.get("eval/greedy_acc"),
        "greedy_acc_final": last["eval/greedy_acc"],
        "pass@1_final": last["eval/pass@1"],
        **{f"{axis}_to_target": (x(reach) if reach else None) for axis, x in axes.items()},
    }


def table_md(s: dict) -> str:
    """The study's table.md from its summary (summary.json's content)."""

    def bootstrap(q, one) -> str:  # a [5th, 50th, 95th] percentile triple as 'median [5th, 95th]'
        return "—" if q[1] is None else fmt.interval(q[1], q, one)

    ref, iv = s["reference"], s["bootstrap"]["intervals"]
    target, target_pct = fmt.acc(s["target_greedy_acc"]), f"{s['saving_target']:g}%"
    rows = []
    for c, r in s["configs"].items():
        lr = f"{r['lr']:g}" + ("*" if c in s["lr_choice"] else "")
        accs = [fmt.quartiles(r[k]) for k in ("greedy_acc", "pass@1")] + [f"pass@{r['k']} {fmt.quartiles(r['pass@k'])}"]
        cells = [c, lr, len(r["seeds"]), r["steps"], *accs, fmt.amount(r["generated_tokens"]), fmt.mu(r["mu"])]
        cells += [f"{r['replay_ratio']:.2f}", f"{r['staleness']:.2f}"]
        for axis in AXES:
            cells += [fmt.amount(r[f"{axis}_to_target"]), fmt.saving(r[f"{axis}_saving_pct"], digits=1)]
        rows.append(cells)
    head = ["config", "lr", "seeds", "steps", "greedy acc", "pass@1", "pass@k", "gen. tokens", "mu (meas.)"]
    head += ["replay ratio", "staleness", "tokens to target", "saving", "compute (meas.) to target", "saving"]
    costs = []
    for c in s["configs"]:
        for f in ("target", "90% of target"):
            cells = [c, f]
            for axis in AXES:
                saving = "—" if c == ref else bootstrap(iv[c]["saving"][axis][f], fmt.saving)
                cells += [bootstrap(iv[c]["cost"][axis][f], fmt.cost), saving]
            costs.append(cells)
    equal = [
        [c, *(bootstrap(iv[c]["at_equal"][a][w], fmt.acc) for a in AXES[1:] for w in ("acc", "pass@k"))]
        for c in s["configs"]
    ]
    cost_head = ["gen. tokens", "saving", "compute (meas. mu)", "saving", "compute (paper mu)", "saving"]
    equal_head = ["greedy acc (meas. mu)", "pass@k (meas. mu)", "greedy acc (paper mu)", "pass@k (paper mu)"]
    seeds = [
        [c, r["seed"], r["warmstart_reached"]]
        + [fmt.acc(r[k]) for k in ("warmstart_pass@k", "greedy_acc_start", "greedy_acc_final")]
        for c, runs in s["per_seed"].items()
        for r in runs
    ]
    blocks = [
        "# Replay-GRPO study",
        [
            f"Final held-out accuracy as median [IQR] over seeds (greedy decoding; pass@1 at temperature 0.1, "
            f"top-p 0.95; pass@k at temperature 1). Reference: **{ref}**, whose final median greedy accuracy "
            f"{target} is the target: "
            "'to target' is the generated tokens / compute at the first evaluation where a configuration's "
            "median greedy accuracy reaches it (— never), 'saving' is 1 − ours / reference's.",
            f"Compute units: training on a rollout costs 1, generating one costs mu; compute = trained rollouts "
            f"+ mu × generated rollouts. 'meas.' uses mu = {fmt.mu(s['mu_measured'])} (median of the runs' measured "
            f"mu on this machine), 'paper' uses mu = {s['paper_mu']:g}. Replay ratio: trained / generated rollouts; "
            "staleness: optimizer steps between a rollout's generation and its use, averaged over every use.",
        ],
        fmt.table(head + ["compute (paper) to target", "saving"], rows),
    ]
    if s["configs"][ref]["tokens_to_target"] == 0:
        blocks.append(
            f"Note: {ref}'s median accuracy is at the target already at step 0 (before any RL), "
            "so the savings are undefined: train longer or with a weaker warm start."
        )
    blocks += [
        f"## Cost to reach {ref}'s final median accuracy ({target}) and 90% of it",
        f"Median and bootstrap 90% interval ({s['bootstrap']['replicates']} resamples of the seeds of each "
        "configuration; the target recomputed from each resample of the reference). 'never': not reached "
        "within the run. Saving = 1 − ours / reference's.",
        fmt.table(["config", "reaches", *cost_head], costs),
        f"## Accuracy at equal compute (the compute {ref} used in its whole run)",
        "Median greedy accuracy and pass@k at the last evaluation within that compute, bootstrap 90% interval.",
        fmt.table(["config", *equal_head], equal),
        f"## Decision: >= {target_pct} fewer generated tokens and >= {target_pct} less "
        f"compute at the paper's mu, to {ref}'s final median accuracy",
        [  # the rule, a blank line, and a verdict per configuration
            "met: the whole 90% interval of the saving is at or above the target; not met: the whole interval is "
            "below it; not resolvable: the interval straddles it (or the target was not reached).",
            "",
            *(
                f"- {c}: tokens {d['tokens']}, compute at paper mu {d['compute_paper_mu']}: **{d['both']}**"
                for c, d in s["decision"].items()
            ),
        ],
    ]
    if any(r.get("by_staleness") for r in s["configs"].values()):
        rows = [
            [c, label, f"{b['share']:.3f}", *(f"{b[k]:.4f}" for k in ("clip_frac", "abs_log_ratio", "ess_per_token"))]
            for c, r in s["configs"].items()
            for label, b in (r.get("by_staleness") or {}).items()
        ]
        head = ["config", "staleness", "share of rollouts", "clip fraction", "mean abs log ratio", "ESS per token"]
        blocks += [
            "## What a step trains on, by staleness",
            "Over every step and seed: the share of trained rollouts in each staleness bucket (optimizer steps "
            "since generation) and, weighted by tokens, the clip fraction, the mean |log ratio| to the "
            "behaviour policy and the effective sample size of the token ratios per token ((sum w)^2 / sum "
            "w^2 over the tokens: 1 when all ratios are equal).",
            fmt.table(head, rows),
        ]
    head = ["config", "seed", "warm start reached", "pass@k after it", "greedy start", "greedy final"]
    blocks += ["## Seeds", fmt.table(head, seeds)]
    if s["lr_choice"]:
        tuned = s.get("tune_seeds")
        chosen = (
            f"on seeds {', '.join(map(str, tuned))}, which are not reported:"
            if tuned
            else "on the same seeds it is reported on:"
        )
        picked = []
        for c, note in ((c, s["lr_choice"][c]) for c in s["configs"] if c in s["lr_choice"]):
            tried = ", ".join(f"{label}: {acc:.3f}" for label, acc in note["median_final_greedy_acc"].items())
            picked.append(f"- {c}: {note['label']} picked (median final greedy accuracy {tried})")
        blocks += [
            "## Learning rate (*)",
            "Configurations run with several learning rates (and delta_V) keep the one with the best median "
            f"final greedy accuracy (ties: pass@1, then the smaller lr), chosen {chosen}",
            picked,
        ]
    return fmt.markdown(blocks)


def plot(s: dict, out_dir: Path) -> list[Path]:
    """The figures: median over seeds, shaded IQR, one line per configuration (its best lr); the histograms of
    staleness and replay ratio; the metrics by staleness where the runs logged them."""
    from matplotlib.ticker import MaxNLocator

    plt = report.pyplot()
    runs, ref, target, written = s["_runs"], s["reference"], s["target_greedy_acc"], []
    palette = iter(plt.get_cmap("tab10").colors)
    color = {c: "black" if c == ref else next(palette) for c in runs}
    label = {c: c + (f" (lr {s['configs'][c]['lr']:g})" if c in s["lr_choice"] else "") for c in runs}
    style = {c: {"color": color[c], "lw": 2.2 if c == ref else 1.4, "label": label[c]} for c in runs}

    def save(fig, name, legend=None):
        if legend is not None:
            legend.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
        written.append(save_figure(fig, out_dir / name, bbox_inches="tight"))

    steps, tokens = itemgetter("step"), report.x_of("tokens", {})
    acc, by_steps, G = "held-out greedy accuracy", "gradient steps", "eval/greedy_acc"
    mus = {"measured on this machine": s["mu_measured"], "the paper's": s["paper_mu"]}
    computes = [(partial(compute, mu=mu), f"mu = {mu:.2f} ({what})") for what, mu in mus.items()]
    figures = {  # per figure, each panel's y (a record's key; None: pass@k), x, x label, y label and title
        "accuracy_vs_steps.png": [(G, steps, by_steps, acc, ""), (None, steps, by_steps, PASS_K, "")],
        "accuracy_vs_tokens.png": [(G, tokens, "generated tokens", acc, "Held-out accuracy vs generated tokens")],
        "accuracy_vs_compute.png": [(G, x, "compute = trained + mu x generated rollouts", acc, t) for x, t in computes],
        "entropy.png": [("entropy", steps, by_steps, "policy entropy on the batch (nats/token)", "Training entropy")],
    }
    for name, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(11, 4) if len(panels) > 1 else (7, 4), squeeze=False)
        for ax, (y, x, xlabel, ylabel, panel_title) in zip(axes[0], panels):
            for c, rs in runs.items():
                key = y or f"eval/pass@{s['configs'][c]['k']}"
                cv = curve(rs, key, x, eval_only=key.startswith("eval/"))
                ax.plot(cv["x"], cv["median"], **style[c])
                ax.fill_between(cv["x"], cv["q25"], cv["q75"], color=color[c], alpha=0.15, lw=0)
            if y == "eval/greedy_acc":
                ax.axhline(target, color="grey", ls=":", lw=1, label=f"target: {ref} final median")
            report.label_axes(ax, xlabel=xlabel, ylabel=ylabel, title=panel_title)
        if name in TITLES:
            fig.suptitle(TITLES[name])
        save(fig, name, legend=axes[0, -1])

    def replays(r):
        return Counter({int(u): n for u, n in r["records"][-1].get("replay_hist", {}).items()})

    n = len(runs)
    ncol, nrow = min(4, n), math.ceil(n / min(4, n))
    for name, xlabel, counts_of in [
        ("staleness_hist.png", "staleness (optimizer steps)", staleness_counts),
        ("replay_ratio_hist.png", "uses", replays),
    ]:
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.3 * ncol, 2.7 * nrow), squeeze=False, sharex=True, sharey=True)
        for ax, (c, rs) in zip(axes.flat, runs.items()):
            counts = sum((counts_of(r) for r in rs), Counter())
            total, xs = sum(counts.values()) or 1, sorted(counts)
            ax.bar(xs, [counts[x] / total for x in xs], width=0.85, color=color[c])
            ax.set_title(f"{label[c]}\nmean {sum(x * counts[x] for x in xs) / total:.2f}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelbottom=True)
        for ax in axes[:, 0]:
            ax.set_ylabel("fraction")
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(TITLES[name])
        save(fig, name)

    by_config = {c: s["configs"][c]["by_staleness"] for c in runs if s["configs"][c].get("by_staleness")}
    if by_config:  # runs that logged the metrics by staleness
        buckets = sorted({b for d in by_config.values() for b in d}, key=bucket_order)
        fig, axes = plt.subplots(1, len(BUCKET_PANELS), figsize=(4 * len(BUCKET_PANELS), 3.6))
        for ax, (key, ylabel) in zip(axes, BUCKET_PANELS):
            for c, d in by_config.items():
                xs = [i for i, b in enumerate(buckets) if b in d]
                ax.plot(xs, [d[buckets[i]][key] for i in xs], marker="o", **style[c])
            ax.set_xticks(range(len(buckets)), buckets)
            report.label_axes(ax, xlabel="staleness (optimizer steps)", ylabel=ylabel)
        fig.suptitle("What a step trains on, by staleness (all steps and seeds)")
        save(fig, "staleness_metrics.png", legend=axes[-1])
    return written


PASS_K = "held-out pass@k (k samples, temperature 1)"
TITLES = {
    "accuracy_vs_steps.png": "Held-out accuracy vs gradient steps (median, IQR over seeds)",
    "accuracy_vs_compute.png": "Held-out accuracy vs compute (training a rollout = 1 unit, generating one = mu units)",
    "staleness_hist.png": "Staleness of each use (steps since generation), all steps and seeds",
    "replay_ratio_hist.png": "Replay ratio per rollout: times each evicted rollout was trained on",
}
BUCKET_PANELS = [
    ("share", "share of trained rollouts"),
    ("clip_frac", "clip fraction"),
    ("abs_log_ratio", "mean |log ratio| per token"),
    ("ess_per_token", "ESS per token"),
]


# What the report reads of a run, records.json.xz keeps: records' keys (and eval/pass@k at the run's k) and settings
KEYS = (
    *runner.RECORD_KEYS,
    "eval/pass@1",
    "replay_ratio",
    "staleness_hist",
    "replay_hist",
    "by_staleness",
    "warmstart_reached",
    "warmstart_pass@k",
)
SETTINGS = (*runner.CONFIG_KEYS, "publish_every", "asymre_delta_v")


def compact(runs: list[dict], tune_seeds: list[int]) -> dict:
    """records.json.xz's content: the tune seeds, and each run cut to what the report reads (runner.compact_run)."""
    keys = [KEYS + (f"eval/pass@{r['cfg']['pass_k']}",) for r in runs]
    return {"tune_seeds": tune_seeds, "runs": [runner.compact_run(r, k, SETTINGS) for r, k in zip(runs, keys)]}


def write(args: Args) -> dict:
    def records(runs, out):
        return compact(runs, args.tune_seeds or runner.tune_seeds(out))

    return report.study_report(args, "study", analyse, private="_runs", table_md=table_md, plot=plot, compact=records)


def main(argv: list[str] | None = None) -> dict:
    return write(tyro.cli(Args, args=argv))


if __name__ == "__main__":
    runner.cli(main)
