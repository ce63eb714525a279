"""--mode async through the real CLI: torchrun with 2 FSDP2 trainer ranks + 1 generator process,
resume, a generator killed mid-run, and one process (T = 1) stopped by Ctrl-C. CPU, offline."""

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

PATH = str(ROOT)
sys.path[:0] = PATH.split(os.pathsep)
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=PATH)

import async_pipeline as ap  # noqa: E402
import replay_grpo as rg  # noqa: E402
import warm_start  # noqa: E402

TINY = (
    "--preset cpu --sft-warmup-steps 0 --group-size 4 --prompts-per-step 2 --batch-size 8 "
    "--buffer-size 16 --max-new-tokens 4 --eval-size 8 --pass-k 2 --eval-every 0 --mode async "
    "--num-generators 1 --loss asymre --lr 1e-3"
).split()  # asymre: nonzero gradients at reward 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        str(ROOT / "replay_grpo.py"),
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
    """A CLI run in its own session; remembers every process it ever had below it."""

    def __init__(self, cmd: list[str], preexec_fn=None):
        self.t0, self.seen = time.time(), set()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            preexec_fn=preexec_fn,
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

    def generators(self) -> list[int]:
        return [p for p in descendants(self.proc.pid) if "spawn_main" in cmdline(p)]

    def finish(self, timeout: float) -> tuple[int, str]:
        self.poll_until(lambda: self.proc.poll() is not None, timeout)
        if self.proc.poll() is None:  # a hang: clean up for the next test, then fail
            os.killpg(self.proc.pid, signal.SIGKILL)
            out = self.proc.communicate()[0].decode()
            pytest.fail(f"run did not end within {timeout}s:\n{out[-3000:]}")
        out = self.proc.communicate()[0].decode()
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
def two_rank_run(tmp_path_factory):
    """T = 2 trainer ranks (torchrun, FSDP2), W = 1 generator, 6 steps, publish every step."""
    out = tmp_path_factory.mktemp("async")
    run = Run(torchrun(2, "--total-steps", "6", "--sample-every", "3", "--out-dir", str(out), "--run-name", "t2"))
    rc, log = run.finish(timeout=240)
    assert rc == 0, log[-4000:]
    assert len(run.seen) >= 4, run.seen  # 2 ranks + a generator at least (+ mp's resource tracker)
    return out / "t2", log


def test_two_ranks_write_rank_0s_trained_samples_every_sample_every_steps(two_rank_run):
    run_dir, _ = two_rank_run
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["source"] == "train"]
    assert sorted({r["step"] for r in train}) == [3, 6] and len(train) == 2 * rg.SAMPLES
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
        assert 0 <= r["queue_depth"] <= 4  # the channel is bounded
    # rollouts made after weight publishes carry the newer version, never a future one
    newest = [max(r["fresh_versions"]) for r in steps if r["fresh_versions"]]
    assert newest == sorted(newest) and newest[-1] >= 2, newest
    assert all(max(r["fresh_versions"], default=0) < r["step"] for r in steps)
    # trained samples are stale: generation runs ahead of the trainers
    assert any(int(s) > 0 for r in steps for s in r["staleness_hist"])
    last = steps[-1]
    throughput = (last["trained_rollouts"] / 2) / (last["generated_rollouts"] / 1)  # the paper's App. D.4 mu
    assert last["mu_throughput"] == pytest.approx(throughput)
    assert last["gamma"] == pytest.approx((1 + 1 / 2) / (1 + throughput))
    assert math_finite(last["mu"]) and last["mu"] > 0  # busy seconds per rollout, generators / trainers, as in sync
    assert last["replay_hist"] and last["trainer_idle_seconds"] >= 0 and last["gen_busy_seconds"] > 0
    assert "eval/pass@1" in last and "measured mu" in log
    # each rank's shard is in its own file, both full, with rollouts of several versions
    ckpt = run_dir / "checkpoint"
    shards = [torch.load(ckpt / f"buffer_rank{i}.pt", weights_only=False)["buffer"]["items"] for i in (0, 1)]
    assert [len(s) for s in shards] == [8, 8]
    assert 2 <= max(r["policy_version"] for s in shards for r in s) < 6
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["step"] == 6 and state["trainers"] == 2 and state["mode"] == "async"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt)  # loadable by transformers (and vLLM)


