"""The buffer's rules beside the paper's uniform sampling (--sampling, --max-age, --max-uses, --priority-*), the
sequence-level ratio (--ratio-level) and the metrics by staleness: each on a hand-written stream of rollouts with
its batches and evictions written out, a chi-squared test where a rule draws at random, and short CPU runs
through the real CLI in both loops."""

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import replay_grpo as rg

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
# chi-squared 99.9% quantiles by degrees of freedom
CHI2_999 = {3: 16.27, 4: 18.47, 9: 27.88}


def rollout(i, version=0, advantage=0.0):
    return rg.Rollout(
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        behaviour_logprobs=torch.zeros(2),
        reward=0.0,
        advantage=advantage,
        group_mean=0.0,
        policy_version=version,
        group_id=i,
    )


def ids(batch):
    return [r.group_id for r in batch]


def chi2(counts: Counter, expected: dict) -> float:
    return sum((counts[k] - e) ** 2 / e for k, e in expected.items())


def small_args(out_dir, *extra):
    """A few-second configuration of the real CLI: tiny random model, G=4, R=B=8, N=16."""
    return [
        *(
            "--preset cpu --sft-warmup-steps 0 --sft-imitation 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
            "--buffer-size 16 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 4 --eval-every "
            "0 --out-dir"
        ).split(),
        str(out_dir),
        "--loss",
        "grpo",
        "--lr",
        "1e-3",
        *extra,
    ]


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# --- the paper's sampling variants ------------------------------------------------------------------


def test_without_replacement_draws_each_rollout_once():
    buf = rg.ReplayBuffer(capacity=6, sampling="without-replacement", seed=0)
    buf.push([rollout(i) for i in range(2)])
    assert sorted(ids(buf.sample(2, 0)[0])) == [0, 1]
    buf.push([rollout(2)])
    assert not buf.ready(2, 1)  # one never-used rollout: generation must go on
    buf.push([rollout(3)])
    assert sorted(ids(buf.sample(2, 1)[0])) == [2, 3]  # the only never-used ones
    buf.push([rollout(i) for i in range(4, 8)])  # 8 > 6: evicts 0 and 1, both used once
    assert ids(buf.items) == [2, 3, 4, 5, 6, 7] and buf.evicted_uses == Counter({1: 2})
    assert sorted(ids(buf.sample(4, 2)[0])) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="0 drawable by --sampling without-replacement"):
        buf.sample(1, 3)


def test_at_least_once_takes_the_never_used_first():
    buf = rg.ReplayBuffer(capacity=8, sampling="at-least-once", seed=0)
    buf.push([rollout(i) for i in range(3)])
    assert sorted(ids(buf.sample(3, 0)[0])) == [0, 1, 2]
    buf.push([rollout(3)])
    batch = ids(buf.sample(3, 1)[0])
    assert batch[0] == 3 and len(set(batch)) == 3  # the never-used one, then two of the used ones
    assert len(buf) == 4 and buf.evicted_uses == Counter()  # nothing is removed


@pytest.mark.parametrize("sampling", ["without-replacement", "at-least-once"])
def test_never_used_rollouts_are_drawn_uniformly(sampling):
    """Ten rollouts, five of them used: a batch of one is uniform over the five never used."""
    counts, trials = Counter(), 5000
    buf = rg.ReplayBuffer(capacity=10, sampling=sampling, seed=1)
    buf.push([rollout(i) for i in range(10)])
    for r in buf.items:
        r.uses = int(r.group_id % 2 == 0)  # 0, 2, 4, 6, 8 used
    for step in range(trials):
        (r,), _ = buf.sample(1, step)
        counts[r.group_id] += 1
        r.uses = 0  # never used again, for the next trial
    assert set(counts) == {1, 3, 5, 7, 9}
    assert chi2(counts, {i: trials / 5 for i in (1, 3, 5, 7, 9)}) < CHI2_999[4], counts


# --- the no-buffer baseline: a queue consumed once, freshest first -----------------------------------


def test_queue_trains_on_each_rollout_once_freshest_first():
    buf = rg.ReplayBuffer(capacity=8, sampling="queue", seed=0)
    buf.push([rollout(i) for i in range(6)])
    assert ids(buf.sample(2, 0)[0]) == [5, 4]
    assert ids(buf.sample(2, 1)[0]) == [3, 2]
    buf.push([rollout(6), rollout(7)])
    assert ids(buf.sample(2, 2)[0]) == [7, 6]
    assert ids(buf.items) == [0, 1] and buf.evicted_uses == Counter({1: 6})  # none evicted unused


