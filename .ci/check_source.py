"""The source rules CI checks before the tests (python .ci/check_source.py), on every tracked file, beside ruff
(format, pyflakes, import order, pycodestyle: pyproject.toml), which checks none of these:

- the source files (not the tests): no call with six or more positional arguments (keywords say what each is;
  ctx.save_for_backward takes its tensors as positional arguments only);
- code and docs cite no file outside the repository and no issue number (the project speaks for itself);
- what the entries run on lies beneath them: no file of infra/ and not kernels.py imports an entry (replay_grpo,
  async_pipeline), at its top or inside a function, and the source files' imports form no circle;
- the tracked files' working-tree sizes sum to at most MAX_TREE_BYTES.

Prints one line per violation (file:line: what) and exits 1 if there is any; else one line with the method file's
size, which is reported, not ruled.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

MAX_POSITIONAL = 5
ENTRIES = ("replay_grpo", "async_pipeline")  # the two scripts a user runs: the method, and its W/T system
# What both entries run on: the entries import it, never the reverse.
BENEATH = ("infra/", "kernels.py")
METHOD = "replay_grpo.py"
# The GPU machines the project is checked on carry at most 64 MiB of working tree, the wheels built for them included:
# the tracked files may take half of it.
MAX_TREE_BYTES = 32 * 2**20


def imported(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """Every import in a module, at its top or inside a function: (line, module, the names it takes from it)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return out


def violations(path: Path, text: str, tracked_names: set[str]) -> list[str]:
    """What `path` (its contents `text`) breaks of the rules above, but the circles (import_circles)."""
    out = []
    tree = ast.parse(text) if path.suffix == ".py" else None
    if tree is not None and not path.name.startswith("test_"):
        for node in ast.walk(tree):
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
    if tree is not None and path.as_posix().startswith(BENEATH):
        for line, module, _ in imported(tree):
            if module.split(".")[0] in ENTRIES:
                out.append(
                    f"{path}:{line}: imports {module.split('.')[0]}, an entry: infra/ and kernels.py lie beneath both "
                    "entries and import neither (pass what they need of the method in)"
                )
    return out


def module_name(path: Path) -> str | None:
    """The name a source file is imported by: the root's and tools/' files by their stem (tools/ is on sys.path),
    a package's files under the package (infra.tasks, studylib.report); None for tests and CI."""
    parts = path.with_suffix("").parts
    if path.suffix != ".py" or parts[0] in ("tests", ".ci") or path.name.startswith("test_"):
        return None
    parts = parts[1:] if parts[0] == "tools" else parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts)


def import_circles(sources: dict[str, str]) -> list[list[str]]:
    """The import circles among `sources` (module name -> text): for each set of modules that import one another, one
    circle through it, its first module (the least name) again at its end. An import counts wherever it stands (a
    function's import is a dependency too); `from P import m` of a module m of package P is an import of P.m."""
    graph = {}
    for name, text in sources.items():
        edges = set()
        for _, module, names in imported(ast.parse(text)):
            found = {f"{module}.{n}" for n in names if f"{module}.{n}" in sources}
            edges |= found or ({module} if module in sources else set())
        graph[name] = sorted(edges - {name})

    def reach(start: str) -> dict[str, str]:  # every module `start` leads to, with the one it is first reached from
        seen, queue = {start: ""}, [start]
        for node in queue:
            for nxt in graph[node]:
                if nxt not in seen:
                    seen[nxt] = node
                    queue.append(nxt)
        return seen

    circles, placed = [], set()
    for start in sorted(graph):
        if start in placed:
            continue
        ahead = reach(start)
        back = [n for n in sorted(ahead) if n != start and start in reach(n)]  # start's circle: both ways
        placed |= set(back)
        last = next((n for n in sorted(ahead) if start in graph[n] and (n == start or n in back)), None)
        if back and last:
            path = [last]
            while path[-1] != start:  # back along the shortest way from start
                path.append(ahead[path[-1]])
            circles.append(path[::-1] + [start])
    return circles


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
    sources = {}
    for name in tracked:
        if name.endswith((".py", ".md")) and (root / name).is_file():
            text = (root / name).read_text(errors="replace")
            found += violations(Path(name), text, names)
            if module_name(Path(name)):
                sources[module_name(Path(name))] = text
    found += [f"-: an import circle: {' -> '.join(circle)}" for circle in import_circles(sources)]
    if found:
        print("\n".join(found))
        return 1
    method = root / METHOD
    size = f"; {METHOD}: {len(method.read_text().splitlines())} lines (reported, not ruled)" if method.is_file() else ""
    print(f"source rules: {len(tracked)} tracked files checked, no violation{size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
