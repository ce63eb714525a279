"""Per-token log-probs (and entropy) of an LM head without materialising [N x V] logits.

Math (T = temperature, y = targets):
    z = H Wᵀ / T                      (N x V, fp32 accumulation, kept fp32)
    lse = logsumexp(z),  logp = z[y] - lse,  p = softmax(z),  entropy = lse - Σ p·z
Backward, with upstream gradients g (on logp) and e (on entropy):
    dz = g·(onehot(y) - p) - e·p·(z - Σ p·z),   then / T        (fp32, rounded once)
    dH = dz W,   dW = dzᵀ H
Rows with y == ignore_index are dropped before any work and give 0 (no gradient); rows whose upstream gradients are
both zero (GRPO's zero-variance groups) are dropped before the backward's matmuls (their dz is exactly 0).

Row state (both backends): relative to the running max m, s = Σ exp(z-m), x = the same sum without the target,
t = Σ exp(z-m)(z-m) and z[y]. Then lse = m + log s, entropy = log s - t/s, q = 1 - p_y = x/s, and logp = log1p(-q)
for confident tokens: a common logit offset cancels exactly and 1 - p_y is never formed by cancellation.

"triton" (CUDA; also runs under TRITON_INTERPRET=1 on CPU tensors), split-N with fused epilogues:
  * forward: one Triton GEMM over (token tiles x vocab splits). Each program walks its split's vocab blocks, keeps
    the row state in registers (the GEMM's epilogue) and writes one partial state per (row, split); the partials
    are merged in a fixed order on the host. No logits tile ever reaches HBM. The grad and no-grad forwards are
    this one kernel, so they are bitwise equal.
  * backward, per vocab split of Vs columns over all tokens at once: one Triton GEMM recomputes z and writes dz
    once in the compute dtype (fp32 math, rounded once); dW for the split is one cuBLAS GEMM over all tokens
    written once (no fp32 dW accumulator); dH is one accumulating GEMM into an fp32 [N x d] buffer. The logits
    are recomputed (8NdV FLOPs in all against the 6NdV of keeping them).
  * tiles (BLOCK_N, BLOCK_V, BLOCK_D, warps, stages) are chosen by triton.autotune keyed on (d, V), from the
    entries of kernels_tuned.json for the GPU's name when it has them (one config for a tuned (d, V): the same
    tiles, hence the same bits, in every process), else from DEFAULT_CONFIGS. N is not in the key (no re-tune for
    a new batch length). No atomics: the same inputs give the same bits.
"eager" (the reference and the CPU default): the same math tile by tile in torch ops on [token chunk x vocab
chunk] logits from cuBLAS with fp32 output; the backward accumulates dW and dH in fp32 and writes each once.
"auto" picks triton on CUDA when Triton imports, else eager.
"""

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import torch

try:  # Triton is optional: `import kernels` must work without it or without a GPU driver
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = tl = None
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "eager")
TUNED_FILE = Path(__file__).resolve().parent / "kernels_tuned.json"  # tuned tiles by GPU name (tools/tune_kernels.py)
# Tiles the autotuner tries on a GPU with no tuned entry: Hopper-sized bf16 GEMM tiles (128-256 wide, 64-deep
# k-steps, 3-4 stages fit in 228 KiB of shared memory), the widest rows first.
DEFAULT_CONFIGS = (
    dict(BLOCK_N=128, BLOCK_V=256, BLOCK_D=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, num_warps=4, num_stages=4),
    dict(BLOCK_N=256, BLOCK_V=128, BLOCK_D=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=64, BLOCK_V=256, BLOCK_D=64, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BLOCK_V=64, BLOCK_D=64, num_warps=4, num_stages=5),
)
# Under TRITON_INTERPRET=1 each program runs in numpy: small tiles, so tests see many vocab blocks and ragged tails
INTERPRET_CONFIG = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=16, num_warps=4, num_stages=1)
FWD_SPLIT_COLS = 4096  # the forward's vocab splits hold at least this many columns (tests lower it)
FWD_PROGRAMS = 1024  # the forward splits the vocabulary until about this many programs run (8 per SM on an H100)
DZ_BYTES = 2**27  # the backward's dz buffer [N x Vs] in the compute dtype: at least this, more when dH's is small
WORKSPACE_BYTES_TRITON = 2**28  # dz buffer + fp32 dH accumulator, where N x d allows


def _interpret():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend, device):
    """Map a backend name (one of BACKENDS) to the one that will run on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        if cuda and HAS_TRITON:
            return "triton"
        return "eager"
    if backend == "triton" and not (HAS_TRITON and (cuda or _interpret())):
        raise ValueError("backend 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)")
    return backend


# ----------------------------------------------------------------------------- matmuls
_OUT_DTYPE_OK = {}


def _out_dtype_ok(device):
    """Whether torch.mm(bf16, bf16, out_dtype=float32) works and is exact-accumulating here
    (CUDA, torch >= 2.8). Probed once per device; otherwise we upcast the operands."""
    key = str(device)
    if key not in _OUT_DTYPE_OK:
        ok = False
        if torch.device(device).type == "cuda":
            try:  # the three patterns used below: A Bᵀ, A B into acc, Aᵀ B into acc
                g = torch.Generator(device=device).manual_seed(0)
                a, b = (torch.randn(96, 64, device=device, generator=g).bfloat16() for _ in range(2))
                ad, bd = a.double(), b.double()
                r1 = torch.mm(a, b.t(), out_dtype=torch.float32)
                acc = torch.ones(96, 64, device=device)
                torch.addmm(acc, r1.bfloat16(), b, out_dtype=torch.float32, out=acc)
                acc2 = torch.ones(64, 64, device=device)
                torch.addmm(acc2, a.t(), b, out_dtype=torch.float32, out=acc2)
                errs = (
                    (r1.double() - ad @ bd.t()).abs().max(),
                    (acc.double() - 1 - r1.bfloat16().double() @ bd).abs().max(),
                    (acc2.double() - 1 - ad.t() @ bd).abs().max(),
                )
                ok = r1.dtype == torch.float32 and max(float(x) for x in errs) < 1e-3
            except Exception:
                ok = False
        _OUT_DTYPE_OK[key] = bool(ok)
    return _OUT_DTYPE_OK[key]


def matmul_path(device, dtype):
    """(description, slow) of the GEMM path that logits tiles of `dtype` inputs take on `device`. slow: a GPU whose
    torch refuses bf16/fp16 matmuls with fp32 output, so every tile is upcast to fp32 first (about 10x slower)."""
    if dtype == torch.float32:
        return "fp32 matmuls", False
    if _out_dtype_ok(device):
        return f"{str(dtype).removeprefix('torch.')} matmuls with fp32 output (torch.mm out_dtype)", False
    slow = torch.device(device).type == "cuda"
    return f"{str(dtype).removeprefix('torch.')} operands upcast to fp32 matmuls (no torch.mm out_dtype here)", slow


# The precision policy of replay_grpo.py. Weights and Adam state are fp32 everywhere (masters): a bf16 weight loses
# every update below half its ulp, nearly all of them at lr 1e-6. Forward and backward run in the compute dtype
# (bf16 on GPUs that support it, under autocast), generators hold compute-dtype copies, log-probs are fp32 (here).
# REPLAY_GRPO_COMPUTE_DTYPE=bfloat16 selects bf16 on a CPU too: the tests simulate a GPU's policy with it.
COMPUTE_DTYPE_ENV = "REPLAY_GRPO_COMPUTE_DTYPE"


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, fp32 elsewhere, unless REPLAY_GRPO_COMPUTE_DTYPE names one."""
    forced = os.environ.get(COMPUTE_DTYPE_ENV)
    if forced:
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[forced]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def report_precision(device: torch.device, write=print) -> None:
    """One line at the start of a run that computes in bf16: the policy, and the log-prob matmul path if slow."""
    dtype = compute_dtype(device)
    if dtype == torch.float32:
        return
    path, slow = matmul_path(device, dtype)
    line = f"precision: fp32 master weights and Adam state, {str(dtype).removeprefix('torch.')} compute; "
    line += f"log-prob tiles: {path}"
    if slow:
        line += " -- the slow path (about 10x): a torch with mm(..., out_dtype=float32) avoids it"
    write(line)


