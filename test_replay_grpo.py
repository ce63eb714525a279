"""Offline tests of replay_grpo.py on a tiny model built in code (CPU, no network)."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
# as replay_grpo.py does, before torch loads libgomp; not in pytest-xdist workers, which run one torch thread each
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PYTEST_XDIST_WORKER"} & set(os.environ):
    os.environ["GOMP_SPINCOUNT"] = "300"

import pytest
import torch

import replay_grpo as rg
from infra import evaluation, generation, models, reporting, run_folder, tasks, warm_start

ROOT = Path(__file__).resolve().parent
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # xdist workers share the cores: torch's threads fight (4x slower)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def small_args(out_dir, *extra):
    """A few-second configuration of the real CLI: tiny random model, G=4, R=B=N=8."""
    return [
        *(
            "--preset cpu --sft-warmup-steps 0 --sft-imitation 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
            "--buffer-size 8 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 3 --eval-every 0 "
            "--out-dir"
        ).split(),
        str(out_dir),
        *extra,
    ]


def run_main(args):
    return rg.main(list(args))


def user_error(capsys, args) -> str:
    with pytest.raises(SystemExit) as exc:
        rg.main(list(args))
    assert exc.value.code == 2
    return capsys.readouterr().err


def rollout(i, correct=False, version=0):
    return rg.Rollout(
        prompt_ids=[1, 2],
        completion_ids=[3, i % 200],
        behaviour_logprobs=torch.zeros(2),
        reward=float(correct),
        advantage=0.0,
        group_mean=0.0,
        policy_version=version,
        group_id=i,
    )


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# --- the replay buffer ----------------------------------------------------------------------------


def test_buffer_evicts_oldest_first():
    buf = rg.ReplayBuffer(capacity=5)
    buf.push([rollout(i) for i in range(3)])
    buf.push([rollout(i) for i in range(3, 8)])
    assert [r.group_id for r in buf.items] == [3, 4, 5, 6, 7]
    assert len(buf) == 5


def test_buffer_sampling_is_uniform_without_replacement_and_removes_nothing():
    buf = rg.ReplayBuffer(capacity=20, seed=123)
    buf.push([rollout(i) for i in range(20)])
    counts, trials, batch = [0] * 20, 4000, 5
    for step in range(trials):
        sample, _ = buf.sample(batch, step)
        ids = [r.group_id for r in sample]
        assert len(set(ids)) == batch  # no duplicates inside a batch
        for i in ids:
            counts[i] += 1
    assert len(buf) == 20 and [r.group_id for r in buf.items] == list(range(20))
    # chi-square goodness of fit to uniform: 19 dof, 99.9% quantile ~ 43.8
    expected = trials * batch / 20
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 43.8, (chi2, counts)


def test_buffer_sample_larger_than_content_is_refused():
    buf = rg.ReplayBuffer(capacity=8)
    buf.push([rollout(i) for i in range(3)])
    with pytest.raises(ValueError, match="holds 3"):
        buf.sample(4, 0)


def test_positive_bias_paper_example():
    # N = 8, delta = 0.25; ten rollouts oldest -> newest: x v v x v v x v x x
    stream = [False, True, True, False, True, True, False, True, False, False]
    buf = rg.ReplayBuffer(capacity=8, positive_bias=0.25)
    for i, ok in enumerate(stream, start=1):
        buf.push([rollout(i, correct=ok)])
    assert sorted(r.group_id for r in buf.items) == [2, 3, 5, 6, 7, 8, 9, 10]


def test_positive_bias_zero_is_plain_fifo():
    buf = rg.ReplayBuffer(capacity=4, positive_bias=0.0)
    buf.push([rollout(i, correct=(i % 2 == 0)) for i in range(10)])
    assert [r.group_id for r in buf.items] == [6, 7, 8, 9]


def test_buffer_state_dict_round_trip():
    buf = rg.ReplayBuffer(capacity=6, positive_bias=0.5, seed=3)
    buf.push([rollout(i, correct=i % 3 == 0) for i in range(9)])
    buf.sample(3, 0)
    other = rg.ReplayBuffer(capacity=1)
    other.load_state_dict(buf.state_dict())
    assert [r.group_id for r in other.items] == [r.group_id for r in buf.items]
    assert [r.group_id for r in other.sample(4, 1)[0]] == [r.group_id for r in buf.sample(4, 1)[0]]


def test_buffer_sample_says_how_long_each_reused_rollout_rested():
    buf = rg.ReplayBuffer(capacity=4, seed=0)
    buf.push([rollout(i) for i in range(4)])
    assert buf.sample(4, 0)[1] == []  # none was used before
    batch, since = buf.sample(4, 3)
    assert since == [3, 3, 3, 3] and all(r.uses == 2 and r.last_use_step == 3 for r in batch)
    buf.push([rollout(4)])  # evicts rollout 0: the newest has never been used
    assert sorted(buf.sample(4, 5)[1]) == [2, 2, 2]


# --- advantages and losses ------------------------------------------------------------------------


def test_group_advantages_are_z_scores():
    adv, mean = rg.group_advantages([1.0, 0.0, 0.0, 1.0])
    assert mean == 0.5
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    adv, mean = rg.group_advantages([1.0, 1.0, 1.0])
    assert adv == [0.0, 0.0, 0.0] and mean == 1.0
    for partial in (0.1, 0.7):  # equal partial credits whose float mean is a rounding step off them
        assert rg.group_advantages([partial] * 7)[0] == [0.0] * 7


def test_grpo_loss_clips_on_both_sides_by_hand():
    # ratios exp(logp - behaviour): 1.5 (above 1.2), 0.5 (below 0.8), 1.1 (inside)
    behaviour = torch.zeros(6)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 1.1]))
    adv = torch.tensor([2.0, -2.0, 2.0, -2.0, 2.0, -2.0])
    loss, ratio, clipped = rg.token_loss("grpo", logp, behaviour, adv, None, None, 0.2, 0.2, 0.0)
    # min(r*A, clip(r)*A): A>0,r=1.5 -> 1.2*2; A<0,r=1.5 -> 1.5*-2; A>0,r=0.5 -> 0.5*2;
    # A<0,r=0.5 -> 0.8*-2; inside: r*A
    expected = -torch.tensor([2.4, -3.0, 1.0, -1.6, 2.2, -2.2])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert clipped.tolist() == [True, False, False, True, False, False]
    assert torch.allclose(ratio, torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 1.1]), atol=1e-6)
    # asymmetric clip: eps_high = 0.3 lets 1.25 through, eps_low = 0.1 clips 0.85 at 0.9 for A<0
    logp2 = torch.log(torch.tensor([1.25, 0.85]))
    loss2, _, _ = rg.token_loss("grpo", logp2, torch.zeros(2), torch.tensor([1.0, -1.0]), None, None, 0.1, 0.3, 0.0)
    assert torch.allclose(loss2, -torch.tensor([1.25, -0.9]), atol=1e-6)


def test_grpo_clipped_tokens_have_zero_gradient():
    logp = torch.log(torch.tensor([1.5, 1.1])).requires_grad_(True)
    loss, _, _ = rg.token_loss("grpo", logp, torch.zeros(2), torch.tensor([1.0, 1.0]), None, None, 0.2, 0.2, 0.0)
    loss.sum().backward()
    assert logp.grad[0] == 0 and logp.grad[1] == pytest.approx(-1.1, abs=1e-6)


def test_asymre_loss_by_hand():
    logp = torch.tensor([-0.5, -2.0, -1.0])
    reward = torch.tensor([1.0, 0.0, 1.0])
    group_mean = torch.tensor([0.25, 0.25, 0.75])
    loss, _, clipped = rg.token_loss("asymre", logp, torch.full((3,), -9.0), None, reward, group_mean, 0.2, 0.2, -0.1)
    # -(r - (V + dV)) * logp with dV = -0.1
    expected = -torch.tensor([(1 - 0.15) * -0.5, (0 - 0.15) * -2.0, (1 - 0.65) * -1.0])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert not clipped.any()


def test_token_weights_sum_to_one_over_the_batch():
    lengths = [3, 1, 4, 2]
    w_tok = torch.cat([rg.token_weights(part, "token-mean", 10, 4) for part in (lengths[:2], lengths[2:])])
    w_seq = torch.cat([rg.token_weights(part, "seq-mean", 10, 4) for part in (lengths[:2], lengths[2:])])
    assert w_tok.sum().item() == pytest.approx(1.0) and torch.allclose(w_tok, torch.full((10,), 0.1))
    assert w_seq.sum().item() == pytest.approx(1.0)
    assert w_seq[:3].tolist() == pytest.approx([1 / 12] * 3) and w_seq[3].item() == pytest.approx(1 / 4)


# --- the real trainer path ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model, tok = models.build_tiny_model(0)
    return model, tok


def make_batch(tiny, n_prompts=3, G=4, seed=0):
    model, tok = tiny
    cfg = rg.Args(group_size=G, max_new_tokens=5, sft_warmup_steps=0)
    task = tasks.make_arith_task(cfg)
    gen = generation.HFGenerator(model, tok)
    torch.manual_seed(seed)
    rollouts, _ = rg.make_rollouts(gen, tok, task, task.sample(random.Random(seed), n_prompts), cfg, 0)
    return cfg, rollouts


def test_micro_batching_does_not_change_the_gradient(tiny):
    model, tok = tiny
    for agg in ("token-mean", "seq-mean"):
        cfg, batch = make_batch(tiny)
        for r in batch:  # non-trivial advantages so the gradient is not zero
            r.advantage = random.Random(r.group_id * 100 + len(r.completion_ids)).uniform(-1, 1)
        grads = []
        for mbs in (len(batch), 3):
            m = rg.copy.deepcopy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.0)
            cfg.micro_batch_size, cfg.loss_agg = mbs, agg
            rg.train_step(m, opt, batch, cfg, tok.pad_token_id, version=0)
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        assert grads[0].abs().sum() > 0
        assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_on_policy_ratio_is_one_and_behaviour_logprobs_match(tiny):
    model, tok = tiny
    cfg, batch = make_batch(tiny)
    m = rg.copy.deepcopy(model)
    stats = rg.train_step(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, cfg, tok.pad_token_id, version=0)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["logprob_mismatch_abs"] < 1e-5 and stats["clip_frac"] == 0.0
    # behaviour log-probs are those of the sampled tokens: they sum to a finite negative number
    for r in batch:
        assert len(r.behaviour_logprobs) == len(r.completion_ids) and (r.behaviour_logprobs <= 0).all()


def test_advantages_and_behaviour_logprobs_stay_frozen_while_training(tiny):
    model, tok = tiny
    cfg, batch = make_batch(tiny)
    for r in batch:
        r.advantage = 1.0 if r.group_id % 2 else -1.0
    frozen = [(r.advantage, r.group_mean, r.behaviour_logprobs.clone()) for r in batch]
    m = rg.copy.deepcopy(model)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    ratios = []
    for step in range(3):
        ratios.append(rg.train_step(m, opt, batch, cfg, tok.pad_token_id, version=step)["ratio_mean"])
    for r, (a, v, lp) in zip(batch, frozen):
        assert r.advantage == a and r.group_mean == v and torch.equal(r.behaviour_logprobs, lp)
    assert ratios[0] == pytest.approx(1.0, abs=1e-5) and abs(ratios[-1] - 1.0) > 1e-4  # the policy moved


def test_on_policy_setting_uses_every_rollout_exactly_once(tmp_path):
    run_main(small_args(tmp_path, "--run-name", "onpol", "--total-steps", "4"))
    state = torch.load(tmp_path / "onpol" / "checkpoint" / "trainer_state.pt", weights_only=False)
    evicted = state["buffer"]["evicted_uses"]
    uses = [r["uses"] for r in state["buffer"]["items"]] + [u for u, n in evicted.items() for _ in range(n)]
    assert len(uses) == 4 * 8 and set(uses) == {1}
    recs = metrics(tmp_path / "onpol")[1:]
    assert all(r["staleness_max"] == 0 and r["replay_ratio"] == 1.0 for r in recs)
    assert recs[-1]["replay_hist"] == {"1": 3 * 8}  # the buffer's count, logged: 3 batches evicted after one use


def test_replay_reuses_rollouts_and_measures_staleness(tmp_path):
    run_main(
        small_args(
            tmp_path,
            "--run-name",
            "replay",
            "--total-steps",
            "6",
            "--prompts-per-step",
            "1",
            "--buffer-size",
            "16",
            "--publish-every",
            "2",
        )
    )
    recs = metrics(tmp_path / "replay")[1:]
    assert recs[-1]["replay_ratio"] == pytest.approx(6 * 8 / (recs[-1]["generated_rollouts"]))
    assert max(r["staleness_max"] for r in recs) >= 2
    assert any(r["steps_since_last_use"] for r in recs)
    state = torch.load(tmp_path / "replay" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert max(r["uses"] for r in state["buffer"]["items"]) >= 2
    versions = [r["policy_version"] for r in state["buffer"]["items"]]
    assert versions == sorted(versions) and max(versions) > 0


def test_end_to_end_main_logs_metrics_and_saves_a_loadable_model(tmp_path):
    out = run_main(small_args(tmp_path, "--run-name", "e2e", "--eval-every", "2", "--loss", "asymre"))
    run_dir = tmp_path / "e2e"
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["loss"] == "asymre" and cfg["batch_size"] == 8
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    for key in tuple(
        (
            "reward entropy response_length loss clip_frac ratio_mean ratio_max grad_norm buffer_size "
            "staleness_mean staleness_max replay_ratio generated_tokens trained_tokens gen_seconds "
            "train_seconds mu"
        ).split()
    ):
        assert key in recs[-1], key
        assert recs[-1][key] is not None and math.isfinite(recs[-1][key]), key
    assert "eval/greedy_acc" in recs[0] and "eval/pass@2" in recs[2] and "eval/pass@1" in out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint")
    tok = AutoTokenizer.from_pretrained(run_dir / "checkpoint")
    assert model.num_parameters() > 0 and tok("12+7=")["input_ids"] == list(b"12+7=")


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    # asymre: its loss is not zero even when the random tiny model earns no reward
    common = ("--prompts-per-step", "1", "--buffer-size", "16", "--eval-every", "2", "--loss", "asymre")
    run_main(small_args(tmp_path, "--run-name", "full", "--total-steps", "6", *common))
    run_main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "4", *common))
    before = torch.load(tmp_path / "cut" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert before["step"] == 4
    run_main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "6", "--resume", *common))
    full, cut = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4, 5, 6]
    for a, b in zip(full, cut):
        for k in ("loss", "reward", "grad_norm", "buffer_size", "staleness_mean"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
    s_full = torch.load(tmp_path / "full" / "checkpoint" / "trainer_state.pt", weights_only=False)
    s_cut = torch.load(tmp_path / "cut" / "checkpoint" / "trainer_state.pt", weights_only=False)
    completions = [[r["completion_ids"] for r in s["buffer"]["items"]] for s in (s_full, s_cut)]
    assert completions[0] == completions[1]


def test_resume_after_a_kill_inside_the_swap_of_a_checkpoint(tmp_path):
    """A kill after the new checkpoint was renamed in but before the old one was deleted leaves both
    folders: the resumed run's next save must not trip over the stale checkpoint.old."""
    args = small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--total-steps", "3")
    run_main(args)
    shutil.copytree(tmp_path / "r" / "checkpoint", tmp_path / "r" / "checkpoint.old")  # the stale one
    run_main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--total-steps", "6", "--resume"))
    assert [r["step"] for r in metrics(tmp_path / "r")] == list(range(7))
    assert not (tmp_path / "r" / "checkpoint.old").exists()


