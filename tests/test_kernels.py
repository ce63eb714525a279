"""Tests for kernels.token_logprobs against an fp64 reference built from the same inputs.

Backends: every test runs on "eager"; the Triton kernels run the whole file again in a subprocess
with TRITON_INTERPRET=1 (the variable must be set before Triton decorates the kernels, i.e. before
`import kernels`), on CPU tensors, with 16 x 32 x 16 tiles (kernels.INTERPRET_CONFIG) and forward
vocab splits of 40+ columns: V = 517 and 123 are multiples of no tile, and split into ragged,
full and empty splits.

Tolerances (all outputs vs fp64 of the same bf16/fp32-valued inputs):
  * logp and entropy are fp32 whatever the input dtype (logits are exact-product fp32):
    |err| <= 2e-5 + 1e-5·|ref|.
  * gradients, norm-wise relative error: fp32 inputs <= 2e-5; bf16 inputs <= 1e-2 (dz is
    rounded once to bf16 and the gradient is stored in bf16: ~2e-3 expected; the bugs this
    guards against give errors of order 1).
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import token_logprobs

INNER = os.environ.get("KERNELS_TEST_TRITON") == "1"  # set by test_triton_interpreter
if INNER:  # several forward splits per row: V = 517 -> 17 blocks of 32 -> splits of 2 blocks, the last ones empty
    kernels.FWD_SPLIT_COLS = 40
MAIN = ["triton"] if INNER else ["eager"]
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# ragged token and vocab tiles (V = 517 -> 300 + 217, N = 193 -> 128 + 65 or 64 * 3 + 1)
SMALL_TILES = dict(chunk_size=128, vocab_chunk_size=300) if INNER else dict(chunk_size=64, vocab_chunk_size=200)
N_BIG = 65 if INNER else 193  # for the tests that run the op many times
N_RAGGED = 97 if INNER else 193  # 6 token tiles of 16 and one row
CHUNKS = [(None, None), (40, 64), (97, 1000)] if INNER else [(None, None), (13, 517), (16, 64), (193, 1000), (50, 123)]


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny per-tile ops: OpenMP on an oversubscribed 2-core box is up to ~100x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make(N, d, V, dtype=torch.float32, seed=0, peaked=0.25, ignore=0.1, scale=3.0):
    """Non-uniform logits (std ~scale), a fraction of peaked rows (p_y > 0.999) and of
    ignored rows (target -100)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, d, generator=g) * (scale / math.sqrt(d))
    h = torch.randn(N, d, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    pk = torch.rand(N, generator=g) < peaked
    # peaked row: hidden + a·w[y], with a bisected (fp64) so that p_y ~ 0.9995
    u = w[y[pk]] / w[y[pk]].pow(2).sum(1, keepdim=True)
    z0, z1 = ((h[pk] * 0.3) @ w.t()).double(), (u @ w.t()).double()
    lo, hi = torch.zeros(len(u), 1, dtype=torch.float64), torch.full((len(u), 1), 200.0, dtype=torch.float64)
    for _ in range(30):
        a = (lo + hi) / 2
        p = torch.softmax(z0 + a * z1, -1).gather(1, y[pk][:, None])
        lo, hi = torch.where(p < 0.9995, a, lo), torch.where(p < 0.9995, hi, a)
    h[pk] = h[pk] * 0.3 + hi.float() * u
    y[torch.rand(N, generator=g) < ignore] = -100
    return h.to(dtype), w.to(dtype), y


def reference(h, w, y, T=1.0, ignore_index=-100):
    """fp64 logp, entropy and a closure giving fp64 gradients for upstream (gl, ge)."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    valid = y != ignore_index
    lsm = torch.log_softmax(h64 @ w64.t() / T, -1)
    logp = lsm.gather(1, torch.where(valid, y, 0)[:, None])[:, 0] * valid
    ent = -(lsm.exp() * lsm).sum(-1) * valid

    def grads(gl, ge):
        dh, dw = torch.autograd.grad(
            (logp * gl.double()).sum() + (ent * ge.double()).sum(), (h64, w64), retain_graph=True
        )
        return dh, dw

    return logp.detach(), ent.detach(), grads


def run(h, w, y, backend, need_w=True, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_(need_w)
    lp, en = token_logprobs(h, w, y, return_entropy=True, backend=backend, **kw)
    return h, w, lp, en


def close(x, ref):
    torch.testing.assert_close(x.double(), ref, atol=2e-5, rtol=1e-5)


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def upstream(N, seed=1, zero_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    z = torch.rand(N, generator=g) < zero_frac  # zero-gradient rows
    gl[z] = 0
    ge[torch.roll(z, 1)] = 0
    return gl, ge


def check_all(h, w, y, backend, T=1.0, gl=None, ge=None, grad_tol=None, **kw):
    N = h.shape[0]
    if gl is None:
        gl, ge = upstream(N)
    h1, w1, lp, en = run(h, w, y, backend, temperature=T, **kw)
    assert lp.dtype == en.dtype == torch.float32
    rlp, ren, grads = reference(h, w, y, T)
    close(lp, rlp)
    close(en, ren)
    ((lp * gl).sum() + (en * ge).sum()).backward()
    dh, dw = grads(gl, ge)
    tol = grad_tol or GRAD_TOL[h.dtype]
    assert h1.grad.dtype == h.dtype and w1.grad.dtype == w.dtype
    assert rel(h1.grad, dh) < tol, rel(h1.grad, dh)
    assert rel(w1.grad, dw) < tol, rel(w1.grad, dw)
    return h1, w1, lp, en


# ------------------------------------------------------------------ correctness vs fp64
@pytest.mark.parametrize("backend", MAIN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 24, 123), (7, 40, 517), (N_RAGGED, 72, 517)])
def test_matches_fp64(backend, dtype, shape):
    h, w, y = make(*shape, dtype=dtype)
    check_all(h, w, y, backend, **SMALL_TILES)


@pytest.mark.parametrize("backend", MAIN)
def test_bf16_grads_accumulate_in_fp32(backend):
    # bug 5: dW sums over token chunks, dH over vocab chunks; rounding to bf16 per tile would
    # grow the error with the tile count. Allowed: 1.6x the error of rounding the exact
    # gradient to bf16 once (dz is rounded once too: ~1.4x measured).
    h, w, y = make(N_BIG, 40, 517, dtype=torch.bfloat16, seed=19, ignore=0.0)
    gl, ge = upstream(N_BIG)
    cs, vcs = (32, 128) if INNER else (8, 32)
    h1, w1, lp, en = run(h, w, y, backend, chunk_size=cs, vocab_chunk_size=vcs)
    ((lp * gl).sum() + (en * ge).sum()).backward()
    dh, dw = reference(h, w, y)[2](gl, ge)
    # the interpreter truncates fp32 -> bf16 (numpy has no bf16); the GPU code rounds to
    # nearest (cvt.rn.bf16.f32, checked in test_triton_compiles_for_sm90)
    k = 2.5 if INNER else 1.6
    assert rel(h1.grad, dh) < k * rel(dh.bfloat16(), dh)
    assert rel(w1.grad, dw) < k * rel(dw.bfloat16(), dw)


@pytest.mark.parametrize("backend", MAIN)
def test_fp16(backend):
    h, w, y = make(65, 40, 517, dtype=torch.float16, seed=15)
    check_all(h, w, y, backend, **SMALL_TILES)


@pytest.mark.parametrize("backend", MAIN)
@pytest.mark.parametrize("T", [0.5, 0.7, 1.5])
def test_temperature(backend, T):
    h, w, y = make(65, 40, 517, dtype=torch.bfloat16, seed=2)
    check_all(h, w, y, backend, T=T, **SMALL_TILES)


@pytest.mark.parametrize("backend", MAIN)
@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_single_output_backward(backend, which):
    # bug 11 (entropy gradient dropped) and bug 2 (per-token gradients folded before matmul)
    h, w, y = make(50, 40, 123, seed=3)
    gl, ge = upstream(50)
    if which == "logp":
        ge = torch.zeros(50)
        h1, w1, lp, en = run(h, w, y, backend, **SMALL_TILES)
        (lp * gl).sum().backward()
    else:
        gl = torch.zeros(50)
        h1, w1, lp, en = run(h, w, y, backend, **SMALL_TILES)
        (en * ge).sum().backward()
    dh, dw = reference(h, w, y)[2](gl, ge)
    assert rel(h1.grad, dh) < 2e-5 and rel(w1.grad, dw) < 2e-5


@pytest.mark.parametrize("backend", MAIN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_rows(backend, dtype):
    # bugs 1 and 3: an unmasked vocab tail or p_y rounded before 1 - p_y only show when peaked
    h, w, y = make(40, 24, 123, dtype=dtype, seed=4, peaked=1.0, ignore=0.0)
    assert reference(h, w, y)[0].exp().min() > 0.999
    # 1 - p_y ~ 5e-4 must not be formed as 1 - p_y (fp32 cancellation alone gives ~1e-4)
    check_all(h, w, y, backend, **SMALL_TILES)


@pytest.mark.parametrize("backend", MAIN)
@pytest.mark.parametrize("offset", [200.0, -200.0])
def test_large_common_offset(backend, offset):
    # an extra hidden dim of 1 and weight column of +-200 shift every logit by +-200 (> 88, so a
    # missing max-subtraction overflows fp32, and a padded vocab column's 0 taken as the row max
    # underflows every exp(z - max) at -200); outputs and the original grads must not move
    h, w, y = make(33, 40, 123, dtype=torch.bfloat16, seed=5)
    hb = torch.cat([h, torch.ones(33, 1, dtype=h.dtype)], 1)
    wb = torch.cat([w, torch.full((123, 1), offset, dtype=w.dtype)], 1)
    gl, ge = upstream(33)
    h0, w0, lp0, en0 = run(h, w, y, backend)
    h1, w1, lp1, en1 = run(hb, wb, y, backend)
    torch.testing.assert_close(lp1, lp0, atol=1e-4, rtol=0)  # ulp(200) in fp32 is 1.5e-5
    torch.testing.assert_close(en1, en0, atol=1e-4, rtol=0)
    for lp, en in ((lp0, en0), (lp1, en1)):
        ((lp * gl).sum() + (en * ge).sum()).backward()
    assert torch.isfinite(h1.grad).all() and torch.isfinite(w1.grad).all()
    assert rel(h1.grad[:, :40].float(), h0.grad.double()) < 1e-2
    assert rel(w1.grad[:, :40].float(), w0.grad.double()) < 1e-2
    # vs fp64 in fp32 only: with bf16 dz, Σ_v dz_v = 0 holds only to bf16 rounding, and the
    # gradient of the constant column (Σ_v dz_v · 200) is that noise (naive torch too)
    check_all(hb.float(), wb.float(), y, backend, gl=gl, ge=ge)


@pytest.mark.parametrize("backend", MAIN)
def test_ignored_rows(backend):
    h, w, y = make(20, 24, 123, seed=6, ignore=0.0)
    y[::3] = 7  # custom ignore_index inside the vocab range
    h1, w1, lp, en = run(h, w, y, backend, ignore_index=7)
    assert (lp[::3] == 0).all() and (en[::3] == 0).all()
    (lp.sum() + en.sum()).backward()
    assert (h1.grad[::3] == 0).all()
    ref_h, ref_w, _, _ = run(h[y != 7], w, y[y != 7], "eager")
    (
        token_logprobs(ref_h, ref_w, y[y != 7], return_entropy=True, backend="eager")[0].sum()
        + token_logprobs(ref_h, ref_w, y[y != 7], return_entropy=True, backend="eager")[1].sum()
    ).backward()
    torch.testing.assert_close(w1.grad, ref_w.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INNER, reason="backend-independent")
def test_ignored_rows_cost_nothing(monkeypatch):
    rows = []
    orig = kernels._mm_f32
    monkeypatch.setattr(kernels, "_mm_f32", lambda a, b: rows.append(a.shape[0]) or orig(a, b))
    h, w, y = make(40, 24, 123, seed=16, ignore=0.0)
    y[5:] = -100
    h1, w1, lp, en = run(h, w, y, "eager")
    (lp.sum() + en.sum()).backward()
    assert rows == [5, 5]  # forward and backward logits of the 5 kept rows only
    assert (lp[5:] == 0).all() and (h1.grad[5:] == 0).all()


@pytest.mark.parametrize("backend", MAIN)
def test_zero_gradient_rows_skipped(backend, monkeypatch):
    # GRPO's zero-variance groups give rows whose upstream gradients are both 0: their dz is exactly 0, so the
    # backward's matmuls run on the other rows only, and the gradients are those of the full batch
    h, w, y = make(40, 24, 517, seed=20, ignore=0.0)
    gl, ge = upstream(40, zero_frac=0.0)
    gl[::3] = ge[::3] = 0
    gl[1::3] = 0  # logp-only and entropy-only rows stay
    rows = []
    name = "_backward_triton" if backend == "triton" else "_backward_eager"
    orig = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda h, *a, **kw: rows.append(h.shape[0]) or orig(h, *a, **kw))
    h1, w1, lp, en = run(h, w, y, backend, **SMALL_TILES)
    ((lp * gl).sum() + (en * ge).sum()).backward()
    assert rows == [40 - 14]
    dh, dw = reference(h, w, y)[2](gl, ge)
    assert (h1.grad[::3] == 0).all()
    assert rel(h1.grad, dh) < 2e-5 and rel(w1.grad, dw) < 2e-5
    h2, w2, lp, en = run(h, w, y, backend, **SMALL_TILES)
    (lp * 0).sum().backward()  # every row zero: no matmul at all, zero gradients
    assert rows == [40 - 14] and (h2.grad == 0).all() and (w2.grad == 0).all()


@pytest.mark.parametrize("backend", MAIN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_ignored(backend, dtype):
    h, w, y = make(9, 24, 123, dtype=dtype, seed=7)
    y[:] = -100
    h1, w1, lp, en = run(h, w, y, backend)
    assert (lp == 0).all() and (en == 0).all()
    (lp.sum() + en.sum()).backward()
    assert (h1.grad == 0).all() and (w1.grad == 0).all()


@pytest.mark.parametrize("backend", MAIN)
def test_invalid_arguments(backend):
    h, w, y = make(5, 24, 123)
    for bad in (123, -5, 10_000):
        yb = y.clone()
        yb[2] = bad
        with pytest.raises(ValueError, match="outside"):
            token_logprobs(h, w, yb, backend=backend)
    for T in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(h, w, y, temperature=T, backend=backend)
    with pytest.raises(ValueError, match="eager"):
        token_logprobs(h, w, y, backend="cuda")


@pytest.mark.parametrize("backend", MAIN)
def test_deterministic(backend):
    # bug 13: bitwise equal across runs, and a no-grad forward equals the grad forward
    h, w, y = make(N_BIG, 40, 517, dtype=torch.bfloat16, seed=8)
    gl, ge = upstream(N_BIG)
    outs = []
    for _ in range(2):
        h1, w1, lp, en = run(h, w, y, backend, **SMALL_TILES)
        ((lp * gl).sum() + (en * ge).sum()).backward()
        outs.append((lp, en, h1.grad, w1.grad))
    with torch.no_grad():
        lp_ng = token_logprobs(h, w, y, backend=backend, **SMALL_TILES)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(lp_ng, outs[0][0])


if INNER:  # the Triton kernels' property (torch's CPU GEMMs round by place): collected in the interpreter's run only

    def test_a_logit_does_not_depend_on_its_place_in_the_tile():
        # the backward's vocab splits start anywhere (not at a tile's edge) and its token tiles hold other rows than
        # the forward's (zero-gradient rows dropped): a recomputed logit must come out the same bits wherever it sits
        # in a tile (the interpreter's fp32 numpy matmul rounds by place on some CPUs), or it differs from the
        # forward's. dz of each column, fp32, is compared from splits starting at 0 and at columns that are no tile's
        # edge, and of rows alone or in a batch of their own.
        h, w, y = make(37, 40, 517, dtype=torch.float32, seed=21, ignore=0.0)
        inv_t = 1 / 0.7
        m, s, x, t, zy = kernels.merge_partials(kernels.fwd_triton(h, w, y, inv_t))
        stats = (m, s.log(), t / s, x / s, zy)
        g, e = upstream(37, zero_frac=0.0)

        def dz(rows, first):
            sub = tuple(a[rows] for a in stats)
            out = torch.empty(len(range(37)[rows]), 517 - first)
            return kernels.bwd_dz_triton(h[rows], w[first:], y[rows] - first, sub, g[rows], e[rows], inv_t, out, V=517)

        whole = dz(slice(None), 0)
        for first in (7, 13, 300):
            assert torch.equal(dz(slice(None), first), whole[:, first:]), first
        for lo, hi in ((5, 6), (14, 18), (33, 37)):
            assert torch.equal(dz(slice(lo, hi), 0), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("backend", MAIN)
def test_chunk_size_invariance(backend):
    h, w, y = make(N_BIG, 40, 517, seed=9)
    gl, ge = upstream(N_BIG)
    res = []
    for cs, vcs in CHUNKS:
        h1, w1, lp, en = run(h, w, y, backend, chunk_size=cs, vocab_chunk_size=vcs)
        ((lp * gl).sum() + (en * ge).sum()).backward()
        res.append((lp, en, h1.grad, w1.grad))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", MAIN)
def test_noncontiguous(backend):
    # bug 10: hidden[:, :-1]-style views, a transposed weight view, stride-0 upstream grads
    h, w, y = make(31, 40, 123, seed=10)
    big = torch.randn(31, 3, 41)
    big[:, 1, :40] = h
    hv = big[:, 1, :40].requires_grad_()  # leaf? no: make the view from a leaf
    base_h = big.clone().requires_grad_()
    hv = base_h[:, 1, :40]
    base_w = w.t().contiguous().requires_grad_()  # [d, V] storage, used as [V, d] view
    wv = base_w.t()
    assert not hv.is_contiguous() and not wv.is_contiguous()
    lp, en = token_logprobs(hv, wv, y, return_entropy=True, backend=backend, **SMALL_TILES)
    (lp.sum() + en.sum()).backward()  # .sum() gives expanded stride-0 gradients
    rlp, ren, grads = reference(h, w, y)
    close(lp, rlp)
    close(en, ren)
    dh, dw = grads(torch.ones(31), torch.ones(31))
    assert rel(base_h.grad[:, 1, :40], dh) < 2e-5 and rel(base_w.grad.t(), dw) < 2e-5
    assert (base_h.grad[:, 0] == 0).all() and (base_h.grad[:, :, 40] == 0).all()


@pytest.mark.parametrize("backend", MAIN)
def test_frozen_weight_and_hidden(backend):
    h, w, y = make(17, 24, 123, seed=11)
    gl, ge = upstream(17)
    h1, w1, lp, en = run(h, w, y, backend, need_w=False)
    ((lp * gl).sum() + (en * ge).sum()).backward()
    assert w1.grad is None and h1.grad is not None
    dh, dw = reference(h, w, y)[2](gl, ge)
    assert rel(h1.grad, dh) < 2e-5
    h2 = h.clone()  # hidden frozen: only the weight receives a gradient
    w2 = w.clone().requires_grad_()
    lp2 = token_logprobs(h2, w2, y, backend=backend)
    (lp2 * gl).sum().backward()
    assert rel(w2.grad, reference(h, w, y)[2](gl, torch.zeros(17))[1]) < 2e-5


@pytest.mark.parametrize("backend", MAIN)
def test_leading_dims_and_tied_embedding(backend):
    # bug 12: a tied head passes the embedding parameter itself, so both uses reach it
    torch.manual_seed(12)
    emb = torch.nn.Embedding(123, 24)
    ids = torch.randint(0, 123, (3, 9))
    hid = torch.tanh(emb(ids)) * 3
    lp = token_logprobs(hid[:, :-1], emb.weight, ids[:, 1:], backend=backend)
    assert lp.shape == (3, 8)
    lp.sum().backward()
    g_fused = emb.weight.grad.clone()
    emb.weight.grad = None
    hid = torch.tanh(emb(ids)) * 3
    ref = torch.log_softmax(hid[:, :-1] @ emb.weight.t(), -1).gather(2, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp, ref, atol=2e-5, rtol=1e-5)
    ref.sum().backward()
    torch.testing.assert_close(g_fused, emb.weight.grad, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", MAIN)
def test_empty_batch(backend):
    h, w, y = make(0, 24, 123)
    h1, w1, lp, en = run(h, w, y, backend)
    assert lp.shape == (0,) and en.shape == (0,)
    (lp.sum() + en.sum()).backward()
    assert (w1.grad == 0).all()


@pytest.mark.skipif(INNER, reason="tiling is backend-independent")
@pytest.mark.parametrize("backend", MAIN)
def test_tiles_bounded(backend, monkeypatch):
    # never materialise [N x V]: every logits matmul is at most one [chunk x vocab chunk] tile
    sizes = []
    orig = kernels._mm_f32
    monkeypatch.setattr(kernels, "_mm_f32", lambda a, b: sizes.append(a.shape[0] * b.shape[1]) or orig(a, b))
    h, w, y = make(100, 24, 517, seed=13)
    h1, w1, lp, en = run(h, w, y, backend, chunk_size=16, vocab_chunk_size=64)
    (lp.sum() + en.sum()).backward()
    assert sizes and max(sizes) <= 16 * 64


# --------------------------------------------------------------------- misc / driver
@pytest.mark.skipif(INNER, reason="outer process only")
def test_resolve_backend():
    assert kernels.resolve_backend("auto", "cpu") == "eager"
    assert kernels.resolve_backend("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="auto, triton, eager"):
        kernels.resolve_backend("compile", "cpu")  # the torch.compile backend is gone
    if not kernels._interpret():
        with pytest.raises(ValueError, match="triton"):
            kernels.resolve_backend("triton", "cpu")


@pytest.mark.skipif(INNER, reason="outer process only")
def test_cuda_matmul_path_emulated(monkeypatch):
    # the CUDA-only branch (bf16 operands, fp32 output/accumulator via out_dtype), emulated
    calls = []
    mm, addmm = torch.mm, torch.addmm

    def fake_mm(a, b, out_dtype=None, **kw):
        if out_dtype is None:
            return mm(a, b, **kw)
        calls.append("mm")
        assert a.dtype == b.dtype == torch.bfloat16 and out_dtype == torch.float32
        return mm(a.float(), b.float())

    def fake_addmm(acc, a, b, out_dtype=None, out=None, **kw):
        if out_dtype is None:
            return addmm(acc, a, b, out=out, **kw) if out is not None else addmm(acc, a, b, **kw)
        calls.append("addmm")
        assert a.dtype == b.dtype == torch.bfloat16 and acc.dtype == out.dtype == torch.float32
        return out.copy_(acc + mm(a.float(), b.float()))

    monkeypatch.setattr(torch, "mm", fake_mm)
    monkeypatch.setattr(torch, "addmm", fake_addmm)
    monkeypatch.setattr(kernels, "_out_dtype_ok", lambda device: True)
    h, w, y = make(70, 40, 517, dtype=torch.bfloat16, seed=18)
    check_all(h, w, y, "eager", **SMALL_TILES)
    assert {"mm", "addmm"} <= set(calls)


@pytest.mark.skipif(INNER or not kernels.HAS_TRITON, reason="needs triton; outer process only")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_triton_compiles_for_sm90(dtype):
    # no GPU here: compile the kernels ahead of time for an H100/H200 (sm_90) with the first default tiles, to catch
    # what the interpreter cannot (typing, lowering, shared memory); check no fp64 math, 64-bit row offsets,
    # tensor-core GEMMs and round-to-nearest bf16 dz
    spill_check = _spill_check()
    for kind in ("fwd", "bwd"):
        row = spill_check.compile_sm90(kind, kernels.DEFAULT_CONFIGS[kind][0], dtype)
        ptx = row["ptx"]
        assert row["shared"] <= 227 * 1024  # an H100's shared memory per block
        assert ".f64" not in ptx  # temperature stayed fp32; the interpreter's fp64 logits are compiled out
        assert "mul.lo.s64" in ptx or "mad.wide" in ptx  # 64-bit row * stride offsets
        if dtype == "bf16":
            assert "wgmma" in ptx or "mma.sync" in ptx  # the GEMM runs on tensor cores
            assert "cp.async" in ptx  # the k-loop's loads are pipelined (num_stages > 1)
        if dtype == "bf16" and kind == "bwd":
            assert "cvt.rn.bf16" in ptx  # dz rounded to nearest, once


def _spill_check():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import spill_check

    return spill_check


@pytest.mark.skipif(INNER, reason="outer process only")
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_autotune_space_compiles_without_spills_for_sm90(kind, capsys):
    # every tile the autotuner may pick on an H100/H200 (the space of a GPU without a tuned entry, and each tuned
    # entry committed for a GPU), compiled ahead of time for sm_90 with the ptxas the installed Triton's JIT uses:
    # a spill (ptxas -v) or local memory in the PTX puts HBM traffic inside the GEMM's loop or its epilogue
    spill_check = _spill_check()
    if spill_check.ptxas_path() is None:
        pytest.skip("no ptxas for sm_90 here (Triton missing, or without its bundled ptxas)")
    rows = [spill_check.compile_sm90(kind, c) for c in spill_check.space(kind)]
    with capsys.disabled():
        print("", *map(spill_check.line, rows), sep="\n")  # registers, spills and shared memory of each tile
    bad = [spill_check.line(r) for r in rows if spill_check.spills(r)]
    assert not bad, "\n".join(bad)
    assert all(r["shared"] <= 227 * 1024 for r in rows)  # an H100's shared memory per block


@pytest.mark.skipif(INNER, reason="outer process only")
def test_inside_callers_torch_compile():
    # a trainer that compiles its loss must get the same numbers (the op runs eagerly)
    h, w, y = make(30, 24, 123, seed=17)
    f = torch.compile(lambda h, w, y: (token_logprobs(h * 2, w, y, backend="eager") ** 2).sum())
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    f(h1, w1, y).backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    (token_logprobs(h2 * 2, w2, y, backend="eager") ** 2).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


@pytest.mark.skipif(INNER, reason="outer process only")
def test_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; import torch, kernels; "
        "assert not kernels.HAS_TRITON and kernels.resolve_backend('auto', 'cpu') == 'eager'; "
        "print(kernels.token_logprobs(torch.randn(3, 8), torch.randn(11, 8), torch.tensor([1, 2, 3])).shape)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 0 and "torch.Size([3])" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(INNER or not kernels.HAS_TRITON, reason="needs triton; outer process only")
def test_triton_interpreter():
    """Run this whole file for the Triton kernels under TRITON_INTERPRET=1 in a subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="1", KERNELS_TEST_TRITON="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


# ------------------------------------------------------------------ tuned tiles and the tools
@pytest.mark.skipif(INNER, reason="outer process only")
def test_tuned_file_seeds_the_autotuner(tmp_path, monkeypatch):
    # a tuned (d, V) of this GPU: that config alone (the same tiles in every process); another shape: the GPU's
    # tuned configs first, then the defaults; another GPU: the defaults
    fwd = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_D=32, num_warps=4, num_stages=3)
    bwd = dict(BLOCK_N=128, BLOCK_V=64, BLOCK_D=32, num_warps=4, num_stages=3)
    path = tmp_path / "tuned.json"
    path.write_text(
        '{"gpus": {"NVIDIA H200": {"896x151936": {"fwd": %s, "bwd": %s}}}}' % (json.dumps(fwd), json.dumps(bwd))
    )
    monkeypatch.setattr(kernels, "TUNED_FILE", path)
    assert kernels.candidate_configs("fwd", "NVIDIA H200", 896, 151936) == [fwd]
    assert kernels.candidate_configs("bwd", "NVIDIA H200", 896, 151936) == [bwd]
    others = kernels.candidate_configs("bwd", "NVIDIA H200", 3584, 151936)
    assert others[0] == bwd and others[1:] == [c for c in map(dict, kernels.DEFAULT_CONFIGS["bwd"]) if c != bwd]
    assert kernels.candidate_configs("fwd", "NVIDIA H100 80GB HBM3", 896, 151936) == list(
        map(dict, kernels.DEFAULT_CONFIGS["fwd"])
    )
    assert kernels.candidate_configs("fwd", "interpreter", 896, 151936) == [kernels.INTERPRET_CONFIG]


