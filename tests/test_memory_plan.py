"""The memory plan (device_memory.plan_memory, printed and checked before the first step) against measurement on this
CPU, --activation-checkpointing, and the GPU presets' plans on simulated devices (REPLAY_GRPO_DEVICE_GIB, a test
hook)."""

import ast
import copy
import dataclasses
import importlib.util
import os
import random
import re
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

import memory_plan

import async_pipeline as ap
import kernels
import replay_grpo as rg
from infra import device_memory, flag_checks, models, run_folder, serving, tasks

ARGS = ["--preset", "cpu", "--sft-warmup-steps", "0", "--group-size", "4", "--prompts-per-step", "2"]
ARGS += ["--batch-size", "8", "--buffer-size", "16", "--max-new-tokens", "4", "--eval-size", "8", "--pass-k", "2"]
ARGS += ["--total-steps", "2", "--eval-every", "0", "--loss", "asymre", "--lr", "1e-3"]
WIDTHS = {"tiny": {}, "Qwen2.5-0.5B width": dict(hidden_size=896, layers=2, vocab_size=151936)}  # 14 heads of 64


def batch(n=6, prompt=10, completion=40, seed=0):
    """Rollouts of n x (prompt + completion) tokens (300 in all: no weight of these models has a dimension of 300)."""
    rng = random.Random(seed)
    return [
        rg.Rollout(
            [rng.randrange(1, 250) for _ in range(prompt)],
            [rng.randrange(1, 250) for _ in range(completion)],
            torch.zeros(completion),
            reward=float(i % 2),
            advantage=rng.uniform(-1, 1),
            group_mean=0.5,
            policy_version=0,
            group_id=i,
        )
        for i in range(n)
    ]


def saved_bytes(model, rollouts) -> int:
    """What autograd saves for the backward of the log-probs' forward, parameters and their casts left out (those
    are the plan's states and compute copies): each storage once."""
    shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and tuple(t.shape) not in shapes:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    pairs = [(r.prompt_ids, r.completion_ids) for r in rollouts]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kernels.completion_logprobs(model, pairs, 0, 1.0, entropy=True)
    return sum(seen.values())


