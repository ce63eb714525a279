"""async_pipeline.py: the paper's asynchronous system for replay_grpo.py (--mode async).

W generator processes run make_rollouts in a loop with whatever weights they hold and put every
finished request (prompts_per_step x G rollouts, advantages, behaviour log-probs and policy version
frozen) on one bounded channel; a full channel makes them wait (backpressure). The trainers are
torchrun ranks sharding the policy with FSDP2. Rank 0 owns the channel and deals new rollouts
round-robin to the ranks; each keeps a ReplayBuffer shard of N/T, samples B/T per step and FSDP
averages the gradients. Every k steps the full weights are gathered to rank 0 and written to a
shared-memory mailbox that generators read between requests, so a rollout carries the version
(= optimizer steps) that really made it.

    python replay_grpo.py --preset cpu --mode async --num-generators 1                  # T = 1
    torchrun --nproc_per_node 2 replay_grpo.py --preset cpu --mode async --num-generators 1

On GPUs the T ranks use GPUs 0..T-1 with NCCL and generator i takes GPU T+i (with fewer GPUs they
share: on one GPU, the trainer's), which it sees as its only device (CUDA_VISIBLE_DEVICES is set in
the generator before CUDA starts there, so a vLLM engine lands on it too). The mailbox goes through
host memory; at scale, weights would rather go from rank 0 to the engines by an NCCL broadcast (a
process group spanning trainers and engines) or vLLM's weight-transfer API.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import kernels
import replay_grpo as rg
import run_folder
from replay_grpo import PipelineError, UserError

# A generator that delivers nothing while the channel has room for its requests is hung (or stopped): after
# SILENT_FACTOR times the longest request any generator took (its weight pull and its generation), and at least
# SILENT_FLOOR seconds, rank 0 kills it and stops the run. Before its first request it has START_SECONDS (a
# model and an engine to load). Time the channel is full does not count: generators then wait for the trainers.
SILENT_FACTOR = 10
SILENT_FLOOR = 60.0
START_SECONDS = 1800.0


class LogprobPolicy(torch.nn.Module):
    """A causal LM whose forward is completion_logprobs. Under FSDP2 (`fully_shard(LogprobPolicy(model))`)
    the embedding, the (tied) LM head and the final norm belong to this root module and are sharded
    DTensors except inside its forward, where FSDP all-gathers them: computing the log-probs here hands
    kernels.token_logprobs the full head weight, and FSDP reduce-scatters its gradient (to the tied
    embedding too). Reading the head outside this forward would hand the kernel a shard of it."""

    computes_logprobs = True  # rg.completion_logprobs calls forward with packed ids

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, ids, mask, targets, temperature, entropy):
        out = rg.packed_logprobs(self.policy, ids, mask, targets, temperature, entropy=entropy)
        # fresh tensors, not views: FSDP hangs its pre-backward hook on the outputs
        return tuple(t.clone() for t in out) if entropy else out.clone()


class WeightMailbox:
    """The latest published weights in shared memory, in the generators' dtype: rank 0 overwrites them in
    place, a generator copies them out between requests when the version moved and loads its copy after
    releasing the lock, so a publish waits at most for a memory copy, never for a generator's weight reload.
    One copy for all W generators however often weights are published (a queue of state dicts would pile up
    behind a slow generator)."""

    def __init__(self, ctx, state_dict: dict, version: int, dtype: torch.dtype = torch.float32):
        self.tensors = {k: v.detach().to("cpu", dtype, copy=True).share_memory_() for k, v in state_dict.items()}
        self.version, self.lock = ctx.Value("q", version, lock=False), ctx.Lock()

    def publish(self, state_dict: dict, version: int, alive=lambda: True) -> bool:
        """Overwrite the weights; False, without waiting forever, when a generator died holding the lock
        (alive() turned false: the run is then stopped by the dead generator's failure)."""
        while not self.lock.acquire(timeout=1.0):
            if not alive():
                return False
        try:
            for k, t in self.tensors.items():
                t.copy_(state_dict[k])
            self.version.value = version
        finally:
            self.lock.release()
        return True

    def pull(self, generator) -> None:
        if self.version.value == generator.policy_version:  # unlocked peek; the copy itself is locked
            return
        with self.lock:
            version = self.version.value
            weights = {k: t.clone() for k, t in self.tensors.items()}
        generator.load_weights(weights, version)


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (containers, SLURM)."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return min(cores, quota) if quota else cores


def cgroup_cpu_quota() -> int | None:
    """The cgroup's CPU limit in whole cores (v2's cpu.max, else v1's CFS quota); None without a limit."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def set_cpu_threads(role: str, processes: int) -> int:
    """This process's torch intra-op threads: its share of the machine's cores among the `processes` of the
    pipeline that run on it (on 2 cores, two processes of 2 threads each ran 3x slower than of 1 thread each),
    unless the user set OMP_NUM_THREADS. Says so in one line."""
    if "OMP_NUM_THREADS" in os.environ:
        threads, why = torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    else:
        cores = available_cores()
        threads, why = max(1, cores // processes), f"{cores} cores / {processes} processes on this machine"
        torch._C.set_num_threads(threads)  # torch._C: an in-process vLLM CPU worker patches torch.set_num_threads
    print(f"threads: {role} uses {threads} torch thread{'s' * (threads > 1)} ({why})", flush=True)
    return threads


def generator_streams(seed: int, index: int, first_group_id: int) -> random.Random:
    """A generator process's prompt stream, its torch and numpy seeds (vLLM's GPU runner samples from numpy's):
    its own per generator and per resume, so that no two generators sample the same noise."""
    rng = random.Random(f"{seed}/{index}/{first_group_id}")
    torch.manual_seed(rng.getrandbits(63))
    np.random.seed(random.Random(f"numpy/{seed}/{index}/{first_group_id}").getrandbits(32))  # leaves rng as it was
    return rng


def generator_main(
    index: int,
    cfg: rg.Args,
    mailbox: WeightMailbox,
    channel,
    errors,
    stop,
    first_group_id: int,
    gpu: str | None,
    processes: int,
) -> None:
    """One generator process: make_rollouts with the newest weights, request after request."""
    if gpu is not None:  # before CUDA starts in this process: GPU `gpu` becomes its cuda:0 (vLLM uses the first one)
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    set_cpu_threads(f"generator {index}", processes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a spawned process: no weight-loading bars in the run's log
    channel.cancel_join_thread()  # at exit, never wait to flush rollouts nobody will read
    parent = mp.parent_process()
    try:
        task = rg.make_task(cfg)
        device = torch.device("cpu" if gpu is None else "cuda:0")
        # the architecture and tokenizer, in the compute dtype on the host (never fp32 on the GPU): the weights come
        # from the mailbox before the first request
        model, tok = rg.load_base_policy(cfg, torch.device("cpu"), kernels.compute_dtype(device))
        rg.fit_to_context(cfg, task, tok, model)  # the prompts the trainer kept (it said what it skipped)
        generator = rg.make_generator(
            dataclasses.replace(cfg, generator="hf") if cfg.generator == "auto" else cfg,
            model,
            tok,
            cfg.model,
            colocated=False,
            device=device,
        )
        del model  # the generator holds its own copy (HF) or the engine's (vLLM)
        generator.policy_version = -1  # start from the published weights
        rng = generator_streams(cfg.seed, index, first_group_id)
        idle, request = 0.0, 0
        while not stop.is_set() and parent.is_alive():
            t_pull = time.perf_counter()
            mailbox.pull(generator)
            t0 = time.perf_counter()
            group_id = first_group_id + (request * cfg.num_generators + index) * cfg.prompts_per_step
            examples = task.sample(rng, cfg.prompts_per_step)
            rollouts, counts = rg.make_rollouts(generator, tok, task, examples, cfg, next_group_id=group_id)
            msg = pickle.dumps(
                {
                    "rollouts": rollouts,
                    "counters": dict(counts),
                    "idle_seconds": idle,
                    "busy_seconds": time.perf_counter() - t0,
                    "generator": index,
                    "request_seconds": time.perf_counter() - t_pull,
                }
            )  # bytes: no shared-memory fd per tensor
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
        errors.put((index, os.environ.get("CUDA_VISIBLE_DEVICES"), traceback.format_exc()))
        raise SystemExit(1)


class GeneratorPool:
    """The W generator processes, the bounded channel they fill, their error queue and lifecycle."""

    def __init__(
        self,
        cfg: rg.Args,
        ctx,
        mailbox: WeightMailbox,
        first_group_id: int,
        n_trainers: int,
        processes: int = 1,
        checkpoint: Path | None = None,
    ):
        self.checkpoint = checkpoint  # the run's, named when a generator hangs
        self.capacity = max(4, 2 * cfg.num_generators)  # finished requests the channel holds
        self.channel, self.errors, self.stop = ctx.Queue(maxsize=self.capacity), ctx.Queue(), ctx.Event()
        self.gpus = generator_gpus(cfg.num_generators, n_trainers, torch.cuda.device_count())
        self.procs = [
            ctx.Process(
                target=generator_main,
                name=f"generator-{i}",
                args=(i, cfg, mailbox, self.channel, self.errors, self.stop, first_group_id, gpu, processes),
            )
            for i, gpu in enumerate(self.gpus)
        ]
        for p in self.procs:  # not daemons: a vLLM engine starts processes of its own
            p.start()
        self.heard = [time.monotonic()] * len(self.procs)  # when each delivered last, or could not for a full channel
        self.delivered = [False] * len(self.procs)
        self.longest = 0.0  # seconds of the longest request so far

    def receive(self, wait: float, limit: int | None = None) -> list[dict]:
        """Every finished request in the channel (at most `limit`), waiting up to `wait` seconds for the first."""
        msgs, backlog = [], self.depth()
        most = self.capacity + len(self.procs) + 1  # bounded: they keep producing
        if limit is not None:
            most = min(most, limit)
        try:
            if most > 0:
                msgs.append(self.channel.get(timeout=wait) if wait > 0 else self.channel.get_nowait())
            while len(msgs) < most:
                msgs.append(self.channel.get_nowait())
        except queue.Empty:
            pass
        now = time.monotonic()
        full = len(msgs) >= self.capacity if backlog is None else backlog >= self.capacity  # None: macOS
        if full or len(msgs) == limit:  # a generator may have waited for room, or still waits: it is not silent
            self.heard = [now] * len(self.procs)
        msgs = [pickle.loads(m) for m in msgs]
        for m in msgs:
            self.heard[m["generator"]], self.delivered[m["generator"]] = now, True
            self.longest = max(self.longest, m["request_seconds"])
        return msgs

    def hung(self) -> str | None:
        """A generator that has delivered nothing for longer than it may (SILENT_FACTOR above), killed, in one line;
        None while every generator delivers."""
        bound = max(SILENT_FLOOR, SILENT_FACTOR * self.longest)
        for i, p in enumerate(self.procs):
            silent = time.monotonic() - self.heard[i]
            if silent > (bound if self.delivered[i] else max(bound, START_SECONDS)):
                p.kill()  # a stopped process ends only so
                kept = run_folder.what_is_kept(self.checkpoint.parent if self.checkpoint is not None else None)
                return (
                    f"generator {i} (pid {p.pid}) delivered no rollouts for {silent:.0f} s while the channel had "
                    f"room (the bound: {SILENT_FACTOR} x the longest request, {self.longest:.1f} s, at least "
                    f"{SILENT_FLOOR:.0f} s): it hangs or was stopped, so the run stops; {kept}"
                )
        return None

    def failure(self) -> str | None:
        """Why a generator stopped (its traceback, or its exit code / signal); None while all run."""
        dead = [(i, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
        if not dead:
            return None
        try:  # a generator that raised sent its traceback before exiting
            index, gpus, tb = self.errors.get(timeout=2)
            return f"generator {index} (CUDA_VISIBLE_DEVICES={gpus}) failed:\n{tb.rstrip()}"
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


def shard_policy(model, device: torch.device) -> LogprobPolicy:
    """The policy under FSDP2: one unit per decoder block (HF lists their classes) and the root (embeddings, tied
    head, final norm; the log-probs run in its forward). Parameters and Adam state stay fp32 (the masters); on GPUs
    the forward and backward run on the bf16 copies FSDP all-gathers, and gradients are reduce-scattered in fp32."""
    policy = LogprobPolicy(model)
    precision = MixedPrecisionPolicy(param_dtype=kernels.compute_dtype(device), reduce_dtype=torch.float32)
    for m in model.modules():
        if type(m).__name__ in (model._no_split_modules or ()):
            fully_shard(m, mp_policy=precision)
    fully_shard(policy, mp_policy=precision)
    return policy


def load_optimizer_state(policy, optimizer, full_state: dict) -> None:
    """The full optimizer state, read by rank 0 alone (other ranks pass {}), broadcast and sharded. Collective."""
    set_optimizer_state_dict(
        policy, optimizer, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def generator_gpus(W: int, T: int, n_gpus: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES entry of each generator: the GPUs after the T trainers' (W + T <= n_gpus), else
    shared round-robin (one GPU: the trainer's); None without GPUs. The index is one into this process's
    visible devices, so it is mapped through an inherited CUDA_VISIBLE_DEVICES (SLURM, containers; ordinals,
    UUIDs or MIG names alike): a child reads its value as physical devices."""
    if not n_gpus:
        return [None] * W
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in inherited.split(",")] if inherited else [str(i) for i in range(n_gpus)]
    return [visible[(T + i) % n_gpus] for i in range(W)]


