"""sweep.py: run a grid of replay-GRPO configurations x seeds, then tabulate and plot the study.

    python sweep.py run --out-dir runs/study --seeds 0 1 2            # the default grid, resumable
    python sweep.py run --out-dir runs/smoke --grid smoke --seeds 0 1 # 2 tiny configs (seconds)
    python sweep.py run --out-dir runs/study --seeds 0 --extra --total-steps 50 --eval-every 10
    python sweep.py report --out-dir runs/study                       # table.md, summary.json, PNGs

Every run is `replay_grpo.main([...])`, in this process (or one subprocess each with
--subprocess), named after its configuration: onpolicy-s0, N512-R32-grpo-s0, N512-R32-asymre-s0,
N512-R32-grpo-d0.2-s0, N512-R32-grpo-lr5e-05-s0 (when the grid entry tries several lrs), ...
`run` skips finished runs (checkpoint at total_steps), continues interrupted ones from their
checkpoint (--resume) and deletes and restarts ones that died before their first checkpoint.

`report` reads every finished run under --out-dir, groups runs by configuration over seeds
(median and IQR), keeps per configuration the learning rate with the best median final greedy
accuracy, and measures savings against the on-policy GRPO configuration (N = B = R).
Compute, in the paper's normalisation: training on one rollout costs 1 unit and generating one
costs mu units, so compute after t steps = trained_rollouts + mu * generated_rollouts
(= t * B * (1 + mu * R / B) for a fixed schedule; on-policy costs B(1 + mu) per update).
It is reported twice: with the mu measured on this machine (median of the runs' logged "mu")
and with the paper's mu = 5.28 (Qwen2.5-7B).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

TRAINER = Path(__file__).resolve().parent / "replay_grpo.py"


@dataclass
class Args:
    """Run a grid of replay-GRPO configurations x seeds (`run`), or tabulate and plot it (`report`)."""

    mode: tyro.conf.Positional[Literal["run", "report"]]
    """run: train every (configuration, lr, seed) not finished yet; report: table and figures."""
    out_dir: str = "runs/study"
    """folder holding the run folders; the report's table.md, summary.json and PNGs go here too."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """run: seeds of every configuration (the paper reports median and IQR over >= 4)."""
    grid: Literal["default", "smoke"] = "default"
    """run: which grid of GRIDS below (default: the study, for --preset cpu; smoke: 2 tiny configs)."""
    only: list[str] = field(default_factory=list)
    """run: only configurations whose name contains one of these strings (none given: all)."""
    subprocess: bool = False
    """run: start each run as `python replay_grpo.py ...` instead of calling it in this process
    (frees all memory between runs; worth it on GPU)."""
    reference: str | None = None
    """report: configuration that savings are measured against (default: the on-policy GRPO one,
    N = B = R published every step)."""
    paper_mu: float = 5.28
    """report: the paper's generation/training cost ratio, for the second compute axis."""
    extra: list[str] = field(default_factory=list)
    """run: trainer flags for every run, e.g. --extra --total-steps 50 --lr 1e-4. Must come last:
    everything after --extra goes to replay_grpo.py verbatim. Flags set by a grid entry win."""


# ----------------------------------------------------------------------------------------------
# Grids: a list of configurations, each a dict of replay_grpo flags (Args field names). "lr" may
# be a list: each lr is run and the report keeps the best per configuration. "name" overrides
# the derived run name. A grid is (flags for every run, configurations).
# ----------------------------------------------------------------------------------------------

