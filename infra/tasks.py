"""tasks.py: the tasks and their data: a Task (training prompts drawn from a seeded RNG, held-out ones, the name of its
reward function), built from synthetic sums, reasoning-gym's generators, GSM8K and MATH (the hub or a local copy) or a
local JSONL file; and `score`, a reward function run under a time limit. The reward functions are the method's
(replay_grpo.VERIFIERS, by the names Task.verifier holds)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from infra import run_folder
from infra.run_folder import UserError

VERIFY_TIMEOUT = 5.0  # seconds a verifier may take on one completion (reward 0 beyond, counted)


@dataclass
class Example:
    prompt: str  # the user message (the chat template is applied later)
    answer: str  # gold final answer
    solution: str = ""  # gold completion imitated by the supervised warm start


@dataclass
class Task:
    """Training prompts (drawn one at a time by `draw`, from a seeded RNG), held-out prompts, a verifier."""

    name: str
    draw: object  # rng -> Example
    eval: list[Example]
    verifier: str  # the name of its reward function, a key of replay_grpo.VERIFIERS
    train: list[Example] | None = None  # the training rows `draw` picks from (None: drawn by a generator, arith)
    repeats: int = 0  # rows left out of `train` because their prompt is held out
    longest_prompt: int = 0  # tokens of the longest training prompt kept (fit_to_context), for the memory plan
    longest_eval_prompt: int = 0  # and of the longest held-out one
    shots: tuple = ()  # (question, reply) pairs shown as earlier chat turns before every prompt (render_prompt)
    untwinned: frozenset | None = None  # held-out prompts with no twin in `train` (twin_key), where some have one

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        return [self.draw(rng) for _ in range(n)]


def make_arith_task(cfg) -> Task:
    """Sums: '3+5+7=' -> 15 (worked as '3+5=8, 8+7=15' from 3 terms on); a problem is held out iff crc32 of its
    text is 0 mod 10, so train and eval never share one, whatever the seed."""
    import zlib

    def draw(rng: random.Random) -> tuple[str, int, str]:
        terms = [rng.randint(0, cfg.arith_max_operand) for _ in range(cfg.arith_terms)]
        for _ in terms[1:]:
            rng.choice("+")  # an operator draw per term (always +): the problem streams the recorded runs used
        text, value, steps = str(terms[0]), terms[0], []
        for t in terms[1:]:
            steps.append(f"{value}+{t}={value + t}")
            text, value = f"{text}+{t}", value + t
        worked = ", ".join(steps) if len(steps) > 1 else str(value)  # a sum of two: just the answer
        return text + "=", value, worked

    def is_eval(text: str) -> bool:
        return zlib.crc32(text.encode()) % 10 == 0

    def sampler(rng: random.Random) -> Example:
        text, value, worked = draw(rng)
        while is_eval(text):
            text, value, worked = draw(rng)
        if cfg.arith_demo_error and rng.random() < cfg.arith_demo_error:
            worked = worked[: worked.rfind(str(value))] + str(value + 1)  # a wrong demonstration
        return Example(text, str(value), worked)

    count_arith_problems(cfg, is_eval)
    eval_rng, held_out = random.Random(10_000 + cfg.seed), {}
    for _ in range(100 * cfg.eval_size):
        text, value, worked = draw(eval_rng)
        if is_eval(text):
            held_out.setdefault(text, Example(text, str(value), worked))
            if len(held_out) == cfg.eval_size:
                break
    if len(held_out) < cfg.eval_size:
        raise UserError(
            f"--eval-size {cfg.eval_size}: {100 * cfg.eval_size} draws found only {len(held_out)} "
            "distinct held-out problems: lower it, or raise --arith-max-operand / --arith-terms"
        )
    return Task("arith", sampler, list(held_out.values()), "numeric")


def count_arith_problems(cfg, is_eval) -> None:
    """Refuse an arith task with nothing to train on, or fewer held-out problems than --eval-size (counted
    exactly up to 2M distinct sums, estimated as a tenth beyond)."""
    size = (cfg.arith_max_operand + 1) ** cfg.arith_terms
    shown = size if size < 10**18 else f"about 10^{math.log10(size):.0f}"  # str() refuses over 4300 digits
    where = f"(--arith-max-operand {cfg.arith_max_operand}, --arith-terms {cfg.arith_terms}: {shown} distinct sums)"
    if size > 2_000_000:
        held = size // 10
    else:
        operands = range(cfg.arith_max_operand + 1)
        held = sum(is_eval("+".join(map(str, t)) + "=") for t in itertools.product(operands, repeat=cfg.arith_terms))
    if held == size:
        raise UserError(
            f"--arith-max-operand {cfg.arith_max_operand}: every problem is held out {where}, none is "
            "left to train on: raise it"
        )
    if cfg.eval_size > held:
        raise UserError(
            f"--eval-size {cfg.eval_size}: the task holds out only {held} problems {where}: use at most "
            f"{held}, or a larger task"
        )


MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_jsonl(path: str) -> list[dict]:
    """{"prompt": str, "answer": str or number, "solution": optional str} per line, as rows of three strings (a
    missing solution is the answer); one line names a bad line."""
    if not Path(path).is_file():
        raise UserError(f"--data-path {path}: no such file")
    out = []
    for lineno, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start})") from None
        if not line.strip():
            continue
        try:
            row = run_folder.read_json(line, f"{path}:{lineno}", parse_constant=reject_constant)
        except ValueError as e:  # bad JSON, NaN or Infinity, an integer too long to read
            raise UserError(f"{path}:{lineno}: not valid JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise UserError(
                f'{path}:{lineno}: each line needs "prompt" and "answer" keys, '
                f"got {sorted(row) if isinstance(row, dict) else type(row).__name__}"
            )
        for key, kinds in (("prompt", (str,)), ("answer", (str, int, float)), ("solution", (str,))):
            value = row.get(key, "")
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise UserError(
                    f'{path}:{lineno}: "{key}" must be {" or ".join(k.__name__ for k in kinds)}, got '
                    f"{json.dumps(value)[:40]}"
                )
            if key in row and not str(value).strip() or isinstance(value, float) and not math.isfinite(value):
                raise UserError(f'{path}:{lineno}: "{key}" is empty or not a finite number: {json.dumps(value)}')
        answer = str(row["answer"])
        out.append({"prompt": row["prompt"], "answer": answer, "solution": row.get("solution", answer)})
    if not out:
        raise UserError(f"{path}: the data set is empty")
    return out


def load_hf_rows(hub_id: str, config: str | None, split: str, local: str | None, columns: tuple[str, ...]) -> list:
    """Rows from the hub (users with a network) or a local copy (--data-path): a folder saved by
    `datasets`, a folder of <split>.jsonl / .parquet files, or one such file. Every row must hold each of
    `columns` as text."""
    import datasets  # imported only for the data-set tasks

    datasets.disable_progress_bars()  # the console shows the run, not the loader
    where = f"--data-path {local}" if local else f"hub data set {hub_id}"
    try:
        if local and (Path(local) / "dataset_dict.json").exists():
            rows = list(datasets.load_from_disk(local)[split])
        elif local and Path(local).is_file():
            builder = Path(local).suffix.lstrip(".").replace("jsonl", "json")  # datasets' json or parquet loader
            rows = list(datasets.load_dataset(builder, data_files={split: local}, split=split))
        else:
            rows = list(datasets.load_dataset(local or hub_id, None if local else config, split=split))
    except Exception as e:  # the hub, a missing file: one clear line either way
        where += "" if local else " (needs a network)"
        raise UserError(f"could not load split '{split}' from {where}: {type(e).__name__}: {e}") from None
    for i, row in enumerate(rows):
        bad = [c for c in columns if not isinstance(row.get(c), str)]
        if bad:
            raise UserError(
                f"{where}, split '{split}', row {i}: the task needs the text columns {', '.join(columns)}; "
                f"{', '.join(bad)} is missing or not text (columns: {', '.join(sorted(row))})"
            )
    return rows


def gsm8k_example(row: dict) -> Example:
    """GSM8K's answer is a rationale, then '#### <number>'."""
    rationale, _, final = row["answer"].rpartition("####")
    final = final.strip()
    solution = rationale.strip() + f"\nThe final answer is \\boxed{{{final}}}."
    return Example(prompt=row["question"] + MATH_INSTRUCTION, answer=final.replace(",", ""), solution=solution)


