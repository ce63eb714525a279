"""async_pipeline.py on real vLLM server processes (tests/conftest.py): served log-probs against the trainer's,
publishes (tied and untied heads), version spans across a publish; through the real CLI, torchrun with 2 FSDP2 trainer
ranks, resume with servers the run launches itself, a server killed mid-run, and one process (T = 1) stopped by
Ctrl-C. CPU, offline."""

import copy
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

PATH = str(ROOT)
sys.path[:0] = PATH.split(os.pathsep)
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=PATH)

import async_pipeline as ap  # noqa: E402
import kernels  # noqa: E402
import replay_grpo as rg  # noqa: E402
from infra import evaluation, generation, models, run_folder, serving, tasks, warm_start  # noqa: E402

TINY = (
    "--preset cpu --sft-warmup-steps 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
    "--buffer-size 16 --max-new-tokens 4 --eval-size 8 --pass-k 2 --eval-every 0 "
    "--num-generators 1 --loss asymre --lr 1e-3"
).split()  # asymre: nonzero gradients at reward 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tiny(vllm_servers) -> list[str]:
    """TINY on the session's tied-head server."""
    return TINY + ["--generator-urls", vllm_servers["tied"].url]


def torchrun(nproc: int, *args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--master-port",
        str(free_port()),
        str(ROOT / "async_pipeline.py"),
        *TINY,
        *args,
    ]


def descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc, no psutil)."""
    children = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # not a process, or gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Run:
    """A CLI run in its own session; remembers every process it ever had below it. It gets SIGTERM (a Ctrl-C to the
    run) when the test process ends, SIGKILL included (serving.die_with_parent)."""

    def __init__(self, cmd: list[str], preexec_fn=None, env: dict | None = None):
        self.t0, self.seen, parent = time.time(), set(), os.getpid()

        def child() -> None:
            serving.die_with_parent(parent)
            if preexec_fn is not None:
                preexec_fn()

        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env or ENV,
            stdout=subprocess.PIPE,
            preexec_fn=child,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def poll_until(self, cond, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.seen |= descendants(self.proc.pid)
            if cond() or self.proc.poll() is not None:
                return cond()
            time.sleep(0.2)
        return False

    def servers(self) -> list[int]:
        """The vLLM servers the run launched (their engine processes are below them)."""
        return [p for p in descendants(self.proc.pid) if "vllm.entrypoints.openai.api_server" in cmdline(p)]

    def finish(self, timeout: float) -> tuple[int, str]:
        self.poll_until(lambda: self.proc.poll() is not None, timeout)
        if self.proc.poll() is None:  # a hang: clean up for the next test, then fail
            os.killpg(self.proc.pid, signal.SIGKILL)
            out = self.proc.communicate()[0].decode()
            pytest.fail(f"run did not end within {timeout}s:\n{out[-3000:]}")
        try:
            out = self.proc.communicate(timeout=30)[0].decode()
        except subprocess.TimeoutExpired:  # a process left behind still holds the run's output open
            pytest.fail(f"processes left behind: {[(p, cmdline(p)) for p in self.seen if alive(p)]}")
        time.sleep(0.5)  # let the kernel reap what was reparented
        left = [(p, cmdline(p)) for p in self.seen if alive(p)]
        assert not left, f"processes left behind: {left}"
        print(f"[{time.time() - self.t0:.1f}s, exit {self.proc.returncode}, {len(self.seen)} child processes]")
        return self.proc.returncode, out


def math_finite(x) -> bool:
    return x is not None and abs(x) < float("inf")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, vllm_servers):
    """T = 2 trainer ranks (torchrun, FSDP2), W = 1 server (the session's), 6 steps, publish every step."""
    out = tmp_path_factory.mktemp("async")
    url = vllm_servers["tied"].url
    args = ["--total-steps", "6", "--sample-every", "3", "--out-dir", str(out), "--run-name", "t2"]
    run = Run(torchrun(2, "--generator-urls", url, *args))
    rc, log = run.finish(timeout=240)
    assert rc == 0, log[-4000:]
    assert len(run.seen) >= 2, run.seen  # 2 ranks at least
    return out / "t2", log


def test_the_door_torchrun_async_pipeline_names_its_entry_and_only_it_resumes_the_run(two_rank_run):
    """`torchrun --nproc_per_node 2 async_pipeline.py --preset cpu ... --num-generators 1` (the fixture's run) trains
    through the W/T system's own entry: its config.json names that entry, and replay_grpo.py refuses to resume the
    folder in one line (exit 2), writing nothing."""
    run_dir, log = two_rank_run
    config = json.loads((run_dir / "config.json").read_text())
    assert config["entry"] == "async_pipeline.py" and config["num_generators"] == 1 and "mode" not in config
    assert [r["step"] for r in metrics(run_dir)] == list(range(7)) and "async: W = 1 vLLM server(s)" in log
    before = sorted(p.name for p in run_dir.iterdir())
    cmd = [sys.executable, str(ROOT / "replay_grpo.py"), "--preset", "cpu", "--out-dir", str(run_dir.parent)]
    res = subprocess.run(
        cmd + ["--run-name", run_dir.name, "--resume"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    started = f"{run_dir} was started by async_pipeline.py, so only async_pipeline.py continues it, not replay_grpo.py"
    assert res.returncode == 2 and res.stderr == f"error: --resume: {started}\n", res.stderr[-2000:]
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_two_ranks_write_rank_0s_trained_samples_every_sample_every_steps(two_rank_run):
    run_dir, _ = two_rank_run
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["source"] == "train"]
    assert sorted({r["step"] for r in train}) == [3, 6] and len(train) == 2 * evaluation.SAMPLES
    assert all(r["staleness"] >= 0 and r["gold"] and "advantage" in r for r in train)


def test_two_ranks_train_on_evenly_dealt_stale_rollouts(two_rank_run):
    run_dir, log = two_rank_run
    recs = metrics(run_dir)
    steps = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in recs] == list(range(7))
    for r in steps:
        assert r["num_trainers"] == 2 and r["num_generators"] == 1
        assert math_finite(r["loss"]) and math_finite(r["grad_norm"]) and r["grad_norm"] > 0
        n0, n1 = r["rollouts_per_rank"]
        assert abs(n0 - n1) <= 8 // 2  # dealt evenly (round-robin: +-1 rollout, within one B/T batch)
        assert r["buffer_size"] <= 16 and sum(r["staleness_hist"].values()) == 8
        assert 0 <= r["queue_depth"] <= 4  # at most max(4, 2W) requests in flight or waiting
        assert r["publishes"] >= 1 and r["publish_seconds"] > 0
    # rollouts never carry a future version, nor an older one than what came before (the publisher may lag behind
    # six quick steps on a busy machine: the queue test shows the versions rising with every publish awaited)
    newest = [max(r["fresh_versions"]) for r in steps if r["fresh_versions"]]
    assert newest == sorted(newest), newest
    assert all(max(r["fresh_versions"], default=0) < r["step"] for r in steps)
    # trained samples are stale: generation runs ahead of the trainers
    assert any(int(s) > 0 for r in steps for s in r["staleness_hist"])
    last = steps[-1]
    throughput = (last["trained_rollouts"] / 2) / (last["generated_rollouts"] / 1)  # the paper's App. D.4 mu
    assert last["mu_throughput"] == pytest.approx(throughput)
    assert last["gamma"] == pytest.approx((1 + 1 / 2) / (1 + throughput))
    assert math_finite(last["mu"]) and last["mu"] > 0  # busy seconds per rollout, generators / trainers, as in sync
    assert last["trainer_idle_seconds"] >= 0 and last["gen_busy_seconds"] > 0
    # the ranks' evicted rollouts, merged: every one dealt and no longer held (none at all when the server's requests
    # came slower than six steps, which a busy machine makes happen)
    assert sum(last["replay_hist"].values()) == sum(last["rollouts_per_rank"]) - last["buffer_size"]
    assert "eval/pass@1" in last and "measured mu" in log
    # each rank's shard is in its own file, both full, with rollouts of several versions
    ckpt = run_dir / "checkpoint"
    shards = [torch.load(ckpt / f"buffer_rank{i}.pt", weights_only=False)["buffer"]["items"] for i in (0, 1)]
    assert [len(s) for s in shards] == [8, 8]
    assert max(r["policy_version"] for s in shards for r in s) < 6
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["step"] == 6 and state["trainers"] == 2 and state["mode"] == "async"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt)  # loadable by transformers (and vLLM)