@pytest.mark.parametrize("width", WIDTHS)
def test_parameter_gradient_and_adam_bytes_are_exact(width):
    model, tok = models.build_tiny_model(0, **WIDTHS[width])
    cfg = rg.parse_args(ARGS + ["--micro-batch-size", "3"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    fresh = []  # each gradient autograd makes before adding it to .grad
    hooks = [p.register_hook(lambda g: fresh.append(g.nbytes)) for p in model.parameters()]
    rg.train_step(model, opt, batch(), cfg, tok.pad_token_id, version=0)
    for hook in hooks:
        hook.remove()
    rows = device_memory.plan_memory(model, cfg, 10, device_total=2**40, compute_bytes=4)["rows"]
    assert rows[device_memory.FRESH_GRADIENT_ROW] == max(fresh)
    assert rows["fp32 masters"] == sum(p.nbytes for p in model.parameters())
    assert rows["fp32 gradients"] == sum(p.grad.nbytes for p in model.parameters())
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert rows["Adam moments (fp32)"] == sum(t.nbytes for t in moments)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("width", WIDTHS)
def test_activation_bytes_are_what_autograd_saves_within_25_percent(width, dtype, monkeypatch):
    """The estimate from the model's config against the tensors autograd keeps for the backward, in the GPU's
    compute dtype (bf16, simulated) and in fp32."""
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, dtype)
    model, _ = models.build_tiny_model(0, **WIDTHS[width])
    measured = saved_bytes(model.train(), batch())
    estimate = device_memory.activation_bytes(model.config, 300, compute_bytes=2 if dtype == "bfloat16" else 4)
    assert abs(estimate / measured - 1) < 0.25, (estimate, measured)


def test_activation_checkpointing_gives_the_same_loss_and_gradients_from_fewer_saved_bytes():
    """fp32 on this CPU: each decoder layer checkpointed (non-reentrant) recomputes exactly what it dropped."""
    model, tok = models.build_tiny_model(0, layers=3)
    cfg = rg.parse_args(ARGS + ["--micro-batch-size", "3"])
    runs = {}
    for ac in (False, True):
        m = copy.deepcopy(model).train()
        kernels.checkpoint_layers(m, ac)
        stats = rg.train_step(m, torch.optim.SGD(m.parameters(), lr=0.0), batch(), cfg, tok.pad_token_id, version=0)
        runs[ac] = stats["loss"], {n: p.grad.clone() for n, p in m.named_parameters()}, saved_bytes(m, batch())
    (loss, grads, saved), (loss_ac, grads_ac, saved_ac) = runs[False], runs[True]
    assert abs(loss - loss_ac) <= 1e-6 and max((grads[n] - g).abs().max().item() for n, g in grads_ac.items()) <= 1e-6
    est = [device_memory.activation_bytes(model.config, 300, compute_bytes=4, checkpointing=ac) for ac in (False, True)]
    assert saved_ac < 0.7 * saved and est[1] < 0.7 * est[0], (saved, saved_ac, est)


def test_shared_prompts_are_planned_once_a_group_within_25_percent_of_what_autograd_saves():
    """On-policy (groups whole in the batch), micro-batches of 8 rollouts, G = 4: two 100-token prompts forwarded
    once each, with their 8 completions of 10 tokens; the plan's activations and mask against the tensors autograd
    keeps, and against the unshared plan (--no-share-prompts): the prompts' activations are counted once."""
    model, _ = models.build_tiny_model(0)
    flags = ["--group-size", "4", "--prompts-per-step", "2", "--batch-size", "8", "--buffer-size", "8"]
    cfg = rg.parse_args(flags + ["--micro-batch-size", "8", "--max-new-tokens", "10"])
    rollouts = batch(n=8, prompt=100, completion=10)
    for i, r in enumerate(rollouts):
        r.prompt_ids = rollouts[i % 2].prompt_ids
    measured = saved_bytes(model.train(), rollouts)
    rows = device_memory.plan_memory(model, cfg, 100, device_total=2**40, compute_bytes=4)["rows"]
    tokens = 2 * 99 + 8 * 11
    estimate = rows[f"activations ({tokens} tokens)"] + rows[device_memory.SHARED_MASK_ROW]
    assert abs(estimate / measured - 1) < 0.25, (estimate, measured)
    unshared = device_memory.plan_memory(model, dataclasses.replace(cfg, share_prompts=False), 100, 2**40, 4)["rows"]
    assert unshared[f"activations ({8 * 110} tokens)"] > 2 * estimate and device_memory.SHARED_MASK_ROW not in unshared
    replay = device_memory.plan_memory(model, dataclasses.replace(cfg, buffer_size=32), 100, 2**40, 4)["rows"]
    assert f"activations ({8 * 110} tokens)" in replay  # a replay batch may hold a rollout of each of 8 groups


@pytest.mark.parametrize("preset", ["gsm8k-qwen2.5-0.5b", "math-qwen3-0.6b", "math-qwen2.5-1.5b"])
def test_the_small_gpu_presets_fit_one_h200_beside_the_engine(preset, capsys, monkeypatch):
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    plans = memory_plan.plan(["--preset", preset], memory_plan.H200_GIB)
    gib = memory_plan.H200_GIB * 2**30
    assert plans[0]["peak"] <= gib and plans[0]["rows"]["generator (resident)"] == int(0.3 * gib)
    assert "memory plan per trainer rank" in capsys.readouterr().out


def test_a_plan_leaves_the_process_computing_in_its_own_dtype(monkeypatch, capsys):
    """The plan is made for a bf16 GPU of a given size; a run in the same process afterwards (on this CPU: fp32)
    must not inherit either, or its generation and log-probs silently change precision."""
    for name in (kernels.COMPUTE_DTYPE_ENV, device_memory.DEVICE_GIB_ENV):
        monkeypatch.delenv(name, raising=False)
    before = kernels.compute_dtype(torch.device("cpu"))
    memory_plan.plan(["--preset", "gsm8k-qwen2.5-0.5b"], memory_plan.H200_GIB)
    assert "memory plan per trainer rank" in capsys.readouterr().out
    assert kernels.compute_dtype(torch.device("cpu")) == before == torch.float32
    assert kernels.COMPUTE_DTYPE_ENV not in os.environ and device_memory.DEVICE_GIB_ENV not in os.environ
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "float32")  # a value set by the user is kept, and restored
    memory_plan.plan(["--preset", "gsm8k-qwen2.5-0.5b"], memory_plan.H200_GIB)
    assert os.environ[kernels.COMPUTE_DTYPE_ENV] == "float32" and device_memory.DEVICE_GIB_ENV not in os.environ