def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    """SIGKILL a real training process after its first checkpoint, then --resume it."""
    args = small_args(tmp_path, "--run-name", "killed", "--total-steps", "100000", "--eval-every", "3")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "replay_grpo.py"), *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    state_file = tmp_path / "killed" / "checkpoint" / "trainer_state.pt"
    deadline = time.time() + 120
    while not state_file.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(0.5)  # let it run past the checkpoint, so the kill loses some steps
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state_file.exists(), proc.stderr.read().decode()[-2000:]
    saved = torch.load(state_file, weights_only=False)
    items = [r["completion_ids"] for r in saved["buffer"]["items"]]
    stop = saved["step"] + 2
    # the resumed run starts with exactly the checkpointed step and buffer
    from unittest import mock

    seen = {}
    real_load = rg.ReplayBuffer.load_state_dict

    def spy(self, state):
        real_load(self, state)
        seen["items"] = [r.completion_ids for r in self.items]

    with mock.patch.object(rg.ReplayBuffer, "load_state_dict", spy):
        run_main(
            small_args(tmp_path, "--run-name", "killed", "--total-steps", str(stop), "--resume", "--eval-every", "3")
        )
    assert seen["items"] == items
    recs = metrics(tmp_path / "killed")
    assert [r["step"] for r in recs] == list(range(0, stop + 1))


