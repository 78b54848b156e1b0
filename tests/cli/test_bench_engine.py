"""`mhctool bench --engine` on the CPU (issue 91): the training step of each variant timed through
the engine stand-in (impls/engine_standin.py, never Megatron's code), the overhead over the
baseline, the entry points' time measured in place (core/entry_timing.py), the report, its
tables and figure, and bad input. The Megatron-core engine itself is the GPU test's."""
import json
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from mhctool.cli.app import app
from mhctool.core import report
from mhctool.core.entry_timing import EntryTimer, own_nodes

IMPLS = Path(__file__).resolve().parents[1] / "impls"
STANDIN = f"{IMPLS / 'engine_standin.py'}:train"
TOY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8", "--batch", "2", "--vocab", "32",
       "--recipe", "global_batch=4", "--steps", "3", "--warmup", "1", "--entry-steps", "1"]
FAMILIES = {"proj_rms", "sinkhorn", "h_aggregate", "h_post_bda"}

runner = CliRunner()


def _sinkhorn(logits, iters=5, eps=1e-6):
    m = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True).clamp(min=eps)
        m = m / m.sum(-2, keepdim=True).clamp(min=eps)
    return m


def test_the_entry_timer_counts_a_calls_forward_and_its_own_backward_and_leaves_the_numbers_alone():
    torch.manual_seed(0)
    x = torch.randn(64, 4, 4, requires_grad=True)
    timer = EntryTimer(cuda=False)
    op = timer.wrap("sinkhorn", _sinkhorn)
    out = op(x * 2)  # outside a profiled step: untouched, nothing recorded
    (out ** 2).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    with timer.profiling():
        y = x * 2
        assert len(own_nodes([op.__wrapped__(y)], [y])) > 10  # its own nodes, not the input's MulBackward
        x.grad = None
        (op(y) ** 2).sum().backward()
    got = timer.step_end()
    assert torch.equal(x.grad, plain)
    s = got["sinkhorn"]
    assert s["fwd_calls"] == 1 and s["bwd_calls"] == 1 and s["fwd_ms"] > 0 and s["bwd_ms"] > 0, got
    assert got["*"]["busy_ms"] >= s["fwd_ms"]
    assert timer.step_end() == {}  # read once


def test_a_forward_run_again_inside_the_backward_is_a_recompute():
    from torch.utils.checkpoint import checkpoint
    x = torch.randn(32, 4, 4, requires_grad=True)
    timer = EntryTimer(cuda=False)
    op = timer.wrap("sinkhorn", _sinkhorn)
    with timer.profiling():
        out = checkpoint(lambda z: op(z * 2), x, use_reentrant=True)
        out.sum().backward()
    got = timer.step_end()["sinkhorn"]
    assert got["fwd_calls"] == 1 and got["recompute_calls"] == 1 and got["bwd_calls"] == 1, got


class _Module(torch.nn.Module):
    """What Megatron-core's adapter reads off a HyperConnectionModule to swap its two paths."""

    def __init__(self, n=2, C=8):
        super().__init__()
        self.n, self.hidden_size, self._sinkhorn_op = n, C, None
        self.mapping_proj = torch.nn.Linear(n * C, n * n + 2 * n, bias=False)
        self.alpha_pre, self.alpha_post, self.alpha_res = (torch.nn.Parameter(torch.tensor(v)) for v in (1.0, 2.0, 3.0))
        self.bias = torch.nn.Parameter(torch.zeros(n * n + 2 * n))


def _pre(x, weight, alpha, bias):  # x [s, b, n, C] -> aggregated, h_res, h_post (not mHC's math: its calls)
    s, b, n, C = x.shape
    logits = x.reshape(s, b, n * C) @ weight.t() * alpha[2] + bias
    h_res = torch.softmax(logits[..., :n * n].reshape(s, b, n, n), -1)
    h_post = torch.sigmoid(logits[..., n * n:n * n + n]) * alpha[1]
    return (x * torch.sigmoid(logits[..., -n:])[..., None]).sum(2) * alpha[0], h_res, h_post


def _post(h_res, x, h_post, y, bias, p, seed, offset):
    return h_res @ x + h_post[..., None] * y[:, :, None, :]