# --preset cpu: B = 128, G = 16, so R = 16 x prompts_per_step. On this machine mu ~ 0.8, where the
# paper's planner (alpha = rho = 0.1) wants N/R ~ 6, B/R ~ 2: N256-R64 (N/R = 4, B/R = 2) is near it.
# N512-R32 (N/R = 16, B/R = 4) is near its optimum for the paper's mu = 5.28 (14.3, 5.6); the
# paper's refinements (AsymRE, positive bias delta) matter most at large reuse, so they go there.
# lrs: a trial scan of on-policy GRPO at 5e-5, 1e-4, 2e-4 found 2e-4 worse on every seed.
LRS = [5e-5, 1e-4]
DEFAULT_GRID = ["--preset", "cpu", "--no-progress"], [
    dict(buffer_size=128, prompts_per_step=8, lr=LRS),  # on-policy GRPO: N = B = R = 128
    dict(buffer_size=256, prompts_per_step=4),  # N/R = 4, B/R = 2
    dict(buffer_size=512, prompts_per_step=2, lr=LRS),  # N/R = 16, B/R = 4
    dict(buffer_size=512, prompts_per_step=2, loss="asymre"),
    dict(buffer_size=512, prompts_per_step=2, positive_bias=0.2),
    dict(buffer_size=512, prompts_per_step=2, positive_bias=0.5),
]
SMOKE_GRID = ["--preset", "cpu", "--sft-warmup-steps", "0", "--group-size", "4", "--prompts-per-step", "2",
              "--batch-size", "8", "--buffer-size", "8", "--max-new-tokens", "4", "--eval-size", "8",
              "--pass-k", "2", "--pass-k-prompts", "4", "--total-steps", "3", "--eval-every", "0",
              "--no-progress"], [
    dict(buffer_size=8, prompts_per_step=2),  # on-policy: N = B = R = 8
    dict(buffer_size=16, prompts_per_step=1, lr=[1e-3, 3e-3]),  # N/R = 4, B/R = 2, two lrs
]
GRIDS = {"default": DEFAULT_GRID, "smoke": SMOKE_GRID}


# ----------------------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------------------

def flags(entry: dict) -> list[str]:
    """{"buffer_size": 512} -> ["--buffer-size", "512"] (booleans: --x / --no-x)."""
    out = []
    for k, v in entry.items():
        k = "--" + k.replace("_", "-")
        out += [k] if v is True else [k.replace("--", "--no-", 1)] if v is False else [k, str(v)]
    return out


def is_on_policy(cfg: dict) -> bool:
    R = cfg["prompts_per_step"] * cfg["group_size"]
    return cfg["buffer_size"] == cfg["batch_size"] == R and cfg.get("publish_every", 1) == 1


def config_name(cfg: dict) -> str:
    """A run name (without lr and seed) from the trainer config: onpolicy, N512-R32-asymre-d0.2..."""
    R = cfg["prompts_per_step"] * cfg["group_size"]
    name = "onpolicy" if is_on_policy(cfg) else f"N{cfg['buffer_size']}-R{R}"
    if cfg["loss"] != "grpo" or name != "onpolicy":
        name += f"-{cfg['loss']}"
    if cfg["positive_bias"]:
        name += f"-d{cfg['positive_bias']:g}"
    if cfg.get("publish_every", 1) != 1:
        name += f"-k{cfg['publish_every']}"
    return name


def plan_runs(args: Args) -> list[dict]:
    """Every (configuration, lr, seed) of the grid: its name, trainer argv and total steps."""
    import replay_grpo
    base, entries = GRIDS[args.grid]
    runs, owner = [], {}
    for i, entry in enumerate(entries):
        entry = dict(entry)
        name, lrs = entry.pop("name", None), entry.pop("lr", None)
        lrs = lrs if isinstance(lrs, list) else [lrs]
        for lr in lrs:
            argv = base + list(args.extra) + flags(entry) + ([] if lr is None else ["--lr", str(lr)])
            cfg = replay_grpo.parse_args(argv)
            config = name or config_name(vars(cfg))
            if args.only and not any(s in config for s in args.only):
                continue
            tag = config + (f"-lr{lr:g}" if len(lrs) > 1 else "")
            if owner.setdefault(tag, i) != i:
                raise SystemExit(f"error: grid entries {owner[tag]} and {i} are both named {tag!r}: "
                                 "give one a 'name'")
            for seed in args.seeds:
                runs.append({"name": f"{tag}-s{seed}", "total_steps": cfg.total_steps,
                             "argv": argv + ["--seed", str(seed), "--run-name", f"{tag}-s{seed}",
                                             "--out-dir", args.out_dir]})
    return runs


def checkpoint_state(run_dir: Path) -> dict | None:
    """The run's trainer_state.pt (memory-mapped), or None if it has no readable checkpoint."""
    import torch
    for ckpt in ("checkpoint", "checkpoint.old"):  # .old: killed between the two renames of a save
        path = run_dir / ckpt / "trainer_state.pt"
        if path.exists():
            try:
                return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            except Exception as e:
                print(f"warning: cannot read {path}: {type(e).__name__}: {e}")
    return None


