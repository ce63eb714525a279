"""gpu_check.py on this machine: without CUDA it skips with its reason; --smoke runs every check at toy
sizes (on the CPU here), so the script itself is tested wherever the suite runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the real check runs instead")
def test_without_cuda_it_says_why_and_exits_0():
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py")],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.startswith("skipped: no CUDA device here"), res.stdout + res.stderr


def test_smoke_runs_every_check_and_prints_one_table():
    """Under the simulated bf16 policy: the precision rows and the AsymRE steps of qwen-0.5b (gradient > 0,
    weights moved) must pass."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=900,
    )
    out = res.stdout
    assert res.returncode == 0, (out + res.stderr)[-4000:]
    rows = {line.split("  ")[0]: line.split() for line in out[out.index("\ncheck ") :].strip().splitlines()[1:-1]}
    for check in ("kernels", "precision", "learns", "eval-rng", "qwen-0.5b", "async:", "async nccl", "vllm"):
        assert any(name.startswith(check) for name in rows), rows
    for name, words in rows.items():  # toy sizes measure nothing, but every check that can pass must
        must_pass = name.startswith(("precision", "eval-rng", "qwen", "async:"))  # async nccl: with 2 GPUs
        assert "FAIL" not in words and ("PASS" in words or not must_pass), rows
    assert out.rstrip().endswith("0 failed"), out[-2000:]
    # every training with a vLLM engine and the vllm-* checks ran in a process of their own: the guard that
    # refuses a second sleep-mode engine in one process never fired, and their rows are in the one table
    assert "already lives in this process" not in out + res.stderr
    for check in ("eval-rng (vLLM)", "vllm-sync", "vllm-logprobs"):
        assert any(name.startswith(check) and "PASS" in words for name, words in rows.items()), (check, rows)


def test_a_missed_speed_target_is_a_measured_row_not_a_failure(monkeypatch, capsys):
    """A kernel slower than its target (time judged as on a GPU, here made to miss) is MISSED; a wrong log-prob is
    FAIL; the run's verdict counts only failures."""
    import gpu_check

    real = gpu_check.targets_met
    monkeypatch.setattr(gpu_check, "ROWS", [])
    monkeypatch.setattr(gpu_check, "targets_met", lambda **kw: real(**kw) | {"time": False})
    gpu_check.check_kernels("cpu", smoke=True)
    assert [r[3] for r in gpu_check.ROWS] == ["MISSED", "MISSED"], gpu_check.ROWS
    monkeypatch.setattr(gpu_check, "targets_met", lambda **kw: real(**kw) | {"logp": False})
    gpu_check.check_kernels("cpu", smoke=True)
    assert [r[3] for r in gpu_check.ROWS[2:]] == ["FAIL", "FAIL"], gpu_check.ROWS


def test_without_vllm_the_async_check_is_skipped_not_failed(monkeypatch, tmp_path):
    """async_pipeline.py runs on `vllm serve`: where vLLM does not import, the row says so instead of failing the
    run."""
    import gpu_check

    def unavailable():
        raise gpu_check.generation.VLLMUnavailable("--generator vllm needs vLLM (ImportError: no vllm)")

    monkeypatch.setattr(gpu_check, "ROWS", [])
    monkeypatch.setattr(gpu_check.generation, "import_vllm", unavailable)
    gpu_check.check_async(tmp_path, smoke=True)
    assert [(r[0], r[3]) for r in gpu_check.ROWS] == [("async", "skipped")], gpu_check.ROWS
    assert not any(tmp_path.iterdir())  # no run was started