def full_weights(policy) -> dict:
    """The full state dict on rank 0 (CPU, Hugging Face key names), {} elsewhere. Collective."""
    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("policy."): v for k, v in sd.items()}


def merge_stats(per_rank: list[dict]) -> dict:
    """The ranks' train_step metrics as the step's: token-weighted means; maxima; sums of counts; loss and
    grad norm as the mean over ranks (grad norm is already global: FSDP clips globally)."""
    tokens, out = [s["trained_tokens"] for s in per_rank], {}
    for k in dict.fromkeys(k for s in per_rank for k in s):
        vals = [(s[k], n) for s, n in zip(per_rank, tokens) if k in s]
        if k == "trained_tokens":
            out[k] = sum(tokens)
        elif k in ("ratio_max", "nonfinite"):
            out[k] = max(v for v, _ in vals)
        elif k in ("loss", "grad_norm"):
            out[k] = sum(v for v, _ in vals) / len(vals)
        elif k == "staleness_sums":  # bucket -> summed counts and sums (rg.add_staleness_sums)
            out[k] = {}
            for v, _ in vals:
                for bucket, row in v.items():
                    out[k][bucket] = [x + y for x, y in zip(out[k].get(bucket, [0] * len(row)), row)]
        else:
            out[k] = sum(v * n for v, n in vals) / sum(n for _, n in vals)
    return out