# --- the caps: age and uses --------------------------------------------------------------------------


def test_age_cap_evicts_rollouts_older_than_max_age_before_sampling():
    buf = rg.ReplayBuffer(capacity=8, max_age=2, seed=0)
    buf.push([rollout(i, version=i) for i in range(4)])  # versions 0..3
    assert buf.ready(3, 3) and ids(buf.items) == [1, 2, 3]  # at step 3, version 0 is 3 > 2 versions old
    assert sorted(ids(buf.sample(3, 3)[0])) == [1, 2, 3]
    assert sorted(ids(buf.sample(2, 4)[0])) == [2, 3]  # version 1 is evicted at step 4, used once
    assert buf.evicted_uses == Counter({0: 1, 1: 1})
    assert not buf.ready(1, 6)  # at step 6 nothing is young enough


def test_use_cap_evicts_a_rollout_after_max_uses_uses():
    buf = rg.ReplayBuffer(capacity=8, max_uses=2, seed=0)
    buf.push([rollout(i) for i in range(3)])
    buf.sample(3, 0)
    assert len(buf) == 3
    buf.push([rollout(3)])
    batch = ids(buf.sample(4, 1)[0])
    assert sorted(batch) == [0, 1, 2, 3] and ids(buf.items) == [3]  # 0, 1, 2 reached two uses
    assert buf.evicted_uses == Counter({2: 3})


# --- fresh-anchored batches and prioritized replay ---------------------------------------------------


def test_fresh_anchored_batches_hold_every_fresh_rollout():
    buf = rg.ReplayBuffer(capacity=8, sampling="fresh-anchored", seed=0)
    buf.push([rollout(i) for i in range(4)])
    assert sorted(ids(buf.sample(4, 0)[0])) == [0, 1, 2, 3]
    buf.push([rollout(4), rollout(5)])
    batch = ids(buf.sample(4, 1)[0])
    assert batch[:2] == [5, 4] and set(batch[2:]) <= {0, 1, 2, 3} and len(set(batch)) == 4
    batch = ids(buf.sample(2, 2)[0])  # nothing fresh since: all replayed
    assert len(set(batch)) == 2


def test_priority_prefers_large_advantages_and_decays_with_age():
    """tau tiny: a rollout one version old has weight exp(-1/tau) = 0, so the fresh ones are drawn first;
    among them the larger |A| comes first at a large alpha."""
    buf = rg.ReplayBuffer(capacity=8, sampling="priority", priority_alpha=30.0, priority_tau=1e-3, seed=0)
    buf.push(
        [
            rollout(0, version=4, advantage=2.0),
            rollout(1, version=5, advantage=0.1),
            rollout(2, version=5, advantage=-1.5),
            rollout(3, version=4, advantage=0.0),
        ]
    )
    assert ids(buf.sample(2, 5)[0]) == [2, 1]


def test_priority_draws_in_proportion_to_its_weights():
    """A batch of one: P(i) = w_i / sum w, w = (|A| + eps)^alpha * exp(-age / tau)."""
    alpha, tau, step = 1.0, 4.0, 6
    rollouts = [
        rollout(i, version=v, advantage=a) for i, (v, a) in enumerate([(6, 0.0), (6, 1.0), (4, 1.0), (2, -2.0)])
    ]
    weights = [
        (abs(r.advantage) + rg.PRIORITY_EPS) ** alpha * math.exp(-(step - r.policy_version) / tau) for r in rollouts
    ]
    buf = rg.ReplayBuffer(capacity=4, sampling="priority", priority_alpha=alpha, priority_tau=tau, seed=2)
    buf.push(rollouts)
    counts, trials = Counter(), 20000
    for _ in range(trials):
        counts[buf.sample(1, step)[0][0].group_id] += 1
    expected = {i: trials * w / sum(weights) for i, w in enumerate(weights)}
    assert chi2(counts, expected) < CHI2_999[3], (counts, expected)


