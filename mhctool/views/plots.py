"""Figures made from report tables (never from live results), PNG through matplotlib's Agg."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import json

import matplotlib.pyplot as plt  # noqa: E402
import pyarrow as pa  # noqa: E402

from mhctool.core.findings import verdicts  # noqa: E402

# Red means "failed" in every figure, so no series is drawn in it: tab20's colours without its two
# reds, the dark shades first (ten distinct colours), then the light ones; past 18 series the line
# style changes too, so two series never look alike.
_PALETTE = [c for i, c in enumerate(plt.get_cmap("tab20").colors[0::2] + plt.get_cmap("tab20").colors[1::2])
            if i not in (3, 13)]
_LINESTYLES = ("-", "--", ":", "-.")
_FAILED = "tab:red"
NATIVE = "torch"  # the native baseline's implementation name in every family (registry.native_impl)


def _style(k: int) -> dict:
    """The k-th series' colour and line style: never red, distinct for up to 72 series."""
    return {"color": _PALETTE[k % len(_PALETTE)], "ls": _LINESTYLES[(k // len(_PALETTE)) % len(_LINESTYLES)]}


def _folder(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def _save(fig, path: Path, dpi: int) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _label(v: dict) -> str:
    knobs = v["knobs"].strip("{}").replace('"', "")
    return f"{v['family']} {v['dtype']} {v['shape']}" + (f" {knobs}" if knobs else "")


def parity_figures(table: pa.Table, out_dir: str | Path) -> list[Path]:
    """One PNG per kernel: for each case and implementation, the worst gated error as a share of
    its threshold (1 = the verdict boundary), forward and backward side by side."""
    out_dir = _folder(out_dir)
    vs = [v for v in verdicts(table) if v["passed"] is not None]
    written = []
    for kernel in sorted({v["kernel"] for v in vs}):
        kv = [v for v in vs if v["kernel"] == kernel]
        labels = sorted({_label(v) for v in kv})
        impls = sorted({v["impl"] for v in kv})
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.45 * len(labels) + 4), 5.5), sharey=True)
        for ax, direction in zip(axes, ("fwd", "bwd")):
            for k, impl in enumerate(impls):
                pts = [v for v in kv if v["impl"] == impl and v["direction"] == direction]
                xs, ys, edges = [], [], []
                for v in pts:
                    m = v["worst_margin"]
                    m = 1e3 if (m is None or math.isinf(m) or m != m) else max(m, 1e-6)
                    xs.append(labels.index(_label(v)) + (k - (len(impls) - 1) / 2) * 0.15)
                    ys.append(m)
                    edges.append(_FAILED if not v["passed"] else "k")
                ax.scatter(xs, ys, color=_style(k)["color"], marker="osD^v<>"[k % 7], label=impl, edgecolors=edges,
                           linewidths=[1.6 if e == _FAILED else 0.4 for e in edges], s=36)
            ax.axhline(1.0, color="k", ls="--", lw=1)
            ax.set_yscale("log")
            ax.set_title(f"{kernel} {direction}")
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
            ax.grid(axis="y", alpha=0.3)
        axes[0].set_ylabel("worst error / threshold  (>1 fails; red ring = failed)")
        axes[0].legend(fontsize=8, title="impl (marker)")
        path = _save(fig, out_dir / f"parity-{kernel}.png", 110)
        written.append(path)
        scatter = error_scatter(table, kernel, out_dir)
        if scatter is not None:
            written.append(scatter)
    return written


def error_scatter(table: pa.Table, kernel: str, out_dir: str | Path) -> Path | None:
    """Each implementation's error against the native implementation's on the same case, output
    and metric (max_abs and rel_l2 of every tensor, forward and backward): on the diagonal an
    implementation is as accurate as PyTorch; the dashed line is kappa times native, the verdict's
    bound. Points of a failed verdict are ringed in red. None when there is nothing to pair."""
    rows = [r for r in table.to_pylist() if r["kernel"] == kernel and r["metric"] in ("max_abs", "rel_l2")]
    native = NATIVE
    base = {(r["case_id"], r["direction"], r["tensor"], r["metric"]): r["value"] for r in rows if r["impl"] == native}
    impls = sorted({r["impl"] for r in rows if r["impl"] != native and r["backend"] != "reference"})
    if not base or not impls:
        return None
    kappa = json.loads((table.schema.metadata or {}).get(b"mhctool.run", b"{}")).get("kappa") or 2.0
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    lo, hi = math.inf, 0.0
    for ax, metric in zip(axes, ("max_abs", "rel_l2")):
        for k, impl in enumerate(impls):
            pts = [(base[key], r["value"], r["passed"]) for r in rows
                   if r["impl"] == impl and r["metric"] == metric
                   and (key := (r["case_id"], r["direction"], r["tensor"], metric)) in base
                   and r["value"] is not None and base[key] is not None and math.isfinite(r["value"])
                   and math.isfinite(base[key]) and r["value"] > 0 and base[key] > 0]
            if not pts:
                continue
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=_style(k)["color"], marker="osD^v<>"[k % 7],
                       s=18, label=impl, edgecolors=[_FAILED if p[2] is False else "none" for p in pts],
                       linewidths=1.2)
            lo = min(lo, *(min(p[0], p[1]) for p in pts))
            hi = max(hi, *(max(p[0], p[1]) for p in pts))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"native ({native}) {metric}")
        ax.set_ylabel(f"implementation {metric}")
        ax.set_title(f"{kernel}: {metric} against native's")
        ax.grid(alpha=0.3)
    if hi > 0:
        line = [lo / 2, hi * 2]
        for ax in axes:
            ax.plot(line, line, color="k", lw=0.8, label="as native")
            ax.plot(line, [kappa * v for v in line], color="k", ls="--", lw=0.8, label=f"{kappa:g} x native")
        axes[0].legend(fontsize=7)
    return _save(fig, _folder(out_dir) / f"parity-{kernel}-vs-native.png", 110)


