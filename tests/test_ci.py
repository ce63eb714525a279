"""The source rules CI checks before the tests (.ci/check_source.py), on code made to break each one; the suite's split
over two workers."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

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


def test_the_source_check_fails_on_a_module_beneath_the_entries_that_imports_one():
    """infra/ and kernels.py import neither entry: an import of one, at the top or inside a function, plain or from,
    fails in one line; a tool may import the method; the real folder and kernels.py pass."""
    check = load_check()
    why = "an entry: infra/ and kernels.py lie beneath both entries and import neither (pass what they need of the "
    why += "method in)"
    code = "import os\nimport replay_grpo as rg\n\n\ndef f():\n    from async_pipeline import AsyncArgs\n"
    assert check.violations(Path("infra/tasks.py"), code, set()) == [
        f"infra/tasks.py:2: imports replay_grpo, {why}",
        f"infra/tasks.py:6: imports async_pipeline, {why}",
    ]
    assert check.violations(Path("kernels.py"), "import replay_grpo.x\n", set()) == [
        f"kernels.py:1: imports replay_grpo, {why}"
    ]
    assert check.violations(Path("tools/sweep.py"), "import replay_grpo\n", set()) == []
    for path in [ROOT / "kernels.py", *sorted((ROOT / "infra").glob("*.py"))]:
        assert check.violations(path.relative_to(ROOT), path.read_text(), set()) == [], path


def test_the_source_check_finds_an_import_circle(tmp_path, capsys):
    """Modules that import one another, a function's import included, are a circle, named in one line through its
    modules; the real tree has none."""
    check = load_check()
    sources = {"a": "import b\n", "b": "from infra import c\n", "infra": "", "infra.c": "def f():\n    import a\n"}
    assert check.import_circles(sources) == [["a", "b", "infra.c", "a"]]
    assert check.import_circles(sources | {"infra.c": "import os\n"}) == []
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "infra").mkdir()
    (tmp_path / "replay_grpo.py").write_text("from infra import warm_start\n")
    (tmp_path / "infra" / "warm_start.py").write_text("def load():\n    import replay_grpo\n")
    subprocess.run(["git", "add", "--intent-to-add", "replay_grpo.py", "infra/warm_start.py"], cwd=tmp_path, check=True)
    assert check.main(tmp_path) == 1
    out = capsys.readouterr().out
    assert "-: an import circle: infra.warm_start -> replay_grpo -> infra.warm_start" in out, out
    assert "infra/warm_start.py:2: imports replay_grpo, an entry" in out, out
    assert check.main(ROOT) == 0
    assert "replay_grpo.py: " in capsys.readouterr().out  # its size, reported


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


def test_the_suites_groups_reach_pytest_xdist(tmp_path):
    """Under two workers (pyproject.toml's addopts), the tests that take a module fixture run in one worker, which
    builds it once; the hook must mark them before pytest-xdist reads the marks, or it splits them silently."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(ROOT / 'tests' / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
    )
    built = tmp_path / "built.txt"
    (tmp_path / "test_shared.py").write_text(
        "import os\nimport pytest\n\n\n@pytest.fixture(scope='module')\ndef shared():\n"
        f"    with open({str(built)!r}, 'a') as f:\n        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n\n\n"
        + "".join(f"def test_{i}(shared):\n    pass\n\n\n" for i in range(20))
        + "".join(f"def test_free_{i}():\n    pass\n\n\n" for i in range(20))
    )
    flags = ["-q", "-p", "no:cacheprovider", "-n", "2", "--dist=loadgroup", "-rA"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *flags, str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(built.read_text().split()) == 1, built.read_text()  # one worker built it
    assert done.stdout.count("@test_shared.py") == 20, done.stdout[-3000:]  # the free tests carry no group
