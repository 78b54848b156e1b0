"""identify finds what a kernel computes whatever it is asked (issue 90): the stand-ins of
tests/impls/identify_asks.py, each asked three ways a user might ask (the asks never reach the
function: it takes none of these knobs, or none of these values change what it computes), get the
same best match; what is asked only changes what is called a convention. Each claim is checked
against its own numbers: a partial fit says where it fails, a right autograd backward is never
called wrong, and a knob a function takes no parameter for is never its defect."""
from pathlib import Path

import pytest

from mhctool.analyses.identify import fmt_knobs, identify
from mhctool.registry.specs import resolve_impls

ASKS = Path(__file__).resolve().parents[1] / "impls" / "identify_asks.py"


STRANGERS = ASKS.with_name("strangers.py")


def _identify(fn, kernel="sinkhorn", where=ASKS, **asked):
    return identify(kernel, resolve_impls(kernel, [f"{where}:{fn}"])[0], asked=asked)


CLAMPED = "stabilize=clamp eps_mode=threshold_zero order=row_first iters=20 eps=1e-06 clamp_at=20"
NAN_GRADS = "its backward returns non-finite gradients where the float64 contract's are finite"

# (function, asks, what every ask must find, a phrase of the line)
SAME = [
    # the floored log-domain Sinkhorn: TE's eps=0 domain=log with a floor 60 below the max
    pytest.param("sinkhorn_floored_log", [{}, {"eps": 0.0}, {"eps": 0.0, "domain": "log"}],
                 "stabilize=rowmax eps_mode=add order=row_first floor=60 iters=20 eps=0 domain=log",
                 "floor=60: every logit more than 60 below its matrix's max raised to that level",
                 id="sinkhorn_floored_log"),
    # a clamped exponential, eps as a zeroing threshold and fast math in one kernel: found together;
    # its own backward's NaN gradients said as such, never "not the derivative" (asked once in the
    # CPU suite, three ways with --slow: 9 s an identification)
    # a plain-autograd log-domain Sinkhorn: once called "not the derivative" at 1.26x the threshold
    pytest.param("sinkhorn_log_autograd", [{}, {"eps": 0.0}, {"eps": 0.0, "domain": "log"}],
                 "stabilize=rowmax eps_mode=add order=row_first iters=20 eps=0 domain=log", "best match: ",
                 id="sinkhorn_log_autograd"),
    # a bias parameter that raises when given one (strangers.py): identified without it, whatever
    # transpose_res is asked (asked true, the fit is called a variant, and still is false)
    pytest.param("h_post_bda_refuses_bias", [{}, {"transpose_res": True}, {"transpose_res": False}],
                 "transpose_res=false", "best match: ", id="h_post_bda_refuses_bias"),
    pytest.param("sinkhorn_clamp_threshold_fast", [{}], CLAMPED, NAN_GRADS, id="sinkhorn_clamp_threshold_fast"),
    pytest.param("sinkhorn_clamp_threshold_fast", [{"domain": "log"}, {"stabilize": "softmax", "order": "col_first"}],
                 CLAMPED, NAN_GRADS, id="sinkhorn_clamp_threshold_fast-asked", marks=pytest.mark.slow),
]


# the composites carry every one of Sinkhorn's knobs: the two rarer Sinkhorns above after the mapping
# (16-20 s an identification on 2 cores: asked once in the CPU suite, three ways with --slow)
FLOORED_MIX = "rms_eps=outside stabilize=rowmax eps_mode=add order=row_first floor=60 eps=1e-06 compute_h_eps=0 sinkhorn_eps=0"
CLAMPED_MIX = ("rms_eps=outside stabilize=clamp eps_mode=threshold_zero order=row_first eps=1e-06 compute_h_eps=0 "
               "sinkhorn_eps=1e-06 clamp_at=20")