def test_fresh_anchored_fills_by_priority_when_given_an_exponent():
    buf = rg.ReplayBuffer(capacity=8, sampling="fresh-anchored", priority_alpha=30.0, seed=0)
    buf.push([rollout(0, advantage=0.1), rollout(1, advantage=3.0), rollout(2, advantage=0.2)])
    buf.sample(3, 0)
    buf.push([rollout(3)])
    assert ids(buf.sample(2, 1)[0]) == [3, 1]  # the fresh one, then the largest |A|


def test_buffer_rules_survive_a_checkpoint():
    buf = rg.ReplayBuffer(capacity=8, sampling="fresh-anchored", seed=4)
    buf.push([rollout(i) for i in range(5)])
    buf.sample(3, 0)
    buf.push([rollout(5)])
    other = rg.ReplayBuffer(capacity=1, sampling="fresh-anchored")
    other.load_state_dict(buf.state_dict())
    assert ids(other.sample(3, 1)[0]) == ids(buf.sample(3, 1)[0])


# --- the sequence-level ratio ------------------------------------------------------------------------


def test_sequence_ratio_is_the_geometric_mean_of_its_token_ratios_clipped_per_sequence():
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.3, -0.1], requires_grad=True)
    behaviour = torch.tensor([-1.2, -2.4, -0.5, -0.1, -0.2])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    lengths = torch.tensor([2, 3])
    loss, ratio, clipped = rg.token_loss(
        loss="grpo",
        logp=logp,
        behaviour=behaviour,
        advantage=adv,
        reward=None,
        group_mean=None,
        clip_low=0.2,
        clip_high=0.2,
        delta_v=0.0,
        lengths=lengths,
        ratio_level="sequence",
    )
    s1 = math.exp((0.2 + 0.4) / 2)  # 1.35: above 1 + 0.2, so clipped for A > 0
    s2 = math.exp((0.0 - 0.2 + 0.1) / 3)  # 0.967: inside the clip range
    assert ratio.tolist() == pytest.approx([s1, s1, s2, s2, s2])
    assert clipped.tolist() == [True, True, False, False, False]
    assert loss.tolist() == pytest.approx([-1.2, -1.2, s2, s2, s2])
    loss.sum().backward()
    # the clipped sequence has no gradient; the other's: d(s2 * 3)/d logp_t = 3 * s2 / 3 for each of its tokens
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, s2, s2, s2])


def test_sequence_ratio_of_one_token_sequences_is_the_token_ratio():
    logp, behaviour = torch.tensor([-1.0, -0.2, -3.0]), torch.tensor([-0.8, -0.5, -3.0])
    common = dict(
        loss="grpo",
        logp=logp,
        behaviour=behaviour,
        advantage=torch.tensor([1.0, -1.0, 0.5]),
        reward=None,
        group_mean=None,
        clip_low=0.2,
        clip_high=0.28,
        delta_v=0.0,
        lengths=torch.tensor([1, 1, 1]),
    )
    for a, b in zip(rg.token_loss(ratio_level="sequence", **common), rg.token_loss(ratio_level="token", **common)):
        assert torch.equal(a, b)


# --- metrics by staleness ----------------------------------------------------------------------------


def test_staleness_buckets():
    assert [rg.staleness_bucket(s) for s in (0, 1, 2, 3, 4, 7, 8, 50)] == ("0 1 2-3 2-3 4-7 4-7 8+ 8+").split()


