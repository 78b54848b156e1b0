"""Megatron-LM's fused mHC kernels (``megatron/core/fusions/fused_mhc_kernels.py``).

Two generations are recognised by their public functions:

- ``pr3828`` (cuTile, PR 3828): ``fused_sinkhorn(input_logits, num_iterations, eps)``,
  ``fused_h_aggregate(x, h_pre)``, ``fused_h_post_bda(h_res, original_residual, h_post, x, bias)``
  and ``fused_proj_rms(x, weight, eps) -> (proj, r [M, 1])``; the contract's conventions.
- ``dev`` (Triton and cuTile, the later generation, recognised by ``fused_proj_rms_compute_h``):
  its Sinkhorn starts from a row softmax plus eps (``stabilize=softmax``; its Triton kernel takes n a
  power of two, other n are skipped with that reason), its h_post_bda mixes
  with ``H_res^T`` (``transpose_res=true``), and ``fused_proj_rms_compute_h(x, weight, alpha_pre,
  alpha_post, alpha_res, bias, n, eps, compute_h_eps) -> (h_pre + compute_h_eps, h_post, h_res
  [M, n*n], r = ||x|| / sqrt(K) [M, 1])`` is the mapping family with ``compute_h_eps=1e-6``.

The cuTile projections of both generations multiply in TF32, forward and backward: those kernels
are judged under the TF32 contract.

Where it is used, Megatron's ``HyperConnectionModule`` hands ``fused_h_aggregate`` its ``h_pre`` and
``fused_h_post_bda`` its ``h_res`` and ``h_post`` in the activations' dtype, not fp32: PR 3828's
``fused_proj_rms`` returns ``proj`` and ``r`` in ``x``'s dtype and ``_compute_h`` keeps them there
(its parameters are bf16 under ``Float16Module``); dev's ``compute_mappings`` ends with
``h_pre.to(dtype), h_post.to(dtype), h_res.to(dtype)``. ``fused_h_post_bda`` writes its output in
``h_res``'s dtype, so fed fp32 ones it writes twice the bytes. ``USED_DTYPES`` says so; bench times
the kernels at those dtypes (parity keeps the contract's).
"""
from __future__ import annotations

from dataclasses import replace

from . import Binding, load_path_or_module, n_of

NAME = "megatron"
MODULE = "megatron.core.fusions.fused_mhc_kernels"


def load(target: str):
    return load_path_or_module(target, MODULE, "fused_mhc_kernels.py")


# the inputs HyperConnectionModule passes in the activations' dtype (both generations)
USED_DTYPES = {"h_aggregate": {"h_pre": "activation"},
               "h_post_bda": {"h_res": "activation", "h_post": "activation"}}


def _sinkhorn(m, logits, iters=20, eps=1e-6):
    return m.fused_sinkhorn(logits, iters, eps)


def _h_aggregate(m, x, h_pre):
    return m.fused_h_aggregate(x, h_pre)


def _h_post_bda(m, h_res, x, h_post, y, bias):
    return m.fused_h_post_bda(h_res, x, h_post, y, bias)


def _proj_rms(m, x2d, weight, eps=1e-6):
    return m.fused_proj_rms(x2d, weight, eps)


def _mapping(m, x2d, weight, alpha, h_bias, eps=1e-6, compute_h_eps=1e-6):
    n = n_of(weight)
    h_pre, h_post, h_res, r = m.fused_proj_rms_compute_h(
        x2d, weight, alpha[0:1], alpha[1:2], alpha[2:3], h_bias, n, eps, compute_h_eps)
    return h_pre, h_post, h_res.reshape(h_res.shape[0], n, n), r


def _power_of_two(shape) -> str | None:
    """dev's Triton Sinkhorn takes ``tl.arange(0, n)``: Triton refuses a range that is not a power of two."""
    n = shape.n
    return None if n & (n - 1) == 0 else f"Megatron-LM dev's Triton Sinkhorn takes n a power of two, not {n}"


def _cutile_check(m) -> tuple[bool, str | None]:
    """The module's own ``is_cutile_available()``: (its answer, or False where it has none; what it
    raised, if it did)."""
    check = getattr(m, "is_cutile_available", None)
    if check is None:
        return False, None
    try:
        return bool(check()), None
    except Exception as e:  # noqa: BLE001 - the library's own check failed
        return False, f"{type(e).__name__}: {e}"


def _unavailable(m, dev: bool) -> str | None:
    """PR 3828's kernels are cuTile only: where the module's own check says no, they cannot run."""
    if dev or not hasattr(m, "is_cutile_available"):
        return None
    ok, raised = _cutile_check(m)
    if raised:
        return f"its is_cutile_available() raised {raised}"
    return None if ok else "Megatron's PR 3828 kernels are cuTile only and its is_cutile_available() is False here"


def recognise(m) -> tuple[str, list[Binding]]:
    dev = hasattr(m, "fused_proj_rms_compute_h")
    generation = "dev" if dev else "pr3828"
    why = _unavailable(m, dev)
    # the cuTile projections multiply in TF32 (``ct.mma`` on tfloat32 operands, forward and
    # backward); dev's torch fallback, taken without cuTile, multiplies at IEEE
    precision = "tf32" if _cutile_check(m)[0] else "ieee"
    found = []
    if hasattr(m, "fused_sinkhorn"):
        found.append(Binding("sinkhorn", "fused_sinkhorn", _sinkhorn, ("iters", "eps"),
                             {"stabilize": "softmax"} if dev else {}, limit=_power_of_two if dev else None))
    if hasattr(m, "fused_h_aggregate"):
        found.append(Binding("h_aggregate", "fused_h_aggregate", _h_aggregate))
    if hasattr(m, "fused_h_post_bda"):
        found.append(Binding("h_post_bda", "fused_h_post_bda", _h_post_bda, (), {"transpose_res": dev}))
    if hasattr(m, "fused_proj_rms"):
        found.append(Binding("proj_rms", "fused_proj_rms", _proj_rms, ("eps",), precision=precision))
    if dev:
        found.append(Binding("mapping", "fused_proj_rms_compute_h", _mapping, ("eps", "compute_h_eps"),
                             {"compute_h_eps": 1e-6}, precision=precision))
    # Megatron's own module launches CUDA kernels (cuTile, Triton) whatever the inputs' device; a
    # plain-PyTorch module with its signatures runs anywhere
    devices = ("cuda",) if hasattr(m, "is_cutile_available") else ("cpu", "cuda")
    return generation, [replace(b, unavailable=why, devices=devices, dtypes=USED_DTYPES.get(b.family, {}))
                        for b in found]