def _tool(args, timeout):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=root)


@pytest.mark.skipif(INNER or not kernels.HAS_TRITON, reason="needs triton; outer process only")
def test_tune_kernels_dry_run_within_its_deadline(tmp_path):
    # the tuning tool's dry run on a CPU under the interpreter, through its command line: it finishes within its
    # deadline (imports included), writes its JSON and table, and the best tiles into the tuned file given
    import time

    tuned = tmp_path / "tuned.json"
    t0 = time.monotonic()
    r = _tool(
        ["tools/tune_kernels.py", "--dry-run", "--deadline", "60", "--out", str(tmp_path), "--write-tuned"]
        + ["--tuned-file", str(tuned)],
        timeout=180,
    )
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "tune.json").read_text())
    assert result["elapsed_s"] <= 60 and wall <= 60 + 15  # the interpreter's exit after the last write
    width = result["widths"]["24"]
    assert width["sweep"]["best"]["fwd"] and width["sweep"]["best"]["bwd"]
    assert {"logits H Wt", "split dz W", "split dzT H"} <= set(width["floor"])
    for row in width["e2e"]:  # measured with errors against the reference, or skipped for the deadline
        assert row.get("skipped") == "deadline" or (row["logp_err"] <= 1e-5 and row["grad_err"] < 1e-2), row
    assert "| vocab split | triton ms |" in (tmp_path / "tune.md").read_text()
    entry = json.loads(tuned.read_text())["gpus"]["interpreter"]["24x300"]
    assert entry["fwd"] == width["sweep"]["best"]["fwd"]["config"] and "measured" in entry


