"""How long rank 0's weight publish takes while a generator is reloading weights (--mode async's hand-off).

    python tools/bench_publish.py [--hidden 896 --layers 24 --vocab 151936 --load-seconds 2 --publishes 5]

A model built in code at Qwen2.5-0.5B's width (by default) is published into async_pipeline.WeightMailbox
--publishes times: first with no reader (the baseline: the copy into shared memory alone), then while a
generator process pulls in a loop with a reload that takes --load-seconds on top of its load_state_dict
(a slow engine). Prints seconds per publish for both and their ratio: ~1 means a publish never waits for a
generator's reload.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the method's modules live at the root

import torch

import async_pipeline as ap
import replay_grpo as rg
import warm_start


class SlowReload:
    """An HF generator whose weight reload takes `extra` seconds more (a large vLLM engine's)."""

    def __init__(self, model, tok, extra: float, pulls):
        self.generator, self.extra, self.pulls = rg.HFGenerator(model, tok), extra, pulls
        self.policy_version = -1

    def load_weights(self, state_dict, version):
        self.generator.load_weights(state_dict, version)
        time.sleep(self.extra)
        self.policy_version = version
        self.pulls.value += 1


def puller(box, shape, extra, stop, pulls):
    torch.set_num_threads(1)
    model, tok = warm_start.build_tiny_model(0, **shape)
    generator = SlowReload(model, tok, extra, pulls)
    while not stop.is_set():
        box.pull(generator)
        time.sleep(0.01)


def publish_seconds(box, state_dict, publishes: int, version: int) -> list[float]:
    times = []
    for i in range(publishes):
        t = time.perf_counter()
        box.publish(state_dict, version + i)
        times.append(time.perf_counter() - t)
        time.sleep(0.5)  # a train step between two publishes
    return times


def main():
    ap_ = argparse.ArgumentParser()
    ap_.add_argument("--hidden", type=int, default=896)
    ap_.add_argument("--layers", type=int, default=24)
    ap_.add_argument("--vocab", type=int, default=151936)
    ap_.add_argument("--load-seconds", type=float, default=2.0)
    ap_.add_argument("--publishes", type=int, default=5)
    args = ap_.parse_args()
    shape = dict(hidden_size=args.hidden, layers=args.layers, vocab_size=args.vocab)
    model, _ = warm_start.build_tiny_model(0, **shape)
    state_dict = {k: v.detach() for k, v in model.state_dict().items()}
    size = sum(v.numel() * v.element_size() for v in state_dict.values()) / 2**30
    ctx = mp.get_context("spawn")
    box = ap.WeightMailbox(ctx, state_dict, 0)
    alone = publish_seconds(box, state_dict, args.publishes, 1)
    stop, pulls = ctx.Event(), ctx.Value("i", 0)
    child = ctx.Process(target=puller, args=(box, shape, args.load_seconds, stop, pulls))
    child.start()
    while pulls.value == 0:  # the generator is up and has loaded once
        time.sleep(0.1)
    busy = publish_seconds(box, state_dict, args.publishes, 100)
    stop.set()
    child.join(60)
    a, b = statistics.median(alone), statistics.median(busy)
    print(
        f"weights {size:.2f} GiB; median seconds per publish: no reader {a:.3f}, a generator reloading "
        f"({args.load_seconds:g} s extra per reload, {pulls.value} reloads) {b:.3f}: ratio {b / a:.2f}"
    )


if __name__ == "__main__":
    main()