def bench_figure(table: pa.Table, path: str | Path, copy_bw: float) -> Path:
    """Bars of achieved bandwidth as a share of the measured copy bandwidth, per kernel and
    direction, one bar per implementation; the line at 100% is the memory roofline."""
    rows = [r for r in table.to_pylist() if r["metric"] == "pct_copy_bw" and r["value"] == r["value"]]
    times = {(r["kernel"], r["direction"], r["impl"]): r["value"] for r in table.to_pylist() if r["metric"] == "time_ms"}
    groups = sorted({(r["kernel"], r["direction"]) for r in rows})
    impls = sorted({r["impl"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(groups) + 3), 4.8))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        xs, ys, labels = [], [], []
        for g, (kernel, direction) in enumerate(groups):
            v = next((r["value"] for r in rows if (r["kernel"], r["direction"], r["impl"]) == (kernel, direction, impl)), None)
            if v is None:
                continue
            xs.append(g + (k - (len(impls) - 1) / 2) * width)
            ys.append(v)
            labels.append(f"{times.get((kernel, direction, impl), float('nan')):.3g}ms")
        bars = ax.bar(xs, ys, width, label=impl, color=_style(k)["color"])
        for b, lab in zip(bars, labels):
            ax.annotate(lab, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=6, rotation=90)
    top = max([r["value"] for r in rows], default=0.0)
    if 0 < top < 20:  # far below the roofline (a CPU, the interpreter): the axis fits the bars, the line is said
        ax.set_ylim(0, 1.25 * top)
        ax.set_title(f"at most {top:.3g}% of the copy rate ({copy_bw / 1e9:.3g} GB/s): the roofline is off the axis",
                     fontsize=9)
    else:
        ax.axhline(100, color="k", ls="--", lw=1, label=f"copy {copy_bw / 1e12:.2f} TB/s")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{k}\n{d}" for k, d in groups], fontsize=8)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, _folder(Path(path).parent) / Path(path).name, 110)


