"""The GPU path, simulated on a CPU: what differs on a GPU is made to happen here, through the real code.

- precision: REPLAY_GRPO_COMPUTE_DTYPE=bfloat16 makes the compute dtype bf16, as a bf16 GPU's is;
- numpy's random stream: vLLM's GPU runner seeds each request from it, simulated by a generator that does so;
- device placement under an inherited CUDA_VISIBLE_DEVICES, the optimizer state broadcast from rank 0, the
  warm-start cache key, the benchmark's precision and the log-prob matmul path.
Publishes to real vLLM servers are tested in test_async_pipeline.py. The cpu preset's learning under this policy
is a run of its own (docs/gpu.md): on a CPU without bf16 instructions its bf16 matmuls are ~40x slower than fp32.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import bench_generation
import numpy as np
import pytest
import torch

import async_pipeline as ap
import kernels
import replay_grpo as rg
from infra import generation, loading, models, reporting, serving, tasks

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(
    os.environ,
    HF_HUB_OFFLINE="1",
    OMP_NUM_THREADS="1",
    PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]),
)
SMALL = (
    "--preset cpu --sft-warmup-steps 0 --sft-imitation 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
    "--buffer-size 16 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 4 --eval-every "
    "0 --loss asymre --lr 1e-3"
).split()


@pytest.fixture
def bf16(monkeypatch):
    """The precision policy of a bf16 GPU, on this CPU."""
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def training_records(run_dir):
    return [
        {k: v for k, v in r.items() if not (k.startswith("eval/") or reporting.measured_on_this_machine(k))}
        for r in metrics(run_dir)
    ]


def random_batch(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(n):
        completion = torch.randint(0, 256, (3 + i % 4,), generator=g).tolist()
        prompt = torch.randint(0, 256, (4,), generator=g).tolist()
        batch.append(
            rg.Rollout(
                prompt,
                completion,
                torch.zeros(len(completion)),
                reward=float(i % 2),
                advantage=0.0,
                group_mean=0.5,
                policy_version=0,
                group_id=i,
            )
        )
    return batch


def fraction_changed(before: dict, model) -> float:
    after = model.state_dict()
    changed = sum(int((after[k] != v).sum()) for k, v in before.items())
    return changed / sum(v.numel() for v in before.values())


# --- defect: pure bf16 training loses the updates -------------------------------------------------


def test_bf16_compute_on_fp32_masters_moves_every_weight_at_the_gpu_presets_lr(bf16):
    """10 AdamW steps at lr 1e-6 (the gsm8k preset's) through load_policy and train_step under the bf16 policy:
    the masters are fp32 and >= 99% of the weights move. The same steps on pure bf16 weights move ~2%."""
    cfg = rg.parse_args(["--sft-warmup-steps", "0", "--loss", "asymre", "--lr", "1e-6", "--micro-batch-size", "8"])
    device = torch.device("cpu")
    model, tok, _, _ = loading.load_policy(cfg, device, tasks.make_task(cfg), verifiers=rg.VERIFIERS)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert generation.HFGenerator(model, tok).model.dtype == torch.bfloat16  # the generator's copy computes in bf16
    pure = models.build_tiny_model(cfg.seed)[0].to(torch.bfloat16)
    moved = {}
    for name, m in (("masters", model), ("pure bf16", pure)):
        before = {k: v.clone() for k, v in m.state_dict().items()}
        opt = torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=0.0)
        for step in range(10):
            stats = rg.train_step(m, opt, random_batch(seed=step), cfg, tok.pad_token_id, version=step)
            assert stats["nonfinite"] == 0 and stats["grad_norm"] > 0
        moved[name] = fraction_changed(before, m)
    assert moved["masters"] >= 0.99, moved
    assert moved["pure bf16"] < 0.1, moved  # what this policy avoids


def test_a_checkpoint_holds_the_fp32_masters_and_resume_continues_exactly(bf16, tmp_path):
    full = rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "full", "--eval-every", "2"])
    rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "cut", "--eval-every", "2", "--total-steps", "2"])
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "cut" / "checkpoint" / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.float32}
    rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "cut", "--eval-every", "2", "--resume"])
    assert training_records(tmp_path / "cut") == training_records(tmp_path / "full"), full
    a = load_file(tmp_path / "cut" / "checkpoint" / "model.safetensors")
    b = load_file(tmp_path / "full" / "checkpoint" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


# --- defect: vLLM's GPU runner samples from numpy's global stream ---------------------------------


@pytest.fixture
def numpy_seeded_sampling(monkeypatch):
    """HF generate seeded per request from numpy's global RNG, as vLLM's GPU model runner seeds its requests."""
    real = generation.HFGenerator.generate

    def generate(self, *args, **kwargs):
        torch.manual_seed(int(np.random.randint(2**31)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(generation.HFGenerator, "generate", generate)


def test_evaluating_never_changes_training_when_sampling_draws_from_numpy(numpy_seeded_sampling, tmp_path):
    rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "often", "--eval-every", "1"])
    rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "never"])
    assert training_records(tmp_path / "often") == training_records(tmp_path / "never")


def test_resume_restores_numpy_stream(numpy_seeded_sampling, tmp_path):
    rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "full", "--eval-every", "2"])
    rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "cut", "--eval-every", "2", "--total-steps", "2"])
    np.random.seed(12345)  # whatever the process did in between
    rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "cut", "--eval-every", "2", "--resume"])
    assert training_records(tmp_path / "cut") == training_records(tmp_path / "full")


# --- defect: generators ignored an inherited CUDA_VISIBLE_DEVICES ---------------------------------


def test_server_gpus_map_through_an_inherited_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert serving.server_gpus(4, 3, 4) == ["7", "4", "5", "6"]  # after the trainers' 4, 5, 6, then round-robin
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,MIG-bb")
    assert serving.server_gpus(1, 1, 2) == ["MIG-bb"]


# --- defect: every rank read the full optimizer state on resume -----------------------------------

OPTIMIZER_BROADCAST = r"""
import copy, os, torch, torch.distributed as dist
import async_pipeline as ap, replay_grpo as rg
from infra import models
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from test_gpu_path import random_batch
dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = rg.parse_args(["--loss", "asymre", "--micro-batch-size", "4", "--lr", "1e-2"])
device = torch.device("cpu")
model, tok = models.build_tiny_model(0)
policy = ap.shard_policy(model, device)
opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
for step in range(2):
    rg.train_step(policy, opt, random_batch(n=8, seed=2 * step + rank), cfg, tok.pad_token_id, step)
# copies: on a CPU these may share storage with the live state (a checkpoint writes them out at once)
saved = copy.deepcopy(get_optimizer_state_dict(policy, opt,
                                               options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
weights = copy.deepcopy(ap.full_weights(policy))
box = [weights]
dist.broadcast_object_list(box, src=0)  # every rank loads the checkpoint's model
rg.train_step(policy, opt, random_batch(n=8, seed=10 + rank), cfg, tok.pad_token_id, 2)
uninterrupted = ap.full_weights(policy)
resumed_model = models.build_tiny_model(1)[0]
resumed_model.load_state_dict(box[0])
resumed = ap.shard_policy(resumed_model, device)
opt2 = torch.optim.AdamW(resumed.parameters(), lr=cfg.lr, weight_decay=0.0)
ap.load_optimizer_state(resumed, opt2, saved if rank == 0 else {})  # only rank 0 read the file
rg.train_step(resumed, opt2, random_batch(n=8, seed=10 + rank), cfg, tok.pad_token_id, 2)
after = ap.full_weights(resumed)
if rank == 0:
    assert saved and after.keys() == uninterrupted.keys()
    worst = max((after[k] - uninterrupted[k]).abs().max().item() for k in after)
    assert worst == 0.0, worst
    print("BROADCAST-OK", flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # no interpreter shutdown: a gloo thread still freeing the last work's tensors would abort it (SIGABRT)
"""


def test_resume_on_two_ranks_reads_the_optimizer_state_on_rank_0_only(tmp_path):
    """T = 2 under gloo: rank 0 alone holds the saved optimizer state; after the broadcast the next step's weights
    equal the uninterrupted run's, bit for bit."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "broadcast_check.py"
    script.write_text(OPTIMIZER_BROADCAST)
    cmd = [
        sys.executable,
        *("-m torch.distributed.run --standalone --nproc_per_node 2 --master-port").split(),
        str(port),
        str(script),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "BROADCAST-OK" in res.stdout, (res.stdout + res.stderr)[-4000:]


# --- defect: the warm-start cache ignored the precision -------------------------------------------


def test_a_warm_start_is_not_shared_between_precisions(tmp_path, monkeypatch, capsys):
    args = SMALL + ["--sft-warmup-steps", "2", "--total-steps", "1", "--out-dir", str(tmp_path)]
    rg.main(args + ["--run-name", "fp32"])
    assert "warm start: 2 supervised steps" in capsys.readouterr().out
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    rg.main(args + ["--run-name", "bf16"])
    assert "warm start: 2 supervised steps" in capsys.readouterr().out  # trained again, in bf16
    rg.main(args + ["--run-name", "bf16-again"])
    assert "warm start" not in capsys.readouterr().out  # and cached for bf16


# --- defect: the generation benchmark measured another precision than a run's --------------------


def test_the_generation_benchmark_uses_the_run_precision(bf16):
    model, tok = models.build_tiny_model(0)
    prompts = [models.render_prompt(tok, f"{i}+1=") for i in range(4)]
    rows = bench_generation.bench(
        "tiny", model, tok, None, prompts, group=2, tokens=4, threads=None, train_threads=None, vllm=False
    )
    assert [r[1] for r in rows] == ["hf-bfloat16"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the trainer's side: fp32 masters


# --- defect: the slow log-prob matmul path went unsaid ---------------------------------------------


def test_the_slow_matmul_path_is_said_once_at_the_start(bf16, monkeypatch):
    monkeypatch.setitem(kernels._OUT_DTYPE_OK, "cuda", False)  # a torch whose mm refuses out_dtype=float32
    lines = []
    kernels.report_precision(torch.device("cuda"), write=lines.append)
    assert len(lines) == 1 and "bfloat16 compute" in lines[0] and "the slow path" in lines[0], lines
    monkeypatch.setitem(kernels._OUT_DTYPE_OK, "cuda", True)
    lines.clear()
    kernels.report_precision(torch.device("cuda"), write=lines.append)
    assert "out_dtype" in lines[0] and "slow" not in lines[0], lines
    monkeypatch.delenv(kernels.COMPUTE_DTYPE_ENV)
    lines.clear()
    kernels.report_precision(torch.device("cpu"), write=lines.append)  # fp32: nothing to say
    assert lines == []


class DeviceMemory:
    """torch.cuda's allocator statistics as a GPU keeps them: bytes allocated, and their peak since the last reset."""

    def __init__(self):
        self.allocated = self.peak = 0

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated

    def allocate(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)


def test_peak_memory_is_each_train_steps_own_without_the_generators_share(tmp_path, monkeypatch):
    """A colocated engine's 42 GiB of pools (counted by the allocator asleep or awake) and a first step that peaks
    at 10 GiB of activations, then 3 GiB: each record has its own step's peak, the engine's share apart."""
    gib, device = 2**30, DeviceMemory()
    monkeypatch.setattr(kernels, "memory_stats", lambda _: device)
    real_make, real_step, peaks = rg.make_generator, rg.train_step, iter([10, 3, 3, 3])

    def make_generator(*args, **kwargs):
        device.allocate(42 * gib)  # the engine's weights and KV cache
        return real_make(*args, **kwargs)

    def train_step(*args, **kwargs):
        n = next(peaks) * gib
        device.allocate(n)  # activations, freed by the end of the step
        device.allocated -= n
        return real_step(*args, **kwargs)

    monkeypatch.setattr(rg, "make_generator", make_generator)
    monkeypatch.setattr(rg, "train_step", train_step)
    out = rg.main(SMALL + ["--out-dir", str(tmp_path), "--run-name", "m"])
    recs = metrics(out["run_dir"])[1:]
    assert [r["peak_memory_gib"] for r in recs] == [10, 3, 3, 3], recs
    assert {r["generator_memory_gib"] for r in recs} == {42}


def test_a_run_logged_to_a_file_says_how_it_progresses_while_it_runs(tmp_path):
    """Under a batch scheduler stdout is a file and the progress bar is off: the warm start and the RL steps each
    write a progress line at least every PROGRESS_SECONDS (1 s here, through its test hook), read while it runs."""
    log = tmp_path / "log.txt"
    argv = SMALL + ["--sft-warmup-steps", "200", "--total-steps", "100000", "--out-dir", str(tmp_path)]
    env = dict(ENV, REPLAY_GRPO_PROGRESS_SECONDS="1")
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "replay_grpo.py"), *argv], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    try:
        deadline, lines = time.time() + 240, []
        while time.time() < deadline and proc.poll() is None:
            lines = log.read_text().splitlines()
            if sum(line.startswith("step ") and "s/step" in line for line in lines) >= 2:
                break
            time.sleep(1)
        assert proc.poll() is None, log.read_text()[-3000:]  # read while the run is alive
    finally:
        proc.kill()
        proc.wait()
    warm = [line for line in lines if line.startswith("warm start: step ") and "s/step" in line]
    steps = [line for line in lines if line.startswith("step ") and "s/step" in line]
    assert warm and len(steps) >= 2, "\n".join(lines[-30:])
    assert re.fullmatch(r"step \d+/100000: reward [\d.]+ \(fresh rollouts, last \d+ steps\), [\d.]+ s/step", steps[0])


class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """(dtype, numel) of every tensor an operator makes inside the block (new memory: views and aliases are not)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = torch.utils._pytree.tree_leaves((args, kwargs))
        old = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in old:
                self.made.append((t.dtype, t.numel()))
        return out


def test_the_hf_copy_is_cast_from_the_masters_without_an_fp32_copy(bf16):
    """On a GPU an fp32 copy of the policy, even a passing one, takes 4 bytes a parameter more than the bf16 copy:
    every weight of the copy is made in the compute dtype straight from its master (the tied head once)."""
    model, tok = models.build_tiny_model(0)
    big = {p.numel() for p in model.parameters() if p.numel() >= 1000}
    with Allocations() as seen:
        gen = generation.HFGenerator(model, tok)
    assert not [m for m in seen.made if m[0] == torch.float32 and m[1] in big], seen.made
    assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
    assert gen.model.get_output_embeddings().weight is gen.model.get_input_embeddings().weight  # still tied
    for name, p in model.named_parameters():
        assert torch.equal(gen.model.get_parameter(name), p.detach().to(torch.bfloat16)), name


def test_the_disk_publish_writes_the_compute_dtype_once_with_the_head(tmp_path):
    """Weights leave the trainer in the compute dtype (bf16 on GPUs): one safetensors file per publish, the tied
    head written as its own lm_head.weight (a folder reload keeps the old head otherwise). No server: the file."""
    from safetensors.torch import load_file

    model, _ = models.build_tiny_model(0)
    publisher = ap.Publisher([], "disk", tmp_path, torch.bfloat16, tied=True, address="127.0.0.1")
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    publisher.publish(weights, 3)  # the step goes on at once, and may save a checkpoint that empties the dict
    weights.clear()
    with publisher.cond:
        assert publisher.cond.wait_for(lambda: publisher.done_version == 3 or publisher.error, timeout=60)
    assert (
        publisher.error is None
        and publisher.done_version == 3
        and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    )
    written = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert torch.equal(written["lm_head.weight"], model.model.embed_tokens.weight.detach().to(torch.bfloat16))
    assert written.keys() == model.state_dict().keys() | {"lm_head.weight"}


def test_rank_0_holds_no_evaluator_on_its_device_between_evaluations(tmp_path, monkeypatch, vllm_servers):
    """async_pipeline.py: rank 0 builds its evaluator for each evaluation and drops it; during the train steps no copy
    of the policy but the trainer's lives in the trainer process."""
    import gc
    import weakref

    built, live, real_init, real_step = weakref.WeakSet(), [], generation.HFGenerator.__init__, rg.train_step

    def init(self, *args, **kwargs):  # only this run's generators: earlier tests' may still await collection
        built.add(self)
        real_init(self, *args, **kwargs)

    def train_step(*args, **kwargs):
        gc.collect()
        live.append(sum(g.model is not None for g in built))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(generation.HFGenerator, "__init__", init)
    monkeypatch.setattr(rg, "train_step", train_step)
    argv = SMALL + ["--generator-urls", vllm_servers["tied"].url, "--eval-every", "2"]
    out = ap.main(argv + ["--out-dir", str(tmp_path), "--run-name", "a"])
    assert live == [0, 0, 0, 0], live
    assert len(built) == 0  # the evaluators built for steps 0, 2 and 4 are gone too
    assert [r["step"] for r in metrics(out["run_dir"]) if "eval/greedy_acc" in r] == [0, 2, 4]


# --- defect: the generation benchmark crashed where vLLM does not import (a GPU machine without it) ---------


def test_the_generation_benchmark_measures_hf_alone_without_vllm(monkeypatch, capsys):
    def unavailable():
        raise generation.VLLMUnavailable("--generator vllm needs vLLM (ImportError: no vllm)")

    monkeypatch.setattr(generation, "import_vllm", unavailable)
    argv = "--tiny-prompts 4 --tiny-group 2 --tiny-tokens 4 --skip-smol".split()
    monkeypatch.setattr(sys, "argv", ["bench_generation.py", *argv])
    bench_generation.main()
    out = capsys.readouterr().out
    assert "vllm rows skipped: --generator vllm needs vLLM" in out, out
    assert [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| tiny")] == ["hf-float32"], out