def test_the_7b_preset_is_refused_in_sync_mode_with_the_torchrun_command(monkeypatch):
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    with pytest.raises(run_folder.UserError) as refused:
        memory_plan.plan(["--preset", "math-qwen2.5-7b"], memory_plan.H200_GIB)
    message = str(refused.value)
    assert "\n" not in message and "torchrun --standalone --nproc_per_node" in message, message
    assert "async_pipeline.py --preset math-qwen2.5-7b --num-generators 1" in message, message


README_7B = ["async_pipeline.py", "--preset", "math-qwen2.5-7b", "--num-generators", "5"]
README_7B += ["--batch-size", "60", "--buffer-size", "84", "--prompts-per-step", "1"]
EVALUATION = "evaluation (copy + KV cache)"


def test_the_readmes_7b_async_command_fits_80_gb_ranks_at_the_presets_prompt_bound(capsys, monkeypatch):
    """torchrun --nproc_per_node 3 async_pipeline.py --preset math-qwen2.5-7b --num-generators 5 ...: W + T = 8 GPUs
    of 80 GB, every MATH prompt the run keeps at most --max-prompt-tokens 1024 (training and evaluation alike), the
    weights to the servers by NCCL (each server has a GPU of its own)."""
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    assert ap.parse_args(README_7B[1:]).max_prompt_tokens == 1024
    plans = memory_plan.plan(README_7B, memory_plan.H100_GIB, trainers=3, gpus=8)
    assert max(p["peak"] for p in plans) <= memory_plan.H100_GIB * 2**30
    assert [p["prompt_tokens"] for p in plans] == [(1024, 1024)] * 3 and plans[0]["route"] == "nccl"
    assert device_memory.PUBLISHER_ROW in plans[0]["rows"] and "activations (8192 tokens)" in plans[0]["rows"]
    out = capsys.readouterr().out
    assert "longest prompt 1024 tokens in training, 1024 in evaluation; weights to the servers by nccl" in out, out
    with pytest.raises(run_folder.UserError, match="it fits with --activation-checkpointing$"):  # the preset's setting
        memory_plan.plan(README_7B + ["--no-activation-checkpointing"], memory_plan.H100_GIB, trainers=3, gpus=8)


def kv_bytes_per_token(model, cfg, c: int) -> int:
    """The evaluation's KV cache per token of a sequence: pass@k's 50 prompts x k sequences x layers x 2 (k and v)."""
    config = model.config
    kv = config.num_key_value_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    return 50 * cfg.pass_k * config.num_hidden_layers * 2 * kv * c


def test_the_sync_evaluators_kv_cache_follows_the_longest_evaluation_prompt():
    """A lagging generator (--publish-every 2) evaluates on an HF copy: its KV cache is sized from the held-out
    prompts, the step's activations from the training ones."""
    cfg = rg.parse_args(["--preset", "gsm8k-qwen2.5-0.5b", "--publish-every", "2"])
    model = memory_plan.meta_model(cfg.model)

    def plan(train, evaluation):
        return device_memory.plan_memory(model, cfg, (train, evaluation), device_total=80 * 2**30, compute_bytes=2)

    short, long_eval, long_train = plan(100, 100), plan(100, 1100), plan(1100, 100)
    assert long_eval["rows"][EVALUATION] - short["rows"][EVALUATION] == 1000 * kv_bytes_per_token(model, cfg, 2)
    assert long_eval["train"] == short["train"] and long_eval["prompt_tokens"] == (100, 1100)
    assert long_train["rows"][EVALUATION] == short["rows"][EVALUATION] and long_train["train"] > short["train"]


def test_async_rank_0_holds_no_evaluator_since_a_server_evaluates():
    cfg = ap.parse_args(README_7B[1:])
    model = memory_plan.meta_model(cfg.model)
    servers = device_memory.Layout(servers=5)
    plans = [
        device_memory.plan_memory(model, cfg, 1024, 80 * 2**30, 2, trainers=3, rank=r, layout=servers) for r in range(3)
    ]
    assert all(p["rows"][EVALUATION] == 0 for p in plans)
    rows = plans[0]["rows"]
    after = rows["fp32 masters"] + rows["Adam moments (fp32)"] + rows[device_memory.RESERVE_ROW]
    assert plans[0]["evaluation"] == after < plans[0]["train"]


