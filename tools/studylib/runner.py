"""runner.py: the study tools' runner: each planned run trained once, under its claim (execute), and the finished
run folders read back (load_runs). A run folder is what replay_grpo.py writes: config.json, metrics.jsonl, a
checkpoint, resumes.jsonl after a resume, and sweep_run.json when a study planned it."""

import argparse
import bz2
import contextlib
import fcntl
import json
import lzma
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

from infra import run_folder

TRAINER = ROOT / "replay_grpo.py"
# The cpu preset as the first, Pareto and compute studies ran it (sums of 0..99, 2000 warm-start steps and no check
# at their end, RL at 3e-6 for 200 steps where a grid entry sets neither): their grids pin it, so that they rerun as
# they ran whatever the preset becomes.
CPU_AS_STUDIED = (
    "--preset cpu --arith-max-operand 99 --sft-warmup-steps 2000 --sft-imitation 0 --lr 3e-6 --total-steps 200"
).split()
EVAL_ROLLOUTS = 256  # the Pareto and compute grids evaluate every 256 generated rollouts
PLANNED = "sweep_run.json"  # in each run folder: its configuration, variant and seed, as the study planned them


def checkpoint_state(run_dir: Path) -> dict | None:
    """The run's trainer_state.pt (memory-mapped), or None if it has no readable checkpoint (one that cannot be
    read, or holds no integer "step", is said in one line)."""
    for ckpt in ("checkpoint", "checkpoint.old"):  # .old: killed between the two renames of a save
        path = run_dir / ckpt / "trainer_state.pt"
        if path.exists():
            try:
                state = run_folder.load_torch(path, mmap=True, map_location="cpu")  # plain data: runs no code
            except pickle.UnpicklingError as e:
                print(f"warning: cannot read {path}: it {run_folder.not_plain_data(e)}")
                continue
            except Exception as e:
                print(f"warning: cannot read {path}: {type(e).__name__}: {e}")
                continue
            if isinstance(state, dict) and isinstance(state.get("step"), int):
                return state
            print(f'warning: {path} holds no integer "step": not a trainer state')
    return None


def run_status(run_dir: Path, total_steps: int) -> str:
    """'new', 'done' (config.json and a checkpoint at total_steps), 'partial' (a checkpoint at an
    earlier step) or 'broken' (a folder without a checkpoint: died before its first one)."""
    if not run_dir.exists():
        return "new"
    state = checkpoint_state(run_dir)
    if state is None:
        return "broken"
    return "done" if state["step"] >= total_steps and (run_dir / "config.json").exists() else "partial"


CLAIMS = ".sweep_locks"  # beside run folders: a lock file per run that a runner process holds while it handles it


def claim(path: Path, wait: bool = False) -> int | None:
    """This process's claim on `path` (a run folder, or a file several runners rewrite): an flock on
    <parent>/.sweep_locks/<name>, a file that is never deleted, so that it outlives a run folder deleted and made
    again. Returns its descriptor (os.close releases it, as the process's end does), or None when another process
    holds it (wait: block until it is free)."""
    locks = path.parent / CLAIMS
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / path.name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


STATUS_LINES = {
    "new": "start",
    "done": "finished, skipped",
    "partial": "resume from its checkpoint",
    "broken": "no checkpoint: delete and restart",
    "restart": "delete and run again from nothing",
}


