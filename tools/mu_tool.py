"""mu_tool.py: mu (seconds to generate a rollout / seconds to train on it) at forced completion lengths, with HF
`generate` and the trainer's own train step, and what the replay planner (`replay_grpo.py plan`) then chooses.

    python tools/mu_tool.py                       # CUDA: Qwen2.5-0.5B's and SmolLM2-135M's shapes, 16-1024 tokens
    python tools/mu_tool.py --tiny --lengths 4,8  # a CPU: the same code at toy sizes (the tests run this)

The models are built in code with the real models' shapes (random weights: the cost of a token does not depend on
the weights; no hub access). Per length L: a batch of rollouts of a fixed prompt and exactly L sampled tokens
(min_new_tokens = max_new_tokens = L, HF generate with its KV cache, on a compute-dtype copy of the weights as the
trainer's HF generator holds), then replay_grpo.train_step on those rollouts (forward, backward through the fused
log-probs, AdamW step, under the run's precision policy). mu = generation seconds / training seconds for the same
rollouts. HF generate is slower than vLLM's engine, so this mu is an upper bound on the mu a vLLM run measures.
The planner's inputs other than mu are `plan`'s defaults (alpha 0.1, rho 0.1, B = 60, G = 16).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

import torch  # noqa: E402

import kernels  # noqa: E402
import replay_grpo as rg  # noqa: E402

SHAPES = {  # the published configs' shapes (config.json of each model), vocabulary included
    "qwen2.5-0.5b": dict(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6,
    ),
    "smollm2-135m": dict(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=1e5,
    ),
}  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1)
TINY.update(num_key_value_heads=1, head_dim=64)
PLAN = dict(alpha=0.1, rho=0.1, batch=60, group_size=16)  # replay_grpo.PlanArgs' defaults


def build(name, tiny, device):
    """A causal LM with `name`'s shape (TINY's sizes with --tiny), random weights, fp32 masters on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    if tiny:
        shape.update(TINY)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**shape, tie_word_embeddings=True, max_position_embeddings=4096, pad_token_id=0)
    config.eos_token_id = config.bos_token_id = 1
    torch.manual_seed(0)
    return model_cls(config).to(device)


def measure(model, length, batch, prompt_len, device, cfg):
    """(generation seconds, training seconds) of `batch` rollouts of exactly `length` new tokens."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen_model = kernels.cast_copy(model, kernels.compute_dtype(device))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(2, vocab, (batch, prompt_len), generator=g).to(device)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = gen_model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            max_new_tokens=length,
            min_new_tokens=length,
            use_cache=True,
            pad_token_id=0,
        )
    sync()
    gen_s = time.perf_counter() - t0
    del gen_model
    completions = out[:, prompt_len:].tolist()
    assert all(len(c) == length for c in completions)
    rollouts = []
    for i, c in enumerate(completions):
        rollouts.append(
            rg.Rollout(
                prompt_ids=prompt[i].tolist(),
                completion_ids=c,
                behaviour_logprobs=torch.zeros(length),
                reward=float(i % 2),
                advantage=(-1.0) ** i,
                group_mean=0.5,
                policy_version=0,
                group_id=i,
            )
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    sync()
    t0 = time.perf_counter()
    with kernels.autocast(device):
        rg.train_step(model, opt, rollouts, cfg, pad_id=0, version=0)
    sync()
    train_s = time.perf_counter() - t0
    del opt
    return gen_s, train_s


def plan_for(mu) -> dict:
    """What `replay_grpo.py plan --mu MU` chooses with plan's other defaults."""
    s = rg.suggest_schedule(mu, PLAN["alpha"], PLAN["rho"], PLAN["batch"], PLAN["group_size"])
    return {k: s[k] for k in ("B/R", "N/R", "R", "N", "B", "prompts_per_step", "on_policy")}