def test_the_nccl_publisher_is_planned_on_rank_0_only_and_only_for_nccl():
    cfg = ap.parse_args(README_7B[1:])
    model = memory_plan.meta_model(cfg.model)
    P = sum(p.numel() for p in model.parameters())

    def plans(route):
        kw = dict(
            device_total=80 * 2**30, compute_bytes=2, trainers=3, n_gpus=8, layout=device_memory.Layout(5, route=route)
        )
        return [device_memory.plan_memory(model, cfg, 1024, rank=r, **kw) for r in range(3)]

    nccl, disk = plans("nccl"), plans("disk")
    # bf16 gather + buffers
    assert nccl[0]["rows"][device_memory.PUBLISHER_ROW] == 2 * P + device_memory.PACKED_BROADCAST_BYTES
    assert all(device_memory.PUBLISHER_ROW not in p["rows"] for p in nccl[1:] + disk)
    extra = nccl[0]["rows"][device_memory.RESERVE_ROW] - disk[0]["rows"][device_memory.RESERVE_ROW]
    assert extra == 5 * device_memory.NCCL_COMMUNICATOR_BYTES  # a communicator per server
    assert nccl[1]["rows"] == disk[1]["rows"]


def test_the_packed_broadcast_buffers_are_vllms_own():
    """device_memory.PACKED_BROADCAST_BYTES against the installed vLLM's defaults, read from its source (not
    imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed")
    path = Path(spec.origin).parent / "distributed" / "weight_transfer" / "packed_tensor.py"
    names = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "").startswith("DEFAULT_PACKED_"):
            names[node.targets[0].id] = eval(compile(ast.Expression(node.value), str(path), "eval"))
    packed = names["DEFAULT_PACKED_BUFFER_SIZE_BYTES"] * names["DEFAULT_PACKED_NUM_BUFFERS"]
    assert device_memory.PACKED_BROADCAST_BYTES == packed


def test_a_server_sharing_a_trainers_gpu_is_counted_on_that_ranks_device(capsys, monkeypatch):
    """(W, T) = (3, 3) on 4 GPUs: serving.server_gpus puts the servers on GPUs 3, 0 and 1, each with its
    --vllm-gpu-memory-utilization of the device; ranks 0 and 1 hold one, rank 2 none."""
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv = ["async_pipeline.py", "--preset", "math-qwen2.5-7b", "--num-generators", "3"]
    plans = memory_plan.plan(argv, memory_plan.H100_GIB, trainers=3, gpus=4)
    gpus = serving.server_gpus(3, 3, 4)
    share = int(0.3 * memory_plan.H100_GIB * 2**30)
    assert [p["rows"]["generator (resident)"] for p in plans] == [gpus.count(str(r)) * share for r in range(3)]
    assert gpus.count("0") == gpus.count("1") == 1 and plans[2]["rows"]["generator (resident)"] == 0
    assert plans[0]["route"] == "disk"  # a shared GPU: NCCL refuses two ranks on one device
    header = next(line for line in capsys.readouterr().out.splitlines() if "rank 0" in line)
    assert header.split() == ["rank", "0", "rank", "1", "rank", "2"], header


def advised_layout(message: str, W: int, T: int) -> tuple[int, int]:
    """(servers, trainer ranks) of a refusal's advice; those not named are the run's."""
    t = re.search(r"--nproc_per_node (\d+)", message)
    w = re.search(r"--num-generators (\d+)", message)
    return (int(w[1]) if w else W), (int(t[1]) if t else T)


@pytest.mark.parametrize("W,T,gib", [(5, 3, 65.0), (4, 3, 60.0), (5, 4, 60.0)])
def test_the_advice_never_puts_a_server_on_a_trainers_gpu(W, T, gib, monkeypatch):
    """On 8 GPUs: a layout too big for its devices (5 + 3 and 4 + 3 on smaller ones), and one whose fifth server
    shares rank 0's GPU (5 + 4); the layout advised keeps every server on a GPU of its own."""
    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv = ["async_pipeline.py", "--preset", "math-qwen2.5-7b", "--num-generators", str(W)]
    with pytest.raises(run_folder.UserError) as refused:
        memory_plan.plan(argv, gib, trainers=T, gpus=8)
    message = str(refused.value)
    w, t = advised_layout(message, W, T)
    assert "fits" in message and not set(serving.server_gpus(w, t, 8)) & {str(r) for r in range(t)}, message
    advised = ["async_pipeline.py", "--preset", "math-qwen2.5-7b", "--num-generators", str(w)]
    for flag in ("--micro-batch-size", "--activation-checkpointing"):
        advised += re.findall(rf"{flag}(?: \d+)?", message)
    memory_plan.plan([a for f in advised for a in f.split()], gib, trainers=t, gpus=8)  # and it fits


