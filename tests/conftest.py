"""Real vLLM server processes for the tests of async_pipeline.py, shared by the whole session (a server takes half a
minute to start on 2 cores). They listen on 127.0.0.2, not the trainers' own address, so that nothing assumes
localhost. Without vLLM these tests skip with the reason, except under REPLAY_GRPO_REQUIRE_VLLM=1 (CI).

The servers also take `--weight-transfer-config {"backend": "nccl"}`, as launched servers on GPUs do, with the CPU
stand-in for the NCCL data plane (tests/vllm_plugin) on their PYTHONPATH, so that the nccl route runs on a CPU.

Nothing of the suite outlives a killed test run: the servers get SIGTERM from the kernel when the thread that launched
them ends (serving.die_with_parent), their process groups are killed at the interpreter's exit, a SIGTERM
stops the session as Ctrl-C does (the fixtures' teardown runs), and a pytest-xdist worker gets SIGTERM when its
controller dies."""

import atexit
import importlib.util
import os
import signal
import types
from pathlib import Path

import pytest

from infra import generation, models, serving

SERVER_HOST = "127.0.0.2"
PLUGIN = Path(__file__).resolve().parent / "vllm_plugin"
NCCL_CONFIG = ["--weight-transfer-config", '{"backend": "nccl"}']


LAUNCHED: list = []  # every server the suite launched, for the exit hook


def pytest_configure(config):
    """A SIGTERM (kill, a CI runner's cancel) stops the session as Ctrl-C does, so the fixtures stop their servers; an
    xdist worker is sent one by the kernel when its controller dies (kill -9 included)."""

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupted)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        serving.die_with_parent(os.getppid())


@atexit.register
def stop_launched() -> None:
    """The process group of every server still running, at the interpreter's exit (a session cut short)."""
    serving.stop_servers(LAUNCHED, timeout=5.0)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """pytest-xdist (`-n`, pyproject.toml) runs each group in one worker, so that no shared fixture is built twice:
    every test of the session's vLLM servers (launched once), and a file's tests that take one of its module
    fixtures. Every other test goes to whichever worker is free, which keeps the two workers evenly loaded."""
    for item in items:
        if "vllm_servers" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("vllm-servers"))
        elif any(
            d.baseid and d.scope != "function" for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs
        ):
            item.add_marker(pytest.mark.xdist_group(item.path.name))


def untied_tiny(seed: int):
    """The tiny Qwen2 with its own LM head (tie_word_embeddings False), initialised apart from the embedding."""
    import torch
    from transformers import Qwen2ForCausalLM

    model, tok = models.build_tiny_model(seed)
    model.config.tie_word_embeddings = False
    torch.manual_seed(seed + 1)
    untied = Qwen2ForCausalLM(model.config)
    untied.generation_config = model.generation_config
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    return untied, tok


def cpu_data_plane() -> dict:
    """The stand-in's functions by their names in vllm's nccl_engine module, for a trainer in this process (loaded
    from its file: its folder on sys.path would make vLLM load it as a plugin here too)."""
    spec = importlib.util.spec_from_file_location("cpu_weight_transport", PLUGIN / "cpu_weight_transport.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DATA_PLANE


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory):
    """{"tied": Server, "untied": Server}: each serving a tiny Qwen2 folder, launched by async_pipeline itself."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("REPLAY_GRPO_REQUIRE_VLLM") == "1":
            raise RuntimeError("vLLM is not installed: " + generation.VLLM_INSTALL)
        pytest.skip("vLLM is not installed (" + generation.VLLM_INSTALL + ")")
    root = tmp_path_factory.mktemp("servers")
    cfg = types.SimpleNamespace(generator_host=SERVER_HOST, seed=0)
    servers, command = {}, serving.server_command
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PLUGIN), os.environ.get("PYTHONPATH")])))
            mp.setattr(serving, "server_command", lambda *a, **k: command(*a, **k) + NCCL_CONFIG)
            for name, (model, tok) in (("tied", models.build_tiny_model(0)), ("untied", untied_tiny(0))):
                folder = models.export_plain_folder(model, tok, str(root / name))
                (servers[name],) = serving.launch_servers(cfg, folder, 512, [None], root / f"{name}-log")
                LAUNCHED.append(servers[name])
        serving.wait_ready(list(servers.values()), timeout=600)
        yield servers
    finally:
        serving.stop_servers(list(servers.values()))
