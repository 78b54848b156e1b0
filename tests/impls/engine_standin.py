"""A stand-in for an engine (``mhctool train --engine FILE.py:train``), written from Megatron-core's
public structure, none of its code: a small GPT whose layers carry hyper-connection modules with
Megatron's four entry points (``_proj_rms_op``, ``_sinkhorn_op``, ``_h_aggregate_op``,
``_h_post_bda_op``, called as Megatron calls them), PR 3828's native conventions (the row max
subtracted, the sums clamped at eps, H_res x), and the block's exit averaging the streams. Its
"fused" switch (``recipe.fused``) computes the same functions in another order;
``recipe.hyper_connections=False`` is the same GPT with plain residual adds (bench's baseline). It
trains on the CPU in fp32 with SGD and gradient clipping, micro-batches accumulated, and reports
what the engine interface asks: the golden-value metrics and each parameter's exact zeros, and
from ``recipe.time_entry_from`` on the time inside the entry points (mhctool's EntryTimer)."""
import contextlib
import math
import time

import torch
from torch import nn

from mhctool.core.entry_timing import EntryTimer


def _proj_rms(x2d, weight, eps=1e-6):
    proj = x2d @ weight.t()
    r = 1.0 / (x2d.norm(dim=-1, keepdim=True) / math.sqrt(x2d.shape[-1]) + eps)
    return proj, r


def _sinkhorn(logits, iters, eps=1e-6):
    m = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True).clamp(min=eps)
        m = m / m.sum(-2, keepdim=True).clamp(min=eps)
    return m


def _sinkhorn_fused(logits, iters, eps=1e-6):  # the same function, reciprocals multiplied
    m = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(iters):
        m = m * (1.0 / m.sum(-1, keepdim=True).clamp(min=eps))
        m = m * (1.0 / m.sum(-2, keepdim=True).clamp(min=eps))
    return m


def _h_aggregate(x, h_pre):
    return (x * h_pre.unsqueeze(-1)).sum(dim=2)


def _h_post_bda(h_res, residual, h_post, x, bias=None):
    y = x if bias is None else x + bias
    return torch.einsum("sbij,sbjc->sbic", h_res, residual) + h_post.unsqueeze(-1) * y.unsqueeze(2)


class HyperConnection(nn.Module):
    def __init__(self, n, hidden, iters, fused):
        super().__init__()
        self.n, self.iters, self.norm_eps = n, iters, 1e-6
        self.mapping_proj = nn.Linear(n * hidden, n * n + 2 * n, bias=False)
        nn.init.xavier_uniform_(self.mapping_proj.weight)
        self.alpha_pre, self.alpha_post, self.alpha_res = (nn.Parameter(torch.full((1,), 0.01)) for _ in range(3))
        self.bias = nn.Parameter(torch.zeros(n * n + 2 * n))
        self._proj_rms_op, self._h_aggregate_op, self._h_post_bda_op = _proj_rms, _h_aggregate, _h_post_bda
        self._sinkhorn_op = _sinkhorn_fused if fused else _sinkhorn

    def forward(self, streams, sublayer):
        s, b, n, c = streams.shape
        proj, r = self._proj_rms_op(streams.reshape(s * b, n * c), self.mapping_proj.weight, self.norm_eps)
        alpha = torch.cat([self.alpha_pre.expand(n), self.alpha_post.expand(n), self.alpha_res.expand(n * n)])
        h = (r * proj * alpha + self.bias).view(s, b, -1)
        h_pre, h_post = h[..., :n].sigmoid(), 2 * h[..., n:2 * n].sigmoid()
        h_res = self._sinkhorn_op(h[..., 2 * n:].reshape(s, b, n, n), self.iters, self.norm_eps)
        y = sublayer(self._h_aggregate_op(streams, h_pre))
        return self._h_post_bda_op(h_res, streams, h_post, y, None)


