"""bench_publish.py: what one weight publish of async_pipeline.py moves, counted on CPU with the project's own code, and
what it would take on GPUs (an estimate from bandwidths, not a measurement).

Counted here: the tiny Qwen2 of the tests under FSDP2 on one CPU rank, W vLLM CPU servers launched with the nccl
weight transfer and the CPU stand-in of its data plane (tests/vllm_plugin), and one publish as train_async makes it
(its gather, then Publisher.publish with wait): the gathered copy (dtype, bytes, where the code puts it), every NCCL
group opened (world size), every broadcast (bytes, dtype; one after another or together) and every cast a tensor's
`.to` makes inside the publish (bytes read). The publish's dtype is bf16, a GPU's compute dtype.

Estimated: those counts scaled by parameters from the tiny model to a preset's model (PRESET_MODELS of
memory_plan.py), with the bandwidths below (defaults: typical for an 8 x H100 SXM node, NDR InfiniBand), each term
in seconds and the publish against a training step of --step-seconds.

    python tools/bench_publish.py                           # this revision's async_pipeline.py, W = 2 counted
    python tools/bench_publish.py --rev bcf46a0             # another revision's, counted the same way
    python tools/bench_publish.py --model Qwen/Qwen2.5-7B --servers 5 --trainers 3 --step-seconds 5
"""

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests")]  # the method's modules, memory_plan, conftest

import torch
import torch.distributed as dist

from infra import serving

GB = 1e9
PLUGIN = ROOT / "tests" / "vllm_plugin"


def load_pipeline(rev: str | None):
    """async_pipeline as this checkout has it, or as revision `rev` had it (its file alone; the rest is this one's)."""
    import async_pipeline

    if rev is None:
        return async_pipeline
    try:
        text = subprocess.run(
            ["git", "show", f"{rev}:async_pipeline.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--rev {rev}: {e.stderr.strip() or 'not a revision of this repository'}") from None
    path = Path(tempfile.mkdtemp()) / "async_pipeline_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("async_pipeline_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class Counts:
    """What the instrumented calls saw during one publish."""

    def __init__(self):
        self.groups, self.broadcasts, self.casts, self.lock = [], [], [], threading.Lock()

    def table(self) -> dict:
        spans = sorted(self.broadcasts, key=lambda b: b["start"])
        overlapping = any(b["start"] < a["end"] for a, b in zip(spans, spans[1:]))
        return {
            "groups": self.groups,
            "broadcasts": len(spans),
            "broadcast_bytes": [b["bytes"] for b in spans],
            "broadcast_dtypes": sorted({d for b in spans for d in b["dtypes"]}),
            "broadcasts_in_sequence": len(spans) > 1 and not overlapping,
            "casts": len(self.casts),
            "cast_bytes_read": sum(self.casts),
        }


@contextlib.contextmanager
def instrumented(counts: Counts):
    """vLLM's nccl_engine data plane (the CPU stand-in) and Tensor.to, counting as they run."""
    from conftest import cpu_data_plane
    from vllm.distributed.weight_transfer import nccl_engine

    plane, saved, real_to = cpu_data_plane(), {}, torch.Tensor.to

    def endpoint(init_info, *args, **kwargs):
        counts.groups.append(init_info.world_size)
        return plane["open_trainer_endpoint"](init_info, *args, **kwargs)

    def producer(iterator, *args, **kwargs):
        seen = {"bytes": 0, "dtypes": set(), "start": time.perf_counter()}

        def counted():
            for item in iterator:
                seen["bytes"] += item[1].numel() * item[1].element_size()
                seen["dtypes"].add(str(item[1].dtype).removeprefix("torch."))
                yield item

        plane["packed_nccl_broadcast_producer"](counted(), *args, **kwargs)
        seen["end"] = time.perf_counter()
        with counts.lock:
            counts.broadcasts.append(seen)

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.dtype != self.dtype:
            with counts.lock:
                counts.casts.append(self.numel() * self.element_size())
        return out

    for name, function in {
        **plane,
        "open_trainer_endpoint": endpoint,
        "packed_nccl_broadcast_producer": producer,
    }.items():
        saved[name] = getattr(nccl_engine, name)
        setattr(nccl_engine, name, function)
    torch.Tensor.to = to
    try:
        yield
    finally:
        torch.Tensor.to = real_to
        for name, function in saved.items():
            setattr(nccl_engine, name, function)


def count_publish(ap, servers, folder: Path) -> dict:
    """One publish of the tiny model's weights as `ap`'s train_async makes it, counted."""
    from infra import models

    model, _ = models.build_tiny_model(0)
    P = sum(p.numel() for p in model.parameters())
    policy = ap.shard_policy(model, torch.device("cpu"))
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    if hasattr(ap, "gather_weights"):  # the gather each revision's train_async calls before a publish
        weights, gathered_to = ap.gather_weights(policy, bf16, cpu), "the broadcasting device"
    else:
        weights, gathered_to = ap.full_weights(policy), "host memory (cpu_offload)"
    unique = {v.data_ptr(): v for v in weights.values()}.values()
    counts = Counts()
    with instrumented(counts):
        publisher = ap.Publisher(servers, "nccl", folder, bf16, tied=True, address="127.0.0.1", device=cpu)
        t0 = time.perf_counter()
        publisher.publish(weights, 1, wait=True)
        seconds = time.perf_counter() - t0
        publisher.close()
    if publisher.error:
        raise SystemExit(f"the publish failed: {publisher.error}")
    return {
        "parameters": P,
        "gathered_dtype": str(next(iter(unique)).dtype).removeprefix("torch."),
        "gathered_bytes": sum(v.numel() * v.element_size() for v in unique),
        "gathered_to": gathered_to,
        "cpu_seconds": seconds,
        **counts.table(),
    }


def launch(n: int, root: Path):
    """n vLLM CPU servers of the tiny model with the nccl weight transfer and the data plane's stand-in."""
    from infra import models

    model, tok = models.build_tiny_model(0)
    folder = models.export_plain_folder(model, tok, str(root / "model"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN), str(ROOT), os.environ.get("PYTHONPATH")]))
    command = serving.server_command
    serving.server_command = lambda *a, **k: command(*a, **k) + ["--weight-transfer-config", '{"backend": "nccl"}']
    cfg = types.SimpleNamespace(generator_host="127.0.0.1", seed=0, num_generators=n)
    servers = serving.launch_servers(cfg, folder, 512, [None] * n, root / "logs")
    serving.wait_ready(servers, timeout=900)
    return servers


