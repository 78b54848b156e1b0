"""mhctool.philox (a GPU case's large inputs): a value is a function of the seed and its index
alone, the values are Philox-4x32-10's and standard normal or uniform. Through Triton's
interpreter on the CPU; the same checks on a GPU (``-m gpu``)."""
import math

import pytest
import torch

from mhctool.core import philox
from mhctool.references import dropout as D

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def draw(n, seed, normal=True, device=DEVICE):
    return philox.fill(torch.empty(n, dtype=torch.float32, device=device), seed, normal).cpu()


def test_a_value_depends_on_the_seed_and_its_index_alone():
    long, short = draw(5000, 7), draw(3001, 7)  # not a whole number of programs either
    assert torch.equal(long[:3001], short) and torch.equal(draw(5000, 7), long)
    assert not torch.equal(draw(5000, 8), long)
    assert not torch.equal(long[:1024], long[1024:2048])  # the programs draw apart


@pytest.mark.parametrize("normal", [True, False])
def test_the_values_have_their_distribution(normal):
    x = draw(1 << 16, (1 << 62) - 5, normal).double()  # a seed past 32 bits
    assert bool(torch.isfinite(x).all())
    if normal:  # mean and spread within 5 standard errors, and tails of a normal
        assert abs(float(x.mean())) < 5 / math.sqrt(x.numel())
        assert abs(float(x.std()) - 1) < 5 * math.sqrt(0.5 / x.numel())
        assert 0.04 < float((x.abs() > 2).double().mean()) < 0.051
    else:
        assert float(x.min()) >= 0 and float(x.max()) < 1
        assert abs(float(x.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / x.numel())
        counts = torch.histc(x.float(), bins=16, min=0, max=1)
        assert float(counts.min()) > 0.9 * x.numel() / 16


def test_only_contiguous_float32():
    with pytest.raises(ValueError, match="contiguous float32"):
        philox.fill(torch.empty(8, dtype=torch.float64), 1, True)
    with pytest.raises(ValueError, match="contiguous float32"):
        philox.fill(torch.empty(8, 2, dtype=torch.float32).t(), 1, True)
    assert philox.fill(torch.empty(0, dtype=torch.float32), 1, True).numel() == 0


def philox_words(seed: int, index: int) -> tuple[int, int]:
    """The first two words of Philox-4x32-10 (Random123) at counter (index, 0, 0, 0): the contract's
    generator's (references/dropout.py, checked against Random123's known answer and plain Python
    integers in tests/kernels/test_dropout.py), what the kernel's draw must be made of."""
    words = D.philox(seed, torch.tensor([index]))
    return int(words[0][0]), int(words[1][0])


def uniform(word: int) -> float:
    signed = word - (1 << 32) if word >= 1 << 31 else word
    return (-signed - 1 if signed < 0 else signed) * 4.6566127342e-10


def expected(n: int, seed: int, normal: bool) -> torch.Tensor:
    vals = []
    for i in range(n):
        w0, w1 = philox_words(seed, i)
        u0 = uniform(w0)
        vals.append(math.sqrt(-2 * math.log(max(u0, 1e-7))) * math.cos(2 * math.pi * uniform(w1)) if normal else u0)
    return torch.tensor(vals, dtype=torch.float64)


@pytest.mark.parametrize("normal", [True, False])
def test_the_values_are_philox_4x32_10(normal):
    seed = (1 << 40) + 12345
    got = draw(1100, seed, normal).double()
    torch.testing.assert_close(got, expected(1100, seed, normal), rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
def test_on_a_gpu_the_values_are_philox_and_the_same_at_every_size():
    seed = 987654321
    for normal in (True, False):
        got = draw(3001, seed, normal, "cuda")
        torch.testing.assert_close(got.double(), expected(3001, seed, normal), rtol=2e-6, atol=2e-6)
        assert torch.equal(draw(70000, seed, normal, "cuda")[:3001], got)
