"""The source rules CI checks before the tests (python .ci/check_source.py), on every tracked file, beside ruff
(format, pyflakes, import order, pycodestyle: pyproject.toml), which checks neither of these:

- the source files (not the tests): no call with six or more positional arguments (keywords say what each is;
  ctx.save_for_backward takes its tensors as positional arguments only);
- code and docs cite no file outside the repository and no issue number (the project speaks for itself);
- replay_grpo.py puts the method first and async_pipeline.py its system: each file's one line of POSITIONS starts
  before its limit (the files are ruff-formatted, checked before this);
- the tracked files' working-tree sizes sum to at most MAX_TREE_BYTES.

Prints one line per violation (file:line: what) and exits 1 if there is any.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

MAX_POSITIONAL = 5
METHOD_END = "# ######## The method ends here."  # the one marked line between the method and what it runs on
# One limit per file: a reader meets the method's whole (its marked end) and the system's loop (train_async) within
# these lines. When a limit binds, the next extension leaves as its own file, as the W/T system left replay_grpo.py for
# async_pipeline.py: never as a shortened literal or a squeezed line.
POSITIONS = {"replay_grpo.py": (METHOD_END, 800), "async_pipeline.py": ("def train_async(", 250)}
# The GPU machines the project is checked on carry at most 64 MiB of working tree, the wheels built for them included:
# the tracked files may take half of it.
MAX_TREE_BYTES = 32 * 2**20


def violations(path: Path, text: str, tracked_names: set[str]) -> list[str]:
    """What `path` (its contents `text`) breaks of the rules above."""
    out = []
    if path.suffix == ".py" and not path.name.startswith("test_"):
        for node in ast.walk(ast.parse(text)):
            positional = [a for a in node.args if not isinstance(a, ast.Starred)] if isinstance(node, ast.Call) else []
            variadic = isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "save_for_backward"
            if len(positional) > MAX_POSITIONAL and not variadic:
                out.append(
                    f"{path}:{node.lineno}: a call with {len(positional)} positional arguments "
                    f"(at most {MAX_POSITIONAL}: pass the others by keyword)"
                )
    if path.suffix in (".py", ".md") and not str(path).startswith(".ci"):
        for m in re.finditer(r"\b([A-Z][A-Z_]+\.md)\b", text):
            if m[1] not in tracked_names:
                out.append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}: cites {m[1]}, not in the repository")
        for m in re.finditer(r"\b[Ii]ssue #?\d+", text):
            out.append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}: cites {m[0]!r}")
    if str(path) in POSITIONS:
        start, limit = POSITIONS[str(path)]
        at = next((i + 1 for i, line in enumerate(text.splitlines()) if line.startswith(start)), None)
        if at is None or at >= limit:
            out.append(f"{path}:{at or '-'}: {start!r} must start before line {limit} (the method or system first)")
    return out


def tree_violations(root: Path, tracked: list[str]) -> list[str]:
    """The tracked files' working-tree sizes over MAX_TREE_BYTES, with the largest named."""
    sizes = {name: (root / name).stat().st_size for name in tracked if (root / name).is_file()}
    total = sum(sizes.values())
    if total <= MAX_TREE_BYTES:
        return []
    largest = ", ".join(f"{n} ({sizes[n] / 2**20:.1f} MiB)" for n in sorted(sizes, key=sizes.get, reverse=True)[:3])
    return [
        f"-: the tracked files take {total / 2**20:.1f} MiB, more than {MAX_TREE_BYTES // 2**20} MiB (the GPU machines "
        f"carry 64 MiB of working tree); the largest: {largest}"
    ]


def main(root: Path | None = None) -> int:
    root = root or Path(__file__).resolve().parent.parent
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    tracked = [t for t in listed.split("\0") if t]
    names = {Path(t).name for t in tracked}
    found = tree_violations(root, tracked)
    for name in tracked:
        if name.endswith((".py", ".md")):
            found += violations(Path(name), (root / name).read_text(errors="replace"), names)
    print("\n".join(found) if found else f"source rules: {len(tracked)} tracked files checked, no violation")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
