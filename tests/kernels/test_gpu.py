"""GPU tests (``pytest -m gpu`` on a CUDA machine); they skip cleanly without one."""
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from mhctool.cli.app import app

IMPLS = Path(__file__).resolve().parents[1] / "impls"  # loaded by file path, never as a package
DATA = Path(__file__).resolve().parents[1] / "data"
DEFECTS = IMPLS / "defects.py"

pytestmark = pytest.mark.gpu
runner = CliRunner()


def _parity(tmp_path, *args):
    out = tmp_path / "r.parquet"
    res = runner.invoke(app, ["parity", "--device", "cuda", "-o", str(out), *args])
    return res, (pq.read_table(out).to_pylist() if out.exists() else [])


CUTILE_FAMILIES = "sinkhorn,h_aggregate,h_post_bda,proj_rms,mapping,mix_aggregate"
# The CLI runs of this file, started together as child processes when the module starts (only
# those a selected test reads): their time is mostly compilation (Triton, tileiras) on the CPU, so
# they overlap each other and the in-process tests; the default scenario's runs also spread their
# cases over workers on the one GPU. A test marked ``background(name)`` waits for its run.
TRAIN = ["--device", "cuda", "--steps", "8", "--layers", "2", "--hidden", "128", "--seq", "128", "--batch", "2", "--seeds", "2",
         "--dtype", "bf16", "-q"]
BACKGROUND = {
    "triton": ["parity", "--kernel", "all", "--impl", "triton", "--workers", "4"],
    "cutile-fp32": ["parity", "--kernel", CUTILE_FAMILIES, "--impl", "cutile", "--dtype", "fp32", "--workers", "2"],
    "cutile-bf16": ["parity", "--kernel", CUTILE_FAMILIES, "--impl", "cutile", "--dtype", "bf16", "--workers", "2"],
    "fp16-h_aggregate": ["parity", "--kernel", "h_aggregate", "--impl", "triton", "--dtype", "fp16"],
    "fp16-h_post_bda": ["parity", "--kernel", "h_post_bda", "--impl", "triton", "--dtype", "fp16"],
    "defect": ["parity", "--kernel", "sinkhorn", "--dtype", "fp32", "--impl", f"{DEFECTS}:sinkhorn_no_max"],
    "train-triton": ["train", "--impl", "triton", *TRAIN],
    "train-cutile": ["train", "--impl", "cutile", *TRAIN],
    "cuda-fault": ["parity", "--kernel", "sinkhorn", "--scenario", str(DATA / "gpu-fault.toml"), "--isolate",
                   "--impl", f"{IMPLS / 'gpu_faults.py'}:sinkhorn_faults_on_large_inputs"],
    "bwd-fault": ["parity", "--kernel", "h_aggregate", "--scenario", str(DATA / "gpu-bwd-fault.toml"), "--isolate",
                  "--no-hint", "--impl", f"{IMPLS / 'gpu_faults.py'}:h_aggregate_backward_faults_unless_c4"],
    "cutile-mix-fp32": ["parity", "--kernel", "mix_aggregate", "--impl", "cutile", "--dtype", "fp32",
                        "--scenario", str(DATA / "gpu-mix.toml")],
    "cutile-mix-bf16": ["parity", "--kernel", "mix_aggregate", "--impl", "cutile", "--dtype", "bf16",
                        "--scenario", str(DATA / "gpu-mix.toml")],
    # from empty compile caches (the run's own, under its folder)
    "context": ["parity", "--kernel", "h_aggregate", "--impl", f"{IMPLS / 'gpu_backward_launch.py'}:h_aggregate",
                "--shape", "13x3x4x67"],
}
EMPTY_CACHES = {"context"}


