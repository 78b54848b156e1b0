"""The README's reproducibility table from a parity report made with --check determinism
--check batch-invariance (e.g. ``mhctool parity --scenario repro --impl triton,cutile ...``).

    python dev/repro_table.py REPORT.parquet
"""
import sys
from collections import defaultdict

from mhctool.core import report


def main(path: str) -> None:
    table, meta = report.read(path)
    cells: dict = defaultdict(lambda: {"determinism": [], "batch-invariance": []})
    for r in table.to_pylist():
        if r["rule"] in ("determinism", "batch-invariance"):
            cells[r["kernel"], r["impl"], r["shape"]][r["rule"]].append(r)
    env = meta["environment"]
    print(f"device: {env.get('gpu') or 'cpu'}, torch {env.get('torch')}, triton {env.get('triton')}; "
          f"{meta['run'].get('repeats_determinism')} runs for determinism\n")
    print("| kernel | impl | shape | deterministic | batch-invariant |")
    print("|---|---|---|---|---|")
    for (kernel, impl, shape), checks in sorted(cells.items()):
        print(f"| {kernel} | {impl} | {shape} | {_cell(checks['determinism'])} | {_cell(checks['batch-invariance'])} |")


def _cell(rows: list) -> str:
    """yes: every compared tensor bit-identical; no: which differ and how; ``-``: not compared.
    The baseline's and the reference's rows are never gated, but their values count here."""
    def bad(r):
        return r["passed"] is False or (r["value"] == r["value"] and r["value"] is not None and r["value"] > 0)
    failed = [r for r in rows if bad(r)]
    if failed:
        return "no: " + "; ".join(sorted({f"{r['tensor']} ({(r['message'] or '').split(': ', 1)[-1][:70]})"
                                          for r in failed}))
    if not any(r["value"] == 0 for r in rows):
        return "-"
    return "yes"


if __name__ == "__main__":
    main(sys.argv[1])
