"""sweep.py: run a grid of replay-GRPO configurations x seeds, then tabulate and plot the study.

    python tools/sweep.py run --out-dir runs/study --seeds 0 1 2            # the default grid, resumable
    python tools/sweep.py run --out-dir runs/smoke --grid smoke --seeds 0 1 # 2 tiny configs (seconds)
    python tools/sweep.py run --out-dir runs/study --seeds 0 --extra --total-steps 50 --eval-every 10
    python tools/sweep.py report --out-dir runs/study                       # table.md, summary.json, PNGs
    python tools/sweep.py plot runs/NAME                                    # one run's curves, into its folder
    python tools/sweep.py render docs/study/summary.json                    # its table.md again, from the summary
    python tools/sweep.py run --grid pareto --out-dir runs/pareto --seeds 0 1 2  # the Pareto study (report: pareto.py)
    python tools/sweep.py run --grid compute --out-dir runs/compute --seeds 20 21  # report: compute_study.py

Every run is `replay_grpo.main([...])`, in this process (or one subprocess each with --subprocess, and
always for a run whose generator may be vLLM), named after its configuration: onpolicy-s0, N512-R32-grpo-s0,
N512-R32-asymre-s0, N512-R32-grpo-d0.2-s0, N512-R32-grpo-lr5e-05-s0 (when the grid entry tries several lrs), ...
`run` skips finished runs (checkpoint at total_steps), continues interrupted ones from their
checkpoint (--resume) and deletes and restarts ones that died before their first checkpoint. Several `run`
processes may share a folder: each run is claimed by the one that trains it (.sweep_locks/), the others skip it.

`report` reads every finished run under --out-dir, groups runs by configuration over seeds
(median and IQR), keeps per configuration the learning rate with the best median final greedy
accuracy, and measures savings against the on-policy GRPO configuration (N = B = R).
Compute, in the paper's normalisation: training on one rollout costs 1 unit and generating one
costs mu units, so compute after t steps = trained_rollouts + mu * generated_rollouts
(= t * B * (1 + mu * R / B) for a fixed schedule; on-policy costs B(1 + mu) per update).
It is reported twice: with the mu measured on this machine (median of the runs' logged "mu")
and with the paper's mu = 5.28 (Qwen2.5-7B). table.md is rendered from summary.json's content alone (`render`).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

import run_folder

TRAINER = ROOT / "replay_grpo.py"


@dataclass
class RunArgs:
    """Train every (configuration, lr, seed) of a grid that is not finished yet (a finished run is skipped)."""

    out_dir: str = "runs/study"
    """folder of the run folders."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """the reported seeds of every configuration (the paper reports median and IQR over >= 4)."""
    tune_seeds: list[int] = field(default_factory=list)
    """seeds on which every learning rate (and AsymRE delta_V) of a configuration is tried; only the best one
    (median final greedy accuracy) is then run on --seeds, so the reported seeds never choose their own
    learning rate. Empty: every variant runs on --seeds."""
    grid: Literal["study", "cpu", "smoke", "variants", "pareto", "compute"] = "study"
    """which grid of GRIDS below (study: the replay study on --preset cpu-study; cpu: the first study, on
    --preset cpu; smoke: 2 tiny configs; variants: the buffer's rules against uniform sampling, on cpu-study;
    pareto: on-policy against replay on --preset cpu at three lrs, at equal generated rollouts; compute: the
    compute study's, at equal compute at the paper's mu)."""
    only: list[str] = field(default_factory=list)
    """only configurations whose name contains one of these strings (none given: all)."""
    subprocess: bool = False
    """start each run as `python replay_grpo.py ...` instead of calling it in this process (frees all memory
    between runs; worth it on GPU)."""
    extra: list[str] = field(default_factory=list)
    """trainer flags for every run, e.g. --extra --total-steps 50 --lr 1e-4. Must come last: everything after
    --extra goes to replay_grpo.py verbatim. Flags set by a grid entry win."""


@dataclass
class ReportArgs:
    """The table (table.md), summary.json and figures of the finished runs in --out-dir."""

    out_dir: str = "runs/study"
    """folder of the run folders."""
    report_dir: str | None = None
    """where table.md, summary.json and the figures go (default: --out-dir)."""
    tune_seeds: list[int] = field(default_factory=list)
    """seeds that chose a learning rate and are not reported (default: those `run` recorded in sweep.json)."""
    reference: str | None = None
    """configuration that savings are measured against (default: the on-policy GRPO one, N = B = R published
    every step)."""
    paper_mu: float = 5.28
    """the paper's generation/training cost ratio, for the second compute axis."""
    saving_target: float = 30.0
    """the saving (percent of on-policy's generated tokens, and of its compute at the paper's mu) whose
    attainment the report decides with bootstrap 90% intervals."""


@dataclass
class RenderArgs:
    """table.md rendered again from a report's summary.json (sweep.py report's or pareto.py's), e.g. after a change
    to the table's layout: the table is a function of the summary alone."""

    summary: tyro.conf.Positional[str]
    """the report's summary.json."""
    table: str | None = None
    """where the table goes (default: table.md beside the summary)."""


@dataclass
class PlotArgs:
    """One run's curves against steps and generated tokens (curves_vs_steps.png, curves_vs_tokens.png), written
    into its folder."""

    run_folder: tyro.conf.Positional[str]
    """the run folder (runs/NAME)."""


# ----------------------------------------------------------------------------------------------
# Grids: a list of configurations, each a dict of replay_grpo flags (replay_grpo Args field names). "lr" may
# be a list: each lr is run and the report keeps the best per configuration. "name" overrides
# the derived run name. A grid is (flags for every run, configurations).
# ----------------------------------------------------------------------------------------------

