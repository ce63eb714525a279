"""Offline CPU tests of sweep.py: the smoke grid end to end (run, resume, skip, report), and the
report's numbers on hand-made runs whose answers are known."""

import json
import lzma
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pareto
import pytest
import replay_study
import sweep
import torch
from PIL import Image
from studylib import report, runner

import replay_grpo
from infra import flag_checks, run_folder

FIGURES = [
    "accuracy_vs_steps.png",
    "accuracy_vs_tokens.png",
    "accuracy_vs_compute.png",
    "entropy.png",
    "staleness_hist.png",
    "replay_ratio_hist.png",
]


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def table_row(table: Path, config: str) -> list[str]:
    main_table = table.read_text().split("\n## ")[0]  # the per-configuration table, before the later sections
    rows = [line for line in main_table.splitlines() if line.startswith(f"| {config} |")]
    assert len(rows) == 1, table.read_text()
    return [c.strip() for c in rows[0].strip("|").split("|")]


def check_figures(out_dir: Path):
    for name in FIGURES:
        with Image.open(out_dir / name) as im:
            im.verify()
        with Image.open(out_dir / name) as im:
            assert im.format == "PNG" and im.width > 300 and im.height > 200


# --- the smoke grid end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A smoke study with 2 seeds, started over an interrupted run (checkpoint at step 2 of 3) and a
    run that died before its first checkpoint (a folder with no checkpoint)."""
    out = tmp_path_factory.mktemp("study")
    planned = {r["name"]: r for r in sweep.plan_runs(sweep.RunArgs(out_dir=str(out), seeds=[0, 1], grid="smoke"))}
    replay_grpo.main(planned["onpolicy-s0"]["argv"] + ["--total-steps", "2"])  # "killed" after step 2
    interrupted = (out / "onpolicy-s0" / "metrics.jsonl").read_text().splitlines()
    (out / "onpolicy-s1").mkdir()
    (out / "onpolicy-s1" / "metrics.jsonl").write_text('{"step": 0, "junk": true}\n')
    sweep.main(["run", "--out-dir", str(out), "--grid", "smoke", "--seeds", "0", "1"])
    return {"out": out, "planned": planned, "interrupted": interrupted}


def test_smoke_grid_names_and_all_runs_finished(study):
    assert sorted(study["planned"]) == sorted(
        f"{c}-s{s}" for c in ["onpolicy", "N16-R4-grpo-lr0.001", "N16-R4-grpo-lr0.003"] for s in (0, 1)
    )
    for name in study["planned"]:
        run_dir = study["out"] / name
        assert sweep.run_status(run_dir, 3) == "done"
        assert [r["step"] for r in records(run_dir)] == [0, 1, 2, 3]
    cfg = json.loads((study["out"] / "N16-R4-grpo-lr0.003-s1" / "config.json").read_text())
    got = cfg["buffer_size"], cfg["prompts_per_step"], cfg["batch_size"], cfg["lr"], cfg["seed"]
    assert got == (16, 1, 8, 3e-3, 1)


def test_a_run_extended_by_a_resume_is_read_as_finished(study, capsys):
    """onpolicy-s0 started with --total-steps 2 and was resumed to 3: config.json (written once) says 2, its
    resumes.jsonl says 3, and the report reads it as the finished 3-step run it is."""
    assert json.loads((study["out"] / "onpolicy-s0" / "config.json").read_text())["total_steps"] == 2
    runs = {r["name"]: r for r in sweep.load_runs(study["out"])}
    assert "not finished" not in capsys.readouterr().out
    assert runs["onpolicy-s0"]["cfg"]["total_steps"] == 3 and len(runs) == 6
    (study["out"] / "onpolicy-s0" / "resumes.jsonl").rename(study["out"] / "resumes.bak")
    try:  # without the resumes' record the run reads as stopped early
        assert "onpolicy-s0" not in {r["name"] for r in sweep.load_runs(study["out"])}
    finally:
        (study["out"] / "resumes.bak").rename(study["out"] / "onpolicy-s0" / "resumes.jsonl")


def test_current_config_applies_resumes_in_order(tmp_path):
    (tmp_path / "resumes.jsonl").write_text(
        '{"changed": {"--total-steps": [2, 3], "--eval-every": [1, 2]}}\n{"changed": {"--total-steps": [3, 5]}}\n'
    )
    saved = {"total_steps": 2, "eval_every": 1, "lr": 1e-4}
    assert run_folder.current_config(tmp_path, saved) == {"total_steps": 5, "eval_every": 2, "lr": 1e-4}
    with (tmp_path / "resumes.jsonl").open("a") as f:
        f.write('{"changed": 3}\n')
    with pytest.raises(ValueError, match="resumes.jsonl: a line is not a resume record"):
        run_folder.current_config(tmp_path, saved)


def test_each_run_folder_says_what_it_was_planned_as_and_the_report_reads_it(study, tmp_path):
    planned = json.loads((study["out"] / "N16-R4-grpo-lr0.003-s1" / runner.PLANNED).read_text())
    assert planned == {"config": "N16-R4-grpo", "variant": "-lr0.003", "seed": 1}
    shutil.copytree(study["out"] / "N16-R4-grpo-lr0.003-s1", tmp_path / "renamed")  # a name no regex can parse
    (run,) = sweep.load_runs(tmp_path)
    assert (run["config"], run["variant"], run["seed"]) == ("N16-R4-grpo", "-lr0.003", 1)


def test_records_write_the_finished_runs_of_the_seeds_asked_for_as_the_reports_read_them(study, tmp_path):
    to = tmp_path / "records.json.xz"
    seeds = sorted({r["seed"] for r in sweep.load_runs(study["out"])})
    sweep.main(["records", str(study["out"]), "--to", str(to), "--seeds", str(seeds[0])])
    runs = runner.load_records(to)
    expected = runner.compact_runs([r for r in sweep.load_runs(study["out"]) if r["seed"] == seeds[0]])["runs"]
    assert runs == expected and runs and {r["seed"] for r in runs} == {seeds[0]}
    sweep.main(["records", str(study["out"]), "--to", str(to), "--seeds", str(seeds[1]), "--pool-records", str(to)])
    every = sorted(sweep.load_runs(study["out"]), key=lambda r: r["name"])  # the first seed's and the second's
    assert runner.load_records(to) == runner.compact_runs([r for r in every if r["seed"] in seeds[:2]])["runs"]
    with pytest.raises(SystemExit, match="also finished in"):
        sweep.main(["records", str(study["out"]), "--to", str(to), "--seeds", str(seeds[1]), "--pool-records", str(to)])
    assert to.read_bytes().startswith(b"\xfd7zXZ\x00")  # xz
    for name, starts in (("records.json.gz", b"\x1f\x8b"), ("records.json", b'{"runs":')):  # gzip, plain JSON
        sweep.main(["records", str(study["out"]), "--to", str(tmp_path / name), "--seeds", str(seeds[0])])
        assert (tmp_path / name).read_bytes().startswith(starts) and runner.load_records(tmp_path / name) == runs


def test_interrupted_run_is_resumed_not_restarted(study):
    lines = (study["out"] / "onpolicy-s0" / "metrics.jsonl").read_text().splitlines()
    assert lines[:3] == study["interrupted"]  # steps 0-2 kept byte for byte (timings would differ)
    assert json.loads(lines[3])["step"] == 3


def test_run_without_checkpoint_is_restarted(study):
    assert all("junk" not in r for r in records(study["out"] / "onpolicy-s1"))


def test_a_run_another_process_trains_is_left_alone(tmp_path, capsys):
    """Two sweep processes on one folder: a run folder whose lock another process holds (here: a folder without a
    checkpoint yet, which a sweep would otherwise delete and restart) is skipped, its files untouched."""
    other = tmp_path / "onpolicy-s0"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 0}\n')
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from infra import run_folder; "
            "run_folder.lock_run(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)",
            str(other),
        ],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        sweep.main(["run", "--out-dir", str(tmp_path), "--grid", "smoke", "--seeds", "0", "--only", "onpolicy"])
        assert "onpolicy-s0: in use by another process, skipped" in capsys.readouterr().out
        assert (other / "metrics.jsonl").read_text() == '{"step": 0}\n'
    finally:
        holder.kill()
        holder.wait()


def test_second_run_skips_finished_runs(study, capsys):
    mtimes = {p: p.stat().st_mtime_ns for p in study["out"].glob("*/metrics.jsonl")}
    sweep.main(["run", "--out-dir", str(study["out"]), "--grid", "smoke", "--seeds", "0", "1"])
    assert capsys.readouterr().out.count("finished, skipped") == 6
    assert {p: p.stat().st_mtime_ns for p in study["out"].glob("*/metrics.jsonl")} == mtimes


def test_runs_into_one_folder_merge_their_seeds_in_sweep_json(study, tmp_path):
    out = tmp_path / "study"  # a copy: the report tests below read the study's own sweep.json
    shutil.copytree(study["out"], out)
    sweep.main(["run", "--out-dir", str(out), "--grid", "smoke", "--seeds", "1", "--tune-seeds", "0"])  # all skipped
    sweep.main(["run", "--out-dir", str(out), "--grid", "smoke", "--seeds", "1"])  # e.g. a second process, no tuning
    recorded = json.loads((out / "sweep.json").read_text())
    assert recorded["seeds"] == [0, 1] and recorded["tune_seeds"] == [0]
    assert not list(out.glob(".sweep.json.*"))


def test_report_table_matches_metrics_and_figures_parse(study):
    out = study["out"]
    sweep.main(["report", "--out-dir", str(out)])
    check_figures(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reference"] == "onpolicy"
    assert list(summary["lr_choice"]) == ["N16-R4-grpo"]
    picked = summary["lr_choice"]["N16-R4-grpo"]["picked"]
    for config, prefix in [("onpolicy", "onpolicy"), ("N16-R4-grpo", f"N16-R4-grpo-lr{picked:g}")]:
        runs = [records(out / f"{prefix}-s{s}") for s in (0, 1)]
        row = table_row(out / "table.md", config)
        for col, key in [(4, "eval/greedy_acc"), (5, "eval/pass@1")]:
            q25, med, q75 = np.percentile([r[-1][key] for r in runs], [25, 50, 75])
            assert row[col] == f"{med:.3f} [{q25:.3f}–{q75:.3f}]"
        assert row[7] == f"{np.median([r[-1]['total_generated_tokens'] for r in runs]):.0f}"
        assert row[9] == f"{np.mean([r[-1]['replay_ratio'] for r in runs]):.2f}"
    assert table_row(out / "table.md", "onpolicy")[10] == "0.00"  # on-policy: never stale


def test_report_tabulates_what_a_step_trains_on_by_staleness(study):
    """The by-staleness section: each bucket's share of the trained rollouts and its token-weighted metrics, from
    every step's by_staleness in the records."""
    out = study["out"]
    s = sweep.main(["report", "--out-dir", str(out)])
    assert (out / "staleness_metrics.png").exists()
    picked = s["lr_choice"]["N16-R4-grpo"]["picked"]
    steps = [rec for seed in (0, 1) for rec in records(out / f"N16-R4-grpo-lr{picked:g}-s{seed}")[1:]]
    rollouts, tokens, clipped = Counter(), Counter(), Counter()
    for rec in steps:
        for bucket, m in rec["by_staleness"].items():
            rollouts[bucket] += m["rollouts"]
            tokens[bucket] += m["tokens"]
            clipped[bucket] += m["clip_frac"] * m["tokens"]
    assert sum(rollouts.values()) == 8 * len(steps) and len(rollouts) > 1  # replay: stale buckets too
    text = (out / "table.md").read_text()
    for bucket in rollouts:
        share = rollouts[bucket] / sum(rollouts.values())
        clip = clipped[bucket] / tokens[bucket]
        assert f"| N16-R4-grpo | {bucket} | {share:.3f} | {clip:.4f} |" in text
    assert "| onpolicy | 0 | 1.000 |" in text  # on-policy: every rollout trained at staleness 0


