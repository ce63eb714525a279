"""memory_plan.py: the memory plan of replay_grpo.py for every GPU preset, offline (the models built on the meta
device from their shapes), for a device of a given size: the table each run prints before its first step.

    python tools/memory_plan.py                               # every GPU preset, one 139.8 GiB H200
    python tools/memory_plan.py --device-gib 79.2 --trainers 3 -- --preset math-qwen2.5-7b --mode async

The longest prompt is taken as PROMPT_TOKENS (a run uses its task's longest); the compute dtype is bf16.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the method's modules live at the root

import torch

import kernels
import replay_grpo as rg

PROMPT_TOKENS = 512  # the longest prompt assumed for every preset (MATH and GSM8K prompts are mostly shorter)
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


def meta_model(name: str):
    """The preset's model with its real shapes on the meta device (no memory, no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, shape = PRESET_MODELS[name]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **shape))


def plan(argv: list[str], device_gib: float, trainers: int = 1) -> dict:
    """Print the plan of `argv` (replay_grpo.py flags) and return it; raises rg.UserError when it does not fit."""
    cfg = rg.parse_args(argv)
    os.environ[kernels.DEVICE_GIB_ENV] = str(device_gib)
    os.environ.setdefault(kernels.COMPUTE_DTYPE_ENV, "bfloat16")  # a bf16 GPU's
    return kernels.check_memory_plan(cfg, meta_model(cfg.model), PROMPT_TOKENS, torch.device("cpu"), trainers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-gib", type=float, default=H200_GIB)
    ap.add_argument("--trainers", type=int, default=1, help="T, with --mode async among the flags")
    ap.add_argument("flags", nargs="*", help="replay_grpo.py flags after --; none: every GPU preset")
    args = ap.parse_args()
    runs = [args.flags] if args.flags else [["--preset", p] for p in rg.PRESETS if rg.PRESETS[p].model != "tiny"]
    for argv in runs:
        print(f"\n{' '.join(argv)}, {args.trainers} trainer rank(s), {args.device_gib} GiB:")
        try:
            plan(argv, args.device_gib, args.trainers)
        except rg.UserError as e:
            print(f"refused: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
