"""memory_plan.py: the memory plan of replay_grpo.py and async_pipeline.py for every GPU preset, offline (the models
built on the meta device from their shapes), for a device of a given size: the table each run prints before its first
step.

    python tools/memory_plan.py    # every GPU preset: sync on one 139.8 GiB H200, async (W, T) = (5, 3) on 8 x 80 GB
    python tools/memory_plan.py --device-gib 79.2 --trainers 3 --gpus 8 -- async_pipeline.py --preset math-qwen2.5-7b \
        --num-generators 5

The flags are replay_grpo.py's, or async_pipeline.py's after its name.

The longest training and evaluation prompt are taken as the preset's --max-prompt-tokens (a run uses the longest it
keeps, at most that; PROMPT_TOKENS without the flag), or, for --task reasoning-gym, whose problems are generated
offline, bounded from the task's own prompts (generated_prompt_bound); the compute dtype is bf16.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the method's modules live at the root

import torch

import kernels
import replay_grpo as rg
from infra import device_memory, run_folder, tasks

PROMPT_TOKENS = 512  # the longest prompt assumed where --max-prompt-tokens is not set
ASYNC = (5, 3, 8)  # the paper's headline (W, T) on one node of 8 GPUs
H200_GIB, H100_GIB = 139.8, 79.2  # what torch reports as total memory of an H200 and of an 80 GB H100
PRESET_MODELS = {  # the presets' models as their hub config.json describes them (not downloadable here)
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True)),
    "Qwen/Qwen3-0.6B": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                        tie_word_embeddings=True)),
    "Qwen/Qwen2.5-1.5B-Instruct": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True)),
    "Qwen/Qwen2.5-7B": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                        tie_word_embeddings=False)),
}  # fmt: skip
# Qwen2.5-Instruct's chat template around one user message, its default system prompt included: the longest of the
# PRESET_MODELS' templates (Qwen3's has no system prompt); each marker <|im_start|> and <|im_end|> is one token
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
QWEN_TURN = "<|im_start|>{}\n{}<|im_end|>\n"
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")


def generated_prompt_bound(cfg) -> tuple[int, int]:
    """The longest (training, evaluation) prompt of a reasoning-gym task in tokens, bounded from every prompt the
    run would generate (tasks.make_task, in Qwen2.5's chat template): the PRESET_MODELS' tokenizers are byte-level
    BPEs (no model is downloaded here), which spend at most one token per byte of text, a marker one token. A run
    measures its prompts with the model's own tokenizer (models.fit_to_context) and plans with those."""
    task = tasks.make_task(cfg)
    shots = "".join(QWEN_TURN.format(r, c) for q, a in task.shots for r, c in (("user", q), ("assistant", a)))

    def tokens(prompt: str) -> int:  # --rg-shots' turns, then the prompt
        text = QWEN_SYSTEM + shots + QWEN_TURN.format("user", prompt) + "<|im_start|>assistant\n"
        markers = sum(text.count(m) for m in CHAT_MARKERS)
        for m in CHAT_MARKERS:
            text = text.replace(m, "")
        return len(text.encode()) + markers

    return max(tokens(ex.prompt) for ex in task.train), max(tokens(ex.prompt) for ex in task.eval)


def meta_model(name: str):
    """The preset's model with its real shapes on the meta device (no memory, no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, shape = PRESET_MODELS[name]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **shape))


def plan(argv: list[str], device_gib: float, trainers: int = 1, gpus: int | None = None) -> list[dict]:
    """Print the plan of `argv` (replay_grpo.py flags, or async_pipeline.py and its flags) on a node of `gpus` GPUs
    (default: one each for the trainers and the servers) and return it; raises run_folder.UserError when it does not
    fit."""
    layout = device_memory.Layout()
    if argv[:1] == ["async_pipeline.py"]:
        import async_pipeline

        cfg = async_pipeline.parse_args(argv[1:])
        W = cfg.num_generators
        gpus = gpus or W + trainers
        # async_pipeline.weight_transfer's auto: nccl when every server has a GPU of its own
        own = bool(cfg.generator_urls) or W + trainers <= gpus
        route = cfg.weight_transfer if cfg.weight_transfer != "auto" else ("nccl" if own else "disk")
        layout = device_memory.Layout(W, not cfg.generator_urls, route=route, asked=cfg.weight_transfer)
    else:
        cfg = rg.parse_args(argv)
        gpus = gpus or trainers
    prompts = 2 * (cfg.max_prompt_tokens or PROMPT_TOKENS,)
    if cfg.task == "reasoning-gym":  # longer prompts than --max-prompt-tokens would be skipped
        prompts = tuple(min(n, cfg.max_prompt_tokens or n) for n in generated_prompt_bound(cfg))
    model, cpu = meta_model(cfg.model), torch.device("cpu")
    # the device's size and a bf16 GPU's dtype for this plan only: a caller in the same process (a test, then a
    # real fp32 run on the CPU) must not inherit them
    dtype = os.environ.get(kernels.COMPUTE_DTYPE_ENV, "bfloat16")  # a bf16 GPU's, unless the user set one
    with run_folder.environ({device_memory.DEVICE_GIB_ENV: str(device_gib), kernels.COMPUTE_DTYPE_ENV: dtype}):
        return device_memory.check_memory_plan(cfg, model, prompts, cpu, trainers, n_gpus=gpus, layout=layout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-gib", type=float, default=H200_GIB)
    ap.add_argument("--trainers", type=int, default=1, help="T, with async_pipeline.py and its flags")
    ap.add_argument("--gpus", type=int, default=None, help="the node's GPUs (default: W + T, each its own)")
    ap.add_argument(
        "flags",
        nargs="*",
        help="replay_grpo.py flags after -- (or async_pipeline.py and its flags); none: every GPU preset",
    )
    args = ap.parse_args()
    runs = [(args.flags, args.device_gib, args.trainers, args.gpus)]
    if not args.flags:
        W, T, gpus = ASYNC
        presets = [["--preset", p] for p in rg.PRESETS if rg.PRESETS[p].model in PRESET_MODELS]  # the GPU ones
        runs = [(argv, H200_GIB, 1, 1) for argv in presets]
        runs += [(["async_pipeline.py", *argv, "--num-generators", str(W)], H100_GIB, T, gpus) for argv in presets]
    for argv, device_gib, trainers, gpus in runs:
        print(f"\n{' '.join(argv)}, {trainers} trainer rank(s), {device_gib} GiB, {gpus or 'W + T'} GPU(s):")
        try:
            plan(argv, device_gib, trainers, gpus)
        except run_folder.UserError as e:
            print(f"refused: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
