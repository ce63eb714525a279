"""flag_checks.py: the checks of a command line's flags, before anything is loaded or written: a setting that
cannot work is refused in one line naming the flag and what would be valid (validate, with the buffer's rules and the
corrections' knobs), and so is a flag typed without the setting that reads it."""

from __future__ import annotations

import dataclasses
import math

from infra.evaluation import PASS_K_PROMPTS
from infra.models import MAX_MODEL_LEN, check_gguf, gguf_path
from infra.run_folder import UserError
from infra.tasks import check_rg_size, rg_options

MAX_PASS_K = 256  # largest --pass-k (its samples are generated at every evaluation)
MAX_EVAL_SIZE = 100_000  # largest --eval-size
MAX_ROLLOUTS = 65_536  # largest --group-size, --batch-size, --buffer-size (held in memory, G in one generation call)


def validate(cfg, argv: list[str] = ()) -> None:
    """Refuse settings that cannot work: one line naming the flag and what would be valid. `argv`: the command line,
    for the flags that one setting alone reads (OWNED_FLAGS), refused when typed without it."""

    def need(ok, message):
        if not ok:
            raise UserError(message)

    def flag(name):
        return f"--{name.replace('_', '-')} {getattr(cfg, name)}"

    for names, test, valid in (
        (
            "group_size prompts_per_step batch_size buffer_size total_steps max_new_tokens pass_k micro_batch_size "
            "publish_every eval_size arith_terms sft_patience sft_check_prompts".split(),
            lambda v: v >= 1,
            ">= 1",
        ),
        ("eval_every sft_warmup_steps arith_max_operand sample_every".split(), lambda v: v >= 0, ">= 0"),
        (("lr", "sft_lr", "m2po_tau"), lambda v: 0 < v < math.inf, "a positive number"),
        (("temperature",), lambda v: 0.01 <= v <= 100, "in [0.01, 100] (logits / T must stay finite)"),
        (("group_size", "batch_size", "buffer_size"), lambda v: v <= MAX_ROLLOUTS, f"<= {MAX_ROLLOUTS} (rollouts)"),
        (("arith_terms",), lambda v: v <= MAX_MODEL_LEN, f"<= {MAX_MODEL_LEN} (the longest context)"),
        (("clip_low", "positive_bias"), lambda v: 0 <= v < 1, "in [0, 1)"),
        (
            ("arith_demo_error", "sft_target", "sft_imitation", "vllm_gpu_memory_utilization"),
            lambda v: 0 <= v <= 1,
            "in [0, 1]",
        ),
        (("clip_high", "grad_clip", "priority_alpha"), lambda v: 0 <= v < math.inf, ">= 0"),
        (("max_uses", "max_prompt_tokens"), lambda v: v is None or v >= 1, ">= 1"),
        (("priority_tau",), lambda v: v is None or 0 < v < math.inf, "a positive number"),
        (("asymre_delta_v",), lambda v: -1 <= v <= 1, "in [-1, 1] (rewards are 0 or 1)"),
    ):
        for name in names:
            need(test(getattr(cfg, name)), f"{flag(name)}: must be {valid}")
    need(
        cfg.group_size >= 2 or cfg.loss != "grpo",
        f"--group-size {cfg.group_size}: GRPO needs at least 2 "
        "completions per prompt to form an advantage (use >= 2, the paper uses 16)",
    )
    need(
        cfg.buffer_size >= cfg.batch_size,
        f"--buffer-size {cfg.buffer_size} is smaller than --batch-size "
        f"{cfg.batch_size}: a batch is sampled without replacement from the buffer, so N must be >= B",
    )
    protected = round(cfg.positive_bias * cfg.buffer_size)
    need(
        cfg.buffer_size - protected >= 1,
        f"--positive-bias {cfg.positive_bias} with --buffer-size "
        f"{cfg.buffer_size} reserves all {protected} slots for older correct rollouts, leaving none for the "
        "freshest ones (every new incorrect rollout would be evicted on arrival): lower it or raise --buffer-size",
    )
    need(
        cfg.rollouts_per_step <= cfg.buffer_size,
        f"--prompts-per-step {cfg.prompts_per_step} x --group-size "
        f"{cfg.group_size} = {cfg.rollouts_per_step} fresh rollouts a step exceed --buffer-size {cfg.buffer_size}: "
        "the buffer would evict fresh rollouts on arrival (R must be <= N)",
    )
    need(
        cfg.pass_k <= MAX_PASS_K,
        f"--pass-k {cfg.pass_k}: at most {MAX_PASS_K} (k samples for each of "
        f"{PASS_K_PROMPTS} prompts at every evaluation)",
    )
    need(
        cfg.pass_k >= 2,
        f"--pass-k {cfg.pass_k}: k >= 2 (eval/pass@1 is the temperature-0.1 metric, and one sample at temperature 1 "
        "is eval/acc_t1 already)",
    )
    need(cfg.eval_size <= MAX_EVAL_SIZE, f"--eval-size {cfg.eval_size}: at most {MAX_EVAL_SIZE}")
    need(cfg.rg_shots >= 0, f"--rg-shots {cfg.rg_shots}: the number of worked problems shown, 0 or more")
    need(  # before any is drawn: a shot is a question and a reply, at least a token each, before every prompt
        cfg.rg_shots <= MAX_MODEL_LEN // 2,
        f"--rg-shots {cfg.rg_shots}: at most {MAX_MODEL_LEN // 2} (each shot, a question and its reply, takes at least "
        f"2 of the {MAX_MODEL_LEN} positions of the longest context a run has, before every prompt)",
    )
    need(0 <= cfg.seed < 2**32, f"--seed {cfg.seed}: must be in [0, 2^32)")
    for name in ("lr", "sft_lr"):  # Adam moves every weight by about lr a step: at lr >= 1 they are noise at once
        need(getattr(cfg, name) < 1, f"{flag(name)}: must be below 1 (Adam moves each weight by about lr a step)")
    need(cfg.task != "jsonl" or bool(cfg.data_path), "--task jsonl needs --data-path FILE.jsonl")
    need(not cfg.resume or bool(cfg.run_name), "--resume needs --run-name NAME (the run folder under --out-dir)")
    if cfg.model.lower().endswith(".gguf"):  # its header, before the run folder is made
        check_gguf(cfg.model, gguf_path(cfg.model))
    if cfg.task == "reasoning-gym":  # its options read, and its size against the memory, before the run folder
        check_rg_size(cfg, rg_options(cfg))
    typed = typed_flags(argv, type(cfg))
    for owner, used, names in OWNED_FLAGS:  # a preset's own value was not typed: only what the user typed is refused
        for name in names:
            asked = name in typed and (name not in OFF_VALUES or getattr(cfg, name) != OFF_VALUES[name])
            need(used(cfg) or not asked, f"{flag(name)}: only {owner} reads it, so it would be ignored")
    validate_rules(cfg, need)
    validate_correction(cfg, need)


