"""A Triton kernel's registers, shared memory and SASS for sm_90 without a GPU.

Triton compiles for a target it is told about, and its wheel carries ptxas and cuobjdump, so a CPU
machine can see what the device would run (with the device's Triton: 3.6 gave the same 168
registers and 18.7 KB of shared memory as ncu on the H200 for the FMA h_post_bda backward):

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 numpy
    /tmp/t36/bin/python dev/sass_offline.py [--sass | --rows | --proj-agg]

Prints, for the n = 4 h_post_bda backward kernels at their shipped tiles (bf16, with bias; the
tensor-core one without and with dropout, the FMA one with dropout), the registers, shared memory and the instruction histogram of the main loop; with ``--proj-agg``, the
projection backward with mix_aggregate's aggregation term at its shipped tile and others
(registers, shared memory, spills). Pointers and C
are declared 16-byte divisible, as Triton specialises them at launch: without that the loads are
neither vectorised nor pipelined and the figures mean nothing.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones, whatever the shell says

_INSTR = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, divisible=(), **options):
    """(cubin bytes, resource line, SASS text) of ``fn`` compiled for sm_90."""
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(k.asm["cubin"])
        res = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    return f"{regs.group(1) if regs else '?'} registers, {k.metadata.shared} B dynamic shared memory", sass


def loop_histogram(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcode histogram of the longest backward-branching loop."""
    instrs = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines() if (m := _INSTR.match(line))]
    best = (0, 0, 0)
    for addr, op, line in instrs:
        target = re.search(r"0x([0-9a-f]+)", line.split("BRA")[1]) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            size = sum(1 for a, _, _ in instrs if lo <= a <= addr)
            best = max(best, (size, lo, addr))
    ops = collections.Counter(op for a, op, _ in instrs if best[1] <= a <= best[2])
    return best[0], ops


def proj_agg(extra: bool = False) -> None:
    """The bf16 projection backward (``proj_rms._proj_rms_bwd_packed``) with mix_aggregate's
    aggregation term (n = 4, C a whole number of K blocks), at the shipped tile and at others:
    registers, shared memory, spill loads / stores. ``extra``: with the residual's gradient added
    in the dx pass too (``EXTRA``; its shipped tile ``EXTRA_TILE``)."""
    from kernels.triton import proj_rms as pr
    bm, bk, split, warps, stages = pr.EXTRA_TILE if extra else pr.LOWP_TILE
    shipped = (bm, bk, warps, min(stages, pr.AGG_STAGES))
    for tile in (shipped, (bm, bk, 4, 3), (bm, bk, 8, 3), (bm, bk, 8, 2), (bm, bk, 4, 2), (32, bk, 4, 3),
                 (bm, 64, 4, 3)):
        b_m, b_k, w, st = tile
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "hi_ptr": "*bf16", "lo_ptr": "*bf16", "cf_ptr": "*fp32",
               "dx_ptr": "*bf16", "ws_ptr": "*fp32", "hp_ptr": "*fp32", "go_ptr": "*bf16", "ex_ptr": "*bf16",
               "C": "i32", "M": "i32", "K": "i32", "N": "i32"}
        ce = dict(NG=32, BLOCK_M=b_m, BLOCK_K=b_k, SPLIT=split, STAGES=st, NS=4, AGG_ONE=True, GROUP=pr.GROUP_STREAMS,
                  EXTRA=extra)
        res, sass = compile_sm90(pr._proj_rms_bwd_packed, sig, ce, w, st,
                                 divisible=[k for k in sig if k.endswith("_ptr")] + ["C", "K"])
        spills = f"LDL {len(re.findall(r'[^A-Z]LDL', sass))}, STL {len(re.findall(r'[^A-Z]STL', sass))}"
        print(f"(BLOCK_M, BLOCK_K, warps, stages) {tile}"
              f"{' (shipped)' if tile == shipped else ''}: {res}; {spills}")


def main() -> None:
    if "--proj-agg" in sys.argv:
        return proj_agg("--extra" in sys.argv)
    from kernels.triton import h_post_bda as hpb
    common = {"h_ptr": "*fp32", "x_ptr": "*bf16", "hp_ptr": "*fp32", "y_ptr": "*bf16", "b_ptr": "*bf16",
              "g_ptr": "*bf16", "dx_ptr": "*bf16", "dy_ptr": "*bf16"}
    key = {"seed": "i64", "offset": "i64", "G": "i32", "scale": "fp32"}  # the dropout's (mask_args)
    bc, group, warps, stages = hpb.BWD4_TILE_TC
    tc_sig = dict(common, ws_ptr="*fp32", ws_b_ptr="*fp32", T="i32", C="i32", cnt_ptr="*i32", dh_ptr="*fp32",
                  dhp_ptr="*fp32", db_ptr="*bf16", ws_b2_ptr="*fp32", SUPER="i32", **key)
    tc_ce = dict(GROUP=group, BLOCK_C=bc, HAS_BIAS=True, TRANSPOSE=False, STAGES=stages, F32DOT=False,
                 **hpb.finish_args(group, bc, False))
    fma_sig = dict(tc_sig)

    def fma(tile, threshold, rows=None):
        bt, bc4, group4, warps4, stages4 = tile
        ce = dict(GROUP=group4, BLOCK_T=bt, BLOCK_C=bc4, HAS_BIAS=True, TRANSPOSE=False, STAGES=stages4,
                  THRESHOLD=threshold, **hpb.finish_args(group4, bc4, True, rows))
        return (f"_h_post_bda_bwd4 {tile}{', dropout 0.1' if threshold else ''}, finishing {ce['ROWS']} rows at once",
                hpb._h_post_bda_bwd4, fma_sig, ce, warps4, stages4)
    threshold = 429496729  # dropout 0.1 (mhctool.references.dropout.key)
    runs = [
        (f"_h_post_bda_bwd4_tc {hpb.BWD4_TILE_TC}", hpb._h_post_bda_bwd4_tc, tc_sig, dict(tc_ce, THRESHOLD=0),
         warps, stages),
        (f"_h_post_bda_bwd4_tc {hpb.BWD4_TILE_TC_DROPOUT}, dropout 0.1", hpb._h_post_bda_bwd4_tc, tc_sig,
         dict(tc_ce, THRESHOLD=threshold), hpb.BWD4_TILE_TC_DROPOUT[2], hpb.BWD4_TILE_TC_DROPOUT[3]),
        fma(hpb.BWD4_TILE_DROPOUT, threshold),
        fma(hpb.BWD4_TILE, 0),
    ]
    if "--rows" in sys.argv:  # the FMA kernel's finishing rows at once, 1 to 16, at its two tiles
        runs = [fma(t, th, r) for t, th in ((hpb.BWD4_TILE_DROPOUT, threshold), (hpb.BWD4_TILE, 0))
                for r in (1, 2, 4, 8, 16)]
    for name, fn, sig, ce, w, st in runs:
        res, sass = compile_sm90(fn, sig, ce, w, st, divisible=[k for k in sig if k.endswith("_ptr")] + ["C"])
        size, ops = loop_histogram(sass)
        print(f"{name}: {res}; main loop {size} instructions")
        print("  " + " ".join(f"{o}:{c}" for o, c in ops.most_common(24)))
        if "--sass" in sys.argv:
            print(sass)


if __name__ == "__main__":
    main()