class _Background:
    def __init__(self, folder: Path, names: set):
        self.folder, self.procs = folder, {}
        for name in sorted(names):
            argv = BACKGROUND[name]
            cmd = [sys.executable, "-m", "mhctool.cli", *argv, "-o", str(folder / f"{name}.parquet")]
            if argv[0] == "parity":
                cmd += ["--device", "cuda", "--quiet"]
            env = dict(os.environ)
            if name in EMPTY_CACHES:
                env |= {"CUDA_TILE_CACHE_DIR": str(folder / f"{name}-cutile-cache"),
                        "MHCTOOL_CACHE": str(folder / f"{name}-mhctool-cache"),
                        "TRITON_CACHE_DIR": str(folder / f"{name}-triton-cache")}
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                env=env)

    def __call__(self, name: str):
        """(exit code, output, report rows, report path) of run ``name``, once it has ended."""
        text, _ = self.procs[name].communicate(timeout=900)
        path = self.folder / f"{name}.parquet"
        return self.procs[name].returncode, text, (pq.read_table(path).to_pylist() if path.exists() else []), path

    def close(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    names = {m.args[0] for item in request.session.items if item.module is request.module
             for m in item.iter_markers("background")}
    if not names or not torch.cuda.is_available():
        yield None
        return
    runs = _Background(tmp_path_factory.mktemp("background"), names)
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.slow  # the default-scenario test above runs fp32 and bf16 already
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_parity_every_dtype_on_gpu(tmp_path, dtype):
    res, _ = _parity(tmp_path, "--kernel", "all", "--impl", "triton", "--dtype", dtype)
    assert res.exit_code == 0, res.output


@pytest.mark.slow  # inductor compiles for tens of seconds
def test_compile_variant_on_gpu(tmp_path):
    res, rows = _parity(tmp_path, "--kernel", "h_aggregate", "--impl", "compile", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert any(r["impl"] == "compile" and r["passed"] for r in rows)


def _made_once_then_read(tmp_path, imports: str, checks: dict[str, tuple[str, str, str]]) -> None:
    """Each check's ``call`` (an expression after ``imports``; ``g`` is a seeded CUDA generator,
    ``r(*shape)`` draws from it) in two fresh processes, one after the other, sharing one mhctool
    cache folder: the counters ``made`` and ``read`` must say the first process made the entry and
    the second read it, and both must give the same bits. The checks share the two processes (each
    process's start and imports cost seconds on the GPU machine)."""
    code = (f"import hashlib, torch\n{imports}\n"
            "g = torch.Generator(device='cuda').manual_seed(0)\n"
            "r = lambda *s: torch.randn(*s, device='cuda', generator=g)\n")
    for name, (call, made, read) in checks.items():
        code += (f"out = ({call}).cpu()\n"
                 f"print({name!r}, {made}, {read}, hashlib.sha1(out.numpy().tobytes()).hexdigest())\n")
    env = {**os.environ, "MHCTOOL_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    first, second = ({line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.strip()}
                     for r in runs)
    for name in checks:
        assert first[name][:2] == ["1", "0"] and second[name][:2] == ["0", "1"], (name, first, second)
        assert first[name][2] == second[name][2], name


def test_compilations_and_timed_tiles_are_read_back_by_the_next_process(tmp_path):
    """kernels/cutile/_cache.py: the second process launches the kernel the first compiled, without
    compiling it, and gets the same bits. pick_config on the GPU: h_post_bda's generic forward (n =
    3) at 25M elements times its candidates in the first process only; the second reads the pick
    and gives the same bits."""
    _made_once_then_read(
        tmp_path, "from mhctool.kernels.cutile import _cache, h_aggregate as ck\n"
                  "from mhctool.kernels.triton import _common, h_post_bda as tk",
        {"cutile": ("ck.h_aggregate_forward(r(37, 1, 4, 300), torch.rand(37, 1, 4, device='cuda', generator=g))",
                    "_cache.stats['stored']", "_cache.stats['hits']"),
         "triton": ("tk.h_post_bda_forward(r(8192, 1, 3, 3), r(8192, 1, 3, 1024), r(8192, 1, 3), r(8192, 1, 1024))",
                    "_common.picks['timed']", "_common.picks['read']")})


@pytest.mark.parametrize("backend", ["triton", "cutile"])
def test_sinkhorn_tail_and_n(backend):
    """A partial token tile at a size where the tiles are tuned, n = 3 (padded tiles; cuTile's
    per-token path) and 8 (cuTile's tile path), forward and backward. n = 2 and 4 run in the
    default scenario."""
    import importlib
    from mhctool.references.mhc import sinkhorn as ref
    sinkhorn = importlib.import_module(f"mhctool.kernels.{backend}.sinkhorn").sinkhorn
    for n in (3, 8):
        L = torch.randn(32768 + 7, n, n, device="cuda", requires_grad=True)
        y = sinkhorn(L)
        g = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, [L], g)
        Ld = L.detach().double().requires_grad_()
        yr = ref(Ld)
        (gr,) = torch.autograd.grad(yr, [Ld], g.double())
        torch.testing.assert_close(y.double(), yr, rtol=0, atol=2e-6)
        torch.testing.assert_close(gx.double(), gr, rtol=0, atol=5e-5)


_KNOBS = [{}, {"stabilize": "softmax"}, {"eps_mode": "clamp", "order": "col_first"}]


@pytest.mark.parametrize("backend,n,knobs", [("triton", n, k) for n in (4, 8) for k in _KNOBS] +
                         [("cutile", 4, {}), ("cutile", 8, {})])
def test_sinkhorn_backward_stays_finite_where_a_column_underflows(backend, n, knobs, underflowing_logits):
    """The CPU test's regression on the GPU, for both backends and both of cuTile's paths (n = 4
    per token, n = 8 tiles): a column 200 below the rest once overflowed the backward to NaN.
    cuTile's at the default knobs only: each other knob is a compilation of 10-30 s (the per-token
    path unrolls every iteration), and the knobs' math is the Triton kernel's, tested here and on
    the CPU."""
    import importlib
    from mhctool.core.poison import poisoning
    from mhctool.references.mhc import sinkhorn as ref
    sinkhorn = importlib.import_module(f"mhctool.kernels.{backend}.sinkhorn").sinkhorn
    L, Ld = underflowing_logits(4096 + 7, n, knobs, "cuda")
    with poisoning():
        y = sinkhorn(L, 20, 1e-6, **knobs)
        g = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, [L], g)
    yr = ref(Ld, 20, 1e-6, **knobs)
    (gr,) = torch.autograd.grad(yr, [Ld], g.double())
    assert torch.isfinite(gr).all() and torch.isfinite(gx).all()
    torch.testing.assert_close(y.double(), yr, rtol=0, atol=2e-6)
    torch.testing.assert_close(gx.double(), gr, rtol=0, atol=5e-5)


def _moe_inputs(experts=8, tokens=4096, hidden=512, ffn=256, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    m = torch.full((experts,), tokens // experts, dtype=torch.int64, device="cuda")
    m[0] += tokens - int(m.sum())
    m[1], m[2] = 0, m[1] + m[2]  # an expert with no token
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype).requires_grad_()
    w1 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=g) / ffn ** 0.5).to(dtype).requires_grad_()
    s = torch.rand(tokens, device="cuda", generator=g).requires_grad_()
    return x, w1, w2, m, s