# Flags that one setting alone reads (the setting, whether a run has it, the flags): typed without it, refused, even at
# the default value (the user expected it to act)
OWNED_FLAGS = (
    ("--correction tis", lambda cfg: cfg.correction == "tis", ("tis_cap",)),
    ("--correction seq-mask", lambda cfg: cfg.correction == "seq-mask", ("seq_mask",)),
    ("--correction m2po", lambda cfg: cfg.correction == "m2po", ("m2po_tau",)),
    ("--correction decoupled", lambda cfg: cfg.correction == "decoupled", ("decoupled_cap", "prox_lag")),
    ("--task arith", lambda cfg: cfg.task == "arith", ("arith_terms", "arith_max_operand", "arith_demo_error")),
    (
        "--task reasoning-gym",
        lambda cfg: cfg.task == "reasoning-gym",
        ("rg_dataset", "rg_config", "rg_shots", "rg_credit"),
    ),
    (
        "a warm start (--sft-warmup-steps > 0)",
        lambda cfg: cfg.sft_warmup_steps > 0,
        "sft_target sft_patience sft_check_prompts sft_lr sft_lr_decay sft_imitation arith_demo_error".split(),
    ),
)
# An owned flag typed at this value turns its feature off, so asks for nothing that could be ignored: accepted
OFF_VALUES = dict(sft_target=0.0, sft_imitation=0.0, arith_demo_error=0.0, sft_lr_decay=False, rg_shots=0)
OFF_VALUES |= dict(rg_credit="partial")  # the data set's own scoring


def typed_flags(argv: list[str], flags: type) -> set[str]:
    """The fields of `flags` (an entry's: replay_grpo.Args, or async_pipeline.AsyncArgs) named on a command line:
    --name value, --name=value, underscores or dashes, --no-name."""
    fields = {f.name for f in dataclasses.fields(flags)}
    typed = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if name not in fields and name.startswith("no_"):  # a boolean's negation
            name = name.removeprefix("no_")
        if name in fields:
            typed.add(name)
    return typed


