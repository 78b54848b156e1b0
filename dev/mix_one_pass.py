"""mix_aggregate's one-launch backward (kernels/triton/mix_backward.py) at the paper shape (bf16):
how it ran (one launch or the two phases, the compiled kernel's registers and shared memory), its
counters and flags, and its gradients against the two-pass backward's.
    python3 dev/mix_one_pass.py [profile]
Timing: dev/mix_sweep.py graph with {"mix_backward.ONE_PASS": False} / {"mix_backward.LAG": L}."""
import sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.triton import mix_aggregate as mx, mix_backward as mb
s, b, n, c = 8192, 4, 4, 7168
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(s, b, n, c, device="cuda", generator=g).bfloat16().requires_grad_()
w = (torch.randn(24, n * c, device="cuda", generator=g) / (n * c) ** .5).bfloat16().requires_grad_()
a = torch.tensor([0.8, 1.1, 0.9], device="cuda", requires_grad=True)
hb = (0.1 * torch.randn(24, device="cuda", generator=g)).requires_grad_()
outs = mx.mix_aggregate(x, w, a, hb)
ups = [torch.randn_like(o) for o in outs]
def grads(): return torch.autograd.grad(outs, [x, w, a, hb], ups, retain_graph=True)
one = grads(); torch.cuda.synchronize()
print("launches", mb.LAST["launches"], "lost flag", int(mb.LAST["lost"]), flush=True)
print("compiled kernel:", mb.LAST.get("resources"), flush=True)
print("run to run equal:", all(torch.equal(p, q) for p, q in zip(one, grads())), flush=True)
mb.ONE_PASS = False
two = grads(); mb.ONE_PASS = True
for name, p, q in zip(("dx", "dW", "d_alpha", "d_bias"), one, two):
    d = (p.double() - q.double()).abs()
    print(f"{name}: max |one - two| {float(d.max()):.3e} (scale {float(q.abs().max()):.3e}), "
          f"finite {bool(torch.isfinite(p).all())}", flush=True)
if sys.argv[1:2] == ["profile"]:  # device time per kernel: one launch, then the phases apart
    from torch.profiler import ProfilerActivity, profile
    for apart in (False, True):
        mb.APART = apart
        grads(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3): grads()
            torch.cuda.synchronize()
        print(f"--- apart={apart}: device us per backward, by kernel", flush=True)
        rows = [(e.device_time_total / 3, e.count // 3, e.key) for e in prof.key_averages() if e.device_time_total > 0]
        for us, cnt, key in sorted(rows, reverse=True)[:8]: print(f"  {us:9.1f} us  x{cnt}  {key[:90]}", flush=True)
if sys.argv[1:2] == ["phases"]:  # each launch's device time, one launch and apart, at several CHUNK
    import statistics
    for chunk, stagger in ((4, 0), (4, 1), (16, 1), (16, 5), (512, 1), (512, 7)):
        for apart in (False, True):
            mb.CHUNK, mb.APART, mb.STAGGER = chunk, apart, stagger
            grads(); torch.cuda.synchronize()
            mb.TIMED = []
            for _ in range(5): grads()
            torch.cuda.synchronize()
            per = {}
            for phase, (e0, e1) in mb.TIMED: per.setdefault(phase, []).append(e0.elapsed_time(e1))
            mb.TIMED = None
            print(f"CHUNK {chunk} STAGGER {stagger} apart {apart}: " + ", ".join(f"phase {p} {statistics.median(v):.3f} ms" for p, v in per.items()), flush=True)
