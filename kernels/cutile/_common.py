"""Helpers shared by the cuTile kernels: launching on the current torch stream, layout checks,
and compiling a kernel to Tile IR without a GPU (what the CPU tests do)."""
from __future__ import annotations

import io

import cuda.tile as ct
import torch

from ..schedule import next_pow2


def launch(kernel, grid: tuple[int, ...], args: tuple) -> None:
    ct.launch(torch.cuda.current_stream(), grid, kernel, args)


def check_cuda(*tensors) -> None:
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise ValueError(f"the cuTile kernels take CUDA tensors; got a tensor on {t.device}")


def require_contiguous(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous for the cuTile kernels (shape {tuple(t.shape)}, "
                         f"strides {t.stride()}); call .contiguous() first")
    return t


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_CT_DTYPES = {torch.float32: ct.float32, torch.bfloat16: ct.bfloat16, torch.float16: ct.float16,
              torch.int64: ct.int64, torch.int32: ct.int32}


def array(dtype: torch.dtype, ndim: int, aligned: bool = False, shape_divisible_by=None):
    """The compile-time description of a contiguous torch tensor argument (for ``tile_ir``).
    ``aligned``: as a launch specialises a contiguous, aligned tensor (last stride 1, other strides
    multiples of 16 elements, base 256-byte aligned, shapes of whole 64-element tiles past 1-D, or
    ``shape_divisible_by`` per dimension), which offline SASS needs to show the loads a launch gets
    (TMA instead of scalar loads)."""
    from cuda.tile.compilation import ArrayConstraint
    if not aligned:
        return ArrayConstraint(_CT_DTYPES[dtype], ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                               alias_groups=(), may_alias_internally=False)
    if shape_divisible_by is None:
        shape_divisible_by = (64,) * ndim if ndim > 1 else 1
    return ArrayConstraint(_CT_DTYPES[dtype], ndim, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=(None,) * (ndim - 1) + (1,),
                           stride_divisible_by=(16,) * (ndim - 1) + (1,), shape_divisible_by=shape_divisible_by,
                           base_addr_divisible_by=256)


def scalar(dtype):
    """The compile-time description of a scalar argument (for ``tile_ir``)."""
    from cuda.tile.compilation import ScalarConstraint
    return ScalarConstraint(dtype)


BR = 32  # rows per step of sum_rows


def _column_sums(ws, c, BR, BC):
    """fp32 sums of ``ws``'s column tile c over its rows, ``BR`` rows a step in row order."""
    acc = ct.zeros((BC,), dtype=ct.float32)
    for r in range(ct.num_tiles(ws, axis=0, shape=(BR, BC))):
        acc = acc + ct.sum(ct.load(ws, index=(r, c), shape=(BR, BC), padding_mode=ct.PaddingMode.ZERO), axis=0)
    return acc


@ct.kernel
def sum_rows(ws, out, BR: ct.Constant[int], BC: ct.Constant[int]):
    """``out[c] = sum_r ws[r, c]`` in a fixed order: fp32 partials (per token block or split)
    -> out's dtype. Deterministic, unlike atomics."""
    c = ct.bid(0)
    ct.store(out, index=(c,), tile=_column_sums(ws, c, BR, BC).astype(out.dtype))


def rows_a_step(rows: int, br: int = BR) -> int:
    """``sum_rows``'s rows a step for ``rows`` partials: at most ``br``, no more than the rows need
    (a 32-row tile over 8 rows is three quarters padding), a power of two (cuTile's tiles are)."""
    return min(next_pow2(br), next_pow2(max(1, rows)))


# programs a SM asked for by the large sums: the projection backward's dW sum (8 rows of 688128
# fp32 columns at the paper shape) took 10.1 us with 2 against 11.3 without on an H200, same bits
SUM_OCCUPANCY = 2
sum_rows_occ2 = sum_rows.replace_hints(occupancy=SUM_OCCUPANCY)


@ct.kernel(occupancy=SUM_OCCUPANCY)
def sum_rows_pair(wa, oa, wb, ob, BRA: ct.Constant[int], BCA: ct.Constant[int], BRB: ct.Constant[int],
                  BCB: ct.Constant[int]):
    """``sum_rows`` of two partial arrays in one launch: programs [0, column tiles of ``wb``) sum
    ``wb`` into ``ob``, the rest ``wa`` into ``oa``; each in a fixed order. The short sum goes first, so
    that it runs beside the long one's first wave instead of after its last."""
    c = ct.bid(0)
    nb = ct.num_tiles(wb, axis=1, shape=(BRB, BCB))
    if c < nb:
        ct.store(ob, index=(c,), tile=_column_sums(wb, c, BRB, BCB).astype(ob.dtype))
    else:
        ct.store(oa, index=(c - nb,), tile=_column_sums(wa, c - nb, BRA, BCA).astype(oa.dtype))


def sum_partials(ws: torch.Tensor, out: torch.Tensor, bc: int, br: int = BR, kernel=sum_rows) -> None:
    """``out[c] = sum_r ws[r, c]`` (``ws`` fp32 ``[rows, cols]``) with ``sum_rows`` (or ``kernel``, a
    hinted copy of it), ``bc`` columns and ``rows_a_step(rows, br)`` rows a step per program; columns
    of ``out`` past its end are not stored."""
    launch(kernel, (cdiv(ws.shape[1], bc),), (ws, out, rows_a_step(ws.shape[0], br), bc))


def sum_partials_pair(long: tuple, short: tuple) -> None:
    """Two ``sum_partials`` in one launch (``sum_rows_pair``): each of ``long`` and ``short`` is
    ``(ws, out, bc, br)``; ``short`` (a few columns) is summed beside ``long``'s first wave."""
    (wa, oa, bca, bra), (wb, ob, bcb, brb) = long, short
    grid = cdiv(wa.shape[1], bca) + cdiv(wb.shape[1], bcb)
    launch(sum_rows_pair, (grid,), (wa, oa, wb, ob, rows_a_step(wa.shape[0], bra), bca, rows_a_step(wb.shape[0], brb), bcb))


def tile_ir(kernel, params: list) -> bytes:
    """Compile ``kernel`` for one signature to Tile IR bytecode on the host (no GPU, no tileiras):
    the front end's type checking runs, so a kernel that would not compile fails here."""
    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel
    buf = io.BytesIO()
    sig = KernelSignature(params, CallingConvention.cutile_python_v1())
    export_kernel(kernel, [sig], buf, output_format="tileir_bytecode", bytecode_version="13.3")
    return buf.getvalue()