def validate_correction(cfg, need) -> None:
    """Refuse a correction's knob out of range, or a correction that cannot work with the loss or the loop."""
    low, high = cfg.seq_mask
    need(0 < low < 1 < high < math.inf, f"--seq-mask {low} {high}: needs 0 < low < 1 < high (a sequence's weight)")
    # below 1 the cap would truncate an on-policy token's weight 1 too: a smaller step for every token, not a correction
    need(
        1 <= cfg.tis_cap < math.inf, f"--tis-cap {cfg.tis_cap}: must be in [1, inf) (a cap on a weight prox/behaviour)"
    )
    need(1 < cfg.decoupled_cap < math.inf, f"--decoupled-cap {cfg.decoupled_cap}: must be above 1 (a weight)")
    need(0 <= cfg.prox_lag <= 64, f"--prox-lag {cfg.prox_lag}: must be in [0, 64] (a host copy of each version)")
    if cfg.correction == "none":
        return
    need(
        cfg.ratio_level == "token", f"--correction {cfg.correction}: works on token ratios, not --ratio-level sequence"
    )
    need(
        cfg.loss == "grpo" or cfg.correction in ("tis", "seq-mask"),
        f"--correction {cfg.correction}: needs --loss grpo (it reshapes the clipped ratio; asymre has none)",
    )


def validate_rules(cfg, need) -> None:
    """Refuse buffer rules that cannot work, or flags that the chosen rule would ignore."""
    R, B, N = cfg.rollouts_per_step, cfg.batch_size, cfg.buffer_size
    need(
        cfg.max_age is None or cfg.max_age >= max(1, cfg.publish_every - 1),
        f"--max-age {cfg.max_age}: must be "
        f">= 1 and >= --publish-every - 1 = {cfg.publish_every - 1} (the age of the freshest rollouts)",
    )
    need(
        cfg.max_drift is None or 0 < cfg.max_drift < math.inf,
        f"--max-drift {cfg.max_drift}: must be above 0 (a mean squared log-ratio; 0.04 is the clip width squared)",
    )
    need(math.isfinite(cfg.lr_reuse_exponent), f"--lr-reuse-exponent {cfg.lr_reuse_exponent}: must be finite")
    reuse, beta = cfg.rollouts_per_step / cfg.batch_size, cfg.lr_reuse_exponent
    log_lr = math.log(cfg.lr) + beta * math.log(reuse)  # the trained lr, --lr x (R / B)^beta: below 1, as --lr is
    need(
        log_lr < 0,
        f"--lr-reuse-exponent {beta}: scales --lr {cfg.lr} by (R / B = {reuse:g})^{beta} to "
        f"{math.exp(log_lr) if log_lr < 700 else math.inf:g}: must stay below 1",
    )
    need(
        not cfg.skip_zero_signal or cfg.loss == "grpo",
        "--skip-zero-signal: only --loss grpo has no gradient when every advantage is 0 (asymre's baseline has one)",
    )
    prioritized = cfg.priority_alpha > 0 or cfg.priority_tau is not None
    need(
        not prioritized or cfg.sampling in ("priority", "fresh-anchored"),
        f"--priority-alpha / --priority-tau: "
        f"only --sampling priority and fresh-anchored draw by priority, not --sampling {cfg.sampling}",
    )
    need(
        prioritized or cfg.sampling != "priority",
        "--sampling priority needs --priority-alpha > 0 or "
        "--priority-tau (with neither, every weight is 1: that is --sampling uniform)",
    )
    need(
        cfg.sampling != "fresh-anchored" or B >= R,
        f"--sampling fresh-anchored: a batch holds every fresh rollout, "
        f"so --batch-size {B} must be >= R = {R} (--prompts-per-step x --group-size)",
    )
    need(cfg.ratio_level == "token" or cfg.loss == "grpo", "--ratio-level sequence: only --loss grpo has a ratio")
    unprotected = N - round(cfg.positive_bias * N)
    need(
        cfg.sampling != "without-replacement" or unprotected >= B,
        f"--sampling without-replacement: "
        f"--positive-bias {cfg.positive_bias} keeps {N - unprotected} of the --buffer-size {N} slots for older "
        f"rollouts, leaving {unprotected} for never-used ones, fewer than --batch-size {B}",
    )
    if cfg.sampling != "queue":
        return
    need(
        cfg.positive_bias == 0,
        f"--sampling queue --positive-bias {cfg.positive_bias}: the queue consumes every "
        "rollout once and keeps none back: use --positive-bias 0",
    )
    need(
        cfg.max_age is None and cfg.max_uses is None and cfg.max_drift is None,
        "--sampling queue: every rollout is used once and none is evicted, so --max-age, --max-uses and --max-drift "
        "do not apply",
    )
    need(
        B % R == 0,
        f"--sampling queue: --batch-size {B} must be a multiple of R = {R} (--prompts-per-step x "
        "--group-size), so that whole requests fill a batch and no rollout waits forever",
    )
