"""bench_kernels.py: kernels.token_logprobs against full logits: time, FLOPs, HBM bytes, memory and error.

    python tools/bench_kernels.py            # CUDA: N = 16384, V = 151936, d in {896, 3584}; CPU: a small shape
    python tools/bench_kernels.py --dry-run  # a tiny shape on any device (TRITON_INTERPRET=1 runs triton on a CPU)

For each path (naive: bf16 logits, fp32 log_softmax, gather; triton: kernels.token_logprobs; eager where Triton
cannot run): the FLOPs and the HBM bytes it moves, counted from its tile plan (plan_cost), beside its time (the
median of runs interleaved with naive's in the same process), the bf16 GEMM floor measured in the same run (the
cuBLAS matmuls the recomputing design needs: z twice, dH, dW), the ratios, the extra peak memory (CUDA), the errors
against an fp32 reference and the verdict of the targets (targets_met). gpu_check.py runs `measure` as a check.
"""

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the method's modules live at the root

import torch  # noqa: E402

import kernels  # noqa: E402

# Dense bf16 tensor-core peak and HBM bandwidth from the vendor's spec sheets (SXM parts): the cost model's
# denominators, never measured here
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}
TARGET_X_NAIVE = {896: 0.5, 3584: 0.9}  # time targets on an H100/H200 at N = 16384, V = 151936
TARGET_EXTRA_GIB = 1.5  # extra peak memory at d = 3584 (includes the bf16 gradients themselves)


def time_target(d: int) -> float:
    """The time target (x naive) of width d: d = 3584's from 3584 up, d = 896's below."""
    return TARGET_X_NAIVE[3584] if d >= 3584 else TARGET_X_NAIVE[896]


def targets_met(backend, d, ms, naive_ms, extra_gib, logp_err, grad_err, floor_err, cuda) -> dict[str, bool]:
    """The kernels' targets, by name: time <= 0.9x naive (d >= 3584) or <= 0.5x naive (smaller d) and <= 1.5 GiB
    extra at d >= 3584 (GPU only), log-probs within 1e-5, gradients within 1e-3 above the bf16 storage floor."""
    out = {}
    if backend != "naive":
        if naive_ms and cuda:  # the time targets are for the GPU shape
            out["time"] = ms / naive_ms <= time_target(d)
        if cuda and d >= 3584:
            out["mem"] = extra_gib <= TARGET_EXTRA_GIB
    out["logp"] = logp_err <= 1e-5
    out["grad"] = grad_err <= floor_err + 1e-3
    return out


SMS = 132  # streaming multiprocessors of an H100 SXM and an H200: the forward's programs in flight, one each
L2_BYTES = 50 * 2**20  # an H100's / H200's L2
FWD_BLOCK_N = 128  # the token tile the forward's cost is counted at (the autotuned tiles' usual BLOCK_N)