def step_figure(table: pa.Table, path: str | Path) -> Path:
    """``bench --engine``'s figure: with a sweep of one option, each variant's overhead over the
    baseline against the swept value (a line per variant, the paper's 6.7% marked); otherwise
    stacked bars per variant of its step: the baseline's time, the time inside the mHC entry
    points, and the rest of its overhead."""
    rows = table.to_pylist()

    def whole(metric):
        return {(r["variant"], r["point"]): r["value"] for r in rows if r["metric"] == metric and r["entry"] == "*"}
    step, over, mhc = whole("step_ms"), whole("overhead"), whole("mhc_ms")
    outside, idle, floor = whole("outside_ms"), whole("idle_ms"), whole("floor_share")
    swept = sorted({k for _, p in over for k in json.loads(p)})
    if len(swept) == 1:
        key = swept[0]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        variants = list(dict.fromkeys(v for v, _ in over))
        for k, v in enumerate(variants):
            pts = sorted((json.loads(p)[key], 100 * o) for (w, p), o in over.items() if w == v and key in json.loads(p))
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=v, **_style(k))
        ax.axhline(6.7, color="k", ls="--", lw=1, label="6.7% (the mHC paper, n = 4)")
        pts = sorted({(json.loads(p)[key], 100 * f) for (_, p), f in floor.items() if key in json.loads(p)})
        if pts:  # the same for every variant at a point
            ax.plot([x for x, _ in pts], [y for _, y in pts], color="0.4", ls=":", marker=".",
                    label="the byte floor at the copy rate")
        ax.set_xlabel(key)
        ax.set_ylabel("step time over the baseline's (%)")
    else:
        runs = [k for k in step if k[0] != "plain"]
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(runs) + 2), 4.5))
        for x, (v, p) in enumerate(runs):
            t = step[(v, p)]
            base = t / (1 + over[(v, p)]) if over.get((v, p)) is not None else t - (mhc.get((v, p)) or 0.0)
            ax.bar(x, base, color="0.75", label="baseline step" if x == 0 else None)
            if (v, p) in outside:  # the attribution: the module's ops, the kernels outside, the idle time
                parts = [("inside the mHC module's ops", mhc[(v, p)]), ("kernels outside the module", outside[(v, p)]),
                         ("device idle", idle[(v, p)])]
            else:
                inside = min(mhc.get((v, p)) or 0.0, max(0.0, t - base))  # measured in other steps: never past the step
                parts = [("inside the mHC module's ops", inside), ("rest of mHC's overhead", max(0.0, t - base - inside))]
            bottom = base
            for k, (label, h) in enumerate(parts):  # a part below the baseline's (less idle) drawn down from the top
                ax.bar(x, h, bottom=bottom if h >= 0 else bottom + h, color=_style(k)["color"],
                       label=label if x == 0 else None)
                bottom += h
            ax.annotate(f"{100 * over[(v, p)]:+.1f}%" if over.get((v, p)) is not None else "", (x, t), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([v if p == "{}" else f"{v}\n{p}" for v, p in runs], fontsize=8)
        ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, _folder(Path(path).parent) / Path(path).name, 110)


def golden_figures(golden, actual, metrics: list[str], out_dir: str | Path, labels=("golden", "actual")) -> list[Path]:
    """Per metric: both curves, and their relative difference per step."""
    out_dir = _folder(out_dir)
    written = []
    for m in metrics:
        if m not in golden or m not in actual:
            continue
        g, a = golden[m], actual[m]
        steps = sorted(set(g.values) | set(a.values))
        fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=[2, 1])
        ax.plot(g.steps(), [g.values[k] for k in g.steps()], "o-", ms=3, label=labels[0])
        ax.plot(a.steps(), [a.values[k] for k in a.steps()], "s-", ms=3, label=labels[1])
        ax.set_title(m)
        ax.legend(fontsize=8)
        rel = [(k, (a.values[k] - g.values[k]) / abs(g.values[k])) for k in steps
               if k in g.values and k in a.values and g.values[k] not in (0.0,) and math.isfinite(g.values[k]) and math.isfinite(a.values[k])]
        bx.bar([k for k, _ in rel], [100 * v for _, v in rel], color="tab:purple")
        bx.set_ylabel("(actual-golden)/golden %")
        bx.set_xlabel("step")
        bx.grid(alpha=0.3)
        path = _save(fig, out_dir / f"golden-{m.replace(' ', '_')}.png", 100)
        written.append(path)
    return written