def test_prompts_longer_than_max_prompt_tokens_are_skipped_counted_and_bound_the_plan(capsys):
    tok = models.byte_tokenizer()
    model, _ = models.build_tiny_model(0)
    train = [tasks.Example("1+" * n + "1=", str(n + 1)) for n in (2, 5, 20, 30)]
    held_out = [tasks.Example("2+" * n + "2=", str(2 * n + 2)) for n in (3, 25)]
    lengths = {ex.prompt: len(models.render_prompt(tok, ex.prompt)) for ex in train + held_out}
    bound = lengths[train[1].prompt] + 1  # between the second prompt and the third
    assert bound < lengths[held_out[1].prompt] and lengths[held_out[0].prompt] <= bound
    cfg = rg.parse_args(["--preset", "cpu", "--max-prompt-tokens", str(bound)])
    task = tasks.Task("rows", draw=None, eval=list(held_out), verifier="numeric", train=list(train))
    models.fit_to_context(cfg, task, tok, model)
    assert task.train == train[:2] and task.eval == held_out[:1]
    assert (task.longest_prompt, task.longest_eval_prompt) == (lengths[train[1].prompt], lengths[held_out[0].prompt])
    out = capsys.readouterr().out
    assert f"prompts longer than --max-prompt-tokens {bound} are skipped: 1 eval, 2 train" in out, out
    unbounded = tasks.Task("rows", draw=None, eval=list(held_out), verifier="numeric", train=list(train))
    models.fit_to_context(rg.parse_args(["--preset", "cpu"]), unbounded, tok, model)  # the context alone keeps all
    assert unbounded.train == train and unbounded.longest_eval_prompt == lengths[held_out[1].prompt]
    with pytest.raises(run_folder.UserError, match="^--max-prompt-tokens 0: must be >= 1$"):
        flag_checks.validate(rg.parse_args(["--preset", "cpu", "--max-prompt-tokens", "0"]))


def test_a_run_that_cannot_fit_is_refused_before_its_first_step_naming_the_flag(tmp_path, capsys, monkeypatch):
    """Through main(): the plan is printed, and a device too small for the activations (simulated) refuses the run
    in one line naming --activation-checkpointing, before any step; with it, the same device runs."""
    model, _ = models.build_tiny_model(0)
    cfg = rg.parse_args(ARGS)
    task = tasks.make_task(cfg)
    longest = max(len(models.render_prompt(models.byte_tokenizer(), ex.prompt)) for ex in task.eval)
    plan = device_memory.plan_memory(model, cfg, longest, device_total=2**30, compute_bytes=4)
    activations = next(v for k, v in plan["rows"].items() if k.startswith("activations"))
    monkeypatch.setenv(device_memory.DEVICE_GIB_ENV, str((plan["peak"] - activations / 4) / 2**30))
    argv = ARGS + ["--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as refused:
        rg.main(argv + ["--run-name", "big"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and "memory plan per trainer rank" in out and "step 0 eval" not in out
    assert err.strip().count("\n") == 0 and err.strip().endswith("it fits with --activation-checkpointing"), err
    rg.main(argv + ["--run-name", "ok", "--activation-checkpointing"])
    assert "step 0 eval" in capsys.readouterr().out


def test_the_log_prob_workspace_row_is_what_the_triton_backward_allocates_for_the_micro_batch():
    """The dz buffer [tokens x Vs] in the compute dtype and the fp32 dH [tokens x d] of kernels._backward_triton, for
    the micro-batch's tokens: past 256 MiB once 4 x tokens x d outgrows the buffer's budget (the 7B preset's
    micro-batch of 4 x (4096 + 1024) tokens at d = 3584)."""
    cfg = ap.parse_args(README_7B[1:])
    model = memory_plan.meta_model(cfg.model)
    plan = device_memory.plan_memory(
        model, cfg, 4096, 80 * 2**30, 2, trainers=8, layout=device_memory.Layout(servers=5)
    )
    tokens, h, V = cfg.micro_batch_size * (4096 + cfg.max_new_tokens), model.config.hidden_size, model.config.vocab_size
    Vs = kernels.vocab_split(tokens, h, V, 2)
    assert plan["rows"]["log-prob workspace"] == tokens * Vs * 2 + 4 * tokens * h > 2**28
