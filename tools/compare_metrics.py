"""compare_metrics.py: check that a change leaves training unchanged.

Runs the same training commands with the code of a git revision and with the working tree, then
compares every metrics.jsonl record field by field, except wall-clock seconds and the mu computed
from them. Exit code 0 when every record matches.

    python tools/compare_metrics.py REV                 # the two default commands below
    python tools/compare_metrics.py REV --keep /tmp/cmp # keep both run folders
    python tools/compare_metrics.py REV --added KEY     # KEY is new in the working tree's records
    python tools/compare_metrics.py REV --flags=--no-share-prompts  # the working tree's runs with a new flag off
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

from infra import reporting

# seeded CPU runs of the cpu preset: warm start, replay (N > B > R), both losses; each in its own --out-dir, so each
# trains its warm start (a run's records depend on its flags and seed only, cached warm start or not). The task,
# the warm start's length and the lr are pinned: two revisions on either side of a change to the preset run the
# same flags.
REPLAY = (
    "--preset cpu --arith-max-operand 49 --sft-warmup-steps 650 --lr 3e-6 --total-steps 60 --buffer-size 512 "
    "--prompts-per-step 2 --seed 3"
)
COMMANDS = [REPLAY.split(), (REPLAY + " --loss asymre --positive-bias 0.25").split()]


def timing(key: str) -> bool:
    return reporting.measured_on_this_machine(key)


def fail(line: str):
    """Stop with one line (exit 2): a revision, a folder or a run that cannot be used."""
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(2)


def check_revision(rev: str) -> str:
    """The commit `rev` names in this repository; one line when it names none."""
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if found.returncode:
        fail(f"{rev}: not a revision of the repository at {ROOT} (a commit, branch or tag: git log --oneline)")
    return found.stdout.strip()


def check_keep(keep: str) -> Path:
    """--keep as a folder this tool may fill: new or empty (the runs of an earlier comparison would be refused)."""
    path = Path(keep)
    if path.exists() and not path.is_dir():
        fail(f"--keep {keep}: a file, not a folder: give a new or empty folder for both versions' run folders")
    if path.is_dir() and any(path.iterdir()):
        fail(f"--keep {keep}: the folder is not empty (an earlier comparison's?): give a new or empty one")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--keep {keep}: cannot create the folder ({e.strerror or e})")
    return path


def run_all(code_dir: Path, out_dir: Path, flags: list[str] = ()) -> list[list[dict]]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    records = []
    for i, args in enumerate(COMMANDS):
        trainer = str(code_dir / "replay_grpo.py")
        cmd = [sys.executable, trainer, *args, *flags, "--out-dir", str(out_dir / f"c{i}"), "--run-name", "run"]
        print("$", " ".join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, cwd=code_dir, env=env, stdout=subprocess.DEVNULL)
        if done.returncode:  # its own error line is above, on stderr
            fail(f"the run of {code_dir} ended with exit code {done.returncode}: {' '.join(cmd[1:])}")
        lines = (out_dir / f"c{i}" / "run" / "metrics.jsonl").read_text().splitlines()
        records.append([json.loads(line) for line in lines])
    return records


def compare(before: list[list[dict]], after: list[list[dict]], added: set[str]) -> int:
    """Print every value that differs between the two versions' records (skipping the clock's keys, and the keys
    in `added` where only the new records have them); return how many differ."""
    differences = 0
    for command, old, new in zip(COMMANDS, before, after):
        compared = 0
        if len(old) != len(new):
            print(f"{' '.join(command)}: {len(old)} records before, {len(new)} after")
            differences += 1
        for a, b in zip(old, new):
            for key in sorted(set(a) | set(b)):
                if timing(key) or (key in added and key not in a):
                    continue
                compared += 1
                if a.get(key, "<missing>") != b.get(key, "<missing>"):
                    differences += 1
                    print(f"step {a.get('step')}: {key}: {a.get(key, '<missing>')!r} -> {b.get(key, '<missing>')!r}")
        print(f"{' '.join(command)}: {len(new)} records, {compared} values compared")
    return differences


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="git revision to compare the working tree with")
    ap.add_argument("--keep", help="folder for both versions' run folders (default: a temporary one)")
    ap.add_argument(
        "--added",
        nargs="*",
        default=[],
        help="record keys that only the working tree logs (new on "
        "purpose): their values are not compared, every other key must match",
    )
    ap.add_argument(
        "--flags",
        default="",
        help="flags added to the working tree's commands only (e.g. a new flag set so that it changes nothing)",
    )
    args = ap.parse_args()
    commit = check_revision(args.rev)
    work = check_keep(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compare_metrics_"))
    before_code = work / "code"
    added = subprocess.run(
        ["git", "worktree", "add", "--detach", str(before_code), commit], cwd=ROOT, capture_output=True, text=True
    )
    if added.returncode:
        fail(f"{args.rev}: git could not check it out in {before_code}: {' '.join(added.stderr.split())[:300]}")
    try:
        before, after = run_all(before_code, work / "before"), run_all(ROOT, work / "after", args.flags.split())
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before_code)], cwd=ROOT, capture_output=True)
    differences = compare(before, after, added=set(args.added))
    print("identical" if differences == 0 else f"{differences} differences")
    return 0 if differences == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
