"""failed_replay_study.py: the weights' distance moved, measured from a real checkpoint against the model the trainer
starts from; the rule's "holds" at its bounds; run folders read end to end and reported again from the records alone,
byte for byte."""

import json

import pytest
import sweep
import torch
from failed_replay_study import main, problem
from studylib import runner

from infra.models import build_tiny_model


def write_run(folder, seed: int, accs: list[float], moved: dict[str, float], zero_steps: int = 3) -> float:
    """A run folder as replay_grpo.py writes one (R = 8, B = 32 a step, evaluated every 2 steps), its final checkpoint
    the tiny model of its seed with each tensor named in `moved` shifted by that amount everywhere. Returns the
    distance that shift is, computed by hand: sqrt(sum of numel x shift^2)."""
    folder.mkdir(parents=True)
    model, _ = build_tiny_model(seed)
    expected = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in moved:
                p.add_(moved[name])
                expected += p.numel() * moved[name] ** 2
    model.save_pretrained(folder / "checkpoint")
    cfg = {"model": "tiny", "seed": seed, "lr": 1e-5, "prompts_per_step": 1, "group_size": 8, "batch_size": 32}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "machines.jsonl").write_text(json.dumps({"time": f"2026-12-08T01:0{seed}:00"}) + "\n")
    lines, steps = [{"step": 0, "eval/greedy_acc": accs[0]}], 2 * (len(accs) - 1)
    for t in range(1, steps + 1):
        r = {"step": t, "generated_rollouts": 8 * t, "trained_rollouts": 32 * t, "total_generated_tokens": 80 * t}
        r |= {"entropy": 1.0 + t / 10, "clip_frac": 0.01, "offpolicy_by_staleness": {}, "by_staleness": {}}
        if t % 2 == 0:
            r["eval/greedy_acc"] = accs[t // 2]
        lines.append(r)
    lines[-1] |= {"zero_signal_steps": zero_steps, "zero_signal_skipped_steps": 0, "evicted": {"drift": 2, "age": 5}}
    lines[-1] |= {"evicted_age_mean": 3.5}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return expected**0.5


def test_distance_and_verdicts_from_run_folders_and_again_from_the_records_byte_for_byte(tmp_path):
    runs, shift = tmp_path / "runs", {"model.embed_tokens.weight": 0.01, "model.norm.weight": -0.03}
    expected = {}
    for variant, ends in (("baseline", (0.3, 0.5)), ("skip-zero-signal", (0.4, 0.6)), ("max-drift", (0.5, 0.5))):
        for seed, end in zip((7, 8), ends):
            accs = [0.3, 0.35, end] if variant != "max-drift" or seed == 7 else [0.3, 0.62, 0.5]  # seed 8 falls 12
            expected[variant, seed] = write_run(runs / variant / str(seed) / "run", seed, accs, shift)
        write_run(runs / variant / "9" / "run", 9, [0.3, 0.3, 0.3], shift)  # no wall time: unfinished, left out
        (runs / variant / "seed_table.json").write_text(json.dumps({"7": 600.0, "8": 660.0}))
    s = main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])

    row = s["runs"]["baseline"][0]
    assert row["distance"] == pytest.approx(expected["baseline", 7], rel=1e-6) and row["distance"] > 0
    # 4 steps of R = 8: 32 generated rollouts
    assert row["distance_per_generated"] == pytest.approx(expected["baseline", 7] / 32, rel=1e-6)
    # entropy 1.1 ... 1.4 over the 4 steps: the first 10 and the last 10 are all of them
    assert row["entropy"] == pytest.approx([1.25, 1.25]) and row["evicted_by_drift"] == 2
    skip, drift = s["variants"]["skip-zero-signal"], s["variants"]["max-drift"]
    # skip ends +0.10 on both seeds (holds at the bound); max-drift +0.20 and 0.0, and seed 8 falls 0.12
    assert [r["end_over_baseline"] for r in s["runs"]["skip-zero-signal"]] == pytest.approx([0.1, 0.1])
    assert skip["holds"] and skip["missing_seeds"] == []
    assert (drift["holds"], drift["gains"], drift["steady"]) == (False, False, False)
    assert "lr-reuse-exponent" not in s["variants"]

    main(["--records", str(tmp_path / "a" / runner.RECORDS), "--report-dir", str(tmp_path / "b")])
    for name in ("table.md", "summary.json"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name
    assert "**holds**" in (tmp_path / "a" / "table.md").read_text()
    sweep.render(tmp_path / "a" / "summary.json", tmp_path / "rendered.md")  # the summary names its study
    assert (tmp_path / "rendered.md").read_bytes() == (tmp_path / "a" / "table.md").read_bytes()


def test_a_variant_missing_a_baseline_seed_is_undecided_and_a_fall_of_exactly_ten_points_fails(tmp_path):
    runs = tmp_path / "runs"
    for variant, seeds, accs in (("baseline", (7, 8), [0.3, 0.5, 0.5]), ("lr-reuse-exponent", (7,), [0.3, 0.8, 0.7])):
        for seed in seeds:
            write_run(runs / variant / str(seed) / "run", seed, accs, {})
        (runs / variant / "seed_table.json").write_text(json.dumps({str(s): 60.0 for s in seeds}))
    s = main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])
    v = s["variants"]["lr-reuse-exponent"]
    assert (v["holds"], v["missing_seeds"], v["gains"], v["steady"]) == (False, [8], True, False)
    assert s["runs"]["baseline"][0]["distance"] == 0.0
    assert "undecided: seeds 8 not run" in (tmp_path / "a" / "table.md").read_text()


def test_a_checkpoint_of_another_model_stops_the_report_naming_the_tensor_and_a_damaged_record_is_named(tmp_path):
    runs = tmp_path / "runs"
    folder = runs / "baseline" / "7" / "run"
    write_run(folder, 7, [0.3, 0.4, 0.5], {})
    (runs / "baseline" / "seed_table.json").write_text(json.dumps({"7": 60.0}))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"model": "tiny", "seed": 7}))
    from safetensors.torch import load_file, save_file

    path = next((folder / "checkpoint").glob("*.safetensors"))
    tensors = load_file(path)
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(SystemExit, match="model.norm.weight is not a tensor of --model tiny of that shape"):
        main(["--runs", str(runs), "--report-dir", str(tmp_path / "a")])
    assert problem({"arm": "baseline", "seed": 7}) == "no settings with a learning rate"
    assert problem({"arm": "resampled", "seed": 7}) == "no variant of " + ", ".join(
        ("baseline", "skip-zero-signal", "max-drift", "lr-reuse-exponent")
    )