def math_example(row: dict) -> Example:
    """MATH's answer is its own column (MATH-500) or the solution's last \\boxed{} (MATH-lighteval)."""
    answer = row.get("answer") or last_boxed(row["solution"]) or ""
    return Example(prompt=row["problem"] + MATH_INSTRUCTION, answer=answer, solution=row["solution"])


TaskName = Literal["arith", "gsm8k", "math", "jsonl", "reasoning-gym"]  # the --task choices (replay_grpo.Args reads it)
RG_VERSION = "0.1.25"  # the reasoning-gym release pinned by the extra rg (pyproject.toml) and requirements.lock
RG_EVAL_SEED = 1_000_000_000  # reasoning-gym's held-out problems: problem i is generated from this seed + i
RG_EVAL_DRAWS = 10  # held-out problems drawn per --eval-size at most, to find that many distinct questions
RG_SHOT_SEED = 2_000_000_000  # --rg-shots' worked problems: problem i is generated from this seed + i
RG_INSTRUCTION = "\nGive your final answer, and nothing else, between <answer> and </answer> tags."


def open_rg_dataset(cfg, options: dict):
    """The reasoning-gym generator --rg-dataset with `options` (its config's fields); one line when the name or an
    option is wrong: the close names, or reasoning-gym's own message."""
    import difflib

    try:
        import reasoning_gym  # an optional dependency: imported by this task only
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise UserError(
            f"--task reasoning-gym needs the reasoning-gym package: pip install 'reasoning-gym=={RG_VERSION}' (or "
            "the extra rg: pip install '.[rg]')"
        ) from None
    if cfg.rg_dataset not in DATASETS:
        close = difflib.get_close_matches(cfg.rg_dataset, DATASETS, n=5, cutoff=0.6)
        names = f"close names: {', '.join(close)}" if close else f"none of its {len(DATASETS)} names is close"
        raise UserError(f"--rg-dataset {cfg.rg_dataset}: reasoning-gym has no such data set ({names})")
    try:
        return reasoning_gym.create_dataset(cfg.rg_dataset, **options)
    except Exception as e:  # an unknown field (TypeError), a value its config's validate() refuses (AssertionError)
        why = shown(" ".join(f"{type(e).__name__}: {e}".split()), 300)
        raise UserError(f"--rg-config {shown(cfg.rg_config)}: {cfg.rg_dataset} refuses it ({why})") from None


