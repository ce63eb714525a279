"""device_check.py: everything a few minutes on one H100 / H200 should measure, as one command, into one folder.

    python tools/device_check.py --out runs/device            # on the GPU machine: about 6 minutes (--budget 360)
    python tools/device_check.py --out /tmp/rehearsal --dry-run  # a CPU rehearsal: the same parts and files

Needs torch, Triton and transformers (the GPU image: torch 2.11, Triton 3.6, transformers 5.17); no vLLM, no network,
nothing else carried. tyro is not needed except by gpu_check.py's trainer check, which starts `replay_grpo.py` (its
command line is tyro's): without tyro that check fails and says so, the others run. Each part runs as its own
process with a share of the budget, its output in OUT/<part>.log; a part that fails or runs out of time is recorded
and the next one runs. OUT/summary.json and OUT/summary.md are
rewritten after each part, so whatever ran is kept. Parts and files (the dry run writes the same files):
  versions  OUT/versions.json: Python, torch, CUDA, Triton, transformers, the GPU, nvidia-smi's clocks and power
  spill     OUT/spill.txt: tools/spill_check.py, each autotune tile compiled for sm_90 by this Triton (CPU only,
            runs beside the GPU parts)
  tune      OUT/tune/tune.json, OUT/tune/tune.md (versions, clocks, the GEMM floor, the tile sweep, the end-to-end
            table) and OUT/kernels_tuned.json (the committed file plus this GPU's tiles): tools/tune_kernels.py
  bench     OUT/bench.txt: tools/bench_kernels.py with those tiles (naive, triton and the other baselines); the
            parts after tune run with REPLAY_GRPO_TUNED_FILE=OUT/kernels_tuned.json
  mu        OUT/mu/mu.json, OUT/mu/mu.md: tools/mu_tool.py (generation against training, the planner's choice)
  gpu_check OUT/gpu_check.txt: tools/gpu_check.py's table and verdict
Then commit OUT/kernels_tuned.json as kernels_tuned.json and the tables with the card's name.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

START = time.monotonic()
ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
# each part's share of the budget, in the order they run (spill runs beside them, on the CPU)
SHARES = {"versions": 0.04, "tune": 0.40, "bench": 0.20, "mu": 0.18, "gpu_check": 0.18}


def fail(msg):
    print(f"device_check.py: {msg}", file=sys.stderr)
    sys.exit(2)


def versions() -> dict:
    """What ran: the software's versions, the machine, the GPU and its clocks (nvidia-smi)."""
    import torch

    info = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    info.update(python=sys.version.split()[0], platform=platform.platform(), cpu=platform.processor() or None)
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cpus=os.cpu_count())
    for name in ("triton", "transformers", "tyro", "vllm", "liger_kernel"):
        try:
            mod = __import__(name) if importlib.util.find_spec(name) else None
            info[name] = getattr(mod, "__version__", "present") if mod else None
        except Exception as e:  # installed but broken: say how
            info[name] = f"import failed: {type(e).__name__}: {str(e)[:120]}"
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(sms=p.multi_processor_count, memory_gib=p.total_memory / 2**30, capability=f"{p.major}.{p.minor}")
        query = (
            "driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"
        )
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True, timeout=20
            )
            info["nvidia-smi"] = out.stdout.strip() or out.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info["nvidia-smi"] = f"failed: {e}"
    return info


