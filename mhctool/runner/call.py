"""One call of an implementation on a case's inputs: forward, then backward with the seeded
upstream gradients, its outputs conformed to the family's contract, every failure a result (a
refusal, a raise, an exit); and the float64 reference's call."""
from __future__ import annotations

import functools
import os
import traceback
from dataclasses import replace

import torch

from mhctool.core import cuda_context, partial
from mhctool.core import inputs as inputs_mod
from mhctool.core.dtypes import FORMATS, dtype_named, fmt_of
from mhctool.core.errors import short_error, system_exit_message
from mhctool.core.poison import poisoning
from mhctool.families import MATMUL_KERNELS, Family, get_family
from mhctool.registry.builtin import native_impl
from mhctool.registry.impl import Impl
from mhctool.registry.specs import resolve_one
from mhctool.runner.case import Case, ImplResult

# exception classes (by name or by the module they come from) that mean "this implementation does
# not take this case": an assert on a shape or a dtype, a kernel compiler refusing the shape
_LIMIT_TYPES = (AssertionError, NotImplementedError)


_COMPILER_MODULES = ("tilelang", "tvm", "tvm_ffi", "triton.compiler", "cuda.tile")


def refusal(e: BaseException) -> bool:
    """True for an exception by which an outside implementation refuses a case it does not take
    (its own ``assert``, ``NotImplementedError``, or its kernel compiler's error at that shape), as
    opposed to a failure: the case is skipped with the implementation's own words and judged at
    the other shapes (an implementation refusing every case is still judged on nothing, a failure)."""
    if isinstance(e, _LIMIT_TYPES):
        return True
    if _interpreter_refusal(e):
        return True
    for cls in type(e).__mro__:  # raised by a kernel compiler (not, say, torch.compile's failures)
        module = cls.__module__ or ""
        if any(module == m or module.startswith(m + ".") for m in _COMPILER_MODULES):
            return True
    return False


def _interpreter_refusal(e: BaseException) -> bool:
    """Triton's CPU interpreter wraps what the GPU compiler raises while it traces a kernel (an
    ``arange`` whose range is no power of two, a constexpr a check refuses) in an
    ``InterpreterError``: a refusal as on the GPU where the wrapped error was raised by Triton's
    language front end; an error of the kernel's own running (a bad load) is not."""
    if type(e).__name__ != "InterpreterError" or not (type(e).__module__ or "").startswith("triton."):
        return False
    cause = e.__cause__ or e.__context__
    if cause is None or cause.__traceback__ is None:
        return False
    frames = traceback.extract_tb(cause.__traceback__)
    return bool(frames) and f"triton{os.sep}language{os.sep}" in frames[-1].filename


def cast_case_inputs(fam: Family, raw: dict, case: Case) -> dict:
    return cast_inputs(fam, raw, case.dtype, case.device)


def cast_inputs(fam: Family, raw: dict, dtype: str, device: str) -> dict:
    """The family's inputs in call order: activations at ``dtype``, mapping tensors in fp32,
    integer tensors (token counts, masks) as generated; absent ones None."""
    act = FORMATS[dtype].torch_dtype
    out = {}
    for name in fam.inputs:
        t = raw.get(name)
        if t is None:
            out[name] = None
            continue
        if not t.is_floating_point():  # token counts, masks: as generated
            out[name] = t.to(device=device).contiguous()
            continue
        out[name] = t.to(dtype=torch.float32 if name in fam.mapping else act, device=device).contiguous()
    return out


def leaf_inputs(fam: Family, base: dict, dtype=None) -> dict:
    out = {}
    for name, t in base.items():
        if not torch.is_tensor(t):  # None, or a keyed knob given with the call (the dropout's key)
            out[name] = t
            continue
        if not t.is_floating_point():
            out[name] = t.detach().clone()
            continue
        t = t.detach().clone() if dtype is None else t.detach().to(dtype)
        out[name] = t.requires_grad_(name in fam.differentiable)
    return out


def _grad_inputs(fam: Family, args: dict) -> list[str]:
    return [k for k in fam.differentiable if args.get(k) is not None]


def run_reference(fam: Family, base: dict, knobs: dict, upstream: list[torch.Tensor], fn=None):
    """The float64 reference (``fn``: another function of the family's signature) and its gradients."""
    args = leaf_inputs(fam, base, torch.float64)
    outs = fam.call(fn or fam.reference, args, knobs, lambda k: True)
    names = _grad_inputs(fam, args)
    if fam.forward_only or not names:
        return [o.detach() for o in outs], {}
    # autograd's device thread gets the context first (under --ranks this is the process's first
    # backward on the GPU, and cuBLAS warned that it had none)
    grads = torch.autograd.grad(cuda_context.bound(list(outs)), [args[k] for k in names],
                                [u.double() for u in upstream])
    return [o.detach() for o in outs], dict(zip(names, grads))


