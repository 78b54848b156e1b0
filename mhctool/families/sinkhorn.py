"""The Sinkhorn-Knopp projection of the H_res logits onto doubly stochastic matrices: its
contract, knobs and conventions, its input families (each amplifying one knob), mhctool's
kernels and its bytes model."""
from __future__ import annotations

import torch

from mhctool.core.inputs import InputFamily, beside, log_uniform, rand, randn
from mhctool.families.contract import Cost, Family, Knob
from mhctool.references import mhc as ref


def _sk_random(shape, g, knobs):
    # per-matrix scale from 0.1 to 10: the easy regime and the moderately peaked one
    scale = log_uniform(g, -1, 1, shape.s, shape.b, 1, 1)
    logits = randn(g, shape.s, shape.b, shape.n, shape.n)
    return {"logits": logits * beside(logits, scale)}


def _sk_unit(shape, g, knobs):
    # unit normal logits: the benign regime (an mHC layer near initialisation); every row and
    # column sum stays far above eps, so eps changes the result by about eps relative
    return {"logits": randn(g, shape.s, shape.b, shape.n, shape.n)}


def _sk_large(shape, g, knobs):
    # logits of 90 to 300 with a spread of a few units: exp overflows every float format without
    # max subtraction, while the projected matrix is as well conditioned as for small logits
    s, b, n = shape.s, shape.b, shape.n
    level = 90 + 210 * rand(g, s, b, 1, 1)
    spread = 0.5 + 2.5 * rand(g, s, b, 1, 1)
    noise = randn(g, s, b, n, n)
    level, spread = beside(noise, level, spread)
    return {"logits": level + spread * noise}


def _sk_dead(shape, g, knobs):
    # one column per matrix (and one row on every other matrix) sits 20 to 80 below the rest:
    # after exponentiation its sums are far below eps, so eps and its mode decide the result
    s, b, n = shape.s, shape.b, shape.n
    logits = randn(g, s, b, n, n)
    offset = 20 + 60 * rand(g, s, b)
    col = torch.randint(0, n, (s, b), generator=g, device=g.device)
    row = torch.randint(0, n, (s, b), generator=g, device=g.device)
    cols = torch.nn.functional.one_hot(col, n).float()[..., None, :]
    rows = torch.nn.functional.one_hot(row, n).float()[..., :, None]
    every_other = (torch.arange(s * b, device=g.device).reshape(s, b) % 2).float()[..., None, None]
    offset, where = beside(logits, offset, (cols + every_other * rows).clamp(max=1))
    return {"logits": logits - offset[..., None, None] * where}


def _column_below(shape, g, least: float, width: float):
    """Unit normal logits with one column per matrix ``least`` to ``least + width`` below the rest
    (uniform over the matrices)."""
    s, b, n = shape.s, shape.b, shape.n
    logits = randn(g, s, b, n, n)
    offset = least + width * rand(g, s, b)
    col = torch.randint(0, n, (s, b), generator=g, device=g.device)
    cols = torch.nn.functional.one_hot(col, n).float()[..., None, :]
    offset, cols = beside(logits, offset, cols)
    return {"logits": logits - offset[..., None, None] * cols}


def _sk_underflow(shape, g, knobs):
    # one column per matrix 600 to 700 below the rest: exp underflows to zero there in fp32 (from
    # about 104 below), the regime training at a large rate reaches, and a backward that divides by
    # sum + eps a step multiplies the gradient by 1/eps into inf. This far below, float64 keeps the
    # column near zero too (its 20 iterations scale it by at most 1/eps each, 1e120 at eps 1e-6):
    # both functions agree to below fp32's smallest number, where nearer offsets would let float64
    # bring the column back and no fp32 kernel could follow
    return _column_below(shape, g, 600, 100)


def _sk_eps_sweep(shape, g, knobs):
    # one column per matrix 5 to 28 below the rest: the column sums sweep about 1e-2 down to
    # 1e-12, so every eps in that range changes some matrices' result (mhctool identify pins eps
    # with it)
    return _column_below(shape, g, 5, 23)


