"""failed_replay_study.py: the weights' distance moved, measured from a real checkpoint against the model the trainer
starts from; the rule's "holds" at its bounds and with a seed not run; runs whose settings are not their variant's
refused; run folders read end to end and reported again from the records alone, byte for byte."""

import json
import re

import pytest
import sweep
import torch
from failed_replay_study import FLAGS, main, problem
from studylib import runner

from infra.models import build_tiny_model

SHIFT = {"model.embed_tokens.weight": 0.01, "model.norm.weight": -0.03}


def write_run(folder, variant: str, seed: int, accs: list[float], moved: dict[str, float], **cfg) -> float:
    """A run folder as replay_grpo.py writes one (R = 8, B = 32 a step, evaluated every 2 steps), its settings the
    variant's, its final checkpoint the tiny model of its seed with each tensor named in `moved` shifted by that
    amount everywhere. Returns the distance that shift is, computed by hand: sqrt(sum of numel x shift^2)."""
    folder.mkdir(parents=True)
    model, _ = build_tiny_model(seed)
    expected = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in moved:
                p.add_(moved[name])
                expected += p.numel() * moved[name] ** 2
    model.save_pretrained(folder / "checkpoint")
    flags = {"skip_zero_signal": False, "max_drift": None, "lr_reuse_exponent": 0.0}
    flags |= {"skip-zero-signal": {"skip_zero_signal": True}, "max-drift": {"max_drift": 0.04}}.get(variant, {})
    flags |= {"lr_reuse_exponent": 1.0} if variant == "lr-reuse-exponent" else {}
    settings = {"model": "tiny", "seed": seed, "lr": 1e-5, "prompts_per_step": 1, "group_size": 8, "batch_size": 32}
    (folder / "config.json").write_text(json.dumps(settings | flags | {"total_steps": 2 * (len(accs) - 1)} | cfg))
    (folder / "machines.jsonl").write_text(json.dumps({"time": f"2026-12-08T01:0{seed}:00"}) + "\n")
    lines, steps = [{"step": 0, "eval/greedy_acc": accs[0]}], 2 * (len(accs) - 1)
    for t in range(1, steps + 1):
        r = {"step": t, "generated_rollouts": 8 * t, "trained_rollouts": 32 * t, "total_generated_tokens": 80 * t}
        r |= {"entropy": 1.0 + t / 10, "clip_frac": 0.01, "offpolicy_by_staleness": {}, "by_staleness": {}}
        if t % 2 == 0:
            r["eval/greedy_acc"] = accs[t // 2]
        lines.append(r)
    lines[-1] |= {"zero_signal_steps": 3, "zero_signal_skipped_steps": 0, "evicted": {"drift": 2, "age": 5}}
    lines[-1] |= {"evicted_age_mean": 3.5}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return expected**0.5


def write_variant(runs, variant: str, accs: dict[int, list[float]], moved=SHIFT, finished=None, **cfg) -> dict:
    """The variant's run folders, one per seed, and its seed_table.json (the seeds in `finished`, all by default)."""
    expected = {s: write_run(runs / variant / str(s) / "run", variant, s, a, moved, **cfg) for s, a in accs.items()}
    done = accs if finished is None else finished
    (runs / variant / "seed_table.json").write_text(json.dumps({str(s): 600.0 + s for s in done}))
    return expected


def test_distance_and_verdicts_from_run_folders_and_again_from_the_records_byte_for_byte(tmp_path):
    runs, up, expected = tmp_path / "runs", [0.3, 0.35], {}
    # seed 10 has no wall time: unfinished, left out
    expected["baseline"] = write_variant(
        runs, "baseline", {7: up + [0.3], 8: up + [0.5], 9: up + [0.4], 10: up + [0.3]}, finished=(7, 8, 9)
    )
    # skip ends +0.10 on each seed (0.6 - 0.5 is just under 0.1 in floats: holds at the bound)
    expected["skip-zero-signal"] = write_variant(
        runs, "skip-zero-signal", {7: up + [0.4], 8: up + [0.6], 9: up + [0.5]}, {"model.norm.weight": 0.5}
    )
    # max-drift: +0.20, 0.0, +0.2, and seed 8 falls 0.12
    expected["max-drift"] = write_variant(runs, "max-drift", {7: up + [0.5], 8: [0.3, 0.62, 0.5], 9: up + [0.6]})
    s = main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])

    for variant, rows in s["runs"].items():
        assert [r["seed"] for r in rows] == [7, 8, 9]
        for r in rows:  # each seed's run measured against its own seed's model
            assert r["distance"] == pytest.approx(expected[variant][r["seed"]], rel=1e-6) and r["distance"] > 0
    row = s["runs"]["baseline"][0]
    # 4 steps of R = 8: 32 generated rollouts
    assert row["distance_per_generated"] == pytest.approx(expected["baseline"][7] / 32, rel=1e-6)
    # entropy 1.1 ... 1.4 over the 4 steps: the first 10 and the last 10 are all of them
    assert row["entropy"] == pytest.approx([1.25, 1.25]) and row["evicted_by_drift"] == 2
    skip, drift = s["variants"]["skip-zero-signal"], s["variants"]["max-drift"]
    assert [r["end_over_baseline"] for r in s["runs"]["skip-zero-signal"]] == pytest.approx([0.1, 0.1, 0.1])
    assert skip["holds"] and skip["missing_seeds"] == []
    assert (drift["holds"], drift["gains"], drift["steady"]) == (False, False, False)
    assert "lr-reuse-exponent" not in s["variants"] and drift["max_drift"] == [0.04]

    main(["--records", str(tmp_path / "a" / runner.RECORDS), "--report-dir", str(tmp_path / "b")])
    for name in ("table.md", "summary.json"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name
    assert "**holds**" in (tmp_path / "a" / "table.md").read_text()
    sweep.render(tmp_path / "a" / "summary.json", tmp_path / "rendered.md")  # the summary names its study
    assert (tmp_path / "rendered.md").read_bytes() == (tmp_path / "a" / "table.md").read_bytes()


def test_a_seed_not_run_leaves_a_variant_undecided_and_a_fall_of_ten_points_fails(tmp_path):
    runs = tmp_path / "runs"
    write_variant(runs, "baseline", {7: [0.3, 0.4, 0.4], 8: [0.3, 0.4, 0.4], 9: [0.3, 0.4, 0.4]}, moved={})
    # gains 0.2 and steady on the two seeds it has, but seed 9 is unfinished
    write_variant(
        runs, "lr-reuse-exponent", {7: [0.3, 0.5, 0.6], 8: [0.3, 0.5, 0.6], 9: [0.3, 0.3, 0.3]}, finished=(7, 8)
    )
    # 0.5 -> 0.4 is a fall a hair under 0.1 in floats: ten points, which fails
    write_variant(runs, "skip-zero-signal", {7: [0.3, 0.5, 0.6], 8: [0.3, 0.7, 0.6], 9: [0.3, 0.5, 0.4]}, moved={})
    # max-drift's first seed still runs: seed_table.py writes seed_table.json when a seed finishes
    (runs / "max-drift" / "7" / "run").mkdir(parents=True)
    s = main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])
    assert "max-drift" not in s["variants"]
    v, skip = s["variants"]["lr-reuse-exponent"], s["variants"]["skip-zero-signal"]
    assert (v["holds"], v["missing_seeds"], v["gains"], v["steady"]) == (False, [9], True, True)
    assert s["runs"]["lr-reuse-exponent"][0]["lr"] == pytest.approx(1e-5 * 8 / 32)
    assert (skip["holds"], skip["gains"], skip["steady"]) == (False, False, False)
    assert s["runs"]["baseline"][0]["distance"] == 0.0
    assert "undecided: seeds 9 not run" in (tmp_path / "a" / "table.md").read_text()