# --- grid definition ----------------------------------------------------------------------------


def test_default_grid_is_valid_and_extra_flags_apply(tmp_path):
    runs = sweep.plan_runs(
        sweep.RunArgs(
            out_dir=str(tmp_path), seeds=[0, 1], grid="cpu", extra=["--total-steps", "7", "--buffer-size", "999"]
        )
    )
    names = [r["name"] for r in runs]
    assert len(set(names)) == len(names)
    for needle in [
        "onpolicy-lr5e-05-s0",
        "N256-R64-grpo-s1",
        "N512-R32-grpo-lr0.0001-s0",
        "N512-R32-asymre-s0",
        "N512-R32-grpo-d0.2-s0",
        "N512-R32-grpo-d0.5-s1",
    ]:
        assert needle in names
    for r in runs:
        cfg = replay_grpo.parse_args(r["argv"])
        flag_checks.validate(cfg)
        assert r["total_steps"] == cfg.total_steps == 7  # --extra reaches the trainer
        assert cfg.buffer_size != 999 and cfg.batch_size == 128  # the grid's own flags win over --extra
        assert cfg.run_name == r["name"] and cfg.out_dir == str(tmp_path)
    only = sweep.plan_runs(sweep.RunArgs(seeds=[0], grid="cpu", only=["asymre"]))
    assert [r["name"] for r in only] == ["N512-R32-asymre-s0"]