def save_async_checkpoint(
    run_dir, rank: int, policy, optimizer, shard: rg.ReplayBuffer, model, weights: dict, tok, state: dict
) -> None:
    """The model (save_pretrained through rank 0's copy, of the gathered fp32 `weights`) and the full optimizer
    state from rank 0, each rank's buffer shard and RNG in its own file; swapped in whole by rename."""
    osd = get_optimizer_state_dict(
        policy,
        optimizer,  # collective
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )
    if rank == 0:
        run_folder.save_checkpoint(run_dir, model, tok, state, optimizer_state=osd, weights=weights, swap=False)
    barrier()
    own = {"buffer": shard.state_dict(), "rng": rg.run_folder.rng_state()}
    torch.save(own, run_dir / "checkpoint.tmp" / f"buffer_rank{rank}.pt")
    barrier()
    if rank == 0:
        run_folder.swap_in_checkpoint(run_dir)


def throughput_mu_gamma(totals: dict, T: int, W: int) -> tuple[float, float]:
    """The paper's way (its App. D.4): mu as the throughput ratio (rollouts trained on / T) / (unique rollouts
    generated / W), exact when neither side idles, and the speed-up gamma = (1 + W/T) / (1 + mu) of the W/T split
    over alternating generation and training."""
    mu = (totals["trained_rollouts"] / T) / (totals["generated_rollouts"] / W)
    return mu, (1 + W / T) / (1 + mu)


