import os

# pytest-xdist's workers (`pytest -n 2`): one intra-op thread each, set before torch is imported
# and inherited by the workers and ranks the tests start, so that two test processes do not spin
# OpenMP threads on the same cores, and every process of a test computes with one thread count
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run through the interpreter on machines without a GPU. It must be set before any
# kernel module is imported, so the tests set it here, not the user.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (long sweeps; CI and `pytest -m gpu` leave them out)")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    slow = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(no_gpu)
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(slow)


@pytest.fixture
def family_cases():
    """(kernel, family, shape) of the default scenario, one shape a family (tests of the inputs)."""
    from mhctool.analyses import scenario
    seen = {}
    for c in scenario.resolve(None).cases("cpu"):
        seen.setdefault((c.kernel, c.family), c.shape)
    return [(k, f, sh) for (k, f), sh in seen.items()]
