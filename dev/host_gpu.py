"""Where the host's time goes issuing the fused module path on a GPU (cProfile of 10 calls after 3)."""
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from step_profile import _inputs  # noqa: E402
from mhctool.analyses.train import module_path  # noqa: E402

backend = sys.argv[1] if len(sys.argv) > 1 else "triton"
ops = module_path.ops(module_path.pieces("impl", backend, {}, "cuda")[0])
x, w, a, hb, bias = _inputs(4096, 1, 4, 2048)


def one(k):
    agg, h_res, h_post = ops["pre_path"](x, w, a, hb)
    out = ops["post_path"](h_res, x, h_post, agg * 1.0, bias, 0.1, 1234, 4294967000 + k * (1 << 20))
    torch.autograd.backward(out, torch.ones_like(out))


for k in range(3):
    one(k)
torch.cuda.synchronize()
p = cProfile.Profile()
p.runcall(lambda: [one(k) for k in range(10)])
pstats.Stats(p).sort_stats("tottime").print_stats(30)