def test_duplicate_names_are_refused(monkeypatch):
    twins = [dict(buffer_size=16, prompts_per_step=1), dict(buffer_size=16, prompts_per_step=1, loss_agg="seq-mean")]
    monkeypatch.setitem(sweep.GRIDS, "smoke", (replay_study.SMOKE_GRID[0], twins))
    with pytest.raises(SystemExit, match="both named"):
        sweep.plan_runs(sweep.RunArgs(grid="smoke"))


def test_a_failing_run_does_not_stop_the_sweep(tmp_path, monkeypatch):
    monkeypatch.setitem(
        sweep.GRIDS,
        "smoke",
        (
            replay_study.SMOKE_GRID[0],
            [
                dict(buffer_size=4, prompts_per_step=2),  # N < B
                dict(buffer_size=8, prompts_per_step=2),
            ],
        ),
    )
    with pytest.raises(SystemExit, match=r"1 run\(s\) failed: N4-R8-grpo-s0"):
        sweep.main(["run", "--out-dir", str(tmp_path), "--grid", "smoke", "--seeds", "0"])
    assert sweep.run_status(tmp_path / "onpolicy-s0", 3) == "done"


# --- the report's numbers on hand-made runs -----------------------------------------------------


def fake_run(out, name, *, seed, lr, N, P, accs, mu=1.0, stale=None, total=4, ckpt_step=None):
    """A finished run: B = 8, G = 4, R = 4P, evals at steps 0, 2, 4 with greedy accuracies accs;
    each step generates 4P rollouts of 4 tokens and trains on 8. ckpt_step < total: interrupted."""
    run_dir = out / name
    (run_dir / "checkpoint").mkdir(parents=True)
    cfg = dict(
        buffer_size=N,
        batch_size=8,
        prompts_per_step=P,
        group_size=4,
        publish_every=1,
        loss="grpo",
        positive_bias=0.0,
        lr=lr,
        seed=seed,
        total_steps=total,
        eval_every=2,
        pass_k=2,
    )
    (run_dir / "config.json").write_text(json.dumps(cfg))
    R, recs = 4 * P, []
    for step in range(total + 1):
        rec = {"step": step}
        if step:
            rec.update(
                entropy=1.0 / step,
                staleness_hist=stale or {"0": 8},
                replay_ratio=8 / R,
                generated_rollouts=R * step,
                trained_rollouts=8 * step,
                total_generated_tokens=4 * R * step,
                mu=mu,
                replay_hist={"2": 2, "3": 1},
            )
        if step % 2 == 0:
            acc = accs[step // 2]
            rec.update(
                {"eval/greedy_acc": acc, "eval/pass@1": acc / 2, "eval/pass@2": min(1, 2 * acc), "eval/acc_t1": acc / 3}
            )
        recs.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    torch.save({"step": total if ckpt_step is None else ckpt_step}, run_dir / "checkpoint" / "trainer_state.pt")


def test_pareto_report_end_to_end_on_the_smoke_grid(study, tmp_path):
    """pareto.py on the smoke study: the frontier over N16-R4's two lrs against on-policy's one."""
    out = study["out"]
    smoke_lr = next(r["cfg"]["lr"] for r in sweep.load_runs(out) if r["config"] == "onpolicy")
    s = pareto.main(
        [
            "--out-dir",
            str(out),
            "--report-dir",
            str(tmp_path / "report"),
            "--primary",
            "N16-R4-grpo",
            "--same-lr",
            str(smoke_lr),
            "--replicates",
            "20",
        ]
    )
    assert set(s["point"]["configs"]) == {"onpolicy", "N16-R4-grpo"} and s["seeds"] == [0, 1]
    assert set(s["point"]["configs"]["N16-R4-grpo"]["lrs"]) == {1e-3, 3e-3}
    assert s["point"]["configs"]["N16-R4-grpo"]["same_lr_cost"] == {}  # it did not run at on-policy's lr
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())  # strict JSON
    assert summary["point"]["target"] == 0.0  # 3 steps of the smoke model: nothing learned,
    assert summary["point"]["configs"]["N16-R4-grpo"]["saving"]["rollouts"]["90%"] is None  # so nothing saved
    assert summary["decision"]["N16-R4-grpo"]["verdict"] == "not met"
    table = (tmp_path / "report" / "table.md").read_text()
    assert "## Decision" in table and "**N16-R4-grpo**" in table
    for name in ("pareto_frontier.png", "same_lr.png", "entropy.png"):
        with Image.open(tmp_path / "report" / name) as im:
            assert im.format == "PNG" and im.width > 300
    with pytest.raises(SystemExit, match="no finished runs"):
        pareto.main(["--out-dir", str(tmp_path / "empty")])


