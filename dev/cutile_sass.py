"""A cuTile kernel's SASS for sm_90 without a GPU: register spills and instruction counts.

cuTile's front end exports Tile IR bytecode on any machine (what tests/kernels/test_cutile.py does);
`tileiras` (in the device bundle's tile toolkit) compiles that to a cubin for a named GPU, and
`nvdisasm` (the `nvidia-cuda-nvdisasm` wheel) prints its SASS. On the CPU machine:

    mkdir -p /tmp/tt && tar xJf .device/tile-toolkit-*.tar.xz -C /tmp/tt
    pip download --no-deps -d /tmp/nvd nvidia-cuda-nvdisasm && unzip -q -o /tmp/nvd/*.whl -d /tmp/nvd/x
    TILEIRAS=/tmp/tt/nvidia/cu13/bin/tileiras NVDISASM=/tmp/nvd/x/nvidia/cu13/bin/nvdisasm \\
        python3 dev/cutile_sass.py [--keep DIR]

Prints, for the projection backward at its shipped bf16 tile (without and with mix_aggregate's
aggregation term, the latter per K block with the hints it takes on an H200 and on an H100, and
a program per channel block of the streams) and compute_h's backward, the spill loads and stores
(LDL / STL), the tensor-core instructions (HGMMA: wgmma; HMMA: mma.sync) and the global / shared
memory instructions. The sixteenth session found the whole-block projection
backward at (64, 256) with 32 LDL / 13 STL (ncu: 10 M local-memory requests a launch) and the
two-halves form with none (dev/perf-notes.md).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.cutile import mapping, proj_rms  # noqa: E402
from kernels.cutile._common import array, tile_ir  # noqa: E402

COUNTED = ("LDL", "STL", "HGMMA", "HMMA", "LDG", "STG", "LDGSTS", "UTMALDG", "UTMASTG", "LDS", "STS", "ATOMG")


def sass(kernel, params: list, workdir: Path, name: str, gpu: str = "sm_90") -> str:
    """The SASS text of ``kernel`` compiled for one signature (``params`` as for ``tile_ir``)."""
    bc, cubin = workdir / f"{name}.tileirbc", workdir / f"{name}.cubin"
    bc.write_bytes(tile_ir(kernel, params))  # the bytecode the CPU tests compile
    subprocess.run([os.environ.get("TILEIRAS", "tileiras"), f"--gpu-name={gpu}", "-o", str(cubin), str(bc)],
                   check=True, capture_output=True, text=True)
    text = subprocess.run([os.environ.get("NVDISASM", "nvdisasm"), "-c", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    (workdir / f"{name}.sass").write_text(text)
    return text


def counts(text: str) -> dict[str, int]:
    """Instructions by opcode (the mnemonic before its first dot), for the opcodes in ``COUNTED``."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
    return {op: sum(1 for o in ops if o == op) for op in COUNTED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="write the bytecode, cubins and SASS here")
    args = ap.parse_args()
    f32, bf16 = torch.float32, torch.bfloat16
    a2, f2, f1 = array(bf16, 2), array(f32, 2), array(f32, 1)
    A2, F2 = array(bf16, 2, True), array(f32, 2, True)  # as a launch specialises aligned tensors
    X3, W3 = array(bf16, 3, True, (64, 4, 64)), array(bf16, 3, True, (8, 4, 64))  # [rows, n, C] views (W: 24 rows)
    bm, bk, _ = proj_rms.BWD_TILE
    cases = {
        "proj_rms backward, bf16 (64, 256), 64 token blocks a split": (
            proj_rms._proj_rms_bwd, [a2, a2, f2, a2, array(f32, 3), a2, a2, a2, 24, 32, bm, bk, 64, True, 0, 1, 1, 1,
                                     0, False]),
        **{f"proj_rms backward with mix_aggregate's term, bf16 (64, 256), C 7168, on an {dev[7:11]}": (
            proj_rms._bwd_kernel(True, True, dev), [A2, A2, F2, A2, array(f32, 3, True), F2, A2, A2, 24, 32, bm, bk,
                                                    64, True, 1, 7168 // (bk // 2), 7168, 4, 0, False])
           for dev in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")},
        "the same, a program per channel block of the 4 streams (the streams form, both devices)": (
            proj_rms._bwd_kernel(True, True, "NVIDIA H200", True),
            [X3, W3, F2, X3, array(f32, 4, True, (1, 8, 4, 64)), array(f32, 2, True, (64, 4)), A2, X3, 24, 32, bm,
             bk // 4, 2, 64, True, False]),
        f"mapping compute_h backward, {mapping.BWD_H_BM} tokens": (
            mapping._mapping_bwd_h, [f2, f1, f1, f1, f1, f2, f2, f2, f2, f2, 4, 24, 32, mapping.BWD_H_BM, 28672]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for i, (title, (kernel, params)) in enumerate(cases.items()):
            c = counts(sass(kernel, params, workdir, f"k{i}"))
            print(f"{title}: " + ", ".join(f"{k} {v}" for k, v in c.items()))


if __name__ == "__main__":
    main()