def execute(runs: list[dict], *, in_subprocess: bool, quiet: bool = False, on_trained=None) -> dict:
    """Each run not done trained, resumed from its checkpoint (partial), or deleted and trained from nothing (broken,
    restart), under its claim: one another process claims, or whose folder a trainer holds, is skipped. A run: name,
    run_dir, argv (replay_grpo.py's flags), total_steps for run_status or status(run); optionally planned (written to
    sweep_run.json) and clear (more paths deleted before training from nothing). A failed run does not stop the
    others; Ctrl-C does. in_subprocess: `python replay_grpo.py ...` (quiet: without stdout), else replay_grpo.main.
    on_trained(run, seconds): called under the claim after a run trained. Returns the failed and skipped names."""
    import replay_grpo

    failed, skipped = [], []
    for i, r in enumerate(runs, 1):
        run_dir, argv, head = Path(r["run_dir"]), r["argv"], f"[{i}/{len(runs)}] {r['name']}:"
        fd = claim(run_dir)
        if fd is None or run_dir.exists() and run_folder.in_use(run_dir):  # another process has it: leave it alone
            print(f"{head} in use by another process, skipped", flush=True)
            skipped.append(r["name"])
            if fd is not None:
                os.close(fd)
            continue
        try:
            status = r["status"](r) if "status" in r else run_status(run_dir, r["total_steps"])
            print(f"{head} {STATUS_LINES[status]}", flush=True)
            if status == "done":
                continue
            if status == "partial":
                argv = argv + ["--resume"]
            else:  # trained from nothing: nothing of an earlier attempt is kept
                for path in [run_dir, *r.get("clear", [])]:
                    shutil.rmtree(path, ignore_errors=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            if "planned" in r:  # what the report groups it by, written when it is planned
                (run_dir / PLANNED).write_text(json.dumps(r["planned"]))
            start = time.perf_counter()
            # a vLLM engine with sleep mode is one per process and never freed (CUDA): such runs get a process each
            if in_subprocess or r.get("generator", "auto") != "hf":
                out = subprocess.DEVNULL if quiet else None
                code = subprocess.run([sys.executable, str(TRAINER), *argv], stdout=out).returncode
            else:
                try:
                    replay_grpo.main(argv)
                    code = 0
                except SystemExit as e:
                    code = e.code
                except Exception:  # a crash fails this run only; the traceback is printed
                    traceback.print_exc()
                    code = 1
            if code == 130:  # Ctrl-C: stop the runner (the run keeps its last checkpoint)
                raise SystemExit(130)
            if code:
                failed.append(r["name"])
            elif on_trained is not None:
                on_trained(r, time.perf_counter() - start)
        finally:
            os.close(fd)
    return {"failed": failed, "skipped": skipped}


VARIANT = r"(?P<variant>(?:-lr[\d.]+(?:e-?\d+)?)?(?:-dv-?[\d.]+(?:e-?\d+)?)?)"  # -lr0.0001, -dv-0.1, both or none
RUN_NAME = re.compile(r"(?P<config>.+?)" + VARIANT + r"-s(?P<seed>\d+)")


class Damaged(Exception):
    """A run folder's file that cannot be read: its message names the file (and line)."""


def read_json(path: Path) -> dict:
    """A JSON object file (config.json, sweep_run.json, sweep.json, summary.json), read by the trainer's bounded
    reader (run_folder.read_json: its depth and length bounded); Damaged names the file."""
    try:
        value = run_folder.read_json(path.read_bytes().decode("utf-8"), str(path))
    except run_folder.JSONBoundError as e:
        raise Damaged(str(e)) from None
    except (OSError, ValueError) as e:  # missing, unreadable, not UTF-8, not JSON
        raise Damaged(f"{path}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}") from None
    if not isinstance(value, dict):
        raise Damaged(f"{path}: a JSON object was expected, not {type(value).__name__}")
    return value


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, each line read by run_folder.read_json (its depth and length bounded); Damaged
    names the first line that is not a record with an integer step."""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise Damaged(f"{path}: {type(e).__name__}: {str(e).splitlines()[0][:100]}") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = run_folder.read_json(line, f"{path}:{lineno}")
        except run_folder.JSONBoundError as e:
            raise Damaged(str(e)) from None
        except ValueError:
            raise Damaged(f"{path}:{lineno}: not JSON (a cut or garbage line)") from None
        if problem := record_problem(record):
            raise Damaged(f"{path}:{lineno}: {problem}")
        records.append(record)
    return records


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_table(x, depth: int = 1) -> bool:
    """{label: number} (depth 1), or {label: {key: number}} (depth 2): a histogram or a per-bucket table."""
    if not isinstance(x, dict) or not all(isinstance(k, str) for k in x):
        return False
    return all(is_number(v) if depth == 1 else is_table(v, depth - 1) for v in x.values())


# What the reports read of a step's record, and what each must be where a record holds it
RECORD_TYPES = {
    "eval/greedy_acc": (is_number, "a number"),
    "generated_rollouts": (is_number, "a number"),
    "trained_rollouts": (is_number, "a number"),
    "total_generated_tokens": (is_number, "a number"),
    "entropy": (is_number, "a number"),
    "mu": (is_number, "a number"),
    "replay_ratio": (is_number, "a number"),
    "warmstart_pass@k": (lambda x: x is None or is_number(x), "a number or null"),  # null: no check ran
    "warmstart_reached": (lambda x: isinstance(x, bool), "true or false"),
    "staleness_hist": (is_table, "a table of numbers"),
    "replay_hist": (is_table, "a table of numbers"),
    "by_staleness": (lambda x: is_table(x, 2), "a table of tables of numbers"),
    "offpolicy_by_staleness": (lambda x: x is None or is_table(x, 2), "a table of tables of numbers"),
}


def record_problem(record) -> str | None:
    """What is wrong with a step's record (not an object with an integer "step", or a key of RECORD_TYPES or an
    eval/pass@k of another type), None when nothing is."""
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return 'not a record with an integer "step"'
    for key, value in record.items():
        ok, what = RECORD_TYPES.get(key) or ((is_number, "a number") if key.startswith("eval/pass@") else (None, ""))
        if ok is not None and not ok(value):
            return f'step {record["step"]}: "{key}" is not {what}'
    return None


def non_finite(x, where: str = "") -> tuple[str, float] | None:
    """The first NaN or infinite number in x (nested lists and dicts) and where it is, None when there is none."""
    if isinstance(x, float) and not math.isfinite(x):
        return where, x
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for key, value in items:
        if isinstance(x, list) and isinstance(value, dict) and type(value.get("step")) is int:
            key = f"step {value['step']}"  # a record: named by its step
        if found := non_finite(value, f"{where}, {key}" if where else str(key)):
            return found
    return None


# config.json's settings that the reports read, and their JSON types (a config without one is damaged or foreign)
CONFIG_KEYS = {
    "seed": int,
    "lr": (int, float),
    "total_steps": int,
    "eval_every": int,
    "buffer_size": int,
    "batch_size": int,
    "prompts_per_step": int,
    "group_size": int,
    "pass_k": int,
    "loss": str,
    "positive_bias": (int, float),
}
KINDS = {int: "an integer", str: "text", dict: "an object", list: "a list"}  # JSON types as a line names them


def read_run(run_dir: Path, state: dict | None) -> dict | None:
    """A finished run (its checkpoint at total_steps) as load_runs returns it, None for one that is not. Damaged
    names the file that is missing, unreadable, or lacks what the report reads."""
    path = run_dir / "config.json"
    cfg = read_json(path)
    for key, kind in CONFIG_KEYS.items():
        if type(cfg.get(key)) is bool or not isinstance(cfg.get(key), kind):
            raise Damaged(f'{path}: "{key}" is missing or not {KINDS.get(kind, "a number")}')
    try:
        cfg = run_folder.current_config(run_dir, cfg)
    except ValueError as e:
        raise Damaged(str(e)) from None
    if state is None or state["step"] != cfg["total_steps"]:
        return None
    records, path = read_metrics(run_dir / "metrics.jsonl"), run_dir / "metrics.jsonl"
    if not records or records[-1]["step"] < state["step"]:
        raise Damaged(f"{path}: its records do not reach the checkpoint's step {state['step']} (cut)")
    if not any("eval/greedy_acc" in r for r in records):
        raise Damaged(f"{path}: it holds no evaluation")
    if (run_dir / PLANNED).exists():
        planned = read_json(run_dir / PLANNED)
        if not all(isinstance(planned.get(k), str) for k in ("config", "variant")):
            raise Damaged(f'{run_dir / PLANNED}: "config" and "variant" are not both text')
    else:  # a folder from before sweep_run.json: its name says it
        m = RUN_NAME.fullmatch(run_dir.name)
        planned = {"config": m["config"] if m else run_dir.name, "variant": m["variant"] if m else ""}
    return {
        "name": run_dir.name,
        "config": planned["config"],
        "variant": planned["variant"],
        "seed": cfg["seed"],
        "cfg": cfg,
        "records": records,
    }


def load_runs(out_dir: Path, quiet: bool = False) -> list[dict]:
    """Every finished run: name, config (name without variant and seed), variant (e.g. -lr0.0001), seed, cfg and
    metric records. A run folder with a damaged file is left out, named in one line, and counted."""
    runs, damaged = [], 0
    for run_dir in sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / "config.json").exists()):
        try:
            run = read_run(run_dir, checkpoint_state(run_dir))
        except Damaged as e:
            print(f"report: {run_dir.name} left out, a file is damaged: {e}")
            damaged += 1
            continue
        if run is not None:
            runs.append(run)
        elif not quiet:
            print(f"report: {run_dir.name} is not finished, left out")
    if damaged:
        print(f"report: {damaged} run folder(s) with a damaged file left out")
    return runs


# What the compute and Pareto reports read of a run's records: records.json.xz keeps these and the settings of
# CONFIG_KEYS
RECORD_KEYS = (
    "step",
    "eval/greedy_acc",
    "generated_rollouts",
    "trained_rollouts",
    "total_generated_tokens",
    "entropy",
    "mu",
)
RUN_KEYS = ("name", "config", "variant", "seed", "cfg", "records")  # what a run of compact_runs holds


def compact_run(run: dict, keys=RECORD_KEYS, settings=tuple(CONFIG_KEYS)) -> dict:
    """A finished run (load_runs's) as records.json.xz keeps it: its names, seed, settings and records cut to keys."""
    return {k: run[k] for k in RUN_KEYS[:4]} | {
        "cfg": {k: run["cfg"][k] for k in settings if k in run["cfg"]},
        "records": [{k: r[k] for k in keys if k in r} for r in run["records"]],
    }


def compact_runs(runs: list[dict]) -> dict:
    return {"runs": [compact_run(r) for r in runs]}


# A study's records file, as its report writes it beside the report: compact JSON, xz-compressed (a sixth of the JSON's
# size; the committed studies' records are 73.6 MB as JSON, 9.6 MB as xz). The readers also take gzip, bzip2 and
# plain JSON.
RECORDS = "records.json.xz"
RECORDS_BYTES = 2**30  # a records file's JSON beyond this once decompressed is refused (a study's largest: 46 MB)
XZ_MAGIC, GZIP_MAGIC, BZIP2_MAGIC = b"\xfd7zXZ\x00", b"\x1f\x8b", b"BZh"
RECORDS_SUFFIXES = (".json", ".json.xz", ".json.gz", ".json.bz2")  # the records files written: JSON, compressed so


def records_bytes(data: dict, path: Path) -> bytes:
    """data as a records file at `path` holds it: compact JSON, xz-, gzip- or bzip2-compressed where its name ends
    so (check_records_path: one of RECORDS_SUFFIXES)."""
    text = (json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n").encode()
    if path.name.endswith(".xz"):
        return lzma.compress(text, preset=9)
    if path.name.endswith(".gz"):  # gzip's header holds no time or name: the same records give the same bytes
        co = zlib.compressobj(9, zlib.DEFLATED, 31)
        return co.compress(text) + co.flush()
    if path.name.endswith(".bz2"):
        return bz2.compress(text, 9)
    return text


def check_records_path(path: Path, flag: str) -> None:
    """Refuse, before any work, a records file to write that is a folder or whose name ends in none of
    RECORDS_SUFFIXES (its content would not be what its name says): one line naming the flag."""
    if path.is_dir():
        raise SystemExit(f"error: {flag} {path} is a folder: give the records file to write, e.g. {path / RECORDS}")
    if not path.name.endswith(RECORDS_SUFFIXES):
        raise SystemExit(
            f"error: {flag} {path}: a records file's name ends in {', '.join(RECORDS_SUFFIXES)} (plain JSON, or "
            "compressed so), and the file is written as its name says"
        )


def write_records(path: Path, data: dict, flag: str) -> None:
    """data as a records file at `path` (records_bytes), written whole or not at all; a folder, a name of no records
    format (check_records_path) or an unwritable place stops with one line naming the flag that gave it."""
    check_records_path(path, flag)
    blob, tmp = records_bytes(data, path), path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise SystemExit(f"error: {flag} {path}: cannot write the records ({e.strerror or e})") from None


def decompress(path: Path, blob: bytes) -> bytes:
    """A records file's JSON bytes: blob as it is, or decompressed (xz, gzip or bzip2, told by its first bytes), at
    most RECORDS_BYTES; Damaged names a cut, damaged or too large file."""
    if blob.startswith(XZ_MAGIC):
        d, errors = lzma.LZMADecompressor(), lzma.LZMAError
    elif blob.startswith(GZIP_MAGIC):
        d, errors = zlib.decompressobj(31), zlib.error
    elif blob.startswith(BZIP2_MAGIC):
        d, errors = bz2.BZ2Decompressor(), OSError  # bz2 raises OSError for damaged data
    else:
        d, errors = None, ()
    try:
        text = d.decompress(blob, RECORDS_BYTES + 1) if d else blob
    except errors as e:
        raise Damaged(f"{path}: a damaged compressed file ({e})") from None
    if len(text) > RECORDS_BYTES:
        raise Damaged(f"{path}: more than {RECORDS_BYTES} bytes of JSON, beyond what a records file may hold")
    if d and not d.eof:
        raise Damaged(f"{path}: the compressed file is cut (it ends before its data)")
    return text


def run_problem(run: dict) -> str | None:
    """What is wrong with a run of compact_runs (records.json.xz): its names, seed, settings or records of another
    type, or no evaluation; None when nothing is."""
    for key, kind in (("name", str), ("config", str), ("variant", str), ("seed", int), ("cfg", dict)):
        if type(run.get(key)) is not kind:
            return f'"{key}" is not {KINDS[kind]}'
    if not is_number(run["cfg"].get("lr")):  # every report reads it; the others, a report of their study
        return '"cfg": "lr" is missing or not a number'
    for key, kind in CONFIG_KEYS.items():
        if key in run["cfg"] and (type(run["cfg"][key]) is bool or not isinstance(run["cfg"][key], kind)):
            return f'"cfg": "{key}" is not {KINDS.get(kind, "a number")}'
    if not all(is_number(v) for k, v in run["cfg"].items() if k not in CONFIG_KEYS):  # publish_every, asymre_delta_v
        return '"cfg" holds a setting that is not a number'
    if not isinstance(run.get("records"), list) or not run["records"]:
        return '"records" is not a list of records'
    for record in run["records"]:
        if problem := record_problem(record):
            return f'"records": {problem}'
    if not any("eval/greedy_acc" in r for r in run["records"]):
        return '"records" hold no evaluation'
    return None


def run_label(run, i: int) -> str:
    """A run of a records file as a line names it: its name, else its configuration and seed, else its position."""
    if isinstance(run, dict) and isinstance(run.get("name"), str):
        return run["name"]
    if isinstance(run, dict) and isinstance(run.get("config"), str) and type(run.get("seed")) is int:
        return f"{run['config']} seed {run['seed']}" + (f" lr {run['lr']:g}" if is_number(run.get("lr")) else "")
    return f"number {i + 1}"


def refuse_non_finite(runs: list[dict], where) -> None:
    """Stop with one line at the first run holding a NaN or infinite number: every number a records file keeps is one
    a statistic reads, and leaving the run out would compute it on other runs than asked. where(run, i): the run as
    the line names it."""
    for i, run in enumerate(runs):
        if found := non_finite(run):
            raise SystemExit(
                f"error: {where(run, i)}: {found[0]} is {found[1]}, not a finite number: the report's statistics read "
                "it; correct the run's records, or remove the run to report without it"
            )


def seed_study_parser(doc: str, layout: str) -> argparse.ArgumentParser:
    """The arguments of a per-seed study's report: --runs (the folder of LAYOUT/SEED/run folders, seed_table.py's) or
    --records (the records file it wrote), and --report-dir; a tool adds its own after."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--runs", type=Path, help=f"the folder of {layout}/SEED/run folders (seed_table.py's)")
    source.add_argument("--records", type=Path, help="a records.json.xz this tool wrote")
    ap.add_argument("--report-dir", type=Path, required=True, help="where the report's files go")
    return ap


def finished_seeds(runs: Path, arms: tuple, kind: str = "arm"):
    """(arm, seed, run folder, wall seconds) of every finished seed (its wall time in ARM/seed_table.json) of each of
    `arms`' folders under `runs`, arm by arm, seed by seed; an arm without a folder or a seed unfinished is named (as
    a `kind`) and left out."""
    for arm in arms:
        folder = runs / arm
        if not folder.is_dir():
            print(f"report: {folder}: no such folder, the {kind} has no runs")
            continue
        table = folder / "seed_table.json"  # written when the arm's first seed finishes
        times = read_json(table) if table.exists() else {}
        for seed in sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()):
            if str(seed) not in times:
                print(f"report: {arm} seed {seed} left out: unfinished (no wall time in {table})")
                continue
            yield arm, seed, folder / str(seed) / "run", times[str(seed)]


def runs_or_records(runs: Path | None, records: Path | None, *, collect, check) -> dict:
    """A per-seed study's records (arm, seed, evals per run): collect(runs) from its run folders (a file cut or
    damaged stops it, one line naming it), or read from the records file it wrote."""
    if runs:
        try:
            return collect(runs)
        except Damaged as e:
            raise SystemExit(f"error: --runs {e}") from None
    return read_records(records, keys=("arm", "seed", "evals"), check=check)


def read_records(path: Path, keys=RUN_KEYS, flag: str = "--records", check=run_problem) -> dict:
    """A study's records file ({"runs": [...]}, each run holding keys; xz, gzip or plain JSON), read by the trainer's
    bounded reader; a damaged file stops with one line naming it and the flag that gave it. A run that is not as
    check(run) expects is named in one line and left out, and counted; a NaN or infinite number stops it (one line
    naming the run: refuse_non_finite)."""
    try:
        try:
            text = decompress(path, path.read_bytes()).decode("utf-8")
            data = run_folder.read_json(text, str(path), max_chars=RECORDS_BYTES)
        except run_folder.JSONBoundError as e:
            raise Damaged(str(e)) from None
        except (OSError, ValueError) as e:  # missing, unreadable, not UTF-8, not JSON
            raise Damaged(f"{path}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}") from None
    except Damaged as e:
        raise SystemExit(f"error: {flag} {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise SystemExit(f"error: {flag} {path}: not a study's records file (no list of runs)")
    if data["runs"] and not any(isinstance(r, dict) and set(keys) <= set(r) for r in data["runs"]):
        raise SystemExit(f"error: {flag} {path}: not a study's records file (every run lacks one of {sorted(keys)})")
    tune = data.get("tune_seeds", [])
    if not isinstance(tune, list) or not all(type(s) is int for s in tune):
        raise SystemExit(f'error: {flag} {path}: "tune_seeds" is not a list of integers')
    kept = []
    for i, run in enumerate(data["runs"]):
        problem = check(run) if isinstance(run, dict) else "not an object"
        if problem:
            print(f"report: {flag} {path}: run {run_label(run, i)} left out, damaged: {problem}")
        else:
            kept.append(run)
    if len(kept) < len(data["runs"]):
        print(f"report: {len(data['runs']) - len(kept)} damaged run(s) of {path} left out")
    refuse_non_finite(kept, lambda run, i: f"{flag} {path}: run {run_label(run, i)}")
    return {**data, "runs": kept}


def load_records(path: Path, flag: str = "--records") -> list[dict]:
    """The runs of a records file of compact_runs, as load_runs returns runs."""
    return read_records(path, flag=flag)["runs"]


def pool(kept: list[dict], runs: list[dict], path, out_dir) -> list[dict]:
    """The runs of a records.json.xz (kept) with finished run folders (runs), in load_runs's order (by name). A run in
    both, or a configuration whose settings (CONFIG_KEYS but the seed) differ between the two, stops with one line."""
    settings = {}
    for source, rs in ((path, kept), (out_dir, runs)):
        for r in rs:
            cfg = {k: v for k, v in r["cfg"].items() if k in CONFIG_KEYS and k != "seed"}
            first = settings.setdefault((r["config"], r["variant"]), (source, r["name"], cfg))
            if first[2] != cfg:
                differ = sorted(k for k in first[2].keys() | cfg.keys() if first[2].get(k) != cfg.get(k))
                raise SystemExit(
                    f"error: --pool-records {path}: {r['name']} in {source} and {first[1]} in {first[0]} differ in "
                    f"{', '.join(differ)}: one configuration, two settings"
                )
    both = sorted({r["name"] for r in kept} & {r["name"] for r in runs})
    if both:
        raise SystemExit(f"error: --pool-records {path}: {', '.join(both)} also finished in {out_dir}: keep one")
    return sorted(kept + runs, key=lambda r: r["name"])


def read_sweep_json(path: Path) -> dict:
    """sweep.json's record, its seeds and tune_seeds lists of integers; a damaged one stops with one line."""
    keep = "it records which seeds only chose a learning rate: restore it, or delete it (report: give --tune-seeds)"
    try:
        recorded = read_json(path)
    except Damaged as e:
        raise SystemExit(f"error: {e}; {keep}") from None
    seeds, tune_seeds = recorded.get("seeds", []), recorded.get("tune_seeds", [])
    if not all(isinstance(x, list) and all(type(s) is int for s in x) for x in (seeds, tune_seeds)):
        raise SystemExit(f"error: {path}: seeds and tune_seeds are not lists of integers; {keep}")
    return {**recorded, "seeds": seeds, "tune_seeds": tune_seeds}


def tune_seeds(out_dir: Path, required: bool = False) -> list[int]:
    """The tune seeds out_dir/sweep.json records ([] without one, unless required)."""
    path = out_dir / "sweep.json"
    if path.exists():
        return read_sweep_json(path)["tune_seeds"]
    if required:
        raise SystemExit(f"error: {path} is missing: it records the tune seeds, which the report leaves out")
    return []


def cli(main) -> None:
    """A tool's entry point: main's one-line error (a SystemExit with a message) goes to stderr with exit status 2,
    as replay_grpo.py's errors do; any other exit keeps its status."""
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            raise SystemExit(2) from None
        raise
