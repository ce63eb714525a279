"""Offline CPU tests of compute_study.py on runs whose answers are known: the IQM, the frontier, the interpolated
and censored crossings, the level band that moves with each resample, the saving and decision, the A/A split, the
grid's equal-compute schedule, and the report rendered again from its summary."""

import json
import math

import compute_study as cs
import numpy as np
import pytest
import sweep
from studylib import report, runner
from test_pareto import fake_run  # a finished run as sweep.load_runs returns it

import replay_grpo

MU = 5.28


def args(**kw) -> cs.Args:
    return cs.Args(**{"h1": "fast", "h2": "slow", "replicates": 100} | kw)


def test_iqm_cuts_a_quarter_from_each_end():
    assert cs.iqm(np.arange(1.0, 9.0)) == pytest.approx(4.5)  # the mean of 3, 4, 5, 6
    assert cs.iqm([0.0, 0.5, 0.5, 0.6, 0.6, 0.7, 0.7, 100.0]) == pytest.approx(0.6)  # outliers at both ends gone
    assert cs.iqm([1.0, 2.0, 4.0]) == pytest.approx(7 / 3)  # under 4 values: nothing to cut
    assert cs.iqm(np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [9.0, 90.0]])).tolist() == [2.5, 25.0]


def test_the_frontier_is_the_running_maximum_of_the_best_learning_rate():
    f = cs.frontier([np.array([0.1, 0.6, 0.4, 0.5]), np.array([0.2, 0.3, 0.7, 0.1])])
    assert f.tolist() == [0.2, 0.6, 0.7, 0.7]


def test_a_crossing_is_interpolated_and_a_miss_costs_the_final_compute():
    x, f = np.array([0.0, 100.0, 200.0]), np.array([0.2, 0.5, 0.9])
    assert cs.first_crossing(x, f, 0.7) == pytest.approx(150.0)
    assert cs.first_crossing(x, f, 0.5) == pytest.approx(100.0)  # on an evaluation: that evaluation's x
    assert cs.first_crossing(x, f, 0.1) == 0.0
    assert cs.first_crossing(x, f, 0.95) == 200.0  # never reached: censored at the run's end


def test_the_saving_is_the_geometric_mean_of_the_cost_ratios():
    assert cs.level_saving([50, 50], [100, 100]) == pytest.approx(50.0)
    assert cs.level_saving([25, 100], [100, 100]) == pytest.approx(50.0)  # sqrt(0.25 * 1) = 0.5
    assert cs.level_saving([200, 200], [100, 100]) == pytest.approx(-100.0)
    assert math.isnan(cs.level_saving([0, 50], [100, 100]))  # a level reached before training


def runs_with(replay: dict[str, tuple], seeds=range(8), shapes=None) -> list[dict]:
    """On-policy (one evaluation a step, R = B = 100: 628 compute a step at mu 5.28) at two lrs on `seeds`, and
    replay arms {name: (R, B, factor)} whose curves are on-policy's with each evaluation's accuracy times factor."""
    shapes = shapes or {1e-5: [0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 1.0], 3e-5: [0.0, 0.4, 0.5, 0.7, 0.85, 0.9, 0.9]}
    runs = []
    for s in seeds:
        noise = 0.02 * ((s * 7) % 5 - 2)  # a seed moves the whole curve a little
        for lr, shape in shapes.items():
            accs = [min(1.0, max(0.0, a + noise * (i > 0))) for i, a in enumerate(shape)]
            runs.append(fake_run("onpolicy", lr, s, accs, R=100, B=100))
            for name, (R, B, factor) in replay.items():
                runs.append(fake_run(name, lr, s, [a * factor for a in accs], R=R, B=B))
    return runs


def test_a_curve_at_half_the_compute_saves_half_and_is_met():
    # 182 trained + 5.28 x 25 generated = 314 a step, half of on-policy's 628: every level costs half
    s = cs.analyse(runs_with({"fast": (25, 182, 1.0), "slow": (100, 100, 1.0)}), args())
    fast, slow = s["point"]["configs"]["fast"], s["point"]["configs"]["slow"]
    assert fast["saving"] == pytest.approx(50.0) and slow["saving"] == pytest.approx(0.0, abs=1e-9)
    assert all(r == pytest.approx(0.5) for r in fast["ratio"].values())
    assert s["interval_90"]["configs"]["fast"]["saving"] == pytest.approx([50.0, 50.0])  # so in every resample
    assert set(s["interval_90"]["configs"]["fast"]["reached"].values()) == {1.0}
    assert s["decision"] == {"H1": "met", "H2": "not met"}  # H2 tested, and 0% is not 30%
    assert s["point"]["best"] == pytest.approx(cs.iqm([min(1.0, 1.0 + 0.02 * ((k * 7) % 5 - 2)) for k in range(8)]))


