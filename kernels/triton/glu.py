"""Scaled MoE activations in Triton: SwiGLU, clamped SwiGLU (QGeGLU) and sReLU, forward and
backward, with an optional per-token scale and GLU interleaving.

GLU inputs ``x[M, 2F]`` hold the activated half ``a`` and the linear half ``b``: ``[a | b]``, or
blocks of ``INTERLEAVE`` columns ``[a0:k, b0:k, ak:2k, ...]``; sReLU takes ``x[M, F]``. Math is
fp32 whatever the input dtype; the output and ``dx`` round once to the input dtype, the scale's
gradient ``sum_j g_ij f_ij`` (``f`` unscaled) stays fp32 and is reduced over F on chip: one
program owns a block of rows and walks F.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhctool.core.poison import empty

from ._common import cast, cdiv, check_device, next_pow2, require_contiguous

SWIGLU, CLAMPED, SRELU = 0, 1, 2
_ACT = {"swiglu": SWIGLU, "clamped_swiglu": CLAMPED, "srelu": SRELU}


@triton.jit
def _columns(j, F, INTERLEAVE: tl.constexpr, GLU: tl.constexpr):
    """Columns of ``a`` and ``b`` in x for output columns ``j``."""
    if not GLU:
        return j, j
    if INTERLEAVE == 0:
        return j, j + F
    a_col = (j // INTERLEAVE) * (2 * INTERLEAVE) + j % INTERLEAVE
    return a_col, a_col + INTERLEAVE


@triton.jit
def _act_fwd(a, b, limit, alpha, offset, ACT: tl.constexpr):
    if ACT == 0:
        return a * tl.sigmoid(a) * b
    elif ACT == 1:
        ac = tl.minimum(a, limit)
        bc = tl.minimum(tl.maximum(b, -limit), limit) + offset
        return ac * tl.sigmoid(alpha * ac) * bc
    else:
        r = tl.maximum(a, 0.0)
        return r * r


@triton.jit
def _act_bwd(a, b, g, limit, alpha, offset, ACT: tl.constexpr):
    """``(f, df/da * g, df/db * g)`` with ``g`` the gradient of the unscaled output."""
    if ACT == 0:
        s = tl.sigmoid(a)
        silu = a * s
        return silu * b, g * b * (s + silu * (1.0 - s)), g * silu
    elif ACT == 1:
        ac = tl.minimum(a, limit)
        s = tl.sigmoid(alpha * ac)
        bc = tl.minimum(tl.maximum(b, -limit), limit) + offset
        da = tl.where(a <= limit, g * bc * (s + alpha * ac * s * (1.0 - s)), 0.0)
        db = tl.where((b >= -limit) & (b <= limit), g * ac * s, 0.0)
        return ac * s * bc, da, db
    else:
        r = tl.maximum(a, 0.0)
        return r * r, g * 2.0 * r, g * 0.0


@triton.jit
def _glu_fwd(x_ptr, s_ptr, out_ptr, M, F, limit, alpha, offset, ACT: tl.constexpr, GLU: tl.constexpr,
             INTERLEAVE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (j < F)[None, :]
    width = 2 * F if GLU else F
    a_col, b_col = _columns(j, F, INTERLEAVE, GLU)
    row_base = x_ptr + rows.to(tl.int64)[:, None] * width
    a = tl.load(row_base + a_col[None, :], mask=mask, other=0.0).to(tl.float32)
    if GLU:
        b = tl.load(row_base + b_col[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        b = a
    f = _act_fwd(a, b, limit, alpha, offset, ACT)
    if HAS_SCALE:
        f = f * tl.load(s_ptr + rows, mask=rows < M, other=0.0)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * F + j[None, :], cast(f, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(x_ptr, s_ptr, g_ptr, dx_ptr, ds_ptr, M, F, limit, alpha, offset, ACT: tl.constexpr,
             GLU: tl.constexpr, INTERLEAVE: tl.constexpr, HAS_SCALE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    width = 2 * F if GLU else F
    row_x = rows.to(tl.int64)[:, None] * width
    row_g = rows.to(tl.int64)[:, None] * F
    if HAS_SCALE:
        scale = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range(0, F, BLOCK_F):
        j = j0 + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (j < F)[None, :]
        a_col, b_col = _columns(j, F, INTERLEAVE, GLU)
        a = tl.load(x_ptr + row_x + a_col[None, :], mask=mask, other=0.0).to(tl.float32)
        if GLU:
            b = tl.load(x_ptr + row_x + b_col[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            b = a
        g = tl.load(g_ptr + row_g + j[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            f, da, db = _act_bwd(a, b, g * scale[:, None], limit, alpha, offset, ACT)
            ds += tl.sum(tl.where(mask, g * f, 0.0), axis=1)
        else:
            f, da, db = _act_bwd(a, b, g, limit, alpha, offset, ACT)
        tl.store(dx_ptr + row_x + a_col[None, :], cast(da, dx_ptr.dtype.element_ty), mask=mask)
        if GLU:
            tl.store(dx_ptr + row_x + b_col[None, :], cast(db, dx_ptr.dtype.element_ty), mask=mask)
    if HAS_SCALE:
        tl.store(ds_ptr + rows, ds, mask=rmask)


def _check(x: torch.Tensor, scale, act: int, interleave: int) -> int:
    check_device(x, scale)
    require_contiguous("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, width], got shape {tuple(x.shape)}")
    glu = act != SRELU
    if glu and x.shape[1] % 2:
        raise ValueError(f"a GLU input has an even width (2 * ffn), got {x.shape[1]}")
    f = x.shape[1] // 2 if glu else x.shape[1]
    if glu and interleave and f % interleave:
        raise ValueError(f"interleave {interleave} needs ffn to be a multiple of it; ffn = {f}")
    if interleave not in (0, 32) or (interleave and not glu):
        raise ValueError(f"interleave must be 0 or 32 (GLU activations only), got {interleave}")
    if scale is not None:
        require_contiguous("scale", scale)
        if scale.shape != (x.shape[0],) or scale.dtype != torch.float32:
            raise ValueError(f"scale must be fp32 [tokens] = ({x.shape[0]},), got {tuple(scale.shape)} {scale.dtype}")
    return f


def _blocks(f: int) -> tuple[int, int]:
    return 16, min(256, next_pow2(f))


class _ScaledActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, act, interleave, limit, alpha, offset):
        f = _check(x, scale, act, interleave)
        m = x.shape[0]
        out = empty((m, f), x.dtype, x.device)
        bm, bf = _blocks(f)
        _glu_fwd[(cdiv(m, bm), cdiv(f, bf))](
            x, scale if scale is not None else x, out, m, f, limit, alpha, offset, ACT=act, GLU=act != SRELU,
            INTERLEAVE=interleave, HAS_SCALE=scale is not None, BLOCK_M=bm, BLOCK_F=bf)
        ctx.save_for_backward(x, scale)
        ctx.cfg = (act, interleave, limit, alpha, offset, f)
        return out

    @staticmethod
    def backward(ctx, g):
        x, scale = ctx.saved_tensors
        act, interleave, limit, alpha, offset, f = ctx.cfg
        g = g.contiguous()
        m = x.shape[0]
        dx = empty(x.shape, x.dtype, x.device)
        ds = empty((m,), torch.float32, x.device) if scale is not None else None
        bm, bf = _blocks(f)
        _glu_bwd[(cdiv(m, bm),)](
            x, scale if scale is not None else x, g, dx, ds if ds is not None else dx, m, f, limit, alpha, offset,
            ACT=act, GLU=act != SRELU, INTERLEAVE=interleave, HAS_SCALE=scale is not None,
            BLOCK_M=bm, BLOCK_F=bf)
        return dx, ds, None, None, None, None, None


def swiglu(x, scale=None, interleave: int = 0):
    """``silu(a) * b``, times ``scale[token]`` when given."""
    return _ScaledActivation.apply(x, scale, SWIGLU, interleave, 0.0, 1.0, 0.0)


def clamped_swiglu(x, scale=None, interleave: int = 0, limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0):
    """``min(a, limit) * sigmoid(alpha * min(a, limit)) * (clamp(b, -limit, limit) + offset)``."""
    return _ScaledActivation.apply(x, scale, CLAMPED, interleave, float(limit), float(alpha), float(offset))


def srelu(x, scale=None):
    """``relu(x)^2``, times ``scale[token]`` when given."""
    return _ScaledActivation.apply(x, scale, SRELU, 0, 0.0, 1.0, 0.0)


def activation(name: str, x, scale=None, interleave: int = 0):
    """The named activation at its default knobs (what the grouped MLP uses)."""
    if name == "swiglu":
        return swiglu(x, scale, interleave)
    if name == "clamped_swiglu":
        return clamped_swiglu(x, scale, interleave)
    if name == "srelu":
        return srelu(x, scale)
    raise ValueError(f"activation must be one of {', '.join(_ACT)}, got {name!r}")
