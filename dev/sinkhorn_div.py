"""Issue 63, item 5 (mix_aggregate's fp32 grad_h_bias at about 2x PyTorch's error on a GPU): the
Triton Sinkhorn's divisions rewritten in place, to run parity on each and compare. Variants:

    full     as shipped: ``p * (1.0 / d)``, Triton's fp32 ``/`` (``div.full.f32`` on NVIDIA, 2 ulp)
    rn       the reciprocal correctly rounded: ``p * div_rn(1, d)`` (one rounding more than PyTorch)
    el       every element divided once, correctly rounded: ``div_rn(p, d)`` (PyTorch's ``p / d``)

    python3 dev/sinkhorn_div.py rn      # rewrites kernels/triton/sinkhorn.py (git checkout restores it)

Triton keys its cache on the source, so each variant compiles anew."""
import sys
from pathlib import Path

path = Path(__file__).resolve().parents[1] / "kernels" / "triton" / "sinkhorn.py"
ONE = "tl.full(d.shape, 1.0, tl.float32)"
EDITS = {
    "full": [],
    "rn": [("return p * (1.0 / d)", f"return p * tl.math.div_rn({ONE}, d)"),
           ("    inv = 1.0 / d\n", f"    inv = tl.math.div_rn({ONE}, d)\n")],
    "el": [("return p * (1.0 / d)", "return tl.math.div_rn(p, tl.broadcast_to(d, p.shape))"),
           ("    inv = 1.0 / d\n    y = q * inv\n", "    y = tl.math.div_rn(q, tl.broadcast_to(d, q.shape))\n"),
           ("    return (g - gy) * inv\n", "    return tl.math.div_rn(g - gy, tl.broadcast_to(d, g.shape))\n")],
}
text = path.read_text()
for old, new in EDITS[sys.argv[1]]:
    assert text.count(old) == 1, old
    text = text.replace(old, new)
path.write_text(text)
print(f"kernels/triton/sinkhorn.py: {sys.argv[1]}")