FLOOR_SAID = "floor=60: every logit more than 60 below its matrix's max raised to that level"
SAME += [
    pytest.param("mapping_sinkhorn_floored_log", [{}], FLOORED_MIX, FLOOR_SAID, id="mapping_sinkhorn_floored_log"),
    pytest.param("mapping_sinkhorn_floored_log", [{"sinkhorn_eps": 0.0}, {"sinkhorn_eps": 0.0, "domain": "log"}],
                 FLOORED_MIX, FLOOR_SAID, id="mapping_sinkhorn_floored_log-asked", marks=pytest.mark.slow),
    pytest.param("mapping_sinkhorn_clamp_threshold_fast", [{}], CLAMPED_MIX, NAN_GRADS,
                 id="mapping_sinkhorn_clamp_threshold_fast"),
    pytest.param("mapping_sinkhorn_clamp_threshold_fast", [{"domain": "log"}, {"stabilize": "softmax", "order": "col_first"}],
                 CLAMPED_MIX, NAN_GRADS, id="mapping_sinkhorn_clamp_threshold_fast-asked", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fn,asks,knobs,phrase", SAME)
def test_the_same_kernel_asked_three_ways_gets_the_same_best_match(fn, asks, knobs, phrase):
    kernel, where = ("h_post_bda", STRANGERS) if fn.startswith("h_post_bda") else ("sinkhorn", ASKS)
    kernel = "mapping_sinkhorn" if fn.startswith("mapping_sinkhorn") else kernel
    found = []
    for asked in asks:
        ident = _identify(fn, kernel, where, **asked)
        assert ident.best is not None, ident.line()
        found.append(fmt_knobs(ident.best.knobs))
        assert phrase in ident.line() + " " + (ident.best.note or ""), (asked, ident.line(), ident.best.note)
        # no match far from its numbers: asked the log domain, a candidate with an eps used to be
        # judged against the log-domain baseline (which has none) and "matched" 2.4e5x native noise off
        for c in ident.candidates:
            if c.stage == "judged" and (c.passed or c.fwd_passed):
                assert c.score <= 100, (asked, c.knobs, c.score)
    assert found == [knobs] * len(asks), found


def test_a_fit_on_most_probes_is_a_finding_with_where_it_differs():
    """A floor below each row's max (no knob of mhctool's): the contract at eps=0 on the probes
    whose logits stay within reach, and the line says which matrices differ elsewhere."""
    ident = _identify("sinkhorn_row_floored_log")
    line = ident.line()
    assert not ident.passed
    assert line.startswith("no convention fits every probe: it computes stabilize=rowmax eps_mode=add "
                           "order=row_first iters=20 eps=0 on random and near_perm (within "), line
    assert "not on dead_rows_cols" in line and "below its row's max" in line, line
    assert "none comes near" not in line


def test_a_composites_partial_fit_says_where_its_sinkhorn_differs():
    """The same floor below each row's max after the mapping: the H_res logits that say where it
    differs are the ones the reference mapping computes from the probe's streams."""
    ident = _identify("mapping_sinkhorn_row_floored_log", "mapping_sinkhorn")
    line = ident.line()
    assert not ident.passed
    assert line.startswith("no convention fits every probe: it computes rms_eps=outside "), line
    assert "not on res_depths" in line and "below its row's max; of the" in line, line


@pytest.mark.parametrize("fn,knobs", [
    ("sinkhorn_log_autograd", "stabilize=rowmax eps_mode=add order=row_first iters=20 eps=0 domain=log"),
    ("sinkhorn_log_autograd_cols_first", "stabilize=colmax eps_mode=add order=col_first iters=20 eps=0 domain=log"),
    ("sinkhorn_softmax_autograd", "stabilize=softmax eps_mode=add order=col_first iters=20 eps=1e-06"),
    ("sinkhorn_rowmax_autograd", "stabilize=rowmax eps_mode=add order=row_first iters=20 eps=1e-06"),
])
def test_plain_autograd_sinkhorns_pass_and_are_never_called_not_the_derivative(fn, knobs):
    ident = _identify(fn)
    assert ident.passed, ident.line()
    assert ident.line().startswith(f"best match: {knobs} "), ident.line()
    assert "not the derivative" not in ident.line()


def test_a_knob_the_function_takes_no_parameter_for_is_not_claimed_without_a_difference():
    # asked eps=1e-6 of a function that takes none and computes without: where its outputs tell
    # the two apart, it runs 0 (a known convention); never "likely a defect"
    ident = _identify("sinkhorn_log_autograd")
    assert "likely a defect" not in (ident.best.note or "")
    assert not ident.defect()


def test_the_floor_declared_as_identify_hints_makes_parity_pass(tmp_path):
    """The floored kernel's hint (--convention floor=60 eps=0 domain=log): parity's reference and
    native baseline take the floor, and every case passes."""
    from typer.testing import CliRunner

    from mhctool.cli.app import app
    res = CliRunner().invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", f"{ASKS}:sinkhorn_floored_log",
                                   "--convention", "floor=60", "--convention", "eps=0", "--convention", "domain=log",
                                   "--dtype", "fp32", "--device", "cpu", "-q", "-o", str(tmp_path / "p.parquet")])
    assert res.exit_code == 0, res.output
    assert "0 failed" in res.output


def test_a_value_its_outputs_do_not_tell_from_the_asked_one_is_no_convention_to_declare():
    """At TF32 a pre-path's outputs do not tell Sinkhorn's eps 0 from 1e-6 (TransformerEngine's
    [tf32] variant on an H200): the line says so, and the parity hint declares no eps for it."""
    asked = {"sinkhorn_eps": 0.0, "domain": "log", "rms_eps": "inside", "eps": 1.1920928955078125e-07}
    ident = _identify("mix_aggregate_te_tf32", "mix_aggregate", **asked)
    assert "--convention sinkhorn_eps" not in ident.flags(), ident.flags()
    if ident.best.knobs["sinkhorn_eps"] != 0.0:  # a tie the family's default took: said as one
        assert "its outputs do not tell sinkhorn_eps=" in ident.best.note, ident.best.note
