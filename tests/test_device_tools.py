"""The GPU tools' CPU rehearsals, through their command lines: the mu tool at toy sizes."""

import json
import os
import subprocess
import sys

import pytest

import replay_grpo as rg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(args, timeout, **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_mu_tool_table_at_toy_sizes(tmp_path):
    # both models' shapes at toy sizes, two forced lengths: a row per (model, length) with mu = generation seconds /
    # training seconds, and the schedule replay_grpo's planner gives for that mu with plan's defaults
    r = _tool(
        [
            "tools/mu_tool.py",
            "--tiny",
            "--lengths",
            "3,12",
            "--batch",
            "2",
            "--prompt-len",
            "5",
            "--out",
            str(tmp_path),
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "mu.json").read_text())
    rows = result["rows"]
    assert [(x["model"], x["new_tokens"]) for x in rows] == [
        (m, n) for n in (3, 12) for m in ("qwen2.5-0.5b", "smollm2-135m")
    ]
    for x in rows:
        assert x["gen_s"] > 0 and x["train_s"] > 0 and x["mu"] == pytest.approx(x["gen_s"] / x["train_s"])
        plan = rg.suggest_schedule(x["mu"], 0.1, 0.1, 60, 16)
        assert x["plan"] == {k: plan[k] for k in x["plan"]}
        assert f"{x['mu']:7.2f}" in r.stdout and f"--buffer-size {plan['N']} " in r.stdout
    assert "upper bound on vLLM's mu" in r.stdout
    assert (tmp_path / "mu.md").read_text().count("\n| ") == len(rows) + 1  # header and a line per row


def test_mu_tool_refuses_bad_lengths():
    r = _tool(["tools/mu_tool.py", "--tiny", "--lengths", "0"], timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--lengths" in r.stderr, r.stderr


def test_device_check_dry_run_writes_every_file(tmp_path):
    pytest.importorskip("triton")  # the kernels' parts run under its interpreter, the spill part with its ptxas
    # the one device command, rehearsed on a CPU under the interpreter: every part runs and writes the files it
    # writes on a GPU, and the summary records each
    out = tmp_path / "device"
    r = _tool(["tools/device_check.py", "--out", str(out), "--dry-run"], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert files == {
        "summary.json", "summary.md", "versions.json", "spill.txt", "tune.log", "tune/tune.json", "tune/tune.md",
        "kernels_tuned.json", "bench.txt", "mu.log", "mu/mu.json", "mu/mu.md", "gpu_check.txt",
    }  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["status"] for k, v in summary["parts"].items()} == dict.fromkeys(
        ["versions", "tune", "bench", "mu", "gpu_check", "spill"], "ok"
    )
    assert json.loads((out / "versions.json").read_text())["torch"]
    tune = json.loads((out / "tune" / "tune.json").read_text())
    assert tune["dry_run"] and {"logits H Wt", "split dz W", "split dzT H"} <= set(tune["widths"]["24"]["floor"])
    assert json.loads((out / "kernels_tuned.json").read_text())["gpus"]["interpreter"]["24x300"]["fwd"]
    bench = (out / "bench.txt").read_text()
    assert "GEMM floor" in bench and any(line.startswith("triton ") for line in bench.splitlines())
    assert len(json.loads((out / "mu" / "mu.json").read_text())["rows"]) == 4
    assert "-> PASS" in (out / "gpu_check.txt").read_text()
    assert (out / "spill.txt").read_text().count("\nok ") == 2  # one tile of each kernel, compiled for sm_90


def test_device_check_refuses_a_used_folder(tmp_path):
    (tmp_path / "old.txt").write_text("kept\n")
    r = _tool(["tools/device_check.py", "--out", str(tmp_path), "--dry-run"], timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]


def test_the_method_and_the_gpu_tools_import_without_tyro():
    """The GPU machines have no tyro: replay_grpo imports it only to parse a command line, so the method, gpu_check
    and the mu tool import (tyro made unimportable in the child); parsing a command line still needs it."""
    no_tyro = "import sys; sys.modules['tyro'] = None; sys.path[:0] = ['.', 'tools']; import replay_grpo; "
    r = _tool(["-c", no_tyro + "import gpu_check, mu_tool"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _tool(["-c", no_tyro + "replay_grpo.parse_args([])"], timeout=120)
    assert r.returncode != 0 and "tyro" in r.stderr
