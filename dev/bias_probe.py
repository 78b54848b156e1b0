"""Issue 63, item 5: where mix_aggregate's fp32 grad_h_bias error comes from, a column at a time.

    python3 dev/bias_probe.py [cuda|cpu] [SHAPE] [FAMILY]     (default: cuda 9x2x2x40 random)

grad_h_bias[j] sums the logit gradient gh[t, j] over every token t. For each column j (pre
columns 0..n-1, post n..2n-1, res 2n..): the float64 value, the sum of its terms' magnitudes
(sum_t |gh[t, j]|), and the error of PyTorch's fp32 and of Triton's, each in units of the fp32
roundoff of that term sum (u * sum_t |gh|) and of the value itself (u * |value|). Errors of a few
u of the term sum and far more than a few u of the value: the rounding of the terms, not a defect."""
import functools
import sys

import torch

from mhctool.families import FAMILIES, generate, get_family
from mhctool.runner.call import cast_inputs, native_at, run_impl, run_reference, upstream_for
from mhctool.analyses import scenario
from mhctool.registry.specs import resolve_one
from mhctool.core.shapes import parse_shape

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
shape = parse_shape(sys.argv[2] if len(sys.argv) > 2 else "9x2x2x40")
family = sys.argv[3] if len(sys.argv) > 3 else "random"
kernel = "mix_aggregate"
seed = next(c.seed for c in scenario.resolve(None).cases(device) if c.kernel == kernel)
fam = get_family(kernel)
_, raw = generate(kernel, family, shape, seed, {}, draw_on=device)
base = cast_inputs(fam, raw, "fp32", device)
native = run_impl(fam, native_at(kernel, "ieee"), base, {},
                         lambda outs: upstream_for(fam, outs, seed))
upstream = upstream_for(fam, native.outputs, seed)
triton = run_impl(fam, resolve_one(kernel, "triton", "triton"), base, {}, lambda outs: upstream)
_, ref_grads = run_reference(fam, base, {}, upstream)

# the terms: the logit gradient of the float64 reference, traced as the registry's term scale does
seen = {}
args = {k: (v.detach().double().requires_grad_(k in fam.differentiable) if v is not None and v.is_floating_point()
            else v) for k, v in base.items()}
traced = functools.partial(FAMILIES[kernel].reference, trace=lambda name, t: seen.setdefault(name, t))
outs = fam.call(traced, args, {}, lambda k: True)
(gh,) = torch.autograd.grad(outs, [seen["h"]], [u.double() for u in upstream][:len(outs)])
terms = gh.abs().sum(0)
u = 2.0 ** -24
want = ref_grads["h_bias"]
print(f"{kernel} {family} {shape} fp32 on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})")
print(" j  value        sum|terms|   torch err (u*terms, u*|v|)   triton err (u*terms, u*|v|)")
for j in range(want.numel()):
    v, t = float(want[j]), float(terms[j])
    e_n = abs(float(native.grads["h_bias"][j]) - v)
    e_t = abs(float(triton.grads["h_bias"][j]) - v)
    print(f"{j:2d} {v:+.4e}  {t:.4e}   {e_n:.2e} ({e_n / (u * t):5.2f}, {e_n / (u * abs(v)):6.2f})"
          f"   {e_t:.2e} ({e_t / (u * t):5.2f}, {e_t / (u * abs(v)):6.2f})")