class Dealer:
    """Rank 0: takes the generators' finished requests off the channel, adds their counts to the run totals and
    deals their rollouts round-robin to the T ranks' shards (its state is checkpointed). With --sampling queue it
    takes only requests that every shard has room for, so the channel fills and the generators wait."""

    def __init__(self, cfg: rg.Args, T: int, state: dict | None = None):
        self.T = T
        self.next_group_id, self.next_rank, self.dealt = 0, 0, [0] * T
        self.empty_requests = 0  # requests in a row whose groups were all dropped
        self.held = [0] * T  # rollouts in each shard (--sampling queue): the last step's sizes, plus those dealt since
        self.room = None  # rollouts a shard may hold: N/T for the queue, no limit otherwise
        self.share = math.ceil(cfg.rollouts_per_step / T)  # the most rollouts a request deals to one shard
        if cfg.sampling == "queue":
            self.room = cfg.buffer_size // T
        if state is not None:
            self.next_group_id, self.next_rank, self.dealt = state["next_group_id"], state["next_rank"], state["dealt"]
            self.held = state.get("held", self.held)

    def state_dict(self) -> dict:
        return {
            "next_group_id": self.next_group_id,
            "next_rank": self.next_rank,
            "dealt": list(self.dealt),
            "held": list(self.held),
        }

    def take(self, pool: GeneratorPool, totals: dict, step: int, wait: bool) -> tuple[list[dict], list, int]:
        """Each rank's message (its rollouts, and why the run must stop or None), the new rollouts and the tokens
        generated; waits up to a second for a request if `wait` (a shard could not draw a batch)."""
        failure = pool.failure()
        limit = None
        if self.room is not None:  # backpressure: only whole requests that every shard has room for
            limit = (self.room - max(self.held)) // self.share
        msgs = [] if failure else pool.receive(wait=1.0 if wait else 0, limit=limit)
        failure = failure or pool.hung()
        parts, fresh, stop = self.deal(msgs, totals, step)
        tokens = sum(m["counters"].get("generated_tokens", 0) for m in msgs)
        out = [{"rollouts": p, "failure": failure or stop} for p in parts]
        return out, fresh, tokens

    def deal(self, msgs: list[dict], totals: dict, step: int) -> tuple[list[list], list, str | None]:
        """The rollouts of `msgs` for each rank, all of them in order, and why the run must stop (or None)."""
        parts, fresh, failure = [[] for _ in range(self.T)], [], None
        for m in msgs:
            totals["gen_seconds"] += m["busy_seconds"]
            totals["gen_idle_seconds"] += m["idle_seconds"]
            rg.add_counts(totals, m["counters"])  # generated rollouts and tokens, verifier failures...
            self.empty_requests = 0 if m["rollouts"] else self.empty_requests + 1
            if self.empty_requests >= rg.MAX_EMPTY_REQUESTS:
                failure = rg.all_dropped_message(self.empty_requests, step)
            for r in m["rollouts"]:
                parts[self.next_rank].append(r)
                self.dealt[self.next_rank] += 1
                self.held[self.next_rank] += 1
                self.next_rank = (self.next_rank + 1) % self.T
                self.next_group_id = max(self.next_group_id, r.group_id + 1)
                fresh.append(r)
        return parts, fresh, failure


