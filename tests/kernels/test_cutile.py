"""The cuTile backend on a machine without a GPU: every kernel module imports, every kernel
compiles to Tile IR (cuTile's front end: types, shapes, control flow), and asking for the backend
explicitly is a clear exit 2. Running the kernels needs the GPU (tests/kernels/test_gpu.py)."""
import importlib

import pytest
import torch
from typer.testing import CliRunner

from mhctool.cli.app import app
from mhctool.registry.builtin import CUTILE_KERNELS, impls_for

ct = pytest.importorskip("cuda.tile")
runner = CliRunner()
MODULES = sorted({target.split(":")[0] for target in CUTILE_KERNELS.values()})


@pytest.mark.parametrize("module", MODULES)
def test_every_cutile_kernel_compiles_to_tile_ir(module):
    mod = importlib.import_module(module)
    ir = mod.compile_checks()
    assert ir and all(len(b) > 500 for b in ir.values())
    assert any(k.startswith("fwd") for k in ir) and any(k.startswith("bwd") for k in ir)


def test_registered_entry_points_exist_and_are_gpu_only():
    for kernel, target in CUTILE_KERNELS.items():
        mod, fn = target.split(":")
        assert callable(getattr(importlib.import_module(mod), fn))
        (impl,) = [i for i in impls_for(kernel) if i.name == "cutile"]
        assert impl.devices == ("cuda",)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_asking_for_cutile_without_a_gpu_is_exit_2(tmp_path):
    res = runner.invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", "cutile", "--device", "cpu",
                              "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2, res.output
    assert "cutile cannot run sinkhorn here" in res.output and "GPU" in res.output
    res = runner.invoke(app, ["doctor"])
    assert "cutile" in res.output and "GPU" in res.output


def test_kernels_refuse_cpu_tensors():
    from mhctool.kernels.cutile import h_aggregate, sinkhorn
    with pytest.raises(ValueError, match="CUDA tensors"):
        sinkhorn.sinkhorn(torch.randn(3, 4, 4))
    with pytest.raises(ValueError, match="CUDA tensors"):
        h_aggregate.h_aggregate(torch.randn(2, 1, 4, 8), torch.rand(2, 1, 4))


