"""Offline CPU tests of pareto.py: the frontier over learning rates, the costs and savings on each axis, the
bootstrap and the decision rule, on runs whose answers are known (the report end to end: test_sweep.py)."""

import math

import pytest

import pareto


def fake_run(config: str, lr: float, seed: int, accs: list[float], R: int, B: int) -> dict:
    """A finished run as sweep.load_runs returns it: one evaluation a step, R generated and B trained a step."""
    records = [{"step": 0, "eval/greedy_acc": accs[0]}]
    for step, a in enumerate(accs[1:], 1):
        records.append({"step": step, "eval/greedy_acc": a, "generated_rollouts": R * step,
                        "trained_rollouts": B * step, "entropy": 1.0 - 0.1 * step, "mu": 1.0})
    return {"name": f"{config}-lr{lr:g}-s{seed}", "config": config, "variant": f"-lr{lr:g}", "seed": seed,
            "cfg": {"lr": lr, "buffer_size": 4 * B, "batch_size": B, "prompts_per_step": R // 4, "group_size": 4,
                    "total_steps": len(accs) - 1, "eval_every": 1}, "records": records}


def args(**kw) -> pareto.Args:
    return pareto.Args(replicates=50, same_lr=1e-4, **kw)


ON = [0.0, 0.5, 0.8, 0.9, 1.0]  # on-policy: 90% of its best (1.0) at step 3
FAST = [0.0, 0.9, 1.0, 1.0, 1.0]  # 90% at step 1, the target at step 2


def test_saving_on_every_axis_and_the_decision():
    runs = [fake_run("onpolicy", 1e-4, s, ON, R=100, B=100) for s in range(3)]
    runs += [fake_run("replay", 1e-4, s, FAST, R=100, B=400) for s in range(3)]
    s = pareto.analyse(runs, args(primary="replay"))
    assert s["seeds"] == [0, 1, 2] and s["point"]["target"] == 1.0
    row = s["point"]["configs"]["replay"]
    assert row["cost"]["rollouts"] == {"90%": 100, "100%": 200}
    assert row["saving"]["rollouts"]["90%"] == pytest.approx(100 * (1 - 100 / 300))
    paper = 400 + 5.28 * 100  # one step of the replay run, against three of on-policy's
    assert row["saving"]["compute_paper_mu"]["90%"] == pytest.approx(100 * (1 - paper / (3 * (100 + 528))))
    assert row["saving"]["compute_measured_mu"]["90%"] == pytest.approx(100 * (1 - 500 / 600))  # mu 1.0: logged
    assert s["decision"]["replay"]["verdict"] == "met"  # identical seeds: the interval is the point
    assert s["configs"]["replay"] | {"lrs": None} == {"N": 1600, "B": 400, "R": 100, "steps": 4, "eval_every": 1,
                                                       "lrs": None, "eval_rollouts": [0, 100, 200, 300, 400],
                                                       "mu": 1.0}
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


def test_bootstrap_interval_spans_the_seeds():
    runs = [fake_run("onpolicy", 1e-4, s, ON, R=100, B=100) for s in range(6)]
    slow = [0.0, 0.5, 0.8, 0.9, 1.0]
    runs += [fake_run("replay", 1e-4, s, FAST if s < 3 else slow, R=100, B=100) for s in range(6)]
    s = pareto.analyse(runs, args())
    lo, hi = s["interval_90"]["configs"]["replay"]["saving"]["rollouts"]["90%"]
    assert lo <= 0 < 50 <= hi  # half the seeds as slow as on-policy, half three times faster


@pytest.mark.parametrize("saving,low,verdict", [(35, 1, "met"), (35, -5, "not met"), (29, 10, "not met")])
def test_decision_rule(saving, low, verdict):
    point = {"configs": {"replay": {"saving": {a: {"90%": saving} for a in pareto.DECISION_AXES}}}}
    ci = {"configs": {"replay": {"saving": {a: {"90%": [low, 90]} for a in pareto.DECISION_AXES}}}}
    assert pareto.decide(point, ci, "onpolicy", 30.0)["replay"]["verdict"] == verdict
    point["configs"]["replay"]["saving"]["rollouts"]["90%"] = 10  # one axis short: not met
    assert pareto.decide(point, ci, "onpolicy", 30.0)["replay"]["verdict"] == "not met"