def run_status(run_dir: Path, total_steps: int) -> str:
    """'new', 'done' (config.json and a checkpoint at total_steps), 'partial' (a checkpoint at an
    earlier step) or 'broken' (a folder without a checkpoint: died before its first one)."""
    if not run_dir.exists():
        return "new"
    state = checkpoint_state(run_dir)
    if state is None:
        return "broken"
    return "done" if state["step"] >= total_steps and (run_dir / "config.json").exists() else "partial"


def run(args: Args) -> None:
    import replay_grpo
    runs, failed = plan_runs(args), []
    for i, r in enumerate(runs, 1):
        run_dir, argv = Path(args.out_dir) / r["name"], r["argv"]
        status = run_status(run_dir, r["total_steps"])
        print(f"[{i}/{len(runs)}] {r['name']}: " + {"new": "start", "done": "finished, skipped",
              "partial": "resume from its checkpoint", "broken": "no checkpoint: delete and restart"}[status],
              flush=True)
        if status == "done":
            continue
        if status == "partial":
            argv = argv + ["--resume"]
        if status == "broken":
            shutil.rmtree(run_dir)
        if args.subprocess:
            code = subprocess.run([sys.executable, str(TRAINER), *argv]).returncode
        else:
            try:
                replay_grpo.main(argv)
                code = 0
            except SystemExit as e:
                code = e.code
            except Exception:  # a crash fails this run only; the traceback is printed
                traceback.print_exc()
                code = 1
        if code == 130:  # Ctrl-C: stop the sweep (the run keeps its last checkpoint)
            raise SystemExit(130)
        if code:
            failed.append(r["name"])
    if failed:
        raise SystemExit(f"error: {len(failed)} run(s) failed: {', '.join(failed)} (rerun to retry)")
    print(f"all {len(runs)} runs finished in {args.out_dir}; next: python sweep.py report --out-dir {args.out_dir}")


# ----------------------------------------------------------------------------------------------
# report: load, group over seeds, pick the lr, table, figures
# ----------------------------------------------------------------------------------------------

def load_runs(out_dir: Path) -> list[dict]:
    """Every finished run: name, config (name without lr and seed), seed, cfg, metric records and
    the use count of every rollout (evicted and resident)."""
    runs = []
    for run_dir in sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / "config.json").exists()):
        cfg = json.loads((run_dir / "config.json").read_text())
        state = checkpoint_state(run_dir)
        if state is None or state["step"] != cfg["total_steps"] or not (run_dir / "metrics.jsonl").exists():
            print(f"report: {run_dir.name} is not finished, left out")
            continue
        m = re.fullmatch(r"(.+?)(-lr.+)?-s(\d+)", run_dir.name)
        records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
        buf = state["buffer"]
        runs.append({"name": run_dir.name, "config": m[1] if m else run_dir.name, "seed": cfg["seed"],
                     "cfg": cfg, "records": records,
                     "uses": list(buf["evicted_uses"]) + [it["uses"] for it in buf["items"]]})
    return runs


def quartiles(values) -> tuple[float, float, float]:
    q25, q50, q75 = np.percentile(np.asarray(values, dtype=float), [25, 50, 75])
    return float(q25), float(q50), float(q75)


def evals(run: dict) -> list[dict]:
    return [r for r in run["records"] if "eval/greedy_acc" in r]


def compute(rec: dict, mu: float) -> float:
    """Paper units: training a rollout costs 1, generating one costs mu."""
    return rec.get("trained_rollouts", 0) + mu * rec.get("generated_rollouts", 0)


def curve(runs: list[dict], y: str, x, eval_only: bool = True) -> dict:
    """Over seeds at each step all of them logged: median x, and median / IQR of y."""
    recs = [{r["step"]: r for r in (evals(run) if eval_only else run["records"]) if y in r} for run in runs]
    steps = sorted(set.intersection(*(set(r) for r in recs)))
    xs = np.array([[x(r[s]) for s in steps] for r in recs], dtype=float)
    ys = np.array([[r[s][y] for s in steps] for r in recs], dtype=float)
    q = np.percentile(ys, [25, 50, 75], axis=0) if steps else np.zeros((3, 0))
    return {"x": np.median(xs, axis=0) if steps else np.zeros(0), "q25": q[0], "median": q[1], "q75": q[2]}


