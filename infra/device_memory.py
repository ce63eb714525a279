"""device_memory.py: the memory plan, a train step's bytes on each trainer's device, estimated before the first step and
checked against the device (both loops; tools/memory_plan.py prints the GPU presets' plans offline)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import torch

import kernels
from infra.run_folder import UserError

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
    """The launched vLLM servers on GPU `gpu` of this node: serving.server_gpus's round-robin after the
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
    else:  # a server sharing this GPU takes its --vllm-gpu-memory-utilization of it (serving.start_generators)
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
