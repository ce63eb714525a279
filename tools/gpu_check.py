"""gpu_check.py: verify the GPU path of replay_grpo.py on one CUDA GPU, offline, in minutes.

    python tools/gpu_check.py            # on a CUDA machine: every check, one table, exit 1 if one fails
    python tools/gpu_check.py --smoke    # on a CPU: the same checks at toy sizes (tests this script)

Needs torch, transformers, triton and the project's pure-Python dependencies; the vLLM checks run
when vLLM imports and are reported as "skipped: vLLM not installed" otherwise. vLLM on CUDA allows one
sleep-mode engine per process and never frees it, so every training that builds an engine runs as its own
`python replay_grpo.py` and the vllm-* checks in a child `gpu_check.py --only vllm`; their rows join the
one table. Verdicts: FAIL is a wrong result or a crash (exit 1); MISSED is a speed or memory target of the
kernels not reached, measured and shown, not a failure of the GPU path. --smoke on a CPU
simulates a bf16 GPU's precision policy (REPLAY_GRPO_COMPUTE_DTYPE=bfloat16) in the precision and qwen-0.5b
checks and runs the others in fp32 (a CPU without bf16 instructions multiplies bf16 ~40x slower). Checks:
  kernels    token_logprobs at N=16384, V=151936, d=896 and 3584 (bf16): triton against naive torch
             in the same run (time, extra peak memory, log-prob and gradient error, the matmul path
             taken) and the targets: <= 1.5 GiB extra at d=3584, time <= 0.9x naive at 3584, <= 0.5x
             naive at 896
  precision  at lr 1e-6 and 6e-8 (the GPU presets'), 5 AdamW steps under the run's policy: bf16
             compute, fp32 masters, >= 99% of the weights moved, update norm within 10% of fp32's
  learns     the cpu preset on the GPU (bf16 compute) gains >= 25 points of held-out greedy accuracy
  eval-rng   evaluating every step or never gives the same training records (CUDA generators and
             numpy forked; under torch's deterministic algorithms), with HF generate and, when vLLM
             imports, with the vLLM engine
  qwen-0.5b  a Qwen2 built in code at Qwen2.5-0.5B's width (hidden 896, 24 layers, 14 heads, vocab
             151936, bf16 compute) takes AsymRE replay steps with the Triton log-probs: step time,
             peak memory, sampler/trainer mismatch, gradient norm > 0, weights moved, no NaN
  memory plan  that run's train steps' measured peak (generator apart) within the plan's estimate
  shared-prompts  a micro-batch of G = 16 rollouts of one 512-token prompt (64-token completions) through a Qwen2
             of Qwen2.5-0.5B's width (4 layers, bf16 compute): the prompt forwarded once against every rollout's,
             log-prob and gradient agreement, forward + backward seconds and peak memory of each
  async      async_pipeline.py --sampling queue, T = 1, W = 1 vLLM server on the one GPU (each publish
             awaited): a clean start, increasing policy versions, a clean exit with no process left
  vllm-*     (vLLM) the training configuration (tied Qwen2, bf16 engine, sleep level 2): after a
             publish the engine's greedy output equals HF's; engine vs trainer log-probs below the
             warning threshold; memory released while asleep and taken back on wake
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what torch's deterministic algorithms ask of cuBLAS
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

import torch
from bench_kernels import measure, targets_met, time_target

import kernels
import replay_grpo as rg
from infra import device_memory, generation, loading, models, reporting, run_folder, tasks

ROWS = []  # (check, measured, target, verdict)
MISSED = "missed"  # a row's `ok` when only a speed or memory target was not reached
SIMULATE_BF16 = False  # --smoke on a CPU: the precision and qwen-0.5b checks under a bf16 GPU's precision policy


def row(check: str, measured: str, target: str, ok: bool | str | None) -> None:
    verdict = "MISSED" if ok == MISSED else "PASS" if ok else "FAIL" if ok is not None else "skipped"
    ROWS.append((check, measured, target, verdict))
    print(f"  {check}: {measured} ({target}) -> {verdict}", flush=True)


def without_vllm(check: str) -> bool:
    """True, with a skipped row for `check`, where vLLM does not import (the checks that need an engine or a server)."""
    try:
        generation.import_vllm()
    except generation.VLLMUnavailable as e:
        row(check, f"skipped: vLLM not installed or unusable here ({str(e).splitlines()[0][:80]})", "", None)
        return True
    return False


def kernel_verdict(met: dict[str, bool]) -> bool | str:
    """False when a result is wrong (log-probs, gradients); MISSED when only a time or memory target is not met."""
    if not (met["logp"] and met["grad"]):
        return False
    return True if all(met.values()) else MISSED


def check_kernels(dev: str, smoke: bool) -> None:
    cuda = dev == "cuda"
    N, V, ds = (256, 1031, (64, 128)) if smoke else (16384, 151936, (896, 3584))
    backends = ["triton"] if cuda and kernels.HAS_TRITON else ["eager"]
    for d, big in zip(ds, (False, True)):  # the targets of the larger width are those of d = 3584
        m = measure(N, V, d, backends=["naive"] + backends, reps=2 if smoke else 5, dev=dev)
        naive_ms = m["results"]["naive"][0] if m["results"]["naive"] else None
        path, slow = kernels.matmul_path(dev, torch.bfloat16)  # which GEMMs the bf16 tiles ran on
        for be in backends:
            if m["results"][be] is None:
                row(f"kernels {be} d={d}", "out of memory", "runs", False)
                continue
            ms, extra, lp_err, g_err = m["results"][be]
            met = targets_met(
                backend=be,
                d=3584 if big else 896,
                ms=ms,
                naive_ms=naive_ms,
                extra_gib=extra,
                logp_err=lp_err,
                grad_err=g_err,
                floor_err=m["floor_err"],
                cuda=cuda,
            )
            speed = f"{ms / naive_ms:.2f}x naive" if naive_ms else "naive out of memory"
            row(
                f"kernels {be} d={d}",
                f"{ms:.1f} ms = {speed}, +{extra:.2f} GiB, logp err {lp_err:.1e}, "
                f"grad err {g_err:.1e}; matmuls: {path}" + (" (SLOW PATH)" if slow else ""),
                f"<= {time_target(3584 if big else 896)}x naive"
                + (", <= 1.5 GiB" if big else "")
                + f", logp <= 1e-5, grad <= {m['floor_err'] + 1e-3:.1e}",
                kernel_verdict(met),
            )


def training_records(run_dir: Path) -> list[dict]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [
        {k: v for k, v in r.items() if not (k.startswith("eval/") or reporting.measured_on_this_machine(k))}
        for r in records
    ]


@contextlib.contextmanager
def deterministic_algorithms():
    """Two GPU trainings of one seed differ in the last digits without torch's deterministic algorithms (measured on
    an H200: from step 2, cuDNN attention's backward), so the checks that compare two trainings run under them."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


