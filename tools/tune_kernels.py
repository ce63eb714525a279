"""tune_kernels.py: tune and measure kernels.py's Triton log-prob kernels on this GPU within a deadline.

    python tools/tune_kernels.py --deadline 360 --write-tuned   # on an H100/H200: the whole run, into runs/tune
    TRITON_INTERPRET=1 python tools/tune_kernels.py --dry-run --deadline 60     # a tiny shape on a CPU

In order, each step only if the deadline leaves time for it (the run stops cleanly and keeps what it has): the
versions and clocks; the floor GEMMs (bf16 H Wᵀ, dz W, dzᵀ H as torch runs them); the sweep of tiles
(SWEEP_CONFIGS) for the forward kernel and the backward's dz kernel at each width, best so far kept; the end-to-end
table (bench_kernels.measure: forward + backward against naive, interleaved, with errors against the fp32
reference) for a few backward vocab splits with the best tiles. Writes OUT/tune.json and OUT/tune.md after each
step (a later failure loses nothing measured); with --write-tuned, the best tiles and split of each width into
kernels_tuned.json under this GPU's name. Bad flags and destinations (--widths, --deadline, --out, --tuned-file) are
refused before any work: one line naming the flag, exit 2.
"""

import time

START = time.monotonic()  # the deadline counts from here: imports (torch, Triton) included

import argparse  # noqa: E402
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the method's modules live at the root
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kernels import PEAKS, estimate_ms, measure, plan_cost, time_target  # noqa: E402

import kernels  # noqa: E402

# The sweep, per kernel: the autotuner's defaults, every one compiled for sm_90 without spills (tools/spill_check.py)
SWEEP_CONFIGS = {kind: [dict(c) for c in configs] for kind, configs in kernels.DEFAULT_CONFIGS.items()}
_DRY = [dict(kernels.INTERPRET_CONFIG), dict(BLOCK_N=32, BLOCK_V=16, BLOCK_D=16, num_warps=4, num_stages=1)]
DRY_CONFIGS = {"fwd": _DRY, "bwd": _DRY}


class Clock:
    """The run's deadline: left() seconds remain; step costs are learnt as the run goes."""

    def __init__(self, seconds):
        self.end = START + seconds

    def left(self):
        return self.end - time.monotonic()


