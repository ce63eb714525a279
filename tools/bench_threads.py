"""The CPU preset's speed under three thread settings, on an idle machine and beside one busy process: the warm start's
supervised steps/s and the RL steps/s, each setting's slowdown against the better of 1 thread and torch's default.

    python tools/bench_threads.py [--warm-steps 300] [--rl-steps 30] [--repeats 1]

Each run is `replay_grpo.py --preset cpu` in a fresh --out-dir (the warm start trained, not loaded), with
--warm-steps supervised steps and --rl-steps RL steps. The settings:
  1 thread         OMP_NUM_THREADS=1, torch imported before replay_grpo (OpenMP's own wait policy)
  default threads  torch's default (a thread per core), torch imported before replay_grpo (OpenMP's own wait policy)
  chosen default   `python replay_grpo.py` as a user runs it, with the defaults it sets before torch is imported
Busy: a `python -c 'while True: pass'` this tool starts beside each run and stops after it (on 2 cores: one core
left). Warm start steps/s: the steps over the seconds in its warmstart.json; RL steps/s: the steps over the summed
gen_seconds + train_seconds of metrics.jsonl (evaluations left out). The slowdown of a setting is the better rate of
1 thread and default threads over its rate, measured in the same run of this tool; each setting's OpenMP spin count
(GOMP_SPINCOUNT, libgomp's own report: OMP_DISPLAY_ENV=VERBOSE) is printed, so that a wait policy set too late
shows. With --repeats k each rate is the best of k runs.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# torch first: libgomp reads its settings once, when torch loads it, so replay_grpo's defaults come too late to act
TORCH_FIRST = "import runpy, sys, torch; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
SETTINGS = {
    "1 thread": ({"OMP_NUM_THREADS": "1"}, TORCH_FIRST),
    "default threads": ({}, TORCH_FIRST),
    "chosen default": ({}, None),
}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "OMP_DISPLAY_ENV")
LIMIT = 1.5  # the slowdown a default may have against the better of 1 thread and default threads


def one_run(setting: str, warm_steps: int, rl_steps: int) -> dict:
    """One `--preset cpu` run under `setting`: warm start and RL steps/s, torch's threads, libgomp's spin count."""
    extra, wrapper = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env |= {"HF_HUB_OFFLINE": "1", "OMP_DISPLAY_ENV": "VERBOSE", **extra}
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as out:
        args = ["replay_grpo.py", "--preset", "cpu", "--sft-warmup-steps", str(warm_steps), "--sft-imitation", "0"]
        args += ["--total-steps", str(rl_steps), "--eval-every", "0", "--eval-size", "20", "--pass-k", "2"]
        args += ["--out-dir", out, "--run-name", "r"]
        cmd = [sys.executable, *(["-c", wrapper] if wrapper else []), *args]
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{setting}: {' '.join(cmd)} failed:\n{(res.stdout + res.stderr)[-3000:]}")
        (warm,) = Path(out, ".warmstart").glob("*/warmstart.json")
        info = json.loads(warm.read_text())
        steps = [json.loads(line) for line in Path(out, "r", "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if "train_seconds" in r]
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", res.stderr)
    return {
        "warm": info["steps"] / info["seconds"],
        "rl": len(steps) / sum(r["gen_seconds"] + r["train_seconds"] for r in steps),
        "threads": info["threads"],
        "spin": spin[1] if spin else "?",
    }


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm-steps", type=int, default=300, help="supervised warm-start steps of each run")
    p.add_argument("--rl-steps", type=int, default=30, help="RL steps of each run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each setting and load; the best rate is kept")
    a = p.parse_args()
    print(f"{cpu_name()}, {os.cpu_count()} cores; --warm-steps {a.warm_steps} --rl-steps {a.rl_steps}", flush=True)
    rates = {}
    t0 = time.time()
    for load in ("idle", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
        try:
            for _ in range(a.repeats):
                for setting in SETTINGS:  # interleaved: a drift in the machine's speed touches each setting alike
                    r = one_run(setting, a.warm_steps, a.rl_steps)
                    print(
                        f"  {load:4} {setting:15}: warm start {r['warm']:6.1f} steps/s, RL {r['rl']:5.2f} steps/s "
                        f"({r['threads']} threads, GOMP_SPINCOUNT {r['spin']}; {time.time() - t0:.0f} s so far)",
                        flush=True,
                    )
                    best = rates.setdefault((load, setting), r)
                    best["warm"], best["rl"] = max(best["warm"], r["warm"]), max(best["rl"], r["rl"])
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    print(f"\nslowdown against the better of 1 thread and default threads (> {LIMIT}: FAIL); steps/s in brackets")
    print(f"{'load':5} {'part':11} " + " ".join(f"{s:>22}" for s in SETTINGS))
    failed = []
    for load in ("idle", "busy"):
        for part, name in (("warm", "warm start"), ("rl", "RL steps")):
            best = max(rates[load, "1 thread"][part], rates[load, "default threads"][part])
            cells = []
            for setting in SETTINGS:
                rate = rates[load, setting][part]
                cells.append(f"{best / rate:6.2f}x ({rate:7.2f})")
                if setting == "chosen default" and best / rate > LIMIT:
                    failed.append(f"{load} {name}")
            print(f"{load:5} {name:11} " + " ".join(f"{c:>22}" for c in cells))
    print(f"chosen default: {'FAIL on ' + ', '.join(failed) if failed else 'within ' + str(LIMIT) + 'x everywhere'}")
    print(f"{time.time() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