def _digest(tensors) -> torch.Tensor | None:
    """A digest of CUDA tensors' bytes (a byte sum each), computed on the caller's stream: taken
    before and after a device-wide synchronization, it differs where the tensors were still being
    written by work on another stream, which the caller's stream had not been told to wait for."""
    cuda = [t.detach() for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda and t.numel()]
    if not cuda:
        return None
    return torch.stack([t.contiguous().view(torch.uint8).sum(dtype=torch.int64) for t in cuda])


_DIGEST_LOADED: set = set()  # devices where the digest's kernels have run once


def load_digest(device) -> None:
    """Run :func:`_digest` once on ``device`` before the code under test: a kernel's first launch
    can wait for the whole device (its module loaded lazily), which would let work left on another
    stream finish before the first digest reads it."""
    if str(device) not in _DIGEST_LOADED:
        torch.equal(_digest([torch.ones(2, device=device)]), _digest([torch.ones(2, device=device)]))
        _DIGEST_LOADED.add(str(device))


def settled(tensors, what: str) -> str | None:
    """Synchronize the device (an asynchronous CUDA error surfaces here, in the direction that
    caused it), and say so where ``tensors`` changed meanwhile (:func:`_digest`; call
    :func:`load_digest` before the code under test runs)."""
    before = _digest(tensors)
    torch.cuda.synchronize()
    if before is None or torch.equal(before, _digest(tensors)):
        return None
    return (f"its {what} changed after the call returned: work left on another stream that the caller's stream "
            f"was never told to wait for (a caller reads them unfinished)")


def run_impl(fam: Family, impl: Impl, base: dict, knobs: dict, upstream_fn, expect=None,
             before_backward=None) -> ImplResult:
    """Forward, then backward with the upstream gradients ``upstream_fn(outputs)``. ``expect``:
    the contract's (shape, dtype, device) per output; outputs are conformed to it by value.
    ``before_backward(result)``: called with the forward's result before the backward runs."""
    res = ImplResult()
    args = leaf_inputs(fam, base)
    on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in args.values())
    if on_gpu:
        load_digest(next(t.device for t in args.values() if isinstance(t, torch.Tensor) and t.is_cuda))
    try:
        with poisoning(True):
            outs = list(fam.call(impl.fn, args, knobs, impl.accepts, impl.bind, impl.takes))
            # an asynchronous CUDA error of the forward's kernels is the forward's, here
            unsettled = settled(outs, "outputs") if on_gpu else None
    except SystemExit as e:  # code under test never decides mhctool's exit code
        res.fwd_error = system_exit_message(e)
        return res
    except Exception as e:  # an implementation that raises is a failed case, not a crash
        res.fwd_error = short_error(e)
        if impl.backend == "external" and refusal(e):
            res.fwd_refused = res.fwd_error  # parity skips it; elsewhere it is an error as before
        return res
    if unsettled:
        res.fwd_error = unsettled
        return res
    if expect is not None:
        outs, problem = conform_outputs(fam, outs, expect, res.returned)
        if problem:
            res.fwd_error = problem
            return res
    res.outputs = [o.detach() for o in outs]
    if fam.forward_only:
        return res
    outs = cuda_context.bound(outs)  # autograd's device thread gets the context before the impl's backward
    names = _grad_inputs(fam, args)
    if not any(o.requires_grad for o in outs):
        res.bwd_unsupported = "no backward: its outputs carry no autograd graph"
        return res
    if before_backward is not None:
        before_backward(res)
    try:
        with poisoning(True):
            grads = torch.autograd.grad(
                [o for o in outs if o.requires_grad],
                [args[k] for k in names],
                [u for o, u in zip(outs, upstream_fn(outs)) if o.requires_grad],
                allow_unused=True,
            )
            unsettled = settled(grads, "gradients") if on_gpu else None  # the backward's, not the next call's
    except SystemExit as e:
        res.bwd_error = system_exit_message(e)
        return res
    except Exception as e:
        if impl.backend == "external" and refusal(e):
            res.bwd_unsupported = f"its backward refuses this case: {short_error(e)}"
        else:
            res.bwd_error = short_error(e)
        return res
    if unsettled:
        res.bwd_error = unsettled
        return res
    missing = [k for k, g in zip(names, grads) if g is None]
    if missing:
        res.bwd_error = f"no gradient for {', '.join(missing)}"
        return res
    res.grads = {k: g.detach() for k, g in zip(names, grads)}
    return res


