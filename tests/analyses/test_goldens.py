"""Golden values (`mhctool goldens`) on Megatron's real files, and the CI gate (`mhctool gate`)."""
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mhctool.analyses import goldens as G
from mhctool.core import report
from mhctool.cli.app import app

DATA = Path(__file__).resolve().parents[1] / "data" / "goldens"
MHC = DATA / "gpt3_mcore_te_tp2_pp2_mhc"
MOE = DATA / "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic"
ALL_FILES = sorted(DATA.glob("*/*.json"))
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def mhc(name):
    return MHC / f"golden_values_dev_dgx_h100.{name}.json"


def test_every_real_file_reads_and_shows():
    assert len(ALL_FILES) == 7
    for f in ALL_FILES:
        g = G.load(f)
        assert {"lm loss", "num-zeros", "iteration-time"} <= set(g)
        res = run("goldens", "show", f)
        assert res.exit_code == 0 and "num-zeros" in res.output


def test_megatron_first_iteration_time_nan_and_start_step():
    g = G.load(mhc("dev"))
    assert math.isnan(g["iteration-time"].values[1])
    moe = G.load(MOE / "golden_values_dev_dgx_h100.json")
    assert moe["iteration-time"].start_step == 2 and min(moe["iteration-time"].values) == 2


def test_check_reports_the_pr3828_num_zeros_pattern():
    found = G.check(G.load(mhc("pr3828")))
    assert [a.kind for a in found] == ["bimodal"]
    a = found[0]
    assert a.metric == "num-zeros" and 1500 < a.low < 2500 and 34000 < a.high < 35500 and a.ratio > 15
    assert a.first_step == 2 and 2 in a.steps and 1 not in a.steps
    res = run("goldens", "check", mhc("pr3828"))
    assert res.exit_code == 1 and "two levels" in res.output


@pytest.mark.parametrize("f", [p for p in ALL_FILES if "pr3828" not in p.name], ids=lambda p: p.name)
def test_check_finds_nothing_in_the_clean_files(f):
    assert G.check(G.load(f)) == []
    assert run("goldens", "check", f).exit_code == 0


def test_diff_pr2943_vs_pr3828_fails_num_zeros_passes_lm_loss(tmp_path):
    v = {x.metric: x for x in G.diff(G.load(mhc("pr2943")), G.load(mhc("pr3828")))}
    assert set(v) == {"lm loss", "num-zeros"}  # the recipe lists no METRICS: Megatron's default
    assert v["lm loss"].passed and not v["num-zeros"].passed
    res = run("goldens", "diff", mhc("pr2943"), mhc("pr3828"), "--config", MHC / "model_config.yaml",
              "-o", tmp_path / "d.parquet", "--plot", tmp_path)
    assert res.exit_code == 1 and "FAIL" in res.output
    table, meta = report.read(tmp_path / "d.parquet")
    assert meta["kind"] == "goldens"
    steps = [r for r in table.to_pylist() if r["metric"] == "num-zeros" and r["step"] is not None]
    assert len(steps) == 50 and sum(r["close"] for r in steps) == 23
    assert (tmp_path / "golden-num-zeros.png").stat().st_size > 5000


def test_diff_pr2943_vs_dev_passes_and_deterministic_adds_the_exact_check():
    assert all(v.passed for v in G.diff(G.load(mhc("pr2943")), G.load(mhc("dev"))))
    exact = [v for v in G.diff(G.load(mhc("pr2943")), G.load(mhc("dev")), deterministic=True) if v.check == "exact"]
    assert len(exact) == 2 and not exact[0].passed  # lm loss moved in the 5th decimal
    assert run("goldens", "diff", mhc("pr2943"), mhc("dev")).exit_code == 0
    assert run("goldens", "diff", mhc("pr2943"), mhc("dev"), "--deterministic").exit_code == 1


@pytest.mark.parametrize("other", ["dev_dgx_a100", "dev_dgx_gb200", "lts_dgx_a100"])
def test_moe_platforms_compare(other):
    h100 = G.load(MOE / "golden_values_dev_dgx_h100.json")
    o = G.load(MOE / f"golden_values_{other}.json")
    v = G.diff(h100, o, ["lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes"])
    by = {x.metric: x for x in v}
    assert by["lm loss"].passed and by["num-zeros"].passed
    assert by["iteration-time"].check == "median"


def test_rules_per_metric_and_tolerance_override():
    g = G.parse({"num-zeros": {"values": {str(i): 100.0 for i in range(1, 101)}}}, "g")
    a = G.parse({"num-zeros": {"values": {**{str(i): 100.0 for i in range(1, 100)}, "100": 150.0}}}, "a")
    # N = 100 steps: one may be off (1 - max(1, N // 100) / N = 0.99)
    assert G.diff(g, a, ["num-zeros"])[0].passed
    a2 = G.parse({"num-zeros": {"values": {**{str(i): 100.0 for i in range(1, 99)}, "99": 150.0, "100": 150.0}}}, "a")
    assert not G.diff(g, a2, ["num-zeros"])[0].passed
    assert G.diff(g, a2, ["num-zeros"], {"num-zeros": 0.6})[0].passed


