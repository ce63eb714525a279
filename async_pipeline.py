"""async_pipeline.py: the paper's asynchronous system of W generators and T trainers, running replay_grpo.py's method.

The generators are W OpenAI-compatible vLLM servers. Rank 0 launches them on its node (one per GPU after the trainers',
or on the CPU) or connects to servers started elsewhere (--generator-urls). A thread per server runs make_rollouts
request after request: prompts go as token ids with a seed drawn from the run's RNG, the answers come back with the
sampled tokens' log-probs and the weight version of every token, and rewards, advantages and behaviour log-probs are
frozen there. The trainers are torchrun ranks sharding the policy with FSDP2; rank 0 deals finished requests round-robin
to the ranks, each keeps a ReplayBuffer shard of N/T, samples B/T per step, and FSDP averages the gradients. Every k
steps the weights are gathered to rank 0 in the compute dtype, and a publisher thread hands them to every server
through vLLM's own API (pause keeping requests, load, label the version, resume): from a safetensors file on a shared
filesystem (--weight-transfer disk), or by one NCCL broadcast to all servers with vLLM's trainer-side weight-transfer
engine (--weight-transfer nccl). The held-out evaluation runs on a server at the published version. A rollout's
policy_version is its oldest token's version; one whose tokens span a publish is counted (mixed_version_rollouts).

    python async_pipeline.py --preset cpu --num-generators 2                             # T = 1, two servers
    torchrun --nproc_per_node 2 async_pipeline.py --preset cpu --num-generators 1        # T = 2, one server
    python async_pipeline.py ... --generator-urls http://node1:8000 http://node2:8000    # servers started elsewhere

Its flags are replay_grpo.py's (the presets too) and AsyncArgs's own. Where it departs from the synchronous loop:
1. rollouts come from servers at the weights they hold, so a batch mixes policy versions beyond the buffer's
   staleness (counted: mixed_version_rollouts, offpolicy_by_staleness);
2. each trainer rank holds a buffer shard of N/T and samples B/T: --batch-size and --buffer-size are multiples of T;
3. the held-out evaluation runs on a server at the published weights (greedy, pass@1, pass@k as requests);
4. --prox-lag is 0 (no lagged copies are kept) and --sampling queue needs --zero-variance-groups keep;
5. --generator does not apply: generation is always on vLLM servers.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import multiprocessing
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads spin 300 rounds before they sleep (set before torch loads libgomp): its default 300,000 made 2-core
# runs beside one busy process 2-4x slower, sleeping at once (OMP_WAIT_POLICY=PASSIVE) idle ones 1.3-1.6x slower
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):  # a setting the user made is kept
    os.environ["GOMP_SPINCOUNT"] = "300"

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import kernels
import replay_grpo as rg
from infra import device_memory, flag_checks, generation, loading, models, reporting, run_folder, tasks
from infra.run_folder import UserError
from infra.serving import (
    GENERATE,
    LOAD_BYTES_PER_SECOND,
    PROBE_BOUND,
    PROBE_PROMPTS,
    PipelineError,
    Server,
    ServerError,
    WrongAnswer,
    as_server_error,
    check_generator_host,
    free_port,
    on_daemons,
    on_servers,
    reach,
    start_generators,
    stop_servers,
    wait_ready,
)


@dataclass
class AsyncArgs(rg.Args):
    """The W/T system of replay_grpo.py's method. --preset picks every flag's default; later flags override it."""

    # --- the system: W vLLM servers stream rollouts to T torchrun trainer ranks (FSDP2) ---
    num_generators: int = 1  # W: vLLM servers (launched: one per GPU the trainers do not use)
    generator_urls: list[str] = dataclasses.field(default_factory=list)  # servers started elsewhere (W URLs)
    generator_host: str = "127.0.0.1"  # the address the launched servers listen on
    weight_transfer: Literal["auto", "disk", "nccl"] = "auto"  # how weights reach the servers (docs/async.md)
    publish_check: int = 1  # every k-th publish, each server's log-probs of a fixed probe checked (0: off)
    dist_timeout: int = 120  # minutes a torchrun rank may wait in a collective (rank 0 evaluating, saving)


def train_async(cfg: AsyncArgs) -> dict:
    """The W/T pipeline: run under `torchrun --nproc_per_node T`, or as one process (T = 1). 0. every rank sets up
    (setup) and rank 0 starts the servers (start_system); then each step: 1. rank 0 deals the servers' rollouts to the
    ranks' buffer shards, 2. one optimizer step, 3. a publish, 4. the record, an evaluation, a checkpoint."""
    owns_group = init_process_group(cfg)
    rank, T, W = dist.get_rank(), dist.get_world_size(), cfg.num_generators
    device, _ = place_trainer(rank, 0 if cfg.generator_urls else W)
    B = cfg.batch_size
    system, run, old_sigterm = System(), None, signal.getsignal(signal.SIGTERM)
    try:
        # 0. setup: the servers given by URL probed, the run folder, the policy sharded over the T ranks, a buffer
        #    shard each; rank 0 starts the servers and publishes the first weights to them
        run = setup(cfg, rank, T, device)
        last_eval = start_system(cfg, run, system, T, device) if rank == 0 else {}
        run.first = None  # sent by rank 0; the others' copy freed
        policy, optimizer, shard, dealer, tok = run.policy, run.optimizer, run.shard, run.dealer, run.tok
        servers, loop, publisher, step, totals = system.servers, system.loop, system.publisher, run.step, run.totals
        nonfinite_streak, fresh, step_tokens = 0, [], 0  # step_tokens: generated since the last record
        ready = False  # every shard could draw a batch at the last look
        while step < cfg.total_steps:
            # 1. rank 0 takes what the generators finished and deals it round-robin; it waits (the
            #    trainers idle) only while a shard lacks a batch of B/T
            t0 = time.perf_counter()
            if rank == 0:
                failure = publisher.error and str(publisher.error)
                out, new, tokens = dealer.take(loop, totals, step, wait=not ready, failure=failure)
                fresh += new
                step_tokens += tokens
            box = [None]
            dist.scatter_object_list(box, out if rank == 0 else None, src=0)
            mine = box[0]
            shard.push(mine["rollouts"], step)
            if mine["failure"]:  # every rank stops here, none is left waiting in a collective
                if rank == 0:
                    mine["failure"] += f"; {run_folder.what_is_kept(run.run_dir)}"
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
                "evicted": shard.evicted,
                "evicted_age": shard.evicted_age,
            }
            reports = [None] * T if rank == 0 else None
            dist.gather_object(report, reports, dst=0)
            step += 1  # the policy version of the updated weights
            nonfinite_streak = nonfinite_streak + 1 if stats["nonfinite"] else 0  # same on every rank
            if nonfinite_streak >= rg.MAX_NONFINITE_STEPS:
                raise run_folder.nonfinite_stop(nonfinite_streak, step, run.ckpt)

            # 3. publish the weights every k steps and at an evaluation (a server evaluates them: it waits for them,
            #    as the queue baseline's next requests do); on GPUs one gathered copy at a time: while the last is
            #    still going out, this step's is not gathered (the next publish sends newer weights)
            evaluating, waits = (
                reporting.is_eval_step(cfg, step),
                cfg.sampling == "queue" or reporting.is_eval_step(cfg, step),
            )
            t0 = time.perf_counter()
            publishing = step % cfg.publish_every == 0 or evaluating
            if publishing and run.route == "nccl" and waits and rank == 0:
                publisher.idle(failure=loop.failure)
            elif publishing and run.route == "nccl":
                publishing = rg.all_ranks(torch.tensor(rank != 0 or not publisher.sending, device=device))
            check = None  # every --publish-check k-th publish: the probe and the trainer's log-probs (collective)
            if publishing and cfg.publish_check and step % (cfg.publish_every * cfg.publish_check) == 0:
                check = (run.probes, trainer_logprobs(policy, run.probes, tok))
            if publishing:
                gathered = gather_weights(policy, run.dtype, run.publish_from)  # collective
                if rank == 0:
                    publisher.publish(gathered, step, wait=waits, failure=loop.failure, check=check)
                del gathered
            weights = full_weights(policy) if evaluating else None  # the checkpoint's fp32 (collective)
            evaluator = None
            if rank == 0 and evaluating and publisher.done_version == step:  # else the failure stops the next step
                evaluator = ServerEvaluator(servers[0], system.eos_ids, policy_version=step, seed=cfg.seed + step)
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
                    queue_depth=loop.depth(),
                    publish_seconds=publisher.seconds,
                    publishes=publisher.count,
                    publish_probe_diff=publisher.probe_diff,
                    mixed_version_rollouts=totals.get("mixed_version_rollouts", 0),
                    rollouts_per_rank=list(dealer.dealt),
                    wait_seconds=wait_seconds,
                    sync_seconds=sync_seconds,
                )
                fresh, step_tokens = [], 0
                evaluation = reporting.end_step(
                    cfg,
                    record,
                    batch,
                    tok,
                    run.task,
                    evaluator=evaluator,
                    runlog=system.runlog,
                    bar=system.bar,
                    verifiers=rg.VERIFIERS,
                )
                last_eval = evaluation or last_eval
                if evaluator is not None:
                    evaluator.close()
            if evaluating:
                state = {"step": step, "totals": totals, "dealing": dealer.state_dict(), "mode": "async", "trainers": T}
                save_async_checkpoint(
                    run.run_dir,
                    rank,
                    policy=policy,
                    optimizer=optimizer,
                    shard=shard,
                    weights=weights,
                    model=run.host_copy,
                    tok=tok,
                    state=state,
                )
        if rank == 0:
            system.bar.close()
            print_summary(totals, T, W)
        return {**last_eval, "run_dir": str(run.run_dir)}
    except ServerError as e:  # a server failed at setup (the loop's failures, PipelineErrors, say what is kept)
        raise ServerError(f"{e}; {run_folder.what_is_kept(run and run.run_dir)}") from None
    finally:
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
            try:
                system.stop()
            finally:
                signal.signal(signal.SIGTERM, old_sigterm)
        if system.runlog is not None:
            system.runlog.close()
        if owns_group:
            dist.destroy_process_group()