def named_tensors(fam: Family, outputs: list | None, grads: dict | None) -> dict[str, torch.Tensor]:
    """Outputs by the family's names and gradients as ``grad_<input>``: the report's tensor names."""
    return dict(zip(fam.outputs, outputs or [])) | {f"grad_{k}": g for k, g in (grads or {}).items()}


def output_specs(outs: list[torch.Tensor]) -> list[tuple]:
    """What the contract expects of each output: (shape, dtype, device), from the native outputs."""
    return [(tuple(o.shape), o.dtype, str(o.device)) for o in outs]


def conform_outputs(fam: Family, outs, expect: list[tuple], returned: dict) -> tuple[list, str | None]:
    """Outputs judged by value: a shape that differs from the contract's only by size-1 dimensions
    is reshaped, another floating dtype is converted to the contract's (its error is then judged
    by the contract's threshold: a lower precision is not excused) and named in ``returned``.
    What cannot be judged (count, non-tensor, element count, device, a non-float) is the problem."""
    required = len(expect) - len(fam.optional_outputs)
    if not required <= len(outs) <= len(expect):
        counted = f"{required} to {len(expect)}" if required < len(expect) else str(len(expect))
        return outs, f"returned {len(outs)} outputs, expected {counted} ({', '.join(fam.outputs)})"
    conformed = []
    for name, o, (shape, dtype, device) in zip(fam.outputs, outs, expect):
        if not isinstance(o, torch.Tensor):
            return outs, f"output {name} is {type(o).__name__}, not a tensor"
        if str(o.device) != device:
            return outs, f"output {name} is on {o.device}, expected {device}"
        if tuple(o.shape) != shape:
            if [d for d in o.shape if d != 1] != [d for d in shape if d != 1]:
                return outs, f"output {name} has shape {tuple(o.shape)}, expected {shape}"
            o = o.reshape(shape)
        if o.dtype != dtype:
            if not (o.is_floating_point() and dtype.is_floating_point):
                return outs, f"output {name} has dtype {o.dtype}, expected {dtype}"
            returned[name] = fmt_of(o.dtype).name
            o = o.to(dtype)
        conformed.append(o)
    return conformed, None


def isolated_impl(kernel: str, spec: str, name: str, base: dict, knobs: dict, upstream: list, expect: list) -> dict:
    """The job an isolation worker runs: resolve ``spec`` for ``kernel`` there, and run ``name``."""
    impl = resolve_one(kernel, spec, name)
    handed = []  # the forward's outputs, handed to the parent before the backward (which may end the process)
    res = run_impl(get_family(kernel), impl, base, knobs, lambda outs: upstream, expect,
                   before_backward=lambda r: handed.append(
                       partial.report({"outputs": r.outputs, "returned": dict(r.returned)})))
    out = res.to_dict()
    if any(handed):
        out["outputs"], out["outputs_handed"] = None, True
    return out


def native_at(kernel: str, precision: str) -> Impl:
    nat = native_impl(kernel)
    if precision == "ieee" or kernel not in MATMUL_KERNELS:
        return nat
    fn = functools.partial(nat.fn, matmul_precision=precision)
    return replace(nat, name=f"torch-{precision}", target=fn, _fn=fn, precision=precision)


INPUT_DTYPES = ("activation", "fp32", "bf16", "fp16")


def declared_inputs(base: dict, cast: dict, dtype: str) -> tuple[dict, dict]:
    """(the inputs an implementation is given, the same values at the contract's dtypes): each
    input named in ``cast`` (name -> ``activation``, the case's dtype, or a format name) converted,
    so that the float64 reference and the native baseline see the values it sees (its rounding of
    an input is no error of its own)."""
    given, rounded = dict(base), dict(base)
    for name, want in cast.items():
        t = base.get(name)
        if t is None or not t.is_floating_point():
            continue
        given[name] = t.to(dtype_named(want, dtype))
        rounded[name] = given[name].to(t.dtype)
    return given, rounded


def contract_grads(res: ImplResult, base: dict) -> ImplResult:
    """Gradients of inputs given in another dtype, converted to the contract's (each judged by the
    contract's threshold: a lower precision is not excused), the dtype they came in recorded."""
    for name, g in (res.grads or {}).items():
        want = base[name].dtype
        if g.dtype != want:
            res.returned[f"grad_{name}"] = fmt_of(g.dtype).name
            res.grads[name] = g.to(want)
    return res


def upstream_for(fam: Family, outputs: list, seed: int) -> list:
    """Seeded upstream gradients; zero for the family's optional outputs."""
    ups = inputs_mod.upstream_grads(outputs, seed)
    first_optional = len(fam.outputs) - len(fam.optional_outputs)
    return [u if i < first_optional else torch.zeros_like(u) for i, u in enumerate(ups)]