def test_resume_then_a_killed_server_stops_every_rank(two_rank_run):
    """Resume the 6-step run on 2 ranks (model, full optimizer state, per-rank buffer shards and
    counters come back) with W = 2 servers that the run launches itself, then SIGKILL one: one line naming it,
    non-zero exit, no hang, the other server stopped too, and the checkpoint kept for --resume."""
    run_dir, _ = two_rank_run
    before = metrics(run_dir)[-1]
    run = Run(
        torchrun(
            2,
            "--total-steps",
            "100000",
            "--eval-every",
            "1",
            "--resume",
            "--num-generators",
            "2",
            "--out-dir",
            str(run_dir.parent),
            "--run-name",
            run_dir.name,
        )
    )
    state_file = run_dir / "checkpoint" / "trainer_state.pt"
    assert run.poll_until(lambda: len(metrics(run_dir)) >= 9 and len(run.servers()) == 2, 400), run.proc.poll()
    victim = min(run.servers())
    os.killpg(victim, signal.SIGKILL)  # the server and its engine process
    t_kill = time.time()
    rc, log = run.finish(timeout=90)
    assert rc != 0
    assert time.time() - t_kill < 30, "the dead server was noticed late"
    errors = [line for line in log.splitlines() if line.startswith("error: vLLM server ")]  # rank 0's
    assert len(errors) == 1 and errors[0].startswith("error: vLLM server http://127.0.0.1:"), log[-3000:]
    assert "exited with code -9" in errors[0] and "continue with --resume" in errors[0], errors
    assert "error: rank 1 stopped by rank 0: vLLM server " in log, log[-3000:]
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(len(recs)))  # continued at 7, nothing repeated
    first = recs[7]
    assert first["buffer_size"] == 16 and first["num_generators"] == 2  # the shards came back full
    assert all(a >= b for a, b in zip(first["rollouts_per_rank"], before["rollouts_per_rank"]))
    state = torch.load(state_file, weights_only=False)
    assert state["step"] >= 8
    optimizer = torch.load(run_dir / "checkpoint" / "optimizer.pt", weights_only=False)
    adam_steps = {float(s["step"]) for s in optimizer["state"].values()}
    assert adam_steps == {float(state["step"])}  # Adam's moments carried over from the first run


