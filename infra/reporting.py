"""reporting.py: what both loops count, write and print: the run's totals (counts, tokens, seconds, the measured
mu), the step-0 record and each step's end (an evaluation, samples, the record written), the console (Progress,
evaluation lines) and a command line's run (run_command: a UserError in one line, Ctrl-C and SIGTERM said)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

from infra import run_folder
from infra.evaluation import SAMPLES, evaluate
from infra.run_folder import UserError
from infra.tasks import Task

COUNTED = "verifier_errors verifier_timeouts zero_variance_groups nonfinite_steps generated_rollouts trained_rollouts"
COUNTED = tuple(COUNTED.split() + ["zero_signal_steps", "zero_signal_skipped_steps"])  # the counts every record carries


def new_totals(**extra) -> dict:
    """A run's totals (checkpointed): the counts of COUNTED, tokens and seconds, and `extra`."""
    seconds = {"gen_seconds": 0.0, "train_seconds": 0.0}  # async: the generators' busy seconds, summed over W
    return dict.fromkeys(COUNTED, 0) | {"generated_tokens": 0, "trained_tokens": 0} | seconds | extra


def add_counts(totals: dict, counts: dict) -> None:
    for key, value in counts.items():
        totals[key] = totals.get(key, 0) + value


def measured_mu(totals: dict, trainers: int = 1) -> float:
    """mu, the planner's input: seconds to generate one rollout / seconds to train on one, on this machine (each of
    T trainer ranks trains B/T rollouts of a step, so a step's seconds count T times)."""
    generate = totals["gen_seconds"] / totals["generated_rollouts"]
    return generate / (totals["train_seconds"] * trainers / totals["trained_rollouts"])


def count_step(totals: dict, stats: dict, batch_size: int, train_seconds: float) -> None:
    """One optimizer step into the run totals (async: the ranks' merged stats and the slowest rank's seconds)."""
    totals["trained_rollouts"] += batch_size
    totals["trained_tokens"] += stats["trained_tokens"]
    totals["train_seconds"] += train_seconds
    totals["nonfinite_steps"] += stats["nonfinite"]
    totals["zero_signal_steps"] += stats["zero_signal"]
    totals["zero_signal_skipped_steps"] += stats["zero_signal_skipped"]


def is_eval_step(cfg, step: int) -> bool:
    """A held-out evaluation and a checkpoint every --eval-every steps and after the last step."""
    return step == cfg.total_steps or bool(cfg.eval_every and step % cfg.eval_every == 0)


# Record keys measured on the clock or the device: they differ between two runs of the same seed.
def measured_on_this_machine(key: str) -> bool:
    return key.endswith(("_seconds", "_memory_gib")) or key in ("mu", "mu_throughput", "gamma")


def first_evaluation(
    generator, tok, task: Task, cfg, runlog, warm: dict | None, *, verifiers: dict, rule: dict
) -> dict:
    """Step 0's record: the held-out evaluation (scored by `verifiers`, the reward functions by name), the warm
    start's (steps, pass@k reached, target reached) and `rule`, the rules the run trains by."""
    metrics, samples = evaluate(generator, tok, task, cfg, seed=cfg.seed, verifiers=verifiers)
    warm_start = {f"warmstart_{k}": warm[k] for k in ("steps", "pass@k", "reached")} if warm is not None else {}
    if warm and warm.get("imitation"):  # --sft-imitation's last check
        warm_start["warmstart_imitation"] = warm["imitation"][-1]
    runlog.log({"step": 0, **metrics, **warm_start, "rule": rule}, samples)
    print_eval(print, 0, metrics, samples)
    return metrics


MISMATCH_WARN = 0.05  # warn when sampler and trainer log-probs differ more than this per token


def end_step(
    cfg, record: dict, batch: list, tok, task: Task, evaluator, runlog, bar, *, verifiers: dict
) -> dict | None:
    """Both loops' end of a step: a few trained rollouts every --sample-every steps; with an `evaluator` (at
    evaluation steps) the held-out evaluation (scored by `verifiers`), into the record; the record written and the
    console's progress (`bar`, a Progress) moved. Returns the evaluation (None without one)."""
    step, metrics = record["step"], None
    samples = sample_rows(tok, batch[:SAMPLES]) if cfg.sample_every and step % cfg.sample_every == 0 else []
    if evaluator is not None:
        metrics, eval_samples = evaluate(evaluator, tok, task, cfg, seed=cfg.seed + step, verifiers=verifiers)
        record.update(metrics)
        samples += eval_samples
        print_eval(bar.write, step, metrics, eval_samples)
    if record.get("logprob_mismatch_abs", 0.0) > MISMATCH_WARN:
        bar.write(
            f"warning: step {step}: sampler and trainer log-probs differ by {record['logprob_mismatch_abs']:.3g} "
            f"per token on average (> {MISMATCH_WARN}); the importance ratio is biased"
        )
    runlog.log(record, samples)
    bar.update(record)
    return metrics


