"""--correction: each stale-data correction's loss and gradient against its formula written out here by hand (on
small tensors, and through train_step on the tiny model), its masks on hand-made cases, the proximal policy of
--prox-lag, the per-age diagnostics, and a resumed run that matches an uninterrupted one."""

import dataclasses
import math

import pytest
import torch

import kernels
import replay_grpo as rg
from infra import models
from test_replay_grpo import metrics, small_args

CFG = dataclasses.replace(rg.PRESETS["cpu"], sft_warmup_steps=0)


def cfg(**kw):
    return dataclasses.replace(CFG, **kw)


# --- the weights and masks, on tensors small enough to check by hand ------------------------------------------


def test_tis_truncates_the_weight_of_the_trained_policy_to_the_behaviour_at_the_cap():
    behaviour = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    logp = torch.log(torch.tensor([0.5, 0.75, 2.0]))  # weights 1, 1.5, 4
    anchor, weight, corrected = rg.correction_terms(
        cfg(correction="tis", tis_cap=2.0), logp, behaviour, torch.ones(3), torch.tensor([3]), proximal=logp
    )
    assert torch.equal(anchor, logp) and weight.tolist() == pytest.approx([1.0, 1.5, 2.0])
    assert corrected.tolist() == [False, False, True]


def test_seq_mask_drops_whole_sequences_whose_geometric_mean_weight_leaves_the_bounds():
    behaviour = torch.zeros(5)
    # sequence 1: log weights 0.005, -0.005 (geometric mean 1: kept); sequence 2: 0.02 each (e^0.02 > 1.01: masked)
    proximal = torch.tensor([0.005, -0.005, 0.02, 0.02, 0.02])
    _, weight, corrected = rg.correction_terms(
        cfg(correction="seq-mask"), proximal, behaviour, torch.ones(5), torch.tensor([2, 3]), proximal=proximal
    )
    assert weight.tolist() == [1, 1, 0, 0, 0] and corrected.tolist() == [False, False, True, True, True]


def test_decoupled_masks_the_tokens_whose_weight_exceeds_the_cap_and_keeps_the_weight_elsewhere():
    behaviour = torch.zeros(3)
    proximal = torch.log(torch.tensor([0.5, 4.0, 6.0]))
    _, weight, corrected = rg.correction_terms(
        cfg(correction="decoupled"), proximal, behaviour, torch.ones(3), torch.tensor([3]), proximal=proximal
    )
    assert weight.tolist() == pytest.approx([0.5, 4.0, 0.0]) and corrected.tolist() == [False, False, True]


def m2po_by_hand(log_r: list[float], adv: list[float], tau: float) -> list[bool]:
    """Algorithm 1 of the M2PO paper, one token at a time: drop the trust-region token of largest (log r)^2 while
    the trust-region tokens left have a mean (log r)^2 above tau."""
    trust = [i for i, (lr, a) in enumerate(zip(log_r, adv)) if (a > 0 and lr > 0) or (a < 0 and lr < 0)]
    keep = [True] * len(log_r)
    while trust and sum(log_r[i] ** 2 for i in trust) / len(trust) > tau:
        worst = max(trust, key=lambda i: log_r[i] ** 2)
        keep[worst] = False
        trust.remove(worst)
    return keep


def test_m2po_masks_the_largest_trust_region_tokens_until_the_second_moment_is_within_tau():
    log_r = [0.6, -0.5, 0.3, 0.05, -0.9, 0.1, 0.2, -0.02]
    adv = [1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0]  # index 1 (A > 0, r < 1) and 3 (A < 0, r > 1): outside
    expected = m2po_by_hand(log_r, adv, 0.04)
    assert expected == [False, True, True, True, False, True, True, True]  # two dropped, index 1 kept whatever its m2
    behaviour = torch.zeros(8)
    anchor, weight, corrected = rg.correction_terms(
        cfg(correction="m2po"), torch.tensor(log_r), behaviour, torch.tensor(adv), torch.tensor([8]), proximal=None
    )
    assert torch.equal(anchor, behaviour) and weight.bool().tolist() == expected
    assert corrected.tolist() == [not k for k in expected]
    torch.manual_seed(0)
    for _ in range(20):  # random cases against the one-at-a-time loop
        log_r, adv = (torch.randn(40) * 0.3).tolist(), torch.randn(40).tolist()
        got = rg.m2po_keep(torch.tensor(log_r).double() ** 2, trust_of(log_r, adv), cfg(m2po_tau=0.02))
        assert got.tolist() == m2po_by_hand(log_r, adv, 0.02)


