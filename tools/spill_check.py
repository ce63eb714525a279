"""spill_check.py: compile kernels.py's Triton kernels ahead of time for sm_90 (H100/H200) at each tile of the
autotune space and the tuning sweep, without a GPU, and report what ptxas made of them.

    python tools/spill_check.py               # every tile the autotuner or the sweep may pick, both kernels, bf16
    python tools/spill_check.py --kind fwd    # the forward's only

For each (kernel, tile): registers per thread, spill stores and loads and the stack frame (bytes per thread, from
`ptxas -v` run with the very command line the installed Triton's JIT uses, captured while it compiles), shared memory
(bytes per block) and whether the PTX declares local memory. A spilling tile reads and writes local memory (HBM,
cached in L1) inside the k-loop or the epilogue: ptxas, not the PTX, decides it. Exit 1 if a tile spills.
"""

import argparse
import contextlib
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the method's modules live at the root

import kernels  # noqa: E402

TARGET = ("cuda", 90, 32)  # sm_90: H100 / H200, 32 threads a warp
# What the JIT knows at run time of torch's tensors and of d = 896 or 3584: 16-aligned pointers, strides and d
# divisible by 16 (without it the loads cannot be pipelined)
SIZES = dict(N="i32", V="i32", D="i32", stride_h="i32", stride_w="i32")


def ptxas_path():
    """The ptxas the installed Triton compiles sm_90 with (its bundled copy, or TRITON_PTXAS_PATH), or None."""
    if not kernels.HAS_TRITON:
        return None
    try:
        from triton import knobs

        return knobs.nvidia.ptxas.path
    except Exception:  # no bundled ptxas and none named: Triton cannot compile for a GPU here
        return None


def signature(kind, dtype):
    t, f32 = "*" + dtype, "*fp32"
    if kind == "fwd":
        return kernels._fwd_kernel, dict(h_ptr=t, w_ptr=t, y_ptr="*i64", part_ptr=f32, **SIZES, NUM_SPLITS="i32"), {}
    sig = dict(h_ptr=t, w_ptr=t, yl_ptr="*i64", m_ptr=f32, ls_ptr=f32, tbar_ptr=f32, q_ptr=f32, zy_ptr=f32)
    sig.update(g_ptr=f32, e_ptr=f32, dz_ptr=t, N="i32", VS="i32", D="i32", V="i32", stride_h="i32", stride_w="i32")
    sig.update(stride_dz="i32")
    return kernels._bwd_kernel, sig, {"GROUP_N": kernels.GROUP_N}


@contextlib.contextmanager
def ptxas_logs(into):
    """Capture (command, log) of each ptxas run while Triton compiles (its log file is deleted right after)."""
    from triton.backends.nvidia import compiler

    real = compiler.subprocess.run

    def run(cmd, *a, **kw):
        r = real(cmd, *a, **kw)
        if "ptxas" in Path(str(cmd[0])).name and hasattr(kw.get("stderr"), "name"):
            kw["stderr"].flush()
            into.append((cmd, Path(kw["stderr"].name).read_text()))
        return r

    compiler.subprocess.run = run
    try:
        yield
    finally:
        compiler.subprocess.run = real


@contextlib.contextmanager
def always_compile():
    """Compile even where Triton's cache holds the kernel (a cached kernel runs no ptxas, so leaves no log)."""
    old = os.environ.get("TRITON_ALWAYS_COMPILE")
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_ALWAYS_COMPILE"]
        else:
            os.environ["TRITON_ALWAYS_COMPILE"] = old


def parse_ptxas(log) -> dict:
    """Registers, spill stores/loads and stack frame (bytes per thread) from `ptxas -v`'s log."""

    def num(pattern):
        found = re.findall(pattern, log)
        return max((int(x) for x in found), default=None)

    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "stack": num(r"(\d+) bytes stack frame"),
    }


def compile_sm90(kind, config, dtype="bf16", inv_t=1 / 0.7):
    """Compile kernel `kind` ("fwd" or "bwd") with tiles `config` for sm_90; returns the row of the report."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, extra = signature(kind, dtype)
    tiles = {k: v for k, v in config.items() if k.startswith("BLOCK")}
    options = {k: v for k, v in config.items() if k.startswith("num")}
    consts = dict(INV_T=inv_t, UPCAST=False, **tiles, **extra)
    div = [n for n in sig if n.endswith("_ptr") or n.startswith("stride") or n == "D"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    sig = dict(sig, **{k: "constexpr" for k in consts})
    logs = []
    with ptxas_logs(logs), always_compile():
        compiled = kernels.triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget(*TARGET), options=options
        )
    ptx = compiled.asm["ptx"]
    row = {"kind": kind, "config": dict(config), "dtype": dtype, "shared": compiled.metadata.shared}
    row.update(parse_ptxas(logs[-1][1] if logs else ""))
    row["ptxas"] = " ".join(map(str, logs[-1][0][:-3])) if logs else None
    row["local_in_ptx"] = bool(re.search(r"\.local\b", ptx))
    row["ptx"] = ptx
    return row


def spills(row) -> bool:
    """Whether ptxas spilled (or the PTX already uses local memory, or the log said nothing)."""
    unknown = row["spill_stores"] is None or row["spill_loads"] is None
    return row["local_in_ptx"] or unknown or row["spill_stores"] + row["spill_loads"] > 0


def tiles_text(c) -> str:
    return f"{c['BLOCK_N']}x{c['BLOCK_V']}x{c['BLOCK_D']}, {c['num_warps']} warps, {c['num_stages']} stages"


def line(row) -> str:
    return (
        f"{row['kind']} {tiles_text(row['config'])} ({row['dtype']}): {row['registers']} registers, "
        f"{row['spill_stores']} B spill stores, {row['spill_loads']} B spill loads, {row['stack']} B stack, "
        f"{row['shared'] / 1024:.0f} KiB shared, local memory in PTX: {'yes' if row['local_in_ptx'] else 'no'}"
    )


def space(kind) -> list[dict]:
    """The autotune space of kernel `kind` on a GPU without a tuned entry (kernels.DEFAULT_CONFIGS), then the tuned
    tiles committed for any GPU (kernels_tuned.json) and the tuning sweep's (tools/tune_kernels.py)."""
    configs = kernels.candidate_configs(kind, "a GPU without a tuned entry", 896, 151936)
    for gpu, entries in kernels.load_tuned().get("gpus", {}).items():
        if gpu != "interpreter":  # the interpreter's entries (dry runs) never run on a GPU
            configs += [e[kind] for e in entries.values() if e[kind] not in configs]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tune_kernels import SWEEP_CONFIGS

    return configs + [dict(c) for c in SWEEP_CONFIGS[kind] if dict(c) not in configs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["fwd", "bwd"], help="one kernel (default: both)")
    ap.add_argument("--limit", type=int, default=0, help="the first LIMIT tiles of each kernel only (a rehearsal)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the operands' type (bf16)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "spill_check.py: TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled", file=sys.stderr
        )
        sys.exit(2)
    path = ptxas_path()
    if path is None:
        print("spill_check.py: no ptxas for sm_90 (Triton missing, or without its bundled ptxas)", file=sys.stderr)
        sys.exit(2)
    print(f"triton {kernels.triton.__version__}, ptxas {path}", flush=True)
    bad = 0
    for kind in [args.kind] if args.kind else ["fwd", "bwd"]:
        for config in space(kind)[: args.limit or None]:
            row = compile_sm90(kind, config, args.dtype)
            bad += spills(row)
            print(("SPILLS " if spills(row) else "ok     ") + line(row), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
