"""sweep.py: run a grid of replay-GRPO configurations x seeds, then tabulate and plot the study.

    python tools/sweep.py run --out-dir runs/study --seeds 0 1 2            # the default grid, resumable
    python tools/sweep.py run --out-dir runs/smoke --grid smoke --seeds 0 1 # 2 tiny configs (seconds)
    python tools/sweep.py run --out-dir runs/study --seeds 0 --extra --total-steps 50 --eval-every 10
    python tools/sweep.py report --out-dir runs/study                       # table.md, summary.json, PNGs
    python tools/sweep.py plot runs/NAME                                    # one run's curves, into its folder
    python tools/sweep.py render docs/study/summary.json                    # its table.md again, from the summary
    python tools/sweep.py run --grid pareto --out-dir runs/pareto --seeds 0 1 2  # the Pareto study (report: pareto.py)
    python tools/sweep.py run --grid compute --out-dir runs/compute --seeds 20 21  # report: compute_study.py

Each run (runner.execute) is named after its configuration: onpolicy-s0, N512-R32-grpo-s0, N512-R32-grpo-d0.2-s0,
N512-R32-grpo-lr5e-05-s0 (when the grid entry tries several lrs), ... `report` is the replay study's (replay_study.py).
"""

import itertools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import compute_study
import corrections_study
import failed_replay_study
import pareto
import real_model_study
import real_replay_study
import replay_study
import tyro
from replay_study import BUCKET_PANELS, is_on_policy, pick_variants
from studylib import runner
from studylib.report import bucket_order, label_axes, pyplot, save_figure
from studylib.runner import Damaged, claim, cli, execute, load_runs, read_json, read_metrics, run_status

# A grid is (flags for every run, configurations), each configuration a dict of replay_grpo flags (replay_grpo Args
# field names). "lr" may be a list: each lr is run and the report keeps the best per configuration. "name" overrides
# the derived run name.
GRIDS = {
    "study": replay_study.STUDY_GRID,
    "cpu": replay_study.DEFAULT_GRID,
    "smoke": replay_study.SMOKE_GRID,
    "variants": replay_study.VARIANTS_GRID,
    "pareto": pareto.PARETO_GRID,
    "compute": compute_study.COMPUTE_GRID,
    "compute-replication": compute_study.REPLICATION_GRID,
    "corrections": corrections_study.CORRECTIONS_GRID,
}


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
    grid: Literal[*GRIDS] = "study"
    """which grid of GRIDS, each defined in its study's module (cpu: the first study's; smoke: 2 tiny configs)."""
    only: list[str] = field(default_factory=list)
    """only configurations whose name contains one of these strings (none given: all)."""
    subprocess: bool = False
    """start each run as `python replay_grpo.py ...` instead of calling it in this process (frees all memory
    between runs; worth it on GPU)."""
    extra: list[str] = field(default_factory=list)
    """trainer flags for every run, e.g. --extra --total-steps 50 --lr 1e-4. Must come last: everything after
    --extra goes to replay_grpo.py verbatim. Flags set by a grid entry win."""


@dataclass
class RenderArgs:
    """table.md rendered again from a study's summary.json (any study report's): a function of the summary alone."""

    summary: tyro.conf.Positional[str]
    """the report's summary.json."""
    table: str | None = None
    """where the table goes (default: table.md beside the summary)."""


@dataclass
class PlotArgs:
    """One run's curves against steps and generated tokens (curves_vs_*.png), written into its folder."""

    run_folder: tyro.conf.Positional[str]
    """the run folder (runs/NAME)."""


@dataclass
class RecordsArgs:
    """The finished runs of a folder as a records file (runner.compact_runs), e.g. to pool with later seeds."""

    out_dir: tyro.conf.Positional[str]
    """the sweep's folder."""
    to: str
    """the records file to write: records.json.xz (xz-compressed, as the reports write it), .json.gz, .json.bz2 or
    .json."""
    seeds: list[int] | None = None
    """only these seeds (default: every finished run's)."""
    pool_records: str | None = None
    """an earlier records file whose runs are written with these (it may be --to itself); a run in both stops."""


def flags(entry: dict) -> list[str]:
    """{"buffer_size": 512} -> ["--buffer-size", "512"] (booleans: --x / --no-x)."""
    out = []
    for k, v in entry.items():
        k = "--" + k.replace("_", "-")
        out += [k] if v is True else [k.replace("--", "--no-", 1)] if v is False else [k, str(v)]
    return out


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


