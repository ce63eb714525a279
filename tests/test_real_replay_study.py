"""real_replay_study.py on hand-written records: the cost to a level (interpolated, censored at 1.5 x the budget), the
geometric mean over the levels, the verdicts, the break-even mu, the bootstrap's determinism, and the run folders
read end to end and reported again from the records alone, byte for byte."""

import json
import math

import numpy as np
import pytest
import real_replay_study as rrs
import sweep
from studylib import runner

MU = rrs.PAPER_MU
PRODUCT_OF_FRACTIONS = 0.84 * 0.88 * 0.92 * 0.96


def run(arm: str, seed: int, evals: list[tuple], wall: float = 600.0) -> dict:
    """A compact record; evals: (step, trained, generated, accuracy), tokens 10 per generated rollout."""
    return {
        "arm": arm,
        "seed": seed,
        "made": None,
        "wall_seconds": wall,
        "cfg": {"lr": 1e-5},
        "evals": [
            dict(step=s, trained_rollouts=t, generated_rollouts=g, total_generated_tokens=10 * g, greedy_acc=a)
            for s, t, g, a in evals
        ],
        "m2_by_staleness": {},
    }


def records(on: list[list[tuple]], replay: list[list[tuple]]) -> dict:
    return {
        "runs": [run("on-policy", 10 + i, e) for i, e in enumerate(on)]
        + [run("replay", 10 + i, e) for i, e in enumerate(replay)]
    }


ONE_JUMP = [(0, 0, 0, 0.0), (5, 100, 100, 1.0)]  # accuracy 0 -> 1 over compute 0 -> 628 at mu 5.28


def test_a_seed_reaches_a_level_between_two_evaluations_linearly_exactly_at_one_and_never_costs_the_censored_value():
    acc, x = np.array([0.3, 0.5, 0.9]), np.array([0.0, 1004.8, 2009.6])
    levels = np.array([0.5, 0.7, 0.95, 0.1 * 3])  # 0.1 * 3 is 0.30000000000000004: step 0's 0.3 reaches it
    cost = rrs.at_crossing(x, rrs.crossing(acc, levels), censored=3014.4)
    assert cost == pytest.approx([1004.8, 1004.8 + 0.5 * 1004.8, 3014.4, 0.0], abs=1e-9)
    last = rrs.crossing(np.array([0.0, 0.9 * 1 / 3]), np.array([0.1 * 3]))  # reached at the last evaluation only
    assert rrs.at_crossing(np.array([0.0, 628.0]), last, censored=942.0) == pytest.approx([628.0])

    # through the report: on-policy's mean best (1.0 + 0.6) / 2 = 0.8, levels 0.672 ... 0.768; compute = 6.28 x
    # trained; budget 2009.6; seed 10 crosses between 0.5 at 1004.8 and 1.0 at 2009.6, at 2009.6 x level; seed 11
    # never does: 1.5 x 2009.6 = 3014.4
    a = [(0, 0, 0, 0.3), (5, 160, 160, 0.5), (10, 320, 320, 1.0)]
    b = [(0, 0, 0, 0.3), (5, 160, 160, 0.5), (10, 320, 320, 0.6)]
    s = rrs.analyse(records([a, b], [a, b]), replicates=10)
    assert s["budget"]["compute"] == pytest.approx(2009.6)
    assert list(s["levels"].values()) == pytest.approx([0.672, 0.704, 0.736, 0.768])
    seed_10, seed_11 = s["runs"]["on-policy"]
    assert list(seed_10["cost"].values()) == pytest.approx([2009.6 * L for L in (0.672, 0.704, 0.736, 0.768)])
    assert list(seed_11["cost"].values()) == [math.inf] * 4
    assert s["compute"]["cost"]["on-policy"]["84%"] == pytest.approx((2009.6 * 0.672 + 3014.4) / 2)
    assert s["compute"]["reached"]["on-policy"] == {"84%": 1, "88%": 1, "92%": 1, "96%": 1}


