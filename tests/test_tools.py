"""Every tool as printed in the docs: `python tools/NAME.py --help` from the root, and the committed study reports
rendered again from their committed summaries, and computed again from their committed per-run records, byte for
byte."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sweep
from studylib import runner

ROOT = Path(__file__).resolve().parent.parent
TOOLS = sorted(p.name for p in (ROOT / "tools").glob("*.py"))
SUMMARIES = sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("study*/**/summary.json"))


def test_the_tools_and_reports_are_found():
    assert {"sweep.py", "pareto.py", "seed_table.py", "gpu_check.py", "compare_metrics.py"} <= set(TOOLS)
    assert {str(p.parent) for p in SUMMARIES} >= {"docs/study", "docs/study/pareto", "docs/study/variants"}


@pytest.mark.parametrize("name", TOOLS)
def test_each_tool_prints_its_usage_from_the_root(name):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, f"tools/{name}", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    first = done.stdout.lstrip().splitlines()[0]
    assert first.startswith("usage:") and name in first, done.stdout


@pytest.mark.parametrize("summary", SUMMARIES, ids=str)
def test_a_committed_report_renders_again_from_its_summary_byte_for_byte(summary, tmp_path):
    sweep.main(["render", str(ROOT / summary), "--table", str(tmp_path / "table.md")])
    assert (tmp_path / "table.md").read_bytes() == (ROOT / summary).with_name("table.md").read_bytes()


# Each committed records.json.xz (a study's per-run records) and the report command that computed its folder from it
FROM_RECORDS = {
    "docs/study/compute": ["compute_study", "--seeds", *map(str, range(20, 60))],
    "docs/study/compute/replication": ["compute_study", "--h2", "None", "--seeds", *map(str, range(300, 340))],
    "docs/study/corrections": ["corrections_study"],
    "docs/study/pareto/rerun": ["pareto"],
    "docs/study/real_model": ["real_model_study"],
    "docs/study/real_model/full": ["real_model_study"],
    "docs/study/real_model/lr1e5": ["real_model_study"],
    "docs/study/real_model/shared": ["real_model_study"],
    "docs/study/real_replay/results": ["real_replay_study"],
    "docs/study/rerun": ["replay_study"],
    "docs/study/variants/rerun": ["replay_study", "--reference", "N224-R32-grpo"],
}


def test_every_committed_records_file_has_its_report_command():
    found = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "docs").glob(f"study*/**/{runner.RECORDS}")}
    assert found == set(FROM_RECORDS)
    assert not list((ROOT / "docs").glob("study*/**/records.json")), "records are kept compressed"


@pytest.mark.parametrize("folder", sorted(FROM_RECORDS))
def test_a_committed_report_is_computed_again_from_its_committed_records_byte_for_byte(folder, tmp_path):
    tool, *argv = FROM_RECORDS[folder]
    importlib.import_module(tool).main(
        ["--records", str(ROOT / folder / runner.RECORDS), "--report-dir", str(tmp_path)] + argv
    )
    written = sorted(p.name for p in tmp_path.iterdir())
    assert {"table.md", "summary.json", runner.RECORDS} <= set(written), written
    for name in written:  # the figures too; the records as JSON (another liblzma may compress them otherwise)
        new, old = (tmp_path / name).read_bytes(), (ROOT / folder / name).read_bytes()
        if name == runner.RECORDS:
            new, old = runner.decompress(tmp_path / name, new), runner.decompress(ROOT / folder / name, old)
        assert new == old, name


def test_the_real_model_report_compares_the_arms_at_the_budget_every_run_reached_and_one_is_better_only_three_to_none(
    tmp_path,
):
    """real_model_study's comparison: each run read at the fewest tokens any run ended on (linear between
    evaluations), then at the end when the arms ended on the same rollouts (within 5%); an arm is better only when
    each of its seeds beats each of the other's."""
    import real_model_study

    def run(arm, seed, tokens, accs):
        evals = [
            dict(step=i, tokens=t, rollouts=i, seconds=i, greedy_acc=a) for i, (t, a) in enumerate(zip(tokens, accs))
        ]
        answer = dict(question="1 + 1 =", gold="2", completion="<answer>2</answer>", score=1.0)
        return dict(
            arm=arm, seed=seed, wall_seconds=60.0, config={}, evals=evals, answers=dict(first=[answer], last=[answer])
        )

    on = [run("on-policy", 1, (0, 3000, 6000), (0.3, 0.4, 0.5)), run("on-policy", 2, (0, 3000, 5800), (0.3, 0.5, 0.6))]
    on.append(run("on-policy", 3, (0, 3000, 6100), (0.3, 0.35, 0.45)))
    replay = [run("replay", 1, (0, 2900, 5900), (0.3, 0.6, 0.7)), run("replay", 2, (0, 2900, 5700), (0.3, 0.65, 0.8))]
    for last, better in ((0.66, "replay"), (0.55, "undecided")):
        records = {"runs": on + replay + [run("replay", 3, (0, 3000, 6000), (0.3, 0.62, last))]}
        runner.write_records(tmp_path / runner.RECORDS, records, "--to")
        c = real_model_study.main(["--records", str(tmp_path / runner.RECORDS), "--report-dir", str(tmp_path / "r")])
        c = c["comparison"]
        assert c["tokens"] == 5700  # replay seed 2's end
        assert c["at_tokens"]["on-policy"] == pytest.approx(
            [0.4 + 0.1 * 27 / 30, 0.5 + 0.1 * 27 / 28, 0.35 + 0.1 * 27 / 31]
        )
        assert c["at_tokens"]["replay"] == pytest.approx([0.6 + 0.1 * 28 / 30, 0.8, 0.62 + (last - 0.62) * 27 / 30])
        assert c["at_end"] == {"on-policy": [0.5, 0.6, 0.45], "replay": [0.7, 0.8, last]}
        assert c["better_at_tokens"] == c["better_at_end"] == better
        assert "| at 5700 generated tokens | 0.490, 0.596, 0.437 |" in (tmp_path / "r" / "table.md").read_text()
    arms = real_model_study.by_arm(records)
    for rollouts, compared in ((1280, False), (640, True)):  # replay ends on 664 (its first batch filled)
        for arm, n in (("on-policy", rollouts), ("replay", 664)):
            for r in arms[arm]:
                r["evals"][-1]["rollouts"] = n
        c = real_model_study.compare(arms["on-policy"], arms["replay"])
        assert ("at_end" in c) == compared and c["tokens"] == 5700 and c["better_at_tokens"] == "undecided"
    records["runs"][-1]["evals"][-1]["greedy_acc"] = 0.66  # the arms swapped: the first is then better
    arms = real_model_study.by_arm(records)
    assert real_model_study.compare(arms["replay"], arms["on-policy"])["better_at_end"] == "on-policy"