def trust_of(log_r, adv):
    return torch.tensor([(a > 0 and lr > 0) or (a < 0 and lr < 0) for lr, a in zip(log_r, adv)])


# --- the loss and its gradient through train_step --------------------------------------------------------------


def hand_loss(correction: str, logp, behaviour, adv, lengths, c) -> torch.Tensor:
    """Each correction's per-token loss from its formula (the sources'), with the proximal policy the weights being
    trained (prox = logp without its gradient), r = pi / behaviour, rho = pi / prox."""
    prox = logp.detach()
    r, rho, w = torch.exp(logp - behaviour), torch.exp(logp - prox), torch.exp(prox - behaviour)

    def ppo(ratio):
        return -torch.minimum(ratio * adv, ratio.clamp(1 - c.clip_low, 1 + c.clip_high) * adv)

    if correction == "none":
        return ppo(r)
    if correction == "tis":
        return torch.minimum(w, torch.tensor(c.tis_cap)) * ppo(rho)
    if correction == "decoupled":
        return torch.where(w > c.decoupled_cap, 0.0, w) * ppo(rho)
    if correction == "seq-mask":
        keep, start = [], 0
        for n in lengths:
            g = math.exp(sum((prox - behaviour)[start : start + n].tolist()) / n)
            keep += [float(c.seq_mask[0] <= g <= c.seq_mask[1])] * n
            start += n
        return torch.tensor(keep) * ppo(rho)
    keep = m2po_by_hand((prox - behaviour).tolist(), adv.tolist(), c.m2po_tau)
    return -torch.tensor(keep, dtype=torch.float32) * r * adv  # M2PO: unclipped, masked


@pytest.mark.parametrize("correction", ["none", "tis", "seq-mask", "m2po", "decoupled"])
def test_train_step_gradient_is_the_hand_written_loss_of_each_correction(correction):
    """The gradient train_step leaves equals the one of the formula written above (token mean over the batch), on
    rollouts whose behaviour log-probs are off the policy by amounts that make every correction act."""
    knobs = dict(seq_mask=(0.9, 1.1), m2po_tau=0.1, tis_cap=1.3, decoupled_cap=1.5)  # each acts on this batch
    c = cfg(correction=correction, grad_clip=0.0, micro_batch_size=64, **knobs)
    model, _ = models.build_tiny_model(0)
    torch.manual_seed(1)
    batch = []
    for i in range(6):
        completion = torch.randint(3, 200, (3 + i % 3,)).tolist()
        batch.append(rg.Rollout([5, 6, 7], completion, None, 0.0, (-1.0) ** i * (1 + i / 5), 0.0, 0, i))
    with torch.no_grad():
        logp = kernels.completion_logprobs(model, [(r.prompt_ids, r.completion_ids) for r in batch], 0, 1.0)
    for r, lp in zip(batch, logp.split([len(r.completion_ids) for r in batch])):
        r.behaviour_logprobs = lp - torch.randn(len(lp)) * 0.4  # r = pi / behaviour around e^{+-0.4}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = rg.train_step(model, opt, batch, c, pad_id=0, version=0)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    lengths = [len(r.completion_ids) for r in batch]
    logp = kernels.completion_logprobs(model, [(r.prompt_ids, r.completion_ids) for r in batch], 0, 1.0)
    behaviour = torch.cat([r.behaviour_logprobs for r in batch])
    adv = torch.cat([torch.full((n,), r.advantage) for r, n in zip(batch, lengths)])
    loss = hand_loss(correction, logp, behaviour, adv, lengths, c).sum() / sum(lengths)
    loss.backward()
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-7), n
    corrected = sum(b["corrected_frac"] * stats_tokens(stats, k) for k, b in offpolicy(stats).items())
    assert (corrected > 0) == (correction != "none")  # every correction acted on this batch


def offpolicy(stats):
    return rg.by_staleness(stats["staleness_sums"])[1]


def stats_tokens(stats, bucket):
    return stats["staleness_sums"][bucket][1]


