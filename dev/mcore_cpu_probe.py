"""What Megatron-core (staged unchanged by ``../shared/anchors/stage.sh megatron-core GIT_DIR``)
allows on a CPU build of PyTorch, the ground work of issue 77's ``--engine megatron:DIR``:

    python dev/mcore_cpu_probe.py .anchors/megatron-core/m3828 [--model] [--recompute]

Without ``--model``: its HyperConnectionModule alone (one layer's mapping, Sinkhorn and aggregate),
forward and backward, with each parameter's count of exact-zero gradient entries. With
``--model``: its GPTModel on the local layer spec with hyper-connections, over a one-rank gloo
group, a forward and backward (``--recompute``: the recipe's mHC recompute too). A CPU build has
no NVTX, which the module marks its ranges with unconditionally: those two functions are made
no-ops here (nothing of Megatron's is changed). Needs einops (pip install einops).
"""
from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", help="a staged megatron-core generation (its folder holds megatron/core)")
    ap.add_argument("--model", action="store_true")
    ap.add_argument("--recompute", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    import torch
    import torch.cuda.nvtx as nvtx
    nvtx.range_push = lambda *args, **kw: 0
    nvtx.range_pop = lambda *args, **kw: 0
    from megatron.core.transformer.transformer_config import TransformerConfig
    extra = dict(recompute_granularity="selective", recompute_modules=["mhc"], mhc_recompute_layer_num=2) \
        if a.recompute else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            enable_hyper_connections=True, num_residual_streams=4, **extra)
    if not a.model:
        from megatron.core.transformer.hyper_connection import HyperConnectionModule
        hc = HyperConnectionModule(cfg, layer_number=1)
        x = torch.randn(16, 2, 4 * 64, requires_grad=True)
        out = hc(x)
        print("module forward:", [tuple(t.shape) for t in out])
        sum(t.float().square().mean() for t in out).backward()
        for name, p in hc.named_parameters():
            print(f"  {name} {tuple(p.shape)}: {int((p.grad == 0).sum())} zero gradient entries")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    parallel_state.initialize_model_parallel(1, 1)
    model = GPTModel(cfg, get_gpt_layer_local_spec(enable_hyper_connection=True), vocab_size=128, max_sequence_length=32)
    print("model built:", sum(p.numel() for p in model.parameters()), "parameters")
    tokens = torch.randint(0, 128, (2, 32))
    position = torch.arange(32).unsqueeze(0).expand(2, -1)
    mask = torch.tril(torch.ones(32, 32, dtype=torch.bool)).logical_not().view(1, 1, 32, 32)
    try:
        loss = model(tokens, position, mask, labels=tokens)
        loss.float().mean().backward()
        print("model forward and backward: ok")
    except Exception as e:  # noqa: BLE001 - what stops it on a CPU is the finding
        import traceback
        where = [f for f in traceback.extract_tb(e.__traceback__) if "megatron" in f.filename][-1:]
        print(f"model stops: {type(e).__name__}: {str(e).splitlines()[0]}"
              + (f" (at {where[0].filename.split('megatron/')[-1]}:{where[0].lineno})" if where else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