def write(out, result, what) -> None:
    """mu.json and mu.md as they stand."""
    (out / "mu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# mu on {what}", "", "| model | new tokens | gen s | train s | mu | plan |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "mu" not in r:
            lines.append(f"| {r['model']} | {r['new_tokens']} | skipped: {r['skipped']} | | | |")
            continue
        p = r["plan"]
        plan = "on-policy" if p["on_policy"] else f"B {p['B']}, N {p['N']}, R {p['R']}"
        lines.append(
            f"| {r['model']} | {r['new_tokens']} | {r['gen_s']:.3f} | {r['train_s']:.3f} | {r['mu']:.2f} | {plan} |"
        )
    (out / "mu.md").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,smollm2-135m", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--lengths", default="16,128,512,1024", help="new tokens per rollout, comma-separated")
    ap.add_argument("--batch", type=int, default=16, help="rollouts generated and trained together (16)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (64)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (hidden 64, 2 layers, vocab 512): a CPU")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds: later rows are skipped (600)")
    ap.add_argument("--out", help="write mu.json and mu.md here")
    args = ap.parse_args()
    start = time.monotonic()

    def fail(msg):
        print(f"mu_tool.py: {msg}", file=sys.stderr)
        sys.exit(2)

    models = args.models.split(",")
    if unknown := [m for m in models if m not in SHAPES]:
        fail(f"--models: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        lengths = [0]
    if not all(1 <= n <= 4096 for n in lengths):
        fail(f"--lengths {args.lengths!r}: give comma-separated integers from 1 to 4096")
    if not (1 <= args.batch <= 4096 and 1 <= args.prompt_len <= 4096):
        fail("--batch and --prompt-len: integers from 1 to 4096")
    if not (0 < args.deadline <= 86400):
        fail(f"--deadline {args.deadline}: seconds above 0, at most 86400")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = rg.Args(micro_batch_size=args.batch)
    what = f"{device.type}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
    print(
        f"mu on {what}, torch {torch.__version__}, {kernels.compute_dtype(device)} compute, batch {args.batch}, "
        f"prompt {args.prompt_len} tokens{', tiny sizes' if args.tiny else ''}; HF generate: an upper bound on "
        f"vLLM's mu",
        flush=True,
    )
    print(
        f"{'model':14} {'new tokens':>10} {'gen s':>8} {'train s':>8} {'mu':>7}  plan (alpha 0.1, rho 0.1, B 60, G 16)"
    )
    out = Path(args.out) if args.out else None
    if out:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"--out {out}: cannot create it ({e.strerror or e})")
    result = {"device": what, "torch": torch.__version__, "tiny": args.tiny, "plan_inputs": PLAN, "rows": []}
    built, last = {}, {}  # each model built once; its last row's (length, seconds) to foresee the next
    for name in models:
        built[name] = build(name, args.tiny, device)
        built[name].train()
        warm = rg.Args(micro_batch_size=2)
        measure(
            built[name], 2, min(args.batch, 2), prompt_len=8, device=device, cfg=warm
        )  # warm-up: kernels, allocator
    for n in lengths:  # the short lengths of every model first: a deadline cuts the longest
        for name in models:
            row = {"model": name, "new_tokens": n, "batch": args.batch, "prompt_len": args.prompt_len}
            left = args.deadline - (time.monotonic() - start)
            foreseen = last[name][1] * n / last[name][0] if name in last else 0.0
            if left < foreseen:
                row["skipped"] = f"deadline ({left:.0f} s left, about {foreseen:.0f} s needed)"
                print(f"{name:14} {n:10d}   skipped: {row['skipped']}", flush=True)
            else:
                t0 = time.monotonic()
                gen_s, train_s = measure(built[name], n, args.batch, prompt_len=args.prompt_len, device=device, cfg=cfg)
                last[name] = (n, time.monotonic() - t0)
                mu = gen_s / train_s
                row.update(gen_s=gen_s, train_s=train_s, mu=mu, plan=plan_for(mu))
                p = row["plan"]
                choice = (
                    "on-policy" if p["on_policy"] else f"replay B/R {p['B'] / p['R']:.2f}"
                ) + f": --batch-size {p['B']} --buffer-size {p['N']} --prompts-per-step {p['prompts_per_step']}"
                print(f"{name:14} {n:10d} {gen_s:8.3f} {train_s:8.3f} {mu:7.2f}  {choice}", flush=True)
            result["rows"].append(row)
            if out:  # after each row: a later failure or a kill loses nothing measured
                write(out, result, what)
    rows = result["rows"]
    return 0 if all(math.isfinite(r.get("mu", 0)) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