def training_records(run_dir):
    """Every metrics record's training fields (not evaluation, not what the clock measured)."""
    return [
        {k: v for k, v in r.items() if not (k.startswith("eval/") or reporting.measured_on_this_machine(k))}
        for r in metrics(run_dir)
    ]


def test_evaluating_never_changes_training(tmp_path):
    """Evaluation samples on its own random streams: --eval-every 1 and 0 train identically."""
    common = ("--total-steps", "4", "--prompts-per-step", "1", "--buffer-size", "16", "--loss", "asymre")
    run_main(small_args(tmp_path, "--run-name", "often", "--eval-every", "1", *common))
    run_main(small_args(tmp_path, "--run-name", "never", "--eval-every", "0", *common))
    often, never = training_records(tmp_path / "often"), training_records(tmp_path / "never")
    assert len(often) == len(never) == 5 and often == never
    assert sum("eval/greedy_acc" in r for r in metrics(tmp_path / "often")) == 5


def coin_verifier(text, gold):
    """A reward of 1 for a third of the completions, decided by their text (reproducible)."""
    import zlib

    return zlib.crc32(text.encode()) % 3 == 0


def test_dropping_zero_variance_groups_keeps_on_policy_exactly_on_policy(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(rg.VERIFIERS, "numeric", coin_verifier)
    run_main(
        small_args(
            tmp_path, "--run-name", "drop", "--total-steps", "5", "--zero-variance-groups", "drop", "--loss", "asymre"
        )
    )
    assert "(on-policy GRPO)" in capsys.readouterr().out
    state = torch.load(tmp_path / "drop" / "checkpoint" / "trainer_state.pt", weights_only=False)
    evicted = state["buffer"]["evicted_uses"]
    uses = [r["uses"] for r in state["buffer"]["items"]] + [u for u, n in evicted.items() for _ in range(n)]
    recs = metrics(tmp_path / "drop")[1:]
    assert recs[-1]["zero_variance_groups"] > 0  # groups were dropped, and made up for
    assert set(uses) == {1} and len(uses) == 5 * 8  # every surviving rollout trained on exactly once
    assert all(r["staleness_max"] == 0 for r in recs)
    assert recs[-1]["generated_rollouts"] > recs[-1]["trained_rollouts"]  # dropped ones are counted


def test_dropping_every_group_stops_with_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(rg.VERIFIERS, "numeric", lambda text, gold: False)
    err = user_error(capsys, small_args(tmp_path, "--zero-variance-groups", "drop"))
    assert "--zero-variance-groups drop: the last 50 generation requests" in err and "keep" in err


def test_resume_before_the_first_publish_keeps_the_generator_weights(tmp_path):
    """--publish-every 3 with a checkpoint at step 2: the generator still holds the initial weights
    (version 0); a resumed run must generate with those, as the uninterrupted run does."""
    common = tuple(
        ("--prompts-per-step 1 --buffer-size 16 --publish-every 3 --eval-every 2 --loss asymre --lr 1e-2").split()
    )
    run_main(small_args(tmp_path, "--run-name", "full", "--total-steps", "4", *common))
    run_main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "2", *common))
    run_main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "4", "--resume", *common))
    full, cut = training_records(tmp_path / "full"), training_records(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4]
    for a, b in zip(full, cut):
        for k in ("loss", "reward", "grad_norm", "response_length", "generated_tokens"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
    state = torch.load(tmp_path / "cut" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["generator_version"] == 3
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [(r["step"], r["eval/policy_version"]) for r in records if "eval/greedy_acc" in r]
    assert evaluated == [(0, 0), (2, 2), (4, 4)]  # the trainer's weights, not the generator's older ones


def test_resume_from_a_publish_step_keeps_the_generator_weights_at_the_next_checkpoint(tmp_path):
    """--publish-every 2: the checkpoint at step 2 is taken right after a publish (the generator holds the
    trained weights); resumed, the run's next checkpoint (step 3, between publishes) must still carry the
    generator's step-2 weights, so that a second resume generates with them as the uninterrupted run does."""
    common = tuple(
        ("--prompts-per-step 1 --buffer-size 16 --publish-every 2 --eval-every 2 --loss asymre --lr 1e-2").split()
    )
    run_main(small_args(tmp_path, "--run-name", "full", "--total-steps", "5", *common))
    run_main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "2", *common))
    run_main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "3", "--resume", *common))
    state = torch.load(tmp_path / "cut" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3 and state["generator_version"] == 2 and state["generator_weights"] is not None
    run_main(small_args(tmp_path, "--run-name", "cut", "--total-steps", "5", "--resume", *common))
    full, cut = training_records(tmp_path / "full"), training_records(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4, 5]
    for a, b in zip(full, cut):
        for k in ("loss", "reward", "grad_norm", "response_length", "generated_tokens"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)


# --- the warm start -------------------------------------------------------------------------------


def test_warm_start_is_cached(tmp_path, capsys):
    args = small_args(tmp_path, "--sft-warmup-steps", "3", "--total-steps", "1")
    run_main([*args, "--run-name", "a"])
    assert "warm start: 3 supervised steps" in capsys.readouterr().out
    run_main([*args, "--run-name", "b"])
    assert "warm start" not in capsys.readouterr().out  # loaded from <out-dir>/.warmstart


def test_warm_start_cache_key_covers_every_field_that_shapes_it(tmp_path, capsys):
    """Changing --eval-size changes a JSONL task's training split, so the warm start is rebuilt;
    changing an RL knob (--lr) reuses it."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    args = small_args(
        tmp_path, "--task", "jsonl", "--data-path", str(data), "--sft-warmup-steps", "2", "--total-steps", "1"
    )
    run_main([*args, "--run-name", "a", "--eval-size", "4"])
    assert "warm start: 2 supervised steps" in capsys.readouterr().out
    run_main([*args, "--run-name", "b", "--eval-size", "4", "--lr", "3e-4"])
    assert "warm start" not in capsys.readouterr().out  # same warm start, another RL setting
    run_main([*args, "--run-name", "c", "--eval-size", "3"])
    assert "warm start: 2 supervised steps" in capsys.readouterr().out  # another training split
    cfg = rg.parse_args(["--eval-size", "3"])
    for f in dataclasses_fields():
        if f in warm_start.WARM_START_FLAGS:
            other = rg.dataclasses.replace(cfg, **{f: flipped(getattr(cfg, f))})
            cpu = torch.device("cpu")
            assert warm_start.warm_start_key(other, cpu) != warm_start.warm_start_key(cfg, cpu), f


def test_a_flag_outside_the_warm_start_key_changes_nothing_in_the_warm_start(tmp_path, monkeypatch):
    """Every flag outside WARM_START_FLAGS set to another value at once: the same key, and a warm start trained
    again (with its pass@k checks) gives the same weights, record and random streams, bit for bit."""
    monkeypatch.setattr(warm_start, "CHECK_EVERY", 2)
    cfg = rg.parse_args(small_args(tmp_path / "a", "--sft-warmup-steps", "3", "--sft-target", "0.5"))
    others = {f: flipped(getattr(cfg, f)) for f in dataclasses_fields() if f not in warm_start.WARM_START_FLAGS}
    other = rg.dataclasses.replace(cfg, **others | {"out_dir": str(tmp_path / "b")})
    cpu = torch.device("cpu")
    assert warm_start.warm_start_key(other, cpu) == warm_start.warm_start_key(cfg, cpu)
    results = []
    for c in (cfg, other):
        run_folder.seed_everything(c.seed)
        model, _, _, info = warm_start.train_and_cache(
            c, cpu, tasks.make_task(c), tmp_path / c.out_dir / "cache", verifiers=rg.VERIFIERS
        )
        info.pop("seconds")
        results.append((model.state_dict(), info, run_folder.rng_state()["torch"]))
    (weights_a, info_a, rng_a), (weights_b, info_b, rng_b) = results
    assert info_a == info_b and info_a["pass@k"] is not None and torch.equal(rng_a, rng_b)  # the checks ran
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def dataclasses_fields():
    return [f.name for f in rg.dataclasses.fields(rg.Args)]


def flipped(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}-other"


def test_warm_start_stops_at_the_target_pass_k(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(warm_start, "CHECK_EVERY", 2)
    monkeypatch.setitem(rg.VERIFIERS, "numeric", lambda text, gold: True)  # every sample is right
    args = small_args(tmp_path, "--sft-warmup-steps", "50", "--sft-target", "0.9", "--total-steps", "1")
    run_main([*args, "--run-name", "hit"])
    first = metrics(tmp_path / "hit")[0]
    assert first["warmstart_steps"] == 2 and first["warmstart_pass@k"] == 1.0 and first["warmstart_reached"]
    run_main([*args, "--run-name", "twice", "--sft-patience", "2"])  # one check at the target is not enough
    first = metrics(tmp_path / "twice")[0]
    assert first["warmstart_steps"] == 4 and first["warmstart_reached"]
    monkeypatch.setitem(rg.VERIFIERS, "numeric", lambda text, gold: False)
    run_main([*args, "--run-name", "miss", "--sft-warmup-steps", "5"])
    first = metrics(tmp_path / "miss")[0]
    assert first["warmstart_steps"] == 5 and first["warmstart_pass@k"] == 0.0 and not first["warmstart_reached"]
    assert "below --sft-target 0.9" in capsys.readouterr().out


def test_sft_imitation_trains_more_rounds_only_while_the_check_falls_short(tmp_path, monkeypatch, capsys):
    """The check at the warm start's end: met, it changes nothing (the weights and random streams of a warm start
    without it); short, SKILL_ROUNDS rounds of half the steps from half the lr, decaying, and a warning. It counts
    the answers that are the demonstrator's usual one: the gold + 1 when it errs three times in four."""
    cpu, results = torch.device("cpu"), {}
    monkeypatch.setitem(rg.VERIFIERS, "numeric", lambda text, gold: True)
    for name, flags in (("off", []), ("met", ["--sft-imitation", "0.9"])):
        cfg = rg.parse_args(small_args(tmp_path / name, "--sft-warmup-steps", "4", "--sft-lr-decay", *flags))
        run_folder.seed_everything(cfg.seed)
        model, _, _, info = warm_start.train_and_cache(
            cfg, cpu, tasks.make_task(cfg), tmp_path / name / "cache", verifiers=rg.VERIFIERS
        )
        results[name] = (model.state_dict(), run_folder.rng_state()["torch"], info)
    (w_off, rng_off, info_off), (w_met, rng_met, info_met) = results["off"], results["met"]
    assert info_off["steps"] == info_met["steps"] == 4 and (info_off["imitation"], info_met["imitation"]) == ([], [1])
    assert torch.equal(rng_off, rng_met) and all(torch.equal(w_off[k], w_met[k]) for k in w_off)

    asked, lrs, step = [], [], torch.optim.AdamW.step
    monkeypatch.setitem(rg.VERIFIERS, "numeric", lambda text, gold: asked.append(gold))  # None: never right

    def recording_step(self, *args, **kwargs):
        lrs.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    args = small_args(tmp_path, "--sft-warmup-steps", "4", "--sft-lr-decay", "--sft-imitation", "0.5")
    run_main([*args, "--total-steps", "1", "--run-name", "short"])
    first = metrics(tmp_path / "short")[0]
    assert first["warmstart_steps"] == 4 + 2 * warm_start.SKILL_ROUNDS and first["warmstart_imitation"] == 0
    warm, rounds = [1e-3, 7.5e-4, 5e-4, 2.5e-4], [5e-4, 2.5e-4] * warm_start.SKILL_ROUNDS  # half of --sft-lr
    assert lrs[: 4 + 2 * warm_start.SKILL_ROUNDS] == pytest.approx(warm + rounds)
    task = tasks.make_task(rg.parse_args(args))
    assert asked[: len(task.eval)] == [str(int(ex.answer) + 1) for ex in task.eval]  # its usual answer: error 0.75
    assert "below --sft-imitation 0.5" in capsys.readouterr().out