def test_a_module_variants_recompute_is_timed_as_its_recompute(monkeypatch):
    """Under Megatron's mHC recompute the module's two calls run again inside the backward from the
    checkpoint's own closure (not through the module's methods): the timer wraps the calls
    themselves, so the recompute is its own row, each forward counted once, and each backward is
    the call's (here torch's reentrant checkpoint stands in for Megatron's CheckpointWithoutOutput,
    which likewise runs its function without grad and again inside the backward)."""
    from torch.utils.checkpoint import checkpoint

    from mhctool.libraries import megatron_core as mc
    monkeypatch.setattr(mc, "_checkpointed", lambda manager, fn, *args: checkpoint(fn, *args, use_reentrant=True)
                        if manager is not None else fn(*args))
    torch.manual_seed(0)
    m = _Module()
    mc.swap_module_paths(m, {"pre_path": _pre, "post_path": _post})
    timer = EntryTimer(cuda=False)
    mc.time_entry_points(m, timer)
    plain, x0 = {}, torch.randn(3, 2, m.n * m.hidden_size)
    for timed in (False, True):
        x = x0.clone().requires_grad_()
        with (timer.profiling() if timed else torch.enable_grad()):
            for manager in (object(), None):  # under the block's recompute, and a block-end layer without it
                agg, h_res, h_post = m(x, mhc_recompute_manager=manager)
                out = m.fused_h_res_h_post_bda(h_res, x, h_post, (agg * 2, None), 0.0, True, False, manager)
                out.square().sum().backward()
        plain.setdefault("grad", x.grad.clone())
        assert torch.equal(x.grad, plain["grad"])  # the timer leaves the numbers alone
    got = timer.step_end()
    assert set(got) == {"pre_path", "post_path", "*"}, got  # the module's forward is no call of its own
    for path in ("pre_path", "post_path"):
        assert got[path]["fwd_calls"] == 2 and got[path]["recompute_calls"] == 1 and got[path]["bwd_calls"] == 2, got


def test_under_the_recompute_the_fused_pre_paths_mapping_runs_once_a_call(monkeypatch):
    """Under Megatron's mHC recompute the pre-path's closure runs twice on the same inputs: with
    mhctool's kernels swapped in, the recompute takes the forward's mapping (kernels.schedule.
    recompute_memo) and h_res, and runs only the aggregation again; the gradients have the bits
    of the call without the recompute (torch's reentrant checkpoint stands in for Megatron's, x moved
    to another address for the recompute as Megatron's restored storage moves it)."""
    from torch.utils.checkpoint import checkpoint

    from mhctool.analyses.train import module_path
    from mhctool.kernels.triton import mix_aggregate as tmix
    from mhctool.libraries import megatron_core as mc
    def moved(fn):  # the recompute finds x at another address, as Megatron's restored storage puts it
        return lambda x, *rest: fn(x if not torch.is_grad_enabled() else x.clone(), *rest)
    monkeypatch.setattr(mc, "_checkpointed", lambda manager, fn, *args: checkpoint(moved(fn), *args, use_reentrant=True)
                        if manager is not None else fn(*args))
    calls, real, real_mix = [], tmix.mapping_forward, tmix.sinkhorn_forward
    monkeypatch.setattr(tmix, "mapping_forward", lambda *a, **k: calls.append("map") or real(*a, **k))
    monkeypatch.setattr(tmix, "sinkhorn_forward", lambda *a, **k: calls.append("mix") or real_mix(*a, **k))
    torch.manual_seed(0)
    m = _Module(n=4, C=12)
    mc.swap_module_paths(m, module_path.ops(module_path.pieces("impl", "triton", {}, "cpu")[0]))
    x0, got = torch.randn(5, 3, m.n * m.hidden_size), {}
    for manager in (None, object()):
        calls.clear()
        x = x0.clone().requires_grad_()
        agg, h_res, h_post = m(x, mhc_recompute_manager=manager)
        out = m.fused_h_res_h_post_bda(h_res, x, h_post, (agg * 2, None), 0.0, True, False, manager)
        out.square().sum().backward()
        assert calls == ["map", "mix"], (manager, calls)  # the recompute's pre-path: the aggregation alone
        got[manager is None] = [x.grad, *(p.grad.clone() for p in m.parameters())]
        m.zero_grad()
    for plain, recomputed in zip(got[True], got[False]):
        assert torch.isfinite(plain).all() and torch.equal(plain, recomputed)