def merge_sums(per_rank: list[dict]) -> dict:
    """The ranks' rg.batch_sums as the whole batch's."""
    merged = {"reward": 0, "length": 0, "truncated": 0, "staleness": []}
    for sums in per_rank:
        for key, value in sums.items():
            merged[key] += value
    return merged


def async_record(
    step: int, reports: list[dict], totals: dict, fresh: list, batch_size: int, T: int, W: int, **extra
) -> dict:
    """One step's record from the ranks' reports (counted into the run totals: the slowest rank's seconds set the
    pace): rg.step_record, and what the pipeline adds."""
    stats, train_seconds = merge_stats([r["stats"] for r in reports]), max(r["train_seconds"] for r in reports)
    rg.count_step(totals, stats, batch_size=batch_size, train_seconds=train_seconds)
    totals["sync_seconds"] += extra["sync_seconds"]
    mu_throughput, gamma = throughput_mu_gamma(totals, T, W)
    return rg.step_record(
        step=step,
        stats=stats,
        fresh=fresh,
        sums=merge_sums([r["sums"] for r in reports]),
        since_last=[s for r in reports for s in r["since_last"]],
        buffer_size=sum(r["buffer_size"] for r in reports),
        evicted_uses=sum((r["evicted_uses"] for r in reports), Counter()),
        batch_size=batch_size,
        totals=totals,
        trainers=T,
        fresh_rollouts=len(fresh),
        fresh_versions=sorted({r.policy_version for r in fresh}),
        **extra,
        train_seconds=train_seconds,
        trainer_idle_seconds=totals["trainer_idle_seconds"],
        gen_idle_seconds=totals["gen_idle_seconds"],
        gen_busy_seconds=totals["gen_seconds"],
        mu_throughput=mu_throughput,
        gamma=gamma,
        num_generators=W,
        num_trainers=T,
    )