@pytest.mark.skipif(INNER, reason="outer process only")
@pytest.mark.parametrize(
    "case, flag",
    [
        ("widths abc", "--widths"),
        ("widths 0", "--widths"),
        ("widths -8", "--widths"),
        ("deadline nan", "--deadline"),
        ("out an existing file", "--out"),
        ("tuned-file a folder", "--tuned-file"),
    ],
)
def test_tune_kernels_refuses_bad_input_before_any_work(tmp_path, case, flag):
    # each bad input or destination is named in one line (exit 2) before anything is measured, and nothing that
    # exists is touched: a destination found wrong only after the run would lose every measured result
    existing = tmp_path / "results.txt"
    existing.write_text("kept\n")
    folder = tmp_path / "tuned"
    folder.mkdir()
    given = {
        "widths abc": ["--widths", "abc"],
        "widths 0": ["--widths", "0"],
        "widths -8": ["--widths", "-8"],
        "deadline nan": ["--deadline", "nan"],
        "out an existing file": ["--out", str(existing)],
        "tuned-file a folder": ["--write-tuned", "--tuned-file", str(folder)],
    }[case]
    out = ["--out", str(tmp_path / "out")] if flag != "--out" else []
    r = _tool(["tools/tune_kernels.py", "--dry-run", "--deadline", "30", *out, *given], timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and flag in lines[0], r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout == ""  # refused before the versions line: nothing measured
    assert existing.read_text() == "kept\n" and list(folder.iterdir()) == []
    assert not (tmp_path / "out" / "tune.json").exists()


@pytest.mark.skipif(INNER or not kernels.HAS_TRITON, reason="needs triton; outer process only")
def test_bench_kernels_dry_run():
    # the benchmark at a tiny shape on a CPU: a row per path with its FLOPs, bytes, time and ratios
    r = _tool(["tools/bench_kernels.py", "--dry-run"], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {
        line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["triton"], ["naive"])
    }
    assert set(rows) == {"triton", "naive"}, r.stdout
    assert "GEMM floor" in r.stdout and "x floor" in r.stdout and "GFLOP" in r.stdout
    assert float(rows["naive"][3]) == 1.0  # x naive of naive itself
    # the other fused heads beside ours on the same inputs, or "not run" and why: torch 2.13 has
    # F.linear_cross_entropy; liger-kernel is optional
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()[:1] in (["liger"], ["torch_lce"])}
    assert set(lines) == {"liger", "torch_lce"}, r.stdout
    assert "not run: " in lines["liger"] or float(lines["liger"].split()[10]) < 1e-2
    lce = lines["torch_lce"].split()
    assert float(lce[3]) > 0 and float(lce[11]) < 1e-2  # x naive, grad err
    assert float(rows["triton"][10]) <= 1e-5  # logp err
