"""run_folder.py: a run folder for both entries (replay_grpo.py, async_pipeline.py): creating it, its checkpoints
and its records (metrics.jsonl, samples.jsonl, wandb), and its safety: one process at a time, the saved configuration
as the truth on resume, whole-or-nothing writes, and damaged files or a full disk said in one line (UserError)."""

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path


class UserError(Exception):
    """A mistake in flags, input files or the run folder: printed as one clear line, never as a traceback."""


ENTRIES = {"sync": "replay_grpo.py", "async": "async_pipeline.py"}  # the script that runs each loop

# Flags a resume may change: how long to run, how often to evaluate and log, where the folder is, and the
# infrastructure that sets how fast, not what, the run computes. Any other difference from config.json is refused.
RESUMABLE = (
    "total_steps",
    "eval_every",
    "sample_every",
    "wandb",
    "verbose",
    "out_dir",
    "run_name",
    "resume",
    "dist_timeout",
    "num_generators",
    "generator_urls",
    "generator_host",
    "weight_transfer",
    "publish_check",
    "micro_batch_size",
    "vllm_gpu_memory_utilization",
    "activation_checkpointing",
)
RUN_LOCKS: dict[str, int] = {}  # run folder -> open file descriptor of its lock (flock), held until release_runs
WARM_START_FOLDER = ".warmstart"  # the warm-start caches' folder under --out-dir (warm_start.py)

# A JSON text nesting deeper than this is refused before it is parsed: json's parser recurses once per level and would
# end in a RecursionError near Python's limit of 1000; records, data rows and server answers nest a few levels.
JSON_DEPTH = 64
# A JSONL line longer than this is refused before it is parsed: a data row is a prompt and its answer, and a whole
# 1M-token context is about 4 MB of text; a longer line is a file that is not one row per line.
JSON_LINE_CHARS = 16 * 2**20
JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
JSON_BRACKET = re.compile(r"[\[\]{}]")


class JSONBoundError(UserError):
    """A JSON text beyond JSON_DEPTH or a size bound: one line naming where it is."""


def read_json(text: str, where: str, max_chars: int | None = JSON_LINE_CHARS, what: str = "a line", **kwargs):
    """json.loads(text, **kwargs) within bounds: a text longer than `max_chars` (None: no bound) or nesting deeper than
    JSON_DEPTH is a JSONBoundError naming `where` (a file:line, or a flag) and the bound, the text called `what`;
    invalid JSON raises json's ValueError. Every JSON a user types, a file gives or a server answers is read here."""
    if max_chars is not None and len(text) > max_chars:
        raise JSONBoundError(f"{where}: {what} of {len(text)} characters, beyond the {max_chars} one may hold")
    if text.count("[") + text.count("{") > JSON_DEPTH:  # else it cannot nest deeper: no need to look
        depth = 0
        for m in JSON_BRACKET.finditer(JSON_STRING.sub("", text)):  # brackets outside strings
            depth += 1 if m[0] in "[{" else -1
            if depth > JSON_DEPTH:
                raise JSONBoundError(
                    f"{where}: its arrays and objects nest deeper than {JSON_DEPTH} levels, the most {what} may hold"
                )
    return json.loads(text, **kwargs)


