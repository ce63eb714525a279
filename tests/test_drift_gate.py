"""The drift gate (--max-drift), the evictions counted by reason, --skip-zero-signal and --lr-reuse-exponent: the
buffer on hand-written streams, train_step on the tiny model against log-probs computed apart, and short CPU runs
through the real CLI."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import kernels
import replay_grpo as rg
from infra import models, reporting

PAIRS = [([5, 6, 7], [8, 9]), ([5, 6, 7], [10, 11, 12]), ([13, 14], [15]), ([16], [17, 18])]
OFFSETS = [[0.1, -0.2], [0.3, 0.0, -0.1], [0.5], [-0.05, 0.05]]  # log(pi_theta / behaviour) of each token


def rollout(i, version=0, m2=None):
    return rg.Rollout(
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        behaviour_logprobs=torch.zeros(2),
        reward=0.0,
        advantage=0.0,
        group_mean=0.0,
        policy_version=version,
        group_id=i,
        drift_m2=m2,
    )


def ids(items):
    return [r.group_id for r in items]


def test_the_gate_evicts_what_drifted_at_its_last_use_and_keeps_the_never_used():
    buf = rg.ReplayBuffer(capacity=8, seed=0, max_drift=0.04)
    buf.push([rollout(0, m2=0.01), rollout(1, m2=0.05), rollout(2), rollout(3, m2=0.04), rollout(4, m2=0.2)], step=0)
    assert buf.ready(1, step=3)  # before a draw: 0.05 and 0.2 exceed 0.04; 0.04 does not; 2 was never used
    assert ids(buf.items) == [0, 2, 3]
    assert buf.evicted == {"drift": 2} and buf.evicted_age == 3 + 3  # both born at version 0, evicted at 3
    buf.items[1].drift_m2 = 0.5  # what its first use would measure
    batch, _ = buf.sample(2, step=5)
    assert ids(buf.items) == [0, 3] == sorted(ids(batch))
    assert buf.evicted == {"drift": 3} and buf.evicted_age == 6 + 5


def test_evictions_are_counted_by_reason_with_their_ages():
    buf = rg.ReplayBuffer(capacity=3, seed=0, max_age=4, max_uses=1)
    buf.push([rollout(i, version=i) for i in range(4)], step=3)
    assert ids(buf.items) == [1, 2, 3] and buf.evicted == {"capacity": 1} and buf.evicted_age == 3  # version 0, at 3
    batch, _ = buf.sample(1, step=6)  # the age cap first: version 1 is 5 > 4 behind; then the drawn one's one use
    drawn = batch[0].policy_version
    assert buf.evicted == {"capacity": 1, "age": 1, "uses": 1} and buf.evicted_age == 3 + 5 + (6 - drawn)
    assert sum(buf.evicted.values()) == sum(buf.evicted_uses.values()) == 3
    left = buf.items[0].policy_version
    buf.push([rollout(9, version=6) for _ in range(3)])  # no step given: the last draw's, 6
    assert buf.evicted["capacity"] == 2 and buf.evicted_age == 3 + 5 + (6 - drawn) + (6 - left)
    queue = rg.ReplayBuffer(capacity=4, seed=0, sampling="queue")
    queue.push([rollout(i, version=1) for i in range(2)], step=1)
    queue.sample(2, step=3)
    assert queue.evicted == {"consumed": 2} and queue.evicted_age == 2 * (3 - 1)


def test_the_eviction_counts_survive_a_checkpoint():
    buf = rg.ReplayBuffer(capacity=2, seed=0, max_drift=0.1)
    buf.push([rollout(i, m2=0.2 * (i % 2)) for i in range(3)], step=4)
    buf.ready(1, step=5)
    again = rg.ReplayBuffer(capacity=2, seed=0, max_drift=0.1)
    again.load_state_dict(buf.state_dict())
    assert again.evicted == buf.evicted == {"capacity": 1, "drift": 1} and again.evicted_age == buf.evicted_age == 4 + 5
    assert [(r.drift_m2, r.drift_version) for r in again.items] == [(r.drift_m2, r.drift_version) for r in buf.items]


def tiny_batch(model, tok, advantages):
    """Rollouts of PAIRS whose behaviour log-probs are the model's own less OFFSETS: log r is OFFSETS exactly."""
    with torch.no_grad():
        logp = kernels.completion_logprobs(model, PAIRS, tok.pad_token_id, 1.0, share_prompts=False).double()
    rollouts, start = [], 0
    for i, ((prompt, completion), offsets, advantage) in enumerate(zip(PAIRS, OFFSETS, advantages)):
        behaviour = logp[start : start + len(completion)] - torch.tensor(offsets, dtype=torch.float64)
        start += len(completion)
        rollouts.append(
            rg.Rollout(
                prompt_ids=prompt,
                completion_ids=completion,
                behaviour_logprobs=behaviour.float(),
                reward=float(advantage > 0),
                advantage=advantage,
                group_mean=0.5,
                policy_version=3,
                group_id=i,
            )
        )
    return rollouts