def sample_rows(tok, rollouts: list) -> list[dict]:
    """Rollouts just trained on, as text, with what the loss saw of them (staleness: the step that used them,
    last_use_step, less the version that generated them)."""
    rows = []
    for r in rollouts:
        prompt, completion = (tok.decode(ids, skip_special_tokens=True) for ids in (r.prompt_ids, r.completion_ids))
        rows.append(dict(source="train", prompt=prompt, gold=r.answer, completion=completion, reward=r.reward))
        rows[-1] |= dict(advantage=r.advantage, staleness=r.last_use_step - r.policy_version, truncated=r.truncated)
    return rows


def print_eval(write, step: int, metrics: dict, samples: list[dict] = ()) -> None:
    write(
        f"step {step} eval: "
        + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    )
    for x in samples[:1]:  # one example, shortened
        write(
            f"  e.g. {x['prompt'][-60:]!r} -> {x['completion'][:100]!r} (gold {x['gold'][:20]!r}, "
            f"reward {x['reward']:g})"
        )


# Without a terminal, the longest silence between two progress lines (at a step's end); the variable: a test hook
PROGRESS_SECONDS = float(os.environ.get("REPLAY_GRPO_PROGRESS_SECONDS", 60.0))


class Progress:
    """A run's console while it trains. On a terminal, a progress bar; otherwise (a log file, a batch scheduler), a
    line at the end of a step once PROGRESS_SECONDS have passed since the last one: the step, the mean reward of the
    fresh rollouts since then and the seconds per step. Evaluations and warnings are lines either way."""

    SHOWN = {"reward": "reward", "loss": "loss", "ent": "entropy", "stale": "staleness_mean", "mu": "mu"}

    def __init__(self, step: int, total: int):
        from tqdm import tqdm

        self.bar = tqdm(initial=step, total=total, dynamic_ncols=True, disable=None)  # None: off when not a tty
        self.since, self.since_step, self.rewards = time.perf_counter(), step, []

    def write(self, line: str) -> None:
        self.bar.write(line)

    def update(self, record: dict) -> None:
        self.bar.update(1)
        postfix = {name: f"{record[key]:.2f}" for name, key in self.SHOWN.items() if record.get(key) is not None}
        self.bar.set_postfix(postfix | ({"queue": record["queue_depth"]} if "queue_depth" in record else {}))
        if record.get("reward") is not None:
            self.rewards.append(record["reward"])
        seconds = time.perf_counter() - self.since
        if self.bar.disable and seconds >= PROGRESS_SECONDS:
            reward = f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"
            steps = record["step"] - self.since_step
            print(
                f"step {record['step']}/{self.bar.total}: reward {reward} (fresh rollouts, last {steps} steps), "
                f"{seconds / steps:.2f} s/step",
                flush=True,
            )
            self.since, self.since_step, self.rewards = time.perf_counter(), record["step"], []

    def close(self) -> None:
        self.bar.close()


def terminated(signum, frame):
    """SIGTERM (kill, a scheduler, a container's stop) stops a run as Ctrl-C does: by default it would end the process
    at once, with no line saying what is kept. A second one, while the run stops, is ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_command(run: Callable[[list[str]], dict | None], argv: list[str] | None) -> dict | None:
    """`run` on the command line (default: sys.argv's): a UserError is one line and exit 2, Ctrl-C or SIGTERM says
    what is kept and exits 130; the run's folder is unlocked whatever happens. Both entries run this way."""
    argv = sys.argv[1:] if argv is None else argv
    old_sigterm = None
    if threading.current_thread() is threading.main_thread():
        # a process started from a script's background job inherits SIGINT as ignored: Python would then
        # never raise KeyboardInterrupt and Ctrl-C (SIGINT to the process group) would not stop the run
        signal.signal(signal.SIGINT, signal.default_int_handler)
        old_sigterm = signal.signal(signal.SIGTERM, terminated)
    try:
        return run(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except KeyboardInterrupt:
        print(f"interrupted: {run_folder.what_is_kept()}", file=sys.stderr)
        raise SystemExit(130)
    finally:
        run_folder.release_runs()
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