@dataclass
class Run:
    """What every rank holds from its setup on (rank 0 alone: host_copy, probed)."""

    run_name: str
    run_dir: Path
    ckpt: Path  # the run's checkpoint folder
    task: tasks.Task
    tok: object  # the policy's tokenizer
    warm: dict | None  # the warm start's record (a fresh run), else None
    route: str  # how the weights reach the servers: nccl or disk (weight_transfer)
    host_copy: object  # rank 0: the full policy on the host in the compute dtype (launch, checkpoint); else None
    policy: LogprobPolicy  # this rank's FSDP2 shard
    optimizer: torch.optim.Optimizer
    shard: rg.ReplayBuffer  # this rank's N/T of the buffer
    totals: dict  # rank 0's run totals (checkpointed)
    step: int
    dealer: Dealer
    dtype: torch.dtype  # the compute dtype the weights are published in
    publish_from: torch.device  # where a publish gathers them: the GPU (nccl) or the host (disk)
    probes: list  # the publish check's (prompt, completion) pairs
    probed: list  # rank 0: what reach found of each server given by URL
    first: dict | None  # the weights of the first publish (rank 0 sends them, then drops them)


def setup(cfg: AsyncArgs, rank: int, T: int, device: torch.device) -> Run:
    """Stage 0 on every rank: the servers given by URL probed (before anything is written), the run folder (rank 0
    creates it), the task and the policy (rank 0 first: it may write the warm-start cache), the memory plan, the
    policy sharded over the T ranks with its optimizer, a buffer shard each, a resume's state, the first weights."""
    check_sharding(cfg, T)
    probed = [reach(url.rstrip("/")) for url in cfg.generator_urls] if rank == 0 else []
    run_folder.seed_everything(cfg.seed)
    if rank == 0:
        kernels.report_precision(device)
    box = [run_folder.open_run(cfg, "async_pipeline.py") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    run_name, run_dir, ckpt = box[0]
    if rank == 0:  # first: it may write the warm-start cache that the others then read
        with generation.torch_threads(warm_start_threads(device)):
            task, model, tok, _, warm, state = loading.load_run(
                cfg, device, ckpt, T, rank, mode="async", verifiers=rg.VERIFIERS
            )
    barrier()
    if rank != 0:
        task, model, tok, _, warm, state = loading.load_run(
            cfg, device, ckpt, T, rank, mode="async", verifiers=rg.VERIFIERS
        )
    prompts, route = (task.longest_prompt, task.longest_eval_prompt), weight_transfer(cfg, device, T)
    layout = device_memory.Layout(cfg.num_generators, not cfg.generator_urls, route=route, asked=cfg.weight_transfer)
    # before sharding
    device_memory.check_memory_plan(cfg, model, prompts, device, trainers=T, rank=rank, layout=layout)
    kernels.checkpoint_layers(model, cfg.activation_checkpointing)  # each decoder layer, before fully_shard
    # rank 0's full copy on the host in the compute dtype, made before sharding: launched servers start from it,
    # and save_pretrained writes a checkpoint through it
    host_copy = kernels.cast_copy(model, kernels.compute_dtype(device), torch.device("cpu")) if rank == 0 else None
    policy = shard_policy(model, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=rg.learning_rate(cfg), weight_decay=0.0)
    shard = rg.make_buffer(cfg, capacity=cfg.buffer_size // T, seed=cfg.seed + 1_000_003 * rank)
    # rank 0's run totals and dealing state (checkpointed)
    totals = reporting.new_totals(gen_idle_seconds=0.0, trainer_idle_seconds=0.0, sync_seconds=0.0)
    step, dealing = 0, None
    if state is not None:
        step, dealing = resume_async(state, ckpt, rank, policy=policy, optimizer=optimizer, shard=shard, totals=totals)
    dtype = kernels.compute_dtype(device)
    publish_from = device if route == "nccl" else torch.device("cpu")  # the disk route writes from the host
    return Run(
        run_name=run_name,
        run_dir=run_dir,
        ckpt=ckpt,
        task=task,
        tok=tok,
        warm=warm,
        route=route,
        host_copy=host_copy,
        policy=policy,
        optimizer=optimizer,
        shard=shard,
        totals=totals,
        step=step,
        dealer=Dealer(cfg, T, dealing),
        dtype=dtype,
        publish_from=publish_from,
        probes=probe_pairs(task, tok),
        probed=probed,
        first=gather_weights(policy, dtype, publish_from),  # collective
    )


@dataclass
class System:
    """What rank 0 starts, and stops whatever happens: the servers, the rollout loop feeding from them, the
    publisher, the run's records and progress bar."""

    servers: list = dataclasses.field(default_factory=list)
    loop: RolloutLoop | None = None
    publisher: Publisher | None = None
    runlog: run_folder.RunLog | None = None
    bar: reporting.Progress | None = None
    eos_ids: list[int] | None = None

    def stop(self) -> None:
        """The loop's threads and the publisher's stopped, then the servers whatever happened (a second Ctrl-C
        included)."""
        try:
            if self.loop is not None:
                self.loop.close()
            if self.publisher is not None:
                self.publisher.close()
        finally:
            stop_servers(self.servers)


def start_system(cfg: AsyncArgs, run: Run, system: System, T: int, device: torch.device) -> dict:
    """Stage 0 on rank 0: the servers started (or those given checked), the run's records opened, the first weights
    published to every server, the first evaluation (a fresh run: its metrics, else {}), the rollout loop started.
    Fills `system` as it goes: what it started is stopped even if a later part fails."""
    signal.signal(signal.SIGTERM, _interrupt)
    host_copy, tok, task, B, N = run.host_copy, run.tok, run.task, cfg.batch_size, cfg.buffer_size
    servers = start_generators(cfg, run.run_dir, host_copy, tok, T=T, device=device, probed=run.probed)
    system.servers = servers
    for s in servers:  # the token ids the trainer can take: its embedding's rows and its head's outputs
        s.vocab = vocab_size(host_copy)
    seconds = wait_ready(servers) if cfg.generator_urls else None  # up already: before any record is written
    system.runlog = run_folder.RunLog(cfg, run.run_name, run.run_dir, run.step)
    print(f"run folder: {run.run_dir}")
    if seconds is None:
        seconds = wait_ready(servers)
    tied = bool(getattr(host_copy.config, "tie_word_embeddings", False))
    address = rendezvous_address(cfg)
    system.publisher = Publisher(
        servers, run.route, run.run_dir / "published", run.dtype, tied=tied, address=address, device=device
    )
    system.publisher.publish(run.first, run.step, wait=True)  # every server holds this policy before its first request
    system.eos_ids = generation.stop_token_ids(host_copy, tok)
    last_eval = {}
    if run.step == 0:  # on a server, before the rollouts' requests
        evaluator = ServerEvaluator(servers[0], system.eos_ids, policy_version=0, seed=cfg.seed)
        last_eval = reporting.first_evaluation(
            evaluator, tok, task, cfg, runlog=system.runlog, warm=run.warm, verifiers=rg.VERIFIERS, rule=rg.rules(cfg)
        )
    system.loop = RolloutLoop(cfg, servers, task, tok, system.eos_ids, first_group_id=run.dealer.next_group_id)
    print(
        f"async: W = {cfg.num_generators} vLLM server(s) ({', '.join(s.url for s in servers)}; ready in {seconds:.0f} "
        f"s), T = {T} trainer rank(s); requests of {cfg.rollouts_per_step} rollouts, batch B = {B} ({B // T}/rank), "
        f"buffer N = {N} ({N // T}/rank), {system.loop.capacity} requests in flight or waiting, weights by "
        f"{run.route} every {cfg.publish_every} step(s)"
    )
    system.bar = reporting.Progress(run.step, cfg.total_steps)
    return last_eval


class Dealer:
    """Rank 0: takes the servers' finished requests from the rollout loop, adds their counts to the run totals and
    deals their rollouts round-robin to the T ranks' shards (its state is checkpointed). With --sampling queue it
    takes only requests that every shard has room for, so the loop's slots fill and its threads wait."""

    def __init__(self, cfg: AsyncArgs, T: int, state: dict | None = None):
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

    def take(self, loop: RolloutLoop, totals: dict, step: int, wait: bool, failure: str | None) -> tuple:
        """Each rank's message (its rollouts, and why the run must stop or None), the new rollouts and the tokens
        generated; waits up to a second for a request if `wait` (a shard could not draw a batch)."""
        failure = failure or loop.failure()
        limit = None
        if self.room is not None:  # backpressure: only whole requests that every shard has room for
            limit = (self.room - max(self.held)) // self.share
        msgs = [] if failure else loop.receive(wait=1.0 if wait else 0, limit=limit)
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
            reporting.add_counts(totals, m["counters"])  # generated rollouts and tokens, verifier failures...
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


def throughput_mu_gamma(totals: dict, T: int, W: int) -> tuple[float, float]:
    """The paper's way (its App. D.4): mu as the throughput ratio (rollouts trained on / T) / (unique rollouts
    generated / W), exact when neither side idles, and the speed-up gamma = (1 + W/T) / (1 + mu) of the W/T split
    over alternating generation and training."""
    mu = (totals["trained_rollouts"] / T) / (totals["generated_rollouts"] / W)
    return mu, (1 + W / T) / (1 + mu)


def merge_stats(per_rank: list[dict]) -> dict:
    """The ranks' train_step metrics as the step's: token-weighted means; maxima; sums of counts; loss and
    grad norm as the mean over ranks (grad norm is already global: FSDP clips globally)."""
    tokens, out = [s["trained_tokens"] for s in per_rank], {}
    for k in dict.fromkeys(k for s in per_rank for k in s):
        vals = [(s[k], n) for s, n in zip(per_rank, tokens) if k in s]
        if k == "trained_tokens":
            out[k] = sum(tokens)
        elif k in ("ratio_max", "nonfinite", "zero_signal", "zero_signal_skipped"):
            out[k] = max(v for v, _ in vals)
        elif k in ("loss", "grad_norm"):
            out[k] = sum(v for v, _ in vals) / len(vals)
        elif k == "staleness_sums":  # bucket -> the ranks' rg.BucketSums added up
            out[k] = {}
            for v, _ in vals:
                for bucket, sums in v.items():
                    out[k][bucket] = out[k].get(bucket, rg.BucketSums()).plus(sums)
        else:
            out[k] = sum(v * n for v, n in vals) / sum(n for _, n in vals)
    return out


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
    reporting.count_step(totals, stats, batch_size=batch_size, train_seconds=train_seconds)
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
        evicted=sum((r["evicted"] for r in reports), Counter()),
        evicted_age=sum(r["evicted_age"] for r in reports),
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
    mu = reporting.measured_mu(totals, T)
    mu_throughput, gamma = throughput_mu_gamma(totals, T, W)
    print(
        f"measured mu = {mu:.2f} (busy seconds per rollout, generators / trainers); the paper's throughput ratio "
        f"(trained/T) / (generated/W) = {mu_throughput:.2f}, gamma = (1 + W/T)/(1 + mu) = {gamma:.2f}; idle "
        f"seconds: trainers {totals['trainer_idle_seconds']:.1f}, generators {totals['gen_idle_seconds']:.1f} "
        f"(of {totals['gen_seconds']:.1f} busy)"
    )


# ######## The system ends here. What it runs on: trainers, checkpoints, publisher, rollouts, servers, checks ########


# ===== FSDP2 trainers ============================================================================


class LogprobPolicy(torch.nn.Module):
    """A causal LM whose forward is completion_logprobs. Under FSDP2 (`fully_shard(LogprobPolicy(model))`)
    the embedding, the (tied) LM head and the final norm belong to this root module and are sharded
    DTensors except inside its forward, where FSDP all-gathers them: computing the log-probs here hands
    kernels.token_logprobs the full head weight, and FSDP reduce-scatters its gradient (to the tied
    embedding too). Reading the head outside this forward would hand the kernel a shard of it."""

    computes_logprobs = True  # kernels.completion_logprobs calls forward with its kernels.Packed ids

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.config = policy.config  # completion_logprobs reads its attention implementation

    def forward(self, packed, temperature, entropy):
        out = kernels.packed_logprobs(self.policy, packed, temperature, entropy=entropy)
        # fresh tensors, not views: FSDP hangs its pre-backward hook on the outputs
        return tuple(t.clone() for t in out) if entropy else out.clone()


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


def full_weights(policy) -> dict:
    """The full fp32 state dict on rank 0 (CPU, Hugging Face key names), {} elsewhere, for a checkpoint. Collective."""
    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("policy."): v for k, v in sd.items()}


def gather_weights(policy, dtype: torch.dtype, device: torch.device) -> dict:
    """What a publish sends: on rank 0 the full weights in `dtype` (the compute dtype) on `device` (the GPU for the
    nccl broadcast, the host for the disk), Hugging Face key names; {} elsewhere. Collective: each shard is cast
    before its all-gather, a tensor at a time, so a publish moves and holds bf16 on GPUs, not fp32. A tied head is
    gathered once (two names, one tensor)."""
    out, gathered, rank0 = {}, {}, dist.get_rank() == 0
    with torch.no_grad():
        for k, v in policy.state_dict(keep_vars=True).items():  # keep_vars: a tied head is one object under two names
            if id(v) not in gathered:
                mine = v.to(dtype, copy=True)  # never the live parameter: the publisher reads it while training goes on
                full = mine.full_tensor() if isinstance(mine, DTensor) else mine
                gathered[id(v)] = full.to(device) if rank0 else None  # the others' gathered copies go at once
            if rank0:
                out[k.removeprefix("policy.")] = gathered[id(v)]
    return out


def init_process_group(cfg: AsyncArgs) -> bool:
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


def check_sharding(cfg: AsyncArgs, T: int) -> None:
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
        threads, why = (
            max(1, cores // processes),
            f"{cores} cores / {processes} process{'es' * (processes != 1)} on this machine",
        )
        torch._C.set_num_threads(threads)  # torch._C: an in-process vLLM CPU worker patches torch.set_num_threads
    print(f"threads: {role} uses {threads} torch thread{'s' * (threads > 1)} ({why})", flush=True)
    return threads


def warm_start_threads(device: torch.device) -> int | None:
    """Rank 0's torch threads while it loads the run, which may train the warm start: the servers are not started
    yet, so on a CPU it takes this node's cores among its trainer ranks alone (None: unchanged)."""
    if device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    threads = max(1, available_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    print(f"threads: the warm start (if not cached) uses {threads} torch thread{'s' * (threads > 1)}", flush=True)
    return threads


def place_trainer(rank: int, W: int) -> tuple[torch.device, int]:
    """This rank's device, and its torch threads among the processes sharing this machine's cores: its trainer
    ranks, and the W servers rank 0 launches on its machine (returned: their number)."""
    local_trainers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    processes = local_trainers + (W if int(os.environ.get("GROUP_RANK", "0")) == 0 else 0)
    set_cpu_threads(f"trainer rank {rank}", processes)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, processes


def barrier() -> None:
    """dist.barrier on this rank's GPU under NCCL (without device_ids it may guess one and hang)."""
    dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # torchrun stops workers with SIGTERM: stop the servers too


def vocab_size(model) -> int:
    """The token ids `model` can take: fewer than both its input embedding's rows and its output head's rows."""
    heads = [m.weight.shape[0] for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    return min(heads)


# ===== Resume and checkpoint =====================================================================


def resume_async(
    state: dict, ckpt: Path, rank: int, policy, optimizer, shard: rg.ReplayBuffer, totals: dict
) -> tuple[int, dict]:
    """Load a checkpoint's optimizer state (collective), this rank's buffer shard and RNG, and rank 0's totals;
    returns the step and the dealing state."""
    load_optimizer_state(policy, optimizer, state.get("optimizer", {}))  # rank 0's; {} on the others
    own = run_folder.read_checkpoint_file(ckpt, f"buffer_rank{rank}.pt", run_folder.load_torch, ("buffer", "rng"))
    shard.load_state_dict(own["buffer"])
    run_folder.set_rng_state(own["rng"])
    totals.update(state["totals"])
    return state["step"], state["dealing"]


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
    own = {"buffer": shard.state_dict(), "rng": run_folder.rng_state()}
    torch.save(own, run_dir / "checkpoint.tmp" / f"buffer_rank{rank}.pt")
    barrier()
    if rank == 0:
        run_folder.swap_in_checkpoint(run_dir)


# ===== The publisher and the weight check ========================================================


def weight_transfer(cfg: AsyncArgs, device: torch.device, T: int) -> str:
    """--weight-transfer auto: NCCL when every server has a GPU of its own (NCCL refuses two ranks on one GPU), else
    the disk (on a CPU: vLLM 0.32's NCCL engine needs CUDA)."""
    if cfg.weight_transfer == "auto":
        own = bool(cfg.generator_urls) or cfg.num_generators + T <= torch.cuda.device_count()
        return "nccl" if device.type == "cuda" and own else "disk"
    if cfg.weight_transfer == "nccl" and device.type != "cuda":
        raise UserError("--weight-transfer nccl needs CUDA on the trainers (vLLM's NCCL engine): use disk on a CPU")
    return cfg.weight_transfer


def rendezvous_address(cfg: AsyncArgs) -> str:
    """Where servers reach rank 0's NCCL endpoint: --generator-host for servers launched here; for servers elsewhere
    this node's address on the route to the first of them (torchrun's MASTER_ADDR is 127.0.0.1 on one node)."""
    if not cfg.generator_urls:
        return cfg.generator_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a UDP connect picks the route and sends nothing
        s.connect((urllib.parse.urlsplit(cfg.generator_urls[0]).hostname, 9))
        return s.getsockname()[0]


class Metadata(list):
    """A WeightSource's list of ParamMeta, read as vLLM 0.32 reads it (`source.metadata()`) and as a property
    (`source.metadata`): calling it gives itself."""

    def __call__(self) -> Metadata:
        return self


class DictSource:
    """vLLM's WeightSource over the gathered weights (gather_weights: already in the compute dtype, on the device they
    are broadcast from; a tensor elsewhere moves there only as it is sent). Rank 0 holds every tensor whole, so its
    local tensors (iter_local) are the full ones (iter_full, and plain iteration)."""

    def __init__(self, weights: dict, dtype: torch.dtype, device: torch.device):
        from vllm.distributed.weight_transfer.base import ParamMeta

        self.weights, self.dtype, self.device = weights, dtype, device
        self.metadata = Metadata(ParamMeta(k, dtype, tuple(v.shape)) for k, v in weights.items())

    def __iter__(self):
        for k, v in self.weights.items():
            yield k, v.to(self.device, self.dtype, non_blocking=True)

    def iter_full(self):
        return iter(self)

    def iter_local(self):
        return iter(self)


class ServersClient:
    """vLLM's weight-sync client (its four-call VLLMWeightSyncClient protocol) for every server at once, so that one
    NCCL group holds the trainer (rank 0) and each server's workers from that server's rank offset on: a publish is one
    broadcast however many servers there are. Each call goes to every server together (their workers block in the
    group's rendezvous and in the broadcast until all have joined); a failure is the first server's ServerError."""

    def __init__(self, servers: list[Server], offsets: list[int], receive_bound: float):
        self.servers, self.offsets, self.receive_bound = servers, offsets, receive_bound

    def each(self, path: str, body=None, timeout=None) -> None:
        on_servers(self.servers, lambda s, i: s.post(path, body(i) if callable(body) else body, timeout))

    def init_weight_transfer_engine(self, init_info: dict) -> None:  # vLLM's payload, with each server's own offset
        self.each(
            "/init_weight_transfer_engine", lambda i: {"init_info": {**init_info, "rank_offset": self.offsets[i]}}
        )

    def start_weight_update(self) -> None:
        self.each("/start_weight_update")

    def update_weights(self, update_info: dict) -> None:  # returns once the broadcast is in every worker
        bound = max(self.receive_bound, *(s.control_bound() for s in self.servers))
        self.each("/update_weights", {"update_info": update_info}, bound)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.each("/finish_weight_update", {"weight_version": weight_version})


def nccl_world(servers: list[Server]) -> list[int]:
    """Each server's rank offset in the one group (after the trainer's rank 0), from its own parallel sizes
    (GET /get_world_size: tensor x pipeline x data parallel workers); one line for an answer that is not a size."""

    def size(answer: dict) -> int:
        n = answer["world_size"]
        if type(n) is not int or n < 1:
            raise ValueError(f"world_size {n!r} is not a number of workers")
        return n

    sizes = on_servers(servers, lambda s, i: s.post("/get_world_size", parse=size, method="GET"))
    return [1 + sum(sizes[:i]) for i in range(len(servers))] + [1 + sum(sizes)]


class Publisher:
    """Publishes the trainer's weights to every server on its own thread, so a step never waits for it (the queue
    baseline waits: `wait=True`). Weights waiting to go are replaced by newer ones. Every server pauses (keeping its
    requests), takes the weights, labels them with the version, and resumes; its in-flight requests come back with
    version spans.

    disk: rank 0 writes one safetensors file (the tied head written as lm_head.weight: a folder reload keeps the old
    head otherwise) under the run folder, a shared filesystem across nodes, and each server runs
    `reload_weights(weights_path=...)` through /collective_rpc. nccl: vLLM's trainer-side engine,
    `NCCLTrainerWeightTransferEngine.trainer_init` then `send_weights` (start_weight_update, update_weights during the
    broadcast, finish_weight_update), over one NCCL group of this rank and every server's workers (ServersClient):
    the weights go out once, from the device, in buckets (vLLM's packed broadcast), to all servers together."""

    def __init__(
        self, servers: list[Server], how: str, folder: Path, dtype: torch.dtype, tied: bool, address: str, device=None
    ):
        self.servers, self.how, self.folder, self.dtype, self.tied = servers, how, folder, dtype, tied
        self.device = device or torch.device("cuda")  # where nccl broadcasts from
        self.pending, self.cond, self.done_version, self.error = None, threading.Condition(), None, None
        self.sending = False  # weights handed over and not yet on every server
        self.seconds, self.count = 0.0, 0  # time spent publishing, publishes done
        self.probe_diff = None  # the last publish check's largest mean |served - trained| log-prob (check_served)
        self.engine, self.source = None, None
        if how == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )

            *offsets, world = nccl_world(servers)
            info = NCCLTrainerInitInfo(address, free_port(address), world_size=world, rank=0)
            client = ServersClient(servers, offsets, receive_bound=0.0)
            self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=self)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.thread = threading.Thread(target=self.run, name="publisher", daemon=True)
        self.thread.start()

    def publish(self, weights: dict, version: int, wait: bool = False, failure=lambda: None, check=None) -> None:
        """Hand the weights over; with `wait`, until every server holds them, a publish fails, a launched server
        dies or `failure()` says why the run stops (the dealer reports each). `check`: (the probe's pairs, the trainer's
        log-probs of them at `version`), which every server must then serve (check_served). On CUDA the copies may
        still be in the making on this thread's stream (the gather's casts and all-gathers are queued there): an event
        recorded on it now is waited for by the publisher thread before anything reads them (HandOver)."""
        ready = HandOver(self.device)
        with self.cond:
            self.pending = (dict(weights), version, check, ready)  # its own dict: save_pretrained empties the caller's
            self.sending = True
            self.cond.notify_all()
            while wait and not self.error and (self.done_version is None or self.done_version < version):
                if not self.cond.wait(1.0) and (failure() or any(s.died() for s in self.servers)):
                    return

    def idle(self, failure=lambda: None) -> None:
        """Until the publish under way is on every server (or fails, or `failure()` says why the run stops)."""
        with self.cond:
            while self.sending and not self.error:
                if not self.cond.wait(1.0) and (failure() or any(s.died() for s in self.servers)):
                    return

    def run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending is not None)
                (weights, version, check, ready), self.pending = self.pending, None
            t0 = time.perf_counter()
            try:
                ready.wait()  # vLLM's packed producer reads the copies on streams of its own, on this thread
                self.send(weights, version)
                del weights  # the copy sent is freed before the next is gathered (one at a time on the device)
                if check is not None:
                    diffs = on_daemons(lambda i: check_served(self.servers[i], *check, version), len(self.servers))
                    self.probe_diff = max(diffs)
            except Exception as e:
                with self.cond:
                    self.error = as_server_error("weight publish failed", e)
                    self.cond.notify_all()
                return
            with self.cond:
                self.seconds += time.perf_counter() - t0
                self.count, self.done_version, self.sending = self.count + 1, version, self.pending is not None
                self.cond.notify_all()

    def send(self, weights: dict, version: int) -> None:
        # keep: requests in flight stay, with their KV cache (clear_cache would recompute them, and with a per-request
        # seed the CPU runner then fails: "CPU Generator does not use offset"); their later tokens get the new weights
        self.each(lambda s: s.post("/pause?mode=keep&clear_cache=false"))
        if self.how == "disk":
            from safetensors.torch import save_file

            tensors, seen = {}, set()
            for k, v in weights.items():  # safetensors refuses two names on one storage (a tied head)
                v = v.to("cpu", self.dtype).contiguous()
                tensors[k] = v.clone() if v.data_ptr() in seen else v
                seen.add(v.data_ptr())
            if self.tied and "lm_head.weight" not in tensors:
                tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
            save_file(tensors, self.folder / "model.safetensors.tmp")
            os.replace(self.folder / "model.safetensors.tmp", self.folder / "model.safetensors")
            size = (self.folder / "model.safetensors").stat().st_size
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(self.folder)}}
            # the reload reads the file: its bound grows with its size
            self.each(lambda s: s.post("/collective_rpc", rpc, max(s.control_bound(), size / LOAD_BYTES_PER_SECOND)))
        else:  # one broadcast to every server
            self.source = DictSource(weights, self.dtype, self.device)
            self.engine.client.receive_bound = weights_bytes(weights, self.dtype) / LOAD_BYTES_PER_SECOND
            try:
                self.engine.send_weights()
            finally:
                self.source = None
        self.each(lambda s: (s.post("/update_weight_version", {"new_version": str(version)}), s.post("/resume")))

    def each(self, fn) -> None:
        on_servers(self.servers, lambda s, i: fn(s))

    # the nccl engine's WeightSource, the weights being sent: vLLM 0.32 calls metadata() and iterates it; metadata as
    # a property, iter_full() and iter_local() are there too (DictSource)
    @property
    def metadata(self) -> Metadata:
        return self.source.metadata

    def __iter__(self):
        return iter(self.source)

    def iter_full(self):
        return self.source.iter_full()

    def iter_local(self):
        return self.source.iter_local()

    def close(self, timeout: float = 60.0) -> None:
        """The nccl group, after the publish under way (a group shut down mid-broadcast leaves its peers waiting)."""
        with self.cond:
            self.cond.wait_for(lambda: self.engine is None or not self.sending or self.error, timeout=timeout)
        if self.engine is not None:
            self.engine.shutdown()


