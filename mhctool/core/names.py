"""The names the command line offers before any command runs: kernel families, groups, what
identify takes. Plain tuples, so that ``mhctool --help`` and a usage error answer without importing
torch; :mod:`mhctool.registry` checks them against its families on import."""
from __future__ import annotations

MHC_KERNELS = ("sinkhorn", "h_aggregate", "h_post_bda", "proj_rms", "mapping", "mapping_sinkhorn", "mix_aggregate")
MOE_KERNELS = ("swiglu", "clamped_swiglu", "srelu", "grouped_gemm", "grouped_wgrad", "grouped_mlp")
KERNELS = MHC_KERNELS + MOE_KERNELS
GROUPS = ("all", "mhc", "moe")
# the families mhctool identify knows the conventions of
IDENTIFIABLE = ("sinkhorn", "h_aggregate", "h_post_bda", "proj_rms", "mapping", "mapping_sinkhorn", "mix_aggregate",
                "swiglu", "clamped_swiglu")

DTYPES = ("fp32", "bf16", "fp16")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float64": "fp64"}
DEVICES = ("cpu", "cuda")


def is_outside(spec: str) -> bool:
    """Whether an ``--impl`` spec names code mhctool did not ship: ``module:function``,
    ``FILE.py:function``, a library (``NAME:TARGET``) or a file of family-named functions
    (``FILE.py``); a built-in name (``triton``, ``cutile``, ...) is mhctool's own. The one place
    this is decided (what is isolated by default on a GPU, what time limit a case gets)."""
    return ":" in spec or spec.endswith(".py")