def first_reach(c: dict, target: float) -> float | None:
    """x at the first eval where the median accuracy reaches the target (None: never)."""
    hit = np.nonzero(c["median"] >= target - 1e-9)[0]
    return float(c["x"][hit[0]]) if len(hit) else None


def final(runs: list[dict], key: str) -> list[float]:
    return [evals(r)[-1][key] for r in runs]


def pick_lrs(runs: list[dict]) -> tuple[dict[str, list[dict]], dict]:
    """Group runs by configuration and keep, per configuration, the lr with the best median final
    greedy accuracy (ties: pass@1, then the smaller lr). Returns the kept runs and the choices."""
    by_lr: dict[str, dict[float, list[dict]]] = {}
    for r in runs:
        by_lr.setdefault(r["config"], {}).setdefault(r["cfg"]["lr"], []).append(r)
    configs, choices = {}, {}
    for config, lrs in by_lr.items():
        score = {lr: (np.median(final(rs, "eval/greedy_acc")), np.median(final(rs, "eval/pass@1")))
                 for lr, rs in sorted(lrs.items())}
        best = max(score, key=score.get)  # the first (smallest) lr among equals
        configs[config] = sorted(lrs[best], key=lambda r: r["seed"])
        if len(lrs) > 1:
            choices[config] = {"picked": best, "median_final_greedy_acc": {lr: float(v[0]) for lr, v in score.items()}}
    return configs, choices


def summarize(runs: list[dict], reference: str | None, paper_mu: float) -> dict:
    """Per configuration (best lr): final metrics over seeds and cost to the reference's accuracy."""
    configs, lr_choice = pick_lrs(runs)
    if reference is None:  # the on-policy GRPO configuration (plain FIFO)
        cands = [c for c, rs in configs.items() if is_on_policy(rs[0]["cfg"]) and rs[0]["cfg"]["loss"] == "grpo"]
        reference = min(cands, key=lambda c: (configs[c][0]["cfg"]["positive_bias"], c)) if cands else None
    elif reference not in configs:
        raise SystemExit(f"error: --reference {reference}: no finished runs (have: {', '.join(configs)})")
    target = float(np.median(final(configs[reference], "eval/greedy_acc"))) if reference else None
    mus = [r["records"][-1]["mu"] for r in runs if "mu" in r["records"][-1]]
    mu_machine = float(np.median(mus)) if mus else float("nan")
    axes = {"tokens": lambda r: r.get("total_generated_tokens", 0),
            "compute_measured_mu": lambda r: compute(r, mu_machine),
            "compute_paper_mu": lambda r: compute(r, paper_mu)}
    rows = {}
    for config, rs in configs.items():
        cfg, last = rs[0]["cfg"], [r["records"][-1] for r in rs]
        stale = Counter()
        for r in rs:
            for rec in r["records"]:
                stale.update({int(k): v for k, v in rec.get("staleness_hist", {}).items()})
        row = rows[config] = {
            "lr": cfg["lr"], "seeds": [r["seed"] for r in rs], "steps": cfg["total_steps"],
            "N": cfg["buffer_size"], "B": cfg["batch_size"], "R": cfg["prompts_per_step"] * cfg["group_size"],
            "greedy_acc": quartiles(final(rs, "eval/greedy_acc")), "pass@1": quartiles(final(rs, "eval/pass@1")),
            "k": cfg["pass_k"], "pass@k": quartiles(final(rs, f"eval/pass@{cfg['pass_k']}")),
            "generated_tokens": float(np.median([l.get("total_generated_tokens", 0) for l in last])),
            "mu": float(np.median([l["mu"] for l in last])) if all("mu" in l for l in last) else None,
            "replay_ratio": float(np.mean([l.get("replay_ratio", 0) for l in last])),
            "staleness": sum(s * n for s, n in stale.items()) / max(1, sum(stale.values()))}
        for axis, x in axes.items():
            row[f"{axis}_to_target"] = first_reach(curve(rs, "eval/greedy_acc", x), target) if reference else None
    for row in rows.values():
        for axis in axes:
            ours, ref = row[f"{axis}_to_target"], rows[reference][f"{axis}_to_target"] if reference else None
            row[f"{axis}_saving_pct"] = 100 * (1 - ours / ref) if ours is not None and ref else None
    order = sorted(configs, key=lambda c: (c != reference, rows[c]["N"], -rows[c]["R"], c))
    return {"reference": reference, "target_greedy_acc": target, "mu_measured": mu_machine,
            "paper_mu": paper_mu, "lr_choice": lr_choice, "configs": {c: rows[c] for c in order},
            "_runs": {c: configs[c] for c in order}}