def autocast(device: torch.device):
    """Compute in the compute dtype on fp32 master weights (a no-op where that is fp32)."""
    dtype = compute_dtype(device)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def memory_stats(device: torch.device):
    """The allocator's statistics of `device` (torch.cuda's functions), or None where it keeps none (CPU)."""
    return torch.cuda if device.type == "cuda" else None


class StepMemory:
    """A step record's device memory. peak_memory_gib: the train step's own peak (the peak statistic is reset before
    each step) less the generator's share; generator_memory_gib: that share, what the device holds more once the
    generator is built (a vLLM engine's pools count in the allocator's statistics asleep or awake, and a colocated
    HF copy). None where the device keeps no statistics."""

    def __init__(self, device: torch.device):
        self.device, self.stats, self.generator_bytes = device, memory_stats(device), 0

    def allocated(self) -> int:
        return self.stats.memory_allocated(self.device) if self.stats else 0

    @contextlib.contextmanager
    def generator_share(self):
        """Around the generator's construction: what it adds to the device is its share."""
        before = self.allocated()
        yield
        self.generator_bytes = self.allocated() - before

    def start_step(self) -> None:
        if self.stats:
            self.stats.reset_peak_memory_stats(self.device)

    def record(self) -> dict:
        if not self.stats:
            return {"peak_memory_gib": None}
        peak = self.stats.max_memory_allocated(self.device) - self.generator_bytes
        return {"peak_memory_gib": peak / 2**30, "generator_memory_gib": self.generator_bytes / 2**30}


def cast_copy(model, dtype: torch.dtype, device: torch.device | None = None):
    """A frozen copy of `model` with its floating-point parameters and buffers in `dtype` on `device` (default: the
    model's), each cast straight from the original: no full-precision copy is ever made on the target device."""
    device = device or next(model.parameters()).device
    memo = {}  # deepcopy takes these in place of the originals (tied weights: one tensor, one copy)
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            # cast where the original lives, then move: the target device only ever sees `dtype`
            cast = t.detach().to(dtype=dtype if t.is_floating_point() else t.dtype, copy=True).to(device)
            memo[id(t)] = torch.nn.Parameter(cast, requires_grad=False) if isinstance(t, torch.nn.Parameter) else cast
    import copy

    return copy.deepcopy(model, memo).eval()