def test_metrics_by_staleness_from_the_ratios_of_each_bucket():
    batch = [rollout(0, version=10), rollout(1, version=9), rollout(2, version=7)]  # staleness 0, 1, 3 at step 10
    batch[2].completion_ids = [5, 6, 7]
    ratio = torch.tensor([1.0, 1.0, 1.5, 0.5, 2.0, 1.0, 1.0])
    clipped = torch.tensor([False, False, True, False, True, False, False])
    sums = {}
    corrected = torch.tensor([False, False, False, False, False, True, False])
    rg.add_staleness_sums(sums, batch, 10, ratio=ratio, clipped=clipped, corrected=corrected, log_ratio=ratio.log())
    rg.add_staleness_sums(
        sums, batch[:1], 10, ratio=ratio[:2], clipped=clipped[:2], corrected=corrected[:2], log_ratio=torch.zeros(2)
    )
    out = rg.by_staleness(sums)[0]
    assert list(out) == ["0", "1", "2-3"]
    assert out["0"] == {"rollouts": 2, "tokens": 4, "clip_frac": 0.0, "abs_log_ratio": 0.0, "ess": 4.0}
    assert out["1"]["clip_frac"] == 0.5 and out["1"]["ess"] == pytest.approx(4 / 2.5)
    assert out["1"]["abs_log_ratio"] == pytest.approx(math.log(1.5) / 2 + math.log(2) / 2)
    assert out["2-3"]["ess"] == pytest.approx(16 / 6) and out["2-3"]["clip_frac"] == pytest.approx(1 / 3)
    beside = rg.by_staleness(sums)[1]  # the per-age diagnostics of the corrections, same buckets
    assert list(beside) == list(out) and beside["0"] == {"corrected_frac": 0.0, "m2": 0.0, "mismatch_kl": 0.0}
    assert beside["1"]["m2"] == pytest.approx((math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2)
    assert beside["1"]["mismatch_kl"] == pytest.approx((0.5 - math.log(1.5) - 0.5 - math.log(0.5)) / 2)
    assert beside["2-3"]["corrected_frac"] == pytest.approx(1 / 3)


def test_train_step_reports_every_trained_rollout_in_its_staleness_bucket(tmp_path):
    """Through the real CLI: every step's buckets add up to the batch; a replay run has stale buckets."""
    rg.main(
        small_args(tmp_path, "--buffer-size", "32", "--prompts-per-step", "1", "--total-steps", "6", "--run-name", "r")
    )
    recs = metrics(tmp_path / "r")
    assert recs[0]["rule"] == {
        "positive_bias": 0.0,
        "sampling": "uniform",
        "max_age": None,
        "max_uses": None,
        "max_drift": None,
        "priority_alpha": 0.0,
        "priority_tau": None,
        "ratio_level": "token",
    }
    for rec in recs[1:]:
        assert sum(b["rollouts"] for b in rec["by_staleness"].values()) == 8
        assert sum(rec["staleness_hist"].values()) == 8
        for bucket in rec["by_staleness"].values():
            assert 0 < bucket["ess"] <= bucket["tokens"] + 1e-9 and 0 <= bucket["clip_frac"] <= 1
    assert any(set(rec["by_staleness"]) - {"0"} for rec in recs[1:])


# --- refused settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--sampling", "fresh-anchored", "--batch-size", "4", "--buffer-size", "16"],
            "--sampling fresh-anchored: a batch holds every fresh rollout, so --batch-size 4 must be >= R = 8",
        ),
        (["--max-age", "0"], "--max-age 0: must be >= 1"),
        (["--max-age", "1", "--publish-every", "4"], "--max-age 1: must be >= 1 and >= --publish-every - 1 = 3"),
        (["--max-uses", "0"], "--max-uses 0: must be >= 1"),
        (["--sampling", "priority", "--priority-alpha", "-1"], "--priority-alpha -1.0: must be >= 0"),
        (["--sampling", "priority", "--priority-tau", "0"], "--priority-tau 0.0: must be a positive number"),
        (["--sampling", "priority"], "--sampling priority needs --priority-alpha > 0 or --priority-tau"),
        (["--priority-alpha", "0.5"], "only --sampling priority and fresh-anchored draw by priority"),
        (["--sampling", "queue", "--positive-bias", "0.25"], "--sampling queue --positive-bias 0.25"),
        (["--sampling", "queue", "--max-uses", "2"], "--max-age, --max-uses and --max-drift do not apply"),
        (["--sampling", "queue", "--max-drift", "0.04"], "--max-age, --max-uses and --max-drift do not apply"),
        (["--max-drift", "0"], "--max-drift 0.0: must be above 0"),
        (["--lr-reuse-exponent", "inf"], "--lr-reuse-exponent inf: must be finite"),
        (
            ["--batch-size", "16", "--lr", "0.3", "--lr-reuse-exponent", "-2"],
            "--lr-reuse-exponent -2.0: scales --lr 0.3 by (R / B = 0.5)^-2.0 to 1.2: must stay below 1",
        ),
        (["--skip-zero-signal", "--loss", "asymre"], "--skip-zero-signal: only --loss grpo has no gradient"),
        (["--sampling", "queue", "--batch-size", "12"], "--batch-size 12 must be a multiple of R = 8"),
        (
            ["--sampling", "without-replacement", "--batch-size", "16", "--positive-bias", "0.25"],
            "leaving 12 for never-used ones, fewer than --batch-size 16",
        ),
        (["--ratio-level", "sequence", "--loss", "asymre"], "--ratio-level sequence: only --loss grpo has a ratio"),
        (["--sampling", "sorted"], "sorted"),
    ],
)
def test_settings_a_rule_cannot_work_with_are_refused_in_one_line(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        rg.main(small_args(tmp_path, *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


# --- each rule end to end, in both loops -------------------------------------------------------------

RULES = {
    "without-replacement": ["--sampling", "without-replacement"],
    "at-least-once": ["--sampling", "at-least-once", "--prompts-per-step", "1"],
    "fresh-anchored": ["--sampling", "fresh-anchored", "--prompts-per-step", "1", "--priority-alpha", "1"],
    "priority": ["--sampling", "priority", "--priority-alpha", "0.6", "--priority-tau", "4"],
    "queue": ["--sampling", "queue", "--prompts-per-step", "1"],
    "caps": ["--max-age", "3", "--max-uses", "2", "--prompts-per-step", "1"],
    "drift-gate": ["--max-drift", "1e-6", "--prompts-per-step", "1", "--lr-reuse-exponent", "0.5"],
    "sequence-ratio": ["--ratio-level", "sequence", "--prompts-per-step", "1"],
}


def check_rule_run(name: str, recs: list[dict]) -> None:
    """What every run of a rule must show in its records (the last is the totals')."""
    trained = recs[1:]
    assert len(trained) == 4 and all(math.isfinite(r["loss"]) for r in trained)
    hist = {int(u): n for u, n in trained[-1]["replay_hist"].items()}
    if name == "without-replacement":
        assert max(hist, default=0) <= 1, hist  # used at most once (async: unused ones may be evicted)
    if name == "queue":
        assert set(hist) <= {1}, hist  # used once, and none evicted unused
    if name == "caps":
        assert max(hist, default=0) <= 2 and all(r["staleness_max"] <= 3 for r in trained)
    assert sum(trained[-1]["evicted"].values()) == sum(hist.values())  # each eviction counted once, with its reason


@pytest.mark.parametrize("name", RULES)
def test_each_rule_trains_in_the_synchronous_loop(tmp_path, name):
    rg.main(small_args(tmp_path, *RULES[name], "--run-name", name))
    recs = metrics(tmp_path / name)
    check_rule_run(name, recs)
    if name in ("without-replacement", "queue"):  # each rollout once: 8 generated for each step's 8 trained
        assert recs[-1]["generated_rollouts"] == recs[-1]["trained_rollouts"] == 32


@pytest.mark.parametrize("name", RULES)
def test_each_rule_trains_in_the_async_pipeline(tmp_path, name, vllm_servers):
    cmd = [
        sys.executable,
        str(ROOT / "async_pipeline.py"),
        *small_args(tmp_path, *RULES[name], "--run-name", name),
        "--generator-urls",
        vllm_servers["tied"].url,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    check_rule_run(name, metrics(tmp_path / name))


def test_the_async_queue_trains_on_every_rollout_it_takes_exactly_once(tmp_path, vllm_servers):
    """async_pipeline.py --sampling queue on two servers: nothing is evicted unused; what the trainer took from the
    servers is trained on once or still waits in the queue (the checkpoint's buffer, never used)."""
    cmd = [
        sys.executable,
        str(ROOT / "async_pipeline.py"),
        *small_args(
            tmp_path, "--sampling", "queue", "--prompts-per-step", "1", "--total-steps", "12", "--run-name", "q"
        ),
        "--num-generators",
        "2",
        "--generator-urls",
        vllm_servers["tied"].url,
        vllm_servers["untied"].url,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = metrics(tmp_path / "q")
    last = recs[-1]
    assert last["replay_hist"] == {"1": 96} and last["trained_rollouts"] == 96
    newest = [max(r["fresh_versions"]) for r in recs[1:] if r["fresh_versions"]]  # each publish is awaited
    assert newest == sorted(newest) and newest[-1] >= 4 and last["publishes"] == 13, newest
    shard = torch.load(tmp_path / "q" / "checkpoint" / "buffer_rank0.pt", weights_only=False)["buffer"]
    waiting = shard["items"]
    assert all(r["uses"] == 0 for r in waiting) and len(waiting) <= 16
    assert last["generated_rollouts"] == last["trained_rollouts"] + len(waiting)