class HandOver:
    """Weights handed from the thread that made them to another: a CUDA event recorded on `device`'s current stream
    when made (what the making thread has queued there so far: the gather's casts and all-gathers), which `wait` waits
    for on the other thread. Off CUDA there is nothing to wait for (a copy to the host is done when it returns)."""

    def __init__(self, device: torch.device):
        self.device, self.event = device, None
        if device.type == "cuda" and torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def weights_bytes(weights: dict, dtype: torch.dtype) -> int:
    return sum(v.numel() for v in weights.values()) * dtype.itemsize


def probe_pairs(task: tasks.Task, tok) -> list[tuple[list[int], list[int]]]:
    """The publish check's probe: the first PROBE_PROMPTS held-out prompts and their gold solutions (token ids)."""
    probes = task.eval[:PROBE_PROMPTS]
    gold = [tok(ex.solution or ex.answer, add_special_tokens=False)["input_ids"] for ex in probes]
    return [(models.render_prompt(tok, ex.prompt, task.shots), ids) for ex, ids in zip(probes, gold)]


def check_served(server: Server, pairs: list, expected: list[torch.Tensor], version: int) -> float:
    """The mean |served - trained| log-prob of the probe's completion tokens (the server's prompt_logprobs of prompt
    + completion, at temperature 1; the trainer's at `version`); a ServerError naming both beyond PROBE_BOUND."""
    served, params = [], {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}
    for prompt, completion in pairs:

        def logprobs(answer: dict, prompt=prompt, completion=completion) -> list[float]:
            rows = answer["prompt_logprobs"][len(prompt) :]
            return [float(row[str(t)]["logprob"]) for row, t in zip(rows, completion, strict=True)]

        body = {"token_ids": prompt + completion, "sampling_params": params}
        served += server.post("/inference/v1/generate", body, parse=logprobs)
    diff = (torch.tensor(served) - torch.cat(expected).float().cpu()).abs().mean().item()
    if not diff <= PROBE_BOUND:  # NaN too
        raise ServerError(
            f"vLLM server {server.url} serves other weights than the trainer's version {version}: its log-probs of "
            f"the publish check's probe differ by {diff:.3g} per token on average (bound {PROBE_BOUND})"
        )
    return diff