def tiny_run():
    model, tok = models.build_tiny_model(0)
    cfg = dataclasses.replace(rg.PRESETS["cpu"], batch_size=len(PAIRS), micro_batch_size=3, lr=1e-2)
    return model, tok, cfg, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)


def test_each_use_measures_the_rollouts_m2_and_k3_against_its_behaviour_logprobs():
    model, tok, cfg, optimizer = tiny_run()
    batch = tiny_batch(model, tok, advantages=[1.0, -1.0, 0.5, -0.5])
    rg.train_step(model, optimizer, batch, cfg, tok.pad_token_id, version=7)
    for r, offsets in zip(batch, OFFSETS):  # measured with the weights before the update
        assert r.drift_m2 == pytest.approx(sum(o * o for o in offsets) / len(offsets), abs=1e-5)
        assert r.drift_k3 == pytest.approx(sum(math.exp(o) - 1 - o for o in offsets) / len(offsets), abs=1e-5)
        assert r.drift_version == 7


@pytest.mark.parametrize("skip", [False, True])
def test_a_batch_without_signal_takes_no_optimizer_step_only_under_the_flag(skip):
    model, tok, cfg, optimizer = tiny_run()
    cfg = dataclasses.replace(cfg, skip_zero_signal=skip)
    first = rg.train_step(model, optimizer, tiny_batch(model, tok, [1.0, -1.0, 0.5, -0.5]), cfg, 0, version=0)
    assert (first["zero_signal"], first["zero_signal_skipped"]) == (0, 0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): s["exp_avg"].clone() for p, s in optimizer.state.items()}
    stats = rg.train_step(model, optimizer, tiny_batch(model, tok, [0.0] * 4), cfg, 0, version=1)
    assert stats["grad_norm"] == 0.0 and stats["zero_signal"] == 1 and stats["zero_signal_skipped"] == int(skip)
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
    if skip:  # neither the weights nor Adam's moments
        assert not moved
        assert all(torch.equal(s["exp_avg"], moments[id(p)]) for p, s in optimizer.state.items())
    else:  # a zero gradient, yet Adam's first moment carries the last direction on
        assert moved


def small_args(out_dir, *extra):
    """A few-second replay run of the real CLI: tiny random model, G=4, R=4, B=8, N=32; asymre, whose baseline gives
    a gradient even when every reward is 0, as they are for the untrained model."""
    flags = (
        "--preset cpu --sft-warmup-steps 0 --sft-imitation 0 --group-size 4 --prompts-per-step 1 --batch-size 8 "
        "--buffer-size 32 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 6 --eval-every 0 --loss asymre "
        "--lr 1e-3 --out-dir"
    )
    return [*flags.split(), str(out_dir), *extra]


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_the_gate_at_a_value_it_never_reaches_leaves_the_records_unchanged(tmp_path):
    rg.main(small_args(tmp_path, "--run-name", "off"))
    rg.main(small_args(tmp_path, "--run-name", "never", "--max-drift", "1e9"))
    rg.main(small_args(tmp_path, "--run-name", "tight", "--max-drift", "1e-6"))
    off, never, tight = (records(tmp_path / name) for name in ("off", "never", "tight"))
    assert never[0]["rule"] == off[0]["rule"] | {"max_drift": 1e9}
    for a, b in zip(off, never):
        keys = {k for k in a.keys() | b.keys() if not reporting.measured_on_this_machine(k)} - {"rule"}
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    assert never[-1]["evicted"] == off[-1]["evicted"] and "drift" not in off[-1]["evicted"]
    assert off[-1]["total_trained_tokens"] and off[-2]["grad_norm"] > 0  # it trained: the comparison means something
    last = tight[-1]  # reused rollouts drift past 1e-6 after an update at lr 1e-3: the gate evicts them
    assert last["evicted"]["drift"] > 0
    assert sum(last["evicted"].values()) == sum(last["replay_hist"].values())  # each eviction has one reason
    assert last["evicted_age_mean"] >= 1  # drifted means trained on at an older version


def test_the_reuse_exponent_scales_the_learning_rate_by_r_over_b(tmp_path):
    rg.main(small_args(tmp_path, "--run-name", "beta", "--lr-reuse-exponent", "1", "--total-steps", "1"))
    state = torch.load(tmp_path / "beta" / "checkpoint" / "optimizer.pt", weights_only=True)
    assert state["param_groups"][0]["lr"] == pytest.approx(1e-3 * 4 / 8, rel=1e-12)  # R = 4, B = 8
    cfg = rg.Args(lr=1e-5, prompts_per_step=2, group_size=8, batch_size=32, lr_reuse_exponent=0.0)
    assert rg.learning_rate(cfg) == 1e-5  # exponent 0: the flag's value itself, bit for bit