def fwd_operand_bytes(N, d, V, c, split_major=True) -> int:
    """HBM bytes the forward GEMM reads of H and W. Split-major launch order (kernels._fwd_kernel): the SMS programs
    in flight are all splits of SMS // splits token tiles; each H tile is read once (its splits share it in L2) and W
    once per such group of token tiles. Token tile fastest (the order before): the programs in flight hold up to SMS
    H tiles; where those exceed the L2, H is read again at every vocab block (V / 256 blocks of 256 columns)."""
    tiles, splits = math.ceil(N / FWD_BLOCK_N), kernels.fwd_splits(N, V)
    if split_major:
        group = max(1, SMS // splits)
        return N * d * c + math.ceil(tiles / group) * V * d * c
    if min(tiles, SMS) * FWD_BLOCK_N * d * c <= L2_BYTES:
        return N * d * c + V * d * c
    return math.ceil(V / 256) * N * d * c + V * d * c


def plan_cost(path, N, d, V, itemsize=2, vocab_split=None) -> dict:
    """FLOPs and HBM bytes of a forward + backward of `path`, counted from its plan: every kernel reads its operands
    once and writes its outputs once (a tiled GEMM's re-reads are assumed to hit L2, except the triton forward's W,
    read once per group of token tiles in flight: fwd_operand_bytes), c = itemsize.
      naive:  z = H Wᵀ (c), z.float(), / T, log_softmax, gather; backward: the gather's scatter (fp32 zeros), the
              log_softmax backward, the cast back to c, dH and dW GEMMs: 6NdV FLOPs, 5c + 40 bytes per logit
      triton: forward GEMM with the row state in its epilogue (partials only); per vocab split of Vs columns: the dz
              GEMM (reads H and the split of W, writes dz in c), dW = dzᵀ H (written once), dH += dz W (fp32
              accumulator read and written): 8NdV FLOPs
      eager:  as triton, with fp32 logits tiles written and read, and fp32 dW / dH accumulators per tile
      liger, torch_lce (BASELINES): 6NdV, H and W read twice, dH and dW written (a lower bound: their plans' own
              traffic is not modelled)"""
    c = itemsize
    io = (N * d + V * d) * c  # H and W read once
    if path == "naive":
        flops = 6 * N * d * V
        logits = N * V * (c + (c + 4) + (4 + 4) + (4 + 4) + 4 + (4 + 4 + 4) + (4 + c) + 2 * c)
        nbytes = 3 * io + logits + (N * d + V * d) * c
    elif path == "triton":
        Vs = vocab_split or kernels.vocab_split(N, d, V, c)
        splits = math.ceil(V / Vs)
        flops = 8 * N * d * V
        fwd = fwd_operand_bytes(N, d, V, c) + 5 * 4 * N * kernels.fwd_splits(N, V)
        bwd = splits * N * d * c + V * d * c + N * V * c  # dz GEMMs: H per split, W once, dz written
        bwd += N * V * c + splits * N * d * c + V * d * c  # dW GEMMs: dz and H read, dW written once
        bwd += N * V * c + V * d * c + splits * 2 * 4 * N * d  # dH GEMMs: dz, W, the fp32 accumulator in and out
        nbytes = fwd + bwd + N * d * (4 + c)  # dH rounded to c
    elif path in BASELINES:  # not our plans: counted as keeping the forward's gradient chunks (no recompute),
        # 6NdV, and reading H and W twice and writing dH and dW once: a lower bound on their bytes
        flops = 6 * N * d * V
        nbytes = 2 * io + (N * d + V * d) * c
    else:  # eager
        C, Vc = kernels._default_chunks("cuda", d, V)
        tiles_v, tiles_n = math.ceil(V / Vc), math.ceil(N / C)
        flops = 8 * N * d * V
        fwd = tiles_v * N * d * c + V * d * c + N * V * 4 * 2
        bwd = fwd + N * V * (4 + 2 * c) + N * V * c * 2 + tiles_v * N * d * 4 * 2 + tiles_n * V * d * 4 * 2
        nbytes = fwd + bwd + V * d * (4 + c)
    return {"flops": flops, "bytes": nbytes}


def estimate_ms(cost: dict, gpu: str) -> float:
    """The cost model's time on `gpu` (a PEAKS key): the larger of FLOPs / peak and bytes / bandwidth."""
    peak, bw = PEAKS[gpu]
    return 1e3 * max(cost["flops"] / peak, cost["bytes"] / bw)


def _naive(h, w, y, temperature=1.0):
    """What a trainer writes by hand: bf16 logits, fp32 log_softmax, gather."""
    return torch.log_softmax((h @ w.t()).float() / temperature, -1).gather(1, y[:, None])[:, 0]


LIGER_PIN = "0.8.5"  # liger-kernel, an optional baseline: the version whose dispatch the row names below
BASELINES = ("liger", "torch_lce")  # other fused heads, measured beside ours where installed


def baseline_status(name, dev) -> tuple[str | None, str]:
    """(None, what runs) where baseline `name` runs on `dev`, else (why not, "")."""
    if name == "torch_lce":
        import torch.nn.functional as F

        if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
            return f"torch {torch.__version__} has no F.linear_cross_entropy (torch 2.13 has)", ""
        return None, "F.linear_cross_entropy, chunked (LinearCrossEntropyOptions()), reduction none"
    try:
        import importlib.metadata

        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return f"liger-kernel not installed (pip install liger-kernel=={LIGER_PIN})", ""
    if version != LIGER_PIN:
        return f"liger-kernel {version} installed; the bench is pinned to {LIGER_PIN}", ""
    try:
        from liger_kernel.ops import fused_linear_scaled_cross_entropy as lsce

        impl = lsce._resolve_implementation(torch.device(dev))  # its own dispatch: CuTe DSL on sm_90
    except Exception as e:  # sm_90 without the CuTe DSL (nvidia-cutlass-dsl): the Hopper kernel cannot load
        return f"liger's sm_90 kernel does not load: {type(e).__name__}: {str(e)[:100]}", ""
    fallback = impl is lsce._FusedLinearPPOFallbackFunction
    what = "its chunked PyTorch fallback (not sm_90)" if fallback else "its Hopper CuTe DSL kernel"
    return None, f"liger-kernel {version} LigerFusedLinearScaledCrossEntropyFunction: {what}"


def _baseline(name, h, w, y):
    """Per-token log-probs from another project's fused head (the negative of its per-token loss)."""
    if name == "torch_lce":
        import torch.nn.functional as F

        opts = torch.nn.LinearCrossEntropyOptions()
        return -F.linear_cross_entropy(h, w, y, reduction="none", ignore_index=-100, options=opts)
    from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction

    return -LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, y, 1.0, -100)