def test_an_async_run_logged_to_a_file_has_no_progress_bar(tmp_path, tiny):
    """A warm start, then the servers: no transformers bar in the run's log (the servers log to their own files)."""
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        res = subprocess.run(
            [
                sys.executable,
                str(ROOT / "async_pipeline.py"),
                *tiny,
                "--sft-warmup-steps",
                "20",
                "--total-steps",
                "3",
                "--out-dir",
                str(tmp_path),
                "--run-name",
                "q",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            timeout=300,
        )
    text = log.read_text()
    assert res.returncode == 0, text[-3000:]
    assert "warm start:" in text and "%|" not in text and "it/s]" not in text, text[-3000:]


def test_one_process_without_torchrun_and_ctrl_c(tmp_path):
    """T = 1 as plain `python async_pipeline.py` launching its server; Ctrl-C (SIGINT to the process group) ends it
    cleanly, server included, even when it was started with SIGINT ignored, as a background job of a script starts
    it. The trainer shares the cores with the server it launched; the warm start, trained before the server starts,
    uses them all."""
    run = Run(
        [
            sys.executable,
            str(ROOT / "async_pipeline.py"),
            *TINY,
            "--total-steps",
            "100000",
            "--out-dir",
            str(tmp_path),
            "--run-name",
            "t1",
            "--sft-warmup-steps",
            "3",
        ],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        env={k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"},  # its own share of the cores
    )
    assert run.poll_until(
        lambda: (tmp_path / "t1" / "metrics.jsonl").exists() and len(metrics(tmp_path / "t1")) >= 3 and run.servers(),
        400,
    ), run.proc.poll()
    os.killpg(run.proc.pid, signal.SIGINT)
    rc, log = run.finish(timeout=60)
    assert rc == 130 and "interrupted" in log, log[-3000:]  # and no process left behind (Run.finish)
    n = max(1, ap.available_cores() // 2)
    assert f"threads: trainer rank 0 uses {n} torch thread{'s' * (n > 1)} ({ap.available_cores()} cores / 2 " in log
    # the warm start ran before the server started: on every core, not on the trainer's share
    (cache,) = (tmp_path / ".warmstart").glob("*/warmstart.json")
    assert json.loads(cache.read_text())["threads"] == ap.available_cores(), log[-3000:]
    recs = metrics(tmp_path / "t1")
    assert recs[1]["num_trainers"] == 1 and all(math_finite(r["loss"]) for r in recs[1:])


# --- the servers: served log-probs, publishes, version spans, the rollout loop's channel ------------------------


def prompts_of(tok, texts=("12+7=", "3+45=", "99+1=")) -> list[list[int]]:
    return [models.render_prompt(tok, t) for t in texts]


def served_and_trained(
    publisher, server, model, tok, version: int, publish=True
) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Publish `model` to the publisher's servers as `version` (unless `publish` is False: it is there already),
    sample from `server`, and return the samples, their served behaviour log-probs and the trainer's log-probs of the
    same completions."""
    if publish:
        count = publisher.count
        publisher.publish(model.state_dict(), version, wait=True)
        assert publisher.error is None and publisher.count == count + 1
    generator = ap.ServerGenerator(server, generation.stop_token_ids(model, tok), random.Random(0))
    prompts = prompts_of(tok)
    groups = generator.generate(prompts, 4, 8, temperature=1.0)
    samples = [s for g in groups for s in g]
    pairs = [(prompts[i // 4], s.completion_ids) for i, s in enumerate(samples)]
    with torch.no_grad():
        trained = kernels.completion_logprobs(model, pairs, tok.pad_token_id, 1.0)
    return samples, torch.cat([s.logprobs for s in samples]), trained


@pytest.mark.parametrize("how", ["disk", "nccl"])
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_a_publish_changes_the_served_logprobs_to_the_new_weights(vllm_servers, tmp_path, head, how, monkeypatch):
    """The served behaviour log-probs equal the trainer's log-softmax to 1e-4 for the published weights, and after
    the next publish for the new ones (an untied head is published as its own tensor; a tied one is written out as
    lm_head.weight, or a folder reload keeps the old head). nccl: vLLM's trainer and worker engines and their HTTP
    routes, with the CPU stand-in for the NCCL group and broadcast (tests/vllm_plugin) on both sides."""
    from conftest import cpu_data_plane, untied_tiny
    from vllm.distributed.weight_transfer import nccl_engine

    for name, function in cpu_data_plane().items():
        monkeypatch.setattr(nccl_engine, name, function)
    build = models.build_tiny_model if head == "tied" else untied_tiny
    server = vllm_servers[head]
    (a, tok), (b, _) = build(11), build(12)
    tied, cpu = head == "tied", torch.device("cpu")
    publisher = ap.Publisher([server], how, tmp_path, torch.float32, tied=tied, address="127.0.0.1", device=cpu)
    samples, served, trained = served_and_trained(publisher, server, a, tok, 5)
    assert torch.allclose(served, trained, atol=1e-4), (served - trained).abs().max()
    assert {s.versions for s in samples} == {(5, 5)}
    samples, served, trained = served_and_trained(publisher, server, b, tok, 6)
    publisher.close()
    assert torch.allclose(served, trained, atol=1e-4), (served - trained).abs().max()
    assert {s.versions for s in samples} == {(6, 6)}
    assert how == "disk" or not (tmp_path / "model.safetensors").exists()  # the weights went over the group
    pairs = [(p, s.completion_ids) for p, s in zip([q for q in prompts_of(tok) for _ in range(4)], samples)]
    with torch.no_grad():
        old = kernels.completion_logprobs(a, pairs, tok.pad_token_id, 1.0)
    assert (old - served).abs().max() > 1e-2  # the two policies differ where the server was scored


def test_one_broadcast_reaches_every_server(vllm_servers, tmp_path, monkeypatch):
    """nccl with two servers: one group of world size 3 (the trainer's rank 0, each server's worker at its own rank
    offset, from GET /get_world_size) and one broadcast per publish reach both; after each of two publishes every
    server serves the trainer's log-probs of the published weights (a tied model's: the untied server takes its
    head as lm_head.weight)."""
    from conftest import cpu_data_plane
    from vllm.distributed.weight_transfer import nccl_engine

    plane, groups, broadcasts = cpu_data_plane(), [], []
    for name, function in plane.items():
        monkeypatch.setattr(nccl_engine, name, function)

    def endpoint(init_info, *args, **kwargs):
        groups.append(init_info.world_size)
        return plane["open_trainer_endpoint"](init_info, *args, **kwargs)

    def producer(*args, **kwargs):
        broadcasts.append(1)
        return plane["packed_nccl_broadcast_producer"](*args, **kwargs)

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", endpoint)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", producer)
    servers, cpu = [vllm_servers["tied"], vllm_servers["untied"]], torch.device("cpu")
    publisher = ap.Publisher(servers, "nccl", tmp_path, torch.float32, tied=True, address="127.0.0.1", device=cpu)
    try:
        for version, seed in ((41, 41), (42, 42)):
            model, tok = models.build_tiny_model(seed)
            for i, server in enumerate(servers):  # one publish, then each server sampled
                samples, served, trained = served_and_trained(publisher, server, model, tok, version, publish=i == 0)
                assert torch.allclose(served, trained, atol=1e-4), (server.url, (served - trained).abs().max())
                assert {s.versions for s in samples} == {(version, version)}, server.url
    finally:
        publisher.close()
    assert groups == [3] and len(broadcasts) == 2, (groups, broadcasts)


def test_the_publish_benchmark_counts_one_bf16_broadcast_and_no_host_copy(vllm_servers, tmp_path):
    """tools/bench_publish.py's counts of one publish to two servers, through this checkout's code: the gathered
    copy in bf16 on the broadcasting device, one group of world size 3, one broadcast, no cast inside the publish."""
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_publish

    owns = not torch.distributed.is_initialized()  # FSDP2 needs a process group: one rank here
    if owns:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        counted = bench_publish.count_publish(ap, [vllm_servers["tied"], vllm_servers["untied"]], tmp_path)
    finally:
        if owns:
            torch.distributed.destroy_process_group()
    assert counted["gathered_dtype"] == "bfloat16" and counted["gathered_to"] == "the broadcasting device"
    assert counted["groups"] == [3] and counted["broadcasts"] == 1 and counted["broadcast_dtypes"] == ["bfloat16"]
    assert counted["casts"] == 0, counted


def test_a_publish_that_loads_other_weights_is_named_with_its_server_and_version(vllm_servers, tmp_path, monkeypatch):
    """The publish check: after a publish the server's log-probs of the probe (held-out prompts and gold solutions)
    match the trainer's at that version; a reload made to load other weights (another model's; the old weights
    under the new version, as a reload that silently did nothing) stops the publisher with one line naming the
    server and the version."""
    model, tok = models.build_tiny_model(21)
    other, _ = models.build_tiny_model(22)
    server = vllm_servers["tied"]
    pairs = ap.probe_pairs(tasks.make_task(rg.parse_args([])), tok)
    probe = (pairs, ap.trainer_logprobs(model, pairs, tok))
    publisher = ap.Publisher([server], "disk", tmp_path, torch.float32, True, "127.0.0.1")
    publisher.publish(model.state_dict(), 30, wait=True, check=probe)
    assert publisher.error is None and publisher.probe_diff < 1e-4, publisher.probe_diff
    print(f"right weights: mean |d log p| {publisher.probe_diff:.3g}")
    # 31: another model's weights are loaded; 32: the server keeps version 30's while the trainer has moved far on
    for version, loaded, trained in ((31, other, model), (32, model, build_shifted(model, seed=32))):
        publisher = ap.Publisher([server], "disk", tmp_path / str(version), torch.float32, True, "127.0.0.1")
        real_send = publisher.send
        monkeypatch.setattr(publisher, "send", lambda weights, v, real=real_send, w=loaded: real(w.state_dict(), v))
        probe = (pairs, ap.trainer_logprobs(trained, pairs, tok))
        publisher.publish(trained.state_dict(), version, wait=True, check=probe)
        error = str(publisher.error)
        assert f"vLLM server {server.url} serves other weights than the trainer's version {version}" in error, error
        print(error)


def build_shifted(model, seed: int):
    """`model` after much training: each weight moved at random by its tensor's standard deviation."""
    moved = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p) * p.std())
    return moved


