"""The verdict rule on its own: which part decides, and the reduction-aware floor."""
import math

from mhctool.core.dtypes import FORMATS
from mhctool.core.verdict import VerdictRule

FP32 = FORMATS["fp32"]
NATIVE = {"max_abs": 1e-7, "rel_l2": 1e-7, "nonfinite": 0, "unwritten": 0, "extra_zeros": 0}


def test_kappa_times_native_decides_when_above_the_floor():
    j = VerdictRule().judge("max_abs", 1.9e-7, FP32, 1e-3, NATIVE)
    assert j.passed and j.rule == "kappa=2 x native"
    assert not VerdictRule().judge("max_abs", 2.1e-7 + 2 * FP32.unit_roundoff * 1e-3, FP32, 1e-3, NATIVE).passed


def test_floor_of_a_cancelling_sum_scales_with_its_terms():
    """A result of 1 summed from terms of total magnitude 1e4: two correct orders may differ by
    about u * 1e4, which a floor relative to the result (u * 1) would call a defect."""
    nat = dict(NATIVE, max_abs=1e-8)
    err = 50 * FP32.unit_roundoff
    plain = VerdictRule().judge("max_abs", err, FP32, 1.0, nat)
    assert not plain.passed and plain.rule == "dtype floor"
    reduced = VerdictRule().judge("max_abs", err, FP32, 1.0, nat, term_scale=1e4)
    assert reduced.passed and reduced.rule == "reduction floor"
    assert math.isclose(reduced.threshold, 2e-8 + 2 * FP32.unit_roundoff * 1e4)
    # and it still fails what is rounding at the result's own bf16 precision
    assert not VerdictRule().judge("max_abs", 2 ** -9, FP32, 1.0, nat, term_scale=1e4).passed


def test_a_term_scale_below_the_result_changes_nothing():
    a = VerdictRule().judge("rel_l2", 3e-7, FP32, 2.0, NATIVE)
    b = VerdictRule().judge("rel_l2", 3e-7, FP32, 2.0, NATIVE, term_scale=0.5)
    assert a == b


def test_nan_error_fails_and_counts_are_gated():
    r = VerdictRule()
    assert not r.judge("max_abs", math.nan, FP32, 1.0, NATIVE).passed
    assert not r.judge("unwritten", 1, FP32, 1.0, NATIVE).passed
    assert r.judge("max_rel", 1.0, FP32, 1.0, NATIVE).passed is None


def test_an_overflow_is_never_excused_by_the_native_one():
    """Non-finite where the float64 contract is finite fails whatever the native baseline (of any
    declared convention) does; where native's error is infinite, the threshold is the tolerance
    native is held to, never kappa x inf."""
    r = VerdictRule()
    j = r.judge("nonfinite", 3, FP32, 1.0, dict(NATIVE, nonfinite=3))
    assert not j.passed and j.rule == "non-finite where the contract is finite"
    j = r.judge("max_abs", math.inf, FP32, 1.0, dict(NATIVE, max_abs=math.inf))
    assert not j.passed and j.threshold == 1e-4 and j.rule == "non-finite where the contract is finite"
    assert not r.judge("rel_l2", math.inf, FP32, 1.0, None).passed  # the baseline's own row too


def test_an_infinity_that_rounding_gives_is_no_overflow():
    """A reference past fp16's largest value rounds to inf: an fp16 inf of its sign is correct."""
    import torch

    from mhctool.core.metrics import max_abs, nonfinite

    ref = torch.tensor([1.0, 7e4, -7e4, 3.0], dtype=torch.float64)
    out = torch.tensor([1.0, float("inf"), float("-inf"), 3.0], dtype=torch.float16)
    assert nonfinite(out, ref) == 0 and max_abs(out, ref) == 0
    wrong_sign = torch.tensor([1.0, float("-inf"), float("-inf"), 3.0], dtype=torch.float16)
    assert nonfinite(wrong_sign, ref) == 1 and max_abs(wrong_sign, ref) == math.inf
    in_range = torch.tensor([float("inf"), 7e4, -7e4, 3.0], dtype=torch.float32)
    assert nonfinite(in_range, ref) == 1 and max_abs(in_range, ref) == math.inf


def test_finite_amax_ignores_nonfinite_and_copies_nothing_when_all_finite():
    """The scale a verdict is judged at: the largest finite |reference|, negative ends included."""
    import torch

    from mhctool.core.metrics import finite_amax

    assert finite_amax(torch.tensor([1.0, -3.0, 2.0], dtype=torch.float64)) == 3.0
    assert finite_amax(torch.tensor([1.0, float("-inf"), -2.5, float("nan")], dtype=torch.float64)) == 2.5
    assert finite_amax(torch.tensor([float("nan"), float("inf")])) == 0.0
    assert finite_amax(torch.empty(0)) == 0.0
    assert finite_amax(torch.tensor([[0.5, -7.0], [6.0, 1.0]])) == 7.0


