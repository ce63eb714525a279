"""Faults of the vLLM servers of async_pipeline.py that no real server makes on demand, through the real CLI against the
stand-in servers of misbehaving_server.py: answers that come a byte at a time (every request has a deadline, not a
bound per read), answers the trainer cannot take (token ids outside its vocabulary, log-probs that are not finite,
fewer log-probs than tokens), a URL with a path; and the test suite's own servers, which must not outlive a killed
test run. docs/reference.md's table of faults lists the same cases."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from misbehaving_server import GENERATE, HOST, StandIn
from test_async_pipeline import Run, alive, metrics
from test_faults import ENV, FLOOR, async_args, encode

import async_pipeline as ap
from infra import models, serving

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def one_error(log: str) -> str:
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    return errors[0]


# --- a server that answers a byte at a time is named at the request's deadline ----------------------------------

START_DRIPS = {  # a route the run probes at its start that drips (a byte every 2 s), what the one line says
    "/version": "GET /version got no answer within 5 s",
    "/health": "GET /health failed (timed out)",
    "/tokenize": "/tokenize failed (timed out): no answer in 5 s, this request's bound",
}
PREFLIGHT_DRIPS = {  # a route only the preflight probes (the run meets it later, within its request bound: MID_RUN)
    "/v1/models": "GET /v1/models got no answer within 5 s",
    "/is_paused": "GET /is_paused got no answer within 5 s",
    GENERATE: f"POST {GENERATE} got no answer within 5 s",
}


@pytest.mark.parametrize("route", list(START_DRIPS))
def test_a_probe_answered_a_byte_at_a_time_is_named_at_its_deadline(tmp_path, route):
    """Each probe of a server the run did not launch has PROBE_SECONDS in all, not per read: a route that drips its
    answer a byte every 2 s is one line (exit 2) naming the URL and the route after 5 s; before, GET /version took
    84 s (one read per byte) and the run went on."""
    with StandIn(encode=encode, drip=(route,), drip_seconds=2.0) as server:
        t0 = time.time()
        rc, log = Run(async_args(tmp_path, server.url)).finish(timeout=120)
        took = time.time() - t0
    error = one_error(log)
    assert rc == 2 and error.startswith(f"error: --generator-urls {server.url}: "), log[-3000:]
    assert START_DRIPS[route] in error, error
    assert took < 45, took  # the start (torch, the tokenizer) and one 5 s deadline
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    print(f"[{route}: one line {took:.1f} s after the start] {error}")


@pytest.mark.parametrize("route", list(PREFLIGHT_DRIPS))
def test_a_preflight_probe_answered_a_byte_at_a_time_is_named_at_its_deadline(route):
    """tools/check_servers.py's probes have PROBE_SECONDS each in all, not per read: a route that drips its answer a
    byte every 2 s is one line (exit 2) naming the URL and the route after 5 s."""
    cmd = [sys.executable, str(ROOT / "tools" / "check_servers.py"), "--context", "64"]
    with StandIn(encode=encode, drip=(route,), drip_seconds=2.0) as server:
        t0 = time.time()
        res = subprocess.run(cmd + [server.url], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        took = time.time() - t0
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-3000:]
    assert res.stderr.startswith(f"error: --generator-urls {server.url}: ") and PREFLIGHT_DRIPS[route] in res.stderr
    assert took < 30, took


MID_RUN = {  # the stand-in's fault, what the line says after the endpoint, the bound it reports within
    "a byte every 2 s": ({"drip": (GENERATE,)}, "failed (timed out): no answer in ", FLOOR),
    "NaN log-probs": (
        {"fault": "nan"},
        "answered what the trainer cannot take (choice 0: log-prob nan of token 0 is not finite): b'",
        0.0,
    ),
    "token ids outside the vocabulary": (
        {"fault": "vocab"},
        "answered what the trainer cannot take (choice 0: token id 10000049 is outside the trainer's vocabulary (0 to ",
        0.0,
    ),
    "fewer log-probs than token ids": (
        {"fault": "short"},
        "answered what the trainer cannot take (choice 0: 4 token_ids but 3 log-probs): b'",
        0.0,
    ),
}


@pytest.mark.parametrize("fault", list(MID_RUN))
def test_a_server_whose_answers_drip_or_cannot_be_trained_on_is_named_and_the_run_resumes(tmp_path, fault):
    """Once the run has a checkpoint, the stand-in's generate answers drip a byte every 2 s (named at the request's
    bound, REPLAY_GRPO_REQUEST_FLOOR here, with its age: before, the run hung printing nothing), or carry log-probs
    that are NaN (before: every step skipped as non-finite, exit 0, nothing trained), token ids the trainer's
    vocabulary lacks (before: an IndexError traceback from the step) or one log-prob fewer than tokens: one line
    (exit 1) names the server, the endpoint, what was wrong and the answer's first bytes, and the checkpoint kept;
    --resume continues from it on a server that answers right."""
    kind, needle, bound = MID_RUN[fault]
    run_dir = tmp_path / "r"
    extra = ["--eval-every", "2", "--sampling", "without-replacement"]
    checkpointed = (run_dir / "checkpoint").exists
    with StandIn(encode=encode, fault_when=checkpointed, delay=0.2, **kind) as server:
        run = Run(async_args(tmp_path, server.url, *extra, "--total-steps", "100000"), env=ENV)
        rc, log = run.finish(timeout=bound + 150)
        took = time.time() - server.faulted_at
    error = one_error(log)
    assert rc == 1 and error.startswith(f"error: vLLM server {server.url}: {GENERATE} {needle}"), log[-3000:]
    assert f"the last checkpoint in {run_dir} is kept: continue with --resume" in error, error
    if bound:
        age = int(re.search(r"no answer in (\d+) s, this request's bound", error)[1])
        assert bound <= age < bound + 5 and bound <= took < bound + 30, (age, took)
    else:
        assert took < 30, took
    print(f"[{fault}: one line {took:.1f} s after the fault] {error}")
    step = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]
    with StandIn(encode=encode) as server:
        resume = async_args(tmp_path, server.url, *extra, "--resume", "--total-steps", str(step + 2))
        res = subprocess.run(resume, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(step + 3))


def test_a_url_with_a_path_says_to_give_the_address_alone(tmp_path):
    """The base URL an OpenAI client takes (http://HOST:PORT/v1) is one line (exit 2) saying what to give instead;
    before, the run asked for /v1/version and called the server not a vLLM server."""
    with StandIn(encode=encode) as server:
        rc, log = Run(async_args(tmp_path, server.url + "/v1")).finish(timeout=120)
    error = one_error(log)
    assert rc == 2 and error == (
        f"error: --generator-urls {server.url}/v1: a URL with a path (/v1); give the server's address alone, "
        f"{server.url} (the run calls vLLM's routes, /v1/models among them, itself)"
    ), log[-3000:]
    assert not (tmp_path / "r").exists()


# --- the weights handed to the publisher thread ------------------------------------------------------------------


def test_the_publisher_waits_for_the_copies_on_the_stream_that_made_them(tmp_path, monkeypatch):
    """publish() records, on the calling thread, what the current stream of the publisher's device has queued (the
    gather's casts and all-gathers), and the publisher thread waits for it before any server hears of the weights
    (vLLM's packed producer reads them on its own streams, on that thread). Here the device is a CUDA device on a
    machine without CUDA: everything runs but the CUDA event itself."""
    seen, lock = [], threading.Lock()

    class Recorded(ap.HandOver):
        def __init__(self, device):
            super().__init__(device)
            with lock:
                seen.append(("made", threading.current_thread().name, device))

        def wait(self):
            with lock:
                seen.append(("waited", threading.current_thread().name, None))
            super().wait()

    monkeypatch.setattr(ap, "HandOver", Recorded)
    real_post = serving.Server.post

    def post(self, path, *args, **kwargs):
        with lock:
            seen.append(("request", threading.current_thread().name, path.split("?")[0]))
        return real_post(self, path, *args, **kwargs)

    monkeypatch.setattr(serving.Server, "post", post)
    model, _ = models.build_tiny_model(0)
    with StandIn(encode=encode) as stand_in:
        server = serving.Server(stand_in.url)
        device = torch.device("cuda", 0)
        publisher = ap.Publisher([server], "disk", tmp_path, torch.float32, tied=True, address="", device=device)
        publisher.publish(model.state_dict(), 1, wait=True)
        publisher.publish(model.state_dict(), 2, wait=True)
    assert publisher.error is None and publisher.done_version == 2
    main = threading.current_thread().name
    steps = [(what, thread == main, detail) for what, thread, detail in seen]
    rounds = [
        ("made", True, device),
        ("waited", False, None),
        ("request", False, "/pause"),
        ("request", False, "/collective_rpc"),
        ("request", False, "/update_weight_version"),
        ("request", False, "/resume"),
    ]
    assert steps == rounds + rounds, seen


def test_the_publishers_weight_source_reads_as_vllm_0_32_reads_it(tmp_path):
    """The nccl engine's WeightSource (the Publisher, over the gathered weights) as vLLM 0.32 reads it: metadata()
    called, then plain iteration, in the metadata's order, in the wire dtype; metadata read as a property, iter_full()
    and iter_local() give the same. (vLLM 0.33's engine reads more, before any publish: docs/async.md.)"""
    from vllm.distributed.weight_transfer.base import ParamMeta

    model, _ = models.build_tiny_model(0)
    weights = dict(model.state_dict())
    publisher = ap.Publisher([], "disk", tmp_path, torch.bfloat16, tied=True, address="", device=torch.device("cpu"))
    publisher.source = ap.DictSource(weights, torch.bfloat16, torch.device("cpu"))
    expected = [ParamMeta(k, torch.bfloat16, tuple(v.shape)) for k, v in weights.items()]
    assert publisher.metadata() == expected and publisher.metadata == expected
    for pairs in (list(publisher), list(publisher.iter_full()), list(publisher.iter_local())):
        assert [k for k, _ in pairs] == [m.name for m in expected]
        assert all(v.dtype == torch.bfloat16 and torch.equal(v, weights[k].bfloat16()) for k, v in pairs)


# --- nothing of the test suite outlives a killed test run ----------------------------------------------------------

HOLDER = """
    import os, sys, time, types
    from pathlib import Path

    from infra import serving

    def test_holds_a_launched_server(tmp_path):
        script = {script!r}
        serving.server_command = lambda cfg, folder, max_model_len, port, cpu, memory=0.9: [
            sys.executable, script, cfg.generator_host, str(port), "0"
        ]
        cfg = types.SimpleNamespace(generator_host={host!r}, seed=0)
        servers = serving.launch_servers(cfg, tmp_path, 512, [None], tmp_path / "logs")
        serving.wait_ready(servers, timeout=60)
        Path({pids!r}).write_text(f"{{os.getpid()}} {{servers[0].proc.pid}}")
        time.sleep(600)
"""


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_killed_test_run_leaves_no_server_behind(tmp_path, workers):
    """A pytest process (with the suite's conftest, in one process or with one xdist worker) launches a server as
    the suite's fixture does (serving.launch_servers; here the stand-in script) and is killed with SIGKILL: the
    server, in a session of its own, gets SIGTERM from the kernel as the thread that launched it ends, and an xdist
    worker as its controller ends; within 20 s nothing of the test run is left. Before, the server ran on."""
    pids = tmp_path / "pids"
    test = tmp_path / "holder" / "test_holder.py"
    test.parent.mkdir()
    script = str(TESTS / "misbehaving_server.py")
    test.write_text(textwrap.dedent(HOLDER.format(script=script, host=HOST, pids=str(pids))))
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", workers, "-p", "conftest", "-p", "no:cacheprovider", str(test)]
    cmd += ["--rootdir", str(test.parent), "--basetemp", str(tmp_path / "base")]
    # its own session: the cleanup below may kill its group without this test's
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    holder = server = None
    try:
        deadline = time.time() + 120
        while not pids.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert pids.exists(), proc.communicate(timeout=60)[0].decode()[-3000:] if proc.poll() is not None else "slow"
        time.sleep(0.2)
        holder, server = map(int, pids.read_text().split())
        assert alive(holder) and alive(server)
        os.kill(proc.pid, signal.SIGKILL)  # the pytest process alone: its worker and server must end by themselves
        proc.wait()
        deadline = time.time() + 20
        while (alive(server) or alive(holder)) and time.time() < deadline:
            time.sleep(0.2)
        left = [p for p in (holder, server) if alive(p)]
    finally:  # whatever is left, for the next test: the pytest process's group, the server's
        for group in (proc.pid, server):
            if group is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
        proc.wait()
    assert not left, f"left behind after the test run was killed: {left}"
