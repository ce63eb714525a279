"""Offline CPU tests of pareto.py: the frontier over learning rates, the costs and savings on each axis, the
bootstrap and the decision rule, on runs whose answers are known (the report end to end: test_sweep.py)."""

import math

import pareto
import pytest


def fake_run(config: str, lr: float, seed: int, accs: list[float], R: int, B: int) -> dict:
    """A finished run as sweep.load_runs returns it: one evaluation a step, R generated and B trained a step."""
    records = [{"step": 0, "eval/greedy_acc": accs[0]}]
    for step, a in enumerate(accs[1:], 1):
        records.append(
            {
                "step": step,
                "eval/greedy_acc": a,
                "generated_rollouts": R * step,
                "trained_rollouts": B * step,
                "entropy": 1.0 - 0.1 * step,
                "mu": 1.0,
            }
        )
    return {
        "name": f"{config}-lr{lr:g}-s{seed}",
        "config": config,
        "variant": f"-lr{lr:g}",
        "seed": seed,
        "cfg": {
            "lr": lr,
            "buffer_size": 4 * B,
            "batch_size": B,
            "prompts_per_step": R // 4,
            "group_size": 4,
            "total_steps": len(accs) - 1,
            "eval_every": 1,
        },
        "records": records,
    }


def args(**kw) -> pareto.Args:
    return pareto.Args(replicates=50, same_lr=1e-4, primary="replay", **kw)


ON = [0.0, 0.5, 0.8, 0.9, 1.0]  # on-policy: 90% of its best (1.0) at step 3
FAST = [0.0, 0.9, 1.0, 1.0, 1.0]  # 90% at step 1, the target at step 2


def test_saving_on_every_axis_and_the_decision():
    runs = [fake_run("onpolicy", 1e-4, s, ON, R=100, B=100) for s in range(3)]
    runs += [fake_run("replay", 1e-4, s, FAST, R=100, B=400) for s in range(3)]
    s = pareto.analyse(runs, args())
    assert s["seeds"] == [0, 1, 2] and s["point"]["target"] == 1.0
    row = s["point"]["configs"]["replay"]
    assert row["cost"]["rollouts"] == {"90%": 100, "100%": 200}
    assert row["saving"]["rollouts"]["90%"] == pytest.approx(100 * (1 - 100 / 300))
    paper = 400 + 5.28 * 100  # one step of the replay run, against three of on-policy's
    assert row["saving"]["compute_paper_mu"]["90%"] == pytest.approx(100 * (1 - paper / (3 * (100 + 528))))
    assert row["saving"]["compute_measured_mu"]["90%"] == pytest.approx(100 * (1 - 500 / 600))  # mu 1.0: logged
    assert s["decision"]["replay"]["verdict"] == s["claim"] == "met"  # identical seeds: the interval is the point
    assert s["configs"]["replay"] | {"lrs": None} == {
        "N": 1600,
        "B": 400,
        "R": 100,
        "steps": 4,
        "eval_every": 1,
        "lrs": None,
        "eval_rollouts": [0, 100, 200, 300, 400],
        "mu": 1.0,
    }
    assert s["interval_90"]["configs"]["replay"]["saving"]["rollouts"]["90%"] == [pytest.approx(100 * 2 / 3)] * 2


def test_frontier_takes_the_cheapest_learning_rate_for_each_level():
    runs = [fake_run("onpolicy", 1e-4, s, ON, R=100, B=100) for s in range(2)]
    runs += [fake_run("replay", 1e-4, s, [0.0, 0.6, 0.7, 0.7, 0.7], R=100, B=200) for s in range(2)]  # fast, low
    runs += [fake_run("replay", 1e-5, s, [0.0, 0.1, 0.2, 0.5, 1.0], R=100, B=200) for s in range(2)]  # slow, high
    row = pareto.analyse(runs, args())["point"]["configs"]["replay"]
    assert row["cost"]["rollouts"] == {"90%": 400, "100%": 400}  # only the slow lr gets there
    assert row["best"] == 1.0 and row["lrs"][1e-4]["best"] == 0.7
    assert row["same_lr_cost"]["rollouts"]["90%"] == math.inf  # at 1e-4 alone: never 90% of on-policy's 1.0
    assert row["same_lr_saving"]["rollouts"]["90%"] == -math.inf
    runs.append(fake_run("replay", 1e-4, 2, [0.0, 0.9, 1.0, 1.0, 1.0], R=100, B=200))  # a third seed, one cell
    assert pareto.analyse(runs, args())["seeds"] == [0, 1]  # a seed some cell lacks is left out


