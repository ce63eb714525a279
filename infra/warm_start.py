"""warm_start.py: the supervised warm start that both entries run before RL when --sft-warmup-steps > 0, and its
cache.

A model built in code knows nothing, and RL from it earns no reward. Teacher forcing on gold solutions
gives it the skill; with a demonstrator that is wrong by one in --arith-demo-error of the solutions, it
also gets a systematic error that RL has to unlearn, as an LLM before RL has (greedy accuracy low,
pass@k high). The warm start stops once held-out pass@k reaches --sft-target (checked every CHECK_EVERY
steps), so every seed starts RL with the skill; at most --sft-warmup-steps steps. Or, with --sft-lr-decay and
no target, it takes all its steps with the learning rate decaying linearly to 0, so that every seed settles on
what it imitates (a run of noisy pass@k checks stops each seed at another point). With --sft-imitation it ends on
a check of that: the share of held-out problems whose greedy answer is the demonstrator's most frequent one (the
gold + 1 when it errs more often than not); while the share falls short, up to SKILL_ROUNDS more rounds of half
the steps, from half the lr (a seed whose warm start has not settled on the demonstrator's answer, from which RL
gains less, is trained on instead of handed to RL). Its result is cached in
<out-dir>/.warmstart/<key>, the key hashing every flag that can change it, and shared by every run
(configuration, learning rate) of the same seed.
"""

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import pickle
import random
import shutil
import sys
import time
from pathlib import Path

import torch

import kernels
from infra import evaluation, generation, models, reporting, run_folder, tasks
from infra.run_folder import UserError

BATCH_SIZE = 128  # examples per supervised step
CHECK_EVERY = 100  # steps between two checks of --sft-target
SKILL_ROUNDS = 1  # --sft-imitation: at most this many more rounds of training while the check falls short
SKILL_ROUND_STEPS = 0.5  # a round's steps, as a share of --sft-warmup-steps
SKILL_ROUND_LR = 0.5  # a round's starting lr, as a share of --sft-lr (decaying to 0 with --sft-lr-decay)
STREAMS = "rng_state.pt"  # in a cache: the random streams' state at the warm start's end (run_folder.rng_state)
CACHE_FILES = ("warmstart.json", STREAMS, "config.json", "tokenizer_config.json", "model.safetensors")
# The flags the warm start reads (the task and its held-out split, the base model, the supervised schedule and its
# pass@k checks, the seed): its cache key. A flag outside it must not change the warm start (a test checks that).
WARM_START_FLAGS = (
    "task",
    "model",
    "data_path",
    "eval_size",
    "max_new_tokens",
    "arith_terms",
    "arith_max_operand",
    "arith_demo_error",
    "sft_warmup_steps",
    "sft_target",
    "sft_patience",
    "sft_check_prompts",
    "sft_lr",
    "sft_lr_decay",
    "sft_imitation",
    "seed",
    "pass_k",
)