def start(cmd, log, env):
    """A part's process, in its own process group (a timeout ends it and its children), output into `log`."""
    with open(log, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        return subprocess.Popen(
            [str(c) for c in cmd], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def finish(proc, timeout) -> tuple[int | None, bool]:
    """(exit status, timed out): waits up to `timeout` seconds, then ends the part's process group."""
    try:
        return proc.wait(timeout=max(1.0, timeout)), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return proc.returncode, True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the folder every result goes to (created; must be empty or new)")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on a CPU under TRITON_INTERPRET=1")
    ap.add_argument("--budget", type=float, default=360.0, help="seconds for the whole run (default 360)")
    args = ap.parse_args()
    if not (30 <= args.budget <= 3600):  # NaN fails too
        fail(f"--budget {args.budget}: give seconds from 30 to 3600")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--out {out}: exists and is not an empty folder (results are never written over)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out {out}: cannot create it ({e.strerror or e})")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    dry = args.dry_run
    if dry:
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    budget = args.budget
    py = [sys.executable]
    tuned = out / "kernels_tuned.json"
    shutil.copyfile(ROOT / "kernels_tuned.json", tuned)  # this GPU's entries are added to the committed file's
    env["REPLAY_GRPO_TUNED_FILE"] = str(tuned.resolve())  # the later parts run with the tiles the tune part found
    parts = {
        "spill": [*py, TOOLS / "spill_check.py", *(["--limit", "1"] if dry else [])],
        "tune": [*py, TOOLS / "tune_kernels.py", "--deadline", f"{SHARES['tune'] * budget - 15:.0f}"]
        + ["--out", out / "tune", "--write-tuned", "--tuned-file", tuned, *(["--dry-run"] if dry else [])],
        "bench": [*py, TOOLS / "bench_kernels.py", *(["--dry-run"] if dry else [])],
        "mu": [*py, TOOLS / "mu_tool.py", "--out", out / "mu", "--deadline", f"{SHARES['mu'] * budget - 20:.0f}"]
        + (["--tiny", "--lengths", "4,16", "--batch", "2", "--prompt-len", "8"] if dry else []),
        "gpu_check": [*py, TOOLS / "gpu_check.py"] + (["--smoke", "--only", "precision"] if dry else []),
    }
    logs = {"spill": "spill.txt", "bench": "bench.txt", "gpu_check": "gpu_check.txt"}
    summary = {"out": str(out), "dry_run": dry, "budget_s": budget, "parts": {}}

    def record(name, **kw):
        summary["parts"][name] = kw
        summary["elapsed_s"] = round(time.monotonic() - START, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        lines = ["| part | status | seconds | output |", "|---|---|---|---|"]
        for part, r in summary["parts"].items():
            lines.append(f"| {part} | {r['status']} | {r.get('seconds', '')} | {r.get('output', '')} |")
        (out / "summary.md").write_text(
            f"# device_check.py ({'dry run' if dry else 'GPU'})\n\n" + "\n".join(lines) + "\n"
        )
        print(
            f"device_check: {name}: {kw['status']}" + (f" ({kw['seconds']} s)" if "seconds" in kw else ""), flush=True
        )

    t0 = time.monotonic()
    try:
        info = versions()
        (out / "versions.json").write_text(json.dumps(info, indent=2) + "\n")
        record("versions", status="ok", seconds=round(time.monotonic() - t0, 1), output="versions.json")
    except Exception as e:  # a part's failure never stops the others
        info = {}
        record("versions", status=f"failed: {type(e).__name__}: {e}"[:200])
    if not dry and not info.get("gpu"):
        record("cuda", status="no CUDA device: the GPU parts measure nothing here (use --dry-run to rehearse)")
    if info.get("tyro") is None:
        summary["note"] = "tyro missing: gpu_check.py's trainer check (replay_grpo.py's command line) fails for it"
    # spill_check compiles (even in a dry run), the committed tiles: the tune part writes its file meanwhile
    compile_env = {k: v for k, v in env.items() if k not in ("TRITON_INTERPRET", "REPLAY_GRPO_TUNED_FILE")}
    spill = start(parts.pop("spill"), out / logs["spill"], compile_env)  # on the CPU, beside the GPU parts
    spill_t0 = time.monotonic()
    for name, cmd in parts.items():
        t0 = time.monotonic()
        left = budget - (t0 - START)
        share = min(SHARES[name] * budget, left - 5)
        log = out / logs.get(name, f"{name}.log")
        if share < 10:
            record(name, status="skipped: budget spent", output="")
            continue
        rc, timed_out = finish(start(cmd, log, env), share)
        status = "timed out" if timed_out else "ok" if rc == 0 else f"failed (exit {rc})"
        record(name, status=status, seconds=round(time.monotonic() - t0, 1), output=log.name, exit=rc)
    rc, timed_out = finish(spill, max(10.0, budget - (time.monotonic() - START)))
    status = "timed out" if timed_out else "ok" if rc == 0 else "spills (exit 1)" if rc == 1 else f"failed (exit {rc})"
    record("spill", status=status, seconds=round(time.monotonic() - spill_t0, 1), output=logs["spill"], exit=rc)
    print(f"device_check: wrote {out} ({time.monotonic() - START:.0f} s of {budget:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