class Layer(nn.Module):
    def __init__(self, r):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(r.hidden), nn.LayerNorm(r.hidden)
        self.attn = nn.MultiheadAttention(r.hidden, r.heads, batch_first=False)
        self.mlp = nn.Sequential(nn.Linear(r.hidden, 4 * r.hidden), nn.GELU(), nn.Linear(4 * r.hidden, r.hidden))
        hc = getattr(r, "hyper_connections", True)
        plain = lambda x, sublayer: x + sublayer(x[:, :, 0]).unsqueeze(2)  # noqa: E731 - one stream, a residual add
        self.self_attention_hyper_connection = HyperConnection(r.streams, r.hidden, r.sinkhorn_iters, r.fused) \
            if hc else plain
        self.mlp_hyper_connection = HyperConnection(r.streams, r.hidden, r.sinkhorn_iters, r.fused) if hc else plain

    def forward(self, streams):
        s = streams.shape[0]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)

        def attend(x):
            x = self.attn_norm(x).reshape(s, -1, x.shape[-1])
            return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0].reshape(s, -1, x.shape[-1])
        streams = self.self_attention_hyper_connection(streams, attend)
        return self.mlp_hyper_connection(streams, lambda x: self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, r):
        super().__init__()
        self.streams = r.streams if getattr(r, "hyper_connections", True) else 1
        self.embedding = nn.Embedding(r.vocab, r.hidden)
        self.layers = nn.ModuleList(Layer(r) for _ in range(r.layers))
        self.final_norm = nn.LayerNorm(r.hidden)

    def forward(self, tokens):  # tokens [s, b]
        x = self.embedding(tokens)
        streams = x.unsqueeze(2).expand(*x.shape[:2], self.streams, x.shape[-1]).contiguous()
        for layer in self.layers:
            streams = layer(streams)
        return self.final_norm(streams.mean(dim=2)) @ self.embedding.weight.t()  # the block's exit, tied head


def train(tree, recipe, progress, ops):
    torch.manual_seed(recipe.seed)
    model = GPT(recipe)
    for m in model.modules():
        if isinstance(m, HyperConnection):
            for family, op in ops.items():
                setattr(m, f"_{family}_op", op)
            if recipe.sinkhorn_eps is not None:
                m.norm_eps = recipe.sinkhorn_eps
    params = list(model.parameters())  # updated by hand: torch.optim's first optimizer imports dynamo (1.7 s)
    calls = {f: 0 for f in ("proj_rms", "sinkhorn", "h_aggregate", "h_post_bda")}
    for m in model.modules():
        if isinstance(m, HyperConnection):
            for family in calls:
                op = getattr(m, f"_{family}_op")
                setattr(m, f"_{family}_op", lambda *a, _op=op, _f=family, **k: (calls.__setitem__(_f, calls[_f] + 1),
                                                                                 _op(*a, **k))[1])
    timer = EntryTimer(cuda=False) if getattr(recipe, "time_entry_from", 0) else None
    if timer is not None:
        for m in model.modules():
            if isinstance(m, HyperConnection):
                for family in calls:
                    setattr(m, f"_{family}_op", timer.wrap(family, getattr(m, f"_{family}_op")))
    names = {id(p): n for n, p in model.named_parameters()}
    micro = max(1, recipe.global_batch // recipe.micro_batch)
    for step in range(1, recipe.steps + 1):
        timed = timer is not None and step >= recipe.time_entry_from
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        total, profiled = 0.0, timer.profiling() if timed else contextlib.nullcontext()
        with profiled:
            for k in range(micro):
                g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step * 1009 + k)
                t = torch.randint(0, recipe.vocab, (recipe.seq + 1, recipe.micro_batch), generator=g)
                loss = nn.functional.cross_entropy(model(t[:-1]).flatten(0, 1), t[1:].flatten()) / micro
                loss.backward()
                total += float(loss.detach())
            read_from = time.perf_counter()
        reading = time.perf_counter() - read_from  # the profile's reading: not the step's
        zeros = {}
        for p in model.parameters():
            name = names[id(p)]
            zeros[name] = int(p.grad.numel() - torch.count_nonzero(p.grad))
            if name.endswith("mapping_proj.weight"):
                n = recipe.streams
                for part, rows in (("h_pre", p.grad[:n]), ("h_post", p.grad[n:2 * n]), ("h_res", p.grad[2 * n:])):
                    zeros[f"{name}:{part}"] = int((rows == 0).sum())
        with torch.no_grad():  # clipped at the total norm, then SGD with decoupled weight decay
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
            scale = min(1.0, recipe.clip_grad / (float(norm) + 1e-6))
            for p in params:
                p.mul_(1 - recipe.lr * recipe.weight_decay).add_(p.grad, alpha=-recipe.lr * scale)
        rec = {"entry_ms": timer.step_end()} if timed else {}
        progress({**rec, "step": step, "lm loss": total, "grad-norm": float(norm), "num-zeros": float(sum(
            v for k, v in zeros.items() if ":" not in k)), "iteration-time": time.perf_counter() - t0 - reading,
            "params": sum(p.numel() for p in model.parameters()), "fused": bool(recipe.fused), "dtype": "fp32", "calls": dict(calls),
            "zeros": {k: v for k, v in zeros.items() if v}})


def train_marked(tree, recipe, progress, ops):
    """:func:`train`, touching ``$MHCTOOL_TEST_MARKER`` as a run with hyper-connections starts (the
    signal tests send theirs then)."""
    import os
    import pathlib
    if getattr(recipe, "hyper_connections", True) and os.environ.get("MHCTOOL_TEST_MARKER"):
        pathlib.Path(os.environ["MHCTOOL_TEST_MARKER"]).touch()
    return train(tree, recipe, progress, ops)
