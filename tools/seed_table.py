"""seed_table.py: run a preset on many seeds as a new user would, and tabulate what each seed gained.

    python seed_table.py --seeds 0 1 2 3 4                        # --preset cpu, into runs/seeds
    python seed_table.py --preset cpu --seeds $(seq 0 19) --table docs/cpu_seeds.md

Each seed is `python replay_grpo.py --preset P --seed S` in a subprocess, one after another, with its own
warm-start cache (under --out-dir/S), so every wall time includes the warm start as a first run's does.
A seed whose run finished (its record at --total-steps and its wall time in seed_table.json) is not run
again; a partial one is deleted and run again (a resumed run's wall time would not be a whole run's).
The table gives, per seed, the warm start's steps, held-out greedy accuracy at step 0 and at the end, the
gain in points and the wall time; below it the minimum, median and maximum gain and wall time.
"""

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

TRAINER = Path(__file__).resolve().parent.parent / "replay_grpo.py"


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


def finished(record_file: Path) -> dict | None:
    """The run's first and last records if its metrics.jsonl holds its final evaluation, else None."""
    if not record_file.exists():
        return None
    records = [json.loads(line) for line in record_file.read_text().splitlines() if line.strip()]
    config = json.loads((record_file.parent / "config.json").read_text())
    last = [r for r in records if r.get("step") == config["total_steps"] and "eval/greedy_acc" in r]
    return {"first": records[0], "last": last[0]} if last else None


def run_seed(args: Args, seed: int) -> float:
    """One seed's run from nothing (its folder deleted first); returns its wall time in seconds."""
    folder = Path(args.out_dir) / str(seed)
    shutil.rmtree(folder, ignore_errors=True)
    command = [
        sys.executable,
        str(TRAINER),
        "--preset",
        args.preset,
        "--seed",
        str(seed),
        "--out-dir",
        str(folder),
        "--run-name",
        "run",
        *args.extra,
    ]
    print(f"seed {seed}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
    if code:  # the trainer printed why on stderr
        raise SystemExit(f"error: seed {seed}: replay_grpo.py exited with code {code}")
    return time.perf_counter() - start


def table(rows: list[dict]) -> str:
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
    times = json.loads(times_file.read_text()) if times_file.exists() else {}
    rows = []
    for seed in args.seeds:
        records = finished(out / str(seed) / "run" / "metrics.jsonl")
        if records is None or str(seed) not in times:
            times[str(seed)] = run_seed(args, seed)
            times_file.write_text(json.dumps(times, indent=1))
            records = finished(out / str(seed) / "run" / "metrics.jsonl")
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
    text = table(rows)
    print(text, end="")
    if args.table:
        write_table(Path(args.table), text)
    return rows


def write_table(path: Path, text: str) -> None:
    """The table into its place in `path` (between the markers), or as the whole file."""
    start, end = "<!-- seed_table -->\n", "<!-- /seed_table -->"
    old = path.read_text() if path.exists() else ""
    if start in old and end in old:
        text = old[: old.index(start) + len(start)] + text + old[old.index(end) :]
    path.write_text(text)


if __name__ == "__main__":
    main()
