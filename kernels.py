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
  * forward: one Triton GEMM over (token tiles x vocab splits), launched split-fastest (the splits of a token tile
    run side by side and share its H tile in L2). Each program walks its split's vocab blocks, keeps
    the row state in registers (the GEMM's epilogue) and writes one partial state per (row, split); the partials
    are merged in a fixed order on the host. No logits tile ever reaches HBM. The grad and no-grad forwards are
    this one kernel, so they are bitwise equal.
  * backward, per vocab split of Vs columns over all tokens at once: one Triton GEMM recomputes z and writes dz
    once in the compute dtype (fp32 math, rounded once); dW for the split is one cuBLAS GEMM over all tokens
    written once (no fp32 dW accumulator); dH is one accumulating GEMM into an fp32 [N x d] buffer. The logits
    are recomputed (8NdV FLOPs in all against the 6NdV of keeping them).
  * tiles (BLOCK_N, BLOCK_V, BLOCK_D, warps, stages) are chosen by triton.autotune keyed on (d, V), from the
    entries of kernels_tuned.json for the GPU's name when it has them (one config for a tuned (d, V): the same
    tiles, hence the same bits, in every process), else from the kernel's DEFAULT_CONFIGS. N is not in the key (no
    re-tune for a new batch length). No atomics: the same inputs give the same bits.
"eager" (the reference and the CPU default): the same math tile by tile in torch ops on [token chunk x vocab
chunk] logits from cuBLAS with fp32 output; the backward accumulates dW and dH in fp32 and writes each once.
"auto" picks triton on CUDA when Triton imports, else eager.