@torch.no_grad()
def trainer_logprobs(policy, pairs: list, tok) -> list[torch.Tensor]:
    """The trainer's log-probs of `pairs` at temperature 1 (what a server holding its weights serves), per pair."""
    logp = kernels.completion_logprobs(policy, pairs, tok.pad_token_id, 1.0)
    if hasattr(policy, "reshard"):  # FSDP2 keeps the root unsharded after a forward until a backward: shard it back
        policy.reshard()
    return list(logp.float().cpu().split([len(c) for _, c in pairs]))


# ===== Rollouts over HTTP ========================================================================


class ServerGenerator:
    """rg.make_rollouts' generator on one server: `POST /inference/v1/generate` per prompt (token ids in and out, n
    samples, the sampled tokens' processed log-probs, a seed drawn from `rng`), the prompts in flight together so the
    server batches them. Each Sample carries the oldest and newest weight versions of its tokens."""

    def __init__(self, server: Server, eos_ids: list[int], rng: random.Random):
        self.server, self.eos_ids, self.rng = server, eos_ids, rng

    def generate(self, prompts: list, n: int, max_new_tokens: int, temperature: float, top_p: float = 1.0):
        params = dict(n=n, temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_new_tokens, logprobs=0)
        params |= dict(ignore_eos=True, stop_token_ids=self.eos_ids, detokenize=False)  # stop where HF stops
        bodies = [
            {"token_ids": list(p), "sampling_params": {**params, "seed": self.rng.getrandbits(31)}} for p in prompts
        ]
        timeout, t0 = self.server.bound(max_new_tokens), time.monotonic()
        answers = on_daemons(
            lambda i: self.server.post(
                GENERATE, bodies[i], timeout, parse=lambda a: self.samples(a, n, self.server.vocab)
            ),
            len(bodies),
        )
        self.server.answered(max_new_tokens, time.monotonic() - t0)
        return answers

    @classmethod
    def samples(cls, answer: dict, n: int, vocab: int = 0) -> list[generation.Sample]:
        """The `n` samples of one prompt's answer, in their order; ValueError (or KeyError...) for what is not, and
        WrongAnswer for values the trainer cannot take (token ids from `vocab` on, when given; log-probs that are not
        finite), which would stop its step (an IndexError) or skip it (a NaN loss) without naming the server."""
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise ValueError(f"{len(choices)} choices where {n} were asked for")
        return [cls.sample(c, vocab) for c in choices]

    @staticmethod
    def sample(choice: dict, vocab: int = 0) -> generation.Sample:
        ids = choice["token_ids"]
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ValueError("token_ids is not a list of integers")
        wrong = [t for t in ids if t < 0 or (vocab and t >= vocab)]
        if wrong:
            vocabulary = f"0 to {vocab - 1}" if vocab else "0 and above"
            raise WrongAnswer(
                f"choice {choice.get('index')}: token id {wrong[0]} is outside the trainer's vocabulary ({vocabulary})"
            )
        lp = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]], dtype=torch.float32)
        if len(lp) != len(ids):
            raise WrongAnswer(f"choice {choice.get('index')}: {len(ids)} token_ids but {len(lp)} log-probs")
        if not torch.isfinite(lp).all():
            at = int((~torch.isfinite(lp)).nonzero()[0])
            raise WrongAnswer(f"choice {choice.get('index')}: log-prob {lp[at].item()} of token {at} is not finite")
        versions = [int(span["version"]) for span in choice.get("weight_versions") or []]
        if not versions:  # without them no rollout could say which policy made it
            raise ValueError("no weight_versions spans: the run needs vLLM 0.32 or later on its servers")
        return generation.Sample(ids, lp, choice["finish_reason"] == "length", (min(versions), max(versions)))