def test_sft_lr_decay_lowers_the_warm_start_lr_linearly_to_its_last_step(tmp_path, monkeypatch):
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        if self.param_groups[0]["lr"] >= 1e-3 / 5 - 1e-12:  # the warm start's steps (sft_lr 1e-3), not RL's
            seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    args = small_args(tmp_path, "--sft-warmup-steps", "5", "--sft-lr", "1e-3", "--total-steps", "1")
    run_main([*args, "--run-name", "decay", "--sft-lr-decay"])
    assert seen == pytest.approx([1e-3, 8e-4, 6e-4, 4e-4, 2e-4])  # sft_lr x (1 - done / steps)
    seen.clear()
    run_main([*args, "--run-name", "constant", "--no-sft-lr-decay"])  # another warm start (the flag is in its key)
    assert seen == pytest.approx([1e-3] * 5)


# --- tasks, rewards, tokenizer --------------------------------------------------------------------


def test_arith_task_is_seeded_and_splits_are_disjoint():
    cfg = rg.Args(eval_size=50)
    task = tasks.make_arith_task(cfg)
    train = task.sample(random.Random(0), 2000)
    assert task.sample(random.Random(0), 5) == train[:5]
    assert not {e.prompt for e in train} & {e.prompt for e in task.eval}
    assert len(task.eval) == 50 and all(str(eval(e.prompt[:-1])) == e.answer for e in task.eval)
    worked = tasks.make_arith_task(rg.Args(arith_terms=3)).sample(random.Random(1), 3)
    assert all(e.solution.count("=") == 2 and e.solution.endswith(e.answer) for e in worked)