Then a causal LM's log-probs of (prompt, completion) pairs through token_logprobs: completion_logprobs forwards a
micro-batch packed by pack (each distinct prompt once, with --share-prompts), and prompt_order puts a batch's rollouts
of one prompt into one micro-batch.
"""

import contextlib
import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch

try:  # Triton is optional: `import kernels` must work without it or without a GPU driver
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = tl = None
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "eager")
# tuned tiles by GPU name (tools/tune_kernels.py); REPLAY_GRPO_TUNED_FILE names another (tools/device_check.py's)
TUNED_FILE = Path(os.environ.get("REPLAY_GRPO_TUNED_FILE") or Path(__file__).resolve().parent / "kernels_tuned.json")
# Tiles the autotuner tries on a GPU with no tuned entry, per kernel: bf16 tiles that ptxas compiles for sm_90
# (H100 / H200) without spilling registers, under Triton 3.6 (the GPU machines') and 3.9 (the lock's), checked ahead of
# time by tools/spill_check.py and tests/test_kernels.py. The forward's epilogue holds the logits tile, its exponentials
# and five row-state vectors beside the GEMM's accumulator: at 128 x 256 x 64 it spilled 836 / 1,812 bytes a thread
# (Triton 3.6 / 3.9), and every other former default forward tile 24 to 740 bytes under one of them or both.
DEFAULT_CONFIGS = {
    "fwd": (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=128, num_warps=8, num_stages=2),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, num_warps=8, num_stages=2),
        dict(BLOCK_N=64, BLOCK_V=128, BLOCK_D=64, num_warps=8, num_stages=4),
        dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=64, num_warps=4, num_stages=3),
    ),
    "bwd": (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, num_warps=8, num_stages=4),
        dict(BLOCK_N=64, BLOCK_V=256, BLOCK_D=64, num_warps=8, num_stages=4),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=128, num_warps=8, num_stages=2),
        dict(BLOCK_N=128, BLOCK_V=64, BLOCK_D=64, num_warps=4, num_stages=5),
        dict(BLOCK_N=64, BLOCK_V=128, BLOCK_D=64, num_warps=4, num_stages=4),
    ),
}
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


def _bwd_tile_torch(z, yl, inv_t, m, ls, tbar, q, zy, g, e, out_dtype):
    """dz tile = (g·(onehot - p) - e·p·(z - Σp·z)) / T in fp32, rounded once. Logits are
    taken relative to the row max m (so a common offset cancels exactly) and the target
    column uses the forward's own terms: q = 1 - p_y (no cancellation when p_y -> 1) and
    zy - m (0 exactly where the target is the max), not a recomputed logit whose last bit may
    differ and whose difference with Σp·z, small when p_y -> 1, would magnify it."""
    tgt = torch.arange(z.shape[1], device=z.device) == yl[:, None]
    zc = torch.where(tgt, (zy - m)[:, None], z * inv_t - m[:, None])
    p = (zc - ls[:, None]).exp()
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
        # UPCAST (the interpreter only, whose tl.dot multiplies bf16's raw bits and whose numpy matmul rounds a row
        # differently by its position in the tile): operands and accumulator in fp64, where every product of bf16 or
        # fp32 values is exact, then rounded once to fp32, so a row's logits do not depend on the tile it lands in.
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float64 if UPCAST else tl.float32)
        for k0 in range(0, D, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            kmask = ks < D
            a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float64)
                b = b.to(tl.float64)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        return acc.to(tl.float32)

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
        # (m, s, x, t, zy) per (split, row) written to part [5, NUM_SPLITS, N]. Vocab-split-major launch order: the
        # programs in flight together are all splits of a few token tiles, so each H tile is read from HBM once and
        # shared in L2 by its splits, and W once per such group (token tile fastest re-read all of H at every vocab
        # block where H exceeds the L2: about 71 GB at N = 16384, d = 3584 against 9 GB).
        pid = tl.program_id(0)
        split = (pid % NUM_SPLITS).to(tl.int64)
        rows = (pid // NUM_SPLITS).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: row * stride > 2**31
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
        zy_ptr,
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
        zy = tl.load(zy_ptr + rows, mask=rmask, other=0.0)
        g = tl.load(g_ptr + rows, mask=rmask, other=0.0)
        e = tl.load(e_ptr + rows, mask=rmask, other=0.0)
        yl = tl.load(yl_ptr + rows, mask=rmask, other=-1)
        # relative to the row max (a common offset cancels); the target column from the forward's own q = 1 - p_y
        # (no cancellation) and zy - m (a recomputed logit may differ in its last bit from the forward's)
        tgt = cols[None, :] == yl[:, None]
        zc = tl.where(tgt, (zy - m)[:, None], z * INV_T - m[:, None])
        p = tl.exp(zc - ls[:, None])
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
    found = [shape[kind] for shape in entry.values()] + [dict(c) for c in DEFAULT_CONFIGS[kind]]
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
        _tuned_kernel("fwd", h.device, d, V)[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]) * splits,)](**args)
    else:
        _fwd_kernel[(triton.cdiv(N, config["BLOCK_N"]) * splits,)](**args, **config)
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
    m, ls, tbar, q, zy = stats
    args = dict(h_ptr=h, w_ptr=wv, yl_ptr=yl, m_ptr=m, ls_ptr=ls, tbar_ptr=tbar, q_ptr=q, zy_ptr=zy, g_ptr=g, e_ptr=e)
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
            m, ls, tbar, q, zy = (a[sl] for a in stats)
            kw = dict(tbar=tbar, q=q, zy=zy, g=g[sl], e=e[sl], out_dtype=h.dtype)
            dz = _bwd_tile_torch(z, y[sl] - v0, inv_t, m, ls, **kw)
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
        ctx.save_for_backward(h, w, y, m, ls, tbar, q, zy)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g, e):
        h, w, y, m, ls, tbar, q, zy = ctx.saved_tensors
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
        stats = (m, ls, tbar, q, zy)
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


def checkpoint_layers(model, enabled: bool) -> None:
    """--activation-checkpointing: each decoder layer keeps only its input and recomputes the rest in the backward
    (torch.utils.checkpoint, non-reentrant), the same gradients for a second forward of each layer."""
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# ===== A causal LM's log-probs of (prompt, completion) pairs: packed, each prompt forwarded once ==================


class Packed(NamedTuple):
    """A micro-batch's ids for one forward, and where its completion tokens are predicted. Unshared: a row per rollout
    (prompt + completion, right-padded), `mask` its padding. Shared: a row per distinct prompt, its prompt less the last
    token then one segment per completion (the prompt's last token, which predicts the first completion token, and the
    completion), `mask` [rows, 1, L, L] the keys each position attends to: a segment sees its row's prompt and itself,
    at `positions` that go on from the prompt's, so each completion is computed as in its own unshared row."""

    ids: torch.Tensor
    mask: torch.Tensor
    index: torch.Tensor  # each completion token's flat position (row x L + column), in rollout order
    targets: torch.Tensor  # the completion tokens, in rollout order
    positions: torch.Tensor | None = None  # shared: each position's position id