def _sk_clamp_sweep(shape, g, knobs):
    # a level per matrix from 3 to 80 (log-uniform) with a spread of one or two units: every bound
    # of a clamped exponential between shows on some matrices (those above it lose their
    # differences), and below 88 nothing overflows fp32 even without max subtraction
    s, b, n = shape.s, shape.b, shape.n
    level = 3.0 * (80.0 / 3.0) ** rand(g, s, b, 1, 1)
    spread = 1.0 + rand(g, s, b, 1, 1)
    noise = randn(g, s, b, n, n)
    level, spread = beside(noise, level, spread)
    return {"logits": (level + spread * noise).clamp(max=86.0)}


def _sk_near_perm(shape, g, knobs):
    # a permutation plus noise: Sinkhorn converges slowly, so iteration count and order matter
    s, b, n = shape.s, shape.b, shape.n
    perm = torch.argsort(rand(g, s, b, n), dim=-1)
    p = torch.nn.functional.one_hot(perm, n).float()
    noise = randn(g, s, b, n, n)
    return {"logits": 8.0 * beside(noise, p) + 0.5 * noise}


def _reference(logits, iters=20, eps=1e-6, **kw):
    return ref.sinkhorn(logits, iters, eps, **kw)


def _cost(shape, e: int, f: int) -> Cost:
    # the mapping path: logits are fp32 in the model whatever the activation dtype
    T, n = shape.tokens, shape.n
    return Cost(2 * T * n * n * f, 3 * T * n * n * f, 0.0, 0.0)


FAMILY = Family(
    "sinkhorn", ("logits",), ("logits",), (), ("out",),
    {
        "iters": Knob(20, kind=int),
        "eps": Knob(1e-6, kind=float, zero_ok=True),
        "stabilize": Knob("rowmax", ref.STABILIZE + ref.STABILIZE_RARE),
        # where the exponential is clamped: no meaning but under stabilize=clamp
        "clamp_at": Knob(20.0, kind=float, only_with=("stabilize", "clamp")),
        "eps_mode": Knob("add", ref.EPS_MODES),
        "order": Knob("row_first", ref.ORDERS),
        "domain": Knob("linear", ref.DOMAINS),
        # how its elementwise math is computed (fast: --use_fast_math): the native baseline's, as domain
        "math": Knob("ieee", ref.MATHS),
        # logits raised to at least this far below their matrix's max first (0: no floor)
        "floor": Knob(0.0, kind=float, zero_ok=True),
        # an early stop: a matrix stops once its row and column sums are within tol of one (0: none)
        "tol": Knob(0.0, kind=float, zero_ok=True),
        # an absolute floor on the exponentials, max(exp(x), exp_floor) (0: none)
        "exp_floor": Knob(0.0, kind=float, zero_ok=True),
    },
    ("iters", "eps"),
    _reference,
    # iters too: a kernel may fix its own count (declared, it is judged at it, called without it
    # where it takes no such parameter)
    conventions=("stabilize", "clamp_at", "eps_mode", "eps", "order", "domain", "math", "floor", "iters", "tol",
                 "exp_floor"),
    input_families={f.name: f for f in [
        InputFamily("random", "normal logits, per-matrix scale log-uniform in [0.1, 10]", _sk_random),
        InputFamily("unit_random", "unit normal logits: the benign regime, eps only nudges the sums", _sk_unit),
        InputFamily("large_logits", "logits 90 to 300, spread of a few units: exp overflows without max subtraction", _sk_large),
        InputFamily("dead_rows_cols", "a column (and a row on every other matrix) 20-80 below the rest: sums far below eps", _sk_dead),
        InputFamily("near_perm", "permutation * 8 + noise: slow convergence, order and iterations matter", _sk_near_perm),
    ]},
    # run only where a scenario names it: a regime in which the native implementation itself fails
    stress={"underflow_cols": InputFamily(
        "underflow_cols", "a column 600-700 below the rest: exp underflows to 0 in fp32; autograd through the "
        "native Sinkhorn returns NaN there, a backward must not", _sk_underflow)},
    probes={"eps_sweep": InputFamily(
        "eps_sweep", "a column per matrix 5-28 below the rest: its sums sweep 1e-2 to 1e-12", _sk_eps_sweep),
        "clamp_sweep": InputFamily(
            "clamp_sweep", "logits at a level of 3 to 80 per matrix, a spread of one or two: where an exponential "
            "clamped at a bound between loses the differences", _sk_clamp_sweep)},
    kernels={"triton": "mhctool.kernels.triton.sinkhorn:sinkhorn", "cutile": "mhctool.kernels.cutile.sinkhorn:sinkhorn"},
    cost=_cost,
)