def fmt(x) -> str:
    """Token and compute amounts: 58.24, 6896, 13.3k, 1.25M."""
    if x is None:
        return "—"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def fmt_q(q) -> str:
    return f"{q[1]:.3f} [{q[0]:.3f}–{q[2]:.3f}]"


def fmt_pct(x) -> str:
    return "—" if x is None else f"{x:+.1f}%"


def write_table(s: dict, path: Path) -> None:
    ref, mu, pmu = s["reference"], s["mu_measured"], s["paper_mu"]
    target = "—" if s["target_greedy_acc"] is None else f"{s['target_greedy_acc']:.3f}"
    lines = [
        "# Replay-GRPO study", "",
        f"Final held-out accuracy as median [IQR] over seeds (greedy decoding; pass@1 at temperature 0.1, "
        f"top-p 0.95; pass@k at temperature 1). Reference: **{ref}**, whose final median greedy accuracy "
        f"{target} is the target: "
        "'to target' is the generated tokens / compute at the first evaluation where a configuration's "
        "median greedy accuracy reaches it (— never), 'saving' is 1 − ours / reference's.",
        f"Compute units: training on a rollout costs 1, generating one costs mu; compute = trained rollouts "
        f"+ mu × generated rollouts. 'meas.' uses mu = {mu:.2f} (median of the runs' measured mu on this "
        f"machine), 'paper' uses mu = {pmu:g}. Replay ratio: trained / generated rollouts; staleness: "
        "optimizer steps between a rollout's generation and its use, averaged over every use.", "",
        "| config | lr | seeds | steps | greedy acc | pass@1 | pass@k | gen. tokens | mu (meas.) | replay ratio "
        "| staleness | tokens to target | saving | compute (meas.) to target | saving "
        "| compute (paper) to target | saving |",
        "|" + "---|" * 17,
    ]
    for c, r in s["configs"].items():
        cells = [c, f"{r['lr']:g}" + ("*" if c in s["lr_choice"] else ""), len(r["seeds"]), r["steps"],
                 fmt_q(r["greedy_acc"]), fmt_q(r["pass@1"]), f"pass@{r['k']} {fmt_q(r['pass@k'])}",
                 fmt(r["generated_tokens"]), "—" if r["mu"] is None else f"{r['mu']:.2f}",
                 f"{r['replay_ratio']:.2f}", f"{r['staleness']:.2f}"]
        for axis in ("tokens", "compute_measured_mu", "compute_paper_mu"):
            cells += [fmt(r[f"{axis}_to_target"]), fmt_pct(r[f"{axis}_saving_pct"])]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if ref is not None and s["configs"][ref]["tokens_to_target"] == 0:
        lines += ["", f"Note: {ref}'s median accuracy is at the target already at step 0 (before any RL), "
                      "so the savings are undefined: train longer or with a weaker warm start."]
    if s["lr_choice"]:
        lines += ["", "## Learning rate (*)", "",
                  "Configurations run with several learning rates keep the one with the best median final "
                  "greedy accuracy (ties: pass@1, then the smaller lr), chosen on the same seeds it is "
                  "reported on:", ""]
        for c in s["configs"]:
            if c in s["lr_choice"]:
                note = s["lr_choice"][c]
                tried = ", ".join(f"{lr:g}: {acc:.3f}" for lr, acc in note["median_final_greedy_acc"].items())
                lines.append(f"- {c}: lr {note['picked']:g} picked (median final greedy accuracy {tried})")
    path.write_text("\n".join(lines) + "\n")


