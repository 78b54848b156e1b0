"""The Triton kernels' remembered dispatch (``kernels/triton/_common.fast``): a launch whose key (each
tensor's dtype and 16-byte alignment, each integer's 1-ness, divisibility by 16 and width, every
constexpr's value, the options) was seen before goes straight to the compiled kernel Triton's own
dispatch chose for it, with every argument in the kernel's order; anything new goes through
Triton's dispatch. On the CPU against a stand-in kernel (the interpreter has no launcher); the
module path's bits with and without it are the GPU test's (tests/kernels/test_gpu.py)."""
import pytest
import torch

from mhctool.kernels.triton import _common


class _Param:
    def __init__(self, name, constexpr=False, default=None, has_default=False):
        self.name, self.is_constexpr, self.default, self.has_default = name, constexpr, default, has_default


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, tag, fail=False):
        self.tag, self.fail, self.launches = tag, fail, []

    def run(self, *args):
        if self.fail:
            raise TypeError("a launcher of another form")
        self.launches.append(args)


class _Kernel:
    """What ``fast`` reads off a ``triton.jit`` kernel: its parameters and its ``run``."""

    def __init__(self):
        self.params = [_Param("x_ptr"), _Param("n"), _Param("eps"), _Param("flag"), _Param("BLOCK", constexpr=True),
                       _Param("MODE", constexpr=True, default=3, has_default=True)]
        self.slow_calls = []

    def run(self, *args, grid, warmup, **kw):
        ck = _Compiled(len(self.slow_calls))
        self.slow_calls.append((args, grid, warmup, kw))
        return ck


@pytest.fixture
def dispatch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_common, "_STREAM", [lambda device: f"stream{device}"])
    k = _Kernel()
    return k, _common._Dispatch(k)


def test_a_key_seen_before_launches_the_remembered_kernel_with_every_argument_in_order(dispatch):
    k, d = dispatch
    x = torch.zeros(64)
    first = d(x, 17, 0.5, True, BLOCK=32, grid=(4,), warmup=False, num_warps=4)
    again = d(x, 33, 0.25, True, BLOCK=32, grid=(4,), warmup=False, num_warps=4)  # same key: 33 is like 17
    assert len(k.slow_calls) == 1 and again is first and d.hits == 1
    assert first.launches == [(4, 1, 1, "stream0", "fn", "meta", None, None, None, x, 33, 0.25, True, 32, 3)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "one", "by16", "wide", "bool", "constexpr", "option"])
def test_anything_triton_specializes_on_is_a_new_key(dispatch, change):
    k, d = dispatch
    x = torch.zeros(64)
    base = dict(args=(x, 17, 0.5, True), kw=dict(BLOCK=32, num_warps=4))
    d(*base["args"], grid=(4,), warmup=False, **base["kw"])
    args, kw = list(base["args"]), dict(base["kw"])
    if change == "misaligned":
        args[0] = x[1:]  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args[0] = x.double()
    elif change in ("one", "by16", "wide"):
        args[1] = {"one": 1, "by16": 32, "wide": 2**40 + 1}[change]
    elif change == "bool":
        args[3] = False
    elif change == "constexpr":
        kw["BLOCK"] = 64
    else:
        kw["num_warps"] = 8
    d(*args, grid=(4,), warmup=False, **kw)
    assert len(k.slow_calls) == 2 and d.hits == 0


def test_triton_dispatches_where_the_remembered_path_cannot(dispatch, monkeypatch):
    k, d = dispatch
    x = torch.zeros(64)
    for _ in range(2):
        d(x, 17, 0.5, True, BLOCK=32, grid=(4,), warmup=True)  # a warm-up compiles only
    assert len(k.slow_calls) == 2
    monkeypatch.setattr(_common, "FAST_LAUNCH", False)
    d(x, 17, 0.5, True, BLOCK=32, grid=(4,), warmup=False)
    d(x, 17, 0.5, True, BLOCK=32, grid=(4,), warmup=False)
    assert len(k.slow_calls) == 4 and d.hits == 0
    monkeypatch.setattr(_common, "FAST_LAUNCH", True)
    d(x, 17, 0.5, True, BLOCK=32, grid=lambda meta: (4,), warmup=False)  # a grid computed by Triton
    assert len(k.slow_calls) == 5 and d.hits == 0
    monkeypatch.setattr(_common, "_hooked", lambda: True)  # a profiler watching Triton's launches
    d(x, 17, 0.5, True, BLOCK=32, grid=(4,), warmup=False)
    assert len(k.slow_calls) == 6 and d.hits == 0


def test_a_hook_on_tritons_launches_is_seen(monkeypatch):
    import triton
    rt = triton.knobs.runtime
    assert not _common._hooked()
    if hasattr(rt.launch_enter_hook, "add"):  # a chain of hooks (Triton 3.9)
        hook = lambda *a, **k: None  # noqa: E731
        rt.launch_enter_hook.add(hook)
        try:
            assert _common._hooked()
        finally:
            rt.launch_enter_hook.remove(hook)
    else:
        monkeypatch.setattr(rt, "launch_enter_hook", lambda *a, **k: None)
        assert _common._hooked()


def test_a_launcher_of_another_form_turns_the_remembered_path_off(dispatch, monkeypatch):
    k, d = dispatch
    x = torch.zeros(64)
    monkeypatch.setattr(k, "run", lambda *a, grid, warmup, **kw: k.slow_calls.append(a) or _Compiled(0, fail=True))
    d.slow = k.run
    for _ in range(3):
        d(x, 17, 0.5, True, BLOCK=32, grid=(4,), warmup=False)
    assert d.off and len(k.slow_calls) == 3 and d.hits == 0


def test_under_the_interpreter_a_kernel_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(_common, "_INTERPRETED", True)
    k = _Kernel()
    run = k.run
    assert _common.fast(k) is k and k.run == run
    monkeypatch.setattr(_common, "_INTERPRETED", False)
    assert _common.fast(k) is k and isinstance(k.run, _common._Dispatch)