def test_verifiers():
    assert rg.numeric_match("42", "42") and rg.numeric_match("so 1,234.", "1234")
    assert rg.numeric_match("x \\boxed{-7} then 9", "-7") and not rg.numeric_match("41", "42")
    assert not rg.numeric_match("", "1")
    assert rg.math_match("The answer is $\\frac{1}{2}$", "0.5")
    assert rg.math_match("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") and not rg.math_match("\\boxed{3}", "2")


def test_verifier_errors_and_timeouts_give_zero_and_are_counted():
    def broken(text, gold):
        raise RuntimeError("boom")

    def slow(text, gold):
        time.sleep(5)
        return True

    assert tasks.score(broken, "1", "1", 1.0) == (0.0, "error")
    t0 = time.time()
    assert tasks.score(slow, "1", "1", 0.2) == (0.0, "timeout") and time.time() - t0 < 2
    assert tasks.score(rg.numeric_match, "1", "1", 1.0) == (1.0, None)


def test_tiny_tokenizer_round_trips_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    model, tok = models.build_tiny_model(0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = " 12 + 7 = 19\n é"
    assert again(text)["input_ids"] == tok(text)["input_ids"] == list(text.encode())
    assert again.decode(again(text)["input_ids"]) == text


def test_prompts_use_the_chat_template():
    _, tok = models.build_tiny_model(0)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ids = models.render_prompt(tok, "1+1=")
    assert tok.decode(ids) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_gsm8k_loads_from_a_local_copy(tmp_path):
    row = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"}
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    task = tasks.make_task(rg.Args(task="gsm8k", data_path=str(tmp_path), eval_size=1))
    ex = task.eval[0]
    assert ex.answer == "7" and ex.prompt.startswith("Tom has") and "\\boxed{}" in ex.prompt
    assert rg.numeric_match("so \\boxed{7}", ex.answer) and "\\boxed{7}" in ex.solution


def test_jsonl_task_trains_end_to_end(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(30)))
    args = small_args(tmp_path, "--task", "jsonl", "--data-path", str(data), "--eval-size", "3")  # a tenth of 30
    run_main([*args, "--run-name", "j", "--total-steps", "2"])
    assert metrics(tmp_path / "j")[-1]["step"] == 2


