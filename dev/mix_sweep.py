"""Triton mix_aggregate backward at the paper shape (bf16): AGG_STAGES 2 against 3 in paired rounds
(events, median of 10 a round).  python3 dev/mix_sweep.py"""
import sys, torch
sys.path.insert(0, ".")
from kernels.triton import proj_rms as pr, mix_aggregate as mx
s,b,n,c=8192,4,4,7168
g=torch.Generator(device="cuda").manual_seed(0)
x=torch.randn(s,b,n,c,device="cuda",generator=g).bfloat16().requires_grad_()
w=(torch.randn(24,n*c,device="cuda",generator=g)/(n*c)**.5).bfloat16().requires_grad_()
a=torch.tensor([0.8,1.1,0.9],device="cuda",requires_grad=True); hb=(0.1*torch.randn(24,device="cuda")).requires_grad_()
outs=mx.mix_aggregate(x,w,a,hb)
ups=[torch.randn_like(o) for o in outs]
def bwd(): torch.autograd.grad(outs,[x,w,a,hb],ups,retain_graph=True)
def timed(fn,reps=10):
    fn(); torch.cuda.synchronize(); ts=[]
    for _ in range(reps):
        e0,e1=torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)
        e0.record(); fn(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return sorted(ts)[len(ts)//2]
res={}
for r in range(5):
    for st in ([2,3] if r%2==0 else [3,2]):
        pr.AGG_STAGES=st
        res.setdefault(st,[]).append(timed(bwd))
for st,ts in res.items(): print("AGG_STAGES",st,"median ms",sorted(ts)[len(ts)//2],flush=True)
