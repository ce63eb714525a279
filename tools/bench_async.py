"""async_pipeline.py's training wall time on vLLM servers against an earlier revision's, one run each on this machine.

    python tools/bench_async.py REV [--steps 200] [--seed 0] [--out-dir runs/bench-async]

Both sides run `--preset cpu --num-generators 2` on the W/T system (async_pipeline.py; before it had its own entry,
`replay_grpo.py --mode async`) with the same seed and the same cached warm start
(made first, outside the timing, when the cache lacks it). REV runs from `git archive REV` (its own generator
processes, started inside its timing as it starts them); this tree runs on two vLLM servers started beforehand and
passed by --generator-urls (their start-up and warm-up time printed apart). Prints each side's wall time, the
trainer's seconds blocked by publishing per step (sync_seconds), this tree's publisher-thread seconds per publish,
the trained rollouts' mean and largest staleness, held-out greedy accuracy at the end, and the ratio of the wall times.
"""

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import async_pipeline as ap
from infra import models, serving


def run(cmd: list[str], cwd: Path) -> float:
    """Wall seconds of one training run; its output goes to a log beside the run folder, its failure stops here."""
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(res.stdout + res.stderr)[-3000:]}")
    return time.perf_counter() - t0


def summary(run_dir: Path) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    last = steps[-1]
    out = {"steps": len(steps), "greedy_acc": [r for r in recs if "eval/greedy_acc" in r][-1]["eval/greedy_acc"]}
    out["sync_seconds_per_step"] = sum(r["sync_seconds"] for r in steps) / len(steps)
    out["staleness_mean"] = sum(r["staleness_mean"] for r in steps) / len(steps)  # of the rollouts trained on
    out["staleness_max"] = max(r["staleness_max"] for r in steps)
    if last.get("publishes"):
        out["publisher_seconds_per_publish"] = last["publish_seconds"] / last["publishes"]
        out["publishes"] = last["publishes"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the revision to compare with (its W/T system), e.g. d76cecf")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/bench-async")
    a = p.parse_args()
    known = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{a.rev}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    if known.returncode:  # before the warm start's minutes
        print(f"error: {a.rev}: not a revision of the repository at {ROOT} (git log --oneline)", file=sys.stderr)
        raise SystemExit(2)
    out = Path(a.out_dir).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # the task, the warm start's length and the lr pinned: two revisions on either side of a preset change run
    # the same flags
    preset = ["--preset", "cpu", "--arith-max-operand", "49", "--sft-warmup-steps", "650", "--lr", "3e-6"]
    flags = preset + ["--num-generators", "2", "--seed", str(a.seed)]
    flags += ["--total-steps", str(a.steps), "--out-dir", str(out)]
    # the warm start, cached under --out-dir for both sides (its key leaves out where generation runs)
    run(
        [sys.executable, "replay_grpo.py", *preset, "--seed", str(a.seed), "--total-steps", "1"]
        + ["--out-dir", str(out), "--run-name", f"warm-{stamp}"],
        ROOT,
    )

    old_tree = Path(tempfile.mkdtemp(prefix="bench_async_"))
    archive = subprocess.run(["git", "archive", a.rev], cwd=ROOT, capture_output=True, check=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(old_tree)
    own_entry = "def main(" in (old_tree / "async_pipeline.py").read_text()
    entry = ["async_pipeline.py"] if own_entry else ["replay_grpo.py", "--mode", "async"]
    old_seconds = run([sys.executable, *entry, *flags, "--run-name", f"old-{stamp}"], old_tree)

    model, tok = models.build_tiny_model(0)  # the architecture; each run publishes its own weights first
    folder = models.export_plain_folder(model, tok, str(out / f"served-{stamp}"))
    cfg = ap.parse_args(["--generator-host", "127.0.0.1", "--seed", str(a.seed)])
    servers = serving.launch_servers(cfg, Path(folder), 512, [None, None], out / f"servers-{stamp}")
    try:
        start_seconds = serving.wait_ready(servers)
        urls = ["--generator-urls", *[s.url for s in servers]]
        new_seconds = run([sys.executable, "async_pipeline.py", *flags, *urls, "--run-name", f"new-{stamp}"], ROOT)
    finally:
        serving.stop_servers(servers)

    old, new = summary(out / f"old-{stamp}"), summary(out / f"new-{stamp}")
    print(f"{a.rev} (its run, starting its own generators): {old_seconds:.1f} s wall, {old}")
    print(
        f"this tree (2 vLLM servers, up and warm in {start_seconds:.1f} s beforehand): {new_seconds:.1f} s wall, {new}"
    )
    print(f"wall-time ratio new / old: {new_seconds / old_seconds:.2f}")


if __name__ == "__main__":
    main()