def test_the_evaluation_on_a_server_is_the_hf_evaluation(vllm_servers, tmp_path):
    """async_pipeline.py evaluates on a server holding the published weights: its greedy completions of the held-out
    prompts are HF generate's token for token, the greedy accuracy is the same, and the record names the version;
    an answer from other weights than the version evaluated is one line naming the server."""
    model, tok = models.build_tiny_model(51)
    server = vllm_servers["tied"]
    cfg = ap.parse_args(TINY + ["--max-new-tokens", "12", "--eval-size", "16"])
    task = tasks.make_task(cfg)
    publisher = ap.Publisher([server], "disk", tmp_path, torch.float32, tied=True, address="127.0.0.1")
    publisher.publish(model.state_dict(), 51, wait=True)
    publisher.close()
    assert publisher.error is None
    eos = generation.stop_token_ids(model, tok)
    on_server, hf = ap.ServerEvaluator(server, eos, policy_version=51, seed=0), generation.HFGenerator(model, tok)
    hf.policy_version = 51
    prompts = [models.render_prompt(tok, ex.prompt) for ex in task.eval]
    greedy = [[s.completion_ids for s in g] for g in (hf.generate(prompts, 1, 12, 0.0, logprobs=False))]
    assert [[s.completion_ids for s in g] for g in on_server.generate(prompts, 1, 12, 0.0)] == greedy
    metrics, _ = evaluation.evaluate(on_server, tok, task, cfg, verifiers=rg.VERIFIERS)
    reference, _ = evaluation.evaluate(hf, tok, task, cfg, verifiers=rg.VERIFIERS)
    assert metrics["eval/policy_version"] == 51 and metrics["eval/greedy_acc"] == reference["eval/greedy_acc"]
    with pytest.raises(serving.ServerError, match=f"^vLLM server {server.url}: the evaluation of version 52 came back"):
        ap.ServerEvaluator(server, eos, policy_version=52, seed=0).generate(prompts[:2], 1, 4, 0.0)