def _reference(h, w, y, g, chunk=2048):
    """fp32 logp and grads of sum(g·logp), chunked over tokens (TF32 off: true fp32)."""
    wf = w.float()
    lp = torch.empty(h.shape[0], device=h.device)
    dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dw = torch.zeros(wf.shape, dtype=torch.float32, device=h.device)
    for c0 in range(0, h.shape[0], chunk):
        hc, yc, gc = h[c0 : c0 + chunk].float(), y[c0 : c0 + chunk], g[c0 : c0 + chunk]
        lsm = torch.log_softmax(hc @ wf.t(), -1)
        lp[c0 : c0 + chunk] = lsm.gather(1, yc[:, None])[:, 0]
        dz = lsm.exp_().mul_(-gc[:, None])  # g·(onehot - p)
        dz[torch.arange(len(yc), device=h.device), yc] += gc
        dh[c0 : c0 + chunk] = dz @ wf
        dw.addmm_(dz.t(), hc)
        del lsm, dz
    return lp, dh, dw


def measure(N, V, d, backends, reps, dev, vocab_split=None):
    """_measure with TF32 off for its duration (the fp32 reference must be fp32), restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _measure(N, V, d, backends=backends, reps=reps, dev=dev, vocab_split=vocab_split)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _measure(N, V, d, backends, reps, dev, vocab_split=None):
    """One benchmark shape: bf16 hidden [N, d] and weight [V, d] from a seeded generator, random upstream
    gradients; for each backend (and "naive", full logits) the median time of a forward + backward over `reps`
    rounds that run every backend once each (interleaved: a clock or thermal drift hits all alike), the extra peak
    memory (CUDA), and the relative errors of the log-probs and of both gradients against an fp32 reference. Also
    the bf16 GEMM floor and the error that storing the exact gradient in bf16 costs. A backend that runs out of
    memory gets None."""
    cuda = torch.device(dev).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(N, d, device=dev, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(V, d, device=dev, generator=gen) * (3 / d**0.5)).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device=dev, generator=gen)
    g = torch.randn(N, device=dev, generator=gen)
    ref_lp, ref_dh, ref_dw = _reference(h.detach(), w.detach(), y, g)
    floor_err = max(((r.bfloat16().float() - r).norm() / r.norm()).item() for r in (ref_dh, ref_dw))

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return 1e3 * (time.perf_counter() - t0)

    # the floor: the bare bf16 cuBLAS matmuls a recomputing kernel needs (z twice, dH, dW), 8NdV FLOPs
    hd, wd = h.detach(), w.detach()

    def mms():
        z = hd @ wd.t()  # forward
        z = hd @ wd.t()  # backward recompute
        return z @ wd, z.t() @ hd  # dH, dW

    def step(be):
        h.grad = w.grad = None
        if be == "naive":
            lp = _naive(h, w, y)
        elif be in BASELINES:
            lp = _baseline(be, h, w, y)
        else:
            lp = kernels.token_logprobs(h, w, y, backend=be, vocab_chunk_size=vocab_split)
        (lp * g).sum().backward()
        return lp

    fns = {"floor": mms, **{be: (lambda be=be: step(be)) for be in backends}}
    results, times = {}, {name: [] for name in fns}
    for be in ["floor"] + list(backends):  # warm-up (autotunes, compiles), the numbers checked, the memory
        try:
            with torch.no_grad() if be == "floor" else torch.enable_grad():
                out = fns[be]()
            sync()
            if be == "floor":
                del out
                continue
            lp_err = ((out.detach() - ref_lp).norm() / ref_lp.norm()).item()
            g_err = max(((a.float() - r).norm() / r.norm()).item() for a, r in ((h.grad, ref_dh), (w.grad, ref_dw)))
            del out
            h.grad = w.grad = None
            extra = float("nan")
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step(be)
                sync()
                extra = (torch.cuda.max_memory_allocated() - base) / 2.0**30
            results[be] = [extra, lp_err, g_err]
        except (torch.cuda.OutOfMemoryError, MemoryError):
            fns.pop(be)
            results[be] = None
        h.grad = w.grad = None
        if cuda:
            torch.cuda.empty_cache()
    for _ in range(reps):
        for name, fn in fns.items():
            with torch.no_grad() if name == "floor" else torch.enable_grad():
                times[name].append(timed(fn))
            h.grad = w.grad = None
    floor_ms = statistics.median(times["floor"]) if times["floor"] else float("nan")
    out = {be: (None if r is None else (statistics.median(times[be]), *r)) for be, r in results.items()}
    return {"floor_ms": floor_ms, "floor_err": floor_err, "results": out}


def paths(dev) -> list[str]:
    """triton where it runs (CUDA, or TRITON_INTERPRET=1 on a CPU), else eager; then naive."""
    try:
        kernels.resolve_backend("triton", dev)
        return ["triton", "naive"]
    except ValueError:
        return ["eager", "naive"]


def report(N, V, ds, reps, dev, write=print, vocab_split=None, baselines=BASELINES) -> list[dict]:
    """The table for each width in ds; returns its rows (tune_kernels.py keeps them). The baselines run beside
    ours where installed; a row says "not run" and why where one is not."""
    cuda = torch.device(dev).type == "cuda"
    backends = paths(dev)
    not_run = {}
    for name in baselines:
        why, what = baseline_status(name, dev)
        if why:
            not_run[name] = why
        else:
            backends.append(name)
        write(f"baseline {name}: {'not run: ' + why if why else what}")
    gpu = next((k for k in PEAKS if cuda and k in torch.cuda.get_device_name()), None)
    write(
        "rules: time <= 0.5x naive (d=896) / <= 0.9x naive (d=3584) on an H100/H200 at N=16384, V=151936; extra peak "
        "<= 1.5 GiB at d=3584 (bf16 gradients included);\n       logp rel err <= 1e-5; grad rel err <= 1e-3 above "
        "the floor that storing the fp32-exact gradient in bf16 costs. GFLOP and GB: counted from each path's tile "
        "plan (plan_cost)"
    )
    hdr = (
        f"{'path':9} {'d':>5} {'ms':>9} {'x naive':>8} {'x floor':>8} {'GFLOP':>9} {'GB':>8} {'TFLOP/s':>8} "
        f"{'GB/s':>7} {'extra GiB':>9} {'logp err':>9} {'grad err':>9}  verdict"
    )
    rows = []
    for d in ds:
        m = measure(N, V, d, backends=backends, reps=reps, dev=dev, vocab_split=vocab_split)
        floor_ms, floor_err, results = m["floor_ms"], m["floor_err"], m["results"]
        fl = 8 * N * d * V
        write(
            f"\nN={N} V={V} d={d} bf16: GEMM floor (torch bf16 matmuls: z twice, dH, dW) {floor_ms:.2f} ms = "
            f"{fl / floor_ms / 1e9:.1f} TFLOP/s; bf16 storage floor of the gradients {floor_err:.2e}"
        )
        write(hdr)
        naive_ms = results["naive"][0] if results.get("naive") else None
        for be in [b for b in backends if b != "naive"] + ["naive"] + list(not_run):
            if be in not_run:
                write(f"{be:9} {d:5d}   not run: {not_run[be]}")
                rows.append(dict(path=be, N=N, V=V, d=d, not_run=not_run[be]))
                continue
            r = results[be]
            if r is None:
                write(f"{be:9} {d:5d}   out of memory (reported, not fatal)")
                continue
            ms, extra, lp_err, g_err = r
            cost = plan_cost(be, N, d, V, vocab_split=vocab_split)
            met = targets_met(
                be,
                d,
                ms,
                naive_ms=naive_ms,
                extra_gib=extra,
                logp_err=lp_err,
                grad_err=g_err,
                floor_err=floor_err,
                cuda=cuda,
            )
            verdict = " ".join(f"{k} {'PASS' if ok else 'MISS'}" for k, ok in met.items())
            xn = ms / naive_ms if naive_ms else float("nan")
            mem = f"{extra:9.2f}" if cuda else f"{'n/a':>9}"
            write(
                f"{be:9} {d:5d} {ms:9.2f} {xn:8.2f} {ms / floor_ms:8.2f} {cost['flops'] / 1e9:9.1f} "
                f"{cost['bytes'] / 1e9:8.2f} {cost['flops'] / ms / 1e9:8.2f} {cost['bytes'] / ms / 1e6:7.1f} {mem} "
                f"{lp_err:9.2e} {g_err:9.2e}  {verdict}"
            )
            est = {k: estimate_ms(cost, k) for k in PEAKS}
            rows.append(
                dict(path=be, N=N, V=V, d=d, ms=ms, x_naive=xn, x_floor=ms / floor_ms, floor_ms=floor_ms, **cost)
            )
            rows[-1].update(extra_gib=extra, logp_err=lp_err, grad_err=g_err, floor_err=floor_err, met=met)
            rows[-1].update(estimate_ms=est, gpu=gpu)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def int64_check(N, V, dev, write=print) -> None:
    """One vocab split of the whole vocabulary, so in-kernel offsets pass 2**31 (N·V = 2.49e9 at the GPU shape)."""
    d = 896
    gen = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(N, d, device=dev, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(V, d, device=dev, generator=gen) * (3 / d**0.5)).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device=dev, generator=gen)
    y[-1] = V - 1  # the very last logit
    g = torch.randn(N, device=dev, generator=gen)
    ref_lp, ref_dh, ref_dw = _reference(h.detach(), w.detach(), y, g)
    floor_err = max(((r.bfloat16().float() - r).norm() / r.norm()).item() for r in (ref_dh, ref_dw))
    lp = kernels.token_logprobs(h, w, y, backend="triton", vocab_chunk_size=V)
    (lp * g).sum().backward()
    lp_err = ((lp.detach() - ref_lp).norm() / ref_lp.norm()).item()
    last = abs(lp[-1].item() - ref_lp[-1].item())
    g_err = max(((a.float() - r).norm() / r.norm()).item() for a, r in ((h.grad, ref_dh), (w.grad, ref_dw)))
    ok = lp_err <= 1e-5 and last <= 1e-4 and g_err <= floor_err + 1e-3
    write(
        f"\nint64 check (triton, dz [{N} x {V}] in one split, N*V={N * V:.3g}): logp err {lp_err:.2e}, "
        f"last-token |err| {last:.1e}, grad err {g_err:.2e}: {'PASS' if ok else 'MISS'}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="a tiny shape (N=64, V=517, d=40), 2 repetitions")
    ap.add_argument("--tuned-file", help="tuned tiles to use instead of the committed kernels_tuned.json")
    args = ap.parse_args()
    if args.tuned_file:
        if not Path(args.tuned_file).is_file():
            print(f"bench_kernels.py: --tuned-file {args.tuned_file}: not a file", file=sys.stderr)
            sys.exit(2)
        kernels.TUNED_FILE = Path(args.tuned_file)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    versions = f"torch {torch.__version__}, triton {kernels.triton.__version__ if kernels.HAS_TRITON else 'missing'}"
    if args.dry_run:
        N, V, ds, reps = 64, 517, (40,), 2
        print(f"dry run on {dev}: tiny shape, numbers mean nothing (the interpreter truncates dz to bf16); {versions}")
    elif cuda:
        N, V, ds, reps = 16384, 151936, (896, 3584), 5
        print(f"CUDA: {torch.cuda.get_device_name()}, {versions}")
    else:
        N, V, ds, reps = 1024, 8192, (128, 512), 3
        print(
            f"No CUDA: small CPU shape (the targets are for N=16384, V=151936 on a GPU); {versions}, "
            f"{torch.get_num_threads()} threads; memory not measured"
        )
    report(N, V, ds, reps, dev)
    if cuda and kernels.HAS_TRITON and not args.dry_run:
        int64_check(N, V, dev)
    else:
        print("\nint64 check (N*V > 2^31): needs CUDA + Triton at the GPU shape, skipped here")


if __name__ == "__main__":
    main()
