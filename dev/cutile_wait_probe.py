"""Does tileiras keep a loop's tile loads pipelined when each iteration first waits on a flag that
other programs raise? Offline (no GPU), for the read-x-once mix_aggregate backward
(docs/perf-notes.md, twenty-sixth session). Set up the tools as dev/cutile_sass.py says, then:

    TILEIRAS=... NVDISASM=... python3 dev/cutile_wait_probe.py [--keep DIR]

A probe kernel walks 512 (64, 128) bf16 tiles of one column block and sums them; before each
load it waits (WAIT 1: ``ct.load(..., memory_order=ACQUIRE, memory_scope=DEVICE)`` polled in a
``while``; WAIT 2: the same RELAXED; WAIT 0: none). The arrays are declared as the launches see
them (contiguous last axis, 16-element strides, 256-byte base, shapes of whole tiles): without
that the loads are scalar ``LDG.U16`` and the figures mean nothing. Prints each form's TMA loads
(UTMALDG), mbarrier operations (SYNCS), flag polls (``LDG.E.STRONG.GPU``) and L1 invalidations.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import cuda.tile as ct
import torch
from cuda.tile._memory_model import MemoryOrder, MemoryScope
from cuda.tile.compilation import ArrayConstraint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cutile_sass import sass  # noqa: E402
from kernels.cutile._common import _CT_DTYPES  # noqa: E402


def _poll(flags, s, order):
    return ct.load(flags, index=(s,), shape=(1,), memory_order=order, memory_scope=MemoryScope.DEVICE)


@ct.kernel
def probe(x, flags, out, NB: ct.Constant[int], WAIT: ct.Constant[int]):
    kb = ct.bid(0)
    acc = ct.zeros((128,), dtype=ct.float32)
    for s in range(NB):
        if WAIT == 1:
            f = _poll(flags, s, MemoryOrder.ACQUIRE)
            while ct.sum(f) == 0:
                f = _poll(flags, s, MemoryOrder.ACQUIRE)
        if WAIT == 2:
            f = _poll(flags, s, MemoryOrder.RELAXED)
            while ct.sum(f) == 0:
                f = _poll(flags, s, MemoryOrder.RELAXED)
        acc = acc + ct.sum(ct.load(x, index=(s, kb), shape=(64, 128)).astype(ct.float32), axis=0)
    ct.store(out, index=(kb,), tile=acc)


def _array(dtype, ndim):
    """A contiguous tensor as a launch specialises it."""
    return ArrayConstraint(_CT_DTYPES[dtype], ndim, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=(None,) * (ndim - 1) + (1,),
                           stride_divisible_by=(16,) * (ndim - 1) + (1,),
                           shape_divisible_by=(64,) * ndim if ndim > 1 else 1, base_addr_divisible_by=256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="write the bytecode, cubins and SASS here")
    args = ap.parse_args()
    params = [_array(torch.bfloat16, 2), _array(torch.int32, 1), _array(torch.float32, 1), 512]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for wait, name in ((0, "no wait"), (1, "acquire poll"), (2, "relaxed poll")):
            text = sass(probe, [*params, wait], workdir, f"wait{wait}")
            found = {k: len(re.findall(pat, text)) for k, pat in (
                ("UTMALDG", r"UTMALDG"), ("SYNCS", r"SYNCS\."), ("polls", r"LDG\.E\.STRONG\.GPU"), ("CCTL.IVALL", r"CCTL\.IVALL"))}
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)


if __name__ == "__main__":
    main()