def print_summary(totals: dict, T: int, W: int) -> None:
    """The run's mu both ways, gamma and the idle seconds of each side."""
    if not (totals["generated_rollouts"] and totals["trained_rollouts"]):
        return
    mu = rg.measured_mu(totals, T)
    mu_throughput, gamma = throughput_mu_gamma(totals, T, W)
    print(
        f"measured mu = {mu:.2f} (busy seconds per rollout, generators / trainers); the paper's throughput ratio "
        f"(trained/T) / (generated/W) = {mu_throughput:.2f}, gamma = (1 + W/T)/(1 + mu) = {gamma:.2f}; idle "
        f"seconds: trainers {totals['trainer_idle_seconds']:.1f}, generators {totals['gen_idle_seconds']:.1f} "
        f"(of {totals['gen_seconds']:.1f} busy)"
    )


def init_process_group(cfg: rg.Args) -> bool:
    """The trainers' process group: torchrun's (it sets RANK, WORLD_SIZE, MASTER_ADDR), or a world of one under plain
    python. True when this call created it (and must destroy it)."""
    if dist.is_initialized():
        return False
    # a rank waits in a collective while rank 0 evaluates or saves: NCCL's 10-minute default is too short
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(minutes=cfg.dist_timeout)
    if "RANK" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
    return True


def check_sharding(cfg: rg.Args, T: int) -> None:
    """Refuse a batch, buffer or positive bias that T trainer ranks cannot share."""
    B, N = cfg.batch_size, cfg.buffer_size
    if B % T or N % T:
        raise UserError(
            f"--batch-size {B} and --buffer-size {N} must be multiples of the {T} trainer ranks "
            "(torchrun --nproc_per_node): each rank holds N/T, samples B/T"
        )
    if cfg.sampling == "queue" and cfg.rollouts_per_step % T:
        raise UserError(
            f"--sampling queue: R = {cfg.rollouts_per_step} (--prompts-per-step x --group-size) must be "
            f"a multiple of the {T} trainer ranks, so that every shard gets the same share of a request"
        )
    if N // T - round(cfg.positive_bias * (N // T)) < 1:
        raise UserError(
            f"--positive-bias {cfg.positive_bias}: each of the {T} ranks' buffer shards of N/T = "
            f"{N // T} rollouts would keep no slot for the freshest ones"
        )


def place_trainer(rank: int, W: int) -> tuple[torch.device, int]:
    """This rank's device, and its torch threads among the processes sharing this machine's cores: its trainer
    ranks, and the W generators on rank 0's machine (returned: their number)."""
    local_trainers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    processes = local_trainers + (W if int(os.environ.get("GROUP_RANK", "0")) == 0 else 0)
    set_cpu_threads(f"trainer rank {rank}", processes)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, processes


def resume_async(
    state: dict, ckpt: Path, rank: int, policy, optimizer, shard: rg.ReplayBuffer, totals: dict
) -> tuple[int, dict]:
    """Load a checkpoint's optimizer state (collective), this rank's buffer shard and RNG, and rank 0's totals;
    returns the step and the dealing state."""
    load_optimizer_state(policy, optimizer, state.get("optimizer", {}))
    own = run_folder.read_checkpoint_file(
        ckpt, f"buffer_rank{rank}.pt", lambda path: torch.load(path, weights_only=False), ("buffer", "rng")
    )
    shard.load_state_dict(own["buffer"])
    rg.run_folder.set_rng_state(own["rng"])
    state = split_old_counters(state)
    totals.update(state["totals"])
    totals["gen_seconds"] = totals.pop("gen_busy_seconds", totals["gen_seconds"])  # its older name
    return state["step"], state["dealing"]


def split_old_counters(state: dict) -> dict:
    """A checkpoint's trainer state with totals and dealing state apart (older checkpoints held both in one
    "counters", with a replay histogram that the buffer shards now hold)."""
    if "totals" not in state:
        totals = dict(state["counters"])
        state["dealing"] = {k: totals.pop(k) for k in ("next_group_id", "next_rank", "dealt")}
        totals.pop("replay_hist", None)
        state["totals"] = totals
    return state