def warm_start_key(cfg, device: torch.device) -> str:
    """The flags the warm start reads, and the compute dtype it trains in (a CPU's fp32 warm start is another model
    than a GPU's bf16 one)."""
    fields = {k: getattr(cfg, k) for k in WARM_START_FLAGS}
    if cfg.task == "reasoning-gym":  # its problems and prompts (other tasks' keys stay as they were)
        fields.update(
            rg_dataset=cfg.rg_dataset, rg_config=cfg.rg_config, rg_shots=cfg.rg_shots, rg_credit=cfg.rg_credit
        )
    fields["compute_dtype"] = str(kernels.compute_dtype(device))
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def supervised_warm_start(model, tok, task: tasks.Task, cfg, *, verifiers: dict) -> dict:
    """Teacher forcing on gold solutions (at --sft-lr, decaying with --sft-lr-decay) until held-out pass@k reaches
    --sft-target, if set; then, with --sft-imitation, SKILL_ROUNDS more rounds while the held-out greedy answers
    fall short of the demonstrator's (scored by `verifiers`, the reward functions by name). Returns what it reached."""
    rng = random.Random(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    info = {"steps": 0, "target": cfg.sft_target, "pass@k": None, "k": cfg.pass_k, "imitation": []}
    # its weights are loaded at each check
    checker = generation.HFGenerator(model, tok) if cfg.sft_target or cfg.sft_imitation else None
    streak = 0  # checks in a row at the target
    since, since_step = time.perf_counter(), 0  # without a terminal: a progress line at least this often
    model.train()

    @functools.cache  # a few thousand distinct problems, drawn again and again: each tokenized once
    def encode(prompt: str, solution: str) -> tuple[list[int], list[int]]:
        solution_ids = tok(solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return models.render_prompt(tok, prompt, task.shots), solution_ids

    def train_steps(steps: int, lr: float):
        """`steps` supervised steps at `lr` (decaying linearly to lr / steps with --sft-lr-decay), one at a time."""
        nonlocal since, since_step
        last = info["steps"] + steps
        for done in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * (1 - done / steps) if cfg.sft_lr_decay else lr
            seqs = [encode(ex.prompt, ex.solution) for ex in task.sample(rng, BATCH_SIZE)]
            # unshared: a batch of problems drawn one by one, not groups, and the cache key holds no --share-prompts
            loss = -kernels.completion_logprobs(model, seqs, tok.pad_token_id, 1.0, share_prompts=False).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            info["steps"] += 1
            seconds = time.perf_counter() - since
            if not sys.stdout.isatty() and seconds >= reporting.PROGRESS_SECONDS:
                print(
                    f"warm start: step {info['steps']}/{last}, loss {loss.item():.3f}, "
                    f"{seconds / (info['steps'] - since_step):.2f} s/step",
                    flush=True,
                )
                since, since_step = time.perf_counter(), info["steps"]
            yield info["steps"]

    for step in train_steps(cfg.sft_warmup_steps, cfg.sft_lr):
        if cfg.sft_target and (step % CHECK_EVERY == 0 or step == cfg.sft_warmup_steps):
            checker.load_weights(model.state_dict(), step)
            check, _ = evaluation.evaluate(
                checker,
                tok,
                task,
                cfg,
                seed=cfg.seed + step,
                pass_k_only=True,
                pass_k_prompts=cfg.sft_check_prompts,
                verifiers=verifiers,
            )
            model.train()
            info["pass@k"] = check[f"eval/pass@{cfg.pass_k}"]
            streak = streak + 1 if info["pass@k"] >= cfg.sft_target else 0
            print(
                f"warm start: step {step}, held-out pass@{cfg.pass_k} {info['pass@k']:.3f} (target {cfg.sft_target}"
                f", {streak} of {cfg.sft_patience} checks in a row)",
                flush=True,
            )
            if streak >= cfg.sft_patience:
                break
    info["reached"] = not cfg.sft_target or streak >= cfg.sft_patience
    for round_ in range(SKILL_ROUNDS + 1 if cfg.sft_imitation else 0):
        checker.load_weights(model.state_dict(), info["steps"])
        info["imitation"].append(imitation(checker, tok, task, cfg, verifiers=verifiers))
        model.train()
        print(
            f"warm start: step {info['steps']}, held-out greedy answers that are the demonstrator's: "
            f"{info['imitation'][-1]:.3f} (--sft-imitation {cfg.sft_imitation})",
            flush=True,
        )
        if info["imitation"][-1] >= cfg.sft_imitation or round_ == SKILL_ROUNDS:
            break
        for _ in train_steps(int(SKILL_ROUND_STEPS * cfg.sft_warmup_steps), SKILL_ROUND_LR * cfg.sft_lr):
            pass
    return info


def imitation(generator, tok, task: tasks.Task, cfg, *, verifiers: dict) -> float:
    """The share of held-out problems whose greedy answer is the one the demonstrator gives most often: the gold + 1
    when the arith task's --arith-demo-error is above 0.5, else the gold. On forked random streams, as an
    evaluation: checking changes no later draw."""
    verifier = verifiers[task.verifier]
    with run_folder.forked_rng(cfg.seed):
        prompts = [models.render_prompt(tok, ex.prompt, task.shots) for ex in task.eval]
        groups = generator.generate(prompts, 1, cfg.max_new_tokens, 0.0, logprobs=False)
    hits = 0
    for group, ex in zip(groups, task.eval):
        text = tok.decode(group[0].completion_ids, skip_special_tokens=True)
        usual = str(int(ex.answer) + 1) if cfg.task == "arith" and cfg.arith_demo_error > 0.5 else ex.answer
        hits += tasks.score(verifier, text, usual)[0]
    return hits / len(task.eval)


def load_or_train(cfg, device: torch.device, task: tasks.Task, *, verifiers: dict):
    """The warm-started policy, its tokenizer, its cache folder and the warm start's record: from the cache,
    or trained from --model and cached. Either way the random streams leave here as a cold start leaves them
    (the cache holds their state at the warm start's end): a run's records depend on its flags and seed only. A
    damaged cache is trained again and replaced, said in one line."""
    root = Path(cfg.out_dir) / run_folder.WARM_START_FOLDER
    cache = root / warm_start_key(cfg, device)
    before = run_folder.rng_state()  # a cold start's streams, which a retrained warm start draws from
    remove_leftovers(root)
    try:
        return read_cache(cache, device)
    except DamagedCache:
        pass  # absent, damaged, or being replaced by another process: look again holding its lock
    with cache_lock(root, cache.name):
        try:
            return read_cache(cache, device)
        except DamagedCache as e:
            if e.args == (f"{STREAMS} is missing",):  # written by an older version, or cut
                print(f"warm start: the cache {cache} holds no random-stream state ({STREAMS}): training it again")
            elif e.args:  # absent says nothing
                print(f"warm start: the cache {cache} is damaged ({e}): training it again to replace it", flush=True)
        run_folder.set_rng_state(before)
        train_and_cache(cfg, device, task, cache, verifiers=verifiers)
        return read_cache(cache, device)  # the loaded copy: a run computes alike whether it trained the cache or not


class DamagedCache(Exception):
    """A warm-start cache folder that is absent (no argument), or a file in it that cannot be used (its name, why)."""


def read_part(cache: Path, name: str, read):
    """read(cache / name), or DamagedCache naming the file and its error."""
    try:
        return read(cache / name)
    except pickle.UnpicklingError as e:  # run_folder.load_torch's refusal of what is not plain data
        raise DamagedCache(f"{name}: it {run_folder.not_plain_data(e)}") from None
    except Exception as e:  # json's, torch's, safetensors' and transformers' errors for a damaged file share no base
        raise DamagedCache(f"{name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}") from None


def warm_start_record(info):
    """warmstart.json's content, if it is a warm start's record (what first_evaluation logs of it)."""
    number = (int, float, type(None))
    if not isinstance(info, dict) or not (
        isinstance(info.get("steps"), int)
        and isinstance(info.get("reached"), bool)
        and isinstance(info.get("pass@k"), number)
    ):
        raise ValueError("not a warm start's record (steps, pass@k, reached)")
    return info


def read_cache(cache: Path, device: torch.device):
    """The cached policy (fp32 masters on `device`), its tokenizer, folder and record, with the random streams set
    as the warm start left them; DamagedCache when the folder is absent or a file in it is missing or damaged."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not cache.is_dir():
        raise DamagedCache()
    for name in CACHE_FILES:
        if not (cache / name).is_file():
            raise DamagedCache(f"{name} is missing")

    def load_weights(path: Path):
        model, loading = AutoModelForCausalLM.from_pretrained(
            cache, config=config, dtype=torch.float32, output_loading_info=True
        )
        if loading["missing_keys"] or loading["mismatched_keys"]:
            raise ValueError(f"tensors missing or of another shape: {sorted(loading['missing_keys'])[:3]}")
        return model

    info = read_part(
        cache, "warmstart.json", lambda path: warm_start_record(run_folder.read_json(path.read_text(), str(path)))
    )
    streams = read_part(cache, STREAMS, run_folder.load_torch)
    config = read_part(cache, "config.json", lambda _: AutoConfig.from_pretrained(cache))
    tok = read_part(cache, "tokenizer_config.json", lambda _: AutoTokenizer.from_pretrained(cache))
    model = read_part(cache, "model.safetensors", load_weights)
    read_part(cache, STREAMS, lambda _: run_folder.set_rng_state(streams))
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    return model.to(device), tok, str(cache), info


@contextlib.contextmanager
def cache_lock(root: Path, key: str, wait: bool = True):
    """Hold <root>/<key>.lock (fcntl.flock, released by the OS when the process dies) while the cache <key> is
    read, trained and written: a second process waits for the first's cache instead of training it too.
    wait=False: BlockingIOError when another process holds it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"cannot write the warm-start cache {root} ({e.strerror or e}): check --out-dir") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise
            print(f"warm start: another process is writing {root / key}; waiting for it", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_leftovers(root: Path) -> None:
    """Remove the temporary folders (<key>.tmp<pid>) of processes killed while writing a cache: a writer holds
    <key>.lock while its folder exists, so a folder whose lock is free is a leftover."""
    for tmp in sorted(root.glob("*.tmp*")):
        try:
            with cache_lock(root, tmp.name.split(".tmp")[0], wait=False):
                shutil.rmtree(tmp)
        except (OSError, UserError):  # its writer is alive (BlockingIOError), or the folder is read-only
            continue
        print(f"warm start: removed {tmp}, left by a process killed while writing the cache", flush=True)


def train_and_cache(cfg, device: torch.device, task: tasks.Task, cache: Path, *, verifiers: dict):
    """The warm start trained from --model, written to `cache` whole (a temporary folder, renamed) with the random
    streams' state at its end. The caller holds the cache's lock."""
    model, tok = models.load_base_policy(cfg, device)
    t0, info = time.time(), supervised_warm_start(model, tok, task, cfg, verifiers=verifiers)
    streams = run_folder.rng_state()  # at the warm start's end: a run that loads the cache goes on from here
    info["seconds"], info["threads"] = round(time.time() - t0, 1), torch.get_num_threads()  # what it trained with
    info["machine"] = run_folder.machine()  # a cache made elsewhere holds that machine's rounding
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")  # written whole, then renamed: readers never see half
    try:
        models.export_plain_folder(model, tok, str(tmp))
        torch.save(streams, tmp / STREAMS)
        (tmp / "warmstart.json").write_text(json.dumps(info))
    except Exception as e:
        full = run_folder.disk_full(e, cache.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if not full:
            raise
        raise UserError(
            f"disk full: the warm start could not be cached in {cache.parent}: free some space and "
            "run again (it is trained again)"
        ) from None
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)
    print(
        f"warm start: {info['steps']} supervised steps in {info['seconds']:.1f}s, pass@{cfg.pass_k} {info['pass@k']} "
        f"-> {cache}"
    )
    if not info["reached"]:
        print(
            f"warning: the warm start stopped at pass@{cfg.pass_k} {info['pass@k']:.3f} after {info['steps']} steps, "
            f"below --sft-target {cfg.sft_target}: raise --sft-warmup-steps"
        )
    if cfg.sft_imitation and info["imitation"][-1] < cfg.sft_imitation:
        print(
            f"warning: after {info['steps']} steps the warm start's held-out greedy answers are the demonstrator's "
            f"on {info['imitation'][-1]:.3f} of the problems, below --sft-imitation {cfg.sft_imitation}: raise "
            "--sft-warmup-steps"
        )
    return model, tok, str(cache), info
