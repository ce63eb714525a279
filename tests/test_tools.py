"""Every tool as printed in the docs: `python tools/NAME.py --help` from the root, and the committed study reports
rendered again from their committed summaries, byte for byte."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sweep

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