def test_frontier_mixes_learning_rates_across_levels():
    runs = [fake_run("onpolicy", 1e-4, s, ON, R=100, B=100) for s in range(2)]
    runs += [fake_run("replay", 1e-4, s, [0.0, 0.9, 0.9, 0.9, 0.9], R=100, B=200) for s in range(2)]  # 90% first
    runs += [fake_run("replay", 1e-5, s, [0.0, 0.1, 0.5, 1.0, 1.0], R=100, B=200) for s in range(2)]  # 100% first
    row = pareto.analyse(runs, args())["point"]["configs"]["replay"]
    assert row["cost"]["rollouts"] == {"90%": 100, "100%": 300}
    assert row["frontier"]["rollouts"] == {"0": 0.0, "100": 0.9, "200": 0.9, "300": 1.0, "400": 1.0}


def test_bootstrap_interval_spans_the_seeds_and_keeps_never():
    runs = [fake_run("onpolicy", 1e-4, s, ON, R=100, B=100) for s in range(6)]
    stuck = [0.0, 0.5, 0.6, 0.6, 0.6]  # never 90% of on-policy's best
    runs += [fake_run("replay", 1e-4, s, FAST if s < 3 else stuck, R=100, B=100) for s in range(6)]
    s = pareto.analyse(runs, args())
    lo, hi = s["interval_90"]["configs"]["replay"]["saving"]["rollouts"]["90%"]
    assert lo == -math.inf and hi == pytest.approx(100 * 2 / 3)  # resamples of mostly stuck seeds never get there
    assert s["decision"]["replay"]["verdict"] == "not met"


def test_bootstrap_resamples_seeds_once_for_every_configuration():
    """Seeds differ in difficulty (a seed fixes the warm start every configuration shares); a replay configuration
    whose runs equal on-policy's seed by seed saves exactly 0 in every paired resample. The target is recomputed
    from each resample."""
    curves = [
        [0.0, 0.9, 1.0, 1.0, 1.0],
        [0.0, 0.2, 0.5, 0.7, 0.8],
        [0.0, 0.5, 0.8, 0.9, 0.9],
        [0.0, 0.1, 0.2, 0.4, 0.6],
    ]
    runs = [fake_run(c, 1e-4, s, acc, R=100, B=100) for c in ("onpolicy", "replay") for s, acc in enumerate(curves)]
    s = pareto.analyse(runs, args())
    for level in pareto.LEVELS:
        assert s["interval_90"]["configs"]["replay"]["saving"]["rollouts"][level] == [0.0, 0.0]
    lo, hi = s["interval_90"]["target"]
    assert lo < s["point"]["target"] < hi  # the target moves with the resample


def test_one_seed_decides_nothing():
    runs = [fake_run("onpolicy", 1e-4, 0, ON, R=100, B=100), fake_run("replay", 1e-4, 0, FAST, R=100, B=100)]
    assert pareto.analyse(runs, args())["claim"] == "undecided"


def test_two_runs_of_one_seed_in_a_cell_are_refused():
    runs = [fake_run("onpolicy", 1e-4, 0, ON, R=100, B=100), fake_run("replay", 1e-4, 0, FAST, R=100, B=100)]
    runs.append(fake_run("replay", 1e-4, 0, ON, R=100, B=100))  # e.g. a second variant at the same lr
    with pytest.raises(SystemExit, match="replay at lr 0.0001 has several runs of one seed"):
        pareto.analyse(runs, args())


@pytest.mark.parametrize(
    "saving,low,verdict",
    [
        (35, 1, "met"),
        (30, 1, "met"),
        (35, -5, "not met"),
        (35, 0, "not met"),
        (35, None, "not met"),
        (29, 10, "not met"),
    ],
)
def test_decision_rule(saving, low, verdict):
    """At 90% of the target only: the 100% level, here failing everywhere, does not enter."""
    point = {"configs": {"replay": {"saving": {a: {"90%": saving, "100%": -50} for a in pareto.DECISION_AXES}}}}
    ci = {"configs": {"replay": {"saving": {a: {"90%": [low, 90], "100%": [-90, -10]} for a in pareto.DECISION_AXES}}}}
    assert pareto.decide(point, ci, "onpolicy", 30.0, n_seeds=20)["replay"]["verdict"] == verdict
    point["configs"]["replay"]["saving"]["rollouts"]["90%"] = 10  # one axis short: not met
    assert pareto.decide(point, ci, "onpolicy", 30.0, n_seeds=20)["replay"]["verdict"] == "not met"