@pytest.mark.parametrize(
    "variant, cfg, message",
    [
        ("max-drift", {"max_drift": None}, "not the max-drift variant's (only max_drift set)"),
        ("skip-zero-signal", {"max_drift": 0.04}, "not the skip-zero-signal variant's (only skip_zero_signal set)"),
        ("skip-zero-signal", {"total_steps": 6}, "differ from baseline seed 7's in total_steps"),
    ],
)
def test_a_run_whose_settings_are_not_its_variants_stops_the_report(tmp_path, variant, cfg, message):
    runs, accs = tmp_path / "runs", {7: [0.3, 0.4, 0.5]}
    write_variant(runs, "baseline", accs, moved={})
    write_variant(runs, variant, accs, moved={}, **cfg)
    with pytest.raises(SystemExit, match=f"{variant} seed 7: its settings .*{re.escape(message)}"):
        main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])


def test_a_checkpoint_not_of_the_model_or_cut_and_a_damaged_record_are_named_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    runs = tmp_path / "runs"
    write_variant(runs, "baseline", {7: [0.3, 0.4, 0.5]}, moved={})
    path = next((runs / "baseline" / "7" / "run" / "checkpoint").glob("*.safetensors"))
    tensors = load_file(path)
    save_file(tensors | {"model.norm.weight": torch.zeros(3)}, path, metadata={"format": "pt"})
    with pytest.raises(SystemExit, match="model.norm.weight is not a tensor of --model tiny of that shape"):
        main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SystemExit, match="not a whole safetensors file"):
        main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])
    record = {"arm": "baseline", "seed": 7, "cfg": {"lr": 1e-5}, "wall_seconds": 1.0, "m2_by_staleness": {}}
    record |= {"distance": 0.1, "entropy": [1.0, 2.0], "zero_signal_steps": 3.5}
    record["evals"] = [dict(step=0, generated_rollouts=0, trained_rollouts=0, total_generated_tokens=0, greedy_acc=0.3)]
    assert problem(record) == "no generated rollouts at its last evaluation"
    record["evals"].append(record["evals"][0] | {"step": 2, "generated_rollouts": 16})
    assert problem(record) == "one of zero_signal_steps, zero_signal_skipped_steps is not a whole number"
    assert problem(record | {"zero_signal_steps": 3}) is None
    assert problem(record | {"arm": "resampled"}) == "no variant of baseline, " + ", ".join(FLAGS)