def test_report_numbers_on_known_runs(tmp_path):
    on = {0: [0, 0.2, 0.4], 1: [0, 0.3, 0.6], 2: [0, 0.1, 0.5]}  # final median 0.5, reached at step 4
    rp = {0: [0, 0.5, 0.6], 1: [0, 0.6, 0.6], 2: [0, 0.4, 0.5]}  # median 0.5 already at step 2
    for s in range(3):
        fake_run(tmp_path, f"onpolicy-s{s}", seed=s, lr=1e-4, N=8, P=2, accs=on[s], mu=1.0)
        fake_run(
            tmp_path,
            f"N16-R4-grpo-lr0.0001-s{s}",
            seed=s,
            lr=1e-4,
            N=16,
            P=1,
            accs=rp[s],
            mu=1.0,
            stale={"0": 4, "1": 2, "3": 2},
        )
        fake_run(tmp_path, f"N16-R4-grpo-lr0.001-s{s}", seed=s, lr=1e-3, N=16, P=1, accs=[0, 0.1, 0.1], mu=3.0)
    fake_run(tmp_path, "onpolicy-s3", seed=3, lr=1e-4, N=8, P=2, accs=[0, 1, 1], ckpt_step=2)  # unfinished
    (tmp_path / ".warmstart").mkdir()

    s = sweep.main(["report", "--out-dir", str(tmp_path)])
    check_figures(tmp_path)
    assert s["reference"] == "onpolicy" and s["target_greedy_acc"] == pytest.approx(0.5)
    assert s["mu_measured"] == pytest.approx(1.0)  # median over all 9 finished runs' mu (6 x 1.0, 3 x 3.0)
    assert s["lr_choice"]["N16-R4-grpo"]["picked"] == 1e-4
    ref, rp_row = s["configs"]["onpolicy"], s["configs"]["N16-R4-grpo"]
    assert ref["seeds"] == [0, 1, 2]  # the unfinished seed 3 is left out
    assert ref["greedy_acc"] == pytest.approx((0.45, 0.5, 0.55))
    # on-policy reaches 0.5 at step 4: 4 x 32 tokens; compute 4 x 8 trained + mu x 4 x 8 generated
    assert ref["tokens_to_target"] == 128 and ref["compute_measured_mu_to_target"] == pytest.approx(64)
    assert ref["compute_paper_mu_to_target"] == pytest.approx(32 + 5.28 * 32)
    # replay reaches it at step 2: 2 x 16 tokens; compute 2 x 8 + mu x 2 x 4
    assert rp_row["tokens_to_target"] == 32 and rp_row["tokens_saving_pct"] == pytest.approx(75)
    assert rp_row["compute_measured_mu_saving_pct"] == pytest.approx(100 * (1 - 24 / 64))
    assert rp_row["compute_paper_mu_saving_pct"] == pytest.approx(100 * (1 - (16 + 5.28 * 8) / (32 + 5.28 * 32)))
    assert rp_row["staleness"] == pytest.approx((0 * 4 + 1 * 2 + 3 * 2) / 8)
    assert rp_row["replay_ratio"] == pytest.approx(2.0)

    row = table_row(tmp_path / "table.md", "N16-R4-grpo")
    assert row[1] == "0.0001*" and row[4] == "0.600 [0.550–0.600]"
    paper_saving = f"{rp_row['compute_paper_mu_saving_pct']:+.1f}%"
    assert row[-5:] == ["+75.0%", "24", "+62.5%", "58.24", paper_saving]
    assert "N16-R4-grpo: lr 0.0001 picked" in (tmp_path / "table.md").read_text()
    with pytest.raises(SystemExit, match="no finished runs"):
        sweep.main(["report", "--out-dir", str(tmp_path / "empty")])


# --- one run's figures ----------------------------------------------------------------------------


def test_plot_writes_a_runs_figures_from_its_metrics(study, tmp_path):
    run_dir = study["out"] / "N16-R4-grpo-lr0.001-s0"
    written = sweep.main(["plot", str(run_dir)])
    assert sorted(p.name for p in written) == ["curves_vs_steps.png", "curves_vs_tokens.png", "staleness_vs_steps.png"]
    for p in written:
        with Image.open(p) as im:
            assert im.format == "PNG" and im.width > 800 and im.height > 400
    with pytest.raises(SystemExit, match="has no metrics.jsonl"):
        sweep.main(["plot", str(tmp_path)])