def _overflow_lines(ax, points: dict[str, float]) -> None:
    """One dotted line per overflow point, dtypes that overflow at the same amplitude named on one
    label (bf16 and fp32 share fp32's exponent), labels at staggered heights."""
    at: dict[float, list[str]] = {}
    for dt, x in sorted(points.items(), key=lambda p: p[1]):
        near = next((y for y in at if abs(x - y) <= 0.005 * max(abs(x), abs(y))), None)  # one line to the eye
        at.setdefault(x if near is None else near, []).append(dt)  # bf16 88.719 and fp32 88.723: one label
    for k, (x, dts) in enumerate(sorted(at.items())):
        ax.axvline(x, ls=":", color="gray")
        ax.annotate(f"{'/'.join(sorted(dts))} exp overflow", (x, 0.5 - 0.22 * (k % 3)), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize=7, color="gray", ha="right", va="center")


def stability_figures(table: pa.Table, out_dir: str | Path, overflow: dict[str, float]) -> list[Path]:
    """Non-finite rate and error vs logit amplitude (dtype overflow points marked), and the
    convergence of the residuals with the iteration count."""
    out_dir = _folder(out_dir)
    rows = table.to_pylist()
    written = []
    max_iters = max(r["iters"] for r in rows)
    for metric, fname, ylabel in (("nonfinite_rate", "stability-nonfinite.png", "non-finite share of outputs"),
                                  ("err_same_config", "stability-error.png", "max |out - float64| (same config)")):
        fams = sorted({r["family"] for r in rows})
        fig, axes = plt.subplots(1, len(fams), figsize=(5 * len(fams), 4.2), sharey=True, squeeze=False)
        for ax, fam in zip(axes[0], fams):
            sel = [r for r in rows if r["metric"] == metric and r["family"] == fam and r["iters"] == max_iters
                   and r["eps_mode"] == "add" and r["order"] == "row_first"]
            for k, key in enumerate(sorted({(r["impl"], r["dtype"], r["stabilize"], r["eps"]) for r in sel})):
                pts = sorted((r["scale"], r["value"]) for r in sel if (r["impl"], r["dtype"], r["stabilize"], r["eps"]) == key)
                ys = [min(v, 1e3) if v == v else 1e3 for _, v in pts]
                ax.plot([p[0] for p in pts], ys, marker=".", label=f"{key[0]} {key[1]} {key[2]} eps={key[3]:g}",
                        **_style(k))
            _overflow_lines(ax, {dt: x for dt, x in overflow.items() if dt in {r["dtype"] for r in sel}})
            ax.set_xscale("log")
            if metric != "nonfinite_rate":
                ax.set_yscale("log")
            ax.set_title(f"{fam} ({max_iters} iterations)")
            ax.set_xlabel("logit amplitude (max |logit|)")
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=6)
        path = _save(fig, out_dir / fname, 100)
        written.append(path)
    # convergence: residual vs iterations at amplitude ~ 10 in fp32
    sel = [r for r in rows if r["metric"] in ("row_residual", "col_residual") and r["dtype"] == "fp32"]
    if sel:
        target = min({r["scale"] for r in sel}, key=lambda s: abs(math.log10(s) - 1))
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for k, key in enumerate(sorted({(r["impl"], r["family"], r["stabilize"], r["eps"], r["metric"]) for r in sel})):
            pts = sorted((r["iters"], r["value"]) for r in sel if r["scale"] == target and
                         (r["impl"], r["family"], r["stabilize"], r["eps"], r["metric"]) == key)
            if pts and all(v == v and v < float("inf") for _, v in pts):
                ax.plot([p[0] for p in pts], [max(p[1], 1e-17) for p in pts], marker="o", ms=3,
                        label=f"{key[0]} {key[1]} {key[2]} eps={key[3]:g} {key[4].split('_')[0]}", **_style(k))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("iterations")
        ax.set_ylabel("max |sum - 1|")
        ax.set_title(f"convergence at amplitude {target:g} (fp32)")
        ax.legend(fontsize=5)
        path = _save(fig, out_dir / "stability-convergence.png", 100)
        written.append(path)
    return written