def test_the_post_paths_residual_gradient_is_added_in_the_pre_paths_backward(monkeypatch):
    """Megatron's layer gives the post-path the pre-path's own input as its residual: the adapter
    links the two calls (kernels.schedule.ResidualLink), and the Triton pre-path's backward adds the
    post-path's gradient of it where it writes its own (one call's mapping backward with it, each
    module call, under the recompute too). The gradients have the bits of the unlinked step (fp32,
    where the fold adds in autograd's order); a post-path given another residual than the pre-path's
    input is not linked, nor is a pre-path that does not take the link (mhctool's torch pieces)."""
    from torch.utils.checkpoint import checkpoint

    from mhctool.analyses.train import module_path
    from mhctool.kernels.triton import mix_aggregate as tmix
    from mhctool.libraries import megatron_core as mc
    monkeypatch.setattr(mc, "_checkpointed", lambda manager, fn, *args: checkpoint(fn, *args, use_reentrant=True)
                        if manager is not None else fn(*args))
    extras, real = [], tmix.mapping_backward
    monkeypatch.setattr(tmix, "mapping_backward", lambda *a, **k: extras.append(k.get("extra") is not None)
                        or real(*a, **k))
    torch.manual_seed(0)
    x0 = torch.randn(5, 3, 4 * 12)
    for spec in ("triton", "torch"):
        m = _Module(n=4, C=12)
        mc.swap_module_paths(m, module_path.ops(module_path.pieces("impl", spec, {}, "cpu")[0]))
        got = {}
        for link in (False, True):
            monkeypatch.setattr(mc, "LINK_RESIDUAL", link)
            for manager in (None, object()):
                for same in (True, False):
                    extras.clear()
                    x = x0.clone().requires_grad_()
                    agg, h_res, h_post = m(x, mhc_recompute_manager=manager)
                    residual = x if same else x * 1.0  # another tensor of the same values
                    out = m.fused_h_res_h_post_bda(h_res, residual, h_post, (agg * 2, None), 0.0, True, False, manager)
                    out.square().sum().backward()
                    if spec == "triton":
                        assert extras == [link and same], (link, manager, same, extras)
                    got.setdefault((manager is None, same), []).append(
                        [x.grad, *(p.grad.clone() for p in m.parameters())])
                    m.zero_grad()
        for (plain, same), (unlinked, linked) in got.items():
            for a, b in zip(unlinked, linked):
                assert torch.isfinite(a).all() and torch.equal(a, b), (spec, plain, same)


def _rows(path):
    return pq.read_table(path).to_pylist()


def test_bench_engine_times_every_variant_and_splits_the_entry_points(tmp_path):
    """The stand-in engine on the CPU without dropout (its post-path is then the h_post_bda entry
    point): the baseline without hyper-connections, its own path, its fused switch and mhctool's
    torch pieces at the entry points, each with its step and overhead; per entry point and
    direction its time and calls a step; the kernels alone beside; the report read back by report
    show."""
    out = tmp_path / "s.parquet"
    res = runner.invoke(app, ["bench", "--engine", STANDIN, *TOY, "--recipe", "hidden_dropout=0", "--variant",
                              "native,fused,torch", "-o", str(out), "--plot", str(tmp_path / "s.png")])
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    meta = report.read(out)[1]
    assert meta["kind"] == "bench-step"
    # the host's speed issuing ops, which a host-bound step depends on, and its CPU, kept with the run
    assert meta["run"]["host_op_us"] > 0 and "cpu" in meta["environment"]
    assert "us to issue a small op" in res.output
    step = {r["variant"]: r["value"] for r in rows if r["metric"] == "step_ms"}
    assert set(step) == {"plain", "native", "fused", "torch"} and min(step.values()) > 0
    over = {r["variant"]: r["value"] for r in rows if r["metric"] == "overhead"}
    assert set(over) == {"native", "fused", "torch"}
    for v, o in over.items():  # the overhead is the step over the baseline's, as reported
        assert o == pytest.approx(step[v] / step["plain"] - 1)
    calls = {(r["variant"], r["entry"], r["direction"]): r["value"] for r in rows if r["metric"] == "calls"}
    for v in ("native", "fused", "torch"):  # one layer: two modules, two micro-batches
        for f in FAMILIES:
            assert calls[(v, f, "fwd")] == 4 and calls[(v, f, "bwd")] == 4, (v, f, calls)
    assert not any(r["variant"] == "plain" and r["entry"] != "*" for r in rows)
    alone = {(r["entry"], r["direction"]) for r in rows if r["metric"] == "kernel_ms" and r["variant"] == "torch"}
    assert alone == {(f, d) for f in FAMILIES for d in ("fwd", "bwd")}
    assert (tmp_path / "s.png").stat().st_size > 0
    assert "inside the mHC module" in res.output and "overhead" in res.output
    shown = runner.invoke(app, ["report", "show", str(out)])
    assert shown.exit_code == 0 and "sinkhorn" in shown.output and "fused" in shown.output, shown.output
    same = runner.invoke(app, ["report", "compare", str(out), str(out)])
    assert same.exit_code == 0 and "nothing got worse" in same.output, same.output