def test_sinkhorn_takes_the_per_token_path_up_to_n_4():
    from mhctool.kernels.cutile import sinkhorn as sk
    for n in (1, 2, 3, 4):
        fwd, bwd, grid, consts, _ = sk._plan(n, 1000, 20, 1e-6, "rowmax", "add", "row_first")
        assert (fwd, bwd) == (sk._sinkhorn_fwd_el, sk._sinkhorn_bwd_el)
        assert grid == (-(-1000 // sk.EL_BT),) and consts[1] == n
    fwd, bwd, grid, consts, _ = sk._plan(5, 1000, 20, 1e-6, "rowmax", "add", "row_first")
    assert (fwd, bwd) == (sk._sinkhorn_fwd, sk._sinkhorn_bwd) and consts[2] == 8  # NP


def test_partial_sums_step_over_a_power_of_two_rows():
    """The fixed-order sum of per-split / per-block partials loads ``(rows a step, columns)``
    tiles: a power of two (3 dW splits at a small fp32 shape once made a 3-row tile, which cuTile
    refuses on the GPU), never more than asked and no more than the rows need."""
    from mhctool.kernels.cutile._common import BR, rows_a_step

    for rows in range(0, 300):
        for br in (BR, 8, 128, 3):
            cap = 1 << (br - 1).bit_length()  # br as a power of two
            got = rows_a_step(rows, br)
            assert got & (got - 1) == 0 and got <= cap, (rows, br, got)
            if 0 < rows <= cap:
                assert rows <= got < 2 * rows, (rows, br, got)  # one step, no more than the rows need
            elif rows > cap:
                assert got == cap, (rows, br, got)
    assert rows_a_step(3) == 4 and rows_a_step(8) == 8 and rows_a_step(500, 128) == 128 and rows_a_step(0) == 1


def test_the_aggregation_terms_worker_warps_go_by_device(monkeypatch):
    """The bf16 projection backward with mix_aggregate's term takes eight worker warps on an H100
    and tileiras's pick elsewhere (an H200 ran it 24% slower with eight); the kernels without the
    term, and the fp32 one, launch as declared; a sweep's setting wins over the table."""
    from mhctool.kernels.cutile import proj_rms as cpr

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert cpr.agg_worker_warps(h100) == 8 and cpr.agg_worker_warps(h200) is None
    assert cpr._bwd_kernel(True, True, h200) is cpr._proj_rms_bwd
    assert cpr._bwd_kernel(True, True, h100) is not cpr._proj_rms_bwd
    assert cpr._bwd_kernel(True, True, h100) is cpr._bwd_kernel(True, True, h100)  # compiled once
    assert cpr._bwd_kernel(False, True, h100) is cpr._proj_rms_bwd
    assert cpr._bwd_kernel(True, False, h100) is cpr._proj_rms_bwd
    monkeypatch.setattr(cpr, "AGG_WORKER_WARPS", 4)
    assert cpr.agg_worker_warps(h100) == 4 and cpr.agg_worker_warps(h200) == 4
    monkeypatch.setattr(cpr, "AGG_WORKER_WARPS", None)
    assert cpr.agg_worker_warps(h100) is None


def test_the_aggregation_terms_streams_form_goes_where_its_tiles_fit(monkeypatch):
    """The projection backward with mix_aggregate's term takes a program per channel block of all n
    streams (bf16, n a power of two, C a multiple of 256 / n; the paper's n = 4, C = 7168) and the
    per-K-block kernel elsewhere (n = 3, C = 75, fp32, or with the form switched off)."""
    from mhctool.kernels.cutile import proj_rms as cpr

    bk = cpr.AGG_TILE[1]
    assert cpr._streams_form(4, 7168, bk, True) and cpr._streams_form(2, 512, bk, True)
    assert cpr._streams_form(8, 96, bk, True) and cpr._streams_form(4, 384, bk, True)
    assert not cpr._streams_form(3, 768, bk, True) and not cpr._streams_form(4, 75, bk, True)
    assert not cpr._streams_form(4, 7168, bk, False) and not cpr._streams_form(1, 7168, bk, True)
    for dev in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):  # tileiras's worker warps on either device
        assert cpr._bwd_kernel(True, True, dev, True) is cpr._proj_rms_bwd_streams
    monkeypatch.setattr(cpr, "AGG_STREAMS", False)
    assert not cpr._streams_form(4, 7168, bk, True)


# --- the disk cache of mhctool's own cuTile compilations (kernels/cutile/_cache.py) ----------------

def _cache_setup(monkeypatch, tmp_path):
    from mhctool.kernels.cutile import _cache
    monkeypatch.setenv("MHCTOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_cache, "_versions", lambda: ("1.7.0", "tileiras 13.4"))
    monkeypatch.setattr(_cache, "_capability", lambda: (9, 0))
    calls = []

    def compile_(self, signature, context, cc=None):  # cuTile's kernel._compile, stood in for
        calls.append(signature)
        return b"cubin:" + repr(signature).encode(), f"sym_{len(calls)}", None, ()
    return _cache, calls, compile_


class _Kernel:
    def __init__(self, module, options="opts"):
        def fn():
            pass
        fn.__module__ = module
        self._pyfunc, self._compiler_options = fn, options


def test_a_compilation_is_kept_for_the_next_process_and_read_back_as_it_was(monkeypatch, tmp_path):
    _cache, calls, compile_ = _cache_setup(monkeypatch, tmp_path)
    k = _Kernel("mhctool.kernels.cutile.sinkhorn")
    first = _cache.cached_compile(compile_, k, ("f32", 4), None)
    again = _cache.cached_compile(compile_, k, ("f32", 4), None)  # what a new process finds on disk
    assert len(calls) == 1 and again == first
    # another signature, other hints or another GPU is another compilation
    _cache.cached_compile(compile_, k, ("bf16", 4), None)
    _cache.cached_compile(compile_, _Kernel(k._pyfunc.__module__, "other"), ("f32", 4), None)
    _cache.cached_compile(compile_, k, ("f32", 4), None, (10, 0))
    assert len(calls) == 4
    # a broken entry is compiled again and replaced
    for entry in (tmp_path / "cache" / "cutile").glob("*.bin"):
        entry.write_bytes(entry.read_bytes()[:12])
    assert _cache.cached_compile(compile_, k, ("f32", 4), None)[0] == first[0] and len(calls) == 5


def test_what_the_cache_cannot_vouch_for_compiles_as_cutile_would(monkeypatch, tmp_path):
    _cache, calls, compile_ = _cache_setup(monkeypatch, tmp_path)
    other = _Kernel("megatron.core.fusions.fused_mhc_kernels")  # another package's kernel
    for _ in range(2):
        _cache.cached_compile(compile_, other, ("f32",), None)
    assert len(calls) == 2
    monkeypatch.setattr(_cache, "_versions", lambda: None)  # no compiler version known
    ours = _Kernel("mhctool.kernels.cutile.h_aggregate")
    for _ in range(2):
        _cache.cached_compile(compile_, ours, ("f32",), None)
    assert len(calls) == 4
    monkeypatch.setattr(_cache, "_versions", lambda: ("1.7.0", "tileiras 13.4"))
    monkeypatch.setenv("MHCTOOL_CACHE", "0")  # turned off
    for _ in range(2):
        _cache.cached_compile(compile_, ours, ("f32",), None)
    assert len(calls) == 6 and not list((tmp_path / "cache").rglob("*.bin"))
    monkeypatch.setenv("MHCTOOL_CACHE", str(tmp_path / "cache"))

    def linked(self, signature, context, cc=None):  # a compilation that links libraries: not kept
        calls.append(signature)
        return b"cubin", "sym", None, ("a library",)
    for _ in range(2):
        _cache.cached_compile(linked, ours, ("f32",), None)
    assert len(calls) == 8 and not list((tmp_path / "cache" / "cutile").glob("*.bin"))


def test_the_key_follows_the_values_a_kernel_reads_when_it_compiles(monkeypatch, tmp_path):
    _cache, calls, compile_ = _cache_setup(monkeypatch, tmp_path)
    from mhctool.kernels.cutile import sinkhorn
    k = _Kernel("mhctool.kernels.cutile.sinkhorn")
    _cache.cached_compile(compile_, k, ("f32",), None)
    monkeypatch.setattr(sinkhorn, "EL_MAX_N", 3)  # a value the kernels read when they compile
    _cache.cached_compile(compile_, k, ("f32",), None)
    assert len(calls) == 2


def test_two_processes_asking_at_once_compile_once(monkeypatch, tmp_path):
    import threading
    import time
    _cache, calls, compile_ = _cache_setup(monkeypatch, tmp_path)

    def slow(self, signature, context, cc=None):
        time.sleep(0.3)
        return compile_(self, signature, context, cc)
    k = _Kernel("mhctool.kernels.cutile.sinkhorn")
    got = []
    threads = [threading.Thread(target=lambda: got.append(_cache.cached_compile(slow, k, ("f32",), None)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got[0] == got[1]


def test_the_cache_wraps_this_cuda_tile_kernel_compilation():
    import mhctool.kernels.cutile  # noqa: F401 - installs it
    from cuda.tile import _execution

    from mhctool.kernels.cutile import _cache
    assert getattr(_execution.kernel._compile, "_mhctool_cached", False)
    assert _cache.install()  # once a process: a second call changes nothing
    assert _execution.kernel._compile._mhctool_cached


def test_a_cache_folder_this_process_cannot_write_compiles_as_cutile_would(monkeypatch, tmp_path):
    """A read-only cache (one a team shares, or a home the job cannot write): no lock, no entry,
    the compilation as cuTile makes it."""
    from mhctool.kernels import _disk
    _cache, calls, compile_ = _cache_setup(monkeypatch, tmp_path)

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(_disk, "open", refused, raising=False)  # the lock file
    monkeypatch.setattr(_disk.tempfile, "mkstemp", refused)  # the entry
    k = _Kernel("mhctool.kernels.cutile.sinkhorn")
    for _ in range(2):
        assert _cache.cached_compile(compile_, k, ("f32",), None)[0].startswith(b"cubin:")
    assert len(calls) == 2 and not list((tmp_path / "cache").rglob("*.bin"))


def test_the_dropout_scalars_reach_the_launch_as_int32_words():
    """cuTile types a Python int argument int32: a seed's words, Megatron's 64-bit offset and the
    threshold at p >= 0.5 pass 2**31 - 1, which raised OverflowError at the launch on an H100
    (2026-12-07). Each goes as the int32 of its 32 bits, and the kernel takes the bits back."""
    from mhctool.references import dropout as contract
    from mhctool.kernels.cutile.h_post_bda import mask_args

    def bits(v):
        return v & 0xFFFFFFFF
    for c, p, seed, offset in ((7168, 0.1, 1234, 4294967000), (67, 0.6, 2**63 - 1, 2**40 + 5), (4, 0.0, 0, 0)):
        (s_lo, s_hi, o_lo, o_hi, g_row, thr, scale), on = mask_args(c, p, seed, offset)
        k = contract.key(c, p, seed, offset)
        assert all(-2**31 <= w < 2**31 for w in (s_lo, s_hi, o_lo, o_hi, g_row, thr))
        assert bits(s_lo) | bits(s_hi) << 32 == k.seed and bits(o_lo) + (o_hi << 32) == k.offset
        assert bits(thr) == k.threshold and g_row == k.counters_per_row and scale == k.scale and on == (p > 0)