def knob_shift_figure(table: pa.Table, out_dir: str | Path) -> Path:
    """The knob change through the mHC stack: relative shift of the residual stream vs depth per
    input family (solid), beside the shift that storing activations in the dtype causes (dashed)."""
    out_dir = _folder(out_dir)
    rows = [r for r in table.to_pylist() if r["level"] == "stack"]
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(dtypes)), figsize=(5.5 * max(1, len(dtypes)), 4.2), sharey=True, squeeze=False)
    first = rows[0] if rows else {"kernel": "?", "knob": "?", "setting_a": "?", "setting_b": "?"}
    for ax, dt in zip(axes[0], dtypes):
        for k, fam in enumerate(sorted({r["family"] for r in rows})):
            color = _style(k)["color"]
            for metric, ls in (("shift_rel_l2", "-"), ("noise_rel_l2", "--")):
                pts = sorted((r["depth"], r["value"]) for r in rows
                             if r["dtype"] == dt and r["family"] == fam and r["metric"] == metric)
                ax.plot([p[0] for p in pts], [max(p[1], 1e-18) for p in pts], ls=ls, color=color, marker=".",
                        label=f"{fam} {'knob shift' if metric == 'shift_rel_l2' else f'{dt} storage'}")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(f"activations stored in {dt}")
    axes[0][0].set_ylabel("||x_B - x_A|| / ||x_A||")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(f"{first['kernel']} {first['knob']}: {first['setting_a']} -> {first['setting_b']}")
    return _save(fig, out_dir / "stability-eps.png", 100)


def overflow_figure(table: pa.Table, out_dir: str | Path) -> Path:
    """Headroom (log2 of max finite / amax) of every intermediate vs input scale, one panel per
    dtype; zero is the overflow line."""
    out_dir = _folder(out_dir)
    rows = [r for r in table.to_pylist() if r["metric"] == "headroom_log2"]
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(dtypes)), figsize=(5.5 * max(1, len(dtypes)), 4.2), sharey=True, squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        for k, name in enumerate(dict.fromkeys(r["intermediate"] for r in rows)):
            pts = sorted((r["scale"], r["value"]) for r in rows if r["dtype"] == dt and r["intermediate"] == name)
            ax.plot([p[0] for p in pts], [p[1] if math.isfinite(p[1]) else float("nan") for p in pts],
                    marker=".", color=_style(k)["color"], ls=":" if name.startswith("input:") else "-", label=name)
        ax.axhline(0, color=_FAILED, lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("input scale")
        ax.set_title(dt)
    axes[0][0].set_ylabel("headroom, log2(max finite / amax)")
    axes[0][-1].legend(fontsize=6)
    kernel = rows[0]["kernel"] if rows else "?"
    fig.suptitle(f"{kernel}: headroom of each intermediate")
    return _save(fig, out_dir / f"stability-overflow-{kernel}.png", 100)


def gain_figure(table: pa.Table, out_dir: str | Path) -> Path:
    """Composite Amax gain vs depth, forward and backward, per H_res configuration."""
    out_dir = _folder(out_dir)
    rows = table.to_pylist()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, metric, title in zip(axes, ("fwd_gain", "bwd_gain"), ("forward (max |row sum|)", "backward (max |col sum|)")):
        for k, (cfg, impl) in enumerate(dict.fromkeys((r["config"], r["impl"]) for r in rows)):
            for suffix, ls in (("", "-"), ("_max", ":")):
                pts = sorted((r["depth"], r["value"]) for r in rows
                             if r["config"] == cfg and r["impl"] == impl and r["metric"] == metric + suffix)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, color=_style(k)["color"],
                        label=f"{cfg} ({impl}){' max' if suffix else ''}")
        ax.set_yscale("log")
        ax.set_xlabel("depth (layers composed)")
        ax.set_title(title)
    axes[0].set_ylabel("Amax gain of prod H_res (mean over tokens; dotted: max)")
    axes[1].legend(fontsize=6)
    return _save(fig, out_dir / "stability-gain.png", 100)


# the trajectories of a train report: the reference in black, native in grey, the implementation
# in blue (red is kept for what failed), native runs with a knob dashed
_TRAIN_STYLE = {"reference": dict(color="black", lw=2.2, zorder=1), "native": dict(color="0.55", lw=1.6, zorder=2),
                "impl": dict(color="tab:blue", lw=1.3, zorder=3)}