# replay_grpo's rule flags, and their tags in a configuration's name
RULE_TAGS = dict(sampling="", max_age="age", max_uses="uses", priority_alpha="a", priority_tau="tau", ratio_level="")


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
    """Every (configuration, variant, seed) of the grid as runner.execute's run. seeds: default --tune-seeds, or
    --seeds without them. picks: only the picked variant of each configuration ({config: variant tag})."""
    import replay_grpo
    from infra.run_folder import UserError

    base, entries = GRIDS[args.grid]
    seeds = seeds if seeds is not None else (args.tune_seeds or args.seeds)
    runs, owner = [], {}
    for i, entry in enumerate(entries):
        for fixed, varied, tag in variants(entry):
            argv = base + list(args.extra) + flags(fixed) + flags(varied)
            try:
                cfg = replay_grpo.parse_args(argv)
            except UserError as e:  # a bad --extra flag: one line, as the trainer says it
                raise SystemExit(f"error: {e}") from None
            config = entry.get("name") or config_name(vars(cfg))
            if args.only and not any(s in config for s in args.only):
                continue
            if picks is not None and picks.get(config) != tag:
                continue
            variant = config + tag
            if owner.setdefault(variant, i) != i:
                raise SystemExit(
                    f"error: grid entries {owner[variant]} and {i} are both named {variant!r}: give one a 'name'"
                )
            for seed in seeds:
                name = f"{variant}-s{seed}"
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


def record_sweep(out_dir: Path, args: RunArgs) -> None:
    """sweep.json: the grid, and every seed and tune seed run into this folder so far (the report leaves the
    tune seeds out). Several `run` processes share a folder: each merges its seeds under the file's claim, and the
    file is replaced whole. A damaged sweep.json stops the run with one line (what it recorded is unknown)."""
    path, seeds, tune_seeds = out_dir / "sweep.json", set(args.seeds), set(args.tune_seeds)
    fd = claim(path, wait=True)
    try:
        if path.exists():
            before = runner.read_sweep_json(path)
            seeds |= set(before["seeds"])
            tune_seeds |= set(before["tune_seeds"])
        tmp = out_dir / f".sweep.json.{os.getpid()}"
        recorded = {"grid": args.grid, "seeds": sorted(seeds), "tune_seeds": sorted(tune_seeds), "extra": args.extra}
        tmp.write_text(json.dumps(recorded, indent=2))
        os.replace(tmp, path)
    finally:
        os.close(fd)


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
    if others := others_still_train(runs, done):
        then = " (then the variants are picked and --seeds run)" if args.tune_seeds else ""
        return print(
            f"{len(others)} run(s) are another process's, not finished yet: {', '.join(others)}; run this again "
            f"when it ends{then}"
        )
    print(f"all runs finished in {args.out_dir}; next: python tools/sweep.py report --out-dir {args.out_dir}")


def others_still_train(runs: list[dict], done: dict) -> list[str]:
    """The runs execute skipped as another process's that are not finished now."""
    skipped = [r for r in runs if r["name"] in done["skipped"]]
    return [r["name"] for r in skipped if run_status(r["run_dir"], r["total_steps"]) != "done"]


def render(summary_path: Path, table_path: Path) -> None:
    """table.md rendered again from any study's summary.json: the same bytes its report wrote."""
    try:
        summary = read_json(summary_path)
    except Damaged as e:
        raise SystemExit(f"error: {e}") from None
    by_key = {"comparisons": corrections_study, "aa": compute_study, "interval_90": pareto}  # a key of its own
    by_key |= {"real_model": real_model_study, "real_replay": real_replay_study, "failed_replay": failed_replay_study}
    study = next((module for key, module in by_key.items() if key in summary), replay_study)
    try:
        table_path.write_text(study.table_md(summary))
    except OSError as e:
        raise SystemExit(f"error: cannot write {table_path} ({e.strerror or e})") from None
    print("wrote", table_path)