def test_h2_is_not_tested_when_h1_is_not_met():
    s = cs.analyse(runs_with({"fast": (100, 100, 1.0), "slow": (25, 182, 1.0)}), args())
    assert s["point"]["configs"]["slow"]["saving"] == pytest.approx(50.0)
    assert s["decision"]["H1"] == "not met"
    assert s["decision"]["H2"] == "not tested (H1 not met); met by itself"


def test_a_frontier_that_misses_levels_is_charged_its_final_compute():
    # at 0.9 of on-policy's accuracy the replay frontier ends below the upper levels: those cost its final compute
    s = cs.analyse(runs_with({"fast": (25, 182, 0.9), "slow": (100, 100, 1.0)}), args())
    row, best = s["point"]["configs"]["fast"], s["point"]["best"]
    final = 6 * 314.0
    for name, f in zip(cs.LEVEL_NAMES, cs.LEVELS):
        reached = row["frontier"]["6"] >= f * best
        assert row["reached"][name] == float(reached)
        assert row["cost"][name] < final + 1e-9 if reached else row["cost"][name] == pytest.approx(final)
        share = s["interval_90"]["configs"]["fast"]["reached"][name]  # of the resamples
        assert 0 <= share <= 1 and (share > 0.5 if f < 0.87 else True) and (share < 1 if not reached else True)
    assert not all(row["reached"].values()) and any(row["reached"].values())


def test_the_levels_move_with_each_resample():
    # two kinds of seed: on-policy ends at 1.0 or at 0.5; replay reaches 0.9 after its first step on both
    on = {0: [0.0, 0.5, 1.0], 1: [0.0, 0.25, 0.5]}
    runs = []
    for s in range(4):
        runs.append(fake_run("onpolicy", 1e-5, s, on[s % 2], R=100, B=100))
        runs.append(fake_run("fast", 1e-5, s, [0.0, 0.9, 0.9], R=100, B=100))
        runs.append(fake_run("slow", 1e-5, s, [0.0, 0.9, 0.9], R=100, B=100))
    arms = cs.arms_of(report.cells_of(runs, MU)[0])
    high = cs.estimates(arms, "onpolicy", np.array([0, 0, 2, 2]))  # seeds 0 and 2: best 1.0
    low = cs.estimates(arms, "onpolicy", np.array([1, 3, 1, 3]))  # seeds 1 and 3: best 0.5
    assert high["best"] == 1.0 and low["best"] == 0.5
    x1 = 628.0
    for name, f in zip(cs.LEVEL_NAMES, cs.LEVELS):
        # on-policy crosses each level at the same place of its climb either way: x1 + (f - 0.5) / 0.5 x x1
        assert high["configs"]["onpolicy"]["cost"][name] == pytest.approx(x1 + (f - 0.5) / 0.5 * x1)
        assert low["configs"]["onpolicy"]["cost"][name] == pytest.approx(x1 + (f - 0.5) / 0.5 * x1)
        # replay: 0.9 after one step; the high band's levels above 0.9 are never reached (final compute, 2 x1)
        expect_high = 2 * x1 if f > 0.9 else f / 0.9 * x1
        assert high["configs"]["fast"]["cost"][name] == pytest.approx(expect_high)
        assert low["configs"]["fast"]["cost"][name] == pytest.approx(f * 0.5 / 0.9 * x1)
    # a resample's estimate is the estimate on that resample's seeds as data
    subset = {c: {"x": a["x"], "acc": {lr: acc[[1, 3, 1, 3]] for lr, acc in a["acc"].items()}} for c, a in arms.items()}
    assert cs.estimates(subset, "onpolicy", np.arange(4)) == low


def test_the_a_a_split_gives_an_interval_around_zero():
    rng = np.random.default_rng(5)
    runs = []
    for s in range(40):
        speed = rng.uniform(0.5, 2.0)  # seeds differ a lot; the two halves are drawn alike
        accs = [0.0] + [min(1.0, 0.9 * (1 - math.exp(-speed * t / 3)) + rng.normal(0, 0.02)) for t in range(1, 12)]
        runs.append(fake_run("onpolicy", 1e-5, s, accs, R=100, B=100))
        runs.append(fake_run("fast", 1e-5, s, accs, R=25, B=182))
        runs.append(fake_run("slow", 1e-5, s, accs, R=25, B=182))
    s = cs.analyse(runs, args(replicates=300))
    low, high = s["aa"]["interval_90"]
    assert low < 0 < high and abs(s["aa"]["point"]) < 25
    assert s["aa"]["seeds"] == [list(range(20)), list(range(20, 40))]
    assert s["point"]["configs"]["fast"]["saving"] == pytest.approx(50.0)  # the arms themselves: as built