def _mm_f32(a, b):
    """a @ b with fp32 output and fp32 accumulation (bf16 logits would break the ratio)."""
    if a.dtype == torch.float32:
        return a @ b
    if _out_dtype_ok(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # bf16/fp16 products are exact in fp32


def _addmm_f32(acc, a, b):
    """acc += a @ b, acc fp32, accumulation fp32, a/b in the input dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _out_dtype_ok(a.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


# ------------------------------------------------------------------ per-tile functions
# z: raw logits tile [C, Vc] fp32 (not yet divided by T); yl: target index local to the
# tile (int64, may lie outside [0, Vc): then the target is in another tile or ignored).


def _fwd_tile_torch(z, yl, inv_t, m, s, x, t, zy):
    """Merge one tile into the running row state; returns the new (m, s, x, t, zy):
    m = max z, s = Σ exp(z - m), x = the same sum without the target, t = Σ exp(z - m)(z - m),
    zy = z[y]."""
    z = z * inv_t
    mt = z.amax(1)
    zc = z - mt[:, None]
    ez = zc.exp()
    tgt = torch.arange(z.shape[1], device=z.device) == yl[:, None]
    st, xt, tt = ez.sum(1), ez.masked_fill(tgt, 0.0).sum(1), (ez * zc).sum(1)
    hit = (yl >= 0) & (yl < z.shape[1])
    zt = z.gather(1, yl.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
    mn = torch.maximum(m, mt)
    a, b = (m - mn).exp(), (mt - mn).exp()
    t_old = t + torch.where(s > 0, m - mn, 0.0) * s  # s == 0: empty state, m = -inf
    return (mn, a * s + b * st, a * x + b * xt, a * t_old + b * (tt + (mt - mn) * st), torch.where(hit, zt, zy))


def _bwd_tile_torch(z, yl, inv_t, m, ls, tbar, q, g, e, out_dtype):
    """dz tile = (g·(onehot - p) - e·p·(z - Σp·z)) / T in fp32, rounded once. Logits are
    taken relative to the row max m (so a common offset cancels exactly) and the target
    column uses q = 1 - p_y from the forward (no cancellation when p_y -> 1)."""
    zc = z * inv_t - m[:, None]
    p = (zc - ls[:, None]).exp()
    tgt = torch.arange(z.shape[1], device=z.device) == yl[:, None]
    dz = torch.where(tgt, (g * q)[:, None], -p * g[:, None]) - p * e[:, None] * (zc - tbar[:, None])
    return (dz * inv_t).to(out_dtype)


# --------------------------------------------------------------------- Triton kernels
if HAS_TRITON:

    @triton.jit
    def _logits_tile(
        h_ptr,
        w_ptr,
        rows,
        cols,
        rmask,
        cmask,
        D,
        stride_h,
        stride_w,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # z tile [BLOCK_N, BLOCK_V] = H[rows] W[cols]ᵀ, fp32 accumulation (ieee: fp32 inputs stay exact, no TF32).
        # UPCAST (the interpreter only, whose tl.dot multiplies bf16's raw bits): the exact fp32 values instead
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            kmask = ks < D
            a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        return acc

    @triton.jit
    def _fwd_kernel(
        h_ptr,
        w_ptr,
        y_ptr,
        part_ptr,
        N,
        V,
        D,
        stride_h,
        stride_w,
        NUM_SPLITS,
        INV_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # Program (token tile, vocab split): the row state over the split's vocab blocks, in registers; one partial
        # (m, s, x, t, zy) per (split, row) written to part [5, NUM_SPLITS, N].
        split = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: row * stride > 2**31
        rmask = rows < N
        y = tl.load(y_ptr + rows, mask=rmask, other=-1)
        n_blocks = tl.cdiv(V, BLOCK_V)
        per = tl.cdiv(n_blocks, NUM_SPLITS)
        m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        x = tl.zeros((BLOCK_N,), tl.float32)
        t = tl.zeros((BLOCK_N,), tl.float32)
        zy = tl.zeros((BLOCK_N,), tl.float32)
        for blk in range(split * per, tl.minimum(split * per + per, n_blocks)):
            cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
            cmask = cols < V
            z = _logits_tile(
                h_ptr,
                w_ptr,
                rows,
                cols,
                rmask,
                cmask=cmask,
                D=D,
                stride_h=stride_h,
                stride_w=stride_w,
                BLOCK_N=BLOCK_N,
                BLOCK_V=BLOCK_V,
                BLOCK_D=BLOCK_D,
                UPCAST=UPCAST,
            )
            z = tl.where(cmask[None, :], z * INV_T, float("-inf"))  # vocab tail: padded columns must not add exp(0)
            mn = tl.maximum(m, tl.max(z, 1))
            zc = tl.where(cmask[None, :], z - mn[:, None], 0.0)
            ez = tl.where(cmask[None, :], tl.exp(zc), 0.0)
            a = tl.exp(m - mn)
            # (m - mn) is -inf while the state is empty (s = 0): keep it out of the product
            t = a * (t + tl.where(s > 0, m - mn, 0.0) * s) + tl.sum(ez * zc, 1)
            s = a * s + tl.sum(ez, 1)
            tgt = cols[None, :] == y[:, None]
            x = a * x + tl.sum(tl.where(tgt, 0.0, ez), 1)
            zy += tl.sum(tl.where(tgt, z, 0.0), 1)  # one column hits, the rest add exact zeros
            m = mn
        out = part_ptr + split * N + rows
        stride_k = NUM_SPLITS * N
        tl.store(out, m, mask=rmask)
        tl.store(out + stride_k, s, mask=rmask)
        tl.store(out + 2 * stride_k, x, mask=rmask)
        tl.store(out + 3 * stride_k, t, mask=rmask)
        tl.store(out + 4 * stride_k, zy, mask=rmask)

    @triton.jit
    def _bwd_kernel(
        h_ptr,
        w_ptr,
        yl_ptr,
        m_ptr,
        ls_ptr,
        tbar_ptr,
        q_ptr,
        g_ptr,
        e_ptr,
        dz_ptr,
        N,
        VS,
        D,
        V,
        stride_h,
        stride_w,
        stride_dz,
        INV_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP_N: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # One [BLOCK_N x BLOCK_V] tile of dz for a vocab split of VS columns (w_ptr at its first row; V, the whole
        # vocabulary, only keys the autotuner). Programs are grouped GROUP_N token tiles at a time so that the
        # ones running together share W's and H's tiles in L2.
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_N * tl.cdiv(VS, BLOCK_V)
        first_n = (pid // in_group) * GROUP_N
        size = tl.minimum(num_n - first_n, GROUP_N)
        pid_n = first_n + (pid % in_group) % size
        pid_v = (pid % in_group) // size
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        rmask = rows < N
        cmask = cols < VS
        z = _logits_tile(
            h_ptr,
            w_ptr,
            rows,
            cols,
            rmask,
            cmask=cmask,
            D=D,
            stride_h=stride_h,
            stride_w=stride_w,
            BLOCK_N=BLOCK_N,
            BLOCK_V=BLOCK_V,
            BLOCK_D=BLOCK_D,
            UPCAST=UPCAST,
        )
        m = tl.load(m_ptr + rows, mask=rmask, other=0.0)
        ls = tl.load(ls_ptr + rows, mask=rmask, other=0.0)
        tbar = tl.load(tbar_ptr + rows, mask=rmask, other=0.0)
        q = tl.load(q_ptr + rows, mask=rmask, other=0.0)
        g = tl.load(g_ptr + rows, mask=rmask, other=0.0)
        e = tl.load(e_ptr + rows, mask=rmask, other=0.0)
        yl = tl.load(yl_ptr + rows, mask=rmask, other=-1)
        # relative to the row max (a common offset cancels); the target column from q = 1 - p_y (no cancellation)
        zc = z * INV_T - m[:, None]
        p = tl.exp(zc - ls[:, None])
        tgt = cols[None, :] == yl[:, None]
        dz = tl.where(tgt, (g * q)[:, None], -p * g[:, None]) - p * e[:, None] * (zc - tbar[:, None])
        tl.store(
            dz_ptr + rows[:, None] * stride_dz + cols[None, :],
            (dz * INV_T).to(dz_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
            mask=rmask[:, None] & cmask[None, :],
        )


GROUP_N = 8
_TUNERS = {}
_TUNED_CACHE = {}


def gpu_name(device) -> str:
    """The key of kernels_tuned.json: the CUDA device's name, "interpreter" under TRITON_INTERPRET=1 on a CPU."""
    if torch.device(device).type != "cuda":
        return "interpreter"
    return torch.cuda.get_device_name(device)


def load_tuned(path=None) -> dict:
    """kernels_tuned.json (or `path`): {"gpus": {name: {"<d>x<V>": {"fwd": config, "bwd": config, "vocab_split": Vs,
    "measured": {...}}}}}, a config being {"BLOCK_N", "BLOCK_V", "BLOCK_D", "num_warps", "num_stages"}."""
    path = Path(path or TUNED_FILE)
    if not path.exists():
        return {"gpus": {}}
    key = (str(path), path.stat().st_mtime_ns)  # read once per version of the file, not once per call
    if key not in _TUNED_CACHE:
        _TUNED_CACHE[key] = json.loads(path.read_text())
    return _TUNED_CACHE[key]


def candidate_configs(kind, name, d, V) -> list[dict]:
    """The tiles autotune picks from for kernel `kind` ("fwd" or "bwd") at (d, V) on GPU `name`: the tuned one alone
    when the file has (d, V) for this GPU, else the GPU's other tuned ones and DEFAULT_CONFIGS."""
    if name == "interpreter":
        return [dict(INTERPRET_CONFIG)]
    entry = load_tuned().get("gpus", {}).get(name, {})
    if f"{d}x{V}" in entry:
        return [entry[f"{d}x{V}"][kind]]
    found = [shape[kind] for shape in entry.values()] + [dict(c) for c in DEFAULT_CONFIGS]
    return [c for i, c in enumerate(found) if c not in found[:i]]


def _tuned_kernel(kind, device, d, V):
    configs = candidate_configs(kind, gpu_name(device), d, V)
    key = (kind, json.dumps(configs))
    if key not in _TUNERS:
        fn = _fwd_kernel if kind == "fwd" else _bwd_kernel
        tiles = [
            triton.Config(
                {k: c[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_D")},
                num_warps=c["num_warps"],
                num_stages=c["num_stages"],
            )
            for c in configs
        ]
        _TUNERS[key] = triton.autotune(configs=tiles, key=["D", "V"])(fn)
    return _TUNERS[key]


def fwd_splits(N, V) -> int:
    """The forward's vocab splits: enough (token tile x split) programs to fill the GPU (FWD_PROGRAMS, token tiles
    counted at 128 rows), at least FWD_SPLIT_COLS columns each. A function of the shape only, so the merge order and
    the bits do not depend on the device."""
    return max(1, min(-(-FWD_PROGRAMS // -(-N // 128)), V // FWD_SPLIT_COLS))


def vocab_split(N, d, V, itemsize) -> int:
    """The backward's vocab split Vs: the dz buffer [N x Vs] (compute dtype) and the fp32 dH accumulator [N x d]
    within WORKSPACE_BYTES_TRITON where N x d allows, the dz buffer at least DZ_BYTES; a multiple of 256."""
    budget = max(DZ_BYTES, WORKSPACE_BYTES_TRITON - 4 * N * d)
    return max(256, min(V, budget // max(1, N * itemsize) // 256 * 256))


def backward_workspace_bytes(N, d, V, itemsize) -> int:
    """Bytes the triton backward holds beside its inputs and dW: the dz buffer [N x Vs] and the fp32 dH [N x d]."""
    return N * min(vocab_split(N, d, V, itemsize), V) * itemsize + 4 * N * d


def fwd_triton(h, w, y, inv_t, config=None):
    """The forward's partial row states [5, splits, N] (m, s, x, t, zy) from one Triton GEMM; config None: the
    autotuned tiles, else the dict given (tools/tune_kernels.py)."""
    N, d = h.shape
    V = w.shape[0]
    splits = fwd_splits(N, V)
    part = torch.empty(5, splits, N, dtype=torch.float32, device=h.device)
    args = dict(h_ptr=h, w_ptr=w, y_ptr=y, part_ptr=part, N=N, V=V, D=d, stride_h=h.stride(0))
    args.update(stride_w=w.stride(0), NUM_SPLITS=splits, INV_T=inv_t, UPCAST=_interpret())
    if config is None:
        _tuned_kernel("fwd", h.device, d, V)[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), splits)](**args)
    else:
        _fwd_kernel[(triton.cdiv(N, config["BLOCK_N"]), splits)](**args, **config)
    return part


def merge_partials(part):
    """The row state (m, s, x, t, zy) from the splits' partials, merged in the splits' order (no atomics)."""
    m, s, x, t, zy = part
    M = m.amax(0)
    a = torch.exp(m - M)  # an empty split (m = -inf, s = 0) adds nothing
    t = t + torch.where(s > 0, m - M, 0.0) * s
    return M, (a * s).sum(0), (a * x).sum(0), (a * t).sum(0), zy.sum(0)


def bwd_dz_triton(h, wv, yl, stats, g, e, inv_t, dz, V, config=None):
    """dz [N x Vs] (compute dtype) of one vocab split (wv = its rows of W; yl = targets minus its first column)."""
    N, d = h.shape
    VS = wv.shape[0]
    m, ls, tbar, q = stats
    args = dict(h_ptr=h, w_ptr=wv, yl_ptr=yl, m_ptr=m, ls_ptr=ls, tbar_ptr=tbar, q_ptr=q, g_ptr=g, e_ptr=e)
    args.update(dz_ptr=dz, N=N, VS=VS, D=d, V=V, stride_h=h.stride(0), stride_w=wv.stride(0), stride_dz=dz.stride(0))
    args.update(INV_T=inv_t, GROUP_N=GROUP_N, UPCAST=_interpret())
    if config is None:
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(VS, meta["BLOCK_V"]),)  # noqa: E731
        _tuned_kernel("bwd", h.device, d, V)[grid](**args)
    else:
        _bwd_kernel[(triton.cdiv(N, config["BLOCK_N"]) * triton.cdiv(VS, config["BLOCK_V"]),)](**args, **config)
    return dz


# ------------------------------------------------------------------------- autograd
def _default_chunks(device, d, V):
    """The eager backend's tile (token chunk, vocab chunk)."""
    if torch.device(device).type == "cuda":
        # ~2^23 fp32 elements for the [Vc x d] dW accumulator, 4096-token matmuls
        vc = max(1024, 1 << int(math.log2(max(1, (1 << 23) // d))))
        return 4096, min(V, vc)
    return 1024, min(V, 8192)


def _forward_eager(h, w, y, inv_t, C, Vc):
    N, V = h.shape[0], w.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    state = [torch.full((N,), float("-inf"), **f32)] + [torch.zeros(N, **f32) for _ in range(4)]  # m, s, x, t, zy
    for v0 in range(0, V, Vc):
        wv = w[v0 : v0 + Vc]
        for c0 in range(0, N, C):
            sl = slice(c0, c0 + C)
            new = _fwd_tile_torch(_mm_f32(h[sl], wv.t()), y[sl] - v0, inv_t, *(a[sl] for a in state))
            for a, b in zip(state, new):
                a[sl] = b
    return state


def _backward_eager(h, w, y, inv_t, stats, g, e, need_h, need_w, C, Vc):
    N, V = h.shape[0], w.shape[0]
    dh_acc = torch.zeros(N, h.shape[1], dtype=torch.float32, device=h.device) if need_h else None
    dw = torch.empty_like(w) if need_w else None
    for v0 in range(0, V, Vc):
        wv = w[v0 : v0 + Vc]
        dw_acc = torch.zeros(wv.shape, dtype=torch.float32, device=w.device) if need_w else None
        for c0 in range(0, N, C):
            sl = slice(c0, c0 + C)
            z = _mm_f32(h[sl], wv.t())
            m, ls, tbar, q = (a[sl] for a in stats)
            dz = _bwd_tile_torch(z, y[sl] - v0, inv_t, m, ls, tbar=tbar, q=q, g=g[sl], e=e[sl], out_dtype=h.dtype)
            del z
            if need_h:
                _addmm_f32(dh_acc[sl], dz, wv)
            if need_w:
                _addmm_f32(dw_acc, dz.t(), h[sl])
        if need_w:
            dw[v0 : v0 + Vc].copy_(dw_acc)  # each dW slice rounded and written once
    return dh_acc, dw


def _backward_triton(h, w, y, inv_t, stats, g, e, need_h, need_w, Vc):
    N, V = h.shape[0], w.shape[0]
    dz = torch.empty(N, min(Vc, V), dtype=h.dtype, device=h.device)  # reused by every split
    dh_acc = torch.zeros(N, h.shape[1], dtype=torch.float32, device=h.device) if need_h else None
    dw = torch.empty_like(w) if need_w else None
    for v0 in range(0, V, Vc):
        wv = w[v0 : v0 + Vc]
        dzv = bwd_dz_triton(h, wv, y - v0, stats, g, e=e, inv_t=inv_t, dz=dz[:, : wv.shape[0]], V=V)
        if need_w:
            torch.mm(dzv.t(), h, out=dw[v0 : v0 + wv.shape[0]])  # one GEMM over all tokens, written once
        if need_h:
            _addmm_f32(dh_acc, dzv, wv)
    return dh_acc, dw


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, y, cfg):
        inv_t, backend, C, Vc = cfg  # 1 / temperature, backend, eager tile / triton backward vocab split
        if backend == "triton":
            m, s, x, t, zy = merge_partials(fwd_triton(h, w, y, inv_t))
        else:
            m, s, x, t, zy = _forward_eager(h, w, y, inv_t, C=C, Vc=Vc)
        ls, tbar = s.log(), t / s
        q = x / s  # 1 - p_y without cancellation
        # log p_y = log1p(-q) is accurate for confident tokens; z_y - lse elsewhere
        logp = torch.where(q < 0.5, torch.log1p(-q), zy - m - ls)
        ent = ls - tbar
        ctx.save_for_backward(h, w, y, m, ls, tbar, q)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g, e):
        h, w, y, m, ls, tbar, q = ctx.saved_tensors
        inv_t, backend, C, Vc = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g is None and e is None) or not (need_h or need_w):
            return None, None, None, None
        N = h.shape[0]
        zero = torch.zeros(N, dtype=torch.float32, device=h.device)
        # per-token upstream gradients are folded into dz (stride-0 ones from .sum() copied)
        g = zero if g is None else g.float().contiguous()
        e = zero if e is None else e.float().contiguous()
        # rows with g = e = 0 have dz = 0 exactly: dropped before the matmuls (one host sync)
        live = (g != 0) | (e != 0)
        n_live = int(live.sum())
        keep = None if n_live == N else live.nonzero()[:, 0]
        stats = (m, ls, tbar, q)
        hk, yk = h, y
        if keep is not None:
            hk, yk, g, e = h[keep], y[keep], g[keep], e[keep]
            stats = tuple(a[keep] for a in stats)
        if n_live == 0:
            dh_acc = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
            dw = torch.zeros_like(w) if need_w else None
        elif backend == "triton":
            kw = dict(stats=stats, g=g, e=e, need_h=need_h, need_w=need_w, Vc=Vc)
            dh_acc, dw = _backward_triton(hk, w, yk, inv_t, **kw)
        else:
            kw = dict(stats=stats, g=g, e=e, need_h=need_h, need_w=need_w, C=C, Vc=Vc)
            dh_acc, dw = _backward_eager(hk, w, yk, inv_t, **kw)
        dh = None
        if need_h:
            dh = dh_acc.to(h.dtype)
            if keep is not None and n_live:
                dh = torch.zeros_like(h).index_copy_(0, keep, dh)
        return dh, dw, None, None


@torch.compiler.disable  # a caller's torch.compile runs this eagerly
def token_logprobs(
    hidden,
    weight,
    targets,
    temperature=1.0,
    ignore_index=-100,
    return_entropy=False,
    backend="auto",
    chunk_size=None,
    vocab_chunk_size=None,
):
    """log softmax(hidden @ weightᵀ / T)[targets] in fp32, optionally with the entropy.

    hidden [..., d] and weight [V, d] (bf16, fp16 or fp32, same dtype); targets [...] int.
    Rows whose target equals ignore_index give 0, receive no gradient and cost nothing.
    Out-of-range targets and temperature <= 0 or non-finite raise ValueError. Autograd
    flows to hidden and weight (pass a tied embedding parameter itself to reach it).
    eager: chunk_size (tokens) and vocab_chunk_size set the logits tile; triton: vocab_chunk_size sets the
    backward's vocab split (default vocab_split), chunk_size is unused (every split takes all tokens). Results do
    not depend on them beyond fp32 rounding. It syncs with the host (target validation). Inside a caller's
    torch.compile region it runs eagerly (graph break).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} "
            "(expected hidden [..., d], weight [V, d])"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != hidden.shape[:-1] {tuple(hidden.shape[:-1])}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"hidden and weight must share a dtype in bf16/fp16/fp32, got {hidden.dtype} and {weight.dtype}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    backend = resolve_backend(backend, hidden.device)
    lead, d, V = hidden.shape[:-1], hidden.shape[-1], weight.shape[0]
    h = hidden.reshape(-1, d)
    y = targets.reshape(-1).to(device=h.device, dtype=torch.int64)
    ignored = y == ignore_index
    bad = ~ignored & ((y < 0) | (y >= V))
    any_bad, any_ignored = torch.stack([bad.any(), ignored.any()]).tolist()  # one host sync
    if any_bad:  # a wrong index would silently read another token's logit
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target {int(y[i])} at flat position {i} is outside [0, {V}) and is not ignore_index ({ignore_index})"
        )
    # ignored rows are dropped before any work (RL batches are often half padding);
    # ignore_index itself is never used as an index
    keep = (~ignored).nonzero()[:, 0] if any_ignored else None
    if keep is not None:
        h, y = h[keep], y[keep]  # (backward: sort-based index_put, deterministic)
    if backend == "triton":
        C = h.shape[0]
        Vs = vocab_split(h.shape[0], d, V, h.element_size())
        tuned = load_tuned().get("gpus", {}).get(gpu_name(h.device), {}).get(f"{d}x{V}", {}).get("vocab_split")
        Vc = max(1, min(V, int(vocab_chunk_size or min(tuned or Vs, Vs))))  # a tuned split, within the budget
    else:
        C0, Vc0 = _default_chunks(h.device, d, V)
        C = max(1, int(chunk_size or C0))
        Vc = max(1, min(V, int(vocab_chunk_size or Vc0)))
    if h.shape[0] == 0:
        logp = ent = (h.sum(1) + weight.sum() * 0).float()  # zeros, graph kept connected
    else:
        logp, ent = _TokenLogprobs.apply(h.contiguous(), weight.contiguous(), y, (1.0 / temperature, backend, C, Vc))
    if keep is not None:  # scatter back; ignored rows give exactly 0 and get no gradient
        logp = logp.new_zeros(ignored.shape).masked_scatter(~ignored, logp)
        ent = ent.new_zeros(ignored.shape).masked_scatter(~ignored, ent)
    logp, ent = logp.reshape(lead), ent.reshape(lead)
    return (logp, ent) if return_entropy else logp


# ----------------------------------------------------------------------------- the memory plan
# Bytes a train step needs on each trainer's device, estimated before the first step from the model's shapes and the
# run's settings (`plan_memory`), printed as a table and checked against the device (`check_memory_plan`):
#   states       fp32 masters 4, gradients 4, Adam's two moments 8 bytes a parameter (per rank: its FSDP2 shard)
#   fresh grad   sync: the largest parameter's new fp32 gradient, live beside its .grad until autograd adds it (a
#                second micro-batch, or a tied embedding's second use: 0.51 GiB of the 0.5B-width peak on an H200)
#   copies       the compute-dtype weights the forward and backward use: autocast's casts of every weight (sync);
#                FSDP2's all-gathered root (embeddings, head, final norm) and two decoder layers, and fp32 gradients
#                of the root and two layers before their reduce-scatter (async)
#   activations  tokens of the longest micro-batch (micro-batch x (longest training prompt + max new tokens)) x
#                (layers x act_layer + act_outside); with activation checkpointing, layers x 4h (each layer's fp32
#                input) + one layer's act_layer for its recompute. Per token, c the compute dtype's bytes:
#                act_layer   = 16h + 8 (two RMSNorms in fp32) + 5hc (the inputs of q, k, v, gate and up, each
#                              cast) + 3qc + 2kc (attention: q, output, o_proj's input; k and v) + 4 heads (its
#                              log-sum-exp) + 4ic (the MLP); in fp32 compute the cast inputs are shared (8h)
#                act_outside = 14h (the embedding's output, the final norm, the head's input, its gradient)
#                (h hidden, i intermediate, q heads x head_dim, k key-value heads x head_dim)
#   workspace    the triton log-prob backward's dz buffer and fp32 dH (backward_workspace_bytes) for the tokens above
#   generator    sync: a colocated vLLM engine's share of the device, or the HF copy (c a parameter); async: the
#                --vllm-gpu-memory-utilization share of each launched server on this rank's GPU (server_gpus)
#   publisher    async rank 0 with --weight-transfer nccl: the full model gathered in c for a publish, and vLLM's
#                packed broadcast buffers; held while the publisher thread sends, beside the next steps
#   evaluation   sync, after a step: a separate evaluator's copy (c a parameter) and its KV cache (pass@k prompts x k
#                sequences x (longest evaluation prompt + max new tokens) x layers x 2k c), beside the masters and
#                Adam (gradients are freed by then); async evaluates on a server: nothing on the trainers
#   reserve      what no tensor of the run holds: the CUDA context, NCCL's buffers, the allocator's fragmentation
# The peak is the larger of the step and the evaluation. Checked on CPU against measurement (tests/test_memory_plan.py);
# not yet against a GPU's allocator.
DEVICE_GIB_ENV = "REPLAY_GRPO_DEVICE_GIB"  # a test hook: plan for a device of this many GiB (e.g. on a CPU)
GIB = 2**30
# Estimates, not measured here: the CUDA context with cuBLAS's workspaces (~0.5 GiB with lazy module loading) and the
# caching allocator's fragmentation (~0.5 GiB), and each NCCL communicator's buffers (NCCL_BUFFSIZE's default 4 MiB
# per peer and channel: 2 ring peers x up to 32 channels)
CONTEXT_RESERVE_BYTES = 2**30
NCCL_COMMUNICATOR_BYTES = 2**28
# vllm.distributed.weight_transfer.packed_tensor (vLLM 0.32): DEFAULT_PACKED_BUFFER_SIZE_BYTES (1 GiB) x
# DEFAULT_PACKED_NUM_BUFFERS (2), the nccl route's broadcast buffers; written out, as vLLM is optional
PACKED_BROADCAST_BYTES = 2 * 2**30
FRESH_GRADIENT_ROW = "fresh gradient (largest parameter)"
PUBLISHER_ROW, RESERVE_ROW = "publisher (nccl: gathered copy, buffers)", "reserve (CUDA context, NCCL, fragmentation)"


def device_bytes(device: torch.device) -> int | None:
    """The device's memory (REPLAY_GRPO_DEVICE_GIB simulates one); None where there is no plan to check (CPU)."""
    if os.environ.get(DEVICE_GIB_ENV):
        return int(float(os.environ[DEVICE_GIB_ENV]) * GIB)
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def shard_elements(params, ranks: int) -> int:
    """Elements of the largest FSDP2 shard of `params` over `ranks` (each tensor split on dim 0, padded)."""
    return sum(math.ceil(p.shape[0] / ranks) * (p.numel() // max(1, p.shape[0])) if p.dim() else 1 for p in params)


def activation_bytes(config, tokens: int, compute_bytes: int, checkpointing: bool = False) -> int:
    """Bytes autograd saves for the forward of `tokens` tokens through a decoder of `config` (see above)."""
    h, i, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    c = compute_bytes
    inputs = 5 * h * c if c < 4 else 8 * h
    layer = 16 * h + 8 + inputs + (3 * q + 2 * kv) * c + 4 * heads + 4 * i * c
    per_token = (L * 4 * h + layer) if checkpointing else L * layer
    return tokens * (per_token + 14 * h)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run generates and evaluates, as its caller knows it: the plan reads the method's flags only."""

    servers: int = 0  # W vLLM servers of async_pipeline.py; 0: the synchronous loop's generator in this process
    launched: bool = True  # the servers are launched on this node's GPUs (not started elsewhere)
    route: str = "disk"  # how the weights reach the servers: nccl or disk
    asked: str = "auto"  # the route asked for (auto: nccl where every server has a GPU of its own)


def servers_on_gpu(layout: Layout, trainers: int, n_gpus: int | None, gpu: int) -> int:
    """The launched vLLM servers on GPU `gpu` of this node: async_pipeline.server_gpus's round-robin after the
    trainers' GPUs (rank r on GPU r). None or 0 GPUs: every server has a GPU of its own, or runs on the CPU."""
    if not layout.servers or not layout.launched or not n_gpus:
        return 0
    return sum((trainers + i) % n_gpus == gpu for i in range(layout.servers))


def plan_memory(
    model, cfg, prompt_tokens, device_total: int, compute_bytes: int, trainers=1, rank=0, n_gpus=None, layout=Layout()
) -> dict:
    """This rank's bytes by row (see above) for `model` (meta tensors will do) under the run's settings `cfg`.
    prompt_tokens: the longest (training, evaluation) prompt, or one length for both; n_gpus: this node's GPUs
    (servers_on_gpu); layout: the servers and their weight transfer (async_pipeline.py's), or none (the sync loop)."""
    sync = not layout.servers
    train_prompt, eval_prompt = (prompt_tokens, prompt_tokens) if isinstance(prompt_tokens, int) else prompt_tokens
    c = compute_bytes
    params = list(model.parameters())
    P = sum(p.numel() for p in params)
    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]
    layer_P = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    mine = P if trainers == 1 else shard_elements(params, trainers)
    tokens = cfg.micro_batch_size * (train_prompt + cfg.max_new_tokens)
    config = model.config
    kv = config.num_key_value_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    rows = {"fp32 masters": 4 * mine, "fp32 gradients": 4 * mine, "Adam moments (fp32)": 8 * mine}
    if sync:  # async: FSDP2's unsharded fp32 gradients are in its compute copies' row
        rows[FRESH_GRADIENT_ROW] = 4 * max(p.numel() for p in params)
        rows["compute copies"] = c * P if c < 4 else 0
    else:
        root = P - layer_P * len(layers)
        rows["compute copies"] = c * (root + 2 * layer_P) + 4 * (root + 2 * layer_P)
    rows[f"activations ({tokens} tokens)"] = activation_bytes(config, tokens, c, cfg.activation_checkpointing)
    rows["log-prob workspace"] = backward_workspace_bytes(tokens, config.hidden_size, config.vocab_size, c)
    vllm = cfg.generator == "vllm" or (cfg.generator == "auto" and importlib.util.find_spec("vllm") is not None)
    if sync:
        generator = int(cfg.vllm_gpu_memory_utilization * device_total) if vllm else c * P
    else:  # a server sharing this GPU takes its --vllm-gpu-memory-utilization of it (async_pipeline.start_generators)
        generator = servers_on_gpu(layout, trainers, n_gpus, rank) * int(cfg.vllm_gpu_memory_utilization * device_total)
    rows["generator (resident)"] = generator
    nccl_publisher = not sync and rank == 0 and layout.route == "nccl"
    if nccl_publisher:
        rows[PUBLISHER_ROW] = c * P + PACKED_BROADCAST_BYTES
    evaluator = c * P if sync and cfg.publish_every > 1 else 0  # an HF copy, built for the evaluation
    evaluates_here = evaluator or (sync and not vllm)  # else: in the engine, or on a server (async)
    kv_cache = (
        50
        * cfg.pass_k
        * bool(evaluates_here)
        * (eval_prompt + cfg.max_new_tokens)
        * config.num_hidden_layers
        * 2
        * kv
        * c
    )
    rows["evaluation (copy + KV cache)"] = evaluator + kv_cache
    communicators = (trainers > 1) + (layout.servers if nccl_publisher else 0)  # FSDP's group, one per server
    rows[RESERVE_ROW] = CONTEXT_RESERVE_BYTES + NCCL_COMMUNICATOR_BYTES * communicators
    after = ("fp32 masters", "Adam moments (fp32)", "generator (resident)", "evaluation (copy + KV cache)")
    after += (PUBLISHER_ROW, RESERVE_ROW)
    train = sum(rows.values()) - rows["evaluation (copy + KV cache)"]
    evaluation = sum(rows.get(key, 0) for key in after)
    return {
        "rows": rows,
        "train": train,
        "evaluation": evaluation,
        "peak": max(train, evaluation),
        "prompt_tokens": (train_prompt, eval_prompt),
        "route": layout.route if not sync else ("a vLLM engine" if vllm else "an HF copy") + " in this process",
    }


def check_memory_plan(
    cfg, model, prompt_tokens, device: torch.device, trainers: int = 1, rank: int = 0, n_gpus=None, layout=Layout()
):
    """Before the first step, on a GPU (or a device simulated by REPLAY_GRPO_DEVICE_GIB): rank 0 prints the plan, a
    column per kind of rank, and every rank refuses a run that cannot fit in one line naming flags that would.
    prompt_tokens: the longest (training, evaluation) prompt kept; n_gpus: this node's (default: those torch sees);
    layout: the caller's servers (plan_memory)."""
    from run_folder import UserError

    total = device_bytes(device)
    if total is None:
        return None
    c = compute_dtype(device).itemsize
    if n_gpus is None:
        n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0

    def plans(cfg, T, n_gpus=n_gpus, layout=layout):  # every trainer rank's
        kw = dict(prompt_tokens=prompt_tokens, device_total=total, compute_bytes=c, trainers=T)
        return [plan_memory(model, cfg, rank=r, n_gpus=n_gpus, layout=layout, **kw) for r in range(T)]

    mine = plans(cfg, trainers)
    if rank == 0:
        print_plan(mine, total, layout)
    peak = max(p["peak"] for p in mine)
    if peak <= total:
        return mine
    raise UserError(
        f"the memory plan needs {peak / GIB:.1f} GiB on a trainer's device, more than its {total / GIB:.1f} GiB "
        f"(the table above): {fitting_flags(cfg, trainers, plans, total, n_gpus=n_gpus, layout=layout)}"
    )


def print_plan(plans: list[dict], total: int, layout: Layout) -> None:
    """The table: a column for rank 0 and one for each run of ranks with the same plan; a row absent is 0."""
    columns = [("rank 0", plans[0])]
    start = 1
    for r in range(1, len(plans)):
        if r + 1 == len(plans) or plans[r + 1]["rows"] != plans[start]["rows"]:
            columns.append((f"rank {start}" if r == start else f"ranks {start}-{r}", plans[start]))
            start = r + 1
    train, evaluation = plans[0]["prompt_tokens"]
    how = f"weights to the servers by {plans[0]['route']}" if layout.servers else plans[0]["route"]
    print(f"memory plan per trainer rank (GiB, estimated before the first step; device {total / GIB:.1f} GiB):")
    print(f"  longest prompt {train} tokens in training, {evaluation} in evaluation; {how}")
    print(f"  {'':44}" + "".join(f"{name:>12}" for name, _ in columns))
    for key in dict.fromkeys(k for p in plans for k in p["rows"]):
        print(f"  {key:44}" + "".join(f"{p['rows'].get(key, 0) / GIB:12.1f}" for _, p in columns))
    for key in ("train", "evaluation", "peak"):
        print(
            f"  {key + (' step' if key == 'train' else ''):44}" + "".join(f"{p[key] / GIB:12.1f}" for _, p in columns)
        )


def fitting_flags(cfg, trainers: int, plans, total: int, n_gpus: int = 0, layout: Layout = Layout()) -> str:
    """The fewest changes that fit: activation checkpointing, then smaller micro-batches, then more trainer ranks. No
    layout it proposes puts a launched server on rank 0's GPU: where the run's does (server_gpus shares rank 0's
    first), or with more trainer ranks, the servers are as many as have a GPU of their own (W + T <= the node's);
    a layout beyond this node's GPUs is named with the GPUs it needs."""
    sizes = [cfg.micro_batch_size >> k for k in range(cfg.micro_batch_size.bit_length())]
    acs = dict.fromkeys([cfg.activation_checkpointing, True])
    W = layout.servers or 1
    local = layout.launched  # servers that rank 0 launches on this node's GPUs
    route = layout.asked if layout.asked != "auto" else ("nccl" if n_gpus else "disk")

    def layouts(T):  # (servers, the node's GPUs planned: None for each server on a GPU of its own, or beyond this node)
        if not local or not n_gpus:
            yield W, (n_gpus if T == trainers else None)
        elif T == trainers and not servers_on_gpu(layout, T, n_gpus, 0):  # the user's layout: none on rank 0's GPU
            yield W, n_gpus
        elif T < n_gpus:
            yield min(W, n_gpus - T), n_gpus  # every server on a GPU of its own
        else:
            yield W, None  # more GPUs than this node's

    tries = [(T, w, n, ac, m) for T in range(trainers, 9) for w, n in layouts(T) for ac in acs for m in sizes]

    def changes(t):  # on this node first, fewer ranks, servers kept, fewer flags changed, the micro-batch kept
        T, w, n, ac, m = t
        return n is None and bool(n_gpus), T, w != W, (ac != cfg.activation_checkpointing) + (m != sizes[0]), -m

    for T, w, n, ac, m in sorted(tries, key=changes):
        changed = dataclasses.replace(cfg, activation_checkpointing=ac, micro_batch_size=m)
        same = T == trainers and w == W and n == n_gpus
        tried = layout if same else dataclasses.replace(layout, servers=w if T > 1 else layout.servers, route=route)
        if max(p["peak"] for p in plans(changed, T, n, tried)) > total:
            continue
        flags = ["--activation-checkpointing"] * (ac and not cfg.activation_checkpointing)
        flags += [f"--micro-batch-size {m}"] * (m != cfg.micro_batch_size)
        servers = [f"--num-generators {w}"] * (w != W and T > 1)
        node = f" on a node of {w + T} GPUs (this one has {n_gpus})" if n is None and n_gpus and local else ""
        if same:
            return "it fits with " + " ".join(flags)
        if T == trainers:  # async: the servers off the trainers' GPUs
            return f"it fits{node} with every server on a GPU of its own: {' '.join(servers + flags)}".rstrip(": ")
        if layout.servers:
            return f"it fits on {T} trainer ranks{node}: torchrun --nproc_per_node {T} ... " + " ".join(flags + servers)
        return (
            f"it fits with async_pipeline.py on {T} trainer ranks{node}: torchrun --standalone --nproc_per_node {T} "
            f"async_pipeline.py --preset {cfg.preset} --num-generators 1 {' '.join(flags)} (and your other "
            "flags; more generators on the GPUs left)"
        ).replace("  (", " (")
    return "nothing tried fits (activation checkpointing, micro-batches down to 1, up to 8 trainer ranks)"


def checkpoint_layers(model, enabled: bool) -> None:
    """--activation-checkpointing: each decoder layer keeps only its input and recomputes the rest in the backward
    (torch.utils.checkpoint, non-reentrant), the same gradients for a second forward of each layer."""
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