@pytest.mark.slow  # about 12 s on 2 cores
def test_the_overhead_is_attributed_op_by_op_and_the_parts_sum_to_it(tmp_path):
    """With the recipe's hidden dropout (the stand-in's post-path then runs Megatron's unfused ops:
    the H_res product, H_post on y and on the bias, the bias-dropout-add), every op of the module
    is timed in place, with the bytes it moves; the module's ops, the kernels outside them and the
    idle time, each against the baseline's, sum to the overhead; the whole-module variant
    (mhctool's module path, its dropout drawn in the kernel) is its two paths; the byte floor is
    beside; report show prints the split."""
    out = tmp_path / "s.parquet"
    res = runner.invoke(app, ["bench", "--engine", STANDIN, *TOY, "--variant", "native,torch[module]",
                              "--no-kernels", "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    parts = {}
    for r in rows:
        parts.setdefault(r["variant"], {}).setdefault((r["entry"], r["direction"]), {})[r["metric"]] = r["value"]
    native, module = parts["native"], parts["torch[module]"]
    ops = {e for e, _ in native if e != "*"}
    assert {"h_res_product", "h_post_y", "h_post_bias", "dropout_add", "compute_h", "expand", "contract",
            "pre_path", "post_path", "proj_rms", "sinkhorn", "h_aggregate"} <= ops, ops
    assert "h_post_bda" not in ops  # dropout on: the entry point is never called, as in Megatron
    assert {e for e, _ in module if e != "*"} == {"pre_path", "post_path", "expand", "contract"}
    for v in (native, module):
        whole = v[("*", "*")]
        assert whole["mhc_ms"] == pytest.approx(sum(m["entry_ms"] for (e, _), m in v.items() if e != "*"))
        assert whole["mhc_ms"] + whole["outside_ms"] + whole["idle_ms"] == pytest.approx(whole["overhead_ms"])
        assert whole["floor_bytes"] > 0 and whole["floor_ms"] > 0
        assert all(m["bytes"] > 0 for (e, d), m in v.items() if e != "*" and d == "fwd")
    shown = runner.invoke(app, ["report", "show", str(out)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "where the overhead goes" in shown.output and "torch[module]" in shown.output
    assert "a [module] variant's" in shown.output  # the label's brackets are text, not markup


def test_the_byte_floor_is_the_issues_arithmetic():
    """164 KiB a token and module call at C = 2048, n = 4 with the recompute (the pre-path's read of
    the streams and its write, the post-path's two reads and its write, twice that backward, one
    more pre-path, less the plain layer's residual add), 144 KiB without."""
    from mhctool.analyses.train.step_bench import byte_floor
    from mhctool.libraries.megatron_core import Recipe
    r = Recipe(layers=1, hidden=2048, streams=4, seq=1, global_batch=1, micro_batch=1)
    assert byte_floor(r) == 2 * 164 * 1024
    assert byte_floor(replace(r, recompute=False)) == 2 * 2 * 2048 * (3 * 14 - 6)


def test_a_kernel_counts_for_the_innermost_call_it_was_launched_in():
    from mhctool.core.entry_timing import innermost, own_times
    outer = (0, 100, "pre_path", "fwd", 0)
    inner = [(10, 20, "proj_rms", "fwd", 1), (30, 40, "sinkhorn", "fwd", 2)]
    launches = [(5, 1.0), (15, 2.0), (35, 4.0), (50, 8.0), (150, 16.0)]
    got = innermost([outer, *inner], launches)
    assert got == {("pre_path", "fwd"): 9.0, ("proj_rms", "fwd"): 2.0, ("sinkhorn", "fwd"): 4.0}
    assert own_times([outer, *inner]) == {("pre_path", "fwd"): 80, ("proj_rms", "fwd"): 10, ("sinkhorn", "fwd"): 10}


def test_a_device_gap_counts_for_the_call_whose_launch_ended_it():
    """Kernels on two streams overlap (busy once); a gap runs from the end of all before a kernel to
    its start and counts for that kernel's launch, then for the innermost call holding the launch;
    a gap whose launch is unknown is in the total only."""
    from mhctool.core.entry_timing import device_gaps, innermost
    kernels = [(0, 10, 1), (5, 30, 2), (40, 50, 3), (45, 47, 4), (60, 70, 5), (100, 110, 6)]
    launch_of = {1: (7, 0), 2: (7, 1), 3: (7, 15), 4: (8, 16), 5: (7, 55)}  # 6: launched where nothing saw it
    total, gaps = device_gaps(kernels, launch_of)
    assert total == 10 + 10 + 30
    assert gaps == {7: [(15, 10), (55, 10)]}
    calls = [(0, 20, "pre_path", "fwd", 0), (50, 58, "post_path", "bwd", 1)]
    assert innermost(calls, gaps[7]) == {("pre_path", "fwd"): 10, ("post_path", "bwd"): 10}


def test_the_gaps_become_rows_and_the_split_table_says_where_the_device_waited():
    """A GPU step's recorded gaps (``gap_ms``, ``gap_before``): rows gap_ms for the step and
    gap_before_ms per call and direction (medians over the timed steps, a step without a gap
    there counting 0), and the split table's cells and last line."""
    from rich.console import Console

    from mhctool.analyses.train import step_bench as sb
    from mhctool.cli.tables import step_split_table
    from mhctool.libraries.megatron_core import Recipe

    def rec(step, t, entry=None):
        return {"step": step, "iteration-time": t, **({"entry_ms": entry} if entry else {})}

    def entry(gap, before):
        return {"pre_path": {"fwd_ms": 2.0, "fwd_calls": 4}, "post_path": {"bwd_ms": 3.0, "bwd_calls": 4},
                "*": {"busy_ms": 90.0, "gap_ms": gap, "gap_before": before}}
    plain = sb.Measured(sb.Variant(sb.BASELINE, "plain"), {}, [rec(1, 0.1), rec(2, 0.1),
                                                           rec(3, 0.1, {"*": {"busy_ms": 95.0}})], None, 0, 2)
    fused = sb.Measured(sb.Variant("triton[module]", "impl"), {}, [
        rec(1, 0.11), rec(2, 0.11), rec(3, 0.12, entry(6.0, {"pre_path|fwd": 1.5, "post_path|bwd": 2.0})),
        rec(4, 0.12, entry(8.0, {"pre_path|fwd": 2.5})), rec(5, 0.12, entry(7.0, {"pre_path|fwd": 0.5}))], None, 0, 2)
    rows = sb.rows([plain, fused], Recipe(layers=1, hidden=8, streams=4, seq=4, global_batch=1, micro_batch=1))
    got = {(r["entry"], r["direction"]): r["value"] for r in rows if r["metric"] in ("gap_ms", "gap_before_ms")}
    assert got == {("*", "*"): 7.0, ("pre_path", "fwd"): 1.5, ("post_path", "bwd"): 0.0}
    console = Console(width=200, record=True)
    console.print(step_split_table(rows, "split"))
    text = console.export_text()
    assert "waited 1.5" in text and "waited 0" in text
    assert "device waited before other kernels" in text and "5.5 of 7 (profiled)" in text


def test_a_sweep_runs_the_baseline_once_and_a_failing_variant_is_its_row(tmp_path):
    """--sweep streams=2,3: the baseline (no streams) once, the variant at each point; an engine
    that fails for one variant is that variant's error row, the others timed, exit 1."""
    failing = tmp_path / "engine.py"
    failing.write_text("import importlib.util\n"
                       f"spec = importlib.util.spec_from_file_location('standin', {str(IMPLS / 'engine_standin.py')!r})\n"
                       "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
                       "def train(tree, recipe, progress, ops):\n"
                       "    if recipe.streams == 3 and ops:\n"
                       "        raise RuntimeError('no kernel for three streams')\n"
                       "    return m.train(tree, recipe, progress, ops)\n")
    out = tmp_path / "s.parquet"
    res = runner.invoke(app, ["bench", "--engine", f"{failing}:train", *TOY, "--variant", "torch",
                              "--sweep", "streams=2,3", "--no-kernels", "-o", str(out)])
    assert res.exit_code == 1, res.output
    rows = _rows(out)
    runs = {(r["variant"], r["point"]) for r in rows if r["metric"] == "step_ms"}
    assert runs == {("plain", "{}"), ("torch", json.dumps({"streams": 2}))}, runs
    err = [r for r in rows if r["metric"] == "error"]
    assert len(err) == 1 and err[0]["variant"] == "torch" and "three streams" in err[0]["message"]
    assert {r["value"] for r in rows if r["metric"] == "overhead"}  # the point that ran has its overhead
    assert "FAILED torch" in res.output


@pytest.mark.parametrize("args, words", [
    (["--engine", STANDIN, "--sweep", "streams="], "--sweep"),
    (["--engine", STANDIN, "--sweep", "steps=3,4"], "not a sweep of the model"),
    (["--engine", STANDIN, "--sweep", "streams=2", "--sweep", "streams=4"], "given twice"),
    (["--engine", STANDIN, "--recipe", "steps=5"], "bench's to set"),
    (["--engine", STANDIN, "--recipe", "nonsense=1"], "no such option"),
    (["--engine", STANDIN, "--variant", "nothing"], "not one of this run's"),
    (["--engine", STANDIN, "--impl", "nonexistent_impl"], "nonexistent_impl"),
    (["--layers", "2"], "give --engine too"),
    (["--engine", "megatron:/nonexistent"], "megatron/core"),
])
def test_bad_input_to_bench_engine_is_one_sentence_and_exit_2(tmp_path, args, words):
    res = runner.invoke(app, ["bench", *args, "-o", str(tmp_path / "s.parquet")])
    assert res.exit_code == 2, res.output
    assert words in res.output, res.output
    assert not (tmp_path / "s.parquet").exists()


def test_train_refuses_the_recipe_options_that_are_bench_engines(tmp_path):
    res = runner.invoke(app, ["train", "--engine", STANDIN, "--device", "cpu", "--recipe", "time_entry_from=2",
                              "-o", str(tmp_path / "t.parquet")])
    assert res.exit_code == 2 and "bench --engine's" in res.output, res.output


def test_on_a_cpu_the_step_takes_cpu_sizes_where_none_is_given():
    """bench --engine (and train --engine) on a CPU: the recipe in miniature where no size is given
    (the recipe's own took past 600 s and 4 GB on 2 cores; these about a minute for five variants);
    a size given stands, and on a GPU the recipe's sizes stand."""
    from mhctool.analyses.train import engine as E
    from mhctool.analyses.train.step_bench import base_recipe
    cpu = base_recipe([], {}, "cpu")
    assert (cpu.layers, cpu.hidden, cpu.seq, cpu.micro_batch, cpu.global_batch) == (2, 64, 64, 2, 4)
    assert base_recipe([("global_batch", "8")], {"hidden": 32}, "cpu").hidden == 32
    assert base_recipe([("global_batch", "8")], {}, "cpu").global_batch == 8
    gpu = base_recipe([], {}, "cuda")
    assert (gpu.layers, gpu.hidden, gpu.seq) == (12, 512, 1024)
    assert E.configure(STANDIN, [], ["torch"], "cpu", {}, 0, [], [], None, 1, 1)[1].recipe.hidden == 64