def test_the_old_rule_is_reported_on_the_same_seeds():
    s = cs.analyse(runs_with({"fast": (25, 182, 1.0), "slow": (100, 100, 1.0)}), args())
    old = s["old_rule"]["fast"]
    assert set(old) == {"rollouts", "compute_paper_mu", "verdict"}
    # 90% of on-policy's best median: read at the first evaluation past it, the same step for both: half the compute
    assert old["compute_paper_mu"]["saving"] == pytest.approx(50.0)


def test_the_report_renders_again_from_its_summary(tmp_path):
    runs = runs_with({"fast": (25, 182, 0.9), "slow": (100, 100, 1.0)})
    report.write_report(tmp_path, cs.analyse(runs, args()), private="_arms", table_md=cs.table_md, plot=cs.plot)
    written = (tmp_path / "table.md").read_text()
    assert "| H1 | fast |" in written and (tmp_path / "frontier.png").stat().st_size > 0
    sweep.render(tmp_path / "summary.json", tmp_path / "again.md")
    assert (tmp_path / "again.md").read_text() == written


def test_too_few_seeds_or_a_missing_arm_is_one_line():
    with pytest.raises(SystemExit, match="at least 4"):
        cs.analyse(runs_with({"fast": (25, 182, 1.0), "slow": (100, 100, 1.0)}, seeds=range(3)), args())
    with pytest.raises(SystemExit, match="slow: no finished runs"):
        cs.analyse(runs_with({"fast": (25, 182, 1.0)}), args())
    with pytest.raises(SystemExit, match=r"--seeds: \[9\]"):
        cs.analyse(runs_with({"fast": (25, 182, 1.0), "slow": (100, 100, 1.0)}), args(seeds=[0, 1, 2, 3, 9]))


def test_the_grid_runs_every_configuration_to_on_policys_compute():
    runs = sweep.plan_runs(sweep.RunArgs(grid="compute", out_dir="unused", seeds=[20]))
    assert len(runs) == 9  # 3 configurations x 3 learning rates
    on_policy = cs.COMPUTE_ROLLOUTS * (1 + MU)
    for r in runs:
        cfg = replay_grpo.parse_args(r["argv"])
        R, B = cfg.prompts_per_step * cfg.group_size, cfg.batch_size
        assert R * cfg.eval_every == cs.EVAL_ROLLOUTS and cfg.total_steps % cfg.eval_every == 0
        final = B * (1 + MU) + (cfg.total_steps - 1) * (B + MU * R)  # the first step fills the buffer to B
        assert on_policy - cfg.eval_every * (B + MU * R) < final <= on_policy + 1e-6
        assert cfg.lr in cs.COMPUTE_LRS and cfg.seed == 20


def test_h1_alone_when_there_is_no_h2(tmp_path):
    """The replication's report: H1 without a second hypothesis (no N240 arm ran)."""
    s = cs.analyse(runs_with({"fast": (25, 182, 1.0)}), args(h2=None))
    assert s["decision"] == {"H1": "met"} and set(s["point"]["configs"]) == {"onpolicy", "fast"}
    assert set(s["old_rule"]) == {"fast"}
    report.write_report(tmp_path, s, private="_arms", table_md=cs.table_md, plot=cs.plot)
    table = (tmp_path / "table.md").read_text()
    assert "| H1 | fast |" in table and "H2" not in table


def test_the_replication_grid_is_the_compute_grid_on_the_same_setting_with_a_lower_lr():
    """Its runs are the compute study's on-policy and N512-R32 runs (the same flags, the old cpu preset pinned), each
    also at 1e-6."""
    plan = {r["name"]: r for r in sweep.plan_runs(sweep.RunArgs(grid="compute", out_dir="unused", seeds=[300]))}
    rep = sweep.plan_runs(sweep.RunArgs(grid="compute-replication", out_dir="unused", seeds=[300]))
    assert len(rep) == 8 and {r["planned"]["config"] for r in rep} == {"onpolicy", "N512-R32-grpo"}
    for r in rep:
        cfg = replay_grpo.parse_args(r["argv"])
        assert (cfg.arith_max_operand, cfg.sft_warmup_steps, cfg.lr in cs.REPLICATION_LRS) == (99, 2000, True)
        if cfg.lr != 1e-6:
            assert r["argv"] == plan[r["name"]]["argv"]
    assert min(cs.REPLICATION_LRS) < 3e-6