def versions_and_clocks(cuda) -> dict:
    info = {
        "torch": torch.__version__,
        "triton": kernels.triton.__version__ if kernels.HAS_TRITON else None,
        "python": sys.version.split()[0],
        "gpu": kernels.gpu_name("cuda" if cuda else "cpu"),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if cuda:
        query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            out = f"nvidia-smi failed: {e}"
        info["nvidia-smi"] = f"{query}: {out}"
    else:
        info["nvidia-smi"] = "n/a (no CUDA)"
    return info


def timed_ms(fn, reps, sync):
    fn()  # warm-up: compiles
    sync()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def inputs(N, V, d, dev):
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(N, d, device=dev, generator=gen).bfloat16()
    w = (torch.randn(V, d, device=dev, generator=gen) * (3 / d**0.5)).bfloat16()
    y = torch.randint(0, V, (N,), device=dev, generator=gen)
    return h, w, y


def floor_gemms(N, V, d, Vs, dev, reps, sync) -> dict:
    """The GEMMs of the design as torch (cuBLAS) runs them, in bf16: the logits H Wᵀ (the fused GEMMs' floor), one
    split's dH += dz W_s and dW_s = dzᵀ H."""
    h, w, _ = inputs(N, V, d, dev)
    dz = torch.randn(N, Vs, device=dev).bfloat16()
    ws = w[:Vs]
    out = {}
    with torch.no_grad():
        for name, fn, flops in (
            ("logits H Wt", lambda: h @ w.t(), 2 * N * d * V),
            ("split dz W", lambda: dz @ ws, 2 * N * d * Vs),
            ("split dzT H", lambda: dz.t() @ h, 2 * N * d * Vs),
        ):
            ms = timed_ms(fn, reps, sync)
            out[name] = {"ms": ms, "tflops": flops / ms / 1e9}
    return out


def sweep(N, V, d, dev, configs, reps, sync, clock, stop_at) -> dict:
    """Each kernel's configs (the forward kernel's and one split's dz kernel's), in turn, until the clock reaches
    stop_at seconds left; a config that fails to compile or launch (shared memory, registers) is recorded and
    skipped."""
    h, w, y = inputs(N, V, d, dev)
    inv_t = 1.0
    stats_full = kernels.merge_partials(kernels.fwd_triton(h, w, y, inv_t, config=configs["fwd"][0]))
    m, s, x, t, zy = stats_full
    stats = (m, s.log(), t / s, x / s, zy)
    g = torch.randn(N, device=dev)
    e = torch.randn(N, device=dev)
    Vs = kernels.vocab_split(N, d, V, h.element_size())
    dz = torch.empty(N, Vs, dtype=h.dtype, device=dev)
    ws = w[:Vs]
    rows = {"fwd": [], "bwd": []}
    cost = {"fwd": 0.0, "bwd": 0.0}  # the longest a config of each kernel took, compile included
    for i in range(max(map(len, configs.values()))):  # the kernels' i-th tiles side by side
        for kind in ("fwd", "bwd"):
            if i >= len(configs[kind]):
                continue
            c = configs[kind][i]
            if clock.left() < stop_at + cost[kind]:
                rows[kind].append({"config": c, "skipped": "deadline"})
                continue
            t0 = time.monotonic()
            if kind == "fwd":
                fn = lambda c=c: kernels.fwd_triton(h, w, y, inv_t, config=c)  # noqa: E731
                flops = 2 * N * d * V
            else:
                fn = lambda c=c: kernels.bwd_dz_triton(h, ws, y, stats, g, e=e, inv_t=inv_t, dz=dz, V=V, config=c)  # noqa: E731
                flops = 2 * N * d * Vs
            try:
                ms = timed_ms(fn, reps, sync)
                rows[kind].append({"config": c, "ms": ms, "tflops": flops / ms / 1e9})
            except Exception as exc:  # out of resources for this GPU: not a candidate
                rows[kind].append({"config": c, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
            cost[kind] = max(cost[kind], time.monotonic() - t0)
    best = {}
    for kind, rs in rows.items():
        timed = [r for r in rs if "ms" in r]
        best[kind] = min(timed, key=lambda r: r["ms"]) if timed else None
    return {"rows": rows, "best": best, "vocab_split": Vs}


def end_to_end(N, V, d, dev, best, splits, reps, clock, stop_at) -> list[dict]:
    """bench_kernels.measure with the best tiles (a temporary tuned file) at each backward vocab split; a split is
    measured only if the clock leaves stop_at seconds plus the guess of its cost (the sweep's times for the first,
    then the last one's)."""
    out = []
    guess = (reps + 3) * 3 * (best["fwd"]["ms"] + best["bwd"]["ms"] * math.ceil(V / splits[0])) / 1e3
    best = {k: v["config"] for k, v in best.items()}
    name = kernels.gpu_name(dev)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tuned.json"
        path.write_text(json.dumps({"gpus": {name: {f"{d}x{V}": {"fwd": best["fwd"], "bwd": best["bwd"]}}}}))
        old, kernels.TUNED_FILE = kernels.TUNED_FILE, path
        try:
            for Vs in splits:
                if clock.left() < stop_at + guess:
                    out.append({"d": d, "vocab_split": Vs, "skipped": "deadline"})
                    continue
                t0 = time.monotonic()
                m = measure(N, V, d, backends=["triton", "naive"], reps=reps, dev=dev, vocab_split=Vs)
                tr, nv = m["results"]["triton"], m["results"]["naive"]
                row = {"d": d, "vocab_split": Vs, "floor_ms": m["floor_ms"], "floor_err": m["floor_err"]}
                if tr is None:
                    row["triton"] = "out of memory"
                else:
                    extra = tr[1] if math.isfinite(tr[1]) else None  # not measured on a CPU
                    row.update(ms=tr[0], extra_gib=extra, logp_err=tr[2], grad_err=tr[3])
                    row["cost"] = plan_cost("triton", N, d, V, vocab_split=Vs)
                if nv is not None:
                    row.update(naive_ms=nv[0], naive_extra_gib=nv[1] if math.isfinite(nv[1]) else None)
                    if tr is not None:
                        row["x_naive"] = tr[0] / nv[0]
                out.append(row)
                guess = time.monotonic() - t0
        finally:
            kernels.TUNED_FILE = old
    return out


def gib(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(result) -> str:
    info = result["info"]
    lines = [f"# tune_kernels.py on {info['gpu']} ({info['time']})", ""]
    lines += [f"torch {info['torch']}, triton {info['triton']}, python {info['python']}; {info['nvidia-smi']}", ""]
    lines += [f"N = {result['N']}, V = {result['V']}, bf16; deadline {result['deadline_s']} s, "]
    lines[-1] += f"ran {result['elapsed_s']:.0f} s" + (" (dry run: numbers mean nothing)" if result["dry_run"] else "")
    for d, r in result["widths"].items():
        lines += ["", f"## d = {d}", "", "| GEMM | ms | TFLOP/s |", "|---|---|---|"]
        lines += [f"| {k} | {v['ms']:.3f} | {v['tflops']:.1f} |" for k, v in r.get("floor", {}).items()]
        lines += ["", "| kernel | BLOCK_N x BLOCK_V x BLOCK_D, warps, stages | ms | TFLOP/s |", "|---|---|---|---|"]
        for kind, rs in r.get("sweep", {}).get("rows", {}).items():
            for row in rs:
                c = row["config"]
                tiles = f"{c['BLOCK_N']} x {c['BLOCK_V']} x {c['BLOCK_D']}, {c['num_warps']}, {c['num_stages']}"
                what = (
                    f"{row['ms']:.3f} | {row['tflops']:.1f}"
                    if "ms" in row
                    else f"{row.get('skipped') or row.get('error')} |"
                )
                lines.append(f"| {kind} | {tiles} | {what} |")
        lines += [
            "",
            "| vocab split | triton ms | naive ms | x naive | target | GEMM floor ms | extra GiB | logp err | "
            "grad err | estimate ms H100 / H200 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in r.get("e2e", []):
            if "ms" not in row:
                lines.append(f"| {row['vocab_split']} | {row.get('skipped') or row.get('triton')} | | | | | | | | |")
                continue
            est = " / ".join(f"{estimate_ms(row['cost'], k):.1f}" for k in PEAKS)
            lines.append(
                f"| {row['vocab_split']} | {row['ms']:.2f} | {row.get('naive_ms', float('nan')):.2f} | "
                f"{row.get('x_naive', float('nan')):.2f} | <= {time_target(int(d))} | {row['floor_ms']:.2f} | "
                f"{gib(row['extra_gib'])} | {row['logp_err']:.1e} | {row['grad_err']:.1e} "
                f"(floor {row['floor_err']:.1e}) | {est} |"
            )
    return "\n".join(lines) + "\n"


def write_tuned(result, path) -> dict:
    """The best tiles and vocab split of each width, with what they measured, under this GPU's name."""
    tuned = json.loads(Path(path).read_text()) if Path(path).exists() else {"gpus": {}}
    entries = tuned.setdefault("gpus", {}).setdefault(result["info"]["gpu"], {})
    for d, r in result["widths"].items():
        best = r.get("sweep", {}).get("best", {})
        if not (best.get("fwd") and best.get("bwd")):
            continue
        e2e = [row for row in r.get("e2e", []) if "ms" in row]
        fastest = min(e2e, key=lambda row: row["ms"]) if e2e else None
        entry = {"fwd": best["fwd"]["config"], "bwd": best["bwd"]["config"]}
        if fastest:
            entry["vocab_split"] = fastest["vocab_split"]
        info = result["info"]
        entry["measured"] = {k: info[k] for k in ("time", "torch", "triton")} | {"N": result["N"]}
        if fastest:
            entry["measured"].update({k: fastest.get(k) for k in ("ms", "naive_ms", "x_naive", "extra_gib")})
        entries[f"{d}x{result['V']}"] = entry
    Path(path).write_text(json.dumps(tuned, indent=2) + "\n")
    return tuned


MAX_WIDTH = 16384  # the widest LM heads in use (Llama 3 405B) have d = 16384
MAX_DEADLINE = 86400.0


def fail(msg):
    """Bad input: one line naming the flag, exit 2."""
    print(f"tune_kernels.py: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_widths(text) -> list[int]:
    """--widths: comma-separated integers in [1, MAX_WIDTH]."""
    ds = []
    for part in text.split(","):
        try:
            d = int(part.strip())
        except ValueError:
            d = None
        if d is None or not 1 <= d <= MAX_WIDTH:
            fail(
                f"--widths {text!r}: {part.strip()!r} is not a width (d); give comma-separated integers "
                f"from 1 to {MAX_WIDTH}"
            )
        ds.append(d)
    return ds


def check_destinations(out, tuned_file, write_tuned) -> None:
    """Where the results go, checked before any work: --out a folder (created here) this process can write into;
    with --write-tuned, --tuned-file a JSON file of tuned tiles (or a new file) in a writable folder."""
    if out.exists() and not out.is_dir():
        fail(f"--out {out}: exists and is not a folder (tune.json and tune.md go into a folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror or e})")
    if not write_tuned:
        return
    if tuned_file.is_dir():
        fail(f"--tuned-file {tuned_file}: is a folder, not a JSON file of tuned tiles")
    if tuned_file.exists():
        try:
            tuned = json.loads(tuned_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            fail(f"--tuned-file {tuned_file}: not readable as JSON ({str(e).splitlines()[0][:120]})")
        if not isinstance(tuned, dict) or not isinstance(tuned.get("gpus", {}), dict):
            fail(f'--tuned-file {tuned_file}: not a file of tuned tiles (a JSON object with a "gpus" object)')
    folder = tuned_file.parent
    if (
        not folder.is_dir()
        or not os.access(folder, os.W_OK)
        or (tuned_file.exists() and not os.access(tuned_file, os.W_OK))
    ):
        fail(f"--tuned-file {tuned_file}: cannot write there")


def save(result, out) -> None:
    """tune.json and tune.md as they stand: written after each step, so a later failure loses nothing measured."""
    result["elapsed_s"] = time.monotonic() - START
    (out / "tune.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "tune.md").write_text(markdown(result))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline", type=float, default=360.0, help="seconds for the whole run (default 360)")
    ap.add_argument("--out", default="runs/tune", help="folder for tune.json and tune.md (default runs/tune)")
    ap.add_argument("--widths", default=None, help="comma-separated d (default 896,3584; dry run 40)")
    ap.add_argument("--write-tuned", action="store_true", help="write the best tiles into the tuned file")
    ap.add_argument("--tuned-file", default=str(kernels.TUNED_FILE), help="default: the committed kernels_tuned.json")
    ap.add_argument(
        "--dry-run", action="store_true", help="a tiny shape (N=32, V=300, d=24); on a CPU under TRITON_INTERPRET=1"
    )
    args = ap.parse_args()
    if not (0 < args.deadline <= MAX_DEADLINE):  # NaN fails every comparison
        fail(f"--deadline {args.deadline}: give a number of seconds above 0 and at most {MAX_DEADLINE:.0f}")
    ds = parse_widths(args.widths) if args.widths is not None else None
    out = Path(args.out)
    check_destinations(out, Path(args.tuned_file), args.write_tuned)
    clock = Clock(args.deadline)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    try:
        kernels.resolve_backend("triton", dev)
    except ValueError as e:
        print(f"tune_kernels.py: {e}", file=sys.stderr)
        sys.exit(2)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.dry_run or not cuda:
        N, V, default_ds, reps, configs = 32, 300, [24], 1, DRY_CONFIGS
    else:
        N, V, default_ds, reps, configs = 16384, 151936, [896, 3584], 5, SWEEP_CONFIGS
    ds = ds or default_ds
    info = versions_and_clocks(cuda)
    print(f"{info['gpu']}: torch {info['torch']}, triton {info['triton']}; {info['nvidia-smi']}", flush=True)
    result = {"info": info, "N": N, "V": V, "deadline_s": args.deadline, "dry_run": args.dry_run or not cuda}
    result["widths"] = {}
    # the deadline's shares: the sweep may run until 45% of it is left, the end-to-end table until 5% (writing)
    for i, d in enumerate(ds):
        r = result["widths"][str(d)] = {}
        Vs = kernels.vocab_split(N, d, V, 2)
        if clock.left() > 0.5 * args.deadline * (len(ds) - i) / len(ds):
            r["floor"] = floor_gemms(N, V, d, Vs, dev, reps=reps, sync=sync)
            for k, v in r["floor"].items():
                print(f"d={d} floor {k}: {v['ms']:.3f} ms, {v['tflops']:.1f} TFLOP/s", flush=True)
        share = 0.45 * args.deadline + 0.5 * args.deadline * (len(ds) - 1 - i) / len(ds)
        r["sweep"] = sweep(N, V, d, dev, configs, reps=reps, sync=sync, clock=clock, stop_at=share)
        for kind, best in r["sweep"]["best"].items():
            done = sum("ms" in x for x in r["sweep"]["rows"][kind])
            shown = f"{best['config']} {best['ms']:.3f} ms" if best else "none"
            print(f"d={d} {kind}: best of {done} configs: {shown}", flush=True)
        save(result, out)
    for i, d in enumerate(ds):
        r = result["widths"][str(d)]
        best = r["sweep"]["best"]
        if not (best["fwd"] and best["bwd"]):
            continue
        Vs = r["sweep"]["vocab_split"]
        splits = [Vs, max(256, Vs // 2 // 256 * 256), max(256, Vs // 4 // 256 * 256)]
        stop_at = 0.05 * args.deadline + 0.4 * args.deadline * (len(ds) - 1 - i) / len(ds)
        r["e2e"] = end_to_end(
            N, V, d, dev, best, splits=list(dict.fromkeys(splits)), reps=reps, clock=clock, stop_at=stop_at
        )
        for row in r["e2e"]:
            if "ms" in row:
                xn = row.get("x_naive", float("nan"))
                print(
                    f"d={d} split {row['vocab_split']}: triton {row['ms']:.2f} ms = {xn:.2f}x naive, "
                    f"floor {row['floor_ms']:.2f} ms, +{gib(row['extra_gib'])} GiB, logp err {row['logp_err']:.1e}, "
                    f"grad err {row['grad_err']:.1e}",
                    flush=True,
                )
        save(result, out)
    save(result, out)
    print(f"wrote {out / 'tune.json'} and {out / 'tune.md'} ({result['elapsed_s']:.0f} s of {args.deadline:.0f})")
    if args.write_tuned:
        try:
            write_tuned(result, args.tuned_file)
        except OSError as e:
            print(f"tune_kernels.py: --tuned-file {args.tuned_file}: {e} (the results are in {out / 'tune.json'})")
            sys.exit(1)
        print(f"wrote the tiles of {info['gpu']} into {args.tuned_file}")


if __name__ == "__main__":
    main()