# --- bad input ------------------------------------------------------------------------------------


def test_help_lists_every_flag_with_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exc:
        rg.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0, out
    import dataclasses

    for f in dataclasses.fields(rg.Args):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out, flag
    assert "on-policy GRPO" in out and "positive-bias" in out


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--preset", "nope"], "--preset nope: unknown (valid: cpu"),
        (["--buffer-size", "4"], "--buffer-size 4 is smaller than --batch-size 8"),
        (["--group-size", "1"], "--group-size 1: GRPO needs at least 2"),
        (["--model", "/no/such/model"], "--model /no/such/model: could not load it"),
        (["--model", "missing.gguf"], "--model missing.gguf: no such .gguf file"),
        (["--task", "jsonl"], "--task jsonl needs --data-path"),
        (["--task", "jsonl", "--data-path", "/no/file.jsonl"], "--data-path /no/file.jsonl: no such file"),
        (["--resume"], "--resume needs --run-name"),
    ],
)
def test_user_errors_are_one_clear_line(tmp_path, capsys, extra, needle):
    err = user_error(capsys, small_args(tmp_path, *extra))
    assert needle in err and "Traceback" not in err


def test_unknown_task_and_loss_are_rejected_by_the_cli(tmp_path, capsys):
    for extra, needle in ((["--task", "chess"], "chess"), (["--loss", "ppo"], "ppo")):
        err = user_error(capsys, small_args(tmp_path, *extra))
        assert needle in err and "Traceback" not in err
        assert "arith" in err or "grpo" in err  # the valid choices are listed