def test_the_report_recomputes_from_its_compact_records(tmp_path):
    """records.json.xz beside the report keeps what the statistic reads of every run: the report from it is the
    report from the runs, byte for byte, and so is a report from the records it writes in turn."""
    runs = runs_with({"fast": (25, 182, 0.9), "slow": (100, 100, 1.0)})
    for r in runs:  # what a real record also holds, which records.json.xz leaves out
        r["records"][1] |= {"loss": 0.1, "by_staleness": {"0": {"rollouts": 8}}}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(runner.compact_runs(runs)))
    assert "loss" not in runner.load_records(path)[0]["records"][1]
    direct = tmp_path / "direct"
    report.write_report(direct, cs.analyse(runs, args()), private="_arms", table_md=cs.table_md, plot=cs.plot)
    first, again = tmp_path / "first", tmp_path / "again"
    cs.main(["--records", str(path), "--report-dir", str(first), "--h1", "fast", "--h2", "slow", "--replicates", "100"])
    cs.main(
        ["--records", str(first / "records.json.xz"), "--report-dir", str(again), "--h1", "fast", "--h2", "slow"]
        + ["--replicates", "100"]
    )
    for name in ("summary.json", "table.md"):
        assert (first / name).read_text() == (direct / name).read_text() == (again / name).read_text(), name
    assert (first / "records.json.xz").read_bytes() == (again / "records.json.xz").read_bytes()
    with pytest.raises(SystemExit, match="not a study's records file"):
        (tmp_path / "bad.json").write_text('{"runs": [1]}')
        cs.main(["--records", str(tmp_path / "bad.json"), "--report-dir", str(tmp_path / "x")])


def test_an_arm_with_an_extra_learning_rate_reports_and_draws(tmp_path):
    """The replication's bracketing rule may run one arm at a fifth rate: its table gets the column (the other arm
    a '-') and its figure draws every rate."""
    shapes = {lr: [0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 1.0] for lr in (1e-6, 3e-6, 1e-5, 3e-5)}
    runs = runs_with({"fast": (25, 182, 1.0)}, shapes=shapes)
    runs += [fake_run("fast", 1e-4, s, [0.0, 0.2, 0.4, 0.5, 0.6, 0.6, 0.6], R=25, B=182) for s in range(8)]
    s = cs.analyse(runs, args(h2=None))
    report.write_report(tmp_path, s, private="_arms", table_md=cs.table_md, plot=cs.plot)
    table = (tmp_path / "table.md").read_text()
    assert "| lr 1e-06 | lr 3e-06 | lr 1e-05 | lr 3e-05 | lr 0.0001 |" in table
    assert [line for line in table.splitlines() if line.startswith("| onpolicy |")][-1].endswith("| - |")


def test_records_committed_so_far_pool_with_the_seeds_run_later(tmp_path, monkeypatch):
    """A study run over two sessions: the first session's records file pooled with the later run folders gives the
    report of all the runs, byte for byte; a run in both, or a configuration run with other settings, is one line."""
    runs = runs_with({"fast": (25, 182, 0.9), "slow": (100, 100, 1.0)})
    every, so_far, out = tmp_path / "every.json", tmp_path / "so_far.json", tmp_path / "runs"
    every.write_text(json.dumps(runner.compact_runs(sorted(runs, key=lambda r: r["name"]))))
    so_far.write_text(json.dumps(runner.compact_runs([r for r in runs if r["seed"] < 4])))
    out.mkdir()
    later = [r for r in runs if r["seed"] >= 4]
    monkeypatch.setattr(runner, "load_runs", lambda out_dir, quiet=False: later if out_dir == out else [])
    common = ["--h1", "fast", "--h2", "slow", "--replicates", "100"]
    cs.main(["--records", str(every), "--report-dir", str(tmp_path / "all"), *common])
    cs.main(["--out-dir", str(out), "--pool-records", str(so_far), "--report-dir", str(tmp_path / "pooled"), *common])
    for name in ("summary.json", "table.md", "records.json.xz"):
        assert (tmp_path / "pooled" / name).read_bytes() == (tmp_path / "all" / name).read_bytes(), name
    later.append(next(r for r in runs if r["seed"] == 3))
    with pytest.raises(
        SystemExit, match=r"--pool-records .*so_far.json: onpolicy-lr1e-05-s3 also finished in .*runs: keep one$"
    ):
        cs.main(["--out-dir", str(out), "--pool-records", str(so_far), "--report-dir", str(tmp_path / "x"), *common])
    later[-1] = dict(later[0], cfg=dict(later[0]["cfg"], total_steps=99), name="changed")
    with pytest.raises(SystemExit, match=r"changed in .*runs and .* differ in total_steps: one configuration, two"):
        cs.main(["--out-dir", str(out), "--pool-records", str(so_far), "--report-dir", str(tmp_path / "x"), *common])