def plot(s: dict, out_dir: Path) -> list[Path]:
    """The six figures: median over seeds, shaded IQR, one line per configuration (its best lr)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs, ref, target = s["_runs"], s["reference"], s["target_greedy_acc"]
    palette = iter(plt.get_cmap("tab10").colors)
    color = {c: "black" if c == ref else next(palette) for c in runs}
    label = {c: c + (f" (lr {s['configs'][c]['lr']:g})" if c in s["lr_choice"] else "") for c in runs}
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out_dir / name)

    def lines(ax, y, x, xlabel, ylabel, eval_only=True, show_target=True):
        for c, rs in runs.items():
            key = y(c) if callable(y) else y
            cv = curve(rs, key, x, eval_only)
            ax.plot(cv["x"], cv["median"], color=color[c], lw=2.2 if c == ref else 1.4, label=label[c])
            ax.fill_between(cv["x"], cv["q25"], cv["q75"], color=color[c], alpha=0.15, lw=0)
        if show_target and target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1, label=f"target: {ref} final median")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    def legend(ax):
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)

    step = lambda r: r["step"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lines(a, "eval/greedy_acc", step, "gradient steps", "held-out greedy accuracy")
    lines(b, lambda c: f"eval/pass@{s['configs'][c]['k']}", step, "gradient steps",
          "held-out pass@k (k samples, temperature 1)", show_target=False)
    fig.suptitle("Held-out accuracy vs gradient steps (median, IQR over seeds)")
    legend(b)
    save(fig, "accuracy_vs_steps.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    lines(ax, "eval/greedy_acc", lambda r: r.get("total_generated_tokens", 0), "generated tokens",
          "held-out greedy accuracy")
    ax.set_title("Held-out accuracy vs generated tokens")
    legend(ax)
    save(fig, "accuracy_vs_tokens.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (mu, what) in zip(axes, [(s["mu_measured"], "measured on this machine"), (s["paper_mu"], "the paper's")]):
        lines(ax, "eval/greedy_acc", lambda r, mu=mu: compute(r, mu),
              "compute = trained + mu x generated rollouts", "held-out greedy accuracy")
        ax.set_title(f"mu = {mu:.2f} ({what})")
    fig.suptitle("Held-out accuracy vs compute (training a rollout = 1 unit, generating one = mu units)")
    legend(axes[1])
    save(fig, "accuracy_vs_compute.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    lines(ax, "entropy", step, "gradient steps", "policy entropy on the batch (nats/token)",
          eval_only=False, show_target=False)
    ax.set_title("Training entropy")
    legend(ax)
    save(fig, "entropy.png")

    def hists(name, title, xlabel, counts_of):
        n = len(runs)
        ncol = min(4, n)
        nrow = math.ceil(n / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.3 * ncol, 2.7 * nrow), squeeze=False, sharex=True,
                                 sharey=True)
        for ax, (c, rs) in zip(axes.flat, runs.items()):
            counts = sum((counts_of(r) for r in rs), Counter())
            total = sum(counts.values()) or 1
            xs = sorted(counts)
            ax.bar(xs, [counts[x] / total for x in xs], width=0.85, color=color[c])
            mean = sum(x * counts[x] for x in xs) / total
            ax.set_title(f"{label[c]}\nmean {mean:.2f}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelbottom=True)
        for ax in axes[:, 0]:
            ax.set_ylabel("fraction")
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(title)
        save(fig, name)

    hists("staleness_hist.png", "Staleness of each use (steps since generation), all steps and seeds",
          "staleness (optimizer steps)",
          lambda r: Counter([int(k) for rec in r["records"] for k, v in rec.get("staleness_hist", {}).items()
                             for _ in range(v)]))
    hists("replay_ratio_hist.png", "Replay ratio per rollout: times each rollout was trained on "
          "(evicted + still in the buffer)", "uses", lambda r: Counter(r["uses"]))
    return written


def report(args: Args) -> dict:
    out = Path(args.out_dir)
    runs = load_runs(out) if out.is_dir() else []
    if not runs:
        raise SystemExit(f"error: no finished runs in {out} (python sweep.py run --out-dir {out})")
    s = summarize(runs, args.reference, args.paper_mu)
    write_table(s, out / "table.md")
    (out / "summary.json").write_text(json.dumps({k: v for k, v in s.items() if k != "_runs"}, indent=2))
    figures = plot(s, out)
    print((out / "table.md").read_text())
    print("wrote", ", ".join(str(p) for p in [out / "table.md", out / "summary.json", *figures]))
    return s


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--extra" in argv:  # everything after it is for the trainer, verbatim
        i = argv.index("--extra")
        argv, extra = argv[:i], argv[i + 1:]
    args = tyro.cli(Args, args=argv, prog="sweep.py", description=__doc__.split("\n\n")[0])
    args.extra = extra
    return run(args) if args.mode == "run" else report(args)


if __name__ == "__main__":
    main()