def test_missing_metric_and_missing_steps():
    g = G.parse({"lm loss": {"values": {"1": 1.0, "2": 1.0, "3": 1.0}}, "num-zeros": {"values": {"1": 5.0}}}, "g")
    a = G.parse({"lm loss": {"values": {"1": 1.0}}}, "a")
    v = {x.metric: x for x in G.diff(g, a)}
    assert not v["num-zeros"].passed and "missing from the actual" in v["num-zeros"].message
    # 3 steps: 2 must be close (1 - max(1, 3 // 100) / 3); steps missing in actual are not close
    assert not v["lm loss"].passed and v["lm loss"].rows[1]["note"] == "missing in actual"


def test_config_metrics(tmp_path):
    cfg = tmp_path / "model_config.yaml"
    cfg.write_text("MODEL_ARGS:\n  --x: 1\nMETRICS:\n  - \"lm loss\"\n  - iteration-time\nTEST_TYPE: regular\n")
    assert G.metrics_from_config(cfg) == ["lm loss", "iteration-time"]
    assert G.metrics_from_config(MHC / "model_config.yaml") is None


LOG = """\
[2026-05-12 10:11:10] WARNING: something unrelated | lm loss: 99
 [2026-05-12 10:11:11.1] iteration        1/      50 | consumed samples: 32 | elapsed time per iteration (ms): 23327.2 | learning rate: 1.5E-06 | global batch size:    32 | lm loss: 1.086149E+01 | loss scale: 1.0 | grad norm: 9.1 | num zeros: 1667 | params norm: 123.4 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-05-12 10:11:12.123456] iteration        2/      50 | consumed samples: 64 | elapsed time per iteration (ms): 638.2 | learning rate: 1.500000E-04 | global batch size:    32 | lm loss: 1.085467E+01 | loss scale: 1.0 | grad norm: 2.345 | num zeros: 1580 | params norm: 123.456 | number of skipped iterations:   0 | number of nan iterations:   0 |
 validation loss at iteration 2 | lm loss value: 10.8 | lm loss PPL: 5e4 |
"""


def test_extract_log_and_compare_without_tensorboard(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(LOG)
    out = tmp_path / "run.json"
    res = run("goldens", "extract", log, "-o", out)
    assert res.exit_code == 0, res.output
    g = G.load(out)
    assert g["lm loss"].values == {1: 10.86149, 2: 10.85467}
    assert g["num-zeros"].values == {1: 1667.0, 2: 1580.0}
    assert g["iteration-time"].values[2] == pytest.approx(0.6382)
    assert g["grad-norm"].values[2] == 2.345 and g["params-norm"].values[1] == 123.4
    # a log compares directly against golden values
    assert run("goldens", "diff", mhc("pr2943"), log).exit_code == 1  # 2 of 50 steps


@pytest.mark.parametrize("content,needle", [
    ('{"lm loss": {"values": {"1": 10.8, "2": 10.', "not valid JSON"),
    ('{"lm loss": {"values": {"1": "ten"}}}', "'ten' is not a number"),
    ('{"lm loss": {"values": {}}}', 'empty "values"'),
    ('[1, 2]', "expected an object of metrics"),
    ('{"lm loss": {"values": [10.8, 10.7]}}', '"values" is a list; a golden-value file keys each value by its step'),
    ('{"lm loss": {"values": {"1": 10.8, "2": -0.5}}}', "step 2: -0.5 is negative, which a cross-entropy loss never is"),
    ('{"num-zeros": {"values": {"1": -3}}}', "-3 is negative, which a count of zeros never is"),
    ('{"num-zeros": {"values": {"1": 2.5}}}', "2.5 is not a whole number, which a count of zeros is"),
])
def test_broken_golden_files_exit_2(tmp_path, content, needle):
    f = tmp_path / "bad.json"
    f.write_text(content)
    for cmd in (["goldens", "show", f], ["goldens", "check", f], ["goldens", "diff", f, mhc("dev")]):
        res = run(*cmd)
        assert res.exit_code == 2, res.output
        assert needle in res.output and "Traceback" not in res.output


def test_log_without_iteration_lines_exit_2(tmp_path):
    f = tmp_path / "empty.log"
    f.write_text("WARNING: nothing here\nvalidation loss at iteration 2 | lm loss value: 1\n")
    res = run("goldens", "extract", f, "-o", tmp_path / "x.json")
    assert res.exit_code == 2 and "no Megatron training-iteration lines" in res.output
    assert not (tmp_path / "x.json").exists()


# what these metrics can take: never negative, and a count of zeros a whole number
values = st.one_of(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False, width=64), st.just(math.nan))
series = st.dictionaries(st.integers(1, 500), values, min_size=1, max_size=40)
goldens_st = st.dictionaries(st.sampled_from(["lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes"]),
                             series, min_size=1).map(
    lambda d: {m: {k: float(math.floor(v)) if m == "num-zeros" and not math.isnan(v) else v for k, v in s.items()}
               for m, s in d.items()})