def lock_run(run_dir: Path) -> None:
    """Hold <run>/lock (fcntl.flock) for this process's run: a second process in the folder is refused. The OS
    releases it when the process dies. A lock that cannot be opened (a directory, a read-only folder) is named."""
    lock = run_dir / "lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if lock.is_dir():
            raise UserError(f"{lock} is a directory, not the run's lock file: remove it (rm -r {lock})") from None
        raise UserError(
            f"{run_dir}: cannot write in the run folder ({e.strerror or e}; its lock file {lock}): make the "
            "folder writable, or choose another --run-name"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(
            f"{run_dir} is in use by process {holder} (a run holds its folder while it runs): wait for "
            "it to end, or choose another --run-name"
        ) from None
    RUN_LOCKS[str(run_dir)] = fd
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
    except OSError:  # a full disk: the flock holds without the process id
        pass


def in_use(run_dir: Path) -> bool:
    """Whether another process holds <run>/lock now (lock_run), without taking it."""
    if not (run_dir / "lock").exists():
        return False
    fd = os.open(run_dir / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def what_is_kept(run_dir: Path | None = None) -> str:
    """What a stopped run keeps and what to do: the checkpoint of `run_dir` (default: the run folder this process
    holds), or that it holds none yet and the run is to be started again."""
    run_dir = run_dir or next(map(Path, RUN_LOCKS), None)
    if run_dir is None:  # another trainer rank (rank 0 holds the folder), or no run folder is open yet
        return "whatever checkpoint the run folder holds is kept (rank 0 says which)"
    if (run_dir / "checkpoint").exists() or (run_dir / "checkpoint.old").exists():
        return f"the last checkpoint in {run_dir} is kept: continue with --resume (same --run-name)"
    return (
        f"{run_dir} holds no checkpoint yet (one is written every --eval-every steps and at the end), so nothing "
        f"of this run can be resumed: start it again (rm -r {run_dir} first)"
    )


def release_runs() -> None:
    for fd in RUN_LOCKS.values():
        os.close(fd)  # closing the descriptor releases its flock
    RUN_LOCKS.clear()


def write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all: a kill or a full disk leaves the old content (a temporary is renamed in;
    one that fails is removed)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def append_line(path: Path, line: str) -> None:
    """Append one line whole or not at all: a write that fails (a full disk) is cut back to the old end."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        data = (line + "\n").encode()
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def check_resume_config(cfg, run_dir: Path, entry: str) -> None:
    """The saved configuration is the truth: refuse a resume by another entry than the one that started the run
    (`entry`: replay_grpo.py or async_pipeline.py), or whose flags differ outside RESUMABLE (one line naming each,
    with its saved and given values), or that gives a flag config.json lacks another value than its default; append
    the flags that changed (and those config.json lacks: saved as null) to <run>/resumes.jsonl."""
    config = run_dir / "config.json"
    try:
        saved = read_json(config.read_text(), str(config), max_chars=None)
        if not isinstance(saved, dict):
            raise ValueError(f"a {type(saved).__name__}, not a record of settings")
    except (OSError, ValueError, JSONBoundError) as e:
        raise UserError(
            f"--resume: {config} is missing or damaged ({type(e).__name__}): the run's "
            "settings are unknown, so it cannot be continued"
        ) from None
    # a folder from before the two entries names its loop by --mode instead
    made_by = saved.pop("entry", None) or ENTRIES.get(saved.pop("mode", "sync"), "replay_grpo.py")
    if made_by != entry:
        raise UserError(f"--resume: {run_dir} was started by {made_by}, so only {made_by} continues it, not {entry}")
    given = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as saved: JSON types

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    def differs(k: str) -> str:
        """A refused flag with its given and saved values; and their JSON types where those differ (4 and "4")."""
        if json_type(saved[k]) == json_type(given[k]):
            return f"{flag(k)} {given[k]} (saved: {saved[k]})"
        types = f"types: {json_type(given[k])} given, {json_type(saved[k])} saved"
        return f"{flag(k)} {given[k]} (saved: {json.dumps(saved[k])}; {types})"

    differ = [k for k in given if k in saved and saved[k] != given[k] and k not in RESUMABLE]
    if differ:
        listed = "; ".join(differs(k) for k in differ)
        raise UserError(
            f"--resume: {run_dir} was started with other settings, and a run never mixes two: {listed}. "
            "Resume with the saved values, or start a new --run-name"
        )
    # a flag config.json lacks (a folder older than the flag) ran as its default: only that value is vouched for
    default = {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cfg)
    }
    default = json.loads(json.dumps(default))
    unsaved = [k for k in given if k not in saved and k not in RESUMABLE and given[k] != default[k]]
    if unsaved:
        listed = "; ".join(f"{flag(k)} {given[k]} (default: {default[k]})" for k in unsaved)
        raise UserError(
            f"--resume: {run_dir / 'config.json'} does not hold {len(unsaved)} flag(s), so the run had their "
            f"defaults and a run never mixes two: {listed}. Resume with the defaults, or start a new --run-name"
        )
    changed = {flag(k): [saved.get(k), v] for k, v in given.items() if k not in saved or saved[k] != v}
    changed.pop("--resume", None)
    # a setting this code has no flag for (a flag of another version of the code, which removed or renamed it since):
    # the run continues without it, which is said and recorded (given: null)
    unknown = [k for k in saved if k not in given]
    for k in unknown:
        changed[flag(k)] = [saved[k], None]
    if unknown:
        print(
            f"warning: {config} holds {len(unknown)} setting(s) this code has no flag for, and the run continues "
            f"without them: {', '.join(f'{k} = {json.dumps(saved[k])[:60]}' for k in unknown)}"
        )
    record = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changed": changed})
    try:
        append_line(run_dir / "resumes.jsonl", record)
    except OSError as e:
        if not disk_full(e, run_dir):
            raise
        raise UserError(full_disk_line(run_dir / "resumes.jsonl")) from None


def json_type(value) -> str:
    """The JSON type of a value read from JSON."""
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(type(value), "?")


def full_disk_line(path: Path) -> str:
    """The line for a full disk met on resume, before the run changed anything."""
    return (
        f"disk full: --resume could not write {path} ({shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free "
        "there); the checkpoint and the records up to it are kept: free some space, then --resume"
    )


def current_config(run_dir: Path, saved: dict) -> dict:
    """config.json's settings (`saved`) as the run has them now: with the RESUMABLE changes of each resume
    (resumes.jsonl) applied in order, since config.json is written once, when the run starts. A damaged
    resumes.jsonl raises ValueError."""
    current, path = dict(saved), run_dir / "resumes.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for lineno, line in enumerate(lines, 1):
        try:
            changes = read_json(line, f"{path}:{lineno}")["changed"].items()
            for flag, (_, value) in changes:
                current[flag.removeprefix("--").replace("-", "_")] = value
        except (ValueError, KeyError, TypeError, AttributeError, JSONBoundError):
            raise ValueError(f"{path}: a line is not a resume record: {line[:80]!r}") from None
    return current


def read_checkpoint_file(ckpt: Path, name: str, read, keys: tuple[str, ...] = ()):
    """read(ckpt / name), a dict holding `keys` when they are given; or one line naming the damaged (cut, empty,
    missing) file, or the file whose content is another (two files swapped), and what can be done."""
    again = f"restore the file, or start the run again (rm -r {ckpt.parent}, or another --run-name)"
    try:
        content = read(ckpt / name)
    except pickle.UnpicklingError as e:  # load_torch's refusal: something there would build an object or run code
        raise UserError(f"--resume: {ckpt / name} {not_plain_data(e)}, so the run cannot continue from it: {again}")
    except Exception as e:  # torch's, safetensors' and pickle's errors for a damaged file share no base class
        reason = str(e).splitlines()[0][:120] if str(e) else ""
        raise UserError(
            f"--resume: {ckpt / name} is damaged or missing ({type(e).__name__}: {reason}), so the run "
            f"cannot continue from it: {again}"
        ) from None
    missing = [k for k in keys if not isinstance(content, dict) or k not in content]
    if missing:
        raise UserError(
            f"--resume: {ckpt / name} holds something else (no {', '.join(map(repr, missing))}: another file's "
            f"content, or two files swapped), so the run cannot continue from it: {again}"
        )
    return content


def cut_records(path: Path, last_step: int) -> tuple[list[str], list[int]]:
    """The lines of a records file up to `last_step`, and the numbers of the unreadable lines (cut, garbage, beyond
    read_json's bounds, no step)."""
    kept, unreadable = [], []
    for lineno, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        try:
            step = read_json(line, f"{path}:{lineno}")["step"]
        except (ValueError, TypeError, KeyError, JSONBoundError):
            step = None
        if not isinstance(step, int):
            unreadable.append(lineno)
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


# ===== Creating a run folder, its checkpoints and its records =====================================


def open_run(cfg, entry: str) -> tuple[str, Path, Path]:
    """Run name, folder (created, locked for this process, config saved once with the `entry` that runs it) and
    checkpoint; never overwrites a run, resumes one without --resume, resumes it with other settings or by the other
    entry, or appends to a killed run's records."""
    R, B, N = cfg.rollouts_per_step, cfg.batch_size, cfg.buffer_size
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_name = cfg.run_name or f"{cfg.preset}-{cfg.loss}-N{N}-B{B}-R{R}-s{cfg.seed}-{stamp}"
    run_dir = Path(cfg.out_dir) / run_name
    out, run = os.path.abspath(cfg.out_dir), os.path.abspath(run_dir)
    if run == out or os.path.commonpath([out, run]) != out:  # '..', '.', an absolute name
        raise UserError(f"--run-name {run_name}: a run folder must be a folder inside --out-dir {cfg.out_dir}")
    check_nesting(Path(run), f"--out-dir {cfg.out_dir} --run-name {run_name}", cfg.out_dir, cfg.sft_warmup_steps > 0)
    ckpt = run_dir / "checkpoint"
    if cfg.resume and not (ckpt.exists() or (run_dir / "checkpoint.old").exists()):
        raise UserError(f"--resume: no checkpoint in {run_dir} (check --out-dir / --run-name)")
    unwritable = f"--out-dir {cfg.out_dir}: cannot write the run folder {run_dir}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{unwritable} ({e.strerror or e})") from None
    lock_run(run_dir)
    if not ckpt.exists() and (run_dir / "checkpoint.old").exists():
        (run_dir / "checkpoint.old").rename(ckpt)  # killed between the two renames of a save
    if ckpt.exists() and not cfg.resume:
        raise UserError(
            f"{run_dir} already holds a checkpoint: pass --resume to continue it, or choose another --run-name"
        )
    metrics = run_dir / "metrics.jsonl"
    if not cfg.resume and metrics.exists() and metrics.stat().st_size > 0:
        raise UserError(
            f"{run_dir} holds the records of a run that stopped before its first checkpoint: remove the "
            f"folder (rm -r {run_dir}) to start again, or choose another --run-name"
        )
    if cfg.resume:
        check_resume_config(cfg, run_dir, entry)
    else:
        try:
            write_atomic(run_dir / "config.json", json.dumps({"entry": entry, **dataclasses.asdict(cfg)}, indent=2))
        except OSError as e:
            full = "disk full: " if disk_full(e, run_dir) else ""
            raise UserError(f"{full}cannot write {run_dir / 'config.json'} ({e.strerror or e})") from None
    note_machine(run_dir)
    return run_name, run_dir, ckpt


def machine() -> dict:
    """What a run's rounding depends on besides its flags and seed: the processor (vendor, model, and the vector
    instructions torch's kernels use), the GPUs, torch's version and its threads. The same run on two machines that
    differ here may give other records (a sum's order follows the kernel), which compound over thousands of steps."""
    import platform

    import torch

    info = {}
    with contextlib.suppress(OSError):  # Linux; elsewhere platform.processor() alone
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model", "model name") and key.strip() not in info:
                info[key.strip()] = value.strip()
    cpu = " ".join(info.get(k, "") for k in ("vendor_id", "model name")).strip() or platform.processor()
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    isa = torch.backends.cpu.get_cpu_capability()
    return {"cpu": cpu, "isa": isa, "gpus": gpus, "torch": torch.__version__, "threads": torch.get_num_threads()}


def note_machine(run_dir: Path) -> None:
    """Append this process's machine() to <run>/machines.jsonl (a run's start and each resume). A resume on another
    machine than the run's start is said in one line: the run goes on, but not bitwise as it would have there."""
    path, now = run_dir / "machines.jsonl", machine()
    try:
        first = read_json(path.read_text().splitlines()[0], str(path))["machine"]
    except (OSError, IndexError, ValueError, TypeError, KeyError, UserError):  # none recorded yet, or damaged
        first = now
    if isinstance(first, dict) and first != now:
        changed = "; ".join(f"{k} {first.get(k)} -> {v}" for k, v in now.items() if first.get(k) != v)
        print(
            f"warning: {run_dir} started on another machine ({changed}): the run goes on, but its records from here "
            "are not bitwise those it would have made there (rounding follows the processor, torch and its threads)"
        )
    try:
        append_line(path, json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": now}))
    except OSError as e:
        if not disk_full(e, run_dir):
            raise
        raise UserError(full_disk_line(path)) from None


def is_run_folder(path: Path) -> bool:
    """Whether `path` is a run's folder: it holds the run's lock and its config.json (open_run writes both first)."""
    return (path / "lock").is_file() and (path / "config.json").is_file()


def check_nesting(run: Path, given: str, out_dir: str, warm_start: bool) -> None:
    """Refuse a run folder (`run`, absolute; `given`: the flags that name it) that lies inside a warm-start cache or
    inside another run's folder, or that holds either: a run would write into the other's files, and a removal of
    one (rm -r) would take the other with it; with `warm_start`, also a warm-start cache (<out_dir>/.warmstart) that
    lies inside a run's folder. Compared by real paths: a symlink on the way changes nothing."""
    real, cache = Path(os.path.realpath(run)), Path(os.path.realpath(Path(out_dir) / WARM_START_FOLDER))
    shown = str(run) if real == run else f"{run} (really {real})"
    for folder in (real, *real.parents):
        if folder.name == WARM_START_FOLDER or folder == cache:
            raise UserError(
                f"{given}: the run folder {shown} lies inside the warm-start cache {folder}: choose another"
            )
    for folder in real.parents:
        if is_run_folder(folder):
            raise UserError(
                f"{given}: the run folder {shown} lies inside the folder of another run, {folder}: a run folder never "
                "holds another; choose a --run-name beside it"
            )
    if cache.is_relative_to(real):
        raise UserError(
            f"{given}: the run folder {shown} holds the warm-start cache {cache}: a run folder never holds one; "
            "choose another --run-name"
        )
    for folder, subfolders, _ in os.walk(real):  # nothing to walk unless it exists (a resume, or a folder given again)
        for name in subfolders:
            inner = Path(folder) / name
            if name == WARM_START_FOLDER or is_run_folder(inner):
                what = "a warm-start cache" if name == WARM_START_FOLDER else "the folder of another run"
                raise UserError(
                    f"{given}: the run folder {shown} holds {what}, {inner}: a run folder never holds one; choose "
                    "another --run-name"
                )
    for folder in (cache, *cache.parents) if warm_start else ():
        if is_run_folder(folder):
            raise UserError(
                f"{given}: the warm-start cache {cache} lies inside the folder of the run {folder}: a run folder "
                f"never holds one; make {Path(out_dir) / WARM_START_FOLDER} a plain folder, or choose "
                "another --out-dir"
            )


def swap_in_checkpoint(run_dir: Path) -> None:
    """checkpoint.tmp becomes checkpoint by renames: a kill at any point leaves a whole checkpoint (open_run
    renames a lone checkpoint.old back)."""
    tmp, final, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)  # a stale one, when a kill came before its deletion below
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    run_dir: Path,
    model,
    tok,
    trainer_state: dict,
    optimizer_state: dict,
    weights: dict | None = None,
    swap: bool = True,
) -> None:
    """The model (save_pretrained of the fp32 master weights: `weights`, or the model's own), optimizer.pt (fp32
    Adam state, read by rank 0 alone on resume) and trainer_state.pt (buffer, RNG, totals) into checkpoint.tmp,
    swapped in by rename (swap=False: the caller swaps, once more files are in)."""
    import torch

    tmp = run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dtype = next(iter(weights.values())).dtype if weights else None  # (save_pretrained empties `weights`)
        model.save_pretrained(tmp, state_dict=weights)
        if dtype is not None:  # config.json states the dtype of the tensors it sits beside, not the model object's
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tok.save_pretrained(tmp)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(trainer_state, tmp / "trainer_state.pt")
    except Exception as e:
        full = disk_full(e, run_dir)
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint would only fill the disk further
        if not full:
            raise
        ckpt, kept = run_dir / "checkpoint", "no earlier checkpoint exists"
        if ckpt.exists():
            kept_step = load_torch(ckpt / "trainer_state.pt", mmap=True)["step"]
            kept = f"the checkpoint of step {kept_step} in {ckpt} is kept"
        free = shutil.disk_usage(run_dir).free / 2**20
        raise UserError(
            f"disk full: the checkpoint of step {trainer_state['step']} could not be written to "
            f"{run_dir} ({free:.0f} MiB free there now); {kept}: free some space, then --resume"
        ) from None
    if swap:
        swap_in_checkpoint(run_dir)


def load_torch(path: Path, mmap: bool = False, map_location=None):
    """A torch file of a run folder or a warm-start cache (checkpoint/*.pt, rng_state.pt), read by torch.load's
    weights_only unpickler: tensors, numbers, strings, None, and lists, tuples and dicts of them. It builds no other
    object and calls no function a file names, so a file from someone else cannot run code here; a file holding
    anything else raises pickle.UnpicklingError (not_plain_data says it in words). Every file this code saves
    holds only that (rng_state keeps numpy's stream as a tensor); numpy arrays, which checkpoints of earlier versions
    hold (numpy's stream), are read as arrays: their reconstruction builds an array and nothing else."""
    import numpy as np
    import torch

    arrays = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(arrays):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def not_plain_data(e: pickle.UnpicklingError) -> str:
    """load_torch's refusal in words: what the file names that is not plain data (a class or a function)."""
    found = re.search(r"GLOBAL (\S+)", str(e))
    what = f"names {found[1]}" if found else "holds an object that is not plain data"
    return (
        f"{what}: a checkpoint holds tensors, numbers, strings, lists, tuples and dicts only, and the loader builds "
        "nothing else and runs no code a file names (a file made by other code, or crafted)"
    )


def rng_state() -> dict:
    """Every random stream a run draws from, for its checkpoint: torch's (CPU and CUDA), numpy's and `random`. Plain
    data and tensors only (load_torch reads it): numpy's state as (name, its key as an int64 tensor, pos, has_gauss,
    cached_gaussian)."""
    import numpy as np
    import torch

    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("numpy") is not None:  # absent from checkpoints of older versions
        name, key, *rest = state["numpy"]
        np.random.set_state((name, np.asarray(key, dtype=np.int64).astype(np.uint32), *rest))
    if state.get("cuda") is not None and torch.cuda.is_available():  # the devices this process sees
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), numpy and `random`: every stream a run or an engine in it draws from."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """Run a block with these environment variables set, then restore what was there (unset where nothing was)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def forked_rng(seed: int):
    """Run a block on its own random streams seeded with `seed`, then restore every stream: the CPU's and every
    CUDA device's torch generators (HF sampling, vLLM's CPU runner), numpy's (vLLM's GPU runner seeds each
    request from it) and `random`."""
    import numpy as np
    import torch

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    state = random.getstate()
    np_state = np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)  # the CPU and every CUDA device
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(state)
            np.random.set_state(np_state)