class ServerEvaluator:
    """evaluation.evaluate's generator for async_pipeline.py: the held-out evaluation (greedy, pass@1, pass@k) as
    requests to a server holding the weights of `policy_version` (just published), beside the rollouts' requests, on
    its own seeds. An answer with a token of other weights is a ServerError: the record's version is the one
    evaluated."""

    def __init__(self, server: Server, eos_ids: list[int], policy_version: int, seed: int):
        self.generator = ServerGenerator(server, eos_ids, random.Random(seed))
        self.policy_version = policy_version

    def generate(self, prompts: list, n: int, max_new_tokens: int, temperature: float, top_p=1.0, logprobs=False):
        groups = self.generator.generate(prompts, n, max_new_tokens, temperature, top_p)
        versions = {v for group in groups for s in group for v in s.versions}
        if versions != {self.policy_version}:
            raise ServerError(
                f"vLLM server {self.generator.server.url}: the evaluation of version {self.policy_version} came back "
                f"from weights of version(s) {sorted(versions)}"
            )
        return groups

    def close(self) -> None:
        pass


def exit_with_parent(parent: int) -> None:
    """In a helper process: end it once `parent` is gone (a trainer ended by torchrun's SIGTERM never closes it, and
    it would hold the run's output pipes open)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class Scorer:
    """make_rollouts' scorer for the rollout threads: rewards computed in a process of their own, whose main thread
    holds the verifier's time limit (a SIGALRM, which a thread cannot set). One text per task, so that closing it
    waits for one verifier at most."""

    def __init__(self):
        spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(1, mp_context=spawn, initializer=exit_with_parent, initargs=(os.getpid(),))

    def __call__(self, verifier, texts: list[str], gold: str) -> list[tuple[float, str | None]]:
        return list(self.pool.map(tasks.score, [verifier] * len(texts), texts, [gold] * len(texts)))

    def close(self) -> None:  # waits: an executor thread left running races the interpreter's exit for its pipe
        self.pool.shutdown(wait=True, cancel_futures=True)


class RolloutLoop:
    """A thread per server running rg.make_rollouts request after request (rewards, advantages, behaviour log-probs
    frozen) while the trainers step. At most `capacity` requests are in flight or finished and waiting (a thread
    takes a slot before it starts one, the dealer frees it), so the capacity is the channel's real depth; receive
    hands out the freshest finished first, and one passed over `capacity` times before any other."""

    def __init__(self, cfg: AsyncArgs, servers: list[Server], task, tok, eos_ids: list[int], first_group_id: int):
        self.cfg, self.servers, self.task, self.tok, self.eos_ids = cfg, servers, task, tok, eos_ids
        W = len(servers)
        self.capacity = max(W, cfg.batch_size // cfg.rollouts_per_step) if cfg.sampling == "queue" else max(4, 2 * W)
        self.slots, self.ready, self.cond = threading.Semaphore(self.capacity), [], threading.Condition()
        self.stop, self.errors, self.next_group_id = threading.Event(), [], first_group_id
        self.scorer = Scorer()
        self.threads = [
            threading.Thread(target=self.run, args=(i, first_group_id), name=f"rollouts-{i}", daemon=True)
            for i in range(W)
        ]
        for t in self.threads:
            t.start()

    def run(self, index: int, first_group_id: int) -> None:
        cfg = self.cfg
        rng = random.Random(f"{cfg.seed}/{index}/{first_group_id}")  # its own prompts and seeds, per resume too
        generator = ServerGenerator(self.servers[index], self.eos_ids, rng)
        try:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                while not self.slots.acquire(timeout=0.5):  # the channel is full: the trainers are behind
                    if self.stop.is_set():
                        return
                t1 = time.perf_counter()
                with self.cond:
                    group_id = self.next_group_id
                    self.next_group_id += cfg.prompts_per_step
                examples = self.task.sample(rng, cfg.prompts_per_step)
                rollouts, counts = rg.make_rollouts(
                    generator, self.tok, self.task, examples, cfg, next_group_id=group_id, scorer=self.scorer
                )
                msg = {"rollouts": rollouts, "counters": dict(counts), "idle_seconds": t1 - t0}
                msg |= {"busy_seconds": time.perf_counter() - t1, "generator": index, "passed": 0}
                with self.cond:
                    self.ready.append(msg)
                    self.cond.notify_all()
        except Exception as e:  # the run stops on it (failure)
            with self.cond:
                self.errors.append(as_server_error(f"rollout thread {index}", e))
                self.cond.notify_all()

    def receive(self, wait: float, limit: int | None = None) -> list[dict]:
        """Finished requests (at most `limit`), the freshest first, waiting up to `wait` seconds for the first."""
        with self.cond:
            if not self.ready and wait > 0 and limit != 0:
                self.cond.wait_for(lambda: self.ready or self.errors, timeout=wait)
            # stable: the newest last, after it the overdue ones, the longest passed over last of all
            order = sorted(self.ready, key=lambda m: m["passed"] if m["passed"] >= self.capacity else -1)
            taken = order[len(order) - (len(order) if limit is None else min(limit, len(order))) :][::-1]
            self.ready = [m for m in self.ready if not any(m is t for t in taken)]
            for m in self.ready if taken else []:  # passed over only when another was taken
                m["passed"] += 1
        for _ in taken:
            self.slots.release()
        return taken

    def failure(self) -> str | None:
        """Why the run must stop (a server error or death, in one line), or None."""
        if self.errors:
            return str(self.errors[0])
        for s in self.servers:
            if s.died():
                return f"vLLM server {s.url} died{s.died()}"
        return None

    def depth(self) -> int:
        return len(self.ready)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=1.0)  # a thread blocked in a request is a daemon: it ends with the process
        self.scorer.close()


# ===== Checks and main ===========================================================================


def validate(cfg: AsyncArgs, argv: list[str] = ()) -> None:
    """flag_checks.validate, then the system's own flags and what the synchronous loop allows but this one cannot."""
    flag_checks.validate(cfg, argv)

    def need(ok, message):
        if not ok:
            raise UserError(message)

    for name, test, valid in (
        ("num_generators", lambda v: v >= 1, ">= 1"),
        ("num_generators", lambda v: v <= 256, "<= 256 (a process each)"),
        ("publish_check", lambda v: v >= 0, ">= 0"),
        ("dist_timeout", lambda v: v >= 1, ">= 1 (minutes a rank waits in a collective: 0 times out every one)"),
        ("dist_timeout", lambda v: v <= 525_600, "<= 525600 (a year of minutes)"),
    ):
        need(test(getattr(cfg, name)), f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be {valid}")
    urls, W = cfg.generator_urls, cfg.num_generators
    need(len(urls) in (0, W), f"--generator-urls lists {len(urls)} server(s) but --num-generators is {W}: give both")
    need(all(re.match("https?://", u) for u in urls), f"--generator-urls {urls}: each is http(s)://HOST:PORT")
    if not urls:  # the servers it launches listen there
        check_generator_host(cfg.generator_host)
    need(
        not any(a == "--generator" or a.startswith("--generator=") for a in argv),
        "--generator: async_pipeline.py generates on vLLM servers (--num-generators, --generator-urls)",
    )
    need(
        cfg.prox_lag == 0,
        f"--prox-lag {cfg.prox_lag}: only the synchronous loop (replay_grpo.py) keeps lagged weights: use 0 here",
    )
    need(
        cfg.sampling != "queue" or cfg.zero_variance_groups == "keep",
        "--sampling queue needs --zero-variance-groups keep here: requests thinned by dropped groups cannot fill "
        "the queue exactly",
    )


def parse_args(argv: list[str]) -> AsyncArgs:
    """--preset NAME (replay_grpo.PRESETS) picks the defaults; every other flag overrides them."""
    return rg.parse_args(argv, flags=AsyncArgs, description=__doc__)


def run_async(argv: list[str]) -> dict:
    cfg = parse_args(argv)
    validate(cfg, argv)
    run_folder.quiet_libraries(cfg.verbose)
    try:
        return train_async(cfg)
    except PipelineError as e:  # a generator died; every rank stops
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> dict | None:
    return reporting.run_command(run_async, argv)


if __name__ == "__main__":
    main()