def test_resume_then_a_killed_generator_stops_every_rank(two_rank_run):
    """Resume the 6-step run on 2 ranks (model, full optimizer state, per-rank buffer shards and
    counters come back) with W = 2, then SIGKILL one generator: a clear error naming it, non-zero
    exit, no hang, and the surviving generator is shut down too."""
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
    assert run.poll_until(lambda: len(metrics(run_dir)) >= 9 and len(run.generators()) == 2, 180), run.proc.poll()
    victim = min(run.generators())
    os.kill(victim, signal.SIGKILL)
    t_kill = time.time()
    rc, log = run.finish(timeout=60)
    assert rc != 0
    assert time.time() - t_kill < 30, "the dead generator was noticed late"
    assert f"(pid {victim}) died (killed by SIGKILL)" in log and "error: generator " in log, log[-3000:]
    assert "rank 1 stopped by rank 0: generator " in log, log[-3000:]
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


def test_an_async_run_logged_to_a_file_has_no_progress_bar(tmp_path):
    """The generator processes load the warm-started weights too: no transformers bar from them either."""
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        res = subprocess.run(
            [
                sys.executable,
                str(ROOT / "replay_grpo.py"),
                *TINY,
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
    """T = 1 as plain `python replay_grpo.py`; Ctrl-C (SIGINT to the process group) ends it cleanly,
    even when it was started with SIGINT ignored, as a background job of a script starts it."""
    run = Run(
        [
            sys.executable,
            str(ROOT / "replay_grpo.py"),
            *TINY,
            "--total-steps",
            "100000",
            "--out-dir",
            str(tmp_path),
            "--run-name",
            "t1",
        ],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert run.poll_until(
        lambda: (
            (tmp_path / "t1" / "metrics.jsonl").exists() and len(metrics(tmp_path / "t1")) >= 3 and run.generators()
        ),
        180,
    ), run.proc.poll()
    os.killpg(run.proc.pid, signal.SIGINT)
    rc, log = run.finish(timeout=60)
    assert rc == 130 and "interrupted" in log, log[-3000:]
    recs = metrics(tmp_path / "t1")
    assert recs[1]["num_trainers"] == 1 and all(math_finite(r["loss"]) for r in recs[1:])


def test_weight_mailbox_hands_over_the_latest_weights_once():
    import multiprocessing as mp

    model, tok = warm_start.build_tiny_model(0)
    gen = rg.HFGenerator(model, tok)
    box = ap.WeightMailbox(mp.get_context("spawn"), model.state_dict(), 0)
    new = {k: v + 1 for k, v in model.state_dict().items()}
    box.publish({k: v - 1 for k, v in new.items()}, 2)
    box.publish(new, 3)  # a generator that missed version 2 takes 3 directly
    box.pull(gen)
    assert gen.policy_version == 3
    assert all(torch.equal(gen.model.state_dict()[k], v) for k, v in new.items())
    gen.load_weights = lambda *a: pytest.fail("reloaded unchanged weights")
    box.pull(gen)  # same version: nothing to copy


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


def _pull_twice(box, out):
    """Child process: take the published weights, then the next publish; report what it holds."""
    model, tok = warm_start.build_tiny_model(1)
    gen = rg.HFGenerator(model, tok)
    for _ in range(2):
        while box.version.value == gen.policy_version:
            time.sleep(0.01)
        box.pull(gen)
        out.put(pickle.dumps((gen.policy_version, gen.model.state_dict())))  # bytes: outlives this process


def test_weight_publish_reaches_a_generator_process():
    """The mailbox's tensors are shared memory: a publish made after the process started reaches it."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    model, _ = warm_start.build_tiny_model(0)
    first = model.state_dict()
    box, out = ap.WeightMailbox(ctx, first, 4), ctx.Queue()
    child = ctx.Process(target=_pull_twice, args=(box, out))
    child.start()
    try:
        version, held = pickle.loads(out.get(timeout=120))
        assert version == 4 and all(torch.equal(held[k], v) for k, v in first.items())
        second = {k: v * 2 + 1 for k, v in first.items()}
        box.publish(second, 7)
        version, held = pickle.loads(out.get(timeout=60))
        assert version == 7 and all(torch.equal(held[k], v) for k, v in second.items())
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def fsdp_check(agg: str) -> None:
    """Run on 2 ranks by the test below (torchrun this_file.py AGG): train_step through LogprobPolicy + fully_shard
    on B/T rollouts per rank against plain train_step on all B, in one process per rank."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = rg.parse_args(["--loss", "asymre", "--loss-agg", agg, "--micro-batch-size", "2", "--lr", "1e-2"])
    model, tok = warm_start.build_tiny_model(0)  # tied embeddings: the head is the embedding
    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(8):
        completion = torch.randint(0, 256, (2 + i % 3,), generator=g).tolist()
        prompt = torch.randint(0, 256, (3 + i % 4,), generator=g).tolist()
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
    policy = ap.LogprobPolicy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    stats = rg.train_step(policy, optimizer, batch[4 * rank : 4 * rank + 4], cfg, tok.pad_token_id, 0)
    grads = {n.removeprefix("policy."): p.grad.full_tensor() for n, p in policy.named_parameters()}
    losses = [None, None]
    dist.all_gather_object(losses, stats["loss"])
    weights = ap.full_weights(policy)
    if rank == 0:
        worst = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        assert worst < 1e-6, worst
        assert abs(stats["grad_norm"] - ref_stats["grad_norm"]) < 1e-5 * ref_stats["grad_norm"], (stats, ref_stats)
        assert abs(sum(losses) / 2 - ref_stats["loss"]) < 1e-6, (losses, ref_stats)
        # Adam's first step is ~lr * sign(g): rounding in near-zero gradients moves weights by << lr
        assert max((weights[k] - v).abs().max().item() for k, v in ref.state_dict().items()) < 1e-4
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


# --- GPU placement, timeouts and a dead reader, on CPU -------------------------------------------


def test_each_generator_gets_its_own_gpu_after_the_trainers():
    assert ap.generator_gpus(5, 3, 8) == ["3", "4", "5", "6", "7"]  # (W, T) = (5, 3) on one 8-GPU node
    assert ap.generator_gpus(1, 1, 1) == ["0"]  # one GPU: shared with the trainer
    assert ap.generator_gpus(2, 1, 0) == [None, None]  # CPU


def test_spawned_generators_see_only_their_gpu(tmp_path, monkeypatch):
    """Through the real pool: with 4 GPUs (as the parent counts them) and T = 2, the two generators start with
    CUDA_VISIBLE_DEVICES=2 and =3. This machine has no CUDA, so each then fails and reports what it saw."""
    import multiprocessing as mp

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = rg.parse_args(TINY + ["--num-generators", "2", "--out-dir", str(tmp_path)])
    model, _ = warm_start.build_tiny_model(0)
    ctx = mp.get_context("spawn")
    box = ap.WeightMailbox(ctx, model.state_dict(), 0)  # kept referenced: its lock must outlive the spawn
    pool = ap.GeneratorPool(cfg, ctx, box, 0, n_trainers=2)
    try:
        seen = {}
        for _ in range(2):
            index, gpus, tb = pool.errors.get(timeout=120)
            seen[index] = gpus
            assert "CUDA" in tb or "cuda" in tb, tb  # it failed trying to use its GPU
        assert seen == {0: "2", 1: "3"}
        assert pool.gpus == ["2", "3"]
    finally:
        pool.close()


def _hold_the_lock_and_hang(box, inside):
    """A generator stuck while copying the weights out: it dies holding the mailbox's lock."""
    box.lock.acquire()
    inside.set()
    time.sleep(3600)


def mailbox_with_a_reader(target):
    """A mailbox at version 1 and a spawned generator process running target(box, inside), once it set inside."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    model, _ = warm_start.build_tiny_model(0)
    box, inside = ap.WeightMailbox(ctx, model.state_dict(), 1), ctx.Event()
    child = ctx.Process(target=target, args=(box, inside))
    child.start()
    assert inside.wait(120), "the child never reached the mailbox"
    return model, box, child


def test_a_generator_killed_holding_the_mailbox_lock_does_not_hang_the_trainer():
    import threading

    model, box, child = mailbox_with_a_reader(_hold_the_lock_and_hang)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    result = {}

    def publish():
        result.update(ok=box.publish(model.state_dict(), 2, alive=child.is_alive))

    publisher = threading.Thread(target=publish, daemon=True)
    t0 = time.time()
    publisher.start()
    publisher.join(30)
    assert not publisher.is_alive(), "publish hung on the dead generator's lock"
    assert result["ok"] is False and time.time() - t0 < 10 and box.version.value == 1


class SlowLoader:
    """A generator whose weight load takes 5 s."""

    policy_version = -1

    def __init__(self, inside):
        self.inside = inside

    def load_weights(self, state_dict, version):
        self.inside.set()
        time.sleep(5)
        self.policy_version = version


def _pull_slowly(box, inside):
    box.pull(SlowLoader(inside))


def test_a_publish_returns_while_a_generator_is_inside_a_slow_load():
    model, box, child = mailbox_with_a_reader(_pull_slowly)
    try:
        t0 = time.perf_counter()
        assert box.publish(model.state_dict(), 2, alive=child.is_alive)
        assert time.perf_counter() - t0 < 1.0 and child.is_alive()  # the load (5 s) is still running
        assert box.version.value == 2
    finally:
        child.join(30)


def test_the_process_group_timeout_is_the_flag(tmp_path, monkeypatch):
    import datetime

    seen = {}
    real = torch.distributed.init_process_group

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", spy)
    rg.main(TINY + ["--total-steps", "1", "--dist-timeout", "7", "--out-dir", str(tmp_path), "--run-name", "t"])
    assert seen["timeout"] == datetime.timedelta(minutes=7)


# --- CPU threads: each process of the pipeline takes its share of the cores ---------------------------------


@pytest.mark.parametrize("omp", [None, "2"])
def test_async_processes_divide_the_cores_among_themselves(tmp_path, omp):
    """Without OMP_NUM_THREADS the trainer and the generator each take cores / 2 threads (two processes spinning
    on the same cores run many times slower); a user's OMP_NUM_THREADS is honoured. Each says so in one line."""
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    if omp:
        env["OMP_NUM_THREADS"] = omp
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "replay_grpo.py"),
            *TINY,
            "--total-steps",
            "2",
            "--out-dir",
            str(tmp_path),
            "--run-name",
            "t",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    share = max(1, ap.available_cores() // 2)
    why = f"(OMP_NUM_THREADS={omp})" if omp else f"({ap.available_cores()} cores / 2 processes on this machine)"
    for role in ("trainer rank 0", "generator 0"):
        n = int(omp) if omp else share
        assert f"threads: {role} uses {n} torch thread{'s' * (n > 1)} {why}" in res.stdout, res.stdout[-3000:]


if __name__ == "__main__":  # torchrun's workers of test_fsdp_step_on_two_ranks_equals_one_process_on_the_whole_batch
    fsdp_check(sys.argv[1])


def test_an_async_checkpoints_config_states_the_dtype_of_its_weights(tmp_path, monkeypatch):
    """Rank 0 saves the gathered fp32 masters through its copy in the compute dtype (bf16 on GPUs, simulated
    here): config.json says float32, so from_pretrained loads what the file holds."""
    from safetensors.torch import load_file

    import kernels

    monkeypatch.setenv(kernels.COMPUTE_DTYPE_ENV, "bfloat16")
    rg.main(TINY + ["--total-steps", "1", "--out-dir", str(tmp_path), "--run-name", "d"])
    ckpt = tmp_path / "d" / "checkpoint"
    assert {t.dtype for t in load_file(ckpt / "model.safetensors").values()} == {torch.float32}
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "float32"


def test_async_trains_with_activation_checkpointing_applied_before_fully_shard(tmp_path):
    """Each decoder layer checkpointed, then sharded: the FSDP2 units all-gather again for the recompute."""
    out = rg.main(TINY + ["--total-steps", "2", "--activation-checkpointing", "--out-dir", str(tmp_path)])
    recs = metrics(Path(out["run_dir"]))[1:]
    assert len(recs) == 2 and all(r["grad_norm"] > 0 and r["nonfinite"] == 0 for r in recs), recs