class RunLog:
    """<run>/metrics.jsonl, <run>/samples.jsonl (both cut back to the checkpoint's step on resume) and wandb."""

    def __init__(self, cfg, run_name: str, run_dir: Path, start_step: int):
        for name in ("metrics", "samples"):  # drop what a killed run wrote after its checkpoint
            path = run_dir / f"{name}.jsonl"
            if cfg.resume and path.exists():
                kept, unreadable = cut_records(path, start_step)
                try:
                    write_atomic(path, "".join(line + "\n" for line in kept))
                except OSError as e:
                    if not disk_full(e, run_dir):
                        raise
                    raise UserError(full_disk_line(path)) from None
                if unreadable:
                    where = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
                    print(
                        f"resume: dropped {len(unreadable)} unreadable line(s) of {path} (line {where}: cut, not "
                        "a record, or beyond the bounds a line may hold; what a kill or a full disk leaves)"
                    )
        self.metrics = (run_dir / "metrics.jsonl").open("a")
        self.samples = (run_dir / "samples.jsonl").open("a")
        self.wandb = None
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise UserError("--wandb: wandb is not installed (pip install wandb)") from None
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "replay-grpo"),
                name=run_name,
                config=dataclasses.asdict(cfg),
                resume="allow" if cfg.resume else None,
            )

    def log(self, record: dict, samples: list[dict] = ()) -> None:
        """One step's metrics, and the completions sampled at it (also a wandb table)."""
        self._write(self.samples, [{"step": record["step"], **row} for row in samples], record["step"])
        self._write(self.metrics, [record], record["step"])
        if self.wandb is not None:
            import wandb

            table = {}
            if samples:
                table["samples"] = wandb.Table(columns=list(samples[0]), data=[list(x.values()) for x in samples])
            self.wandb.log({**record, **table}, step=record["step"])

    @staticmethod
    def _write(file, rows: list[dict], step: int) -> None:
        try:
            file.write("".join(json.dumps(row) + "\n" for row in rows))
            file.flush()
        except OSError as e:
            if not disk_full(e, Path(file.name).parent):
                raise
            raise UserError(
                f"disk full: could not write {file.name} at step {step} (a cut last line is dropped on resume): "
                f"free some space; {what_is_kept(Path(file.name).parent)}"
            ) from None

    def close(self) -> None:
        self.metrics.close()
        self.samples.close()
        if self.wandb is not None:
            self.wandb.finish()


def nonfinite_stop(streak: int, step: int, ckpt: Path) -> UserError:
    return UserError(
        f"{streak} steps in a row had a NaN/inf loss or gradient (step {step}); stopped (lower --lr): "
        f"{what_is_kept(ckpt.parent)}"
    )


def quiet_libraries(verbose: bool) -> None:
    """Keep vLLM's per-publish lines (weight reloads, prefix-cache resets), math-verify's timeouts and transformers'
    per-checkpoint progress bars off the console, unless --verbose."""
    import logging

    import transformers

    transformers.utils.logging.disable_progress_bar()
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is imported (here, or in generators)
        logging.getLogger("math_verify").setLevel(logging.ERROR)
