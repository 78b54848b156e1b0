"""Triton kernels on the CPU through the interpreter (TRITON_INTERPRET=1, set in conftest)."""
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import triton
import triton.language as tl
from typer.testing import CliRunner

from mhctool.cli.app import app
from mhctool.kernels.triton import h_aggregate as tha
from mhctool.kernels.triton import h_post_bda as thp
from mhctool.kernels.triton import mapping as tmap
from mhctool.kernels.triton import proj_rms as tpr
from mhctool.kernels.triton import sinkhorn as tsk
from mhctool.kernels.triton._common import exp as kernel_exp
from mhctool.core.poison import poisoning
from mhctool.references import mhc as ref

IMPLS = Path(__file__).resolve().parents[1] / "impls"  # loaded by file path, never as a package
DEFECTS = IMPLS / "defects.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; the GPU runs test_gpu.py")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _seeded():
    """Fresh random inputs in every test, but the same ones on every run (no flaky tolerances)."""
    torch.manual_seed(20261122)


@pytest.mark.slow  # about 220 s on 2 cores: CI keeps to 15 minutes; per-kernel tests, the gate and the quick start cover the kernels
def test_parity_all_triton_passes_under_the_interpreter(tmp_path):
    out = tmp_path / "r.parquet"
    res = runner.invoke(app, ["parity", "--kernel", "all", "--impl", "triton", "--device", "cpu", "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = [r for r in pq.read_table(out).to_pylist() if r["impl"] == "triton"]
    from mhctool.families import KERNELS
    assert {r["kernel"] for r in rows} == set(KERNELS)
    unwritten = [r for r in rows if r["metric"] == "unwritten"]
    assert unwritten and all(r["value"] == 0 and r["passed"] for r in unwritten)
    assert {r["direction"] for r in unwritten} == {"fwd", "bwd"}


def _grads(fn, inputs, seed=0):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    diff = [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad]
    return outs, torch.autograd.grad(outs, diff, ups), ups


def _leaf(*shape, dtype=torch.float32, scale=1.0, positive=False):
    t = torch.rand(*shape) if positive else torch.randn(*shape) * scale
    return t.to(dtype).requires_grad_()


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("knobs", [{}, {"stabilize": "none"}, {"stabilize": "softmax"}, {"eps_mode": "clamp"},
                                   {"order": "col_first"}, {"stabilize": "softmax", "order": "col_first"}])
def test_sinkhorn_every_knob_and_n_matches_float64(n, knobs):
    L = _leaf(37, n, n, scale=2.0)  # 37 tokens: not a multiple of the token tile
    with poisoning():
        (out,), (g,), (up,) = _grads(lambda t: tsk.sinkhorn(t, 6, 1e-4, **knobs), [L])
    Ld = L.detach().double().requires_grad_()
    r = ref.sinkhorn(Ld, 6, 1e-4, **knobs)
    (rg,) = torch.autograd.grad(r, Ld, up.double())
    assert torch.isfinite(out).all() and torch.isfinite(g).all()  # poison would be NaN
    torch.testing.assert_close(out.double(), r, rtol=0, atol=2e-6)
    torch.testing.assert_close(g.double(), rg, rtol=0, atol=2e-6)


@pytest.mark.parametrize("shape", [(5, 3, 4, 67), (2, 1, 3, 1030), (1, 3, 8, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_h_aggregate_matches_float64(shape, dtype):
    s, b, n, c = shape
    x, h = _leaf(s, b, n, c, dtype=dtype), _leaf(s, b, n, positive=True)
    with poisoning():
        (out,), (gx, gh), (up,) = _grads(tha.h_aggregate, [x, h])
    xd, hd = x.detach().double().requires_grad_(), h.detach().double().requires_grad_()
    r = ref.h_aggregate(xd, hd)
    rx, rh = torch.autograd.grad(r, (xd, hd), up.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b_ in ((out, r), (gx, rx), (gh, rh)):
        assert torch.isfinite(a).all()
        assert ((a.double() - b_).abs().max() / b_.abs().max()) < tol
    assert gh.dtype == torch.float32 and ((gh.double() - rh).abs().max() / rh.abs().max()) < 1e-5  # fp32 accumulation


@pytest.mark.parametrize("shape", [(5, 3, 4, 67), (70, 1, 4, 33), (1, 3, 8, 5), (2, 2, 3, 300)])
@pytest.mark.parametrize("transpose_res", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_h_post_bda_matches_float64(shape, transpose_res, with_bias):
    s, b, n, c = shape
    ins = [_leaf(s, b, n, n, positive=True), _leaf(s, b, n, c), _leaf(s, b, n, positive=True), _leaf(s, b, c)]
    bias = _leaf(c) if with_bias else None
    with poisoning():
        outs, grads, (up,) = _grads(
            lambda *a: thp.h_post_bda(*a[:4], a[4] if with_bias else None, transpose_res=transpose_res),
            ins + ([bias] if with_bias else []))
    dd = [i.detach().double().requires_grad_() for i in ins + ([bias] if with_bias else [])]
    r = ref.h_post_bda(*dd[:4], dd[4] if with_bias else None, transpose_res=transpose_res)
    rgrads = torch.autograd.grad(r, dd, up.double())
    for a, b_ in zip((outs[0], *grads), (r, *rgrads)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b_, rtol=0, atol=5e-6 * max(1.0, b_.abs().max().item()))


@pytest.mark.parametrize("shape", [(37, 1, 4, 67), (3, 5, 4, 200), (1, 1, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transpose_res", [False, True])
def test_h_post_bda_n4_backward_matches_float64(shape, dtype, transpose_res):
    """n = 4 takes its own backward (per-stream tiles, token groups; bf16 the tensor-core kernel,
    fp32 the FMA one): here with 64-channel blocks and 8-token groups, so C blocks, groups and
    token tiles end part-way (37 tokens: 4 full groups and one of 5; 200 channels: 4 blocks, the
    last of 8). Outputs and workspaces NaN-poisoned."""
    assert thp.backward_tile4(dtype, dtype != torch.float32) == ((4, 64, 8, 4, 1) if dtype == torch.float32 else (64, 8, 1, 1))
    _check_n4_backward(shape, dtype, transpose_res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_h_post_bda_n4_tensor_core_backward_matches_float64(dtype, with_bias):
    """The tensor-core kernel at the GPU's tile class (one warp, one token a step, 512 channels,
    two stages) over 700 channels (a block and a part) and 37 tokens in 32-token groups, with and
    without a bias; under the interpreter its product's operands are upcast to fp32, so what is
    checked is its indexing (the 16 dH partials where h_res keeps them, the two dh_post columns)."""
    assert len(thp.BWD4_TILE_TC) == 4 and thp.BWD4_TILE_TC[0] == 512
    _check_n4_backward((37, 1, 4, 700), dtype, True, tile_=(512, 32, 1, 2), with_bias=with_bias)


@pytest.mark.parametrize("tile", [None, (2, 64, 24, 4, 1)])
def test_h_post_bda_n4_finish_is_batch_invariant(tile):
    """The n = 4 backwards sum their dH / dh_post partials themselves (the last program of a token
    group, elected by a counter, adds the C blocks' partials in block order, 16 tokens at a time):
    a token's gradients must have the same bits in a batch of 37 tokens as in a batch of its first
    11 or 3, and two runs must agree bit for bit. The tensor-core kernel (the interpreter's default
    tile): five 8-token groups, the bias partials in two supergroups of 3 and 2; the FMA kernel: two
    24-token groups of 2-token steps, finished 16 tokens and then 8 (or the part there is)."""
    g = torch.Generator().manual_seed(5)
    h, hp = torch.rand(37, 1, 4, 4, generator=g), torch.rand(37, 1, 4, generator=g)
    x, go = (torch.randn(37, 1, 4, 200, generator=g).to(torch.bfloat16) for _ in range(2))
    y, bias = torch.randn(37, 1, 200, generator=g).to(torch.bfloat16), torch.randn(200, generator=g).to(torch.bfloat16)
    with poisoning():
        full = thp.h_post_bda_backward(h, x, hp, y, bias, go, True, tile_=tile)
        again = thp.h_post_bda_backward(h, x, hp, y, bias, go, True, tile_=tile)
        for k in (11, 3):
            part = thp.h_post_bda_backward(h[:k], x[:k], hp[:k], y[:k], bias, go[:k], True, tile_=tile)
            for name, a, b in zip(("h_res", "x", "h_post", "y"), full[:4], part[:4]):
                assert torch.equal(a[:k], b), (name, k)
    for a, b in zip(full, again):
        assert torch.equal(a, b)
    want = (go.double() * hp.double()[..., None]).sum((0, 1, 2))  # the bias gradient: sum over tokens and streams
    assert ((full[4].double() - want).abs().max() / want.abs().max()) < 2 ** -8


def test_h_post_bda_n4_mixed_dtypes_take_the_fma_kernel():
    """A bf16 x with an fp32 bias is not the tensor-core kernel's case: the FMA kernel runs, and a
    tensor-core tile asked for is refused with a sentence."""
    x16, b32 = torch.randn(5, 3, 4, 67).to(torch.bfloat16), torch.randn(67)
    assert not thp._tc_operands(x16, x16[:, :, 0], b32, x16)
    _check_n4_backward((5, 3, 4, 67), torch.bfloat16, False, bias_dtype=torch.float32)
    x = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="16-bit"):
        thp.h_post_bda_backward(torch.rand(2, 1, 4, 4), x, torch.rand(2, 1, 4), torch.randn(2, 1, 8), None, x,
                                tile_=(64, 8, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_h_post_bda_n4_backward_one_token_tiles_match_float64(dtype):
    """The GPU's tile class (``BWD4_TILE``: one token a step, one warp, pipelined stages) at an
    odd shape: 128-channel blocks over 200 channels, 8-token groups over 13 tokens."""
    assert thp.BWD4_TILE[0] == thp.BWD4_TILE_FP32[0] == 1
    _check_n4_backward((13, 1, 4, 200), dtype, False, tile_=(1, 128, 8, 1, 3))


def _check_n4_backward(shape, dtype, transpose_res, tile_=None, with_bias=True, bias_dtype=None):
    s, b, n, c = shape
    h, x, hp, y = torch.rand(s, b, n, n), torch.randn(s, b, n, c).to(dtype), torch.rand(s, b, n), torch.randn(s, b, c).to(dtype)
    bias, go = torch.randn(c).to(bias_dtype or dtype) if with_bias else None, torch.randn(s, b, n, c).to(dtype)
    with poisoning():
        four = thp.h_post_bda_backward(h, x, hp, y, bias, go, transpose_res, tile_=tile_)
    dd = [t.double().requires_grad_() for t in (h, x, hp, y, bias) if t is not None]
    r = ref.h_post_bda(*dd[:4], dd[4] if with_bias else None, transpose_res=transpose_res)
    want = torch.autograd.grad(r, dd, go.double())
    assert four[4] is None if not with_bias else four[4].dtype == bias.dtype
    # 16-bit outputs (dx, dy, dbias) carry one rounding: 2^-8 of the largest; fp32 sums over C and tokens
    for name, a, w in zip(("h_res", "x", "h_post", "y", "bias"), four, want):
        assert torch.isfinite(a).all(), name
        tol = 1e-5 if a.dtype == torch.float32 else 2 ** -8
        assert ((a.double() - w).abs().max() / w.abs().max().clamp_min(1e-30)) < tol, name


def test_h_post_bda_n4_tile_is_refused_for_other_n():
    x = torch.randn(2, 1, 3, 8)
    with pytest.raises(ValueError, match="n = 4"):
        thp.h_post_bda_backward(torch.rand(2, 1, 3, 3), x, torch.rand(2, 1, 3), torch.randn(2, 1, 8), None, x,
                                tile_=(4, 64, 8, 4, 1))
    with pytest.raises(ValueError, match="n = 4"):
        thp.h_post_bda_forward(torch.rand(2, 1, 3, 3), x, torch.rand(2, 1, 3), torch.randn(2, 1, 8), tile_=(512, 16, 1, 3))


@pytest.mark.parametrize("tile", [None, (512, 16, 1, 3), (1024, 32, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_h_post_bda_n4_forward_matches_float64(tile, dtype):
    """The n = 4 forward kernel (the default for n = 4; the interpreter's tile and the GPU's: a C block
    wider than C's tail, token groups that end inside the batch), transposed or not, with and
    without the bias, NaN-poisoned output."""
    s, b, c = 37, 1, 700
    h, x, hp, y = torch.rand(s, b, 4, 4), torch.randn(s, b, 4, c).to(dtype), torch.rand(s, b, 4), torch.randn(s, b, c).to(dtype)
    for bias, transpose_res in ((torch.randn(c).to(dtype), False), (None, True)):
        with poisoning():
            out = thp.h_post_bda_forward(h, x, hp, y, bias, transpose_res, tile_=tile)
        dd = [t.double() if t is not None else None for t in (h, x, hp, y, bias)]
        want = ref.h_post_bda(*dd, transpose_res=transpose_res)
        assert out.dtype == dtype and torch.isfinite(out).all()
        tol = 1e-6 if dtype == torch.float32 else 2 ** -8
        assert ((out.double() - want).abs().max() / want.abs().max()) < tol


def test_h_post_bda_n4_forward_grid_stays_within_cuda_limits(monkeypatch):
    """CUDA takes at most 65535 blocks on a grid's second and third axes. The n = 4 forward runs one
    token a program on a GPU and had the tokens on the second axis, so it failed to launch past
    65535 tokens (the paper shape has 32768); its grid is now one axis, C blocks fastest. The
    launch is recorded here, not run (the interpreter knows no grid limits)."""
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(thp, "_h_post_bda_fwd4", Recorder())
    t, c = 70000, 8  # one C block a token (small inputs: nothing runs)
    thp.h_post_bda_forward(torch.rand(t, 1, 4, 4), torch.randn(t, 1, 4, c), torch.rand(t, 1, 4), torch.randn(t, 1, c),
                           tile_=thp.FWD4_TILE)
    (grid,) = grids
    assert len(grid) == 1 and grid[0] == t < 2 ** 31


@pytest.mark.parametrize("mkn", [(39, 268, 24), (70, 130, 8), (5, 40, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_proj_rms_matches_float64(mkn, dtype):
    m, k, n = mkn
    x, w = _leaf(m, k, dtype=dtype), (torch.randn(n, k) / k ** 0.5).to(dtype).requires_grad_()
    with poisoning():
        (p, r), (gx, gw), ups = _grads(tpr.proj_rms, [x, w])
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rp, rr = ref.proj_rms(xd, wd)
    rx, rw = torch.autograd.grad((rp, rr), (xd, wd), [u.double() for u in ups])
    assert p.dtype == r.dtype == torch.float32  # the fp32 mapping path
    for a, b_, tol in ((p, rp, 1e-6), (r, rr, 1e-6), (gx, rx, 1e-5 if dtype == torch.float32 else 1e-2),
                       (gw, rw, 1e-5 if dtype == torch.float32 else 1e-2)):
        assert torch.isfinite(a).all()
        assert ((a.double() - b_).abs().max() / b_.abs().max()) < tol


@pytest.mark.parametrize("mkn", [(39, 268, 24), (70, 300, 8), (130, 260, 80), (39, 267, 24), (1, 268, 24)])
def test_proj_rms_tensor_core_backward_indexing_matches_float64(mkn):
    """The bf16/fp16 backward (``_split_grad`` then ``_proj_rms_bwd_packed``: two pieces of the
    gradient on tensor cores) runs only on a GPU by default; forced on fp32 operands here, its
    pieces are exact and the interpreter's products fp32, so what is checked is its indexing and
    the split: row blocks that are not multiples of 128, K that is not a multiple of 128 (odd at
    267), two token splits, NaN-poisoned outputs (the split gradient and factor included), and a
    small tile with several splits of several row blocks; and one token (Triton makes an integer
    argument of 1 a compile-time constant: the batch-invariance check's one-token run)."""
    m, k, n = mkn
    x, w = torch.randn(m, k), torch.randn(n, k) / k ** 0.5
    _, r, rms = tpr.proj_rms_forward(x, w)
    gp, gr = torch.randn(m, n), torch.randn(m)
    with poisoning():
        got = [tpr.proj_rms_backward(x, w, r, rms, gp, gr, lowp=True, tile_=t) for t in (None, (32, 64, 3, 4, 2))]
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    rp, rr = ref.proj_rms(xd, wd)
    rx, rw = torch.autograd.grad((rp, rr), (xd, wd), (gp.double(), gr.double()))
    for gx, gw in got:
        for a, b_ in ((gx, rx), (gw, rw)):
            assert torch.isfinite(a).all()
            assert ((a.double() - b_).abs().max() / b_.abs().max()) < 1e-5


def _assert_tf32(got: dict, want: dict, ieee: dict) -> None:
    """Each result finite and within 2e-6 (relative to its largest) of the float64 product of the
    TF32-rounded operands, and, where the IEEE product is given, more than 2e-5 from it."""
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
        scale = want[name].abs().max()
        assert (g.double() - want[name]).abs().max() / scale < 2e-6, name
        if name in ieee:
            assert (g.double() - ieee[name]).abs().max() / scale > 2e-5, name


@pytest.mark.parametrize("mkn", [(39, 268, 24), (70, 130, 8)])
def test_proj_rms_tf32_variant_multiplies_operands_rounded_to_tf32(mkn):
    """``triton-tf32``: every product (proj, dx's g W, dW's g^T x) is the float64 product of
    operands rounded to TF32, summed in fp32; the RMS term takes x as it is. Checked against that
    in float64 (tight), and against the IEEE product (far: the rounding is really there)."""
    from mhctool.kernels.torch.mhc import round_to_tf32
    m, k, n = mkn
    x, w = _leaf(m, k), (torch.randn(n, k) / k ** 0.5).requires_grad_()
    with poisoning():
        (p, r), (gx, gw), (gp, gr) = _grads(tpr.proj_rms_tf32, [x, w])
    x64, xt, wt, gt = x.detach().double(), round_to_tf32(x.detach()).double(), round_to_tf32(w.detach()).double(), round_to_tf32(gp).double()
    rms = x64.norm(dim=1) / k ** 0.5
    coef = -gr.double() * (1 / (rms + 1e-6)) ** 2 / (k * rms)
    want = {"proj": xt @ wt.T, "dx": gt @ wt + coef[:, None] * x64, "dW": gt.T @ xt}
    ieee = {"proj": x64 @ w.detach().double().T, "dW": gp.double().T @ x64}
    _assert_tf32({"proj": p, "dx": gx, "dW": gw}, want, ieee)


@pytest.mark.parametrize("mkn", [(39, 268, 24), (70, 300, 8)])
def test_proj_rms_tf32_backward_through_the_two_piece_kernel(mkn):
    """On a GPU the TF32 variant's bf16 backward is the two-piece kernel with the gradient rounded to
    TF32 (its 11 bits are two bf16 pieces exactly). Forced on here with bf16-valued fp32 operands
    (exact in TF32, as bf16 ones are): dx and dW are the float64 products of the rounded gradient,
    and far from those of the unrounded one."""
    from mhctool.kernels.torch.mhc import round_to_tf32
    m, k, n = mkn
    x = torch.randn(m, k).bfloat16().float()
    w = (torch.randn(n, k) / k ** 0.5).bfloat16().float()
    _, r, rms = tpr.proj_rms_forward(x, w)
    gp, gr = torch.randn(m, n), torch.randn(m)
    with poisoning():
        gx, gw = tpr.proj_rms_backward(x, w, r, rms, gp, gr, lowp=True, tf32=True)
    x64, w64, gt = x.double(), w.double(), round_to_tf32(gp).double()
    coef = -gr.double() * r.double() ** 2 / (k * rms.double())
    want = {"dx": gt @ w64 + coef[:, None] * x64, "dW": gt.T @ x64}
    ieee = {"dx": gp.double() @ w64 + coef[:, None] * x64, "dW": gp.double().T @ x64}
    _assert_tf32({"dx": gx, "dW": gw}, want, ieee)


def test_triton_tf32_is_judged_at_tf32_and_asked_for_by_name(tmp_path):
    out = tmp_path / "r.parquet"
    sc = tmp_path / "sc.toml"  # long_k (K of 8192) was most of the interpreter's time and shows nothing more of TF32
    sc.write_text('name = "tf32"\n' + "".join(f'[[cases]]\nkernel = "{k}"\nshapes = ["7x2x4x45"]\ndtypes = ["fp32"]\n'
                          f'families = ["random", "tiny_norm", "huge_norm"]\n' for k in ("proj_rms", "mapping")))
    res = runner.invoke(app, ["parity", "--kernel", "proj_rms,mapping", "--impl", "triton-tf32", "--device", "cpu",
                              "--scenario", str(sc), "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    rows = [r for r in pq.read_table(out).to_pylist() if r["impl"] == "triton-tf32"]
    assert {r["kernel"] for r in rows} == {"proj_rms", "mapping"} and {r["direction"] for r in rows} == {"fwd", "bwd"}
    assert all(r["precision"] == "tf32" for r in rows)
    verdicts = [r["passed"] for r in rows if r["passed"] is not None]  # the rest are informational
    assert verdicts and all(verdicts)
    # not run by default (parity and the gate keep to IEEE), and a kernel without a TF32 variant says so
    from mhctool.registry.specs import resolve_impls
    assert "triton-tf32" not in {i.name for i in resolve_impls("proj_rms", None)}
    (absent,) = resolve_impls("h_aggregate", ["triton-tf32"])
    assert "no Triton TF32 implementation of h_aggregate" in absent.unavailable()


@pytest.mark.parametrize("mkn", [(39, 268, 4), (70, 130, 2), (5, 40, 8)])
def test_mapping_path_matches_float64(mkn):
    """proj_rms with compute_h fused after it: H_pre, H_post and the Sinkhorn logits."""
    m, k, n = mkn
    nh = n * n + 2 * n
    ins = [_leaf(m, k), (torch.randn(nh, k) / k ** 0.5).requires_grad_(), (0.5 + torch.rand(3)).requires_grad_(), _leaf(nh)]
    with poisoning():
        outs, grads, ups = _grads(tmap.mapping, ins)
    dd = [t.detach().double().requires_grad_() for t in ins]
    refs = ref.mapping(*dd)
    rgrads = torch.autograd.grad(refs, dd, [u.double() for u in ups])
    assert [tuple(o.shape) for o in outs] == [(m, n), (m, n), (m, n, n)]
    names = ("h_pre", "h_post", "h_res_logits", "grad_x2d", "grad_weight", "grad_alpha", "grad_h_bias")
    for name, a, b_ in zip(names, (*outs, *grads), (*refs, *rgrads)):
        assert torch.isfinite(a).all()
        # grad_alpha: 3 sums of M * (n^2 + 2n) products that cancel; fp32 rounding of the terms
        # shows relative to the (smaller) result, by up to about 3e-6 here
        tol = 2e-5 if name == "grad_alpha" else 2e-6
        assert ((a.double() - b_).abs().max() / b_.abs().max()) < tol, name


@pytest.mark.parametrize("tile", [(16, 128, 2), (32, 64, 4)])
def test_the_mapping_forward_at_another_tile_matches_float64_and_writes_every_row(tile):
    """The forward's tile is a parameter (dev/step_profile.py times them): at a block of 16 or 32
    rows, rows not a multiple of it and K not one of BLOCK_K, every output is written (poisoned
    otherwise) and within the default's error of float64."""
    torch.manual_seed(1)
    m, k, n = 37, 200, 4
    nh = n * n + 2 * n
    x, w, a, hb = torch.randn(m, k), torch.randn(nh, k) / k ** 0.5, 0.5 + torch.rand(3), 0.1 * torch.randn(nh)
    refs = ref.mapping(x.double(), w.double(), a.double(), hb.double())
    with poisoning():
        outs, _ = tmap.mapping_forward(x, w, a, hb, tile_=tile)
    for o, r in zip(outs, refs):
        assert torch.isfinite(o).all() and ((o.double() - r).abs().max() / r.abs().max()) < 2e-6


@pytest.mark.parametrize("mkn, agg", [((39, 268, 4), False), ((130, 260, 2), False), ((70, 148, 4), True), ((1, 40, 2), True)])
def test_mapping_backward_with_the_split_in_compute_h_matches_float64(mkn, agg):
    """On the tensor-core path the mapping backward's compute_h kernel writes the projection
    gradient's two pieces and dx's factor itself (no ``_split_grad``), and its alpha / bias
    partials are summed in dW's sum's launch. Forced on fp32 operands under the interpreter (exact
    pieces): against float64 and against the generic path, NaN-poisoned, at token counts off the
    64-token block, with and without mix_aggregate's aggregation term (K = n C, C = 37 and 20)."""
    m, k, n = mkn
    nh = n * n + 2 * n
    x, w = torch.randn(m, k), torch.randn(nh, k) / k ** 0.5
    alpha, hb = 0.5 + torch.rand(3), 0.1 * torch.randn(nh)
    (pre, post, logits), saved = tmap.mapping_forward(x, w, alpha, hb)
    ups = (torch.randn(m, n), torch.randn(m, n), torch.randn(m, n, n))
    ag = (pre, torch.randn(m, k // n)) if agg else None
    with poisoning():
        got = tmap.mapping_backward(x, w, alpha, hb, saved, ups, agg=ag, lowp=True)
        generic = tmap.mapping_backward(x, w, alpha, hb, saved, ups, agg=ag, lowp=False)
    dd = [t.double().requires_grad_() for t in (x, w, alpha, hb)]
    outs = list(ref.mapping(*dd))
    gouts = [u.double() for u in ups]
    if agg:  # the aggregation's gradient of x enters dx as h_pre[t, i] * grad_out[t, c]
        outs.append((dd[0].view(m, n, k // n) * pre.double()[:, :, None]).sum(1))
        gouts.append(ag[1].double())
    want = torch.autograd.grad(outs, dd, gouts)
    for name, a, g_, b_ in zip(("dx", "dw", "d_alpha", "d_bias"), got, generic, want):
        assert torch.isfinite(a).all(), name
        tol = 2e-5 if name == "d_alpha" else 2e-6
        assert ((a.double() - b_).abs().max() / b_.abs().max()) < tol, name
        assert ((a.double() - g_.double()).abs().max() / b_.abs().max()) < tol, name
    assert torch.equal(got[2], generic[2]) and torch.equal(got[3], generic[3])  # one compute_h, one sum


def test_mapping_refuses_a_weight_that_is_not_n2_plus_2n_rows():
    with pytest.raises(ValueError, match="n\\^2 \\+ 2n"):
        tmap.mapping(torch.randn(4, 8), torch.randn(7, 8), torch.ones(3), torch.zeros(7))


def test_layouts_the_kernels_do_not_take_are_refused():
    x = torch.randn(3, 2, 8, 4).transpose(-1, -2)  # [3, 2, 4, 8] but not contiguous
    with pytest.raises(ValueError, match="x must be contiguous"):
        tha.h_aggregate(x, torch.rand(3, 2, 4))
    with pytest.raises(ValueError, match="x2d must be contiguous"):
        tpr.proj_rms(torch.randn(24, 16).t(), torch.randn(8, 24))
    with pytest.raises(ValueError, match="square matrices"):
        tsk.sinkhorn(torch.randn(5, 4, 3))
    with pytest.raises(ValueError, match="h_res has shape"):
        thp.h_post_bda(torch.rand(2, 1, 3, 3), torch.randn(2, 1, 4, 8), torch.rand(2, 1, 4), torch.randn(2, 1, 8))


def test_the_megatron_view_layout_is_taken():
    """x as the [s, b, n*C] activation viewed as [s, b, n, C] (what Megatron passes)."""
    flat = torch.randn(6, 2, 4 * 33)
    x = flat.view(6, 2, 4, 33)
    h = torch.rand(6, 2, 4)
    torch.testing.assert_close(tha.h_aggregate(x, h), ref.h_aggregate(x, h))


def test_unwritten_elements_are_caught(tmp_path):
    """A kernel that allocates its output poisoned and skips the last token fails `unwritten`."""
    out = tmp_path / "r.parquet"
    res = runner.invoke(app, ["parity", "--kernel", "sinkhorn", "--device", "cpu", "--dtype", "fp32",
                              "--impl", f"{DEFECTS}:sinkhorn_skips_last_token", "-o", str(out), "--no-hint"])
    assert res.exit_code == 1
    rows = pq.read_table(out).to_pylist()
    bad = [r for r in rows if r["metric"] == "unwritten" and r["passed"] is False]
    assert bad and all(r["value"] == 16 for r in bad if r["shape"] == "33x2x4x1" and r["direction"] == "fwd")


def test_poisoning_reaches_other_threads():
    """autograd runs a CUDA backward on its own device thread: the poisoning flag is process-wide,
    or gradients allocated there come unpoisoned and an unwritten element passes unseen (a
    ContextVar did not reach that thread on an H200; the GPU side: tests/kernels/test_gpu.py)."""
    import threading

    from mhctool.core.poison import empty, enabled, poisoning
    seen = {}

    def probe():
        seen["on"], seen["t"] = enabled(), empty((4,), torch.float32, "cpu")

    def in_thread():
        t = threading.Thread(target=probe)
        t.start()
        t.join()

    with poisoning():
        in_thread()
        assert seen["on"] and torch.isnan(seen["t"]).all()
        with poisoning(False):
            in_thread()
            assert not seen["on"]
        in_thread()
        assert seen["on"]
    in_thread()
    assert not seen["on"]


@pytest.mark.parametrize("n", [3, 5])
def test_sinkhorn_backward_stays_finite_when_n_is_not_a_power_of_two(n):
    """Regression: padded entries of the [NP, NP] tile picked up (0 - sum) / eps per backward
    step and overflowed after a few iterations; inf * 0 then turned every gradient into NaN."""
    L = torch.randn(19, n, n).requires_grad_()
    y = tsk.sinkhorn(L, 20)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, [L], g)
    Ld = L.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(ref.sinkhorn(Ld, 20), [Ld], g.double())
    assert torch.isfinite(gx).all()
    assert (gx.double() - gr).abs().max() < 1e-5


@pytest.mark.parametrize("knobs", [{}, {"stabilize": "none"}, {"stabilize": "softmax"}, {"eps_mode": "clamp"},
                                   {"order": "col_first"}])
def test_sinkhorn_backward_stays_finite_where_a_column_underflows(knobs, underflowing_logits):
    """Regression: the backward carried ``(g - sum(g * y)) / (sum + eps)`` a step, so a column
    whose entries underflowed multiplied the gradient by 1 / eps = 1e6 each step, overflowed fp32
    within the 20 iterations and turned every gradient of the matrix into NaN (training at lr 0.05
    reached such logits). Carried as the gradient times each step's output, no factor exceeds 1."""
    L, Ld = underflowing_logits(37, 4, knobs)
    with poisoning():
        (out,), (g,), (up,) = _grads(lambda t: tsk.sinkhorn(t, 20, 1e-6, **knobs), [L])
    r = ref.sinkhorn(Ld, 20, 1e-6, **knobs)
    (rg,) = torch.autograd.grad(r, Ld, up.double())
    assert torch.isfinite(rg).all()
    assert torch.isfinite(out).all() and torch.isfinite(g).all()
    torch.testing.assert_close(out.double(), r, rtol=0, atol=2e-6)
    torch.testing.assert_close(g.double(), rg, rtol=0, atol=2e-6)


def test_the_underflow_scenario_fails_natives_backward_and_passes_tritons(tmp_path):
    """`parity --scenario underflow`: autograd through the native Sinkhorn returns NaN where a
    column underflows; mhctool's Triton kernel stays finite and within the tolerance native is held
    to (kappa x native's inf would bound nothing)."""
    out = tmp_path / "u.parquet"
    res = runner.invoke(app, ["parity", "--scenario", "underflow", "--impl", "triton", "--device", "cpu",
                              "--shape", "9x2x3x1", "-o", str(out)])
    assert res.exit_code == 1, res.output
    rows = [r for r in pq.read_table(out).to_pylist() if r["passed"] is not None]
    assert {r["family"] for r in rows} == {"underflow_cols"}
    assert all(r["passed"] for r in rows if r["impl"] == "triton")
    native_bwd = {r["metric"]: r for r in rows if r["impl"] == "torch" and r["direction"] == "bwd"}
    assert native_bwd["nonfinite"]["value"] > 0 and not native_bwd["nonfinite"]["passed"]
    assert all(r["passed"] for r in rows if r["impl"] == "torch" and r["direction"] == "fwd")
    triton_bwd = [r for r in rows if r["impl"] == "triton" and r["direction"] == "bwd" and r["metric"] == "max_abs"]
    assert triton_bwd and all(r["rule"].endswith("(native non-finite)") for r in triton_bwd)


def test_ordered_row_sum_adds_rows_one_by_one_in_order():
    # h_post_bda's per-token gradients are finished by this sum: its order must not depend on the
    # layout Triton picks for another number of columns (tokens), so it must be plain row order
    from mhctool.kernels.triton.reduce import sum_rows

    for R, L in ((1, 5), (7, 4), (56, 1000)):
        ws = torch.randn(R, L, generator=torch.Generator().manual_seed(R)) * 10.0 ** torch.randint(-3, 4, (R, 1))
        want = torch.zeros(L, dtype=torch.float32)
        for r in range(R):
            want = want + ws[r]  # fp32, row after row
        got = sum_rows(ws, torch.float32, (L,), ordered=True)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (R, L)
        tree = sum_rows(ws, torch.float32, (L,)).double()
        assert ((tree - ws.double().sum(0)).abs() <= 1e-6 * ws.double().abs().sum(0)).all()


def test_tree_row_sum_of_a_few_partials_covers_every_column():
    # dW's token-split partials: under 64 rows, all rows in one step over wide column blocks
    # (the plan's other branch); every column written (a poisoned output) and as accurate
    from mhctool.kernels.triton.reduce import _plan, sum_rows
    from mhctool.core.poison import poisoning

    g = torch.Generator().manual_seed(5)
    for R, L in ((8, 70001), (3, 77), (63, 1000), (64, 1000)):
        ws = torch.randn(R, L, generator=g)
        with poisoning():
            got = sum_rows(ws, torch.float32, (L,)).double()
        block, block_r, ordered, progs = _plan(ws, False)
        assert not ordered and block_r == min(64, 1 << (R - 1).bit_length()) and progs * block >= L
        assert ((got - ws.double().sum(0)).abs() <= 1e-6 * ws.double().abs().sum(0)).all(), (R, L)


def test_row_sum_pair_is_two_row_sums_in_one_launch():
    # the h_post_bda and mapping backward finish two workspaces (ordered per-token partials and a
    # tree sum of bias partials) in one launch: the bits must be those of two separate sums
    from mhctool.kernels.triton.reduce import sum_rows, sum_rows_pair

    g = torch.Generator().manual_seed(3)
    for (r1, l1), (r2, l2) in (((14, 3000), (37, 700)), ((3, 1), (1, 5)), ((5, 0), (70, 33)), ((4, 9), (2, 0))):
        a, b = torch.randn(r1, l1, generator=g), torch.randn(r2, l2, generator=g) * 1e3
        got_a, got_b = sum_rows_pair((a, torch.float32, (l1,), True), (b, torch.bfloat16, (l2,), False))
        assert got_a.dtype == torch.float32 and got_b.dtype == torch.bfloat16
        assert torch.equal(got_a, sum_rows(a, torch.float32, (l1,), ordered=True)), (r1, l1)
        assert torch.equal(got_b, sum_rows(b, torch.bfloat16, (l2,))), (r2, l2)
        assert ((got_b.double() - b.double().sum(0)).abs() <= 1e-2 * b.double().abs().sum(0) + 1e-30).all()


@triton.jit
def _apply_exp(x_ptr, o_ptr, N, NAIVE: tl.constexpr):
    i = tl.arange(0, 2048)
    x = tl.load(x_ptr + i, mask=i < N)
    if NAIVE:
        y = tl.exp2(x * 1.4426950408889634)
    else:
        y = kernel_exp(x)
    tl.store(o_ptr + i, y, mask=i < N)


def test_kernel_exp_is_accurate_far_from_zero():
    """Regression: Sinkhorn's dead rows (logits 20-80 below their max) went through ``tl.exp``,
    which the GPU computes as exp2(x * log2 e) with the product rounded to fp32: an error of
    |x| * 2**-24 relative (5e-6 at -80) that doubled the backward's error against PyTorch. The
    interpreter's ``tl.exp`` is exact, so the naive form is written out here to show the bound
    would catch it."""
    edges = torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0, -200.0, 200.0, 88.72, 88.73, -87.3])
    x = torch.cat([torch.empty(2000).uniform_(-103.0, 88.7), edges])
    want = x.double().exp()
    normal = (want > 1.2e-38) & (want < 3.4e38)
    # 4 ulp: the interpreter's exp2 is numpy's, whose float32 error depends on the host's SIMD path
    # (0.5-1 ulp without AVX-512, up to about 2.8 with it); the naive form is off by |x| ulp, ~100
    for naive, bound in ((False, 4), (True, 50)):
        got = torch.empty_like(x)
        _apply_exp[(1,)](x, got, x.numel(), NAIVE=naive)
        ulps = ((got.double() - want).abs() / want / 2.0**-24)[normal].max().item()
        assert (ulps <= bound) != naive, (naive, ulps)
    got = torch.empty_like(x)
    _apply_exp[(1,)](x, got, x.numel(), NAIVE=False)
    assert torch.equal(got[-len(edges):].isnan(), want[-len(edges):].isnan())
    g, w = got[-len(edges):].double(), want[-len(edges):]
    w32 = w.float().double()  # what fp32 can hold: 0 and inf past its range
    special = (w32 == 0) | w32.isinf() | (w32 == 1)  # 0, inf and e**0 exactly; the rest within the bound
    assert torch.equal(g[special], w32[special])
    rest = ~special & ~w.isnan()
    assert ((g[rest] - w[rest]).abs() <= 4 * 2.0**-24 * w[rest]).all(), (g[rest], w[rest])


@pytest.mark.parametrize("lowp,n,c", [(False, 4, 75), (True, 4, 75), (True, 3, 37), (False, 2, 200), (True, 3, 128),
                                      (False, 2, 256)])
def test_proj_rms_backward_adds_the_aggregation_gradient_in_its_pass(lowp, n, c):
    """``agg``: dx also holds ``h_pre[t, i] * grad_out[t, c]`` at column ``i * C + c``, added in
    fp32 before dx's one rounding, through the generic kernel and the packed tensor-core one
    (forced on fp32 operands: exact pieces); K blocks that span several streams (C < 128), cut
    one (C = 200) or lie in one (C = 128, 256: a multiple of the 128-column K block, one h_pre
    column a block), odd token counts, NaN-poisoned outputs."""
    m, k = 70, n * c
    nh = n * n + 2 * n
    x, w = torch.randn(m, k), torch.randn(nh, k) / k ** 0.5
    _, r, rms = tpr.proj_rms_forward(x, w)
    gp, gr = torch.randn(m, nh), torch.randn(m)
    h_pre, g_out = torch.rand(m, n), torch.randn(m, c)
    with poisoning():
        gx, gw = tpr.proj_rms_backward(x, w, r, rms, gp, gr, lowp=lowp, agg=(h_pre, g_out))
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    rp, rr = ref.proj_rms(xd, wd)
    rx, rw = torch.autograd.grad((rp, rr), (xd, wd), (gp.double(), gr.double()))
    term = (h_pre.double()[:, :, None] * g_out.double()[:, None, :]).reshape(m, k)
    for a, b_ in ((gx, rx + term), (gw, rw)):
        assert torch.isfinite(a).all()
        assert ((a.double() - b_).abs().max() / b_.abs().max()) < 1e-5
    with pytest.raises(ValueError, match="agg takes h_pre"):
        tpr.proj_rms_backward(x, w, r, rms, gp, gr, agg=(h_pre, g_out[:, :5]))


@pytest.mark.parametrize("m,n,c,agg", [(70, 4, 256, True), (1, 2, 256, True), (39, 4, 67, False), (130, 2, 130, False),
                                       (70, 3, 37, True)])
def test_tensor_core_backward_streams_side_by_side_give_the_plain_orders_bits(monkeypatch, m, n, c, agg):
    """The packed projection backward with the streams' programs side by side (``GROUP_STREAMS``)
    against the plain order, under the interpreter on fp32 operands (the tensor-core path forced
    on): the same bits for dx and dW at token counts off the 64-token block, one token and K off
    the 128-column block, into NaN-poisoned outputs; where grad_out's K block would span two
    streams (C = 37) or there is no aggregation term, the order is the plain one either way."""
    k, nh = n * c, n * n + 2 * n
    x, w = torch.randn(m, k), torch.randn(nh, k) / k ** 0.5
    _, r, rms = tpr.proj_rms_forward(x, w)
    gp, gr = torch.randn(m, nh), torch.randn(m)
    ag = (torch.rand(m, n), torch.randn(m, c)) if agg else None
    runs = []
    for group in (False, True):
        monkeypatch.setattr(tpr, "GROUP_STREAMS", group)
        with poisoning():
            runs.append(tpr.proj_rms_backward(x, w, r, rms, gp, gr, lowp=True, agg=ag))
    for a, b_ in zip(runs[1], runs[0]):
        assert torch.isfinite(a).all() and torch.equal(a, b_)


def test_no_kernel_of_ours_takes_tritons_autotuner():
    """A tile sets a sum's order: Triton's autotuner, timing the tiles afresh in each process, gave
    the GPU gate other bits on one GPU than on four. A tile is a function of the shape, or a pick
    timed once per machine and kept on disk (pick_config)."""
    import importlib
    import pkgutil

    import mhctool.kernels.triton as pkg
    from triton.runtime.autotuner import Autotuner
    tuned = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        tuned += [f"{info.name}.{k}" for k, v in vars(mod).items() if isinstance(v, Autotuner)]
    assert not tuned, tuned


def test_a_tile_picked_by_timing_is_kept_for_every_later_process(monkeypatch, tmp_path):
    """pick_config times the candidates once per machine: a later process (a run's other worker, a
    later run) reads the pick back, even where its own timing would have ranked them otherwise."""
    from mhctool.kernels.triton import _common
    monkeypatch.setenv("MHCTOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(_common, "interpreted", lambda: False)
    ms = {"a": 2.0, "b": 1.0, "c": 3.0}
    monkeypatch.setattr(_common, "_time", lambda run, cfg: ms[cfg])
    configs = ["a", "b", "c"]

    def new_process():
        monkeypatch.setattr(_common, "_BEST", {})
        monkeypatch.setattr(_common, "picks", {"timed": 0, "read": 0})
    new_process()
    assert _common.pick_config(("k", 1), configs, run=None) == "b" and _common.picks["timed"] == 1
    ms.update(a=0.5)  # another process's timing would now pick "a"
    new_process()
    assert _common.pick_config(("k", 1), configs, run=None) == "b" and _common.picks == {"timed": 0, "read": 1}
    assert _common.pick_config(("k", 2), configs, run=None) == "a"  # another key is timed for itself
    for entry in (tmp_path / "tiles").glob("*.json"):
        entry.write_text("{not json")  # a broken entry is timed again and replaced
    new_process()
    assert _common.pick_config(("k", 1), configs, run=None) == "a" and _common.picks["timed"] == 1
    monkeypatch.setenv("MHCTOOL_CACHE", "off")  # turned off: every process times for itself
    ms.update(c=0.1)
    new_process()
    assert _common.pick_config(("k", 1), configs, run=None) == "c" and _common.picks["timed"] == 1
    new_process()  # small problems take the first candidate, untimed
    assert _common.pick_config(("k", 1), configs, run=None, work=1000) == "a" and _common.picks["timed"] == 0


def test_h_aggregate_backward_without_grad_x_gives_the_same_grad_h():
    x, h = torch.randn(5, 3, 4, 67), torch.rand(5, 3, 4)
    g = torch.randn(5, 3, 67)
    with poisoning():
        dx, dh = tha.h_aggregate_backward(x, h, g)
        none, dh_only = tha.h_aggregate_backward(x, h, g, write_dx=False)
    assert none is None and torch.equal(dh, dh_only)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_aggregate_one_function_matches_float64_and_the_composition(dtype):
    """mix_aggregate's own backward (the aggregation's part of dx added inside the projection's
    pass) against the float64 composite, and against the same kernels composed by autograd."""
    from mhctool.kernels.triton import mix_aggregate as tmix
    s, b, n, c = 5, 3, 4, 37  # 15 tokens, K = 148: no tile multiple
    x = torch.randn(s, b, n, c).to(dtype)
    weight = (torch.randn(n * n + 2 * n, n * c) / (n * c) ** 0.5).to(dtype)
    alpha, h_bias = torch.tensor([0.8, 1.1, 0.9]), 0.1 * torch.randn(n * n + 2 * n)
    ups = [torch.randn(s, b, c).to(dtype), torch.randn(s, b, n), torch.randn(s, b, n, n)]

    def grads(fn, cast):
        leaves = [t.detach().to(cast(t)).requires_grad_() for t in (x, weight, alpha, h_bias)]
        outs = fn(*leaves)
        return outs, torch.autograd.grad(outs, leaves, [u.to(o.dtype) for u, o in zip(ups, outs)])

    with poisoning():
        outs, got = grads(tmix.mix_aggregate, lambda t: t.dtype)

    def composed(x_, w_, a_, hb_):
        h_pre, h_post, h_res = tmix.mapping_sinkhorn(x_, w_, a_, hb_)
        return tha.h_aggregate(x_, h_pre), h_post, h_res
    _, comp = grads(composed, lambda t: t.dtype)
    _, want = grads(ref.mix_aggregate, lambda t: torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, c_, w_ in zip(("x", "weight", "alpha", "h_bias"), got, comp, want):
        assert torch.isfinite(g).all(), name
        scale = w_.abs().max()
        assert (g.double() - w_).abs().max() / scale < tol, name
        assert (g.double() - c_.double()).abs().max() / scale < tol, name


def test_beside_runs_both_in_order_off_cuda():
    """``schedule.beside`` (Sinkhorn's backward beside the aggregation's in mix_aggregate) returns
    both results; off CUDA (the interpreter) it runs the side callable first, then the main one."""
    from mhctool.kernels.schedule import beside
    calls = []
    got = beside(lambda: calls.append("side") or torch.ones(2), lambda: calls.append("main") or None,
                 torch.device("cpu"))
    assert calls == ["side", "main"] and torch.equal(got[0], torch.ones(2)) and got[1] is None


def test_the_sum_of_squares_keeps_what_sequential_chunks_would_round_away():
    """r's sum of squares over K chunks of 128 is compensated (Kahan): a first chunk of squares
    2^24 makes the running sum 2^31, where every later chunk's sum of 128 is half an ulp, which
    chunks added one after another round away (r 4e-6 relative off); compensated, r is within 2
    fp32 roundings of the float64 one. Both kernels that compute r (proj_rms, the mapping)."""
    k = 128 * 128
    x = torch.ones(3, k)
    x[:, :128] = 4096.0
    x[2] = torch.randn(k)  # and a plain row beside them
    w = torch.randn(24, k) / k ** 0.5
    want = 1.0 / (x.double().norm(dim=-1) / k ** 0.5 + 1e-6)
    _, r, _ = tpr.proj_rms_forward(x, w)
    _, (_, r_map, _) = tmap.mapping_forward(x, w, torch.ones(3), torch.zeros(24))
    for got in (r, r_map):
        assert ((got.double() - want).abs() / want).max() < 2.5 * 2.0 ** -24, got.double() / want - 1