def test_grouped_path_is_free_of_host_synchronisation():
    """Fused grouped GEMM, activation and MLP, forward and backward, under sync debug mode
    "error": any .item(), .tolist() or device-to-host copy raises. A first call outside the mode
    compiles and picks tile configurations (which times with events and synchronises)."""
    from mhctool.kernels.torch import moe as native
    from mhctool.kernels.triton import grouped_gemm as tgg
    from mhctool.kernels.triton import grouped_mlp as tmlp
    x, w1, w2, m, s = _moe_inputs()
    main = torch.zeros(w1.shape, device="cuda")
    flags = torch.ones(w1.shape[0], dtype=torch.bool, device="cuda")

    def step():
        y = tmlp.grouped_mlp(x, w1, w2, m, scale=s)
        torch.autograd.grad(y, [x, w1, w2, s], torch.ones_like(y))
        h = tgg.grouped_gemm(x, w1, m)
        torch.autograd.grad(h, [x, w1], torch.ones_like(h))
        tgg.grouped_wgrad(x.detach(), h.detach(), m, main, flags)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        # the check is live: the per-expert loop reads the counts on the host and is caught
        with pytest.raises(RuntimeError, match="synchroniz"):
            native.grouped_gemm(x, w1, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_fused_grouped_mlp_replays_from_a_cuda_graph():
    from mhctool.kernels.triton import grouped_mlp as tmlp
    x, w1, w2, m, s = _moe_inputs()
    with torch.no_grad():
        eager = tmlp.grouped_mlp(x, w1, w2, m, scale=s)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tmlp.grouped_mlp(x, w1, w2, m, scale=s)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tmlp.grouped_mlp(x, w1, w2, m, scale=s)
        m.copy_(m.roll(1))  # new counts: the captured kernels read them on the device
        graph.replay()
        torch.cuda.synchronize()
        fresh = tmlp.grouped_mlp(x, w1, w2, m, scale=s)
    assert torch.equal(out, fresh) and not torch.equal(out, eager)


def test_h_post_bda_tensor_core_backward_finishes_its_sums_deterministically():
    """The bf16 n = 4 backward finishes its small gradients inside the kernel: a counter elects the
    last program of a token group (and of a bias supergroup), which sums the partials in a fixed
    order and then drops them from L2 (``discard.global.L2``, whole 128-byte lines only). Here with
    an odd number of tokens (6001: the partial rows start off a line) and three C blocks (1100
    channels, the last part-filled), so that a discard reaching past its own group would corrupt a
    neighbour's partials: the gradients must match float64, repeat bit for bit, and a token's dH,
    dh_post, dx and dy must be those of a smaller batch."""
    from mhctool.kernels.triton import h_post_bda as thp
    from mhctool.core.poison import poisoning

    g = torch.Generator(device="cuda").manual_seed(0)
    s, b, C = 353, 17, 1100
    h, hp = torch.rand(s, b, 4, 4, generator=g, device="cuda"), torch.rand(s, b, 4, generator=g, device="cuda")
    x, go = (torch.randn(s, b, 4, C, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    y = torch.randn(s, b, C, generator=g, device="cuda").to(torch.bfloat16)
    bias = torch.randn(C, generator=g, device="cuda").to(torch.bfloat16)
    with poisoning():
        runs = [thp.h_post_bda_backward(h, x, hp, y, bias, go, True) for _ in range(3)]
        part = thp.h_post_bda_backward(h[:5], x[:5], hp[:5], y[:5], bias, go[:5], True)
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            assert torch.equal(a, b_)
    for name, a, p in zip(("h_res", "x", "h_post", "y"), runs[0][:4], part[:4]):
        assert torch.equal(a[:5], p), name
    dd = [t.double().requires_grad_() for t in (h, x, hp, y, bias)]
    from mhctool.references import mhc as ref
    want = torch.autograd.grad(ref.h_post_bda(*dd, transpose_res=True), dd, go.double())
    for name, a, w in zip(("h_res", "x", "h_post", "y", "bias"), runs[0], want):
        assert torch.isfinite(a).all(), name
        tol = 1e-5 if a.dtype == torch.float32 else 2 ** -8
        assert ((a.double() - w).abs().max() / w.abs().max()) < tol, name


def test_triton_h_post_bda_n4_forward_runs_past_65535_tokens():
    """CUDA takes at most 65535 blocks on a grid's second axis; the n = 4 forward (a token a
    program) keeps its grid on one axis. At 70001 tokens (and C = 300, off the C block), into a
    NaN-poisoned output: every element written and within bf16's rounding of float64."""
    from mhctool.kernels.triton import h_post_bda as thp
    from mhctool.core.poison import poisoning
    from mhctool.references import mhc as ref

    g = torch.Generator(device="cuda").manual_seed(0)
    t, c = 70001, 300
    h, hp = torch.rand(t, 1, 4, 4, generator=g, device="cuda"), torch.rand(t, 1, 4, generator=g, device="cuda")
    x = torch.randn(t, 1, 4, c, generator=g, device="cuda").to(torch.bfloat16)
    y = torch.randn(t, 1, c, generator=g, device="cuda").to(torch.bfloat16)
    bias = torch.randn(c, generator=g, device="cuda").to(torch.bfloat16)
    with poisoning():
        out = thp.h_post_bda_forward(h, x, hp, y, bias, tile_=thp.FWD4_TILE)
    want = ref.h_post_bda(*(v.double() for v in (h, x, hp, y, bias)))
    assert torch.isfinite(out).all()
    assert ((out.double() - want).abs().max() / want.abs().max()) < 2 ** -8


@pytest.mark.parametrize("n, transpose, with_bias", [(4, True, True), (3, False, False), (2, False, True)])
def test_cutile_h_post_bda_backward_sums_c_blocks_in_order(n, transpose, with_bias):
    """cuTile's h_post_bda backward runs a program per (C block, token group): the n^2 + n sums
    over C leave as one partial per (C block, token), summed in C-block order by a second launch,
    and the bias's as one per token group. At token counts off the tile and the token group (6001,
    and a 5-token slice), C off the C block (1100 channels: five blocks, the last part-filled), n
    = 3 (padded rows of partials), into NaN-poisoned outputs and workspaces: every gradient matches
    float64, repeats bit for bit, and a token's gradients are those of the smaller batch."""
    from mhctool.kernels.cutile import h_post_bda as chp
    from mhctool.core.poison import poisoning
    from mhctool.references import mhc as ref

    g = torch.Generator(device="cuda").manual_seed(0)
    s, b, C = 353, 17, 1100
    h, hp = torch.rand(s, b, n, n, generator=g, device="cuda"), torch.rand(s, b, n, generator=g, device="cuda")
    x, go = (torch.randn(s, b, n, C, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    y = torch.randn(s, b, C, generator=g, device="cuda").to(torch.bfloat16)
    bias = torch.randn(C, generator=g, device="cuda").to(torch.bfloat16) if with_bias else None

    def grads(*ins):
        leaves = [t.clone().requires_grad_() for t in ins if t is not None]
        args = list(leaves) + ([] if with_bias else [None])
        return torch.autograd.grad(chp.h_post_bda(*args, transpose_res=transpose), leaves, go[:ins[0].shape[0]])

    with poisoning():
        runs = [grads(h, x, hp, y, bias) for _ in range(2)]
        part = grads(h[:5], x[:5], hp[:5], y[:5], bias)
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)
    for name, a, p in zip(("h_res", "x", "h_post", "y"), runs[0][:4], part[:4]):
        assert torch.equal(a[:5], p), name
    dd = [t.double().requires_grad_() for t in (h, x, hp, y, bias) if t is not None]
    out = ref.h_post_bda(*dd, *([] if with_bias else [None]), transpose_res=transpose)
    want = torch.autograd.grad(out, dd, go.double())
    for name, a, w in zip(("h_res", "x", "h_post", "y", "bias"), runs[0], want):
        assert torch.isfinite(a).all(), name
        tol = 1e-5 if a.dtype == torch.float32 else 2 ** -8
        assert ((a.double() - w).abs().max() / w.abs().max()) < tol, name


@pytest.mark.parametrize("backend", ["triton", "cutile"])
@pytest.mark.parametrize("n, dtype", [(4, torch.bfloat16), (4, torch.float32), (3, torch.bfloat16)])
def test_dropout_draws_the_contracts_mask_in_the_kernel(backend, n, dtype):
    """The post-path's dropout drawn in each backend's kernels at their GPU tiles (n = 4: Triton's
    one-token forward, its tensor-core backward in bf16 and FMA one in fp32; cuTile's (C block, token group) programs), tokens and C off
    every tile (C not a multiple of 4 either), a key and counters past 32 bits, into NaN-poisoned
    outputs: the forward and every gradient match float64 under the contract's mask, the dropped
    elements are exactly the mixed streams, the same key gives the same bits, another offset
    another mask."""
    import importlib

    from mhctool.core.poison import poisoning
    from mhctool.references import dropout as D
    from mhctool.references import mhc as ref
    mod = importlib.import_module(f"mhctool.kernels.{backend}.h_post_bda")

    g = torch.Generator(device="cuda").manual_seed(1)
    s, b, c = 1031, 3, 1030
    h = torch.softmax(torch.randn(s, b, n, n, generator=g, device="cuda"), -1)
    hp = 2 * torch.rand(s, b, n, generator=g, device="cuda")
    x, go = (torch.randn(s, b, n, c, generator=g, device="cuda").to(dtype) for _ in range(2))
    y = torch.randn(s, b, c, generator=g, device="cuda").to(dtype)
    bias = torch.randn(c, generator=g, device="cuda").to(dtype)
    key = dict(dropout=0.1, dropout_seed=2**33 + 5, dropout_offset=2**32 - 7)

    def run(**k):
        leaves = [t.clone().requires_grad_() for t in (h, x, hp, y, bias)]
        out = mod.h_post_bda(*leaves, **k)
        return out.detach(), torch.autograd.grad(out, leaves, go)

    with poisoning():
        out, grads = run(**key)
        again, _ = run(**key)
        other, _ = run(**{**key, "dropout_offset": key["dropout_offset"] + 1})
        mixed = mod.h_post_bda(h, x, torch.zeros_like(hp), y, None)
    assert torch.equal(out, again) and not torch.equal(out, other)
    dropped = ~D.keep((s * b, n, c), key["dropout"], key["dropout_seed"], key["dropout_offset"], "cuda").view(x.shape)
    assert 0.09 < float(dropped.double().mean()) < 0.11
    assert torch.equal(out[dropped], mixed[dropped])
    dd = [t.double().requires_grad_() for t in (h, x, hp, y, bias)]
    want_out = ref.h_post_bda(*dd, **key)
    want = torch.autograd.grad(want_out, dd, go.double())
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for name, a, w in zip(("out", "h_res", "x", "h_post", "y", "bias"), (out, *grads), (want_out, *want)):
        assert torch.isfinite(a).all(), name
        assert ((a.double() - w).abs().max() / w.abs().max()) < tol, name


def _proj_inputs(g, m, k, ns=0):
    """The projection backward's inputs on the GPU from generator ``g``: bf16 x ``[m, k]`` and W
    ``[24, k]``, fp32 upstream gradients of proj and r, and (``ns`` > 0) mix_aggregate's aggregation
    term ``(h_pre [m, ns], bf16 grad_out [m, k / ns])``, else None."""
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(24, k, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)
    gp, gr = torch.randn(m, 24, generator=g, device="cuda"), torch.randn(m, generator=g, device="cuda")
    agg = None
    if ns:
        agg = (torch.rand(m, ns, generator=g, device="cuda"),
               torch.randn(m, k // ns, generator=g, device="cuda").to(torch.bfloat16))
    return x, w, gp, gr, agg


def _assert_proj_grads(x, w, gp, gr, agg, dx, dw, where):
    """dx and dW finite and within bf16 rounding of float64 proj_rms's gradients for upstream ``gp``
    and ``gr`` (dx plus the aggregation term's ``h_pre[t, i] * grad_out[t, c]`` where ``agg``)."""
    from mhctool.references import mhc as ref

    m, k = x.shape
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    want_dx, want_dw = torch.autograd.grad(ref.proj_rms(xd, wd, 1e-6), (xd, wd), (gp.double(), gr.double()))
    if agg is not None:
        want_dx = want_dx + (agg[0].double()[:, :, None] * agg[1].double()[:, None, :]).reshape(m, k)
    for name, got, want in (("dx", dx, want_dx), ("dW", dw, want_dw)):
        assert torch.isfinite(got).all(), (name, *where)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 2 ** -7, (name, *where, err)  # bf16 outputs: one rounding, 2^-9 relative


def test_cutile_projection_backward_halves_cover_odd_k():
    """The cuTile projection backward takes each K block as two halves of 128 columns (bf16); where
    K has an odd number of half blocks the last program's second half repeats its first. At such K
    (300: three half blocks; 28800: 225, near the paper's 28672) and token counts off the 64-token
    tile, into NaN-poisoned outputs (and workspace): every element of dx and dW is written and both
    match the float64 reference's gradients."""
    from mhctool.kernels.cutile import proj_rms as cpr
    from mhctool.core.poison import poisoning

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in ((1007, 300), (130, 28800)):
        x, w, gp, gr, _ = _proj_inputs(g, m, k)
        _, r, rms = cpr.forward(x, w, 1e-6)
        dx, dw = torch.full_like(x, float("nan")), torch.full_like(w, float("nan"))
        with poisoning():
            cpr.backward_into(x, w, gp, gr, r, rms, dx, dw)
        _assert_proj_grads(x, w, gp, gr, None, dx, dw, (m, k))


def test_cutile_projection_backward_orders_forms_and_worker_warps_give_the_same_bits(monkeypatch):
    """cuTile's projection backward with mix_aggregate's aggregation term: a program per K block
    with its programs launched in the plain order or, where C is a whole number of the 256-column
    block, with the n streams over the same channels side by side (``GROUP_STREAMS``, a
    permutation of the same programs), or a program per channel block of all n streams
    (``AGG_STREAMS``, where n is a power of two and C a multiple of 256 / n), each with tileiras's
    worker warps and with eight (the hint is chosen by device, so every device must get the bits of
    every other), give dx and dW the same bits, at token counts off the 64-token tile, n = 2, 3, 4,
    8 and C of 1, 2 and 3 blocks, C = 384 (not a whole block, a whole number of channel blocks) and
    C = 96 at n = 8, into NaN-poisoned outputs, within bf16 rounding of float64."""
    from mhctool.kernels.cutile import proj_rms as cpr
    from mhctool.core.poison import poisoning

    g = torch.Generator(device="cuda").manual_seed(2)
    for m, n, c in ((1007, 4, 256), (130, 3, 768), (77, 2, 512), (65, 4, 384), (200, 8, 96)):
        x, w, gp, gr, agg = _proj_inputs(g, m, n * c, n)
        _, r, rms = cpr.forward(x, w, 1e-6)
        gc = torch.empty(m, cpr._ng(24), device="cuda")
        cpr.launch(cpr._pack_grad, (cpr.cdiv(m, cpr.BM_PACK),), (x, gp, gr, r, rms, gc, 24, cpr._ng(24), cpr.BM_PACK))
        runs = []
        for streams, group in ((False, False), (False, True), (True, False)):
            for warps in (None, 8):
                monkeypatch.setattr(cpr, "AGG_STREAMS", streams)
                monkeypatch.setattr(cpr, "GROUP_STREAMS", group)
                monkeypatch.setattr(cpr, "AGG_WORKER_WARPS", warps)
                dx, dw = torch.full_like(x, float("nan")), torch.full_like(w, float("nan"))
                with poisoning():
                    cpr.backward_packed(x, w, gc, dx, dw, agg=agg)
                runs.append((dx, dw))
        for dx, dw in runs[1:]:
            assert torch.equal(runs[0][0], dx) and torch.equal(runs[0][1], dw), (m, n, c)
        _assert_proj_grads(x, w, gp, gr, agg, *runs[0], (m, n, c))


@pytest.mark.parametrize("tf32", [False, True])
def test_triton_projection_backward_on_tensor_cores_matches_float64(tf32):
    """The Triton bf16 projection backward (the gradient split once into two bf16 pieces by
    ``_split_grad``, then the tensor-core kernel) at token counts off the 64-token tile and K off
    the 128-column block (304, 300, 28800), one token (an integer argument of 1 is a compile-time
    constant to Triton), with and without mix_aggregate's aggregation term, and in the TF32
    variant, into NaN-poisoned outputs: dx and dW match float64 (of the TF32-rounded gradient for
    the variant; bf16 x and W are TF32 values already) and repeat bit for bit."""
    from mhctool.kernels.torch.mhc import round_to_tf32
    from mhctool.kernels.triton import proj_rms as tpr
    from mhctool.core.poison import poisoning

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, ns in ((1007, 304, 0), (1007, 304, 4), (1007, 300, 0), (130, 28800, 4), (1, 304, 4)):
        x, w, gp, gr, agg = _proj_inputs(g, m, k, ns)
        _, r, rms = tpr.proj_rms_forward(x, w, 1e-6)
        with poisoning():
            runs = [tpr.proj_rms_backward(x, w, r, rms, gp, gr, agg=agg, tf32=tf32) for _ in range(2)]
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), (m, k, ns)
        _assert_proj_grads(x, w, round_to_tf32(gp) if tf32 else gp, gr, agg, *runs[0], (m, k, ns))


def test_triton_projection_backward_streams_side_by_side_give_the_plain_orders_bits(monkeypatch):
    """With mix_aggregate's aggregation term and C a whole number of the 128-column K block, the
    bf16 projection backward with the streams' programs side by side (``GROUP_STREAMS``, on by
    default) and in the plain order: dx and dW the same bits, and within bf16 rounding of float64,
    at token counts off the 64-token tile, one token, n = 2, 3, 4, into NaN-poisoned outputs."""
    from mhctool.kernels.triton import proj_rms as tpr
    from mhctool.core.poison import poisoning

    g = torch.Generator(device="cuda").manual_seed(1)
    for m, n, c in ((1007, 4, 256), (1, 4, 128), (130, 3, 2048), (77, 2, 384)):
        x, w, gp, gr, agg = _proj_inputs(g, m, n * c, n)
        _, r, rms = tpr.proj_rms_forward(x, w, 1e-6)
        runs = []
        for group in (True, False):
            monkeypatch.setattr(tpr, "GROUP_STREAMS", group)
            with poisoning():
                runs.append(tpr.proj_rms_backward(x, w, r, rms, gp, gr, agg=agg))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), (m, n, c)
        _assert_proj_grads(x, w, gp, gr, agg, *runs[0], (m, n, c))


@pytest.mark.parametrize("backend", ["triton", "cutile"])
def test_mix_aggregate_backward_with_sinkhorn_beside_gives_the_in_order_bits(monkeypatch, backend):
    """mix_aggregate's backward runs Sinkhorn's backward on a side stream beside the aggregation's
    (``schedule.beside``): all four gradients the same bits as the two in order, eagerly and
    replayed from a CUDA graph (the side stream joins the capture), at n = 4 (the projection's
    streams form in cuTile) and n = 3, with only g_res or only g_out given too."""
    import importlib

    from mhctool.analyses.timing import graphed

    mod = importlib.import_module(f"mhctool.kernels.{backend}.mix_aggregate")
    g = torch.Generator(device="cuda").manual_seed(3)
    for s, b, n, c in ((37, 3, 4, 256), (5, 7, 3, 67)):
        x = torch.randn(s, b, n, c, generator=g, device="cuda").bfloat16().requires_grad_()
        w = (torch.randn(n * n + 2 * n, n * c, generator=g, device="cuda") / (n * c) ** 0.5).bfloat16().requires_grad_()
        a = torch.tensor([0.8, 1.1, 0.9], device="cuda", requires_grad=True)
        hb = (0.1 * torch.randn(n * n + 2 * n, generator=g, device="cuda")).requires_grad_()
        fs = torch.cuda.Stream()  # a forward off the default stream, so that its backward can be captured
        fs.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(fs):
            outs = mod.mix_aggregate(x, w, a, hb)
        torch.cuda.current_stream().wait_stream(fs)
        ups = [torch.randn(o.shape, generator=g, device="cuda").to(o.dtype) for o in outs]
        for pick in ((0, 1, 2), (2,), (0,)):
            def grads():
                return torch.autograd.grad([outs[i] for i in pick], [x, w, a, hb], [ups[i] for i in pick],
                                           retain_graph=True, allow_unused=True)
            with monkeypatch.context() as m:
                m.setattr(mod, "beside", lambda side, main, device: (side(), main()))
                want = grads()
            got = grads()
            res = {}

            def captured():
                res["g"] = grads()
            graphed(captured)()
            torch.cuda.synchronize()
            for name, wt, gt, ct in zip(("x", "weight", "alpha", "h_bias"), want, got, res["g"]):
                if wt is None:
                    assert gt is None and ct is None, (backend, n, pick, name)
                    continue
                assert torch.isfinite(wt).all(), (backend, n, pick, name)
                assert torch.equal(wt, gt) and torch.equal(wt, ct), (backend, n, pick, name)


def test_cutile_mapping_backward_sums_bias_and_alpha_beside_dw():
    """The cuTile mapping backward: compute_h's backward gathers the three upstream gradients
    without the gathers' own bounds checks (its token mask covers them), and the bias / alpha
    partials are summed in the dW sum's launch (``sum_rows_pair``). At token counts off the
    128-token tile, one with more than 128 token blocks (two steps of the bias sum), into
    NaN-poisoned outputs: all four gradients match the float64 reference's and repeat bit for bit."""
    from mhctool.kernels.cutile import mapping as cmp
    from mhctool.core.poison import poisoning
    from mhctool.references import mhc as ref

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, dtype in ((1007, 300, torch.bfloat16), (16500, 96, torch.bfloat16), (333, 200, torch.float32)):
        x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        w = (torch.randn(24, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
        alpha = torch.rand(3, generator=g, device="cuda")
        bias = torch.randn(24, generator=g, device="cuda")
        ups = [torch.randn(m, 4, generator=g, device="cuda"), torch.randn(m, 4, generator=g, device="cuda"),
               torch.randn(m, 4, 4, generator=g, device="cuda")]
        leaves = [t.clone().requires_grad_() for t in (x, w, alpha, bias)]
        with poisoning():
            runs = [torch.autograd.grad(cmp.mapping(*leaves), leaves, ups) for _ in range(2)]
        for a, b in zip(*runs):
            assert torch.equal(a, b), (m, k)
        dd = [t.double().requires_grad_() for t in (x, w, alpha, bias)]
        want = torch.autograd.grad(ref.mapping(*dd), dd, [u.double() for u in ups])
        for name, got, ref_g in zip(("dx", "dW", "dalpha", "dbias"), runs[0], want):
            assert torch.isfinite(got).all(), (name, m, k)
            err = ((got.double() - ref_g).abs().max() / ref_g.abs().max()).item()
            tol = 2 ** -7 if got.dtype == torch.bfloat16 else 1e-5
            assert err < tol, (name, m, k, dtype, err)


def test_poisoning_reaches_autograds_cuda_backward_thread():
    """A CUDA backward runs on autograd's device thread: inside ``poisoning()`` the gradients it
    allocates through ``mhctool.poison.empty`` must come poisoned, as the runner's backward
    checks (``unwritten``) assume."""
    from mhctool.core.poison import empty, poisoning

    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            out = empty(g.shape, g.dtype, g.device)
            seen["poisoned"] = bool(torch.isnan(out).all())
            return out.copy_(g * 2)

    x = torch.ones(8, device="cuda", requires_grad=True)
    with poisoning():
        (gx,) = torch.autograd.grad(Probe.apply(x).sum(), x)
    assert seen["poisoned"] and torch.equal(gx, torch.full_like(x, 2.0))


def test_large_inputs_are_drawn_on_the_gpu_the_same_at_every_call(monkeypatch, family_cases):
    """Every family of the default scenario with every tensor past BIG: the large tensors come from
    mhctool.philox on the GPU (the small ones from the CPU generator, moved over by the runner), the
    same bits at every call, and the upstream gradients of a GPU output drawn there too."""
    from mhctool.core import inputs
    from mhctool.families import generate
    from mhctool.core.shapes import parse_shape
    monkeypatch.setattr(inputs, "BIG", 64)
    for kernel, name, shape in family_cases:
        first = generate(kernel, name, shape, 3, {}, draw_on="cuda")[1]
        again = generate(kernel, name, shape, 3, {}, draw_on="cuda")[1]
        on_cpu = generate(kernel, name, shape, 3, {})[1]
        for k, t in first.items():
            if t is None:
                continue
            assert t.shape == on_cpu[k].shape and t.dtype == on_cpu[k].dtype, (kernel, name, k)
            assert torch.equal(t, again[k]) and bool(torch.isfinite(t.float()).all()), (kernel, name, k)
            if t.is_floating_point() and t.numel() >= 64:
                assert t.is_cuda, (kernel, name, k)
    x = generate("h_aggregate", "random", parse_shape("64x4x4x256"), 5, {}, draw_on="cuda")[1]["x"].reshape(-1)
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
    assert not torch.equal(x[:256], x[256:512])
    ups = inputs.upstream_grads([torch.empty(70, 3, device="cuda", dtype=torch.bfloat16)], 1)
    assert ups[0].is_cuda and ups[0].dtype == torch.bfloat16 and float(ups[0].float().std()) > 0.5


def test_hold_gpu_keeps_the_stream_busy():
    """``bench.hold_gpu`` (what lets a graph replay be timed by its device work alone) holds the
    current stream for at least the time asked at clocks up to 2 GHz."""
    from mhctool.analyses.timing import hold_gpu

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    hold_gpu(0.02)
    e1.record()
    torch.cuda.synchronize()
    assert e0.elapsed_time(e1) >= 15.0


@pytest.mark.parametrize("layout", ["pip", "github"])
def test_tilekernels_as_shipped(tmp_path, layout):
    """DeepSeek's TileKernels (TileLang) through its adapter, both layouts: every function judged at
    a shape its kernels take (n = 4, C a multiple of 128, bf16), no error row. Needs the package
    (pip layout) or a GitHub checkout in .anchors/tilekernels-github; skips without them."""
    pytest.importorskip("tilelang")
    if layout == "pip":
        pytest.importorskip("tile_kernels.mhc")
        spec = "tilekernels:tile_kernels"
    else:
        folder = Path(__file__).resolve().parents[2] / ".anchors" / "tilekernels-github"
        if not (folder / "tile_kernels" / "modeling").is_dir():
            pytest.skip("no TileKernels GitHub checkout in .anchors/tilekernels-github")
        spec = f"tilekernels:{folder}"
    res, rows = _parity(tmp_path, "--kernel", "mhc", "--impl", spec, "--dtype", "bf16", "--shape", "37x3x4x256", "-q")
    mine = [r for r in rows if r["impl"].startswith("tilekernels[")]
    assert not [r for r in mine if r["metric"] == "error"], res.output
    judged = {r["impl"] for r in mine if r["passed"] is not None}
    assert len(judged) == 6, (judged, res.output)  # sinkhorn, apply_mix, post, mapping, mhc_pre, big_fuse


# --- the tests that read the background runs: last, so that the in-process tests above run
# while those runs compile ---------------------------------------------------------------------


@pytest.mark.background("triton")
def test_triton_parity_default_scenario_on_gpu(background):
    rc, text, rows, _ = background("triton")
    assert rc == 0, text
    tri = [r for r in rows if r["impl"] == "triton"]
    from mhctool.families import KERNELS
    assert {r["kernel"] for r in tri} == set(KERNELS)
    assert all(r["value"] == 0 for r in tri if r["metric"] == "unwritten")


@pytest.mark.background("fp16-h_aggregate")
def test_triton_fp16_activations_on_gpu_h_aggregate(background):
    """fp16 where the native baseline is meaningful (Sinkhorn and proj_rms in fp16 overflow on
    the amplifying families by design: that is what `stability` is for)."""
    rc, text, _, _ = background("fp16-h_aggregate")
    assert rc == 0, text


@pytest.mark.background("fp16-h_post_bda")
def test_triton_fp16_activations_on_gpu_h_post_bda(background):
    rc, text, _, _ = background("fp16-h_post_bda")
    assert rc == 0, text


@pytest.mark.background("defect")
def test_defect_flagged_on_gpu(background):
    rc, text, _, _ = background("defect")
    assert rc == 1, text


@pytest.mark.background("cutile-fp32")
@pytest.mark.background("cutile-bf16")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cutile_parity_default_scenario_on_gpu(background, dtype):
    rc, text, rows, _ = background(f"cutile-{dtype}")
    assert rc == 0, text
    ct_rows = [r for r in rows if r["impl"] == "cutile"]
    assert {r["kernel"] for r in ct_rows} == set(CUTILE_FAMILIES.split(","))
    assert all(r["value"] == 0 for r in ct_rows if r["metric"] == "unwritten")
    assert {r["direction"] for r in ct_rows} == {"fwd", "bwd"}


@pytest.mark.background("cuda-fault")
def test_a_cuda_fault_fails_its_row_and_the_next_cases_pass(background):
    """An illegal memory access poisons its process's CUDA context: under --isolate it is one
    failed row, and the cases after it run in a fresh worker and pass."""
    rc, text, rows, _ = background("cuda-fault")
    assert rc == 1, text
    fwd = {r["shape"]: r for r in rows if r["impl"].endswith("large_inputs") and r["direction"] == "fwd"
           and r["passed"] is not None and r["metric"] in ("error", "max_abs")}
    assert fwd["8x2x4x1"]["passed"] and fwd["9x1x4x1"]["passed"], fwd
    assert not fwd["101x1x4x1"]["passed"] and "illegal memory access" in fwd["101x1x4x1"]["message"], fwd


@pytest.mark.background("bwd-fault")
def test_a_fault_of_the_backward_is_the_backwards_row(background):
    """A backward that faults asynchronously where C % 4 != 0 (issue 76 item 5): the runner waits
    for each direction's kernels, so the fault is the backward's error row; the forward's outputs
    reached mhctool before the backward ran (issue 89), so the forward is judged, and passes;
    C = 64 passes."""
    rc, text, rows, _ = background("bwd-fault")
    assert rc == 1, text
    ours = [r for r in rows if r["impl"].endswith("unless_c4")]
    odd_fwd = [r for r in ours if r["shape"] == "13x3x4x67" and r["direction"] == "fwd" and r["passed"] is not None]
    assert odd_fwd and all(r["passed"] for r in odd_fwd), odd_fwd
    odd = {r["direction"]: r for r in ours if r["shape"] == "13x3x4x67" and r["tensor"] == "*"}
    assert odd["bwd"]["passed"] is False and odd["bwd"]["rule"] == "cuda", odd
    assert "illegal memory access" in odd["bwd"]["message"], odd
    even = [r["passed"] for r in ours if r["shape"] == "13x3x4x64" and r["passed"] is not None]
    assert even and all(even), [r for r in ours if r["shape"] == "13x3x4x64"]


def test_identify_names_the_alignment_a_faulting_backward_needs(tmp_path):
    """The same faulting backward through identify (isolated, as an outside function on a GPU): the
    fault is the backward's, the channel count is found to be why, and the kernel is identified
    at an aligned shape."""
    res = subprocess.run([sys.executable, "-m", "mhctool.cli", "identify", "--kernel", "h_aggregate", "--impl",
                          f"{IMPLS / 'gpu_faults.py'}:h_aggregate_backward_faults_unless_c4", "--device", "cuda",
                          "-q", "-o", str(tmp_path / "id.parquet")], capture_output=True, text=True, timeout=600)
    text = " ".join(res.stdout.split())
    assert res.returncode == 0, text + res.stderr[-2000:]
    assert text.startswith("best match: the contract (") and "its backward fails at C = 67 (C % 4 = 3: " in text, text
    assert "illegal memory access" in text and "runs at C = 64 and 68: an alignment requirement of its backward" in text


@pytest.mark.background("cutile-mix-bf16")
@pytest.mark.background("cutile-mix-fp32")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cutile_mix_aggregate_adds_the_aggregation_gradient_on_both_paths(background, dtype):
    """cuTile's mix_aggregate adds the aggregation's gradient of x inside the projection backward:
    as tiles where C is a whole number of the backward's half blocks (C = 128 and 256: 128 and 16
    columns for bf16 and fp32) and gathered otherwise (C = 67, 40). n = 3 at C = 128 gives K an
    odd number of half blocks (the last one repeated); token counts off every tile; parity's
    NaN-poisoned outputs and float64 reference judge every gradient (tests/data/gpu-mix.toml)."""
    rc, text, rows, _ = background(f"cutile-mix-{dtype}")
    assert rc == 0, text
    ours = [r for r in rows if r["impl"] == "cutile"]
    assert {r["shape"] for r in ours} == {"37x1x3x128", "13x3x4x67", "9x2x2x40", "5x7x4x256"}
    assert {r["direction"] for r in ours} == {"fwd", "bwd"}
    assert all(r["value"] == 0 for r in ours if r["metric"] == "unwritten")
    verdicts = [r["passed"] for r in ours if r["passed"] is not None]
    assert verdicts and all(verdicts)


@pytest.mark.background("context")
def test_a_backward_that_launches_cutile_and_triton_has_its_context_in_a_fresh_worker(background):
    """Issue 39: under default isolation (an external implementation on a GPU runs in a worker),
    from empty compile caches, a backward that launches a cuTile and a Triton kernel on autograd's
    device thread is judged, never an error row of mhctool's own making."""
    rc, text, rows, _ = background("context")
    mine = [r for r in rows if r["impl"].endswith(":h_aggregate")]
    assert mine and not [r for r in mine if r["metric"] == "error"], [r["message"] for r in mine if r["metric"] == "error"]
    assert rc == 0, text
    assert {r["direction"] for r in mine if r["passed"]} == {"fwd", "bwd"}
    assert "no current CUDA context" not in text


@pytest.mark.background("train-triton")
@pytest.mark.background("train-cutile")
@pytest.mark.parametrize("impl", ["triton", "cutile"])
def test_train_on_gpu_stays_with_the_float64_run(background, impl):
    """mhctool train on the GPU (a small model, bf16 activations): mhctool's kernels in every mHC
    family they have stay with the float64 trajectory within kappa of native's drift."""
    if impl == "cutile":
        from mhctool.core.environment import cutile_status
        if cutile_status().reason:
            pytest.skip(cutile_status().reason)
    rc, text, rows, path = background(f"train-{impl}")
    assert rc == 0, text
    import json
    meta = json.loads(pq.read_schema(path).metadata[b"mhctool.run"])
    ran = set(meta["pieces"].values())
    assert impl in ran, meta["pieces"]
    assert any(r["metric"] == "mem-max-allocated-bytes" for r in rows)


def _megatron_core_tree() -> Path | None:
    """A staged megatron-core at the PR 3828 merge: $MCORE (dev/mcore_gpu.sh unpacks one there) or
    .anchors/megatron-core/m3828 (../shared/anchors/stage.sh megatron-core)."""
    for p in (os.environ.get("MCORE"), Path(__file__).resolve().parents[2] / ".anchors" / "megatron-core" / "m3828"):
        if p and (Path(p) / "megatron" / "core").is_dir():
            return Path(p)
    return None


@pytest.mark.slow  # three processes, each compiling Megatron's torch.compile'd mHC functions
@pytest.mark.parametrize("impl", ["megatron", "triton"])
def test_megatron_engine_trains_its_own_gpt_with_the_kernels_swapped_in(tmp_path, impl):
    """mhctool train --engine megatron:TREE (issue 77) on one GPU: Megatron-core's GPT with
    hyper-connections, its optimizer and num-zeros, the recipe at toy sizes; its own fused kernels
    (its switch) and mhctool's Triton kernels at the module's entry points stay with the float64 run."""
    tree = _megatron_core_tree()
    if tree is None:
        pytest.skip("no megatron-core staged ($MCORE or .anchors/megatron-core/m3828)")
    res = subprocess.run([sys.executable, "-m", "mhctool.cli", "train", "--engine", f"megatron:{tree}", "--impl", impl,
                          "--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "64", "--batch", "2",
                          "--vocab", "1024", "--steps", "3", "--seeds", "1", "--recipe", "global_batch=4",
                          "-o", str(tmp_path / "t.parquet")], capture_output=True, text=True, timeout=500)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "PASSED stays with the float64 reference" in text, text


@pytest.mark.slow
def test_megatron_engine_runs_the_recipe_at_tensor_and_sequence_parallel_2(tmp_path):
    """--ranks 2 --recipe sequence_parallel=true (issue 77): the recipe's parallelism, a GPU a rank,
    with the norms marked for Megatron's sequence-parallel gradient all-reduce
    (megatron_core.SequenceParallelNorm); Megatron's fused kernels stay with the float64 run."""
    import torch
    tree = _megatron_core_tree()
    if tree is None or torch.cuda.device_count() < 2:
        pytest.skip("needs a staged megatron-core and two GPUs")
    res = subprocess.run([sys.executable, "-m", "mhctool.cli", "train", "--engine", f"megatron:{tree}", "--impl",
                          "megatron", "--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "64", "--batch", "2",
                          "--vocab", "1024", "--steps", "3", "--seeds", "1", "--recipe", "global_batch=4",
                          "--ranks", "2", "--recipe", "sequence_parallel=true", "-o", str(tmp_path / "t.parquet")],
                         capture_output=True, text=True, timeout=500)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "PASSED stays with the float64 reference" in text, text


@pytest.mark.slow  # five processes, each compiling Megatron's torch.compile'd mHC functions
def test_bench_engine_times_megatrons_step_for_each_variant(tmp_path):
    """mhctool bench --engine megatron:TREE (issue 91) at toy sizes on one GPU: the GPT without
    hyper-connections, Megatron's own mHC path, its fused kernels and mhctool's Triton kernels at
    its entry points, each step timed, the overhead over the baseline and the entry points' time."""
    import pyarrow.parquet as pq
    tree = _megatron_core_tree()
    if tree is None:
        pytest.skip("no megatron-core staged ($MCORE or .anchors/megatron-core/m3828)")
    out = tmp_path / "s.parquet"
    res = subprocess.run([sys.executable, "-m", "mhctool.cli", "bench", "--engine", f"megatron:{tree}", "--impl",
                          "triton", "--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "64", "--batch", "2",
                          "--vocab", "1024", "--recipe", "global_batch=4", "--steps", "4", "--warmup", "2",
                          "--entry-steps", "2", "-o", str(out)], capture_output=True, text=True, timeout=500)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    rows = pq.read_table(out).to_pylist()
    step = {r["variant"]: r["value"] for r in rows if r["metric"] == "step_ms"}
    assert set(step) == {"plain", "native", "fused", "triton"} and min(step.values()) > 0, step
    over = {r["variant"] for r in rows if r["metric"] == "overhead"}
    assert over == {"native", "fused", "triton"}, over
    timed = {(r["variant"], r["entry"], r["direction"]) for r in rows if r["metric"] == "entry_ms" and r["value"] > 0}
    for v in ("native", "fused", "triton"):
        assert {(v, "sinkhorn", "fwd"), (v, "sinkhorn", "bwd")} <= timed, (v, timed)
    assert any(r["metric"] == "peak_bytes" and r["value"] > 0 for r in rows)


def test_the_remembered_dispatch_gives_the_module_paths_bits(monkeypatch):
    """The fused module path with Triton's kernels (the pre-path, then the post-path with dropout;
    forward and backward) launched through the remembered dispatch (kernels/triton/_common.fast)
    and through Triton's own: the same bits, with x on a 16-byte boundary and 2 bytes off one
    (another specialization, which must not take the aligned kernel), and the remembered path taken."""
    from mhctool.analyses.train import module_path
    from mhctool.core.shapes import parse_shape_for
    from mhctool.families import generate
    from mhctool.kernels.triton import _common, h_post_bda, mapping

    ops = module_path.ops(module_path.pieces("impl", "triton", {}, "cuda")[0])
    _, case = generate("mix_aggregate", "random", parse_shape_for("mhc", "37x2x4x200"), 5, {}, device="cuda")
    x0, w, a, hb = case["x"].bfloat16(), case["weight"].bfloat16(), case["alpha"], case["h_bias"]
    s, b, n, c = x0.shape
    g = torch.Generator(device="cuda").manual_seed(6)
    bias = (0.1 * torch.randn(c, generator=g, device="cuda")).bfloat16()
    up = torch.randn(s, b, n, c, generator=g, device="cuda").bfloat16()
    buf = torch.empty(x0.numel() + 1, dtype=x0.dtype, device="cuda")
    x_off = buf[1:].view(x0.shape)  # 2 bytes past the allocation's start
    x_off.copy_(x0)

    def run(x):
        leaves = [t.detach().requires_grad_() for t in (x, w, a, hb, bias)]
        agg, h_res, h_post = ops["pre_path"](*leaves[:4])
        out = ops["post_path"](h_res, leaves[0], h_post, agg * 1.0, leaves[4], 0.1, 1234, 99)
        return [out, *torch.autograd.grad(out, leaves, up)]

    got = {}
    for on in (False, True):
        monkeypatch.setattr(_common, "FAST_LAUNCH", on)
        got[on] = [run(x) for x in (x0, x0, x_off, x_off, x0)]
    torch.cuda.synchronize()
    for i, (want, have) in enumerate(zip(got[False], got[True])):
        for name, wt, ht in zip(("out", "dx", "dweight", "dalpha", "dh_bias", "dbias"), want, have):
            assert torch.isfinite(wt).all() and torch.equal(wt, ht), (i, name)
    assert mapping._mapping_fwd.run.hits > 0 and h_post_bda._h_post_bda_fwd4.run.hits > 0