def barrier() -> None:
    """dist.barrier on this rank's GPU under NCCL (without device_ids it may guess one and hang)."""
    dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # torchrun stops workers with SIGTERM: shut the generators down too


def train_async(cfg: rg.Args) -> dict:
    """The W/T pipeline: run under `torchrun --nproc_per_node T`, or as one process (T = 1)."""
    owns_group = init_process_group(cfg)
    rank, T, W = dist.get_rank(), dist.get_world_size(), cfg.num_generators
    device, processes = place_trainer(rank, W)
    B, N = cfg.batch_size, cfg.buffer_size
    pool, runlog, old_sigterm = None, None, signal.getsignal(signal.SIGTERM)
    try:
        # 0. setup: the run folder (rank 0 creates it), the policy sharded over the T ranks, a buffer shard each
        check_sharding(cfg, T)
        run_folder.seed_everything(cfg.seed)
        if rank == 0:
            kernels.report_precision(device)
        box = [run_folder.open_run(cfg) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        run_name, run_dir, ckpt = box[0]
        if rank == 0:  # first: it may write the warm-start cache that the others then read
            task, model, tok, _, warm, state = rg.load_run(cfg, device, ckpt, T, rank)
        barrier()
        if rank != 0:
            task, model, tok, _, warm, state = rg.load_run(cfg, device, ckpt, T, rank)
        kernels.check_memory_plan(cfg, model, task.longest_prompt, device, trainers=T, rank=rank)  # before sharding
        kernels.checkpoint_layers(model, cfg.activation_checkpointing)  # each decoder layer, before fully_shard
        # rank 0's full copy on the host in the compute dtype, made before sharding: each evaluation builds its
        # evaluator on the GPU from it (none stays there between evaluations); save_pretrained writes through it
        host_copy = kernels.cast_copy(model, kernels.compute_dtype(device), torch.device("cpu")) if rank == 0 else None
        policy = shard_policy(model, device)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        shard = rg.make_buffer(cfg, capacity=N // T, seed=cfg.seed + 1_000_003 * rank)
        # rank 0's run totals and dealing state (checkpointed)
        totals = rg.new_totals(gen_idle_seconds=0.0, trainer_idle_seconds=0.0, sync_seconds=0.0)
        step, dealing = 0, None
        if state is not None:
            step, dealing = resume_async(
                state, ckpt, rank, policy=policy, optimizer=optimizer, shard=shard, totals=totals
            )
        dealer = Dealer(cfg, T, dealing)
        nonfinite_streak, last_eval, fresh, step_tokens = 0, {}, [], 0  # step_tokens: generated since the last record
        ready = False  # every shard could draw a batch at the last look
        weights = full_weights(policy)
        if rank == 0:
            ctx = mp.get_context("spawn")  # fork would copy the process group and threads
            mailbox = WeightMailbox(ctx, weights, step, kernels.compute_dtype(device))
            signal.signal(signal.SIGTERM, _interrupt)
            pool = GeneratorPool(
                cfg,
                ctx,
                mailbox,
                first_group_id=dealer.next_group_id,
                n_trainers=T,
                processes=processes,
                checkpoint=ckpt,
            )
            runlog = run_folder.RunLog(cfg, run_name, run_dir, step)
            print(
                f"run folder: {run_dir}\nasync: W = {W} generator(s), T = {T} trainer rank(s); requests of "
                f"{cfg.rollouts_per_step} rollouts, batch B = {B} ({B // T}/rank), buffer N = {N} ({N // T}/rank), "
                f"channel {pool.capacity} requests, publish every {cfg.publish_every}"
            )
            if step == 0:  # while the generators start
                evaluator = rg.HFGenerator(host_copy, tok, device)
                last_eval = rg.first_evaluation(evaluator, tok, task, cfg, runlog=runlog, warm=warm)
                evaluator.close()
            bar = run_folder.Progress(step, cfg.total_steps)

        while step < cfg.total_steps:
            # 1. rank 0 takes what the generators finished and deals it round-robin; it waits (the
            #    trainers idle) only while a shard lacks a batch of B/T
            t0 = time.perf_counter()
            if rank == 0:
                out, new, tokens = dealer.take(pool, totals, step, wait=not ready)
                fresh += new
                step_tokens += tokens
            box = [None]
            dist.scatter_object_list(box, out if rank == 0 else None, src=0)
            mine = box[0]
            shard.push(mine["rollouts"])
            if mine["failure"]:  # every rank stops here, none is left waiting in a collective
                if rank == 0:
                    pool.close()
                barrier()  # the others wait: once a rank exits, torchrun SIGTERMs the rest
                raise PipelineError(
                    mine["failure"]
                    if rank == 0
                    else f"rank {rank} stopped by rank 0: {mine['failure'].splitlines()[0]}"
                )
            ready = rg.all_ranks(torch.tensor(shard.ready(B // T, step), device=device))  # every shard has a batch
            if not ready:
                if rank == 0:
                    totals["trainer_idle_seconds"] += time.perf_counter() - t0
                continue
            wait_seconds = time.perf_counter() - t0

            # 2. one optimizer step on B/T rollouts per rank (their uses are counted); FSDP averages the gradients
            batch, since_last_use = shard.sample(B // T, step)
            t0 = time.perf_counter()
            policy.train()
            stats = rg.train_step(policy, optimizer, batch, cfg, tok.pad_token_id, version=step)
            optimizer.zero_grad(set_to_none=True)  # their memory back for the publish and the evaluation
            report = {
                "stats": stats,
                "train_seconds": time.perf_counter() - t0,
                "sums": rg.batch_sums(batch, step),
                "since_last": since_last_use,
                "buffer_size": len(shard),
                "evicted_uses": shard.evicted_uses,
            }
            reports = [None] * T if rank == 0 else None
            dist.gather_object(report, reports, dst=0)
            step += 1  # the policy version of the updated weights
            nonfinite_streak = nonfinite_streak + 1 if stats["nonfinite"] else 0  # same on every rank
            if nonfinite_streak >= rg.MAX_NONFINITE_STEPS:
                raise run_folder.nonfinite_stop(nonfinite_streak, step, ckpt)

            # 3. publish weights every k steps; rank 0's copy gets them to evaluate
            evaluating = rg.is_eval_step(cfg, step)
            t0 = time.perf_counter()
            if step % cfg.publish_every == 0 or evaluating:
                weights = full_weights(policy)  # collective
            if rank == 0 and step % cfg.publish_every == 0:  # generators pick it up before their next request
                mailbox.publish(weights, step, alive=lambda: all(p.is_alive() for p in pool.procs))
            evaluator = None
            if rank == 0 and evaluating:  # on the GPU for this evaluation only
                host_copy.load_state_dict(weights)
                evaluator = rg.HFGenerator(host_copy, tok, device)
                evaluator.policy_version = step
            sync_seconds = time.perf_counter() - t0

            # 4. rank 0: the step's record, an evaluation every --eval-every steps; every rank: a checkpoint
            if rank == 0:
                dealer.held = [r["buffer_size"] for r in reports]
                record = async_record(
                    step=step,
                    reports=reports,
                    totals=totals,
                    fresh=fresh,
                    batch_size=B,
                    T=T,
                    W=W,
                    generated_tokens=step_tokens,
                    queue_depth=pool.depth(),
                    rollouts_per_rank=list(dealer.dealt),
                    wait_seconds=wait_seconds,
                    sync_seconds=sync_seconds,
                )
                fresh, step_tokens = [], 0
                evaluation = rg.end_step(cfg, record, batch, tok, task, evaluator=evaluator, runlog=runlog, bar=bar)
                last_eval = evaluation or last_eval
                if evaluator is not None:
                    evaluator.close()
            if evaluating:
                state = {"step": step, "totals": totals, "dealing": dealer.state_dict(), "mode": "async", "trainers": T}
                save_async_checkpoint(
                    run_dir,
                    rank,
                    policy=policy,
                    optimizer=optimizer,
                    shard=shard,
                    weights=weights,
                    model=host_copy,
                    tok=tok,
                    state=state,
                )
        if rank == 0:
            bar.close()
            print_summary(totals, T, W)
        return {**last_eval, "run_dir": str(run_dir)}
    finally:
        if pool is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
            pool.close()
            signal.signal(signal.SIGTERM, old_sigterm)
        if runlog is not None:
            runlog.close()
        if owns_group:
            dist.destroy_process_group()