DETERMINISTIC_MAIN = (  # `python -c` this: a training in a process of its own, under deterministic algorithms
    "import sys, torch, replay_grpo; torch.use_deterministic_algorithms(True, warn_only=True); "
    "replay_grpo.main(sys.argv[1:])"
)


def check_trainer(out: Path, smoke: bool, dev: str = "cpu") -> None:
    # the cpu preset, on whatever device the run picks (the GPU here)
    args = ["--preset", "cpu", "--out-dir", str(out), "--run-name", "learns"]
    if smoke:
        args += ["--sft-warmup-steps", "100", "--sft-target", "0", "--total-steps", "4", "--eval-size", "20"]
    t0 = time.time()
    rg.main(args)
    records = map(json.loads, (out / "learns" / "metrics.jsonl").read_text().splitlines())
    recs = [r for r in records if "eval/greedy_acc" in r]
    gain = recs[-1]["eval/greedy_acc"] - recs[0]["eval/greedy_acc"]
    row(
        "learns: cpu preset",
        f"greedy {recs[0]['eval/greedy_acc']:.3f} -> {recs[-1]['eval/greedy_acc']:.3f} in {time.time() - t0:.0f} s",
        ">= +0.25",
        None if smoke else gain >= 0.25,
    )

    # evaluation runs on forked generators (CPU and CUDA): it never changes training
    common = [
        *(
            "--preset cpu --sft-warmup-steps 0 --total-steps 6 --prompts-per-step 2 --buffer-size 256 "
            "--loss asymre --eval-size 16 --out-dir"
        ).split(),
        str(out),
    ]
    with deterministic_algorithms():
        rg.main(common + ["--eval-every", "1", "--run-name", "often"])
        rg.main(common + ["--eval-every", "0", "--run-name", "never"])
    same = training_records(out / "often") == training_records(out / "never")
    row("eval-rng: --eval-every 1 vs 0", "training records " + ("identical" if same else "DIFFER"), "identical", same)

    # with the vLLM engine as the generator too (the GPU runner samples from numpy's stream): each training builds
    # a sleep-mode engine, so each runs in its own process
    if not without_vllm("eval-rng (vLLM)"):
        for every, name in (("1", "often-vllm"), ("0", "never-vllm")):
            argv = common + ["--generator", "vllm", "--eval-every", every, "--run-name", name]
            subprocess.run([sys.executable, "-c", DETERMINISTIC_MAIN, *argv], cwd=ROOT, check=True)
        same = training_records(out / "often-vllm") == training_records(out / "never-vllm")
        row(
            "eval-rng (vLLM): --eval-every 1 vs 0",
            "training records " + ("identical" if same else "DIFFER"),
            "identical",
            same,
        )

    # replay steps on a model at Qwen2.5-0.5B's width, Triton log-probs, bf16 compute. A random model over the
    # byte tokenizer earns reward 0 (ids past 258 decode to nothing): AsymRE's gradient is nonzero even then.
    real_build = models.build_tiny_model
    shape = dict(hidden_size=896, layers=24, vocab_size=151936)
    if smoke:
        shape = dict(hidden_size=128, layers=2, vocab_size=1024)
    models.build_tiny_model = lambda seed: real_build(seed, **shape)
    try:
        with simulated_bf16():
            argv = [
                *(
                    "--preset cpu --sft-warmup-steps 0 --total-steps 6 --prompts-per-step 4 --batch-size 128 "
                    "--buffer-size 256 --max-new-tokens 64 --micro-batch-size 32 --eval-size 8 --eval-every 0 "
                    "--loss asymre --lr 1e-5 --out-dir"
                ).split(),
                str(out),
                "--run-name",
                "qwen",
            ]
            if smoke:  # a quarter of the work (bf16 on a CPU)
                argv += "--batch-size 32 --buffer-size 64 --max-new-tokens 16 --micro-batch-size 16".split()
            rg.main(argv)
            start = real_build(0, **shape)[0].state_dict()
            c = kernels.compute_dtype(torch.device(dev)).itemsize
    finally:
        models.build_tiny_model = real_build
    from safetensors.torch import load_file

    final = load_file(out / "qwen" / "checkpoint" / "model.safetensors")
    moved = sum(int((final[k] != start[k]).sum()) for k in final) / sum(v.numel() for v in final.values())
    recs = [r for r in map(json.loads, (out / "qwen" / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    finite = all(r["nonfinite"] == 0 for r in recs)
    grad = min(r["grad_norm"] for r in recs)
    mismatch = max(r.get("logprob_mismatch_abs", 0.0) for r in recs)
    step_ms = 1e3 * statistics.median(r["train_seconds"] for r in recs[1:])
    peak = max(r["peak_memory_gib"] or float("nan") for r in recs)
    row(
        f"qwen-0.5b: {shape['hidden_size']}x{shape['layers']}, vocab {shape['vocab_size']}",
        f"train step {step_ms:.0f} ms ({recs[-1]['trained_tokens']} tokens), peak {peak:.1f} GiB, mismatch "
        f"{mismatch:.1e}, min grad norm {grad:.2e}, {100 * moved:.1f}% of weights moved, "
        f"{'no' if finite else 'some'} NaN/inf steps",
        f"mismatch < {reporting.MISMATCH_WARN}, grad norm > 0, weights moved, no NaN",
        finite and mismatch < reporting.MISMATCH_WARN and grad > 0 and moved > 0.5,
    )
    # the memory plan of that run (what it printed before its first step) against its steps' own measured peaks
    cfg = rg.parse_args(argv)
    model, tok = real_build(0, **shape)
    task = tasks.make_task(cfg)
    longest = max(len(models.render_prompt(tok, ex.prompt, task.shots)) for ex in task.eval)
    plan = device_memory.plan_memory(model, cfg, longest, device_total=2**40, compute_bytes=c)
    rows = plan["rows"]  # the generator's share is apart, and the reserve is what the allocator does not count
    planned = (plan["train"] - rows["generator (resident)"] - rows[device_memory.RESERVE_ROW]) / 2**30
    row(
        "memory plan: qwen-0.5b's train step",
        f"measured peak {peak:.2f} GiB, planned {planned:.2f} GiB",
        "measured <= planned",
        None if peak != peak else peak <= planned,
    )


def compute_dtype_forced(name: str):
    """Run a block with the compute dtype `name` (the hook replay_grpo reads), then restore it."""
    return run_folder.environ({kernels.COMPUTE_DTYPE_ENV: name})


def simulated_bf16():
    """--smoke on a CPU: a bf16 GPU's precision policy; elsewhere the device's own."""
    return compute_dtype_forced("bfloat16") if SIMULATE_BF16 else contextlib.nullcontext()


def check_precision(dev: str, smoke: bool) -> None:
    """At the GPU presets' learning rates, a few optimizer steps under the run's precision policy move the weights
    as fp32 masters do (bf16 weights would lose nearly every update)."""
    import copy

    device = torch.device(dev)
    batch = [
        rg.Rollout(
            [1 + i, 2, 3],
            [40 + i, 50, 60 + i % 3],
            torch.zeros(3),
            reward=float(i % 2),
            advantage=0.0,
            group_mean=0.5,
            policy_version=0,
            group_id=i,
        )
        for i in range(16)
    ]
    for lr in (1e-6, 6e-8):
        cfg = rg.parse_args(["--sft-warmup-steps", "0", "--loss", "asymre", "--lr", str(lr), "--micro-batch-size", "8"])
        with simulated_bf16():
            model, tok, _, _ = loading.load_policy(cfg, device, tasks.make_task(cfg), verifiers=rg.VERIFIERS)
            compute = generation.HFGenerator(model, tok).model.dtype  # what the generators and the autocast forward use
        start = copy.deepcopy(model.state_dict())
        moved = {}
        for name, policy in (("policy", simulated_bf16()), ("fp32", compute_dtype_forced("float32"))):
            m = copy.deepcopy(model)
            with policy:
                opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
                for step in range(5):
                    rg.train_step(m, opt, batch, cfg, tok.pad_token_id, version=step)
            after = m.state_dict()
            changed = sum(int((after[k] != v).sum()) for k, v in start.items())
            norm = sum(float((after[k].double() - v.double()).pow(2).sum()) for k, v in start.items()) ** 0.5
            moved[name] = (changed / sum(v.numel() for v in start.values()), norm)
        masters = {p.dtype for p in model.parameters()}
        ratio = moved["policy"][1] / moved["fp32"][1]
        ok = (
            compute == torch.bfloat16
            and masters == {torch.float32}
            and moved["policy"][0] >= 0.99
            and 0.9 <= ratio <= 1.1
        )
        row(
            f"precision lr={lr:g}",
            f"compute {str(compute)[6:]}, masters {'/'.join(str(d)[6:] for d in masters)}, "
            f"{100 * moved['policy'][0]:.1f}% of weights moved (fp32: {100 * moved['fp32'][0]:.1f}%), update norm "
            f"{ratio:.2f}x fp32's",
            "bf16 compute, fp32 masters, >= 99% moved, norm within 10%",
            ok,
        )


def async_run(out: Path, name: str, extra: tuple = ()) -> tuple[int, list[dict], list[str], str]:
    """A 12-step async_pipeline.py run of the cpu preset's task with one server: its exit code, its step records, the
    processes left in its session, its log."""
    cmd = [
        sys.executable,
        str(ROOT / "async_pipeline.py"),
        *(
            "--preset cpu --num-generators 1 --sft-warmup-steps 0 --total-steps 12 "
            "--eval-size 8 --eval-every 6 --loss asymre --prompts-per-step 2 --batch-size 32 "
            "--buffer-size 64 --sampling queue --out-dir"
        ).split(),
        str(out),
        "--run-name",
        name,
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log = proc.communicate()[0]

    def in_session():  # live processes still in the run's session, from /proc (a zombie waiting to be reaped is gone)
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            except (OSError, IndexError):  # gone meanwhile
                continue
            if fields[3] == str(proc.pid) and fields[0] != "Z":
                left.append(stat.parent.name)
        return left

    deadline = time.time() + 15
    while in_session() and time.time() < deadline:
        time.sleep(0.5)
    path = out / name / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc.returncode, records, in_session(), log


def check_async(out: Path, smoke: bool) -> None:
    """One GPU: the trainer and its server share it (disk publishes), the evaluations on the server; two or more:
    the server on a GPU of its own, publishes by NCCL broadcast, each checked against the trainer's log-probs."""
    if without_vllm("async"):  # async_pipeline.py launches `vllm serve` processes
        return
    code, records, left, log = async_run(out, "async")
    recs = [r for r in records if r["step"] > 0]
    newest = [max(r["fresh_versions"]) for r in recs if r.get("fresh_versions")]
    evaluated = [(r["step"], r.get("eval/policy_version")) for r in records if "eval/greedy_acc" in r]
    ok = code == 0 and len(recs) == 12 and newest == sorted(newest) and newest[-1] > 0 and not left
    ok = ok and [s for s, _ in evaluated] == [0, 6, 12] and all(s == v for s, v in evaluated)
    row(
        "async: T=1, W=1, one GPU",
        f"exit {code}, {len(recs)} steps, newest versions {newest[:3]}..{newest[-1:]}, evaluated (step, version) "
        f"{evaluated}, {len(left)} processes left",
        "exit 0, 12 steps, versions rise, evaluations on the server at their steps, none left",
        ok,
    )
    if not ok:
        print(log[-3000:])
    if torch.cuda.device_count() < 2:
        row("async nccl: T=1, W=1, two GPUs", f"skipped: {torch.cuda.device_count()} GPU(s)", "", None)
        return
    code, records, left, log = async_run(out, "async-nccl", extra=("--weight-transfer", "nccl", "--publish-check", "1"))
    diffs = [r["publish_probe_diff"] for r in records if r.get("publish_probe_diff") is not None]
    ok = code == 0 and sum(r["step"] > 0 for r in records) == 12 and "weights by nccl" in log and not left
    ok = ok and bool(diffs) and max(diffs) < 0.05
    row(
        "async nccl: T=1, W=1, two GPUs",
        f"exit {code}, {len(records) - 1} steps, served vs trained log-probs after publishes: max mean |d| "
        f"{max(diffs, default=float('nan')):.3g}, {len(left)} processes left",
        "exit 0, 12 steps, < 0.05, none left",
        ok,
    )
    if not ok:
        print(log[-3000:])


def check_vllm(out: Path, smoke: bool) -> None:
    if without_vllm("vllm"):
        return
    # the training configuration: a tied Qwen2 built in code, fp32 masters, the engine in the compute dtype (bf16
    # on GPUs), sleep level 2 (what a colocated engine published every step uses)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = models.build_tiny_model(0)
    model = model.to(device)
    folder = models.export_plain_folder(model, tok, str(out / "vllm_model"))
    dtype = str(kernels.compute_dtype(device)).removeprefix("torch.")
    gen = rg.VLLMGenerator(
        model=model,
        tok=tok,
        model_dir=folder,
        dtype=dtype,
        seed=0,
        max_model_len=256,
        gpu_memory_utilization=0.3,
        sleep_level=2,
        cpu_threads=1,
    )
    prompts = [models.render_prompt(tok, f"{a}+{b}=") for a, b in [(1, 2), (12, 7), (30, 4), (44, 44)]]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seqs = []
    for p in prompts:  # the right answer to each
        answer = str(sum(map(int, tok.decode(p)[:-1].split("+"))))
        seqs.append((p, tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    for _ in range(30):  # move the weights so that a missed sync would show
        loss = -kernels.completion_logprobs(model, seqs, tok.pad_token_id, 1.0).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def free():
        return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else float("nan")

    awake = free()
    gen.sleep()
    asleep = free()
    gen.load_weights(model.state_dict(), 1)
    woken = free()
    hf = [g[0].completion_ids for g in generation.HFGenerator(model, tok).generate(prompts, 1, 8, 0.0, logprobs=False)]
    eng = [g[0].completion_ids for g in gen.generate(prompts, 1, 8, 0.0, logprobs=False)]
    row("vllm-sync: greedy after a publish", "equal to HF's" if hf == eng else "DIFFERS from HF's", "equal", hf == eng)
    samples = [s for g in gen.generate(prompts, 4, 16, 1.0) for s in g]
    with torch.no_grad():
        ref = (
            kernels.completion_logprobs(
                model, [(prompts[i // 4], s.completion_ids) for i, s in enumerate(samples)], tok.pad_token_id, 1.0
            )
            .float()
            .cpu()
        )
    diff = (torch.cat([s.logprobs for s in samples]) - ref).abs().mean().item()
    row(
        "vllm-logprobs: engine vs trainer",
        f"mean |d logp| {diff:.1e}",
        f"< {reporting.MISMATCH_WARN}",
        diff < reporting.MISMATCH_WARN,
    )
    released, regained = asleep - awake, asleep - woken
    row(
        f"vllm-sleep (level {gen.sleep_level}, {dtype}): memory released / regained",
        f"free GiB awake {awake:.2f}, asleep {asleep:.2f}, woken {woken:.2f}",
        "asleep frees > 1 GiB, waking takes it back (within 1 GiB)",
        None if smoke or not torch.cuda.is_available() else released > 1.0 and abs(regained - released) < 1.0,
    )


def check_shared_prompts(dev: str, smoke: bool) -> None:
    """--share-prompts against --no-share-prompts on one micro-batch of a group: agreement, time and peak memory."""
    width = dict(hidden_size=128, layers=2) if smoke else dict(hidden_size=896, layers=4, vocab_size=151936)
    prompt_len, completion_len, G = (48, 8, 4) if smoke else (512, 64, 16)
    model, tok = models.build_tiny_model(0, **width)
    model = model.to(dev).train()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (prompt_len,), generator=g).tolist()
    seqs = [(prompt, torch.randint(3, 256, (completion_len,), generator=g).tolist()) for _ in range(G)]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = {}
    for share in (False, True, False, True):  # each twice, interleaved: the second of each is timed
        model.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        logp = kernels.completion_logprobs(model, seqs, tok.pad_token_id, 1.0, share_prompts=share)
        logp.mean().backward()
        sync()
        seconds = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        out[share] = (logp.detach().float(), grads, seconds, peak)
    (lp_a, g_a, s_a, m_a), (lp_b, g_b, s_b, m_b) = out[False], out[True]
    lp_diff = (lp_a - lp_b).abs().mean().item()
    cosine = torch.nn.functional.cosine_similarity(g_a, g_b, dim=0).item()
    row(
        "shared-prompts: agreement",
        f"mean |d logp| {lp_diff:.1e}, gradient cosine {cosine:.6f} ({kernels.compute_dtype(torch.device(dev))})",
        f"< {reporting.MISMATCH_WARN}, > 0.999",
        lp_diff < reporting.MISMATCH_WARN and cosine > 0.999,
    )
    row(
        "shared-prompts: forward + backward",
        f"{s_a * 1e3:.1f} -> {s_b * 1e3:.1f} ms ({s_a / s_b:.2f}x), peak {m_a:.2f} -> {m_b:.2f} GiB",
        "faster, less memory",
        None if smoke or dev != "cuda" else (True if s_b < s_a and m_b < m_a else MISSED),
    )


CHECKS = {  # name -> (check, whether it runs in a child process: it builds a vLLM engine in its own)
    "kernels": (check_kernels, False),
    "shared-prompts": (check_shared_prompts, False),
    "precision": (check_precision, False),
    "trainer": (check_trainer, False),
    "async": (check_async, False),
    "vllm": (check_vllm, True),
}


def run_check(name: str, dev: str, tmp: str, smoke: bool) -> None:
    """One check into ROWS; a crash is a FAIL row and the others still run. A check of its own process runs as
    `gpu_check.py --only NAME`, which writes its rows to a file read back here."""
    check, own_process = CHECKS[name]
    sub = Path(tmp) / name
    sub.mkdir()
    if own_process:
        rows = sub / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--only", name, "--rows", str(rows)]
        code = subprocess.run(cmd + ["--smoke"] * smoke, cwd=ROOT).returncode
        ROWS.extend(tuple(r) for r in (json.loads(rows.read_text()) if rows.exists() else []))
        if not rows.exists():
            row(name, f"crashed: its process exited with {code}", "runs", False)
        return
    try:
        if name == "trainer":
            check(sub, smoke, dev)
        else:
            check(dev if name in ("kernels", "precision", "shared-prompts") else sub, smoke)
    except (Exception, SystemExit) as e:  # a failed check is a row, the others still run
        traceback.print_exc()
        first_line = str(e).splitlines()[0][:100] if str(e) else ""
        row(name, f"crashed: {type(e).__name__}: {first_line}", "runs", False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="toy sizes on any device (checks this script, measures nothing)"
    )
    ap.add_argument("--only", choices=list(CHECKS), help="run this check alone (in this process)")
    ap.add_argument("--rows", help="with --only: write its rows to this JSON file instead of printing a table")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print(
            f"skipped: no CUDA device here (torch {torch.__version__}, cuda {torch.version.cuda}); gpu_check.py "
            "measures the GPU path and needs one (--smoke runs its checks at toy sizes on this device)"
        )
        return 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    global SIMULATE_BF16
    SIMULATE_BF16 = args.smoke and dev == "cpu"  # a bf16 GPU's precision policy, simulated: bf16 compute, fp32 masters
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = "missing"
    import transformers

    if args.only:
        with tempfile.TemporaryDirectory(prefix=f"gpu_check_{args.only}_") as tmp:
            CHECKS[args.only] = (CHECKS[args.only][0], False)
            run_check(args.only, dev, tmp, args.smoke)
        if args.rows:
            Path(args.rows).write_text(json.dumps(ROWS))
        return 0
    print(
        f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, triton {tv}; {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name in CHECKS:
            t0 = time.time()
            run_check(name, dev, tmp, args.smoke)
            print(f"gpu_check: {name} took {time.time() - t0:.0f} s", flush=True)
    width = max(len(r[0]) for r in ROWS)
    print(f"\n{'check':{width}}  verdict  measured  [target]")
    for check, measured, target, verdict in ROWS:
        print(f"{check:{width}}  {verdict:7}  {measured}" + (f"  [{target}]" if target else ""))
    failed, missed = ([r for r in ROWS if r[3] == v] for v in ("FAIL", "MISSED"))
    print(f"{len(ROWS)} checks in {time.time() - t_start:.0f} s: {len(missed)} targets missed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