def test_closing_the_nccl_publisher_waits_for_the_broadcast_under_way(vllm_servers, tmp_path, monkeypatch):
    """The run's end closes the publisher while its last publish may still be broadcasting: the group is shut down
    only after it (a group shut down mid-broadcast leaves the server's worker waiting in it)."""
    from conftest import cpu_data_plane
    from vllm.distributed.weight_transfer import nccl_engine

    plane = cpu_data_plane()

    def slow_producer(*args, **kwargs):  # a broadcast that takes a while
        time.sleep(2.0)
        plane["packed_nccl_broadcast_producer"](*args, **kwargs)

    for name, function in plane.items():
        monkeypatch.setattr(nccl_engine, name, function)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", slow_producer)
    model, _ = models.build_tiny_model(0)
    server, cpu = vllm_servers["tied"], torch.device("cpu")
    publisher = ap.Publisher([server], "nccl", tmp_path, torch.float32, tied=True, address="127.0.0.1", device=cpu)
    publisher.publish(model.state_dict(), 3)
    time.sleep(0.5)  # the broadcast is under way
    publisher.close()
    assert publisher.error is None and publisher.done_version == 3, publisher.error


def generated_tokens(server) -> float:
    """The server's count of generated tokens (its Prometheus /metrics)."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:generation_tokens_total"))


def test_requests_in_flight_across_a_publish_come_back_with_version_spans(vllm_servers, tmp_path):
    """A long request is paused (its tokens kept), the weights change, it resumes: its tokens carry both versions,
    and make_rollouts counts it as mixed with the oldest version as its policy_version."""
    model, tok = models.build_tiny_model(13)
    server = vllm_servers["tied"]
    publisher = ap.Publisher([server], "disk", tmp_path, torch.float32, True, "127.0.0.1")
    publisher.publish(model.state_dict(), 20, wait=True)
    body = {"token_ids": prompts_of(tok)[0], "sampling_params": {"n": 64, "max_tokens": 400, "logprobs": 0}}
    body["sampling_params"] |= {"ignore_eos": True, "seed": 1, "temperature": 1.0}
    answer, before = {}, generated_tokens(server)
    request = threading.Thread(target=lambda: answer.update(server.post("/inference/v1/generate", body)))
    request.start()
    deadline = time.time() + 120
    while generated_tokens(server) < before + 64 * 8 and time.time() < deadline:  # every sample under way
        time.sleep(0.05)
    publisher.publish({k: v * 1.01 for k, v in model.state_dict().items()}, 21, wait=True)
    request.join(120)
    spans = [[(int(s["version"]), s["start"], s["end"]) for s in c["weight_versions"]] for c in answer["choices"]]
    assert all(sp[0][1] == 0 and sp[-1][2] == 400 for sp in spans), spans[:2]  # the spans cover every token
    assert all(a[2] == b[1] and a[0] < b[0] for sp in spans for a, b in zip(sp, sp[1:])), spans[:2]  # in order
    samples = [ap.ServerGenerator.sample(c) for c in answer["choices"]]
    assert {s.versions for s in samples} <= {(20, 21), (21, 21)}  # a sample not yet started ran on 21 alone
    samples = [s for s in samples if s.versions == (20, 21)]
    assert len(samples) == 64, answer["choices"][0]["weight_versions"]

    class Served:  # make_rollouts on these samples, as a generator hands them over
        policy_version = 99

        def generate(self, prompts, n, *args):
            return [samples[:n]]

    cfg = rg.parse_args(["--group-size", "4"])
    task = tasks.make_task(cfg)
    rollouts, counts = rg.make_rollouts(Served(), tok, task, task.sample(random.Random(0), 1), cfg, 0)
    assert counts["mixed_version_rollouts"] == 4 and {r.policy_version for r in rollouts} == {20}


def test_the_rollout_loop_hands_out_the_freshest_first_within_its_slots():
    """The channel (no servers: the dealer's side alone): at most `capacity` requests in flight or waiting, the
    newest finished first, and one passed over `capacity` times goes before any newer one."""
    cfg = ap.parse_args(TINY + ["--sampling", "queue", "--batch-size", "16", "--buffer-size", "16"])
    loop = ap.RolloutLoop(cfg, [], task=None, tok=None, eos_ids=[], first_group_id=0)
    assert loop.capacity == 2  # max(W, B/R) for the queue: B/R = 16/8
    assert loop.slots.acquire(timeout=0) and loop.slots.acquire(timeout=0) and not loop.slots.acquire(timeout=0)
    loop.ready = [{"id": i, "passed": 0} for i in range(2)]  # two finished, in the order they came
    assert [m["id"] for m in loop.receive(wait=0, limit=1)] == [1]  # the freshest
    assert loop.slots.acquire(timeout=0)  # its slot came back for a new request
    loop.ready.append({"id": 2, "passed": 0})
    assert [m["id"] for m in loop.receive(wait=0, limit=1)] == [2]  # 0 is passed over a second time
    assert loop.slots.acquire(timeout=0)
    loop.ready.append({"id": 3, "passed": 0})
    assert [m["id"] for m in loop.receive(wait=0, limit=1)] == [0]  # passed over `capacity` times: its turn now
    assert [m["id"] for m in loop.receive(wait=0, limit=None)] == [3] and loop.depth() == 0
    loop.ready = [{"id": 4, "passed": 0}]
    assert loop.receive(wait=0, limit=0) == [] and loop.ready[0]["passed"] == 0  # nothing taken, none passed over
    loop.errors.append(serving.ServerError("vLLM server http://x: /inference/v1/generate failed (timed out)"))
    assert loop.failure() == "vLLM server http://x: /inference/v1/generate failed (timed out)"


def test_a_server_error_is_one_line_naming_the_server(vllm_servers):
    server = vllm_servers["tied"]
    with pytest.raises(serving.ServerError) as e:
        server.post("/collective_rpc", {"method": "no_such_method"})
    assert str(e.value).startswith(f"vLLM server {server.url}: /collective_rpc answered 500") and "\n" not in str(
        e.value
    )
    with pytest.raises(serving.ServerError, match=r"^vLLM server http://127.0.0.2:1: /health failed \("):
        serving.Server("http://127.0.0.2:1").post("/health", timeout=5)


def test_more_prompt_tokens_in_flight_than_a_step_prefills_come_back_from_a_cpu_server(vllm_servers, tmp_path):
    """Ten prompts of 300 tokens, more than one step of vLLM's CPU server prefills (2,048): each is prefilled whole,
    as a seeded request cut in two stops the CPU runner ('CPU Generator does not use offset', a 500 for every one)."""
    model, tok = models.build_tiny_model(0)
    prompts = [models.render_prompt(tok, f"{i}+{i}=" * 100)[:300] for i in range(10)]
    assert sum(map(len, prompts)) == 3000
    server = vllm_servers["tied"]
    ap.Publisher([server], "disk", tmp_path, torch.float32, True, "127.0.0.1").publish(model.state_dict(), 1, wait=True)
    groups = ap.ServerGenerator(server, generation.stop_token_ids(model, tok), random.Random(0)).generate(
        prompts, 2, 4, 1.0
    )
    assert [len(g) for g in groups] == [2] * 10 and all(1 <= len(s.completion_ids) <= 4 for g in groups for s in g)


def test_a_server_that_does_not_start_is_one_line_with_its_log(tmp_path):
    """A folder that holds no model: the launched server exits; the line names it and shows its log's last lines."""
    import types

    cfg = types.SimpleNamespace(generator_host="127.0.0.2", seed=0)
    (tmp_path / "empty").mkdir()
    servers = serving.launch_servers(cfg, tmp_path / "empty", 512, [None], tmp_path / "log")
    try:
        with pytest.raises(serving.ServerError) as e:
            serving.wait_ready(servers, timeout=600)
    finally:
        serving.stop_servers(servers)
    line = str(e.value)
    assert line.startswith(f"vLLM server {servers[0].url} did not start; the server exited with code 1")
    assert f"the end of {tmp_path / 'log' / 'server0.log'}: " in line and "\n" not in line, line


def test_the_weight_transfer_is_nccl_only_where_every_server_has_its_own_gpu(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert ap.weight_transfer(ap.parse_args(TINY), cpu, 1) == "disk"
    with pytest.raises(run_folder.UserError, match="^--weight-transfer nccl needs CUDA"):
        ap.weight_transfer(ap.parse_args(TINY + ["--weight-transfer", "nccl"]), cpu, 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    five = ap.parse_args(TINY + ["--num-generators", "5"])
    assert ap.weight_transfer(five, gpu, 3) == "nccl"  # (W, T) = (5, 3) on 8 GPUs
    assert ap.weight_transfer(five, gpu, 4) == "disk"  # one server would share a trainer's GPU


def test_where_the_servers_are_does_not_change_the_warm_start():
    """The warm-start cache is keyed by what changes the warm start: which servers generate, where, and how the
    weights reach them do not, so a run on other servers reuses it."""
    base = ap.parse_args(TINY)
    elsewhere = TINY + ["--generator-urls", "http://a:1", "http://b:2", "--num-generators", "2"]
    elsewhere += ["--generator-host", "10.0.0.2", "--weight-transfer", "disk"]
    cpu = torch.device("cpu")
    assert warm_start.warm_start_key(ap.parse_args(elsewhere), cpu) == warm_start.warm_start_key(base, cpu)


def test_launched_servers_take_the_gpus_after_the_trainers(tmp_path, monkeypatch):
    """One server per GPU after the trainers' (round-robin when fewer), each seeing only its own; CPU servers run
    eager with a bounded KV cache. The launch lines only (Popen recorded): no GPU here."""
    assert serving.server_gpus(5, 3, 8) == ["3", "4", "5", "6", "7"]  # (W, T) = (5, 3) on one 8-GPU node
    assert serving.server_gpus(1, 1, 1) == ["0"]  # one GPU: shared with the trainer
    assert serving.server_gpus(2, 1, 0) == [None, None]  # CPU
    launched = []
    monkeypatch.setattr(serving.subprocess, "Popen", lambda cmd, env, **kw: launched.append((cmd, env)))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = ap.parse_args(TINY)
    serving.launch_servers(cfg, tmp_path, 512, ["2", "3", None], tmp_path)
    (gpu2, env2), (gpu3, env3), (cpu, env_cpu) = launched
    assert env2["CUDA_VISIBLE_DEVICES"] == "2" and env3["CUDA_VISIBLE_DEVICES"] == "3"
    assert '{"backend": "nccl"}' in gpu2 and "--enforce-eager" not in gpu2
    assert "--enforce-eager" in cpu and env_cpu["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert all(env["VLLM_SERVER_DEV_MODE"] == "1" for _, env in launched)
    assert {cmd[cmd.index("--host") + 1] for cmd, _ in launched} == {"127.0.0.1"}


def test_servers_launched_before_a_failed_launch_are_stopped(tmp_path, monkeypatch):
    """They run in their own sessions (Ctrl-C reaches the trainer first), so nothing else would end them."""
    real, started = subprocess.Popen, []

    def popen(*args, **kwargs):
        if started:
            raise KeyboardInterrupt  # Ctrl-C while the second server is being launched
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(serving.subprocess, "Popen", popen)
    cfg = types.SimpleNamespace(generator_host="127.0.0.2", seed=0)
    with pytest.raises(KeyboardInterrupt):
        serving.launch_servers(cfg, tmp_path, 512, [None, None], tmp_path / "logs")
    assert len(started) == 1 and started[0].poll() is not None


def test_merge_stats_weights_by_tokens():
    m = ap.merge_stats(
        [
            {"loss": 1.0, "entropy": 1.0, "ratio_max": 2.0, "nonfinite": 0, "trained_tokens": 10},
            {
                "loss": 3.0,
                "entropy": 4.0,
                "ratio_max": 1.0,
                "nonfinite": 1,
                "trained_tokens": 30,
                "logprob_mismatch_abs": 0.5,
            },
        ]
    )
    assert m == {
        "loss": 2.0,
        "entropy": 3.25,
        "ratio_max": 2.0,
        "nonfinite": 1,
        "trained_tokens": 40,
        "logprob_mismatch_abs": 0.5,
    }


def fsdp_check(agg: str) -> None:
    """Run on 2 ranks by the test below (torchrun this_file.py AGG): train_step through LogprobPolicy + fully_shard
    on B/T rollouts per rank against plain train_step on all B, in one process per rank."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = rg.parse_args(["--loss", "asymre", "--loss-agg", agg, "--micro-batch-size", "2", "--lr", "1e-2"])
    model, tok = models.build_tiny_model(0)  # tied embeddings: the head is the embedding
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (3 + i,), generator=g).tolist() for i in range(3)]  # each rank gets one twice
    batch = []
    for i in range(8):
        completion = torch.randint(0, 256, (2 + i % 3,), generator=g).tolist()
        prompt = prompts[i % 3]
        batch.append(
            rg.Rollout(
                prompt_ids=prompt,
                completion_ids=completion,
                behaviour_logprobs=torch.zeros(len(completion)),
                reward=float(i % 2),
                advantage=0.0,
                group_mean=0.5,
                policy_version=0,
                group_id=i,
            )
        )
    ref = copy.deepcopy(model)
    model_init = copy.deepcopy(model.state_dict())
    ref_stats = rg.train_step(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batch, cfg, tok.pad_token_id, 0)
    shares = []  # the ranks' micro-batches forward a shared prompt once, through FSDP2's root and blocks
    pack = kernels.pack

    def counting_pack(*args, **kwargs):
        packed = pack(*args, **kwargs)
        shares.append(packed.positions is not None)
        return packed

    kernels.pack = counting_pack
    policy = ap.LogprobPolicy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    stats = rg.train_step(policy, optimizer, batch[4 * rank : 4 * rank + 4], cfg, tok.pad_token_id, 0)
    kernels.pack = pack
    assert any(shares), shares
    grads = {n.removeprefix("policy."): p.grad.full_tensor() for n, p in policy.named_parameters()}
    losses = [None, None]
    dist.all_gather_object(losses, stats["loss"])
    weights = ap.full_weights(policy)
    published = ap.gather_weights(policy, torch.bfloat16, torch.device("cpu"))  # what a publish sends, in bf16
    if rank == 0:
        assert published.keys() == weights.keys() and all(v.dtype == torch.bfloat16 for v in published.values())
        assert all(torch.equal(published[k], v.to(torch.bfloat16)) for k, v in weights.items())
        assert published["lm_head.weight"] is published["model.embed_tokens.weight"]  # the tied head gathered once
        live = {p.to_local().data_ptr() for p in policy.parameters()}
        assert not live & {v.data_ptr() for v in published.values()}  # copies: training goes on while they go out
    assert rank == 0 or published == {}
    if rank == 0:
        worst = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        assert worst < 1e-6, worst
        assert abs(stats["grad_norm"] - ref_stats["grad_norm"]) < 1e-5 * ref_stats["grad_norm"], (stats, ref_stats)
        assert abs(sum(losses) / 2 - ref_stats["loss"]) < 1e-6, (losses, ref_stats)
        # Adam's first step is ~lr * sign(g): a gradient within rounding of 0 (|g| < 1e-6: a shared prompt's, summed
        # over its completions in another order) may flip its sign, every other weight moves as the reference's
        settled = {k: v.grad.abs() > 1e-6 for k, v in ref.state_dict(keep_vars=True).items()}
        assert max(((weights[k] - v).abs() * settled[k]).max().item() for k, v in ref.state_dict().items()) < 1e-4
        assert max((weights[k] - v).abs().max().item() for k, v in model_init.items()) > 5e-3  # it moved
        print("FSDP-OK", worst, stats["grad_norm"])
    dist.barrier()  # tear down together: a rank leaving while the other still works aborts in gloo
    dist.destroy_process_group()


@pytest.mark.parametrize("agg", ["seq-mean", "token-mean"])
def test_fsdp_step_on_two_ranks_equals_one_process_on_the_whole_batch(agg):
    """train_step through LogprobPolicy + fully_shard, B/T rollouts per rank (the ranks hold 11 and
    12 completion tokens: token-mean must normalise by the batch's, not the rank's), against plain
    train_step on all B: same gradients (the tied head/embedding included), grad norm, loss and
    updated weights."""
    cmd = [
        sys.executable,
        *("-m torch.distributed.run --standalone --nproc_per_node 2 --master-port").split(),
        str(free_port()),
        __file__,
        agg,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0 and "FSDP-OK" in res.stdout, (res.stdout + res.stderr)[-4000:]


# --- the process group and the CPU threads -----------------------------------------------------------------


def test_the_process_group_timeout_is_the_flag(tmp_path, monkeypatch, tiny):
    import datetime

    seen = {}
    real = torch.distributed.init_process_group

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", spy)
    ap.main(tiny + ["--total-steps", "1", "--dist-timeout", "7", "--out-dir", str(tmp_path), "--run-name", "t"])
    assert seen["timeout"] == datetime.timedelta(minutes=7)


@pytest.mark.parametrize("omp", [None, "2"])
def test_a_trainer_with_servers_elsewhere_takes_every_core_unless_told(tmp_path, omp, tiny):
    """With --generator-urls no server runs on the trainer's machine: it takes every core (the Ctrl-C test shows it
    sharing them with a server it launched); a user's OMP_NUM_THREADS is honoured. It says so in one line."""
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    if omp:
        env["OMP_NUM_THREADS"] = omp
    args = [*tiny, "--total-steps", "2", "--out-dir", str(tmp_path), "--run-name", "t"]
    res = subprocess.run(
        [sys.executable, str(ROOT / "async_pipeline.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    n = int(omp) if omp else ap.available_cores()
    why = f"(OMP_NUM_THREADS={omp})" if omp else f"({ap.available_cores()} cores / 1 process on this machine)"
    assert f"threads: trainer rank 0 uses {n} torch thread{'s' * (n > 1)} {why}" in res.stdout, res.stdout[-3000:]


if __name__ == "__main__":  # torchrun's workers of test_fsdp_step_on_two_ranks_equals_one_process_on_the_whole_batch
    fsdp_check(sys.argv[1])
    # Leave without the interpreter's shutdown: a gloo worker thread may still be freeing the last collective's work,
    # whose tensors need the GIL, and taking it while the interpreter goes down aborts the process (SIGABRT, exit -6)
    sys.stdout.flush()
    os._exit(0)


def test_an_async_checkpoints_config_states_the_dtype_of_its_weights(tmp_path, monkeypatch, tiny):
    """Rank 0 saves the gathered fp32 masters through its copy in the compute dtype (bf16 on GPUs, simulated
    here): config.json says float32, so from_pretrained loads what the file holds."""
    from safetensors.torch import load_file

    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    ap.main(tiny + ["--total-steps", "1", "--out-dir", str(tmp_path), "--run-name", "d"])
    ckpt = tmp_path / "d" / "checkpoint"
    assert {t.dtype for t in load_file(ckpt / "model.safetensors").values()} == {torch.float32}
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "float32"


def test_async_trains_with_activation_checkpointing_applied_before_fully_shard(tmp_path, tiny):
    """Each decoder layer checkpointed, then sharded: the FSDP2 units all-gather again for the recompute."""
    out = ap.main(tiny + ["--total-steps", "2", "--activation-checkpointing", "--out-dir", str(tmp_path)])
    recs = metrics(Path(out["run_dir"]))[1:]
    assert len(recs) == 2 and all(r["grad_norm"] > 0 and r["nonfinite"] == 0 for r in recs), recs