def test_the_ratio_is_the_geometric_mean_over_the_levels_of_replays_cost_over_on_policys():
    assert rrs.ratio(np.array([2.0, 4.0, 8.0, 16.0]), np.ones(4)) == pytest.approx(4 * math.sqrt(2))
    # on-policy reaches level L at 628 L; replay at 100, 133.3, 166.7, 200 (0 -> 0.84 -> 0.96 over 0 -> 100 -> 200)
    replay = [(0, 0, 0, 0.0), (3, 100, 0, 0.84), (6, 200, 0, 0.96)]
    s = rrs.analyse(records([ONE_JUMP], [replay]), replicates=10)
    expected = (100 * (400 / 3) * (500 / 3) * 200 / (PRODUCT_OF_FRACTIONS * 628**4)) ** 0.25
    assert s["compute"]["ratio"] == pytest.approx(expected)
    assert s["compute"]["ratio_by_level"]["84%"] == pytest.approx(100 / (0.84 * 628))


def test_identical_arms_give_a_ratio_of_exactly_one_and_their_seeds_spread_leaves_it_undecided():
    seeds = [
        [(0, 0, 0, 0.2), (5, 100, 100, 1.0), (10, 200, 200, 1.0)],  # reaches every level in the first interval
        [(0, 0, 0, 0.2), (5, 100, 100, 0.4), (10, 200, 200, 1.0)],
        [(0, 0, 0, 0.2), (5, 100, 100, 0.3), (10, 200, 200, 0.5)],  # never reaches one
    ]
    s = rrs.analyse(records(seeds, seeds))
    low, high = s["compute"]["interval"]
    assert s["compute"]["ratio"] == 1.0 and s["tokens"]["ratio"] == 1.0
    assert low < 0.85 and high > 1.0 and s["compute"]["verdict"] == "undecided"
    assert math.isnan(s["break_even_mu"]["mu"])
    assert s["break_even_mu"]["replay_pays"] == "ratio equal to 1 at every mu in [0, 1000]"


def test_replay_reaching_every_level_at_half_the_compute_on_tight_seeds_saves_compute_with_a_ratio_of_one_half():
    on = [(0, 0, 0, 0.3), (5, 160, 160, 0.7), (10, 320, 320, 0.9)]
    replay = [(0, 0, 0, 0.3), (5, 80, 80, 0.7), (10, 160, 160, 0.9)]  # every count halved: cost halved at any mu
    s = rrs.analyse(records([on] * 3, [replay] * 3))
    assert s["compute"]["ratio"] == pytest.approx(0.5) and s["tokens"]["ratio"] == pytest.approx(0.5)
    assert s["compute"]["interval"] == pytest.approx([0.5, 0.5])
    assert s["compute"]["verdict"] == "saves compute"
    assert s["break_even_mu"]["replay_pays"] == "ratio under 1 at every mu in [0, 1000]"


def test_a_replay_arm_that_never_reaches_a_level_is_contradicted_at_one_and_a_half_budgets_a_level():
    never = [(0, 0, 0, 0.3), (9, 100, 50, 0.3), (18, 200, 100, 0.3)]
    s = rrs.analyse(records([ONE_JUMP] * 2, [never] * 2))
    # on-policy reaches level L at 628 L, replay never: 1.5 x 628 at each level, so the ratio is 1.5 / L's mean
    expected = 1.5 / PRODUCT_OF_FRACTIONS**0.25
    assert s["compute"]["ratio"] == pytest.approx(expected)
    assert s["compute"]["interval"] == pytest.approx([expected, expected])
    assert s["compute"]["verdict"] == "contradicted"
    assert s["compute"]["reached"]["replay"] == dict.fromkeys(rrs.LEVEL_NAMES, 0)


def test_the_break_even_mu_is_where_the_ratio_on_that_mus_compute_axis_is_one():
    # at each level L: on-policy L (100 + 100 mu), replay L (200 + 50 mu): equal at mu = 2, replay cheaper above
    replay = [(0, 0, 0, 0.0), (9, 200, 50, 1.0)]
    s = rrs.analyse(records([ONE_JUMP] * 2, [replay] * 2))
    b = s["break_even_mu"]
    assert b["mu"] == pytest.approx(2.0) and b["interval"] == pytest.approx([2.0, 2.0])
    assert b["replay_pays"] == "above" and b["resamples_crossing"] == 1.0
    assert b["ratio_at_zero"] == pytest.approx(2.0)
    assert b["ratio_at_paper_mu"] == pytest.approx((200 + 50 * MU) / (100 + 100 * MU))
    assert s["compute"]["ratio"] == pytest.approx((200 + 50 * MU) / (100 + 100 * MU))