# --preset cpu: B = 128, G = 16, so R = 16 x prompts_per_step. On this machine mu ~ 0.8, where the
# paper's planner (alpha = rho = 0.1) wants N/R ~ 6, B/R ~ 2: N256-R64 (N/R = 4, B/R = 2) is near it.
# N512-R32 (N/R = 16, B/R = 4) is near its optimum for the paper's mu = 5.28 (14.3, 5.6); the
# paper's refinements (AsymRE, positive bias delta) matter most at large reuse, so they go there.
# lrs: a trial scan of on-policy GRPO at 5e-5, 1e-4, 2e-4 found 2e-4 worse on every seed.
LRS = [5e-5, 1e-4]
DEFAULT_GRID = (
    ["--preset", "cpu"],
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
STUDY_GRID = (
    ["--preset", "cpu-study"],
    [
        dict(buffer_size=64, prompts_per_step=4, lr=STUDY_LRS),  # on-policy GRPO: N = B = R = 64
        dict(buffer_size=224, prompts_per_step=2, total_steps=400, eval_every=40, lr=STUDY_LRS),  # optimum, measured mu
        dict(buffer_size=240, prompts_per_step=1, total_steps=800, eval_every=80, lr=STUDY_LRS),  # optimum, paper's mu
        # the paper's refinements at the better of the two buffers on the tune seeds (N = 240: median final greedy
        # accuracy 0.837 at lr 1e-5, against 0.825 for N = 224): AsymRE (delta_V scanned too) and positive bias 0.2
        dict(
            buffer_size=240,
            prompts_per_step=1,
            total_steps=800,
            eval_every=80,
            loss="asymre",
            lr=[1e-5, 3e-5],
            asymre_delta_v=[-0.05, -0.1],
        ),
        dict(buffer_size=240, prompts_per_step=1, total_steps=800, eval_every=80, positive_bias=0.2, lr=STUDY_LRS),
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
# The Pareto study on --preset cpu: on-policy against replay with N = 512 at B/R = 2, 4, 8 and the planner's
# suggestion for the paper's mu = 5.28 (`plan --mu 5.28 --batch 128`: N = 240, R = 16), each at every lr of
# PARETO_LRS, the report keeping the frontier over them. Every configuration generates PARETO_ROLLOUTS rollouts
# and is evaluated every EVAL_ROLLOUTS of them (on-policy every 2 steps), so that all curves share their x values.
PARETO_LRS = [1e-5, 3e-5, 1e-4]
PARETO_ROLLOUTS = 3840  # on-policy: 30 steps of R = 128
EVAL_ROLLOUTS = 256


def pareto_entry(buffer_size: int, prompts_per_step: int) -> dict:
    R = prompts_per_step * 16  # the cpu preset's G
    return dict(
        buffer_size=buffer_size,
        prompts_per_step=prompts_per_step,
        total_steps=PARETO_ROLLOUTS // R,
        eval_every=EVAL_ROLLOUTS // R,
        lr=PARETO_LRS,
    )


PARETO_GRID = (
    ["--preset", "cpu"],
    [
        pareto_entry(buffer_size=128, prompts_per_step=8),  # on-policy GRPO: N = B = R = 128
        pareto_entry(buffer_size=512, prompts_per_step=4),  # B/R = 2
        pareto_entry(buffer_size=512, prompts_per_step=2),  # B/R = 4, the README's replay example
        pareto_entry(buffer_size=512, prompts_per_step=1),  # B/R = 8
        pareto_entry(buffer_size=240, prompts_per_step=1),  # the planner's N/R = 15, B/R = 8 at mu = 5.28
    ],
)
# The compute study (its report and rule: compute_study.py): on-policy against the replay buffers of its two
# hypotheses, N = 512, R = 32 and the planner's N = 240, R = 16 (both B = 128), each at every lr of COMPUTE_LRS.
# Every configuration runs to about on-policy's final compute at the paper's mu (trained rollouts + PAPER_MU x
# generated rollouts, a replay run's first step generating B to fill its buffer) and ends on an evaluation; all are
# evaluated every EVAL_ROLLOUTS generated rollouts.
COMPUTE_LRS = [3e-6, 1e-5, 3e-5]
COMPUTE_ROLLOUTS = 7680  # on-policy's generated rollouts (60 steps): chosen on pilot seeds 0-5 (docs/study/compute)
PAPER_MU = 5.28


def compute_entry(buffer_size: int, prompts_per_step: int, batch_size: int = 128) -> dict:
    R, B = prompts_per_step * 16, batch_size  # the cpu preset's G and B
    budget, first, step = COMPUTE_ROLLOUTS * (1 + PAPER_MU), B * (1 + PAPER_MU), B + PAPER_MU * R
    every = EVAL_ROLLOUTS // R
    steps = 1 + int((budget - first) // step)
    return dict(
        buffer_size=buffer_size,
        prompts_per_step=prompts_per_step,
        total_steps=steps - steps % every,
        eval_every=every,
        lr=COMPUTE_LRS,
    )


COMPUTE_GRID = (
    ["--preset", "cpu"],
    [
        compute_entry(buffer_size=128, prompts_per_step=8),  # on-policy GRPO: N = B = R = 128
        compute_entry(buffer_size=512, prompts_per_step=2),  # H1: B/R = 4
        compute_entry(buffer_size=240, prompts_per_step=1),  # H2: the planner's N/R = 15, B/R = 8 at mu = 5.28
    ],
)
GRIDS = {
    "study": STUDY_GRID,
    "cpu": DEFAULT_GRID,
    "smoke": SMOKE_GRID,
    "variants": VARIANTS_GRID,
    "pareto": PARETO_GRID,
    "compute": COMPUTE_GRID,
}


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
    for key, tag in RULE_TAGS.items():  # the buffer's rules, where they are not the default
        value = cfg.get(key)
        if value not in (None, 0, 0.0, "uniform", "token"):
            name += f"-{tag}{value:g}" if isinstance(value, (int, float)) else f"-{value}"
    return name


RULE_TAGS = {
    "sampling": "",
    "max_age": "age",
    "max_uses": "uses",
    "priority_alpha": "a",
    "priority_tau": "tau",
    "ratio_level": "",
}  # replay_grpo's rule flags, and their tags in a configuration's name


VARIED = {"lr": "lr", "asymre_delta_v": "dv"}  # grid keys that may hold a list of values to try


def variants(entry: dict):
    """(fixed flags, varied values, name tag) for each combination of the entry's listed values."""
    fixed = {k: v for k, v in entry.items() if k != "name" and not isinstance(v, list)}
    lists = {k: v for k, v in entry.items() if isinstance(v, list)}
    for combo in itertools.product(*lists.values()):
        varied = dict(zip(lists, combo))
        tag = "".join(f"-{VARIED[k]}{v:g}" for k, v in varied.items() if len(lists[k]) > 1)
        yield fixed, varied, tag


def plan_runs(args: RunArgs, seeds: list[int] | None = None, picks: dict | None = None) -> list[dict]:
    """Every (configuration, variant, seed) of the grid: its name, configuration, variant, trainer
    argv and total steps. seeds: default --tune-seeds, or --seeds without them. picks: only the
    picked variant of each configuration ({config: variant tag})."""
    import replay_grpo

    base, entries = GRIDS[args.grid]
    seeds = seeds if seeds is not None else (args.tune_seeds or args.seeds)
    runs, owner = [], {}
    for i, entry in enumerate(entries):
        for fixed, varied, tag in variants(entry):
            argv = base + list(args.extra) + flags(fixed) + flags(varied)
            try:
                cfg = replay_grpo.parse_args(argv)
            except replay_grpo.UserError as e:  # a bad --extra flag: one line, as the trainer says it
                raise SystemExit(f"error: {e}") from None
            config = entry.get("name") or config_name(vars(cfg))
            if args.only and not any(s in config for s in args.only):
                continue
            if picks is not None and picks.get(config) != tag:
                continue
            if owner.setdefault(config + tag, i) != i:
                raise SystemExit(
                    f"error: grid entries {owner[config + tag]} and {i} are both named "
                    f"{config + tag!r}: give one a 'name'"
                )
            for seed in seeds:
                name = f"{config}{tag}-s{seed}"
                runs.append(
                    {
                        "name": name,
                        "run_dir": Path(args.out_dir) / name,
                        "planned": {"config": config, "variant": tag, "seed": seed},
                        "total_steps": cfg.total_steps,
                        "generator": cfg.generator,
                        "argv": argv + ["--seed", str(seed), "--run-name", name, "--out-dir", args.out_dir],
                    }
                )
    return runs


def checkpoint_state(run_dir: Path) -> dict | None:
    """The run's trainer_state.pt (memory-mapped), or None if it has no readable checkpoint (one that cannot be
    read, or holds no integer "step", is said in one line)."""
    import torch

    for ckpt in ("checkpoint", "checkpoint.old"):  # .old: killed between the two renames of a save
        path = run_dir / ckpt / "trainer_state.pt"
        if path.exists():
            try:
                state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            except Exception as e:
                print(f"warning: cannot read {path}: {type(e).__name__}: {e}")
                continue
            if isinstance(state, dict) and isinstance(state.get("step"), int):
                return state
            print(f'warning: {path} holds no integer "step": not a trainer state')
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


CLAIMS = ".sweep_locks"  # beside run folders: a lock file per run that a runner process holds while it handles it


def claim(path: Path, wait: bool = False) -> int | None:
    """This process's claim on `path` (a run folder, or a file several runners rewrite): an flock on
    <parent>/.sweep_locks/<name>, a file that is never deleted, so that it outlives a run folder deleted and made
    again. Returns its descriptor (os.close releases it, as the process's end does), or None when another process
    holds it (wait: block until it is free)."""
    locks = path.parent / CLAIMS
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / path.name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


STATUS_LINES = {
    "new": "start",
    "done": "finished, skipped",
    "partial": "resume from its checkpoint",
    "broken": "no checkpoint: delete and restart",
    "restart": "delete and run again from nothing",
}


def execute(runs: list[dict], *, in_subprocess: bool, quiet: bool = False, on_trained=None) -> dict:
    """The runner of every study tool. Each run: name, run_dir, argv (replay_grpo.py's flags, its --out-dir and
    --run-name naming run_dir), and total_steps for run_status, or status(run), a function that returns one of
    STATUS_LINES' keys in its place; optionally planned (written to run_dir/sweep_run.json) and clear (more paths
    deleted before a run is trained from nothing, e.g. its warm-start cache).

    A run is handled under its claim (claim(run_dir)), so that two runner processes on one folder never both
    decide on, train, delete or restart one run: a run another process claims, or whose folder a trainer holds
    (its lock), is skipped. Otherwise it is skipped when done, resumed from its checkpoint (partial), or deleted
    and trained from nothing (broken: it died before its first checkpoint; restart). A run that fails does not
    stop the others; Ctrl-C does. in_subprocess: each run is `python replay_grpo.py ...` (quiet: without its
    stdout), else replay_grpo.main in this process. on_trained(run, seconds) is called after each run trained
    without error, with its wall time, under the run's claim. Returns the names of the runs that failed and of
    those skipped as another process's."""
    import replay_grpo

    failed, skipped = [], []
    for i, r in enumerate(runs, 1):
        run_dir, argv, head = Path(r["run_dir"]), r["argv"], f"[{i}/{len(runs)}] {r['name']}:"
        fd = claim(run_dir)
        if fd is None or run_dir.exists() and run_folder.in_use(run_dir):  # another process has it: leave it alone
            print(f"{head} in use by another process, skipped", flush=True)
            skipped.append(r["name"])
            if fd is not None:
                os.close(fd)
            continue
        try:
            status = r["status"](r) if "status" in r else run_status(run_dir, r["total_steps"])
            print(f"{head} {STATUS_LINES[status]}", flush=True)
            if status == "done":
                continue
            if status == "partial":
                argv = argv + ["--resume"]
            else:  # trained from nothing: nothing of an earlier attempt is kept
                for path in [run_dir, *r.get("clear", [])]:
                    shutil.rmtree(path, ignore_errors=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            if "planned" in r:  # what the report groups it by, written when it is planned
                (run_dir / PLANNED).write_text(json.dumps(r["planned"]))
            start = time.perf_counter()
            # a vLLM engine with sleep mode is one per process and never freed (CUDA): such runs get a process each
            if in_subprocess or r.get("generator", "auto") != "hf":
                out = subprocess.DEVNULL if quiet else None
                code = subprocess.run([sys.executable, str(TRAINER), *argv], stdout=out).returncode
            else:
                try:
                    replay_grpo.main(argv)
                    code = 0
                except SystemExit as e:
                    code = e.code
                except Exception:  # a crash fails this run only; the traceback is printed
                    traceback.print_exc()
                    code = 1
            if code == 130:  # Ctrl-C: stop the runner (the run keeps its last checkpoint)
                raise SystemExit(130)
            if code:
                failed.append(r["name"])
            elif on_trained is not None:
                on_trained(r, time.perf_counter() - start)
        finally:
            os.close(fd)
    return {"failed": failed, "skipped": skipped}


def record_sweep(out_dir: Path, args: RunArgs) -> None:
    """sweep.json: the grid, and every seed and tune seed run into this folder so far (the report leaves the
    tune seeds out). Several `run` processes share a folder: each merges its seeds under the file's claim, and the
    file is replaced whole. A damaged sweep.json stops the run with one line (what it recorded is unknown)."""
    path, seeds, tune_seeds = out_dir / "sweep.json", set(args.seeds), set(args.tune_seeds)
    fd = claim(path, wait=True)
    try:
        if path.exists():
            before = read_sweep_json(path)
            seeds |= set(before["seeds"])
            tune_seeds |= set(before["tune_seeds"])
        tmp = out_dir / f".sweep.json.{os.getpid()}"
        recorded = {"grid": args.grid, "seeds": sorted(seeds), "tune_seeds": sorted(tune_seeds), "extra": args.extra}
        tmp.write_text(json.dumps(recorded, indent=2))
        os.replace(tmp, path)
    finally:
        os.close(fd)


def read_sweep_json(path: Path) -> dict:
    """sweep.json's record, its seeds and tune_seeds lists of integers; a damaged one stops with one line."""
    keep = "it records which seeds only chose a learning rate: restore it, or delete it (report: give --tune-seeds)"
    try:
        recorded = read_json(path)
    except Damaged as e:
        raise SystemExit(f"error: {e}; {keep}") from None
    seeds, tune_seeds = recorded.get("seeds", []), recorded.get("tune_seeds", [])
    if not all(isinstance(x, list) and all(type(s) is int for s in x) for x in (seeds, tune_seeds)):
        raise SystemExit(f"error: {path}: seeds and tune_seeds are not lists of integers; {keep}")
    return {**recorded, "seeds": seeds, "tune_seeds": tune_seeds}


def run(args: RunArgs) -> None:
    """Tune (every variant on --tune-seeds), pick per configuration, then the reported --seeds."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record_sweep(out, args)
    runs = plan_runs(args)
    done = execute(runs, in_subprocess=args.subprocess)
    if args.tune_seeds and not done["failed"] and not others_still_train(runs, done):
        picks = {c: p["variant"] for c, p in pick_variants(load_runs(out, quiet=True), args.tune_seeds).items()}
        for config, tag in picks.items():
            print(f"{config}: {tag.lstrip('-') or 'its only variant'} picked on tune seeds {args.tune_seeds}")
        runs = plan_runs(args, seeds=args.seeds, picks=picks)
        done = execute(runs, in_subprocess=args.subprocess)
    if done["failed"]:
        raise SystemExit(f"error: {len(done['failed'])} run(s) failed: {', '.join(done['failed'])} (rerun to retry)")
    others = others_still_train(runs, done)
    if others:
        print(
            f"{len(others)} run(s) are another process's, not finished yet: {', '.join(others)}; run this again "
            f"when it ends{' (then the variants are picked and --seeds run)' if args.tune_seeds else ''}"
        )
        return
    print(f"all runs finished in {args.out_dir}; next: python tools/sweep.py report --out-dir {args.out_dir}")


def others_still_train(runs: list[dict], done: dict) -> list[str]:
    """The runs execute skipped as another process's that are not finished now."""
    return [
        r["name"] for r in runs if r["name"] in done["skipped"] and run_status(r["run_dir"], r["total_steps"]) != "done"
    ]


# ----------------------------------------------------------------------------------------------
# report: load, group over seeds, pick the lr, table, figures
# ----------------------------------------------------------------------------------------------

PLANNED = "sweep_run.json"  # in each run folder: its configuration, variant and seed, as `run` planned them
VARIANT = r"(?P<variant>(?:-lr[\d.]+(?:e-?\d+)?)?(?:-dv-?[\d.]+(?:e-?\d+)?)?)"  # -lr0.0001, -dv-0.1, both or none
RUN_NAME = re.compile(r"(?P<config>.+?)" + VARIANT + r"-s(?P<seed>\d+)")


class Damaged(Exception):
    """A run folder's file that cannot be read: its message names the file (and line)."""


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # missing, unreadable, not UTF-8, not JSON
        raise Damaged(f"{path}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}") from None
    if not isinstance(value, dict):
        raise Damaged(f"{path}: a JSON object was expected, not {type(value).__name__}")
    return value


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; Damaged names the first line that is not a record with an integer step."""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise Damaged(f"{path}: {type(e).__name__}: {str(e).splitlines()[0][:100]}") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise Damaged(f"{path}:{lineno}: not JSON (a cut or garbage line)") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise Damaged(f'{path}:{lineno}: not a record with an integer "step"')
        records.append(record)
    return records


# config.json's settings that the reports read, and their JSON types (a config without one is damaged or foreign)
CONFIG_KEYS = {
    "seed": int,
    "lr": (int, float),
    "total_steps": int,
    "eval_every": int,
    "buffer_size": int,
    "batch_size": int,
    "prompts_per_step": int,
    "group_size": int,
    "pass_k": int,
    "loss": str,
    "positive_bias": (int, float),
}


def read_run(run_dir: Path, state: dict | None) -> tuple[dict, list[dict] | None, dict | None]:
    """A run folder's settings (config.json with the resumes' changes), and when it is finished (its checkpoint at
    total_steps) its records and planned configuration. Damaged names the file that is missing, unreadable, or
    lacks what the report reads."""
    path = run_dir / "config.json"
    cfg = read_json(path)
    for key, kind in CONFIG_KEYS.items():
        if type(cfg.get(key)) is bool or not isinstance(cfg.get(key), kind):
            what = {int: "an integer", str: "text"}.get(kind, "a number")
            raise Damaged(f'{path}: "{key}" is missing or not {what}')
    try:
        cfg = run_folder.current_config(run_dir, cfg)
    except ValueError as e:
        raise Damaged(str(e)) from None
    if state is None or state["step"] != cfg["total_steps"]:
        return cfg, None, None
    records, path = read_metrics(run_dir / "metrics.jsonl"), run_dir / "metrics.jsonl"
    if not records or records[-1]["step"] < state["step"]:
        raise Damaged(f"{path}: its records do not reach the checkpoint's step {state['step']} (cut)")
    if not any("eval/greedy_acc" in r for r in records):
        raise Damaged(f"{path}: it holds no evaluation")
    if (run_dir / PLANNED).exists():
        planned = read_json(run_dir / PLANNED)
        if not all(isinstance(planned.get(k), str) for k in ("config", "variant")):
            raise Damaged(f'{run_dir / PLANNED}: "config" and "variant" are not both text')
    else:  # a folder from before sweep_run.json: its name says it
        m = RUN_NAME.fullmatch(run_dir.name)
        planned = {"config": m["config"] if m else run_dir.name, "variant": m["variant"] if m else ""}
    return cfg, records, planned


def load_runs(out_dir: Path, quiet: bool = False) -> list[dict]:
    """Every finished run: name, config (name without variant and seed), variant (e.g. -lr0.0001), seed, cfg and
    metric records. A run folder with a damaged file is left out, named in one line, and counted."""
    runs, damaged = [], 0
    for run_dir in sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / "config.json").exists()):
        try:
            cfg, records, planned = read_run(run_dir, checkpoint_state(run_dir))
        except Damaged as e:
            print(f"report: {run_dir.name} left out, a file is damaged: {e}")
            damaged += 1
            continue
        if records is None:
            if not quiet:
                print(f"report: {run_dir.name} is not finished, left out")
            continue
        runs.append(
            {
                "name": run_dir.name,
                "config": planned["config"],
                "variant": planned["variant"],
                "seed": cfg["seed"],
                "cfg": cfg,
                "records": records,
            }
        )
    if damaged:
        print(f"report: {damaged} run folder(s) with a damaged file left out")
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
        score = {
            v: (float(np.median(final(rs, "eval/greedy_acc"))), float(np.median(final(rs, "eval/pass@1"))))
            for v, rs in by_variant.items()
        }
        order = sorted(
            by_variant,
            key=lambda v: (
                -score[v][0],
                -score[v][1],
                by_variant[v][0]["cfg"]["lr"],
                abs(by_variant[v][0]["cfg"].get("asymre_delta_v", 0)),
            ),
        )
        best = order[0]
        picks[config] = {
            "variant": best,
            "cfg": by_variant[best][0]["cfg"],
            "n_variants": len(by_variant),
            "scores": {variant_label(by_variant[v][0]["cfg"], v): score[v][0] for v in order},
            "tune_seeds": sorted({r["seed"] for rs in by_variant.values() for r in rs}),
        }
    return picks


def pick_lrs(runs: list[dict], tune_seeds: list[int] | None = None) -> tuple[dict[str, list[dict]], dict]:
    """Group runs by configuration and keep, per configuration, the picked variant's runs on the
    reported seeds (those not in tune_seeds). Returns the kept runs and the choices."""
    configs, choices = {}, {}
    for config, p in pick_variants(runs, tune_seeds).items():
        kept = [
            r
            for r in runs
            if r["config"] == config and r["variant"] == p["variant"] and not (tune_seeds and r["seed"] in tune_seeds)
        ]
        if not kept:
            continue
        configs[config] = sorted(kept, key=lambda r: r["seed"])
        if p["n_variants"] > 1:
            choices[config] = {
                "picked": p["cfg"]["lr"],
                "label": variant_label(p["cfg"], p["variant"]),
                "asymre_delta_v": p["cfg"].get("asymre_delta_v"),
                "tuned_on": p["tune_seeds"],
                "median_final_greedy_acc": p["scores"],
            }
    return configs, choices


def summarize(
    runs: list[dict],
    reference: str | None,
    paper_mu: float,
    tune_seeds: list[int] | None = None,
    saving_target: float = 30.0,
) -> dict:
    """Per configuration (the variant picked on tune_seeds, reported on the other seeds): final metrics over
    seeds, cost to the reference's accuracy, bootstrap intervals, accuracy at equal compute."""
    configs, lr_choice = pick_lrs(runs, tune_seeds)
    if reference is None:  # the on-policy GRPO configuration (plain FIFO)
        cands = [c for c, rs in configs.items() if is_on_policy(rs[0]["cfg"]) and rs[0]["cfg"]["loss"] == "grpo"]
        reference = min(cands, key=lambda c: (configs[c][0]["cfg"]["positive_bias"], c)) if cands else None
    elif reference not in configs:
        raise SystemExit(f"error: --reference {reference}: no finished runs (have: {', '.join(configs)})")
    target = float(np.median(final(configs[reference], "eval/greedy_acc"))) if reference else None
    mus = [r["records"][-1]["mu"] for r in runs if "mu" in r["records"][-1]]
    mu_machine = float(np.median(mus)) if mus else float("nan")
    axes = {
        "tokens": lambda r: r.get("total_generated_tokens", 0),
        "compute_measured_mu": lambda r: compute(r, mu_machine),
        "compute_paper_mu": lambda r: compute(r, paper_mu),
    }
    rows = {}
    for config, rs in configs.items():
        cfg, last = rs[0]["cfg"], [r["records"][-1] for r in rs]
        stale = Counter()
        for r in rs:
            for rec in r["records"]:
                stale.update({int(k): v for k, v in rec.get("staleness_hist", {}).items()})
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
        for axis, x in axes.items():
            row[f"{axis}_to_target"] = first_reach(curve(rs, "eval/greedy_acc", x), target) if reference else None
    for row in rows.values():
        for axis in axes:
            ours, ref = row[f"{axis}_to_target"], rows[reference][f"{axis}_to_target"] if reference else None
            row[f"{axis}_saving_pct"] = 100 * (1 - ours / ref) if ours is not None and ref else None
    order = sorted(configs, key=lambda c: (c != reference, rows[c]["N"], -rows[c]["R"], c))
    out = {
        "reference": reference,
        "target_greedy_acc": target,
        "mu_measured": mu_machine,
        "paper_mu": paper_mu,
        "lr_choice": lr_choice,
        "configs": {c: rows[c] for c in order},
        "tune_seeds": sorted(tune_seeds or []),
        "_runs": {c: configs[c] for c in order},
    }
    if reference:
        out.update(bootstrap_costs(configs, reference, axes, saving_target))
        out["per_seed"] = {c: [per_seed(r, target, axes) for r in configs[c]] for c in order}
    return out


def bucket_order(label: str) -> int:
    """'0', '1', '2-3', '4-7', '8+' (replay_grpo.STALENESS_BUCKETS) in staleness order."""
    return int(label.split("-")[0].rstrip("+"))


def staleness_buckets(rs: list[dict]) -> dict | None:
    """The records' metrics by staleness over every step and seed of a configuration: per bucket, its share of
    the trained rollouts and, token-weighted, the clip fraction, mean |log ratio| and ESS per token (the ESS of
    the token ratios over the tokens: 1 when every ratio is equal). None: runs that did not log them."""
    sums = {}  # bucket -> rollouts, tokens, clipped tokens, |log ratio| summed over tokens, ESS
    for r in rs:
        for rec in r["records"]:
            for label, b in rec.get("by_staleness", {}).items():
                total = sums.setdefault(label, [0, 0, 0.0, 0.0, 0.0])
                total[0] += b["rollouts"]
                total[1] += b["tokens"]
                total[2] += b["clip_frac"] * b["tokens"]
                total[3] += b["abs_log_ratio"] * b["tokens"]
                total[4] += b["ess"]
    if not sums:
        return None
    rollouts = sum(t[0] for t in sums.values())
    out = {}
    for label in sorted(sums, key=bucket_order):
        n, tokens, clipped, abs_log_ratio, ess = sums[label]
        out[label] = {
            "share": n / rollouts,
            "clip_frac": clipped / tokens,
            "abs_log_ratio": abs_log_ratio / tokens,
            "ess_per_token": ess / tokens,
        }
    return out


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


def bootstrap_costs(
    configs: dict, reference: str, axes: dict, saving_target: float, n: int = 2000, key: str = "eval/greedy_acc"
) -> dict:
    """Bootstrap over seeds (each configuration's seeds resampled with replacement, the target recomputed
    from each resample of the reference): 90% intervals of the cost to reach the reference's final median
    accuracy and 90% of it, of the saving against the reference, and of the median accuracy and pass@k
    at the reference's final compute (equal compute). The decision on the saving target: met (the whole
    interval at or above it), not met (the whole interval below) or not resolvable."""
    rng = np.random.default_rng(0)
    arrays = {}  # per configuration: its runs' accuracy, pass@k and x values at the evaluations all share
    for c, rs in configs.items():
        steps = sorted(set.intersection(*({r["step"] for r in evals(run)} for run in rs)))
        by = [{r["step"]: r for r in evals(run)} for run in rs]
        k = f"eval/pass@{rs[0]['cfg']['pass_k']}"
        arrays[c] = {
            "acc": np.array([[b[t][key] for t in steps] for b in by], dtype=float),
            "passk": np.array([[b[t].get(k, np.nan) for t in steps] for b in by], dtype=float),
        }
        for axis, x in axes.items():
            arrays[c][axis] = np.array([[x(b[t]) for t in steps] for b in by], dtype=float)
    fracs = {"target": 1.0, "90% of target": 0.9}
    equal_axes = [axis for axis in axes if axis != "tokens"]  # equal compute: the compute axes only
    samples = {}  # per configuration, each bootstrap quantity's values over the replicates
    for c in configs:
        samples[c] = {
            "cost": {axis: {f: [] for f in fracs} for axis in axes},  # x to reach the level
            "saving": {axis: {f: [] for f in fracs} for axis in axes},  # percent, against the reference
            "at_equal": {axis: {"acc": [], "pass@k": []} for axis in equal_axes},  # at the reference's budget
        }

    def reach(a: dict, idx, med, axis: str, level: float) -> float:
        """Median x over the resampled seeds at the first evaluation where their median accuracy `med` reaches level."""
        hit = np.nonzero(med >= level - 1e-9)[0]
        return float(np.median(a[axis][idx][:, hit[0]])) if len(hit) else np.inf

    for _ in range(n):
        draw = {c: rng.integers(0, len(configs[c]), len(configs[c])) for c in configs}
        ref = arrays[reference]
        level = float(np.median(ref["acc"][draw[reference]][:, -1]))
        budget = {axis: float(np.median(ref[axis][draw[reference]][:, -1])) for axis in axes}
        cost = {}  # every configuration's cost to each level, the reference's first
        for c in [reference] + [c for c in arrays if c != reference]:
            a, med = arrays[c], np.median(arrays[c]["acc"][draw[c]], axis=0)
            cost[c] = {
                (axis, f): reach(a, draw[c], med, axis, frac * level) for axis in axes for f, frac in fracs.items()
            }
        for c, a in arrays.items():
            for axis in axes:
                for f in fracs:
                    samples[c]["cost"][axis][f].append(cost[c][(axis, f)])
                    samples[c]["saving"][axis][f].append(saving(cost[c][(axis, f)], cost[reference][(axis, f)]))
                if axis in equal_axes:  # accuracy at the last evaluation within the reference's final compute
                    within = np.nonzero(np.median(a[axis][draw[c]], axis=0) <= budget[axis] + 1e-6)[0]
                    for what, arr in (("acc", a["acc"]), ("pass@k", a["passk"])):
                        value = np.nan
                        if len(within):
                            value = float(np.median(arr[draw[c]][:, within[-1]]))
                        samples[c]["at_equal"][axis][what].append(value)

    intervals = intervals_of(samples, (5, 50, 95))
    decision = {}
    for c in configs:
        if c == reference:
            continue
        verdicts = []
        for axis in ("tokens", "compute_paper_mu"):
            lo, _, hi = intervals[c]["saving"][axis]["target"]
            verdicts.append(
                "not resolvable"
                if lo is None
                else "met"
                if lo >= saving_target
                else "not met"
                if hi < saving_target
                else "not resolvable"
            )
        decision[c] = {
            "tokens": verdicts[0],
            "compute_paper_mu": verdicts[1],
            "both": "met" if verdicts == ["met", "met"] else "not met" if "not met" in verdicts else "not resolvable",
        }
    bootstrap = {"replicates": n, "intervals": intervals}
    return {"bootstrap": bootstrap, "decision": decision, "saving_target": saving_target}


# ----------------------------------------------------------------------------------------------
# The report engine, shared by this report and pareto.py's: the summary (what is computed from the runs) is
# written as summary.json; table.md is rendered from that JSON alone, and the figures from the summary and
# the runs. The helpers below have one meaning each, in every report.
# ----------------------------------------------------------------------------------------------


def saving(cost: float, reference_cost: float) -> float:
    """Percent of the reference's cost saved: -inf when the level is never reached (cost inf); nan when the
    reference's cost is 0 (reached before training: nothing to save) or inf (the reference never got there)."""
    if not 0 < reference_cost < math.inf:
        return math.nan
    return -math.inf if cost == math.inf else 100 * (1 - cost / reference_cost)


def percentiles(values, ps: tuple) -> list:
    """The percentiles ps of a bootstrap quantity's replicates, each one of the replicates (method "nearest"); the
    replicates where it is undefined (nan) are left out, and where every one is, each percentile is None."""
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if not len(v):
        return [None] * len(ps)
    return [float(np.percentile(v, p, method="nearest")) for p in ps]


def intervals_of(tree, ps: tuple):
    """The nesting of `tree` (dicts), each sequence of replicate values replaced by its percentiles ps."""
    if isinstance(tree, dict):
        return {k: intervals_of(v, ps) for k, v in tree.items()}
    return percentiles(tree, ps)


def strict_json(x):
    """summary.json is plain JSON for any reader: a cost or saving that is never reached (+-inf) is
    "never", an undefined one (nan) is null."""
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else "never"
    return x


# The formatters take a value as summary.json holds it: a number, "never" (+-inf) or None (undefined, or nan).


def fmt(x) -> str:
    """Token and compute amounts: 58.24, 6896, 13.3k, 1.25M."""
    if x is None:
        return "—"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def fmt_cost(x) -> str:
    """A cost to a level, as fmt: never reached is "never"."""
    return "never" if x in ("never", math.inf) else fmt(x)


def fmt_saving(x, digits: int = 0) -> str:
    """A saving in percent with its sign: never reached is "never", undefined "—"."""
    if x is None or x != x:  # None or nan
        return "—"
    return "never" if x in ("never", -math.inf) else f"{x:+.{digits}f}%"


def fmt_acc(x) -> str:
    """An accuracy (or another value in [0, 1]): 0.815."""
    return "—" if x is None else f"{x:.3f}"


def fmt_mu(x) -> str:
    """A generation/training cost ratio mu: 1.37."""
    return "—" if x is None else f"{x:.2f}"


def fmt_diff(x) -> str:
    """A difference of accuracies, with its sign: +0.012."""
    return "—" if x is None else f"{x:+.3f}"


def fmt_quartiles(q) -> str:
    """Quartiles over seeds (25th, 50th, 75th) as 'median [25th–75th]'."""
    return f"{q[1]:.3f} [{q[0]:.3f}–{q[2]:.3f}]"


def fmt_interval(value, ci, one) -> str:
    """A value and its bootstrap interval [5th, 95th percentile] (the first and last of ci) as 'value [5th, 95th]',
    each formatted by `one`."""
    return f"{one(value)} [{one(ci[0])}, {one(ci[-1])}]"


def save_figure(fig, path: Path, **savefig) -> Path:
    """Lay out, write and close a report figure (dpi 110, and `savefig`'s options)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, **savefig)
    plt.close(fig)
    return path


def write_report(dest: Path, s: dict, private: str, table_md, plot) -> None:
    """summary.json (s without its `private` key, as strict JSON), table.md (table_md of that JSON, as a reader
    of summary.json has it) and the figures (plot of s) into dest; an unwritable folder stops with one line."""
    text = json.dumps(strict_json({k: v for k, v in s.items() if k != private}), indent=2, allow_nan=False)
    table = table_md(json.loads(text))
    try:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "table.md").write_text(table)
        (dest / "summary.json").write_text(text)
        figures = plot(s, dest)
    except OSError as e:
        raise SystemExit(f"error: cannot write the report into {dest} ({e.strerror or e})") from None
    print(table)
    print("wrote", ", ".join(str(p) for p in [dest / "table.md", dest / "summary.json", *figures]))


def study_report(args, grid: str, analyse, *, private: str, table_md, plot) -> dict:
    """A study report's main after its arguments: the finished runs in args.out_dir (made by `run --grid grid`),
    analysed, and the report written into args.report_dir (default: args.out_dir)."""
    out = Path(args.out_dir)
    runs = load_runs(out) if out.is_dir() else []
    if not runs:
        raise SystemExit(f"error: no finished runs in {out} (python tools/sweep.py run --grid {grid} --out-dir {out})")
    s = analyse(runs, args)
    write_report(Path(args.report_dir or out), s, private=private, table_md=table_md, plot=plot)
    return s


def render(summary_path: Path, table_path: Path) -> None:
    """table.md rendered again from a report's summary.json (this report's, pareto.py's or compute_study.py's): the
    same bytes that report wrote, as the table is a function of the summary alone."""
    import compute_study
    import pareto

    try:
        summary = read_json(summary_path)
    except Damaged as e:
        raise SystemExit(f"error: {e}") from None
    render_table = (
        compute_study.table_md if "aa" in summary else pareto.table_md if "interval_90" in summary else table_md
    )
    try:
        table_path.write_text(render_table(summary))
    except OSError as e:
        raise SystemExit(f"error: cannot write {table_path} ({e.strerror or e})") from None
    print("wrote", table_path)


def table_md(s: dict) -> str:
    """The study's table.md from its summary (summary.json's content)."""

    def bootstrap(q, one) -> str:
        """A bootstrap [5th, 50th, 95th] percentile triple as 'median [5th, 95th]' ("—" where it is undefined)."""
        return "—" if q[1] is None else fmt_interval(q[1], q, one)

    ref, mu, pmu = s["reference"], s["mu_measured"], s["paper_mu"]
    target = fmt_acc(s["target_greedy_acc"])
    lines = [
        "# Replay-GRPO study",
        "",
        f"Final held-out accuracy as median [IQR] over seeds (greedy decoding; pass@1 at temperature 0.1, "
        f"top-p 0.95; pass@k at temperature 1). Reference: **{ref}**, whose final median greedy accuracy "
        f"{target} is the target: "
        "'to target' is the generated tokens / compute at the first evaluation where a configuration's "
        "median greedy accuracy reaches it (— never), 'saving' is 1 − ours / reference's.",
        f"Compute units: training on a rollout costs 1, generating one costs mu; compute = trained rollouts "
        f"+ mu × generated rollouts. 'meas.' uses mu = {fmt_mu(mu)} (median of the runs' measured mu on this "
        f"machine), 'paper' uses mu = {pmu:g}. Replay ratio: trained / generated rollouts; staleness: "
        "optimizer steps between a rollout's generation and its use, averaged over every use.",
        "",
        "| config | lr | seeds | steps | greedy acc | pass@1 | pass@k | gen. tokens | mu (meas.) | replay ratio "
        "| staleness | tokens to target | saving | compute (meas.) to target | saving "
        "| compute (paper) to target | saving |",
        "|" + "---|" * 17,
    ]
    for c, r in s["configs"].items():
        cells = [
            c,
            f"{r['lr']:g}" + ("*" if c in s["lr_choice"] else ""),
            len(r["seeds"]),
            r["steps"],
            fmt_quartiles(r["greedy_acc"]),
            fmt_quartiles(r["pass@1"]),
            f"pass@{r['k']} {fmt_quartiles(r['pass@k'])}",
            fmt(r["generated_tokens"]),
            fmt_mu(r["mu"]),
            f"{r['replay_ratio']:.2f}",
            f"{r['staleness']:.2f}",
        ]
        for axis in ("tokens", "compute_measured_mu", "compute_paper_mu"):
            cells += [fmt(r[f"{axis}_to_target"]), fmt_saving(r[f"{axis}_saving_pct"], digits=1)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if ref is not None and s["configs"][ref]["tokens_to_target"] == 0:
        lines += [
            "",
            f"Note: {ref}'s median accuracy is at the target already at step 0 (before any RL), "
            "so the savings are undefined: train longer or with a weaker warm start.",
        ]
    if "bootstrap" in s:
        iv = s["bootstrap"]["intervals"]
        lines += [
            "",
            f"## Cost to reach {ref}'s final median accuracy ({target}) and 90% of it",
            "",
            f"Median and bootstrap 90% interval ({s['bootstrap']['replicates']} resamples of the seeds of each "
            "configuration; the target recomputed from each resample of the reference). 'never': not reached "
            "within the run. Saving = 1 − ours / reference's.",
            "",
            "| config | reaches | gen. tokens | saving | compute (meas. mu) | saving | compute (paper mu) | saving |",
            "|" + "---|" * 8,
        ]
        for c in s["configs"]:
            for f in ("target", "90% of target"):
                cells = [c, f]
                for axis in ("tokens", "compute_measured_mu", "compute_paper_mu"):
                    saving = "—" if c == ref else bootstrap(iv[c]["saving"][axis][f], fmt_saving)
                    cells += [bootstrap(iv[c]["cost"][axis][f], fmt_cost), saving]
                lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            f"## Accuracy at equal compute (the compute {ref} used in its whole run)",
            "",
            "Median greedy accuracy and pass@k at the last evaluation within that compute, bootstrap 90% interval.",
            "",
            "| config | greedy acc (meas. mu) | pass@k (meas. mu) | greedy acc (paper mu) | pass@k (paper mu) |",
            "|" + "---|" * 5,
        ]
        for c in s["configs"]:
            cells = [
                bootstrap(iv[c]["at_equal"][a][w], fmt_acc)
                for a in ("compute_measured_mu", "compute_paper_mu")
                for w in ("acc", "pass@k")
            ]
            lines.append("| " + " | ".join([c] + cells) + " |")
        target_pct = f"{s['saving_target']:g}%"
        lines += [
            "",
            f"## Decision: >= {target_pct} fewer generated tokens and >= {target_pct} less "
            f"compute at the paper's mu, to {ref}'s final median accuracy",
            "",
            "met: the whole 90% interval of the saving is at or above the target; not met: the whole interval is "
            "below it; not resolvable: the interval straddles it (or the target was not reached).",
            "",
        ]
        for c, d in s["decision"].items():
            lines.append(f"- {c}: tokens {d['tokens']}, compute at paper mu {d['compute_paper_mu']}: **{d['both']}**")
    if any(r.get("by_staleness") for r in s["configs"].values()):
        lines += [
            "",
            "## What a step trains on, by staleness",
            "",
            "Over every step and seed: the share of trained rollouts in each staleness bucket (optimizer steps "
            "since generation) and, weighted by tokens, the clip fraction, the mean |log ratio| to the "
            "behaviour policy and the effective sample size of the token ratios per token ((sum w)^2 / sum "
            "w^2 over the tokens: 1 when all ratios are equal).",
            "",
            "| config | staleness | share of rollouts | clip fraction | mean abs log ratio | ESS per token |",
            "|" + "---|" * 6,
        ]
        for c, r in s["configs"].items():
            for label, b in (r.get("by_staleness") or {}).items():
                lines.append(
                    f"| {c} | {label} | {b['share']:.3f} | {b['clip_frac']:.4f} | "
                    f"{b['abs_log_ratio']:.4f} | {b['ess_per_token']:.4f} |"
                )
    if s.get("per_seed"):
        lines += [
            "",
            "## Seeds",
            "",
            "| config | seed | warm start reached | pass@k after it | greedy start | greedy final |",
            "|" + "---|" * 6,
        ]
        for c, rows in s["per_seed"].items():
            for r in rows:
                lines.append(
                    f"| {c} | {r['seed']} | {r['warmstart_reached']} | {fmt_acc(r['warmstart_pass@k'])} | "
                    f"{fmt_acc(r['greedy_acc_start'])} | {fmt_acc(r['greedy_acc_final'])} |"
                )
    if s["lr_choice"]:
        tuned = s.get("tune_seeds")
        lines += [
            "",
            "## Learning rate (*)",
            "",
            "Configurations run with several learning rates (and delta_V) keep the one with the best median "
            "final greedy accuracy (ties: pass@1, then the smaller lr), chosen "
            + (
                f"on seeds {', '.join(map(str, tuned))}, which are not reported:"
                if tuned
                else "on the same seeds it is reported on:"
            ),
            "",
        ]
        for c in s["configs"]:
            if c in s["lr_choice"]:
                note = s["lr_choice"][c]
                tried = ", ".join(f"{label}: {acc:.3f}" for label, acc in note["median_final_greedy_acc"].items())
                lines.append(f"- {c}: {note['label']} picked (median final greedy accuracy {tried})")
    return "\n".join(lines) + "\n"


def plot(s: dict, out_dir: Path) -> list[Path]:
    """The figures: median over seeds, shaded IQR, one line per configuration (its best lr); the histograms of
    staleness and replay ratio; the metrics by staleness where the runs logged them."""
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
        written.append(save_figure(fig, out_dir / name, bbox_inches="tight"))

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

    def step_of(r):
        return r["step"]

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lines(a, "eval/greedy_acc", step_of, "gradient steps", "held-out greedy accuracy")
    lines(
        b,
        lambda c: f"eval/pass@{s['configs'][c]['k']}",
        step_of,
        "gradient steps",
        "held-out pass@k (k samples, temperature 1)",
        show_target=False,
    )
    fig.suptitle("Held-out accuracy vs gradient steps (median, IQR over seeds)")
    legend(b)
    save(fig, "accuracy_vs_steps.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    lines(
        ax,
        "eval/greedy_acc",
        lambda r: r.get("total_generated_tokens", 0),
        "generated tokens",
        "held-out greedy accuracy",
    )
    ax.set_title("Held-out accuracy vs generated tokens")
    legend(ax)
    save(fig, "accuracy_vs_tokens.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (mu, what) in zip(axes, [(s["mu_measured"], "measured on this machine"), (s["paper_mu"], "the paper's")]):
        lines(
            ax,
            "eval/greedy_acc",
            lambda r, mu=mu: compute(r, mu),
            "compute = trained + mu x generated rollouts",
            "held-out greedy accuracy",
        )
        ax.set_title(f"mu = {mu:.2f} ({what})")
    fig.suptitle("Held-out accuracy vs compute (training a rollout = 1 unit, generating one = mu units)")
    legend(axes[1])
    save(fig, "accuracy_vs_compute.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    lines(
        ax,
        "entropy",
        step_of,
        "gradient steps",
        "policy entropy on the batch (nats/token)",
        eval_only=False,
        show_target=False,
    )
    ax.set_title("Training entropy")
    legend(ax)
    save(fig, "entropy.png")

    def hists(name, title, xlabel, counts_of):
        n = len(runs)
        ncol = min(4, n)
        nrow = math.ceil(n / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.3 * ncol, 2.7 * nrow), squeeze=False, sharex=True, sharey=True)
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

    hists(
        "staleness_hist.png",
        "Staleness of each use (steps since generation), all steps and seeds",
        "staleness (optimizer steps)",
        lambda r: Counter(
            [int(k) for rec in r["records"] for k, v in rec.get("staleness_hist", {}).items() for _ in range(v)]
        ),
    )
    hists(
        "replay_ratio_hist.png",
        "Replay ratio per rollout: times each evicted rollout was trained on",
        "uses",
        lambda r: Counter({int(u): n for u, n in r["records"][-1].get("replay_hist", {}).items()}),
    )

    by_config = {c: s["configs"][c]["by_staleness"] for c in runs if s["configs"][c].get("by_staleness")}
    if by_config:  # runs that logged the metrics by staleness
        buckets = sorted({b for d in by_config.values() for b in d}, key=bucket_order)
        fig, axes = plt.subplots(1, len(BUCKET_PANELS), figsize=(4 * len(BUCKET_PANELS), 3.6))
        for ax, (key, ylabel) in zip(axes, BUCKET_PANELS):
            for c, d in by_config.items():
                xs = [i for i, b in enumerate(buckets) if b in d]
                ax.plot(
                    xs,
                    [d[buckets[i]][key] for i in xs],
                    marker="o",
                    color=color[c],
                    lw=2.2 if c == ref else 1.4,
                    label=label[c],
                )
            ax.set_xticks(range(len(buckets)), buckets)
            ax.set_xlabel("staleness (optimizer steps)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        legend(axes[-1])
        fig.suptitle("What a step trains on, by staleness (all steps and seeds)")
        save(fig, "staleness_metrics.png")
    return written


BUCKET_PANELS = [
    ("share", "share of trained rollouts"),
    ("clip_frac", "clip fraction"),
    ("abs_log_ratio", "mean |log ratio| per token"),
    ("ess_per_token", "ESS per token"),
]


def report(args: ReportArgs) -> dict:
    out = Path(args.out_dir)
    runs = load_runs(out) if out.is_dir() else []
    if not runs:
        raise SystemExit(f"error: no finished runs in {out} (python tools/sweep.py run --out-dir {out})")
    sweep_json = out / "sweep.json"  # the tune seeds that `run` used
    tune_seeds = args.tune_seeds
    if not tune_seeds and sweep_json.exists():
        tune_seeds = read_sweep_json(sweep_json)["tune_seeds"]
    s = summarize(runs, args.reference, args.paper_mu, tune_seeds, args.saving_target)
    if not s["configs"]:
        raise SystemExit(f"error: {out} has finished runs only on the tune seeds {tune_seeds}, none on reported seeds")
    write_report(Path(args.report_dir or out), s, private="_runs", table_md=table_md, plot=plot)
    return s


# ----------------------------------------------------------------------------------------------
# plot: one run's curves
# ----------------------------------------------------------------------------------------------


def save_run_figure(fig, title: str, out: Path) -> Path:
    """Title, lay out and write one of plot_run's figures; an unwritable folder stops with one line."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise SystemExit(f"error: {out.parent}: cannot write {out.name} ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out


def plot_run(run_dir: Path) -> list[Path]:
    """<run>/curves_vs_steps.png and curves_vs_tokens.png from <run>/metrics.jsonl: held-out accuracy and
    pass@k, reward, entropy, response length and truncated fraction, staleness, replay ratio; and
    staleness_vs_steps.png, the metrics by staleness bucket (rollouts, clip fraction, |log ratio|, ESS)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(
            f"error: {run_dir} has no metrics.jsonl: give a run folder (e.g. runs/NAME, written by replay_grpo.py)"
        )
    try:
        recs = read_metrics(path)
        cfg = read_json(run_dir / "config.json") if (run_dir / "config.json").exists() else {}
    except Damaged as e:
        raise SystemExit(f"error: {run_dir}: a file is damaged: {e}") from None
    steps = [r for r in recs if r["step"] > 0]
    if not steps:
        raise SystemExit(f"error: {path} holds no training step yet")
    k = cfg.get("pass_k", 8)
    R = cfg.get("prompts_per_step", 0) * cfg.get("group_size", 0)
    mu = steps[-1].get("mu")
    title = (
        f"{run_dir.name}: {cfg.get('loss', '?')}, N = {cfg.get('buffer_size', '?')}, "
        f"B = {cfg.get('batch_size', '?')}, R = {R or '?'}, k = {cfg.get('publish_every', '?')}, "
        f"lr {cfg.get('lr', '?')}" + (f"; measured mu = {mu:.2f}" if mu is not None else "")
    )
    panels = [
        (
            "held-out accuracy",
            [("eval/greedy_acc", "greedy"), ("eval/pass@1", "pass@1 (T 0.1)"), (f"eval/pass@{k}", f"pass@{k} (T 1)")],
        ),
        ("reward", [("reward", "fresh rollouts"), ("reward_batch", "trained batch")]),
        ("entropy (nats/token)", [("entropy", "trained tokens")]),
        ("response length (tokens)", [("response_length", "mean"), ("truncated_frac", "truncated fraction (right)")]),
        ("staleness (steps)", [("staleness_mean", "mean"), ("staleness_max", "max")]),
        ("replay ratio", [("replay_ratio", "trained / generated rollouts")]),
    ]
    written = []
    for xname, xkey, xlabel in (
        ("steps", "step", "gradient steps"),
        ("tokens", "total_generated_tokens", "generated tokens"),
    ):
        fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
        for ax, (ylabel, series) in zip(axes.flat, panels):
            for key, label in series:
                pts = [(r.get(xkey, 0), r[key]) for r in recs if r.get(key) is not None]
                target = ax.twinx() if key == "truncated_frac" else ax
                if pts:
                    target.plot(
                        *zip(*pts),
                        marker="o" if key.startswith("eval/") else None,
                        ms=3,
                        label=label,
                        color="grey" if key == "truncated_frac" else None,
                        lw=1.4,
                    )
                if key == "truncated_frac":
                    target.set_ylim(0, 1)
                    target.legend(loc="upper right", fontsize=8, frameon=False)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", fontsize=8, frameon=False)
        written.append(save_run_figure(fig, title, run_dir / f"curves_vs_{xname}.png"))
    with_buckets = [r for r in steps if r.get("by_staleness")]
    if with_buckets:  # the metrics by staleness: one line per bucket
        buckets = sorted({b for r in with_buckets for b in r["by_staleness"]}, key=bucket_order)
        fig, axes = plt.subplots(1, 4, figsize=(16, 4.5))
        for ax, (key, ylabel) in zip(
            axes, [("rollouts", "trained rollouts"), *BUCKET_PANELS[1:3], ("ess_per_token", "ESS per token")]
        ):
            for b in buckets:
                pts = []
                for r in with_buckets:
                    m = r["by_staleness"].get(b)
                    if m is not None:
                        value = m["ess"] / m["tokens"] if key == "ess_per_token" else m[key]
                        pts.append((r["step"], value))
                ax.plot(*zip(*pts), lw=1.2, label=f"staleness {b}")
            ax.set_xlabel("gradient steps")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend(loc="upper left", fontsize=8, frameon=False)
        written.append(save_run_figure(fig, title, run_dir / "staleness_vs_steps.png"))
    print("wrote", ", ".join(map(str, written)))
    return written


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--extra" in argv:  # everything after it is for the trainer, verbatim
        i = argv.index("--extra")
        argv, extra = argv[:i], argv[i + 1 :]
    commands = {"run": RunArgs, "report": ReportArgs, "render": RenderArgs, "plot": PlotArgs}
    args = tyro.extras.subcommand_cli_from_dict(
        commands, args=argv, prog="sweep.py", description=__doc__.split("\n\n")[0]
    )
    if extra and not isinstance(args, RunArgs):
        raise SystemExit("error: --extra is for sweep.py run (trainer flags)")
    if isinstance(args, PlotArgs):
        return plot_run(Path(args.run_folder))
    if isinstance(args, RenderArgs):
        summary = Path(args.summary)
        return render(summary, Path(args.table) if args.table else summary.with_name("table.md"))
    if isinstance(args, ReportArgs):
        return report(args)
    args.extra = extra
    return run(args)


def cli(main) -> None:
    """A tool's entry point: main's one-line error (a SystemExit with a message) goes to stderr with exit status 2,
    as replay_grpo.py's errors do; any other exit keeps its status."""
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    cli(main)