def test_bootstrap_intervals_and_decision_on_known_runs(tmp_path):
    """Identical seeds: every resample is the same, so each interval is a point; replay reaches the
    reference's accuracy with 75% fewer tokens, so the 30% target is met on tokens, and at the paper's mu
    the compute saving is computed the same way."""
    for s in range(3):
        fake_run(tmp_path, f"onpolicy-s{s}", seed=s, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
        fake_run(tmp_path, f"N16-R4-grpo-s{s}", seed=s, lr=1e-4, N=16, P=1, accs=[0, 0.5, 0.6])
        fake_run(tmp_path, f"N32-R4-grpo-s{s}", seed=s, lr=1e-4, N=32, P=1, accs=[0, 0.1, 0.2])  # never reaches 0.5
    s = sweep.main(["report", "--out-dir", str(tmp_path), "--report-dir", str(tmp_path / "docs")])
    iv = s["bootstrap"]["intervals"]
    assert iv["onpolicy"]["cost"]["tokens"]["target"] == [128.0] * 3
    assert iv["N16-R4-grpo"]["cost"]["tokens"]["target"] == [32.0] * 3
    assert iv["N16-R4-grpo"]["saving"]["tokens"]["target"] == [75.0] * 3
    paper = 100 * (1 - (16 + 5.28 * 8) / (32 + 5.28 * 32))
    assert iv["N16-R4-grpo"]["saving"]["compute_paper_mu"]["target"] == pytest.approx([paper] * 3)
    assert iv["N32-R4-grpo"]["cost"]["tokens"]["target"] == [math.inf] * 3
    strict = json.loads(
        (tmp_path / "docs" / "summary.json").read_text(),
        parse_constant=lambda c: pytest.fail(f"summary.json holds {c}, not JSON"),
    )
    never = strict["bootstrap"]["intervals"]["N32-R4-grpo"]["cost"]["tokens"]["target"]
    assert never == ["never"] * 3
    assert s["decision"]["N16-R4-grpo"] == {"tokens": "met", "compute_paper_mu": "met", "both": "met"}
    assert s["decision"]["N32-R4-grpo"]["both"] == "not met"
    # equal compute: on-policy's whole run is 4 x (8 + 5.28 x 8) at the paper's mu; N16 fits all 4 steps
    assert iv["N16-R4-grpo"]["at_equal"]["compute_paper_mu"]["acc"] == pytest.approx([0.6] * 3)
    seeds = s["per_seed"]["N16-R4-grpo"]
    assert [r["seed"] for r in seeds] == [0, 1, 2] and all(r["tokens_to_target"] == 32 for r in seeds)
    table = (tmp_path / "docs" / "table.md").read_text()
    assert "| N16-R4-grpo | target | 32 [32, 32] | +75% [+75%, +75%] |" in table
    assert "- N16-R4-grpo: tokens met, compute at paper mu met: **met**" in table
    assert "| N32-R4-grpo | target | never [never, never] |" in table


def test_the_replay_report_recomputes_from_its_records(tmp_path, monkeypatch):
    """records.json.xz beside the replay study's report holds the tune seeds and what the report reads of every run: the
    report from it is the report from the run folders, byte for byte (figures too), and the summary from the whole
    runs; records without a key the report reads give another summary."""
    out = tmp_path / "runs"
    for s in range(4):
        fake_run(out, f"onpolicy-s{s}", seed=s, lr=1e-4, N=8, P=2, accs=[0, 0.2 + 0.1 * (s % 2), 0.5])
        stale = {"0": 4, "1": 2, "3": 2}
        fake_run(out, f"N16-R4-grpo-lr0.0001-s{s}", seed=s, lr=1e-4, N=16, P=1, accs=[0, 0.5, 0.6], stale=stale)
        fake_run(out, f"N16-R4-grpo-lr0.001-s{s}", seed=s, lr=1e-3, N=16, P=1, accs=[0, 0.1, 0.1], mu=3.0)
    for path in out.glob("*/metrics.jsonl"):  # what real records also hold: some read, some not
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        recs[0] |= {"warmstart_reached": True, "warmstart_pass@k": 0.25}
        for rec in recs[1:]:
            rec |= {
                "loss": 0.1,
                "by_staleness": {"0": dict(rollouts=8, tokens=32, clip_frac=0.1, abs_log_ratio=0.01, ess=30.0)},
            }
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (out / "sweep.json").write_text(json.dumps({"grid": "smoke", "seeds": [1, 2, 3], "tune_seeds": [0]}))
    direct, again, whole = tmp_path / "direct", tmp_path / "again", tmp_path / "whole"
    sweep.main(["report", "--out-dir", str(out), "--report-dir", str(direct)])
    sweep.main(["report", "--records", str(direct / runner.RECORDS), "--report-dir", str(again)])
    data = runner.read_records(direct / runner.RECORDS)
    assert data["tune_seeds"] == [0] and "loss" not in data["runs"][0]["records"][1]
    args = replay_study.Args(out_dir=str(out))
    s = replay_study.analyse({"runs": runner.load_runs(out), "tune_seeds": [0]}, args)
    report.write_report(whole, s, private="_runs", table_md=replay_study.table_md, plot=replay_study.plot)
    assert s["configs"]["onpolicy"]["seeds"] == [1, 2, 3] and s["per_seed"]["onpolicy"][0]["warmstart_reached"]
    for name in ["table.md", "summary.json", *FIGURES, "staleness_metrics.png"]:
        assert (direct / name).read_bytes() == (again / name).read_bytes() == (whole / name).read_bytes(), name
    assert (direct / runner.RECORDS).read_bytes() == (again / runner.RECORDS).read_bytes()
    keys = replay_study.KEYS
    for key in ("staleness_hist", "by_staleness", "warmstart_reached", "replay_ratio"):
        monkeypatch.setattr(replay_study, "KEYS", tuple(k for k in keys if k != key))
        cut = replay_study.analyse(replay_study.compact(runner.load_runs(out), [0]), args)
        assert json.dumps(report.strict_json(cut["configs"])) != json.dumps(report.strict_json(s["configs"])) or (
            cut["per_seed"] != s["per_seed"]
        ), key


def test_a_report_without_an_on_policy_configuration_asks_for_a_reference(tmp_path):
    """Savings need a reference: without an on-policy GRPO configuration the report stops with one line, and with
    --reference it measures against that one."""
    for s in range(2):
        fake_run(tmp_path, f"N16-R4-grpo-s{s}", seed=s, lr=1e-4, N=16, P=1, accs=[0, 0.5, 0.6])
        fake_run(tmp_path, f"N32-R4-grpo-s{s}", seed=s, lr=1e-4, N=32, P=1, accs=[0, 0.1, 0.2])
    with pytest.raises(
        SystemExit, match="no on-policy GRPO configuration among N16-R4-grpo, N32-R4-grpo: give --refer"
    ):
        sweep.main(["report", "--out-dir", str(tmp_path)])
    s = sweep.main(["report", "--out-dir", str(tmp_path), "--reference", "N16-R4-grpo"])
    assert s["reference"] == "N16-R4-grpo" and s["decision"]["N32-R4-grpo"]["both"] == "not met"


# --- seed_table.py: a preset on many seeds, as a new user runs it --------------------------------


# a seed of seed_table.py in seconds: a 20-step warm start and 2 RL steps of the smoke model
TINY_SEED = (
    "--extra --sft-warmup-steps 20 --sft-imitation 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
    "--buffer-size 8 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 2 --eval-every 0"
).split()


def test_seed_table_runs_each_seed_once_and_tabulates_its_records(tmp_path, capsys):
    import seed_table

    argv = ["--seeds", "3", "4", "--out-dir", str(tmp_path), "--table", str(tmp_path / "t.md"), *TINY_SEED]
    rows = seed_table.main(argv)
    for row in rows:
        recs = records(tmp_path / str(row["seed"]) / "run")
        assert recs[0]["warmstart_steps"] == row["warmstart_steps"] == 20
        assert (row["start"], row["end"]) == (recs[0]["eval/greedy_acc"], recs[-1]["eval/greedy_acc"])
        assert row["gain"] == round(100 * (row["end"] - row["start"]), 1) and row["seconds"] > 0
        assert json.loads((tmp_path / str(row["seed"]) / "run" / "config.json").read_text())["seed"] == row["seed"]
    table = (tmp_path / "t.md").read_text()
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:4]] == [
        "3",
        "4",
    ] and "2 seeds: gain min" in table
    doc = tmp_path / "doc.md"  # a document with the markers gets the table in place, its prose kept
    doc.write_text("prose\n<!-- seed_table -->\nold table\n<!-- /seed_table -->\nmore prose\n")
    seed_table.place_table(doc, table)
    assert doc.read_text() == f"prose\n<!-- seed_table -->\n{table}<!-- /seed_table -->\nmore prose\n"
    # a finished seed is not run again; one whose run lost its final record (its last line cut, as a kill in a
    # write leaves it) is named and run again from nothing
    times = json.loads((tmp_path / "seed_table.json").read_text())
    metrics = tmp_path / "4" / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-20])
    capsys.readouterr()
    again = seed_table.main(argv)
    out = capsys.readouterr().out
    assert f"seed 4: a file is damaged, the seed is run again: {metrics}:3: not JSON" in out
    assert "[1/1] seed 3: finished, skipped" in out and "[1/1] seed 4: delete and run again from nothing" in out
    after = json.loads((tmp_path / "seed_table.json").read_text())
    assert after["3"] == times["3"] and after["4"] != times["4"]
    assert again[1]["end"] == rows[1]["end"]
    assert len(records(tmp_path / "4" / "run")) == len(records(tmp_path / "3" / "run"))


