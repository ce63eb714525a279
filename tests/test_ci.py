"""The source rules CI checks before the tests (.ci/check_source.py), on code made to break each one."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_check():
    spec = importlib.util.spec_from_file_location("check_source", ROOT / ".ci" / "check_source.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_the_source_check_names_each_kind_of_violation():
    """Calls with six positional arguments in a source file (not a test; not save_for_backward), citations of files
    outside the repository and of issue numbers; line length and the rest are ruff's."""
    check = load_check()
    code = "x = 1\n" + "y = '" + "a" * 120 + "'\n" + "f(1, 2, 3, 4, 5, 6)\nctx.save_for_backward(a, b, c, d, e, f)\n"
    found = check.violations(Path("source.py"), code, set())
    assert found == ["source.py:3: a call with 6 positional arguments (at most 5: pass the others by keyword)"]
    assert check.violations(Path("test_x.py"), "f(1, 2, 3, 4, 5, 6)\n", set()) == []  # tests may
    other, issue = "OTHER" + ".md", "issue" + " #12"  # split, or the check would find them in this file
    found = check.violations(Path("README.md"), f"see {other} and {issue}\n", {"README.md"})
    assert found == [f"README.md:1: cites {other}, not in the repository", f"README.md:1: cites '{issue}'"]
    assert check.violations(Path("README.md"), f"see {other}\n", {other}) == []


@pytest.mark.parametrize("name", ["replay_grpo.py", "async_pipeline.py"])
def test_the_source_check_keeps_the_method_and_the_system_first(name):
    """replay_grpo.py's marked method end and async_pipeline.py's train_async before their lines, each with 40 lines
    of room at least: the real files pass; pushed down, or without the line, they fail in one line each."""
    check = load_check()
    path, (start, limit) = Path(name), check.POSITIONS[name]
    text = (ROOT / path).read_text()
    assert check.violations(path, text, set()) == []
    at = next(i + 1 for i, line in enumerate(text.splitlines()) if line.startswith(start))
    assert at <= limit - 40, f"{name}: {start!r} at line {at}, less than 40 lines before its limit {limit}"
    found = check.violations(path, "\n" * (limit - at) + text, set())  # pushed down to its limit
    assert found == [f"{name}:{limit}: {start!r} must start before line {limit} (the method or system first)"]
    assert check.violations(path, text.replace(start, "# gone"), set()) == [
        f"{name}:-: {start!r} must start before line {limit} (the method or system first)"
    ]


def test_the_source_check_fails_on_a_tracked_tree_over_its_size_limit(tmp_path, capsys):
    """The tracked files' sizes sum to at most MAX_TREE_BYTES (the GPU machines carry 64 MiB of working tree): a
    repository one byte over it fails, one at it passes, and the real tree is within it."""
    check = load_check()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "notes.md").write_text("a note\n")
    with open(tmp_path / "data.bin", "wb") as f:  # sparse: no disk is used, its size is what counts
        f.truncate(check.MAX_TREE_BYTES - len("a note\n"))
    subprocess.run(["git", "add", "--intent-to-add", "notes.md", "data.bin"], cwd=tmp_path, check=True)
    assert check.main(tmp_path) == 0
    with open(tmp_path / "data.bin", "ab") as f:
        f.write(b"x")
    assert check.main(tmp_path) == 1
    out = capsys.readouterr().out
    assert f"more than {check.MAX_TREE_BYTES // 2**20} MiB" in out and "data.bin (32.0 MiB)" in out, out
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert check.tree_violations(ROOT, tracked.stdout.split("\0")[:-1]) == []