def train_figures(table: pa.Table, out_dir: str | Path) -> list[Path]:
    """Two PNGs from a ``mhctool train`` report: the golden-value metrics per trajectory (lm loss,
    grad-norm, num-zeros; the implementation's distance from the reference against native's, the
    step where it parted marked), and H_res's health per layer (the largest Sinkhorn logit, the
    row-sum deviation) for the implementation and the reference."""
    out_dir = _folder(out_dir)
    rows = table.to_pylist()
    seeds = sorted({r.get("seed") for r in rows if r.get("seed") is not None and r["step"] is not None
                    and r["metric"] in ("lm loss", "grad-norm", "num-zeros")})
    if len(seeds) > 1:
        return [_train_bands(rows, seeds, out_dir), *_train_health(rows, out_dir, seeds[0])]
    runs = list(dict.fromkeys(r["run"] for r in rows if r["step"] is not None
                              and not r["metric"].startswith(("drift:", "seed-drift:"))))
    parted = {r["metric"][len("drift:"):]: r["step"] for r in rows if r["metric"].startswith("drift:") and r["step"]}

    def series(run, metric, layer=None):
        pts = sorted((r["step"], r["value"]) for r in rows if r["run"] == run and r["metric"] == metric
                     and r["layer"] == layer and r["step"] is not None)
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), sharex=True)
    for col, metric in enumerate(("lm loss", "grad-norm", "num-zeros")):
        ax = axes[0, col]
        for run in runs:
            xs, ys = series(run, metric)
            style = _TRAIN_STYLE.get(run, dict(color="tab:purple", lw=1.0, ls="--", zorder=2))
            ax.plot(xs, ys, label=run, **style)
        ax.set_title(metric)
        dist = axes[1, col]
        rx, ry = series("reference", metric)
        ref = dict(zip(rx, ry))
        drawn = False
        for run in (r for r in runs if r != "reference"):
            xs, ys = series(run, metric)
            # a step where the two are equal has no place on a log scale: left out, not drawn at a floor
            d = [(x, abs(y - ref[x])) for x, y in zip(xs, ys) if x in ref and math.isfinite(y) and math.isfinite(ref[x])
                 and y != ref[x]]
            if d:
                style = _TRAIN_STYLE.get(run, dict(color="tab:purple", lw=1.0, ls="--"))
                dist.plot([p[0] for p in d], [p[1] for p in d], marker=".", label=run, **style)
                drawn = True
        if drawn:
            dist.set_yscale("log")
        else:
            dist.text(0.5, 0.5, "equal to the reference at every step", ha="center", va="center",
                      transform=dist.transAxes)
        dist.set_title(f"{metric}: distance from the reference (equal steps left out)")
        dist.set_xlabel("step")
        if metric in parted:
            _mark_parting(ax, dist, parted[metric])
    axes[0, 0].legend(fontsize=8)
    return [_save(fig, out_dir / "train-metrics.png", 110), *_train_health(rows, out_dir, None)]


def _mark_parting(ax, dist, step: int) -> None:
    """The step where the verdict says the run parts from the reference, on a metric and its distance."""
    for ax_ in (ax, dist):
        ax_.axvline(step, color="tab:red", ls=":", lw=1.2)
    ax.annotate(f"parts at step {step}", (step, ax.get_ylim()[1]), color="tab:red", fontsize=8, ha="left",
                va="top", xytext=(3, -3), textcoords="offset points")