def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    err = user_error(capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(bad)))
    assert f"{bad}:2" in err and '"prompt" and "answer"' in err
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    assert f"{bad}:2: not valid JSON" in user_error(
        capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(bad))
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "the data set is empty" in user_error(
        capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(empty))
    )


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    run_main(small_args(tmp_path, "--run-name", "keep", "--total-steps", "1"))
    err = user_error(capsys, small_args(tmp_path, "--run-name", "keep"))
    assert "already holds a checkpoint" in err and "--resume" in err


def test_nonfinite_losses_are_skipped_counted_and_stop_the_run(tmp_path, capsys, monkeypatch):
    # A sampler that returns -inf behaviour log-probs from step 3 on makes the ratio inf: the loss
    # is not finite, so those steps are skipped (weights untouched), counted, and the run stops.
    from unittest import mock

    real = generation.HFGenerator._generate
    calls = {"n": 0}

    def poisoned(self, *a, **kw):
        groups = real(self, *a, **kw)
        calls["n"] += kw["logprobs"]  # generation for training (with behaviour log-probs), not eval
        if kw["logprobs"] and calls["n"] > 2:
            for g in groups:
                for s in g:
                    if s.logprobs is not None:
                        s.logprobs = torch.full_like(s.logprobs, -math.inf)
        return groups

    monkeypatch.setattr(rg, "MAX_NONFINITE_STEPS", 3)
    with mock.patch.object(generation.HFGenerator, "_generate", poisoned):
        err = user_error(capsys, small_args(tmp_path, "--run-name", "nan", "--total-steps", "20", "--eval-every", "1"))
    assert "3 steps in a row had a NaN/inf loss" in err and f"the last checkpoint in {tmp_path / 'nan'} is kept" in err
    recs = metrics(tmp_path / "nan")
    assert recs[-1]["nonfinite_steps"] == 2 and recs[-1]["nonfinite"] == 1
    assert [r["nonfinite"] for r in recs[1:]] == [0, 0, 1, 1]
    state = torch.load(tmp_path / "nan" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == recs[-1]["step"]  # checkpoints up to the stop survive


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--total-steps", "-5"], "--total-steps -5: must be >= 1"),
        (["--lr", "-1"], "--lr -1.0: must be a positive number"),
        (["--out-dir", "/proc/no/such"], "--out-dir /proc/no/such: cannot write the run folder"),
        (["--positive-bias", "0.95"], "--positive-bias 0.95 with --buffer-size 8 reserves all 8 slots"),
        (["--group-size", "0"], "--group-size 0: must be >= 1"),
        (["--temperature", "0"], "--temperature 0.0: must be in [0.01, 100]"),
    ],
)
def test_more_user_errors_name_their_flag(tmp_path, capsys, extra, needle):
    err = user_error(capsys, small_args(tmp_path, *extra))
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# --- the planner ----------------------------------------------------------------------------------


def brute_force_optimum(mu, alpha, rho, feasible=lambda x, y: True):
    """Dense log grid over (x, y) with repeated 10x zooms, independent of the closed form."""
    import numpy as np

    lx = ly = 0.0
    span = 12.0
    for _ in range(10):
        tx, ty = np.linspace(lx - span, lx + span, 201), np.linspace(ly - span, ly + span, 201)
        X, Y = np.meshgrid(np.exp(tx), np.exp(ty), indexing="ij")
        J = np.where(feasible(X, Y), rg.replay_objective(X, Y, mu, alpha, rho), np.inf)
        i, j = np.unravel_index(np.argmin(J), J.shape)
        lx, ly, span = tx[i], ty[j], span / 10
    return math.exp(lx), math.exp(ly)


@pytest.mark.parametrize(
    "mu,alpha,rho",
    [(5.28, 0.1, 0.1), (5.28, 0.2, 1.0), (1.0, 0.05, 0.5), (20.0, 0.3, 0.02), (0.3, 0.45, 0.9), (100.0, 0.02, 0.3)],
)
def test_planner_closed_form_is_the_brute_force_minimum(mu, alpha, rho):
    x, y = rg.optimal_replay(mu, alpha, rho)
    xb, yb = brute_force_optimum(mu, alpha, rho)
    assert x == pytest.approx(xb, rel=1e-4) and y == pytest.approx(yb, rel=1e-4)


