"""Triton mix_aggregate backward at the paper shape (bf16): variants of the projection backward's
tile (LOWP_TILE) and AGG_STAGES in paired rounds (events, median of 10 a round).
    python3 dev/mix_sweep.py ["[((bm, bk, split, warps, stages), agg_stages[, {FLAG: value}]), ...]"]
(FLAG: a proj_rms module flag, or "module.FLAG" of another kernels.triton module)
    python3 dev/mix_sweep.py graph ["[...]"]
(the same variants, each captured as a CUDA graph with its flags set, the replays timed: what
the bench times, without the eager launches' host overhead)
(default: the shipped tile at AGG_STAGES 2 and 3)
    python3 dev/mix_sweep.py profile
(each backward's launches under torch.profiler: device time per kernel, five backwards each)
    python3 dev/mix_sweep.py cutile ["[(bm, bk, splits), ((bm, bk, splits), {MODULE_FLAG: value}), ...]"]
(cuTile's mix_aggregate backward beside Triton's, at cuTile's AGG_TILE or the tiles given, each
with proj_rms module flags set, e.g. {"BC_SUM": 512}, or another cuTile module's, e.g.
{"h_aggregate.BT_BWD": 4}, or "schedule.SIDE_STREAM" (both backends' Sinkhorn backward beside the
aggregation's): a flag stays set for the variants after; dx of each against the first variant's;
"graph cutile [...]" replays each captured)
Ordering the projection backward's programs so that the n over the same channels of the n
streams run side by side (GROUP_STREAMS) read as nothing in eager rounds on an H200 (twenty-second
session); in graph replay on an H100 it took Triton's backward from 2.52 to 2.37 ms and cuTile's
from 2.462 to 2.454 (dev/perf-notes.md, thirty-first session))"""
import ast, importlib, sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1])); sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_sweep import paired_rounds  # noqa: E402 - one form of the paired rounds and their timing
from kernels.triton import proj_rms as pr, mix_aggregate as mx
s,b,n,c=8192,4,4,7168
g=torch.Generator(device="cuda").manual_seed(0)
x=torch.randn(s,b,n,c,device="cuda",generator=g).bfloat16().requires_grad_()
w=(torch.randn(24,n*c,device="cuda",generator=g)/(n*c)**.5).bfloat16().requires_grad_()
a=torch.tensor([0.8,1.1,0.9],device="cuda",requires_grad=True); hb=(0.1*torch.randn(24,device="cuda")).requires_grad_()
def _module(backend,mod):  # a flag's module: "schedule" (shared), else one of the backend's
    return importlib.import_module("kernels.schedule" if mod=="schedule" else f"kernels.{backend}.{mod}")
graph=sys.argv[1:2]==["graph"]  # each variant's backward captured as a CUDA graph (flags set at capture), replays timed
if graph:  # autograd runs a backward op on its forward's stream; the default one cannot join a capture
    fs=torch.cuda.Stream(); fs.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(fs): outs=mx.mix_aggregate(x,w,a,hb)
    torch.cuda.current_stream().wait_stream(fs)
else:
    outs=mx.mix_aggregate(x,w,a,hb)
ups=[torch.randn_like(o) for o in outs]
def bwd(): torch.autograd.grad(outs,[x,w,a,hb],ups,retain_graph=True)
if sys.argv[1:] == ["profile"]:
    from torch.profiler import ProfilerActivity, profile
    from kernels.cutile import mix_aggregate as cmx
    couts=cmx.mix_aggregate(x,w,a,hb)
    def cbwd(): torch.autograd.grad(couts,[x,w,a,hb],ups,retain_graph=True)
    for name,fn in (("triton",bwd),("cutile",cbwd)):
        fn(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): fn()
            torch.cuda.synchronize()
        print(f"--- {name}: device us per backward, by kernel", flush=True)
        rows=[(e.device_time_total/5,e.count//5,e.key) for e in prof.key_averages() if e.device_time_total>0]
        for us,cnt,key in sorted(rows,reverse=True)[:12]: print(f"  {us:9.1f} us  x{cnt}  {key[:90]}",flush=True)
        print(f"  total {sum(r[0] for r in rows):.1f} us",flush=True)
    sys.exit(0)
rest=sys.argv[2:] if graph else sys.argv[1:]
if rest[:1] == ["cutile"]:
    from kernels.cutile import mix_aggregate as cmx, proj_rms as cpr
    if graph:  # the forward on the side stream, as Triton's above
        with torch.cuda.stream(fs): couts=cmx.mix_aggregate(x,w,a,hb)
        torch.cuda.current_stream().wait_stream(fs)
    else:
        couts=cmx.mix_aggregate(x,w,a,hb)
    def cbwd(v):
        tile,flags=(v if isinstance(v[0],tuple) else (v,{}))
        def run():
            cpr.AGG_TILE=tuple(tile)
            for key,val in flags.items():  # proj_rms's, or "module.FLAG" of another kernels.cutile module
                mod,_,name=key.rpartition(".")
                setattr(_module("cutile",mod) if mod else cpr,name,val)
            return torch.autograd.grad(couts,[x,w,a,hb],ups,retain_graph=True)
        return run
    cvs=ast.literal_eval(rest[1]) if len(rest)>1 else [cpr.AGG_TILE]
    ref=None
    bwd()  # the autograd thread's CUDA context first: a cuTile launch there before any other failed
    for v in cvs:  # each variant's gradients against the first's (max abs difference, bits equal or not)
        try:
            gs=cbwd(v)()
            if ref is None: ref=gs
            print("cutile",v,"max |d| against the first:",[float((g-r).abs().max()) for g,r in zip(gs,ref)],
                  "equal:",all(torch.equal(g,r) for g,r in zip(gs,ref)),flush=True)
        except Exception as ex:  # noqa: BLE001
            print("cutile",v,"failed:",type(ex).__name__,str(ex).splitlines()[0][:160],flush=True)
    variants={"triton":bwd,**{f"cutile {v}":cbwd(v) for v in cvs}}
else:
    def tile(v):
        def run():
            pr.LOWP_TILE,pr.AGG_STAGES=tuple(v[0]),v[1]
            for key,val in (v[2] if len(v)>2 else {}).items():  # e.g. {"PACK_M": 64}, {"h_aggregate.REV": True}
                mod,_,name=key.rpartition(".")
                setattr(_module("triton",mod) if mod else pr,name,val)
            bwd()
        return run
    vs=ast.literal_eval(rest[0]) if rest else [(pr.LOWP_TILE,2),(pr.LOWP_TILE,3)]
    variants={f"tile, AGG_STAGES {v}":tile(v) for v in vs}
if graph:
    from mhctool.analyses.timing import graphed
    def _try_graph(k,fn):  # a variant that fails to compile is a line, not the end
        try: return graphed(fn)
        except Exception as ex:  # noqa: BLE001
            print(k,"failed:",type(ex).__name__,str(ex).splitlines()[0][:160],flush=True)
    variants={k:g for k,g in ((k,_try_graph(k,fn)) for k,fn in variants.items()) if g is not None}
ok={}
for v,fn in variants.items():  # compile each first: a variant that fails to compile is a line, not the end
    try:
        fn(); torch.cuda.synchronize(); ok[v]=fn
    except Exception as ex:  # noqa: BLE001 - tileiras 13.4 died of SIGFPE (return code -8) on one cuTile tile
        print(v,"failed:",type(ex).__name__,str(ex).splitlines()[0][:160],flush=True)
for v,ts in paired_rounds(ok,5).items(): print(v,"median ms",sorted(ts)[len(ts)//2],flush=True)
