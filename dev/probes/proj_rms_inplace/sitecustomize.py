"""A probe, not mhctool: why mhctool's Triton projection backward takes 2.2 ms a call inside
Megatron's step and 0.28 ms alone at the same shape (bench --engine on an H200, 2026-11-29).

Put this folder first on PYTHONPATH and set PROBE_PROJ_RMS to a folder: every Python process
(bench --engine runs each variant in its own) then wraps
``kernels.triton.proj_rms.proj_rms_backward``: each call is timed with CUDA events, its
arguments' shapes, strides, dtypes and contiguity and the deterministic-mode settings are kept,
and for the first calls the same backward is timed again three ways: as called, with every
argument made contiguous, with deterministic algorithms off, and (a bf16 weight) with the
weight in fp32, as the engine handed it before 2026-11-29's change. The call's own result is the
one returned. At exit each process writes PROBE_PROJ_RMS/<pid>.json.
    PYTHONPATH=dev/probes/proj_rms_inplace PROBE_PROJ_RMS=$OUT/probe BENCH_STEPS=probe bash dev/engine-gpu.sh bench
"""
import os

if os.environ.get("PROBE_PROJ_RMS"):
    import atexit
    import json

    def _install():
        import torch
        from mhctool.kernels.triton import proj_rms as m
        orig, calls, again = m.proj_rms_backward, [], []

        def desc(t):
            if not isinstance(t, torch.Tensor):
                return repr(t)
            return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
                    "contiguous": t.is_contiguous(), "ptr_mod_16": t.data_ptr() % 16}

        def timed(fn, *a, **k):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = fn(*a, **k)
            e1.record()
            return out, (e0, e1)

        def wrapped(x2d, weight, r, rms, grad_proj, grad_r, *a, **k):
            if not x2d.is_cuda:
                return orig(x2d, weight, r, rms, grad_proj, grad_r, *a, **k)
            out, ev = timed(orig, x2d, weight, r, rms, grad_proj, grad_r, *a, **k)
            args = [x2d, weight, r, rms, grad_proj, grad_r]
            calls.append({"args": [desc(t) for t in args], "kw": sorted(k),
                          "deterministic": torch.are_deterministic_algorithms_enabled(),
                          "fill_uninitialized": bool(getattr(torch.utils.deterministic, "fill_uninitialized_memory", False)),
                          "events": ev})
            if len(again) < 8:
                row = {"as_called": timed(orig, *args, *a, **k)[1]}
                clones = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in args]
                row["contiguous"] = timed(orig, *clones, *a, **k)[1]
                was = torch.are_deterministic_algorithms_enabled()
                torch.use_deterministic_algorithms(False)
                try:
                    row["not_deterministic"] = timed(orig, *args, *a, **k)[1]
                finally:
                    torch.use_deterministic_algorithms(was)
                if weight.dtype != torch.float32:  # the path before the engine kept the weight's dtype
                    row["weight_fp32"] = timed(orig, x2d, weight.float(), *args[2:], *a, **k)[1]
                again.append(row)
            return out

        m.proj_rms_backward = wrapped

        def dump():
            if not calls:
                return
            torch.cuda.synchronize()
            for c in calls:
                e0, e1 = c.pop("events")
                c["ms"] = e0.elapsed_time(e1)
            rows = [{k: v[0].elapsed_time(v[1]) for k, v in r.items()} for r in again]
            os.makedirs(os.environ["PROBE_PROJ_RMS"], exist_ok=True)
            with open(os.path.join(os.environ["PROBE_PROJ_RMS"], f"{os.getpid()}.json"), "w") as f:
                json.dump({"calls": calls[:16], "n_calls": len(calls),
                           "median_ms": sorted(c["ms"] for c in calls)[len(calls) // 2], "again": rows}, f, indent=1)

        atexit.register(dump)

    try:
        _install()
    except Exception as e:  # noqa: BLE001 - a probe never stops the process it watches
        print(f"proj_rms probe not installed: {e}")