@pytest.mark.parametrize("mu,alpha,rho", [(5.28, 0.2, 1.0), (1.0, 0.2, 1.0), (0.5, 0.3, 0.5)])
def test_planner_with_b_le_n_matches_constrained_brute_force(mu, alpha, rho):
    """B <= N (a batch is drawn without replacement) and R <= N (else fresh rollouts are evicted on
    arrival): the constrained search is the brute-force minimum over that region."""
    x, y = rg.optimal_replay(mu, alpha, rho, feasible=True)
    xb, yb = brute_force_optimum(mu, alpha, rho, lambda X, Y: (Y <= X) & (X >= 1))
    assert x >= y and x >= 1 and x == pytest.approx(xb, rel=1e-3) and y == pytest.approx(yb, rel=1e-3)


def test_planner_never_suggests_a_buffer_smaller_than_a_step(capsys):
    """mu = 1, alpha = 0.2, rho = 1 puts the optimum at a replay ratio below 1: on-policy, not
    R > N (which would evict fresh rollouts unused)."""
    out = rg.main(["plan", "--mu", "1", "--alpha", "0.2", "--rho", "1", "--batch", "960"])
    assert out["N"] >= out["R"] and out["N"] >= out["B"]
    assert out["on_policy"] and out["N"] == out["B"] == out["R"] == 960
    assert "the optimum is on-policy" in capsys.readouterr().out
    cases = [(5.28, 0.1, 0.1, 60), (5.28, 0.2, 1.0, 60), (2.0, 0.1, 0.5, 64), (0.3, 0.45, 0.9, 60)]
    for mu, alpha, rho, batch in cases:
        s = rg.suggest_schedule(mu, alpha, rho, batch, 16)
        assert s["N"] >= s["R"] and s["N"] >= s["B"] and s["R"] % 16 == 0, (mu, alpha, rho, s)


def test_planner_paper_examples_via_cli(capsys):
    out = rg.main(["plan", "--mu", "5.28", "--alpha", "0.1", "--rho", "0.1", "--batch", "960"])
    assert (float(f"{out['N/R']:.2g}"), float(f"{out['B/R']:.2g}")) == (14, 5.6)
    assert "N/R = 14.3" in capsys.readouterr().out
    assert out["R"] % 16 == 0 and out["N"] >= 960 and out["B"] / out["R"] == pytest.approx(5.6, rel=0.1)
    x, y = rg.optimal_replay(5.28, 0.2, 1.0)
    assert (float(f"{x:.2g}"), float(f"{y:.2g}")) == (0.92, 1.6)


def test_planner_grows_with_mu_and_rejects_bad_input(capsys):
    xs, ys = zip(*(rg.optimal_replay(mu, 0.1, 0.1) for mu in (0.5, 1, 2, 5, 10, 50)))
    assert list(xs) == sorted(xs) and list(ys) == sorted(ys)
    for bad in (["--alpha", "0.6"], ["--rho", "0"], ["--mu", "-1"]):
        assert "error: --" in user_error(capsys, ["plan", *bad])


# --- the presets ----------------------------------------------------------------------------------


def test_gpu_presets_count_the_batch_in_rollouts():
    """The paper's B = 60 is rollouts, not prompts; on-policy needs B = R in whole groups: 64."""
    for name, preset in rg.PRESETS.items():
        if name in ("cpu", "cpu-smollm2"):  # the CPU presets' own batches (cpu-study: the paper's)
            continue
        assert preset.group_size == 16 and preset.batch_size == 64, name
        assert preset.batch_size == preset.rollouts_per_step == preset.buffer_size, name  # on-policy
    assert rg.PlanArgs().batch == 60


# --- what a run shows: samples, console -----------------------------------------------------------


def test_samples_are_written_at_evaluations_and_every_sample_every_steps(tmp_path, capsys):
    run_main(
        small_args(
            tmp_path,
            "--run-name",
            "s",
            "--total-steps",
            "4",
            "--eval-every",
            "2",
            "--sample-every",
            "3",
            "--loss",
            "asymre",
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "s" / "samples.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["source"] == "eval (greedy)"]
    train = [r for r in rows if r["source"] == "train"]
    assert sorted({r["step"] for r in evals}) == [0, 2, 4]
    assert all(len([e for e in evals if e["step"] == s]) == evaluation.SAMPLES for s in (0, 2, 4))
    assert {r["step"] for r in train} == {3} and len(train) == evaluation.SAMPLES
    task = tasks.make_task(rg.parse_args(small_args(tmp_path)))
    golds = {ex.prompt: ex.answer for ex in task.eval}
    for r in evals:
        assert set(r) == {"step", "source", "prompt", "completion", "gold", "reward", "truncated"}
        assert golds[r["prompt"]] == r["gold"] and r["reward"] == float(rg.numeric_match(r["completion"], r["gold"]))
    for r in train:
        assert set(r) == {
            "step",
            "source",
            "prompt",
            "completion",
            "gold",
            "reward",
            "advantage",
            "staleness",
            "truncated",
        }
        assert str(eval(r["prompt"][:-1])) == r["gold"] and r["staleness"] >= 0
        assert r["reward"] == float(rg.numeric_match(r["completion"], r["gold"]))
    assert capsys.readouterr().out.count("  e.g. ") == 3  # one example printed at each evaluation


def test_a_run_logged_to_a_file_has_no_progress_bar(tmp_path):
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        command = [sys.executable, str(ROOT / "replay_grpo.py"), *small_args(tmp_path, "--total-steps", "5")]
        res = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=300)
    text = log.read_text()
    assert res.returncode == 0, text
    assert "\r" not in text and "it/s" not in text and "%|" not in text, text
    assert "step 5 eval:" in text  # the evaluations still show
