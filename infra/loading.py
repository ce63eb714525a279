"""loading.py: a run's start, for both loops: its task and its policy, fresh (--model as it is, or its cached
supervised warm start) or resumed from the run folder's checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from infra import run_folder, warm_start
from infra.models import fit_to_context, load_base_policy, load_pretrained
from infra.run_folder import UserError
from infra.tasks import Task, make_task


class LoadedRun(NamedTuple):
    """A run as load_run starts it."""

    task: Task
    model: torch.nn.Module  # the policy: fp32 masters on the run's device
    tok: object  # its tokenizer
    model_dir: str  # where its weights live: a folder (the warm start's cache, the checkpoint) or --model
    warm: dict | None  # the warm start's record, logged at step 0 (None: no warm start, or a resume)
    state: dict | None  # the checkpoint's trainer state (None: a fresh run)


def load_policy(cfg, device: torch.device, task: Task, *, verifiers: dict):
    """The policy, its tokenizer, where its weights live (a folder, or --model) and the warm start's record: with
    --sft-warmup-steps, the cached supervised warm start (warm_start.py; its checks scored by `verifiers`, the reward
    functions by name), else --model as it is and None."""
    if cfg.sft_warmup_steps > 0:
        return warm_start.load_or_train(cfg, device, task, verifiers=verifiers)
    model, tok = load_base_policy(cfg, device)
    return model, tok, cfg.model, None


def load_run(
    cfg, device: torch.device, ckpt: Path, trainers: int = 1, rank: int = 0, mode: str = "sync", *, verifiers: dict
) -> LoadedRun:
    """The task, the policy, its tokenizer and folder, the warm start's record and the trainer state. On --resume
    the policy and tokenizer are the checkpoint's (the base model and the warm start are not loaded again) and
    the warm start's record, logged at step 0 only, is None. The optimizer state is read on rank 0 only (at 7B it
    is ~60 GB: the other ranks get it by broadcast). mode: the loop resuming it, sync or async (async_pipeline.py);
    `verifiers`: the reward functions by name, for the warm start's checks."""
    task = make_task(cfg)
    if task.repeats and rank == 0:
        where = cfg.data_path or f"--rg-dataset {cfg.rg_dataset}"
        print(f"{where}: {task.repeats} training row(s) repeat a held-out prompt: left out of training")
    if not cfg.resume:
        model, tok, model_dir, warm = load_policy(cfg, device, task, verifiers=verifiers)
        fit_to_context(cfg, task, tok, model, rank)
        return LoadedRun(task=task, model=model, tok=tok, model_dir=model_dir, warm=warm, state=None)

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
    return LoadedRun(task=task, model=model.to(device), tok=tok, model_dir=str(ckpt), warm=None, state=state)
