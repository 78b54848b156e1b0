"""Scenario TOML: shipped files, expansion, and rejection of malformed files."""
import pytest

from mhctool.analyses import scenario
from mhctool.core.errors import UsageError
from mhctool.families import KERNELS, input_families


def test_builtin_default_covers_every_kernel_and_family():
    sc = scenario.builtin("parity-default")
    cases = sc.cases("cpu")
    assert {c.kernel for c in cases} == set(KERNELS)
    for k in KERNELS:
        assert {c.family for c in cases if c.kernel == k} == set(input_families(k))


def test_paper_scenario_is_the_paper_shape():
    sc = scenario.builtin("paper")
    assert {str(c.shape) for c in sc.cases("cuda")} == {"8192x4x4x7168"}


def test_sanitize_scenario_is_small_with_partial_tiles():
    cases = scenario.builtin("sanitize").cases("cuda")
    assert {c.kernel for c in cases} >= {"sinkhorn", "h_aggregate", "h_post_bda", "proj_rms", "mapping"}
    for k in {c.kernel for c in cases}:  # one input family per kernel: memcheck is slow
        assert len({c.family for c in cases if c.kernel == k}) == 1
    assert any(c.kernel == "sinkhorn" and c.shape.n == 3 for c in cases)


def test_moe_scenario_is_the_issue_size():
    sc = scenario.builtin("moe")
    cases = sc.cases("cuda")
    assert {str(c.shape) for c in cases if c.kernel.startswith("grouped")} == {"4096x2048x1024x8"}
    assert {c.dtype for c in cases} == {"bf16"}
    assert {"zero_experts", "one_expert", "odd_splits"} <= {c.family for c in cases if c.kernel == "grouped_mlp"}


def test_knob_lists_expand_to_their_product(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('name = "x"\n[verdict]\nkappa = 3\n[[cases]]\nkernel = "sinkhorn"\nshapes = ["4x1x4x1"]\n'
                 'families = ["random"]\nseeds = [1, 2]\n[cases.knobs]\niters = [1, 5]\norder = "col_first"\n')
    sc = scenario.load(p)
    assert sc.rule.kappa == 3
    cases = sc.cases("cpu")
    assert len(cases) == 4
    assert {c.knob_dict["iters"] for c in cases} == {1, 5}
    assert {c.knob_dict["order"] for c in cases} == {"col_first"}
    assert len({c.case_id for c in cases}) == 4


@pytest.mark.parametrize("text,needle", [
    ('name = "x"\nbogus = 1\n[[cases]]\nkernel = "sinkhorn"\n', "bogus: unknown key"),
    ('[[cases]]\nkernel = "sinkhorn"\n', "name: required"),
    ('name = "x"\n', "cases: required"),
    ('name = "x"\n[[cases]]\nkernel = "nope"\n', "unknown kernel 'nope'"),
    ('name = "x"\n[[cases]]\nkernel = "sinkhorn"\nshapes = ["4x4"]\n', "malformed shape"),
    ('name = "x"\n[[cases]]\nkernel = "sinkhorn"\nfamilies = ["gauss"]\n', "unknown input family 'gauss'"),
    ('name = "x"\n[[cases]]\nkernel = "sinkhorn"\n[cases.knobs]\ncolor = 1\n', "unknown knob 'color'"),
    ('name = "x"\n[[cases]]\nkernel = "sinkhorn"\n[cases.knobs]\norder = "diag"\n', "knob order='diag'"),
    ('name = "x"\n[[cases]]\nkernel = "sinkhorn"\n[cases.knobs]\niters = 0\n', "positive integer"),
    ('name = "x"\n[[cases]]\nkernel = "sinkhorn"\nseeds = [-1]\n', "seeds"),
    ('name = "x"\n[verdict]\nkappa = "two"\n[[cases]]\nkernel = "sinkhorn"\n', "verdict.kappa"),
    ('name = "x"\n[[cases]\n', "not valid TOML"),
])
def test_malformed_scenarios_name_file_and_key(tmp_path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(UsageError) as e:
        scenario.load(p)
    assert needle in str(e.value)
    assert str(p) in str(e.value)