def test_the_area_is_taken_to_the_budget_cut_there_or_carried_flat_from_the_runs_end():
    x, acc = np.array([0.0, 100.0, 200.0, 300.0]), np.array([0.0, 1.0, 0.5, 0.5])
    assert rrs.area_to(x, acc, budget=150.0) == pytest.approx(50 + 50 * (1 + 0.75) / 2)
    assert rrs.area_to(x[:3], acc[:3], budget=300.0) == pytest.approx(50 + 75 + 50)


def test_the_bootstrap_is_deterministic():
    on = [[(0, 0, 0, 0.2), (5, 100, 100, a), (10, 200, 200, b)] for a, b in ((0.9, 0.8), (0.5, 1.0), (0.4, 0.6))]
    replay = [[(0, 0, 0, 0.2), (9, 120, 60, a), (18, 240, 120, b)] for a, b in ((0.7, 0.9), (0.3, 0.95))]
    first, again = (json.dumps(rrs.analyse(records(on, replay)), sort_keys=True) for _ in range(2))
    assert first == again
    low, high = json.loads(first)["compute"]["interval"]
    assert low < high  # resamples that differ, drawn the same way twice


def test_a_run_at_a_reuse_scaled_learning_rate_is_reported_at_the_rate_it_trained_at():
    recs = records([ONE_JUMP] * 2, [ONE_JUMP] * 2)
    scaled = {"lr": 1e-5, "lr_reuse_exponent": 1.0, "prompts_per_step": 2, "group_size": 8, "batch_size": 32}
    for r in recs["runs"][2:]:
        r["cfg"] = dict(scaled)
    s = rrs.analyse(recs)
    assert s["arms"]["replay"]["lrs"] == [pytest.approx(5e-6)] and s["runs"]["replay"][0]["lr"] == pytest.approx(5e-6)
    assert s["arms"]["on-policy"]["lrs"] == [1e-5]
    del scaled["batch_size"]
    assert "batch_size" in rrs.problem(recs["runs"][0] | {"cfg": scaled})