@settings(max_examples=60, deadline=None)
@given(goldens_st)
@example({"iteration-time": {1: 8.98846567431158e+307, 2: 8.988465674311579e+307}})  # a median's sum overflowed
def test_round_trip_and_self_diff_property(tmp_path_factory, data):
    g = {m: G.Series(min(v), max(v), 1, v) for m, v in data.items()}
    path = tmp_path_factory.mktemp("rt") / "g.json"
    G.dump(g, path)
    back = G.load(path)
    assert set(back) == set(g)
    for m in g:
        assert set(back[m].values) == set(g[m].values)
        for k, v in g[m].values.items():
            assert (math.isnan(v) and math.isnan(back[m].values[k])) or back[m].values[k] == v
    assert all(v.passed for v in G.diff(g, back, list(g), deterministic=True))


# --- gate -------------------------------------------------------------------------------------

def _suite(tmp_path, body):
    s = tmp_path / "suite.toml"
    s.write_text(body)
    return s


def test_gate_writes_junit_markdown_parquet_and_fails_on_a_failing_check(tmp_path, monkeypatch):
    summary_env = tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary_env))
    s = _suite(tmp_path, f"""
name = "t"
[[parity]]
name = "tiny-parity"
kernel = "h_aggregate"
impls = ["torch"]
dtypes = ["fp32"]
device = "cpu"
[[goldens]]
name = "mhc"
golden = "{mhc('pr2943')}"
actual = "{mhc('pr3828')}"
[[goldens_check]]
file = "{mhc('dev')}"
""")
    res = run("gate", "--suite", s, "--junit", tmp_path / "j.xml", "--summary", tmp_path / "s.md", "-o", tmp_path / "g.parquet")
    assert res.exit_code == 1, res.output
    root = ET.parse(tmp_path / "j.xml").getroot()
    suites = {ts.get("name"): ts for ts in root}
    assert suites["mhc"].get("failures") == "1" and suites["tiny-parity"].get("failures") == "0"
    failure = root.find(".//testcase[@name='num-zeros (approximate)']/failure")
    assert failure is not None and "23/50" in failure.get("message")
    md = (tmp_path / "s.md").read_text()
    assert "FAILED" in md and "num-zeros" in md
    assert summary_env.read_text() == md
    table, meta = report.read(tmp_path / "g.parquet")
    assert meta["kind"] == "gate" and table.num_rows == len(list(root.iter("testcase")))


def test_gate_passing_suite_exit_0(tmp_path):
    s = _suite(tmp_path, f'name = "ok"\n[[goldens]]\ngolden = "{mhc("pr2943")}"\nactual = "{mhc("dev")}"\n')
    res = run("gate", "--suite", s, "--junit", tmp_path / "j.xml", "--summary", tmp_path / "s.md", "-o", tmp_path / "g.parquet")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("body,needle", [
    ('name = "x"\n[[goldens]]\ngolden = "nope.json"\nactual = "nope2.json"\n', "no file"),
    ('name = "x"\n[[goldens_check]]\nfile = "missing.json"\n', "no file"),
    ('name = "x"\n[[parity]]\nkernel = "nope"\n', "unknown kernel"),
    ('name = "x"\n[[parity]]\nkernl = "sinkhorn"\n', "parity[0].kernl: unknown key"),
    ('name = "x"\n', "has no [[parity]]"),
    ('name = "x"\n[[stability]]\nkernel = "h_aggregate"\n', "has no stability sweep"),
    ('name = "x"\n[[stability]]\nfinite = ["log"]\n', "unknown stabilize"),
    ('name = "x"\n[[stability]]\niters = [0]\n', "stability[0].iters: [0] is not a list of iteration counts"),
])
def test_gate_bad_suite_exit_2(tmp_path, body, needle):
    res = run("gate", "--suite", _suite(tmp_path, body), "--junit", tmp_path / "j.xml")
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert not (tmp_path / "j.xml").exists()


def test_gate_stability_entry_turns_a_sweep_into_cases(tmp_path):
    s = _suite(tmp_path, 'name = "st"\n[[stability]]\nname = "sk"\nfinite = ["rowmax", "none"]\ndtypes = ["fp32"]\niters = [20]\n')
    res = run("gate", "--suite", s, "--device", "cpu", "--junit", tmp_path / "j.xml", "--summary", tmp_path / "s.md",
              "-o", tmp_path / "g.parquet")
    assert res.exit_code == 1  # bare exp overflows past 88 in fp32: those cases fail
    root = ET.parse(tmp_path / "j.xml").getroot()
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None]
    assert failed and all("/none/" in c.get("name") for c in failed)
    assert any("/rowmax/" in c.get("name") for c in cases)
