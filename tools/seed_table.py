"""seed_table.py: run a preset on many seeds as a new user would, and tabulate what each seed gained.

    python tools/seed_table.py --seeds 0 1 2 3 4                        # --preset cpu, into runs/seeds
    python tools/seed_table.py --preset cpu --seeds $(seq 200 219) --table docs/cpu_seeds.md

Each seed is `python replay_grpo.py --preset P --seed S` in a subprocess, one after another, run by sweep.py's
runner (the same claims, locks and failures as a sweep's runs), with its own warm-start cache (under --out-dir/S),
so every wall time includes the warm start as a first run's does.
A seed whose run finished (its record at --total-steps and its wall time in seed_table.json) is not run
again; a partial one is deleted and run again (a resumed run's wall time would not be a whole run's).
The table gives, per seed, the warm start's steps, held-out greedy accuracy at step 0 and at the end, the
gain in points and the wall time; below it the minimum, median and maximum gain and wall time.
"""

import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import sweep
import tyro


@dataclass
class Args:
    """Run --preset on every seed of --seeds (skipping finished ones) and write the per-seed table."""

    preset: str = "cpu"
    """the replay_grpo.py preset every seed runs."""
    seeds: list[int] = field(default_factory=lambda: list(range(5)))
    """the seeds, run one after another."""
    out_dir: str = "runs/seeds"
    """folder of the per-seed folders (each holds its run and its warm-start cache) and seed_table.json."""
    table: str | None = None
    """also write the markdown table here (it is always printed): between the lines <!-- seed_table --> and
    <!-- /seed_table --> when the file has them, else as the whole file."""
    extra: list[str] = field(default_factory=list)
    """trainer flags for every seed, e.g. --extra --total-steps 50 --lr 1e-4. Must come last: everything after
    it is passed to replay_grpo.py as it is."""


def finished(seed: int, run_dir: Path) -> dict | None:
    """The run's first and last records if its metrics.jsonl holds its final evaluation, else None (a damaged file
    is said in one line: the seed is then run again)."""
    if not (run_dir / "metrics.jsonl").exists():
        return None
    try:
        records = sweep.read_metrics(run_dir / "metrics.jsonl")
        total_steps = sweep.read_json(run_dir / "config.json").get("total_steps")
    except sweep.Damaged as e:
        print(f"seed {seed}: a file is damaged, the seed is run again: {e}", flush=True)
        return None
    last = [r for r in records if r["step"] == total_steps and "eval/greedy_acc" in r]
    if not last or "eval/greedy_acc" not in records[0]:  # records[0]: step 0, evaluated after the warm start
        return None
    return {"first": records[0], "last": last[0]}


def read_times(path: Path) -> dict:
    """seed_table.json: each finished seed's wall time in seconds ({} before the first); a damaged one stops with
    one line, as the wall times it holds cannot be measured again without running every seed again."""
    if not path.exists():
        return {}
    try:
        times = sweep.read_json(path)
    except sweep.Damaged as e:
        times = str(e)
    if isinstance(times, str) or not all(type(v) in (int, float) for v in times.values()):
        raise SystemExit(
            f"error: {times if isinstance(times, str) else f'{path}: not a wall time in seconds per seed'}: "
            "restore it, or delete it to run every seed again"
        )
    return times


def record_time(path: Path, seed: int, seconds: float) -> None:
    """A seed's wall time into seed_table.json, merged under the file's claim with what other processes wrote
    (two seed_table.py on one folder each keep the other's times), and replaced whole."""
    fd = sweep.claim(path, wait=True)
    try:
        times = read_times(path)
        times[str(seed)] = seconds
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(times, indent=1))
        os.replace(tmp, path)
    finally:
        os.close(fd)


def seed_run(args: Args, seed: int, times_file: Path) -> dict:
    """One seed's run for sweep.py's runner: done when its run holds its final evaluation and seed_table.json its
    wall time (decided under the run's claim), else run again from nothing, its warm-start cache deleted too."""
    folder = Path(args.out_dir) / str(seed)

    def status(run: dict) -> str:
        if not run["run_dir"].exists():
            return "new"
        return "done" if finished(seed, run["run_dir"]) and str(seed) in read_times(times_file) else "restart"

    return {
        "name": f"seed {seed}",
        "run_dir": folder / "run",
        "clear": [folder / ".warmstart"],
        "status": status,
        "argv": ["--preset", args.preset, "--seed", str(seed), "--out-dir", str(folder), "--run-name", "run"]
        + args.extra,
    }


def table_md(rows: list[dict]) -> str:
    """The per-seed markdown table and its summary line."""
    lines = [
        "| seed | warm-start steps | held-out greedy accuracy, step 0 -> end | gain | wall time |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['warmstart_steps']} | {r['start']:.3f} -> {r['end']:.3f} "
            f"| {r['gain']:+.1f} | {r['seconds']:.0f} s |"
        )
    gains = [r["gain"] for r in rows]
    seconds = [r["seconds"] for r in rows]
    lines.append("")
    lines.append(
        f"{len(rows)} seeds: gain min {min(gains):+.1f}, median {statistics.median(gains):+.1f}, "
        f"max {max(gains):+.1f} points; wall time min {min(seconds):.0f} s, "
        f"median {statistics.median(seconds):.0f} s, max {max(seconds):.0f} s"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--extra" in argv:  # everything after it is for the trainer, verbatim
        argv, extra = argv[: argv.index("--extra")], argv[argv.index("--extra") + 1 :]
    args = tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0])
    args.extra = extra
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    times_file = out / "seed_table.json"
    read_times(times_file)  # a damaged one stops here, before any seed runs
    rows, others = [], []
    for seed in args.seeds:
        done = sweep.execute(
            [seed_run(args, seed, times_file)],
            in_subprocess=True,
            quiet=True,
            on_trained=lambda run, seconds, seed=seed: record_time(times_file, seed, seconds),
        )
        if done["failed"]:  # the trainer printed why on stderr
            raise SystemExit(f"error: seed {seed}: replay_grpo.py failed")
        if done["skipped"]:  # another process trains it
            others.append(seed)
            continue
        records, times = finished(seed, out / str(seed) / "run"), read_times(times_file)
        if records is None or str(seed) not in times:
            raise SystemExit(f"error: seed {seed}: the run ended without its final evaluation")
        start, end = records["first"]["eval/greedy_acc"], records["last"]["eval/greedy_acc"]
        rows.append(
            {
                "seed": seed,
                "warmstart_steps": records["first"].get("warmstart_steps", 0),
                "start": start,
                "end": end,
                "gain": round(100 * (end - start), 1),
                "seconds": times[str(seed)],
            }
        )
    if others:
        raise SystemExit(
            f"error: seeds {', '.join(map(str, others))} are another process's runs, not finished: the table needs "
            "every seed, run this again when it ends"
        )
    text = table_md(rows)
    print(text, end="")
    if args.table:
        place_table(Path(args.table), text)
    return rows


def place_table(path: Path, text: str) -> None:
    """The table into its place in `path` (between the markers), or as the whole file."""
    start, end = "<!-- seed_table -->\n", "<!-- /seed_table -->"
    old = path.read_text() if path.exists() else ""
    if start in old and end in old:
        text = old[: old.index(start) + len(start)] + text + old[old.index(end) :]
    path.write_text(text)


if __name__ == "__main__":
    sweep.cli(main)