def plot_run(run_dir: Path) -> list[Path]:
    """<run>/curves_vs_steps.png and curves_vs_tokens.png from <run>/metrics.jsonl: held-out accuracy and
    pass@k, reward, entropy, response length and truncated fraction, staleness, replay ratio; and
    staleness_vs_steps.png, the metrics by staleness bucket (rollouts, clip fraction, |log ratio|, ESS)."""
    plt, path, written = pyplot(), run_dir / "metrics.jsonl", []
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
    k, R, mu = cfg.get("pass_k", 8), cfg.get("prompts_per_step", 0) * cfg.get("group_size", 0), steps[-1].get("mu")
    title = (
        f"{run_dir.name}: {cfg.get('loss', '?')}, N = {cfg.get('buffer_size', '?')}, "
        f"B = {cfg.get('batch_size', '?')}, R = {R or '?'}, k = {cfg.get('publish_every', '?')}, "
        f"lr {cfg.get('lr', '?')}" + (f"; measured mu = {mu:.2f}" if mu is not None else "")
    )

    def save(fig, name: str) -> None:  # an unwritable folder stops with one line
        fig.suptitle(title, fontsize=10)
        try:
            written.append(save_figure(fig, run_dir / name, dpi=100))
        except OSError as e:
            raise SystemExit(f"error: {run_dir}: cannot write {name} ({e.strerror or e})") from None

    accuracy = [("eval/greedy_acc", "greedy"), ("eval/pass@1", "pass@1 (T 0.1)"), (f"eval/pass@{k}", f"pass@{k} (T 1)")]
    panels = [
        ("held-out accuracy", accuracy),
        ("reward", [("reward", "fresh rollouts"), ("reward_batch", "trained batch")]),
        ("entropy (nats/token)", [("entropy", "trained tokens")]),
        ("response length (tokens)", [("response_length", "mean"), ("truncated_frac", "truncated fraction (right)")]),
        ("staleness (steps)", [("staleness_mean", "mean"), ("staleness_max", "max")]),
        ("replay ratio", [("replay_ratio", "trained / generated rollouts")]),
    ]
    for xname, xkey, xlabel in (
        ("steps", "step", "gradient steps"),
        ("tokens", "total_generated_tokens", "generated tokens"),
    ):
        fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
        for ax, (ylabel, series) in zip(axes.flat, panels):
            for key, label in series:
                pts = [(r.get(xkey, 0), r[key]) for r in recs if r.get(key) is not None]
                fraction = key == "truncated_frac"  # on its own axis, at the right
                target = ax.twinx() if fraction else ax
                if pts:
                    marker, color = "o" if key.startswith("eval/") else None, "grey" if fraction else None
                    target.plot(*zip(*pts), marker=marker, ms=3, label=label, color=color, lw=1.4)
                if fraction:
                    target.set_ylim(0, 1)
                    target.legend(loc="upper right", fontsize=8, frameon=False)
            label_axes(ax, xlabel=xlabel, ylabel=ylabel)
            ax.legend(loc="upper left", fontsize=8, frameon=False)
        save(fig, f"curves_vs_{xname}.png")
    with_buckets = [r for r in steps if r.get("by_staleness")]
    if with_buckets:  # the metrics by staleness: one line per bucket
        buckets = sorted({b for r in with_buckets for b in r["by_staleness"]}, key=bucket_order)
        fig, axes = plt.subplots(1, 4, figsize=(16, 4.5))
        for ax, (key, ylabel) in zip(axes, [("rollouts", "trained rollouts"), *BUCKET_PANELS[1:]]):
            for b in buckets:
                at = [(r["step"], r["by_staleness"][b]) for r in with_buckets if r["by_staleness"].get(b) is not None]
                pts = [(step, m["ess"] / m["tokens"] if key == "ess_per_token" else m[key]) for step, m in at]
                ax.plot(*zip(*pts), lw=1.2, label=f"staleness {b}")
            label_axes(ax, xlabel="gradient steps", ylabel=ylabel)
        axes[0].legend(loc="upper left", fontsize=8, frameon=False)
        save(fig, "staleness_vs_steps.png")
    print("wrote", ", ".join(map(str, written)))
    return written


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--extra" in argv:  # everything after it is for the trainer, verbatim
        i = argv.index("--extra")
        argv, extra = argv[:i], argv[i + 1 :]
    commands = dict(run=RunArgs, report=replay_study.Args, render=RenderArgs, plot=PlotArgs, records=RecordsArgs)
    args = tyro.extras.subcommand_cli_from_dict(
        commands, args=argv, prog="sweep.py", description=__doc__.split("\n\n")[0]
    )
    if extra and not isinstance(args, RunArgs):
        raise SystemExit("error: --extra is for sweep.py run (trainer flags)")
    if isinstance(args, PlotArgs):
        return plot_run(Path(args.run_folder))
    if isinstance(args, RecordsArgs):
        runner.check_records_path(Path(args.to), "--to")  # before the runs are read
        runs = [r for r in load_runs(Path(args.out_dir), quiet=True) if args.seeds is None or r["seed"] in args.seeds]
        if args.pool_records:
            kept = runner.load_records(Path(args.pool_records), "--pool-records")
            runs = runner.pool(kept, runs, args.pool_records, args.out_dir)
        data = runner.compact_runs(runs)
        runner.refuse_non_finite(data["runs"], lambda run, i: str(Path(args.out_dir) / run["name"]))
        runner.write_records(Path(args.to), data, "--to")
        print(f"wrote {args.to}: {len(runs)} finished run(s), seeds {sorted({r['seed'] for r in runs})}")
        return {"runs": len(runs)}
    if isinstance(args, RenderArgs):
        summary = Path(args.summary)
        return render(summary, Path(args.table) if args.table else summary.with_name("table.md"))
    if isinstance(args, replay_study.Args):
        return replay_study.write(args)
    args.extra = extra
    return run(args)


if __name__ == "__main__":
    cli(main)
