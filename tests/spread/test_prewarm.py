"""mhctool.prewarm: Triton's hash of itself computed early, off CUDA, only where a GPU may run it."""
import importlib
import sys

import pytest

from mhctool.spread import forkserver, prewarm


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(prewarm, "_thread", None)
    calls = []
    import triton.runtime.cache as cache
    monkeypatch.setattr(cache, "triton_key", lambda: calls.append(1) or "key", raising=False)
    return calls


@pytest.mark.parametrize("visible, present, expected", [
    (None, True, True), ("0,1", True, True), ("", True, False), ("-1", True, False), (None, False, False)])
def test_gpu_machine_needs_a_driver_and_a_visible_gpu(monkeypatch, visible, present, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(prewarm.os.path, "exists", lambda p: present and p == "/dev/nvidiactl")
    assert prewarm.gpu_machine() is expected


def test_start_hashes_once_on_a_thread_on_a_gpu_machine(monkeypatch, fresh):
    monkeypatch.setattr(prewarm, "gpu_machine", lambda: True)
    prewarm.start("cuda")
    first = prewarm._thread
    first.join(10)
    prewarm.start(None)  # once a process
    assert prewarm._thread is first and fresh == [1]


@pytest.mark.parametrize("device, gpu", [("cpu", True), (None, False), ("cuda", False)])
def test_start_does_nothing_for_the_cpu_or_without_a_gpu(monkeypatch, fresh, device, gpu):
    monkeypatch.setattr(prewarm, "gpu_machine", lambda: gpu)
    prewarm.start(device)
    assert prewarm._thread is None and fresh == []


def test_a_triton_without_the_hash_is_no_error(monkeypatch):
    import triton.runtime.cache as cache
    monkeypatch.delattr(cache, "triton_key", raising=False)
    assert prewarm.triton_hash() is False


def test_the_fork_server_preloads_the_hash_where_there_is_a_gpu(monkeypatch, fresh):
    assert "mhctool.spread.preload" in forkserver.FORKSERVER_PRELOAD
    for gpu, expected in ((False, []), (True, [1])):
        monkeypatch.setattr(prewarm, "gpu_machine", lambda gpu=gpu: gpu)
        sys.modules.pop("mhctool.spread.preload", None)
        importlib.import_module("mhctool.spread.preload")
        assert fresh == expected
    sys.modules.pop("mhctool.spread.preload", None)