def shown(text: str, limit: int = 80) -> str:
    """A value as a one-line message shows it: whole up to `limit` characters, else its start and its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


RG_CONFIG_CHARS = 2**16  # --rg-config's longest text: a generator's options are a few fields (the presets': 153)


def rg_options(cfg) -> dict:
    """--rg-config as a dict of the generator's options (its seed is --seed's and the held-out split's), read by
    run_folder.read_json (at most RG_CONFIG_CHARS characters, nesting at most run_folder.JSON_DEPTH levels); its size,
    when given, a whole number of problems."""
    where = f"--rg-config {shown(cfg.rg_config)}"
    try:
        options = run_folder.read_json(cfg.rg_config, where, RG_CONFIG_CHARS, what="a value")
    except ValueError as e:  # a bound passed is a JSONBoundError: one line of its own
        raise UserError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(options, dict):
        raise UserError(f"{where}: must be a JSON object of the generator's options")
    if "seed" in options:
        raise UserError(f"{where}: the seed is --seed's (held-out problems have their own)")
    size = options.get("size", 1)
    if type(size) is not int:  # 30.5 would train on 31 problems, true on 1; below 1: the generator's own line
        raise UserError(f"{where}: its size is the number of training problems, a whole number, not {json.dumps(size)}")
    return options


def available_memory() -> int:
    """Bytes of memory this machine has free for new data (Linux's MemAvailable; else the free pages)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


RG_SIZE_PROBE = 64  # problems whose memory is measured before --rg-config's size is generated whole


def check_rg_size(cfg, options: dict) -> None:
    """Refuse an --rg-config size whose training problems, all generated at start and held in memory, would not fit
    in the memory this machine has free: the bytes a problem takes (its entry and its Example: what tracemalloc
    counts while RG_SIZE_PROBE problems are generated after as many others, so that the generator's one-time costs
    are left out) times the size, against available_memory(). Smaller sizes pass unmeasured."""
    size = options.get("size")
    if size is None or size <= 2 * RG_SIZE_PROBE:
        return
    import tracemalloc

    probe = open_rg_dataset(cfg, {**options, "seed": cfg.seed, "size": 2 * RG_SIZE_PROBE})
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    kept, counts = [], []
    for i, entry in enumerate(probe):
        if i % RG_SIZE_PROBE == 0:
            counts.append(tracemalloc.get_traced_memory()[0])
        kept.append((entry, rg_example(cfg, options, entry)))
    per_problem = max(1, (tracemalloc.get_traced_memory()[0] - counts[1]) // RG_SIZE_PROBE)
    if not tracing:
        tracemalloc.stop()
    free = available_memory()
    if size * per_problem > free:
        raise UserError(
            f"--rg-config {shown(cfg.rg_config)}: its size {size} of {cfg.rg_dataset} problems, generated at start and "
            f"held in memory at about {per_problem} bytes each ({RG_SIZE_PROBE} measured), needs "
            f"{size * per_problem / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free here: use at most "
            f"{free // per_problem}"
        )


RG_TAGS = ("(tuple)", "(items)", "(fraction)")  # gold_data's tags: a tuple, a dict as its pairs, a Fraction


def gold_data(value, dataset: str):
    """A reasoning-gym entry as JSON data that from_gold_data turns back into an equal entry of the same types (its
    scorer may compare tuples, or look up integer keys): a tuple as {"(tuple)": [...]}, a dict whose keys are not all
    text (or whose one key is a tag) as {"(items)": [[key, value], ...]}, a Fraction (gsm_symbolic's) as
    {"(fraction)": [numerator, denominator]}, numpy's scalars as Python's. Anything else is refused in one line: a
    gold is plain data, never code or a pickle."""
    from fractions import Fraction

    import numpy as np

    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return str(value)  # numpy's str_ as a str
    if isinstance(value, tuple):
        return {RG_TAGS[0]: [gold_data(v, dataset) for v in value]}
    if isinstance(value, Fraction):
        return {RG_TAGS[2]: [value.numerator, value.denominator]}
    if isinstance(value, list):
        return [gold_data(v, dataset) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in RG_TAGS):
            return {k: gold_data(v, dataset) for k, v in value.items()}
        return {RG_TAGS[1]: [[gold_data(k, dataset), gold_data(v, dataset)] for k, v in value.items()]}
    raise UserError(
        f"--rg-dataset {dataset}: a problem holds a {type(value).__name__}, which a gold (plain JSON data) cannot keep"
    )


def from_gold_data(value):
    """gold_data's inverse: tuples, dicts of any keys, lists, Fractions of two integers and JSON's scalars; nothing
    is built but those."""
    from fractions import Fraction

    if isinstance(value, list):
        return [from_gold_data(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and RG_TAGS[0] in value:
        return tuple(from_gold_data(v) for v in value[RG_TAGS[0]])
    if len(value) == 1 and RG_TAGS[1] in value:
        return dict(from_gold_data(pair) for pair in value[RG_TAGS[1]])
    if len(value) == 1 and RG_TAGS[2] in value:
        numerator, denominator = value[RG_TAGS[2]]
        if not (type(numerator) is int and type(denominator) is int):
            raise ValueError(f"a fraction of {numerator!r} and {denominator!r}, not two integers")
        return Fraction(numerator, denominator)
    return {k: from_gold_data(v) for k, v in value.items()}


def rg_example(cfg, options: dict, entry: dict) -> Example:
    """A reasoning-gym problem: its question and the answer format; the gold, a text as every task's, holds what
    its scorer needs: the data set, its options and the whole entry as plain JSON data (gold_data: its metadata's
    tuples kept as tagged lists), so that a scorer process can rebuild them without running anything."""
    entry_data = gold_data(entry, cfg.rg_dataset)
    gold = dict(answer=entry["answer"], dataset=cfg.rg_dataset, options=options, entry=entry_data)
    gold = json.dumps(gold | ({"credit": "full"} if cfg.rg_credit == "full" else {}))  # a scorer process reads it
    return Example(entry["question"] + RG_INSTRUCTION, gold, f"<answer>{entry['answer']}</answer>")


def make_rg_task(cfg) -> Task:
    """reasoning-gym: training problems from seed --seed (as many as the option size, reasoning-gym's default
    without it), held-out ones from RG_EVAL_SEED (the same for every --seed, distinct questions); a training problem
    whose question is held out is left out (counted). reasoning-gym generates problem i from seed + i, so nearby
    --seed values share most training problems (their draw order differs). Reward: the data set's score_answer."""
    options = rg_options(cfg)
    draws = RG_EVAL_DRAWS * cfg.eval_size
    held_out_set = open_rg_dataset(cfg, {**options, "seed": RG_EVAL_SEED, "size": draws})
    held_out = {}
    for i in range(draws):
        entry = held_out_set[i]
        held_out.setdefault(entry["question"], entry)
        if len(held_out) == cfg.eval_size:
            break
    if len(held_out) < cfg.eval_size:
        raise UserError(
            f"--eval-size {cfg.eval_size}: {draws} problems of {cfg.rg_dataset} hold only {len(held_out)} distinct "
            "questions: lower it, or widen the generator (--rg-config)"
        )
    training = list(open_rg_dataset(cfg, {**options, "seed": cfg.seed}))
    train = [rg_example(cfg, options, e) for e in training if e["question"] not in held_out]
    if not train:
        raise UserError(f"--rg-dataset {cfg.rg_dataset}: every training problem is held out: nothing is left to train")
    test = [rg_example(cfg, options, e) for e in held_out.values()]
    shots = {}  # distinct questions, none held out: a shot never shows a held-out answer
    if cfg.rg_shots:
        pool = open_rg_dataset(cfg, {**options, "seed": RG_SHOT_SEED, "size": RG_EVAL_DRAWS * cfg.rg_shots})
        for ex in (rg_example(cfg, options, e) for e in pool if e["question"] not in held_out):
            if len(shots) == cfg.rg_shots:
                break
            shots.setdefault(ex.prompt, ex.solution)
        if len(shots) < cfg.rg_shots:
            raise UserError(
                f"--rg-shots {cfg.rg_shots}: {len(pool)} problems of {cfg.rg_dataset} hold only {len(shots)} distinct "
                "questions that are not held out: lower it, or widen the generator (--rg-config)"
            )

    def draw(rng: random.Random) -> Example:
        return train[rng.randrange(len(train))]

    repeats = len(training) - len(train)
    trained = {twin_key(e) for e in training if e["question"] not in held_out}
    # prompts, not positions: fit_to_context may drop held-out rows, moving the ones after them
    untwinned = frozenset(ex.prompt for ex, e in zip(test, held_out.values()) if twin_key(e) not in trained)
    return Task(
        "reasoning-gym",
        draw,
        test,
        "reasoning-gym",
        train=train,
        repeats=repeats,
        shots=tuple(shots.items()),
        untwinned=untwinned if len(untwinned) < len(test) else None,
    )


def twin_key(entry: dict) -> tuple:
    """What a question shares with its twin: its numbers, in order of size, and its answer (b + a is a + b's twin;
    so are the other orders of a commutative question's numbers)."""
    return tuple(sorted(int(n) for n in re.findall(r"\d+", entry["question"]))), str(entry["answer"])


def make_task(cfg) -> Task:
    """--task: arith draws its problems from a generator, reasoning-gym from one of its generators (make_rg_task);
    the others draw data-set rows (read_jsonl, load_hf_rows)."""
    if cfg.task == "arith":
        return make_arith_task(cfg)
    if cfg.task == "reasoning-gym":
        return make_rg_task(cfg)
    repeats = 0  # training rows left out: their prompt is held out
    if cfg.task == "jsonl":
        rows = [Example(**row) for row in read_jsonl(cfg.data_path)]
        if len(rows) < 2:
            raise UserError(f"{cfg.data_path}: needs at least 2 lines to hold one out")
        order = list(range(len(rows)))
        random.Random(cfg.seed).shuffle(order)
        held = max(1, len(rows) // 10)
        if cfg.eval_size > held:
            raise UserError(
                f"--eval-size {cfg.eval_size}: {cfg.data_path} holds out only {held} of its {len(rows)} rows "
                f"(a tenth): use at most {held}, or more rows"
            )
        test = [rows[i] for i in order[: cfg.eval_size]]
        held_out = {ex.prompt for ex in test}  # a training row with a held-out prompt would train on the test
        train = [rows[i] for i in order[cfg.eval_size :] if rows[i].prompt not in held_out]
        repeats = len(rows) - cfg.eval_size - len(train)
        if not train:
            raise UserError(f"{cfg.data_path}: every training row repeats a held-out prompt: nothing is left to train")
        verifier = "math"
    elif cfg.task == "gsm8k":
        gsm8k = dict(hub_id="openai/gsm8k", config="main", local=cfg.data_path, columns=("question", "answer"))
        train = [gsm8k_example(row) for row in load_hf_rows(split="train", **gsm8k)]
        test = [gsm8k_example(row) for row in load_hf_rows(split="test", **gsm8k)]
        verifier = "numeric"
    else:  # MATH: train on MATH-lighteval, evaluate on MATH-500
        math = dict(local=cfg.data_path, columns=("problem", "solution"))
        train = [
            math_example(row) for row in load_hf_rows("DigitalLearningGmbH/MATH-lighteval", "default", "train", **math)
        ]
        test = [math_example(row) for row in load_hf_rows("HuggingFaceH4/MATH-500", None, "test", **math)]
        verifier = "math"

    def draw(rng: random.Random) -> Example:
        return train[rng.randrange(len(train))]

    if len(test) < cfg.eval_size:
        raise UserError(f"--eval-size {cfg.eval_size}: the {cfg.task} test split holds only {len(test)} prompt(s)")
    return Task(cfg.task, draw, test[: cfg.eval_size], verifier, train=train, repeats=repeats)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in text, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _timeout(signum, frame):
    raise TimeoutError


def score(verifier, completion: str, gold: str, timeout: float = VERIFY_TIMEOUT) -> tuple[float, str | None]:
    """Reward in [0, 1] ({0, 1} but for reasoning-gym's partial credit) and the failure kind ('error' / 'timeout')
    when the verifier broke. The time limit is a SIGALRM, so score in a process's main thread (a ValueError
    elsewhere; async_pipeline scores in a process)."""
    old = signal.signal(signal.SIGALRM, _timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return float(verifier(completion, gold)), None
    except TimeoutError:
        return 0.0, "timeout"
    except Exception:
        return 0.0, "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def score_texts(verifier, texts: list[str], gold: str) -> list[tuple[float, str | None]]:
    return [score(verifier, text, gold) for text in texts]
