"""The corrections study's statistic (tools/corrections_study.py) on records whose answers are known: the score is the
mean of the last 3 evaluations, the effect is paired against none in the same setting, the Bonferroni interval
decides, the tune seeds are left out, and the report recomputes the same summary from its own records.json.xz."""

import json

import corrections_study as cs
import numpy as np
import pytest

SEEDS = [400, 401, 402, 403, 404, 405]


def record(config: str, seed: int, late: float, lr: float = 3e-6, early: float = 0.1) -> dict:
    """A run whose evaluations are `early` until step 125 and `late` at steps 150, 175 and 200, except the very last,
    which is late + 0.3 at 175 and late - 0.3 at 200 (their mean is still `late`; the last one alone is not)."""
    steps = range(0, 201, 25)
    acc = [early] * 6 + [late, late + 0.3, late - 0.3]
    return {
        "config": config,
        "lr": lr,
        "seed": seed,
        "evals": [[s, 16 * s, a] for s, a in zip(steps, acc)],
        "diagnostics": {"0": {"corrected_frac": 0.0, "m2": 0.0, "mismatch_kl": 0.0}},
    }


def data(effects: dict, tune_seeds=(120,)) -> dict:
    """Every configuration on SEEDS (and the tune seeds, at a far-off score the report must ignore): none scores
    0.5 + seed noise; correction c scores none's + effects[c](seed index)."""
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.05, len(SEEDS))
    runs = []
    for setting in cs.SETTINGS:
        for c in cs.CORRECTIONS:
            name = f"{setting}-R16-k4-{c}"
            for i, seed in enumerate(SEEDS):
                runs.append(record(name, seed, 0.5 + noise[i] + (effects.get(c, lambda i: 0.0))(i)))
            runs += [record(name, s, 0.99 if c == "none" else 0.0) for s in tune_seeds]
    return {"tune_seeds": list(tune_seeds), "runs": runs}


def analyse(d: dict) -> dict:
    return cs.analyse(d, cs.Args(replicates=400))


def test_score_is_the_mean_of_the_last_three_evaluations():
    assert cs.score(record("x", 0, 0.6)) == pytest.approx(0.6)


def test_decisions_from_known_effects():
    s = analyse(
        data(
            {
                "tis": lambda i: 0.1,  # the same gain on every seed: its interval is [0.1, 0.1]
                "m2po": lambda i: -0.05,  # the same loss on every seed
                "seq-mask": lambda i: (-0.3, 0.3)[i % 2],  # mean 0, wide: no difference shown
            }
        )
    )
    assert s["seeds"] == SEEDS and s["tune_seeds"] == [120]  # the tune seeds' far-off scores are left out
    rows = s["comparisons"]
    for setting in cs.SETTINGS:
        tis, m2po, seq, dec = (rows[f"{setting}-R16-k4-{c}"] for c in ("tis", "m2po", "seq-mask", "decoupled"))
        assert tis["effect"] == pytest.approx(0.1) and tis["interval"] == pytest.approx([0.1, 0.1])
        assert tis["decision"] == "helps"
        assert m2po["effect"] == pytest.approx(-0.05) and m2po["decision"] == "hurts"
        assert seq["effect"] == pytest.approx(0.0) and seq["decision"] == "no difference shown"
        assert seq["interval"][0] < 0 < seq["interval"][1]
        assert dec["effect"] == pytest.approx(0.0) and dec["interval"] == pytest.approx([0.0, 0.0])
        assert dec["decision"] == "no difference shown"
    assert s["needs_correction"] == {setting: True for setting in cs.SETTINGS}


def test_bonferroni_interval_is_wider_than_the_plain_90_percent():
    s = analyse(data({"tis": lambda i: 0.02 * (i - 2)}))  # effects -0.04 .. +0.06, mean +0.01
    row = s["comparisons"]["N256-R16-k4-tis"]
    (lo, hi), (lo90, hi90) = row["interval"], row["interval_90"]
    assert lo <= lo90 < hi90 <= hi and (lo < lo90 or hi90 < hi)
    assert cs.PS == (0.625, 5, 95, 99.375)


def test_a_setting_without_a_helping_correction_needs_none():
    s = analyse(data({"tis": lambda i: -0.1}))
    assert s["needs_correction"] == {setting: False for setting in cs.SETTINGS}


def test_seeds_missing_a_configuration_are_left_out_and_too_few_refused():
    d = data({})
    d["runs"] = [r for r in d["runs"] if not (r["seed"] == 405 and r["config"] == "N512-R16-k4-m2po")]
    assert analyse(d)["seeds"] == SEEDS[:-1]
    d["runs"] = [r for r in d["runs"] if r["seed"] in (400, 401, 402) or r["seed"] == 120]
    with pytest.raises(SystemExit, match="needs at least 4"):
        analyse(d)


def test_compact_keeps_what_the_statistic_reads():
    records = [
        {"step": 0, "eval/greedy_acc": 0.1, "generated_rollouts": 0},
        {"step": 1, "loss": 0.0, "offpolicy_by_staleness": {"0": {"corrected_frac": 0.2, "m2": 0.1, "mismatch_kl": 0}}},
        {"step": 2, "loss": 0.0, "offpolicy_by_staleness": {"0": {"corrected_frac": 0.4, "m2": 0.3, "mismatch_kl": 0}}},
        {"step": 2, "eval/greedy_acc": 0.3, "generated_rollouts": 32},
    ]
    run = {"config": "N256-R16-k4-tis", "seed": 7, "cfg": {"lr": 1e-5}, "records": records}
    rec = cs.compact(run)
    assert rec["evals"] == [[0, 0, 0.1], [2, 32, 0.3]] and rec["lr"] == 1e-5 and rec["seed"] == 7
    assert rec["diagnostics"]["0"] == pytest.approx({"corrected_frac": 0.3, "m2": 0.2, "mismatch_kl": 0.0})


def test_report_recomputes_from_its_records(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(data({"tis": lambda i: 0.1})))
    first = tmp_path / "first"
    cs.main(["--records", str(path), "--report-dir", str(first), "--replicates", "200"])
    again = tmp_path / "again"
    cs.main(["--records", str(first / "records.json.xz"), "--report-dir", str(again), "--replicates", "200"])
    for name in ("summary.json", "table.md", "records.json.xz"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert "| N256 | tis | +0.100 |" in (first / "table.md").read_text()


def test_two_runs_of_one_seed_are_refused_not_one_picked():
    d = data({})
    d["runs"].append(record("N256-R16-k4-tis", 400, 0.9, lr=1e-5))  # a second lr on a reported seed
    with pytest.raises(SystemExit, match="N256-R16-k4-tis has several runs of one seed"):
        analyse(d)


def test_records_of_another_report_are_one_line(tmp_path):
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"runs": [{"name": "x", "config": "onpolicy", "records": []}]}))
    with pytest.raises(SystemExit, match="every run lacks one of"):
        cs.main(["--records", str(path), "--report-dir", str(tmp_path / "out")])