def estimate(counted: dict, args, P: int) -> list[tuple[str, float]]:
    """Seconds per term of one publish of a P-parameter model to args.servers servers, from the counts: bytes scaled
    by P / the tiny model's parameters, per-server terms by W / the W counted. A cast the publish makes on its way to
    the device is a host-to-device copy of the source dtype (torch converts a non_blocking copy on the GPU)."""
    scale, per_server = P / counted["parameters"], args.servers / args.counted_servers
    gathered = counted["gathered_bytes"] * scale
    if counted["gathered_to"].startswith("host"):  # FSDP's all-gather, then each tensor to pageable host memory
        terms = [("gather to the host (PCIe, pageable)", gathered / (args.pcie_pageable_gbps * GB))]
    else:  # the all-gather among the T ranks on NVLink: (T - 1) / T of it comes from the others
        share = (args.trainers - 1) / args.trainers
        terms = [("gather on the device (NVLink)", gathered * share / (args.nvlink_gbps * GB))]
    copied = counted["cast_bytes_read"] * scale * per_server
    if copied:
        terms.append(("host to device copies (PCIe, pageable)", copied / (args.pcie_pageable_gbps * GB)))
    in_sequence = counted["broadcasts_in_sequence"]
    sends = counted["broadcasts"] * (per_server if in_sequence else 1)
    each = sum(counted["broadcast_bytes"]) * scale / max(counted["broadcasts"], 1)
    terms.append(
        (f"broadcast x {sends:g}{' in sequence' * in_sequence} (NVLink)", each * sends / (args.nvlink_gbps * GB))
    )
    return terms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="count another revision's async_pipeline.py (git show REV:async_pipeline.py)")
    parser.add_argument("--counted-servers", type=int, default=2, help="W of the CPU run that counts")
    parser.add_argument("--model", default="Qwen/Qwen2.5-7B", help="the estimate's model (memory_plan.PRESET_MODELS)")
    parser.add_argument("--servers", type=int, default=5, help="the estimate's W")
    parser.add_argument("--trainers", type=int, default=3, help="the estimate's T")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="a training step at that size")
    parser.add_argument("--nvlink-gbps", type=float, default=300.0, help="NCCL bus bandwidth within a node, GB/s")
    parser.add_argument(
        "--pcie-pageable-gbps", type=float, default=15.0, help="copies to and from pageable host memory, GB/s"
    )
    parser.add_argument("--json", help="write the counts and the estimate there")
    args = parser.parse_args()
    import memory_plan

    if args.model not in memory_plan.PRESET_MODELS:
        raise SystemExit(f"--model {args.model}: not one of {', '.join(memory_plan.PRESET_MODELS)}")
    ap = load_pipeline(args.rev)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{serving.free_port('127.0.0.1')}", rank=0, world_size=1
    )
    with tempfile.TemporaryDirectory() as tmp:
        servers = launch(args.counted_servers, Path(tmp))
        try:
            counted = count_publish(ap, servers, Path(tmp) / "published")
        finally:
            serving.stop_servers(servers)
    dist.destroy_process_group()
    P = sum(p.numel() for p in memory_plan.meta_model(args.model).parameters())
    terms = estimate(counted, args, P)
    total = sum(s for _, s in terms)
    print(f"counted on CPU ({args.rev or 'this checkout'}, W = {args.counted_servers}, tiny model):")
    for key, value in counted.items():
        print(f"  {key:24} {value}")
    print(f"\nestimated for {args.model} ({P / 1e9:.2f} B parameters), W = {args.servers}, T = {args.trainers}:")
    for what, seconds in terms:
        print(f"  {what:48} {seconds:7.2f} s")
    print(f"  {'publish':48} {total:7.2f} s = {total / args.step_seconds:.2f} x a {args.step_seconds:g} s step")
    if args.json:
        Path(args.json).write_text(json.dumps({"counted": counted, "terms": terms, "total": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