def test_none_is_the_paper_loss_bit_for_bit():
    """--correction none: the same numbers as the loss without the correction machinery (token_loss on the stored
    behaviour log-probs), to the bit."""
    model, _ = models.build_tiny_model(0)
    torch.manual_seed(2)
    batch = [rg.Rollout([5, 6], [9, 10, 11], None, 1.0, 0.7 - i, 0.0, 0, i) for i in range(4)]
    with torch.no_grad():
        logp = kernels.completion_logprobs(model, [(r.prompt_ids, r.completion_ids) for r in batch], 0, 1.0)
    for r, lp in zip(batch, logp.split(3)):
        r.behaviour_logprobs = lp - torch.randn(3) * 0.3
    c = cfg(grad_clip=0.0)
    rg.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, c, pad_id=0, version=0)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp = kernels.completion_logprobs(model, [(r.prompt_ids, r.completion_ids) for r in batch], 0, 1.0)
    repeats = torch.tensor([3] * 4)
    tok_loss, _, _ = rg.token_loss(
        loss="grpo",
        logp=logp,
        behaviour=torch.cat([r.behaviour_logprobs for r in batch]),
        advantage=rg.per_token([r.advantage for r in batch], repeats),
        reward=rg.per_token([1.0] * 4, repeats),
        group_mean=rg.per_token([0.0] * 4, repeats),
        clip_low=0.2,
        clip_high=0.2,
        delta_v=c.asymre_delta_v,
        lengths=repeats,
    )
    (tok_loss * rg.token_weights([3] * 4, "token-mean", 12, 4)).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))


# --- --prox-lag: the proximal policy is the trainer's weights L versions back ----------------------------------


def test_the_lagged_proximal_policy_is_the_weights_lag_versions_back_for_older_rollouts_only():
    model, _ = models.build_tiny_model(0)
    lagged = rg.LaggedPolicy(model, lag=1)
    versions = {}
    for v in range(3):  # version v's weights, pushed before its step, then changed by "the step"
        lagged.push(model, v)
        versions[v] = {k: t.clone() for k, t in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    assert [v for v, _ in lagged.copies] == [1, 2]  # at version 2, lag 1: version 1 is the proximal policy
    old, new = (rg.Rollout([5, 6], [9, 10], torch.zeros(2), 0.0, 1.0, 0.0, v, v) for v in (0, 1))
    proximal = lagged.logprobs([old, new], torch.zeros(4), torch.tensor([2, 2]), CFG, pad_id=0)
    reference, _ = models.build_tiny_model(0)
    reference.load_state_dict(versions[1])
    with torch.no_grad():
        expected = kernels.completion_logprobs(reference, [([5, 6], [9, 10])], 0, 1.0)
    assert torch.allclose(proximal[:2], expected, atol=1e-6)  # made by version 0 < 1: version 1's log-probs
    assert torch.equal(proximal[2:], torch.zeros(2))  # made by version 1: its own behaviour log-probs


def flat(tree: dict) -> dict:
    return {(bucket, k): v for bucket, values in tree.items() for k, v in values.items()}


def test_decoupled_with_a_lag_resumes_as_the_uninterrupted_run_and_logs_the_per_age_diagnostics(tmp_path):
    """The lagged weights are in the checkpoint: a run cut at step 4 and resumed matches the run of 6 steps; every
    record has offpolicy_by_staleness beside by_staleness, over the same buckets."""
    common = ("--prompts-per-step", "1", "--buffer-size", "16", "--eval-every", "2", "--loss", "grpo")
    common += ("--correction", "decoupled", "--prox-lag", "2", "--decoupled-cap", "1.5")
    rg.main(small_args(tmp_path, "--run-name", "full", "--total-steps", "6", *common))
    rg.main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "4", *common))
    rg.main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "6", "--resume", *common))
    full, cut = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == list(range(7))
    for a, b in zip(full[1:], cut[1:]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) and a["loss"] == pytest.approx(b["loss"])
        assert flat(a["offpolicy_by_staleness"]) == pytest.approx(flat(b["offpolicy_by_staleness"]), rel=1e-5)
        assert set(a["offpolicy_by_staleness"]) == set(a["by_staleness"])
        for bucket in a["offpolicy_by_staleness"].values():
            assert 0 <= bucket["corrected_frac"] <= 1 and bucket["m2"] >= 0 and bucket["mismatch_kl"] >= 0
    assert any(set(r["offpolicy_by_staleness"]) - {"0"} for r in full[1:])  # stale rollouts were trained on
