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
