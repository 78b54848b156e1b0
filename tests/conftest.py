import math
import os

# pytest-xdist's workers (`pytest -n 2`): one intra-op thread each, set before torch is imported
# and inherited by the workers and ranks the tests start, so that two test processes do not spin
# OpenMP threads on the same cores, and every process of a test computes with one thread count
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# the commands' cases in the test's own process, as the tests were written for (the test files are
# spread over the cores already); a test of the default spread unsets it
os.environ.setdefault("MHCTOOL_WORKERS", "1")

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


def _listed_slow() -> set[str]:
    """The tests ``slow-tests.txt`` lists (a call of 2 s or more on a 2-core CPU, written by
    dev/slow_tests.py): marked slow like those that carry the mark, so that the README's command
    stays within 3 minutes on CI's 2 cores; ``--slow`` runs them."""
    path = os.path.join(os.path.dirname(__file__), "slow-tests.txt")
    with open(path) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    slow = pytest.mark.skip(reason="slow: run with --slow")
    listed = _listed_slow()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
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


@pytest.fixture
def underflowing_logits():
    """``make(tokens, n, knobs, device)``: Sinkhorn logits whose last column sits 200 below the rest
    (as mHC's learned logits come to at a large learning rate), so that exp underflows to zero
    there in fp32, and the float64 function the fp32 kernels then compute: the reference with that
    column at -inf (its gradient there is zero). Returns (fp32 leaf, float64 leaf)."""
    def make(tokens, n, knobs, device="cpu", seed=0):
        g = torch.Generator().manual_seed(seed)
        L = torch.randn(tokens, n, n, generator=g) * 3
        L[..., n - 1] -= 200.0
        if knobs.get("stabilize") == "none":
            L -= 50.0  # no max subtraction: keep exp of the largest entries in range
        Ld = L.double()
        Ld[..., n - 1] = -math.inf
        return L.to(device).requires_grad_(), Ld.to(device).requires_grad_()
    return make