# --- compare_metrics.py: the comparison of two versions' records ---------------------------------


def test_compare_metrics_counts_differences_skipping_the_clock_and_the_keys_new_on_purpose(capsys):
    import compare_metrics

    old = [[{"step": 1, "loss": 0.5, "train_seconds": 1.0}]] * len(compare_metrics.COMMANDS)
    new = [[{"step": 1, "loss": 0.5, "train_seconds": 2.0, "replay_hist": {"1": 8}}]] * len(compare_metrics.COMMANDS)
    assert compare_metrics.compare(old, new, added={"replay_hist"}) == 0  # seconds and the new key are not compared
    assert compare_metrics.compare(old, new, added=set()) == len(compare_metrics.COMMANDS)  # a key appeared
    changed = [[{"step": 1, "loss": 0.25, "train_seconds": 1.0}]] * len(compare_metrics.COMMANDS)
    assert compare_metrics.compare(old, changed, added={"replay_hist"}) == len(compare_metrics.COMMANDS)
    assert "step 1: loss: 0.5 -> 0.25" in capsys.readouterr().out


# --- the tools on damaged or shared state ---------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def tool(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python tools/NAME.py ...` from the root, as a user runs it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_two_sweeps_on_one_folder_train_each_run_once_and_report_no_failure(tmp_path):
    """Two `sweep.py run --subprocess` started together on one folder: each run is trained by one of them, never
    deleted by the other while it starts, and neither reports a failure."""
    argv = [sys.executable, "tools/sweep.py", "run", "--out-dir", str(tmp_path), "--grid", "smoke", "--seeds", "0"]
    argv += ["--only", "onpolicy", "--subprocess"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    both = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    both.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    text = "".join(outs)
    assert "failed" not in text and "delete" not in text and "in use by process" not in text, text
    assert text.count("onpolicy-s0: start") == 1, text  # trained once; the other process skipped it
    assert sweep.run_status(tmp_path / "onpolicy-s0", 3) == "done"
    assert [r["step"] for r in records(tmp_path / "onpolicy-s0")] == [0, 1, 2, 3]


def test_report_and_pareto_leave_out_a_damaged_run_folder_and_name_its_file(tmp_path, capsys):
    for s in range(3):
        fake_run(tmp_path, f"onpolicy-s{s}", seed=s, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
        fake_run(tmp_path, f"N16-R4-grpo-s{s}", seed=s, lr=1e-4, N=16, P=1, accs=[0, 0.5, 0.6])
    fake_run(tmp_path, "onpolicy-s3", seed=3, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
    cfg = json.loads((tmp_path / "onpolicy-s3" / "config.json").read_text())
    del cfg["seed"]  # valid JSON, without a key the reports read
    (tmp_path / "onpolicy-s3" / "config.json").write_text(json.dumps(cfg))
    fake_run(tmp_path, "N16-R4-grpo-s3", seed=3, lr=1e-4, N=16, P=1, accs=[0, 0.5, 0.6])
    (tmp_path / "N16-R4-grpo-s3" / runner.PLANNED).write_text('{"config": ')  # cut
    fake_run(tmp_path, "onpolicy-s4", seed=4, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
    metrics = tmp_path / "onpolicy-s4" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))  # records end at step 1 of 4
    fake_run(tmp_path, "N16-R4-grpo-s4", seed=4, lr=1e-4, N=16, P=1, accs=[0, 0.5, 0.6])
    torch.save({"steps": 4}, tmp_path / "N16-R4-grpo-s4" / "checkpoint" / "trainer_state.pt")  # no "step"

    s = sweep.main(["report", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert s["configs"]["onpolicy"]["seeds"] == s["configs"]["N16-R4-grpo"]["seeds"] == [0, 1, 2]
    assert f'{tmp_path / "onpolicy-s3" / "config.json"}: "seed" is missing' in out
    assert f"{tmp_path / 'N16-R4-grpo-s3' / runner.PLANNED}: JSONDecodeError" in out
    assert f"{metrics}: its records do not reach the checkpoint's step 4" in out
    assert "N16-R4-grpo-s4 is not finished" in out and 'trainer_state.pt holds no integer "step"' in out
    assert "report: 3 run folder(s) with a damaged file left out" in out
    argv = [
        "--out-dir",
        str(tmp_path),
        "--report-dir",
        str(tmp_path / "p"),
        "--primary",
        "N16-R4-grpo",
        "--same-lr",
        "1e-4",
    ]
    s = pareto.main(argv)
    assert s["seeds"] == [0, 1, 2] and '"seed" is missing' in capsys.readouterr().out


def test_a_damaged_sweep_json_is_named_in_one_line(tmp_path):
    fake_run(tmp_path, "onpolicy-s0", seed=0, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
    for damage in ['{"grid": "smoke", "tune_seeds": [1', '{"tune_seeds": "1"}']:
        (tmp_path / "sweep.json").write_text(damage)
        for argv in (["report"], ["run", "--grid", "smoke", "--only", "nothing"]):  # run: before it plans a run
            done = tool("tools/sweep.py", *argv, "--out-dir", str(tmp_path))
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            (line,) = done.stderr.strip().splitlines()
            assert line.startswith(f"error: {tmp_path / 'sweep.json'}") and "--tune-seeds" in line
        assert (tmp_path / "sweep.json").read_text() == damage  # kept for the user to restore


def test_seed_table_on_a_damaged_seed_table_json_says_so_in_one_line(tmp_path):
    for damage in ['{"3": 171.2', "[171.2]", '{"3": "171 s"}']:
        (tmp_path / "seed_table.json").write_text(damage)
        done = tool("tools/seed_table.py", "--seeds", "3", "--out-dir", str(tmp_path))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"error: {tmp_path / 'seed_table.json'}") and "restore it" in line
        assert not (tmp_path / "3").exists()  # nothing was run


def test_two_seed_tables_on_one_folder_run_each_seed_once_and_keep_each_others_times(tmp_path):
    argv = [sys.executable, "tools/seed_table.py", "--seeds", "3", "4", "--out-dir", str(tmp_path), *TINY_SEED]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    both = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    both.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in both]
    text = "".join(outs)
    assert "Traceback" not in text and "failed" not in text and "delete" not in text, text
    assert text.count("seed 3: start") == text.count("seed 4: start") == 1, text  # each seed trained once
    for p, out in zip(both, outs):  # each process either tabulated both seeds or said which the other one had
        assert p.returncode == 0 or p.returncode == 2 and "are another process's runs, not finished" in out, out
    times = json.loads((tmp_path / "seed_table.json").read_text())
    assert sorted(times) == ["3", "4"]  # neither process's write lost the other's seed
    again = tool("tools/seed_table.py", *argv[2:])  # both finished: tabulated without running anything
    assert again.returncode == 0 and ": start" not in again.stdout and "2 seeds: gain min" in again.stdout


# --- damaged input to the study tools: one line, the run named, never a traceback ---------------------------------

DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON whose parse would recurse 100,000 levels


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The one stderr line of a tool that stopped on bad input (exit 2, no traceback)."""
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def test_a_too_deep_json_line_leaves_out_its_run_and_a_too_deep_records_file_is_one_line(tmp_path):
    """Every JSON and JSONL file is read by the trainer's bounded reader: a 100,000-deep line in one run's
    metrics.jsonl, or in its config.json, leaves that run out (named, counted) and the others are written; a records
    file nesting that deep is one line naming it."""
    for s in range(3):
        fake_run(tmp_path, f"onpolicy-s{s}", seed=s, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
    with open(tmp_path / "onpolicy-s1" / "metrics.jsonl", "a") as f:
        f.write(DEEP + "\n")
    (tmp_path / "onpolicy-s2" / "config.json").write_text('{"seed": 2, "x": ' + DEEP + "}")
    to = tmp_path / "records.json.xz"
    done = tool("tools/sweep.py", "records", str(tmp_path), "--to", str(to))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f"{tmp_path / 'onpolicy-s1' / 'metrics.jsonl'}:6: its arrays and objects nest deeper than 64" in done.stdout
    assert f"{tmp_path / 'onpolicy-s2' / 'config.json'}: its arrays and objects nest deeper than 64" in done.stdout
    assert "report: 2 run folder(s) with a damaged file left out" in done.stdout
    assert [r["name"] for r in runner.load_records(to)] == ["onpolicy-s0"]
    (tmp_path / "deep.json").write_text('{"runs": ' + DEEP + "}")
    line = one_error_line(tool("tools/sweep.py", "report", "--records", str(tmp_path / "deep.json")))
    assert line.startswith(f"error: --records {tmp_path / 'deep.json'}: its arrays and objects nest deeper"), line


def replay_records(tmp_path: Path, seeds=range(4)) -> dict:
    """The records of two configurations' finished runs (seeds 0-3), as the replay report writes them."""
    out = tmp_path / "runs"
    for s in seeds:
        fake_run(out, f"onpolicy-s{s}", seed=s, lr=1e-4, N=8, P=2, accs=[0, 0.2 + 0.1 * (s % 2), 0.5])
        fake_run(out, f"N16-R4-grpo-s{s}", seed=s, lr=1e-4, N=16, P=1, accs=[0, 0.5, 0.6])
    sweep.main(["report", "--out-dir", str(out), "--report-dir", str(tmp_path / "first")])
    return runner.read_records(tmp_path / "first" / runner.RECORDS)


def test_a_damaged_run_of_a_records_file_is_named_in_one_line_and_left_out(tmp_path):
    """Each run of a records file is type-checked: one whose records are not a list, or whose record holds a text
    where a number belongs, is named in one line and left out, the report says how many, and the others report; a
    run folder's metrics.jsonl record likewise."""
    data = replay_records(tmp_path)
    runs = {r["name"]: r for r in data["runs"]}
    runs["onpolicy-s3"]["records"] = "oops"
    runs["N16-R4-grpo-s3"]["records"][2]["entropy"] = "0.5"
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(data))
    done = tool("tools/sweep.py", "report", "--records", str(path), "--report-dir", str(tmp_path / "report"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f'{path}: run onpolicy-s3 left out, damaged: "records" is not a list of records' in done.stdout
    assert f'{path}: run N16-R4-grpo-s3 left out, damaged: "records": step 2: "entropy" is not a number' in done.stdout
    assert f"report: 2 damaged run(s) of {path} left out" in done.stdout
    s = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert s["configs"]["onpolicy"]["seeds"] == s["configs"]["N16-R4-grpo"]["seeds"] == [0, 1, 2]
    metrics = tmp_path / "runs" / "onpolicy-s0" / "metrics.jsonl"  # a run folder's record is checked alike
    metrics.write_text(metrics.read_text().replace('"mu": 1.0', '"mu": "1.0"', 1))
    done = tool("tools/sweep.py", "records", str(tmp_path / "runs"), "--to", str(tmp_path / "r.json.xz"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f'onpolicy-s0 left out, a file is damaged: {metrics}:2: step 1: "mu" is not a number' in done.stdout
    assert len(runner.load_records(tmp_path / "r.json.xz")) == 7


def corrections_records(tmp_path: Path, damage) -> Path:
    """The committed corrections study's records, damage(data) applied, as a plain JSON file."""
    data = json.loads(lzma.decompress((ROOT / "docs/study/corrections/records.json.xz").read_bytes()))
    damage(data)
    (tmp_path / "records.json").write_text(json.dumps(data))
    return tmp_path / "records.json"


def test_a_corrections_run_whose_evals_are_text_is_named_and_left_out(tmp_path):
    def damage(data):  # a run of a reported seed (not a tune seed), which the statistic reads
        next(r for r in reversed(data["runs"]) if r["seed"] not in data["tune_seeds"])["evals"] = "0.9"

    path = corrections_records(tmp_path, damage)
    last = next(r for r in json.loads(path.read_text())["runs"] if r["evals"] == "0.9")
    argv = ["--records", str(path), "--report-dir", str(tmp_path / "report"), "--replicates", "50"]
    done = tool("tools/corrections_study.py", *argv)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    name = f"{last['config']} seed {last['seed']} lr {last['lr']:g}"
    assert f'run {name} left out, damaged: "evals" is not a list of [step, generated rollouts' in done.stdout
    assert f"report: 1 damaged run(s) of {path} left out" in done.stdout
    assert last["seed"] not in json.loads((tmp_path / "report" / "summary.json").read_text())["seeds"]


def test_a_nan_a_statistic_reads_is_refused_with_its_run_named(tmp_path):
    """A NaN accuracy in a records file would move the corrections study's intervals silently: the report stops
    with one line naming the run and the value; a run folder with a NaN entropy (read by the entropy curves) stops
    `sweep.py records`, one with a NaN the reports do not read (loss) is written."""
    reported = []

    def damage(data):
        run = next(r for r in data["runs"] if r["seed"] not in data["tune_seeds"] and r["config"].endswith("-tis"))
        run["evals"][-1][2] = math.nan
        reported.append(run)

    path = corrections_records(tmp_path, damage)
    (run,) = reported
    line = one_error_line(tool("tools/corrections_study.py", "--records", str(path), "--replicates", "50"))
    name = f"{run['config']} seed {run['seed']} lr {run['lr']:g}"
    assert line.startswith(f"error: --records {path}: run {name}: evals, {len(run['evals']) - 1}, 2 is nan"), line
    out = tmp_path / "runs"
    for s, key in enumerate(("entropy", "loss")):
        fake_run(out, f"onpolicy-s{s}", seed=s, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
        metrics = out / f"onpolicy-s{s}" / "metrics.jsonl"
        recs = [json.loads(line) for line in metrics.read_text().splitlines()]
        recs[3][key] = math.nan
        metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    line = one_error_line(tool("tools/sweep.py", "records", str(out), "--to", str(tmp_path / "r.json.xz")))
    assert line.startswith(f"error: {out / 'onpolicy-s0'}: records, step 3, entropy is nan"), line
    shutil.rmtree(out / "onpolicy-s0")
    done = tool("tools/sweep.py", "records", str(out), "--to", str(tmp_path / "r.json.xz"))
    assert done.returncode == 0 and [r["name"] for r in runner.load_records(tmp_path / "r.json.xz")] == ["onpolicy-s1"]


def test_a_records_file_that_cannot_be_written_or_read_is_one_line_naming_it(tmp_path):
    """`sweep.py records --to` a folder or a place that cannot be written, and a `--records` file without runs or
    damaged, are each one line (exit 2) naming the file and its flag, not the default --out-dir."""
    out = tmp_path / "runs"
    fake_run(out, "onpolicy-s0", seed=0, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    line = one_error_line(tool("tools/sweep.py", "records", str(out), "--to", str(tmp_path / "folder")))
    assert line.startswith(f"error: --to {tmp_path / 'folder'} is a folder: give the records file"), line
    to = tmp_path / "file" / "records.json.xz"  # under a file: a place nothing can be written
    line = one_error_line(tool("tools/sweep.py", "records", str(out), "--to", str(to)))
    assert line.startswith(f"error: --to {to}: cannot write the records"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder", "runs"]  # nothing left behind
    (tmp_path / "empty.json").write_text('{"runs": []}')
    line = one_error_line(tool("tools/sweep.py", "report", "--records", str(tmp_path / "empty.json")))
    assert line == f"error: --records {tmp_path / 'empty.json'}: it holds no run to report", line
    sweep.main(["records", str(out), "--to", str(tmp_path / "r.json.xz")])
    cut = tmp_path / "cut.json.xz"
    cut.write_bytes((tmp_path / "r.json.xz").read_bytes()[:-40])
    for tool_argv in (["tools/sweep.py", "report"], ["tools/pareto.py"], ["tools/compute_study.py"]):
        line = one_error_line(tool(*tool_argv, "--records", str(cut)))
        assert line.startswith(f"error: --records {cut}: ") and "runs/" not in line, line
