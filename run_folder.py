"""run_folder.py: a run folder's safety, for replay_grpo.py: one process at a time, the saved configuration as the
truth on resume, whole-or-nothing writes, and damaged files or a full disk said in one line (UserError)."""

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import time
from pathlib import Path


class UserError(Exception):
    """A mistake in flags, input files or the run folder: printed as one clear line, never as a traceback."""


# Flags a resume may change: how long to run, how often to evaluate and log, where the folder is, and the
# infrastructure that sets how fast, not what, the run computes. Any other difference from config.json is refused.
RESUMABLE = ("total_steps", "eval_every", "sample_every", "wandb", "verbose", "out_dir", "run_name", "resume",
             "dist_timeout", "num_generators", "micro_batch_size", "vllm_gpu_memory_utilization")
RUN_LOCKS: dict[str, int] = {}  # run folder -> open file descriptor of its lock (flock), held until release_runs


def lock_run(run_dir: Path) -> None:
    """Hold <run>/lock (fcntl.flock) for this process's run: a second process in the folder is refused. The OS
    releases it when the process dies."""
    fd = os.open(run_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"{run_dir} is in use by process {holder} (a run holds its folder while it runs): wait for "
                        "it to end, or choose another --run-name") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    RUN_LOCKS[str(run_dir)] = fd


def release_runs() -> None:
    for fd in RUN_LOCKS.values():
        os.close(fd)  # closing the descriptor releases its flock
    RUN_LOCKS.clear()


def write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all: a kill or a full disk leaves the old content (a temporary is renamed in)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_resume_config(cfg, run_dir: Path) -> None:
    """The saved configuration is the truth: refuse a resume whose flags differ outside RESUMABLE (one line naming
    each, with its saved and given values); append the RESUMABLE ones that changed to <run>/resumes.jsonl."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--resume: {run_dir / 'config.json'} is missing or damaged ({type(e).__name__}): the run's "
                        "settings are unknown, so it cannot be continued") from None
    given = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as saved: JSON types

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")
    differ = [k for k in given if k in saved and saved[k] != given[k] and k not in RESUMABLE]
    if differ:
        listed = "; ".join(f"{flag(k)} {given[k]} (saved: {saved[k]})" for k in differ)
        raise UserError(f"--resume: {run_dir} was started with other settings, and a run never mixes two: {listed}. "
                        "Resume with the saved values, or start a new --run-name")
    changed = {flag(k): [saved[k], given[k]] for k in RESUMABLE if k in saved and saved[k] != given[k]}
    changed.pop("--resume", None)
    with (run_dir / "resumes.jsonl").open("a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changed": changed}) + "\n")


def read_checkpoint_file(ckpt: Path, name: str, read):
    """read(ckpt / name), or one line naming the damaged (cut, empty, missing) file and what can be done."""
    try:
        return read(ckpt / name)
    except Exception as e:  # torch's, safetensors' and pickle's errors for a damaged file share no base class
        reason = str(e).splitlines()[0][:120] if str(e) else ""
        raise UserError(f"--resume: {ckpt / name} is damaged or missing ({type(e).__name__}: {reason}), so the run "
                        f"cannot continue from it: restore the file, or start the run again (rm -r {ckpt.parent}, "
                        "or another --run-name)") from None


def cut_records(path: Path, last_step: int) -> tuple[list[str], int]:
    """The lines of a records file up to `last_step`, and how many lines were unreadable (cut, garbage, no step)."""
    kept, unreadable = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, TypeError, KeyError):
            step = None
        if not isinstance(step, int):
            unreadable += 1
        elif step <= last_step:
            kept.append(line)
    return kept, unreadable


def disk_full(e: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of space (torch and safetensors do not always say ENOSPC): the error says
    so, or under 1 MiB is left where it wrote."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in str(e):
        return True
    try:
        return shutil.disk_usage(where).free < 2**20
    except OSError:
        return False
