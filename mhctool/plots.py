"""Figures made from report tables (never from live results), PNG through matplotlib's Agg."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pyarrow as pa  # noqa: E402

from .report import verdicts  # noqa: E402


def _label(v: dict) -> str:
    knobs = v["knobs"].strip("{}").replace('"', "")
    return f"{v['family']} {v['dtype']} {v['shape']}" + (f" {knobs}" if knobs else "")


def parity_figures(table: pa.Table, out_dir: str | Path) -> list[Path]:
    """One PNG per kernel: for each case and implementation, the worst gated error as a share of
    its threshold (1 = the verdict boundary), forward and backward side by side."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
                xs, ys, colors = [], [], []
                for v in pts:
                    m = v["worst_margin"]
                    m = 1e3 if (m is None or math.isinf(m) or m != m) else max(m, 1e-6)
                    xs.append(labels.index(_label(v)) + (k - (len(impls) - 1) / 2) * 0.15)
                    ys.append(m)
                    colors.append("tab:green" if v["passed"] else "tab:red")
                ax.scatter(xs, ys, c=colors, marker="osD^v<>"[k % 7], label=impl, edgecolors="k",
                           linewidths=0.4, s=36)
            ax.axhline(1.0, color="k", ls="--", lw=1)
            ax.set_yscale("log")
            ax.set_title(f"{kernel} {direction}")
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
            ax.grid(axis="y", alpha=0.3)
        axes[0].set_ylabel("worst error / threshold  (>1 fails; red = failed)")
        axes[0].legend(fontsize=8, title="impl (marker)")
        fig.tight_layout()
        path = out_dir / f"parity-{kernel}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