def write_run(folder, arm_seed: tuple, steps: int, every: int, per_step: tuple) -> None:
    """A run folder as replay_grpo.py writes one: step 0 evaluated before any count, R generated and B trained a step,
    accuracy rising by 0.1 an evaluation; a step's M2 0.01 on 100 tokens of bucket 0 (even steps: 0.04 on 300, and
    0.1 on 50 of bucket 1), the last record's mu and counts."""
    arm, seed = arm_seed
    R, B = per_step
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"seed": seed, "lr": 1e-5, "total_steps": steps, "max_drift": None}))
    (folder / "machines.jsonl").write_text(json.dumps({"time": f"2026-12-07T09:{seed}:00", "machine": {}}) + "\n")
    lines = [{"step": 0, "eval/greedy_acc": 0.3, "eval/greedy_acc_untwinned": 0.25}]
    for t in range(1, steps + 1):
        m2 = {"0": (0.04, 300), "1": (0.1, 50)} if t % 2 == 0 else {"0": (0.01, 100)}
        r = {"step": t, "generated_rollouts": R * t, "trained_rollouts": B * t, "total_generated_tokens": 9 * R * t}
        r["offpolicy_by_staleness"] = {b: {"m2": v, "mismatch_kl": 0.0} for b, (v, _) in m2.items()}
        r["by_staleness"] = {b: {"tokens": n, "rollouts": 1} for b, (_, n) in m2.items()}
        if t % every == 0 or t == steps:
            r["eval/greedy_acc"] = 0.3 + 0.1 * ((t + every - 1) // every) + (0.05 if arm == "replay" else 0.0)
        lines.append(r)
    lines[-1] |= {"mu": 0.3, "zero_signal_steps": 2, "zero_signal_skipped_steps": 0, "evicted": {"drift": 3}}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_the_run_folders_are_read_and_their_records_give_the_same_report_byte_for_byte(tmp_path):
    runs = tmp_path / "runs"
    for arm, steps, every, per_step in (("on-policy", 4, 2, (32, 32)), ("replay", 6, 3, (16, 32))):
        for seed in (10, 11, 12):
            write_run(runs / arm / str(seed) / "run", (arm, seed), steps, every, per_step)
        # seed 12 has no wall time: unfinished, left out
        (runs / arm / "seed_table.json").write_text(json.dumps({"10": 600.0, "11": 660.0}))
    s = rrs.main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])
    kept = runner.read_records(tmp_path / "a" / runner.RECORDS, keys=("arm", "seed"), check=rrs.problem)["runs"]
    assert [(r["arm"], r["seed"]) for r in kept] == [
        ("on-policy", 10),
        ("on-policy", 11),
        ("replay", 10),
        ("replay", 11),
    ]
    first = kept[0]
    assert first["evals"][0] == dict(
        step=0, generated_rollouts=0, trained_rollouts=0, total_generated_tokens=0, greedy_acc=0.3
    ) | {"greedy_acc_untwinned": 0.25}
    assert first["evals"][1] == pytest.approx(
        dict(step=2, generated_rollouts=64, trained_rollouts=64, total_generated_tokens=576, greedy_acc=0.4)
    )
    # bucket 0 over the 4 steps: (2 x 0.01 x 100 + 2 x 0.04 x 300) / 800 tokens; bucket 1: even steps only
    assert first["m2_by_staleness"] == {"0": {"m2": pytest.approx(0.0325), "steps": 4}, "1": {"m2": 0.1, "steps": 2}}
    assert (first["made"], first["wall_seconds"], first["mu"]) == ("2026-12-07T09:10:00", 600.0, 0.3)
    assert (first["zero_signal_steps"], first["evicted"], first["cfg"]) == (
        2,
        {"drift": 3},
        {"lr": 1e-5, "total_steps": 4, "max_drift": None},
    )
    # on-policy's budget: 128 trained + 5.28 x 128 generated; its mean best 0.5
    assert s["budget"]["compute"] == pytest.approx(128 * (1 + MU)) and s["best"] == pytest.approx(0.5)
    assert s["arms"]["replay"]["end_untwinned"] is None and s["runs"]["on-policy"][0]["untwinned"] == {"0": 0.25}

    rrs.main(["--records", str(tmp_path / "a" / runner.RECORDS), "--report-dir", str(tmp_path / "b")])
    for name in ("table.md", "summary.json"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name
    assert (tmp_path / "b" / rrs.FIGURE).stat().st_size > 0
    sweep.render(tmp_path / "a" / "summary.json", tmp_path / "rendered.md")  # the summary names its study
    assert (tmp_path / "rendered.md").read_bytes() == (tmp_path / "a" / "table.md").read_bytes()


def test_a_damaged_recorded_run_is_left_out_and_a_damaged_run_folder_or_a_missing_arm_stops_the_report(
    tmp_path, capsys
):
    data = records([ONE_JUMP] * 2, [ONE_JUMP] * 2)
    data["runs"][1]["evicted"] = {"drift": "three"}
    runner.write_records(tmp_path / "r.json", data, "--records")
    kept = runner.read_records(tmp_path / "r.json", keys=("arm", "seed"), check=rrs.problem)["runs"]
    assert [(r["arm"], r["seed"]) for r in kept] == [("on-policy", 10), ("replay", 10), ("replay", 11)]
    assert "left out, damaged: evictions not counted by reason" in capsys.readouterr().out

    write_run(tmp_path / "runs" / "on-policy" / "10" / "run", ("on-policy", 10), 4, 2, (32, 32))
    (tmp_path / "runs" / "on-policy" / "seed_table.json").write_text(json.dumps({"10": "ten minutes"}))
    with pytest.raises(SystemExit, match="on-policy/10/run: no wall time"):
        rrs.main(["--runs", str(tmp_path / "runs"), "--report-dir", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="the replay arm has no finished run"):
        rrs.analyse(records([ONE_JUMP], []))