def pack(seqs: list[tuple[list[int], list[int]]], pad_id: int, device, share_prompts: bool = True) -> Packed:
    """The forward's ids for (prompt, completion) pairs; no prompt logits are ever built. With share_prompts, a prompt
    that several completions of `seqs` share is forwarded once (when none is shared, or a prompt is a single token:
    the rows, unshared)."""
    prompts = list(dict.fromkeys(tuple(p) for p, _ in seqs))  # distinct, in first-seen order
    shared = share_prompts and len(prompts) < len(seqs) and min(map(len, prompts)) > 1
    spans = []  # (row, the column predicting a completion's first token, its tokens)
    if not shared:
        rows = [list(p) + list(c) for p, c in seqs]
        spans = [(i, len(p) - 1, len(c)) for i, (p, c) in enumerate(seqs)]
    else:  # segments: 0 the prompt, i the i-th completion, -1 padding; positions go on from the prompt's
        row_of = {p: i for i, p in enumerate(prompts)}
        rows = [list(p[:-1]) for p in prompts]
        segment, positions = [[0] * len(row) for row in rows], [list(range(len(row))) for row in rows]
        for i, (p, c) in enumerate(seqs, start=1):
            r = row_of[tuple(p)]
            spans.append((r, len(rows[r]), len(c)))
            rows[r] += [p[-1], *c]
            segment[r] += [i] * (len(c) + 1)
            positions[r] += range(len(p) - 1, len(p) + len(c))
    length = max(map(len, rows))
    pads = [length - len(row) for row in rows]
    ids = torch.tensor([row + [pad_id] * n for row, n in zip(rows, pads)])  # lists first: one tensor, not a row each
    index = torch.tensor([r * length + start + j for r, start, n in spans for j in range(n)], dtype=torch.long)
    targets = torch.tensor([t for _, c in seqs for t in c], dtype=torch.long)
    if not shared:
        mask = torch.tensor([[1] * len(row) + [0] * n for row, n in zip(rows, pads)])
        return Packed(ids.to(device), mask.to(device), index.to(device), targets.to(device))
    segment = torch.tensor([row + [-1] * n for row, n in zip(segment, pads)])
    positions = torch.tensor([row + list(range(len(row), length)) for row in positions])
    # a position sees the keys before it in its own segment and in the prompt (padding: its own padding, never none)
    mask = (segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == 0) & (segment[:, :, None] >= 0)
    mask &= torch.ones(length, length, dtype=torch.bool).tril()
    return Packed(ids.to(device), mask[:, None].to(device), index.to(device), targets.to(device), positions.to(device))


def completion_logprobs(model, seqs, pad_id, temperature, entropy=False, share_prompts=True):
    """fp32 log-probs (and entropy) of every completion token, flattened in rollout order, through
    token_logprobs on the final hidden states and the LM head: never [tokens x vocab] logits. With
    share_prompts, each distinct prompt of `seqs` is forwarded once (see pack; attention implementations other than
    sdpa and eager take no such mask and get the rows unshared). `model` is a causal LM, or a module computing them
    in its own forward (async_pipeline's FSDP2 root)."""
    share_prompts = share_prompts and model.config._attn_implementation in ("sdpa", "eager")
    packed = pack(seqs, pad_id, next(model.parameters()).device, share_prompts)
    if getattr(model, "computes_logprobs", False):
        return model(packed, temperature, entropy)
    return packed_logprobs(model, packed, temperature, entropy=entropy)


def packed_logprobs(model, packed: Packed, temperature, entropy=False):
    """completion_logprobs on a Packed micro-batch: one forward of the rows, the completion tokens' hidden states
    gathered in rollout order."""
    device, base = packed.ids.device, model.base_model
    mask = packed.mask
    if mask.dim() == 4 and base.config._attn_implementation == "eager":  # eager adds its mask to the scores
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    with autocast(device):
        hidden = base(input_ids=packed.ids, attention_mask=mask, position_ids=packed.positions, use_cache=False)
    hidden = hidden.last_hidden_state.flatten(0, 1)[packed.index]
    head = model.get_output_embeddings().weight  # tied: the embedding, so its gradient reaches it
    dtype = compute_dtype(device) if head.dtype == torch.float32 else head.dtype  # a generator's copy: as is
    return token_logprobs(
        hidden.to(dtype), head.to(dtype), packed.targets, temperature=temperature, return_entropy=entropy
    )


def prompt_order(batch: list, micro_batch_size: int) -> list:
    """The batch reordered so that rollouts of one prompt share a micro-batch where they can: each micro-batch is
    filled with whole groups (same prompt ids; the largest that fits first, equal sizes in the order drawn), then with
    the start of the largest left, whose rest opens the next micro-batch. The same draw gives the same order."""
    groups: dict[tuple, list] = {}
    for r in batch:
        groups.setdefault(tuple(r.prompt_ids), []).append(r)
    pending = sorted(groups.values(), key=len, reverse=True)  # stable: equal sizes keep the order drawn
    out, rest = [], []
    while pending or rest:
        room = micro_batch_size - len(out) % micro_batch_size
        group = rest or pending.pop(next((i for i, g in enumerate(pending) if len(g) <= room), 0))
        out, rest = out + group[:room], group[room:]
    return out