def _train_bands(rows: list[dict], seeds: list[int], out_dir: Path) -> Path:
    """A seed ensemble's metrics: per step, the float64 runs' and native's band (least to largest
    over the seeds) with each of the implementation's runs over them, and below, each seed's
    distance from its float64 run (the implementation's runs over native's band); the step where
    the verdict says it parts marked."""
    by: dict = {}
    for r in rows:
        if r["step"] is not None and r.get("seed") is not None and r["layer"] is None:
            by.setdefault((r["run"], r["metric"], r["seed"]), {})[r["step"]] = r["value"]
    parted = {r["metric"][len("drift:"):]: r["step"] for r in rows
              if r["metric"].startswith("drift:") and r["step"] and r.get("seed") is None}

    def band(ax, run, metric, seeds_, transform=None, **style):
        per = [by.get((run, metric, s), {}) for s in seeds_]
        if transform:
            per = [transform(p, s) for p, s in zip(per, seeds_)]
        steps = sorted(set().union(*per)) if per else []
        lo = [min((p[k] for p in per if k in p and math.isfinite(p[k])), default=math.nan) for k in steps]
        hi = [max((p[k] for p in per if k in p and math.isfinite(p[k])), default=math.nan) for k in steps]
        if steps:
            ax.fill_between(steps, lo, hi, alpha=0.3, lw=0, **style)

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), sharex=True)
    for col, metric in enumerate(("lm loss", "grad-norm", "num-zeros")):
        ax, dist = axes[0, col], axes[1, col]
        band(ax, "reference", metric, seeds, color="black", label=f"float64 (band over {len(seeds)} seeds)")
        band(ax, "native", metric, seeds, color="0.55", label="native (band)")
        for k, s in enumerate(seeds):
            run = by.get(("impl", metric, s), {})
            ax.plot(sorted(run), [run[x] for x in sorted(run)], color="tab:blue", lw=0.9,
                    label="implementation (a line a seed)" if k == 0 else None)

        def distance(run_steps, s, metric=metric):
            ref = by.get(("reference", metric, s), {})
            return {x: abs(v - ref[x]) for x, v in run_steps.items() if x in ref and math.isfinite(v)
                    and math.isfinite(ref[x]) and v != ref[x]}
        band(dist, "native", metric, seeds, transform=distance, color="0.55", label="native (band)")
        drawn = False
        for k, s in enumerate(seeds):
            d = distance(by.get(("impl", metric, s), {}), s)
            if d:
                dist.plot(sorted(d), [d[x] for x in sorted(d)], color="tab:blue", lw=0.9, marker=".", ms=2,
                          label="implementation" if not drawn else None)
                drawn = True
        if drawn or any(distance(by.get(("native", metric, s), {}), s) for s in seeds):
            dist.set_yscale("log")
        else:
            dist.text(0.5, 0.5, "equal to the reference at every step", ha="center", va="center",
                      transform=dist.transAxes)
        ax.set_title(metric)
        dist.set_title(f"{metric}: distance from each seed's float64 run")
        dist.set_xlabel("step")
        if metric in parted:
            _mark_parting(ax, dist, parted[metric])
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=8)
    return _save(fig, out_dir / "train-metrics.png", 110)


def _train_health(rows: list[dict], out_dir: Path, seed) -> list[Path]:
    """H_res's health per layer (the largest Sinkhorn logit, the row-sum deviation) of the
    implementation and the reference (of ``seed``, where the report has several)."""
    written = []

    def series(run, metric, layer=None):
        pts = sorted((r["step"], r["value"]) for r in rows if r["run"] == run and r["metric"] == metric
                     and r["layer"] == layer and r["step"] is not None and (seed is None or r.get("seed") == seed))
        return [p[0] for p in pts], [p[1] for p in pts]
    layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
    if layers:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
        for ax, metric in zip(axes, ("largest logit", "row-sum deviation")):
            for run, ls in (("reference", "-"), ("impl", "--")):
                for k, layer in enumerate(layers):
                    xs, ys = series(run, metric, layer)
                    if xs:
                        ax.plot(xs, [max(y, 1e-12) if math.isfinite(y) else float("nan") for y in ys], ls=ls,
                                color=plt.cm.viridis(k / max(1, len(layers) - 1)), label=f"{run} layer {layer}")
            ax.set_title(metric)
            ax.set_xlabel("step")
            if metric != "largest logit":
                ax.set_yscale("log")
        if axes[0].get_ylim()[1] > 44:  # where exp overflows fp32 without a max subtracted, where that is near
            axes[0].axhline(88.0, color="k", ls=":", lw=1)
        axes[1].legend(fontsize=7, ncol=2)
        written.append(_save(fig, out_dir / "train-health.png", 110))
    return written
