"""evaluation.py: the held-out evaluation of a generator (greedy accuracy, pass@1, pass@k, a few completions as
samples), on forked random streams so that evaluating never changes training."""

from __future__ import annotations

import torch

from infra import run_folder
from infra.models import render_prompt
from infra.tasks import Task, score_texts

PASS_K_PROMPTS = 50  # held-out prompts for pass@k
SAMPLES = 4  # completions written to <run>/samples.jsonl at each evaluation (and every --sample-every steps)


@torch.no_grad()
def evaluate(
    generator,
    tok,
    task: Task,
    cfg,
    seed: int = 0,
    pass_k_only: bool = False,
    pass_k_prompts: int = PASS_K_PROMPTS,
    *,
    verifiers: dict,
) -> tuple[dict, list[dict]]:
    """Held-out accuracy: greedy, pass@1 at temperature 0.1 / top-p 0.95 (the paper's), pass@k with k samples at
    temperature 1 / top-p 0.95; and SAMPLES greedy completions as rows for samples.jsonl. On forked random
    streams: evaluating (or not) never changes training. `verifiers`: the reward functions by name (the method's
    VERIFIERS), the task's scoring the completions."""
    with run_folder.forked_rng(seed):
        verifier = verifiers[task.verifier]
        prompts = [render_prompt(tok, ex.prompt, task.shots) for ex in task.eval]

        def generate_and_score(n: int, temperature: float, top_p: float, count: int):
            """n completions of each of the first `count` held-out prompts, and their rewards (a list per prompt)."""
            groups = generator.generate(
                prompts[:count], n, cfg.max_new_tokens, temperature, top_p=top_p, logprobs=False
            )
            rewards = []
            for group, ex in zip(groups, task.eval):
                texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in group]
                rewards.append([r for r, _ in score_texts(verifier, texts, ex.answer)])
            return groups, rewards

        out, samples = {}, []
        if not pass_k_only:
            groups, greedy = generate_and_score(n=1, temperature=0.0, top_p=1.0, count=len(prompts))
            for ex, group, rewards in zip(task.eval[:SAMPLES], groups, greedy):
                completion = tok.decode(group[0].completion_ids, skip_special_tokens=True)
                row = dict(prompt=ex.prompt, gold=ex.answer, reward=rewards[0], completion=completion)
                samples.append({"source": "eval (greedy)", **row, "truncated": group[0].truncated})
            _, pass1 = generate_and_score(n=1, temperature=0.1, top_p=0.95, count=len(prompts))
            out["eval/policy_version"] = generator.policy_version  # the weights evaluated (a server's: published)
            out["eval/greedy_acc"] = sum(r[0] for r in greedy) / len(greedy)
            # a held-out question whose twin is trained on is half remembered
            untwinned = [r[0] for ex, r in zip(task.eval, greedy) if ex.prompt in (task.untwinned or ())]
            if untwinned:
                out["eval/greedy_acc_untwinned"] = sum(untwinned) / len(untwinned)
            out["eval/pass@1"] = sum(r[0] for r in pass1) / len(pass1)
        _, passk = generate_and_score(n=cfg.pass_k, temperature=1.0, top_p=0.95, count=pass_k_prompts)
        out[f"eval/pass@{cfg.pass_k}"] = sum(max(g) for g in passk) / len(passk)
        out["eval/acc_t1"] = sum(sum(g) / len(g) for g in passk) / len(passk)
        return out, samples