def test_max_rel_is_the_largest_ratio_over_the_references_that_are_not_tiny():
    """max_rel masks the tiny references instead of indexing the rest out (the same maximum,
    without a compacted copy): against the indexed form, with zeros, tiny values and an infinite
    output among them, and an all-zero reference."""
    import torch

    from mhctool.core import metrics
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        ref = torch.randn(4099, dtype=torch.float64, generator=g)
        ref[torch.rand(4099, generator=g) < 0.1] = 0.0
        ref[torch.rand(4099, generator=g) < 0.05] *= 1e-9
        out = (ref + 1e-3 * torch.randn(4099, dtype=torch.float64, generator=g)).float()
        if trial % 4 == 0:
            out[trial] = math.inf
        d, r = metrics._abs_err(out, ref)
        big = r.abs() > r.abs().max() * 1e-6
        indexed = float((d[big] / r[big].abs()).max())
        assert metrics.max_rel(out, ref) == indexed == metrics._errors(out, ref)["max_rel"]
    zero = torch.zeros(7, dtype=torch.float64)
    assert metrics.max_rel(zero.float(), zero) == metrics._errors(zero.float(), zero)["max_rel"] == 0.0


def _metric_cases():
    """Outputs and references that take every path of judging: finite pairs in each output dtype,
    a strided reference, non-finite outputs (NaN, an infinity of either sign, fp16 overflow past
    the reference), poison, exact zeros, non-finite and all-zero references, an empty tensor."""
    import torch

    from mhctool.core.dtypes import poison
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        ref = torch.randn(37, 53, dtype=torch.float64, generator=g) * 10.0 ** (trial % 5 - 2)
        ref[torch.rand(37, 53, generator=g) < 0.05] = 0.0
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            out = (ref + 1e-3 * torch.randn(37, 53, dtype=torch.float64, generator=g)).to(dt)
            yield out, ref
            yield out.t(), ref.t()  # strided, both
            zeros = out.clone()
            zeros[3, :5] = 0
            yield zeros, ref
            bad = out.clone()
            bad[trial, trial] = (math.nan, math.inf, -math.inf)[trial % 3]
            yield bad, ref
            unwritten = out.clone()
            poison(unwritten[1])
            yield unwritten, ref
            nonfinite_ref = ref.clone()
            nonfinite_ref[2, 2] = math.inf
            nonfinite_ref[4, 7] = math.nan
            yield out, nonfinite_ref
    over = torch.tensor([1.0, 7e4, -7e4, 3.0], dtype=torch.float64)
    yield torch.tensor([1.0, math.inf, -math.inf, 3.0], dtype=torch.float16), over
    yield torch.tensor([1.0, -math.inf, -math.inf, 3.0], dtype=torch.float16), over
    yield torch.zeros(9), torch.zeros(9, dtype=torch.float64)
    yield torch.zeros(0), torch.zeros(0, dtype=torch.float64)


def test_measure_gives_each_metric_alone_its_value_with_the_reference_worked_out_once():
    """measure() skips the passes that depend only on the reference (given once per reference)
    and those a finite output needs none of: the same value, bit for bit, as each metric alone."""
    from mhctool.core import metrics
    alone = metrics.ERROR_METRICS | metrics.COUNT_METRICS
    n = 0
    for out, ref in _metric_cases():
        want = {name: fn(out, ref) for name, fn in alone.items()}
        for got in (metrics.measure(out, ref), metrics.measure(out, ref, of=metrics.reference(ref))):
            assert set(got) == set(want)
            for name in want:
                assert got[name] == want[name] or (math.isnan(got[name]) and math.isnan(want[name])), \
                    (name, out.dtype, got[name], want[name])
        n += 1
    assert n > 200


def test_ulp_size_reads_the_exponent_of_a_float64():
    """The exponent read from the bits: log2's floor on random values of every magnitude, and the
    right binade a float64 rounding below a power of two (where log2 rounds up to it)."""
    import torch

    from mhctool.core.metrics import ulp_size
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 16, dtype=torch.float64, generator=g)
    x = x * torch.exp2(torch.randint(-200, 200, x.shape, generator=g).double())
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -4.0, 2.0 ** -1074, 1e-300, math.inf], dtype=torch.float64)])
    for f in FORMATS.values():
        via_log2 = 2.0 ** (torch.floor(torch.log2(x.abs().clamp_min(2.0 ** f.min_exponent))) - f.mantissa_bits)
        assert torch.equal(ulp_size(x, f), via_log2), f.name
        below = torch.nextafter(torch.tensor([8.0, -2.0 ** 40]).double(), torch.zeros(2).double())
        assert ulp_size(below, f).tolist() == [2.0 ** (2 - f.mantissa_bits), 2.0 ** (39 - f.mantissa_bits)]


def test_where_native_is_non_finite_the_implementation_is_held_to_natives_tolerance():
    """kappa x inf would pass anything: the implementation gets the baseline tolerance instead."""
    nat = dict(NATIVE, max_abs=math.inf, rel_l2=math.nan)
    ok = VerdictRule().judge("max_abs", 1e-7, FP32, 1.0, nat)
    assert ok.passed and ok.threshold == 1e-4 and ok.rule == "baseline tol 0.0001 (native non-finite)"
    assert not VerdictRule().judge("max_abs", 1e-3, FP32, 1.0, nat).passed
    assert not VerdictRule().judge("rel_l2", 2e-4, FP32, 1.0, nat).passed


def test_a_reference_below_the_dtypes_smallest_number_is_no_extra_zero():
    import torch

    from mhctool.core.metrics import extra_zeros, measure
    ref = torch.tensor([1e-50, 1e-30, 1.0], dtype=torch.float64)
    out = torch.tensor([0.0, 0.0, 1.0])
    assert extra_zeros(out, ref) == 1  # 1e-30 is an fp32 number; 1e-50 rounds to zero
    assert measure(out, ref)["extra_zeros"] == 1
    assert extra_zeros(out.bfloat16(), ref) == 1
