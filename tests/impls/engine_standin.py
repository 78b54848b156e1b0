"""A stand-in for an engine (``mhctool train --engine FILE.py:train``), written from Megatron-core's
public structure, none of its code: a small GPT whose layers carry hyper-connection modules shaped
as Megatron's ``HyperConnectionModule`` (its four entry points ``_proj_rms_op``, ``_sinkhorn_op``,
``_h_aggregate_op``, ``_h_post_bda_op``, called as Megatron calls them; ``forward`` the pre-path,
returning the aggregated input, H_res and H_post; ``fused_h_res_h_post_bda`` the post-path, which
with dropout on runs the H_res product, H_post applied to the sublayer's output and to its bias, and
the bias-dropout-add one after the other, as Megatron's unfused path does; ``input_expand`` and
``output_contract`` at the block's ends), PR 3828's native conventions (the row max subtracted, the
sums clamped at eps, H_res x). Its "fused" switch (``recipe.fused``) computes the same functions in
another order; ``recipe.hyper_connections=False`` is the same GPT with plain residual adds (bench's
baseline). ``ops`` may replace the entry points, or the whole module (``pre_path`` and
``post_path``, mhctool's module path; the dropout's key drawn from torch's random state as the call
starts). It has no recompute. It trains on the CPU in fp32 with SGD and gradient clipping,
micro-batches accumulated, and reports what the engine interface asks: the golden-value metrics
and each parameter's exact zeros, and from ``recipe.time_entry_from`` on the time inside the entry
points and the module's ops (mhctool's EntryTimer)."""
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
        self.n, self.hidden_size, self.iters, self.norm_eps = n, hidden, iters, 1e-6
        self.mapping_proj = nn.Linear(n * hidden, n * n + 2 * n, bias=False)
        nn.init.xavier_uniform_(self.mapping_proj.weight)
        self.alpha_pre, self.alpha_post, self.alpha_res = (nn.Parameter(torch.full((1,), 0.01)) for _ in range(3))
        self.bias = nn.Parameter(torch.zeros(n * n + 2 * n))
        self._proj_rms_op, self._h_aggregate_op, self._h_post_bda_op = _proj_rms, _h_aggregate, _h_post_bda
        self._sinkhorn_op = _sinkhorn_fused if fused else _sinkhorn
        self._bda = get_bias_dropout_add  # where Megatron imports its own

    def _compute_h(self, proj, r):
        n = self.n
        alpha = torch.cat([self.alpha_pre.expand(n), self.alpha_post.expand(n), self.alpha_res.expand(n * n)])
        h = r * proj * alpha + self.bias
        return h[..., :n].sigmoid(), 2 * h[..., n:2 * n].sigmoid(), h[..., 2 * n:]

    def forward(self, hidden_states):
        """The pre-path: ``[s, b, n*C]`` -> (the aggregated ``[s, b, C]``, H_res, H_post)."""
        s, b, _ = hidden_states.shape
        n, c = self.n, self.hidden_size
        proj, r = self._proj_rms_op(hidden_states.reshape(s * b, n * c), self.mapping_proj.weight, self.norm_eps)
        h_pre, h_post, logits = self._compute_h(proj, r)
        h_res = self._sinkhorn_op(logits.reshape(s, b, n, n), self.iters, self.norm_eps)
        agg = self._h_aggregate_op(hidden_states.view(s, b, n, c), h_pre.view(s, b, n))
        return agg, h_res, h_post.view(s, b, n)

    def apply_h_res(self, h_res, residual):
        s, b, _ = residual.shape
        return torch.bmm(h_res.reshape(s * b, self.n, self.n), residual.view(s * b, self.n, -1)).view(s, b, -1)

    def _apply_h_post(self, x, h_post):
        s, b, n = h_post.shape
        x = x.view(1, 1, 1, -1) if x.dim() == 1 else x.unsqueeze(2)
        return (h_post.unsqueeze(-1) * x).reshape(s, b, -1)

    def fused_h_res_h_post_bda(self, h_res, residual, h_post, layer_output_with_bias, dropout_prob, training, fused):
        """The post-path: the entry point without dropout, Megatron's unfused ops with it."""
        x, bias = layer_output_with_bias
        s, b, _ = residual.shape
        if dropout_prob == 0.0 or not training:
            return self._h_post_bda_op(h_res, residual.view(s, b, self.n, -1), h_post, x, bias).view(s, b, -1)
        mixed = self.apply_h_res(h_res, residual)
        x_exp = self._apply_h_post(x, h_post)
        b_exp = self._apply_h_post(bias, h_post) if bias is not None else None
        return self._bda(training, fused)((x_exp, b_exp), mixed, dropout_prob)

    @staticmethod
    def input_expand(x, n):
        s, b, c = x.shape
        return x.unsqueeze(2).expand(s, b, n, c).contiguous().view(s, b, n * c)

    @staticmethod
    def output_contract(x, n):
        s, b, nc = x.shape
        return x.view(s, b, n, nc // n).mean(dim=2)


def get_bias_dropout_add(training, fused):
    """Megatron's bias-dropout-add: ``residual + dropout(x + bias)`` (torch's dropout)."""
    def bda(x_with_bias, residual, prob):
        x, bias = x_with_bias
        return residual + nn.functional.dropout(x if bias is None else x + bias, p=prob, training=training)
    return bda


class Layer(nn.Module):
    def __init__(self, r):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(r.hidden), nn.LayerNorm(r.hidden)
        # the sublayers' last biases apart, as Megatron's linear layers return them for the bias-dropout-add
        self.attn = nn.MultiheadAttention(r.hidden, r.heads, batch_first=False, bias=False)
        self.attn_bias = nn.Parameter(torch.zeros(r.hidden))
        self.mlp = nn.Sequential(nn.Linear(r.hidden, 4 * r.hidden), nn.GELU(), nn.Linear(4 * r.hidden, r.hidden,
                                                                                         bias=False))
        self.mlp_bias = nn.Parameter(torch.zeros(r.hidden))
        self.hc = getattr(r, "hyper_connections", True)
        self.dropout = getattr(r, "hidden_dropout", 0.0)
        if self.hc:
            self.self_attention_hyper_connection = HyperConnection(r.streams, r.hidden, r.sinkhorn_iters, r.fused)
            self.mlp_hyper_connection = HyperConnection(r.streams, r.hidden, r.sinkhorn_iters, r.fused)

    def _sub(self, hidden, module, sublayer):
        """One sublayer with its hyper-connection (or, without them, a residual add with dropout)."""
        if not self.hc:
            y, bias = sublayer(hidden)
            return get_bias_dropout_add(self.training, False)((y, bias), hidden, self.dropout)
        x, h_res, h_post = module(hidden)
        return module.fused_h_res_h_post_bda(h_res, hidden, h_post, sublayer(x), self.dropout, self.training, False)

    def forward(self, hidden):
        s = hidden.shape[0]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)

        def attend(x):
            x = self.attn_norm(x)
            return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0], self.attn_bias
        hidden = self._sub(hidden, getattr(self, "self_attention_hyper_connection", None), attend)
        return self._sub(hidden, getattr(self, "mlp_hyper_connection", None),
                         lambda x: (self.mlp(self.mlp_norm(x)), self.mlp_bias))


class GPT(nn.Module):
    def __init__(self, r):
        super().__init__()
        self.streams = r.streams if getattr(r, "hyper_connections", True) else 1
        self.embedding = nn.Embedding(r.vocab, r.hidden)
        self.layers = nn.ModuleList(Layer(r) for _ in range(r.layers))
        self.final_norm = nn.LayerNorm(r.hidden)
        self.expand, self.contract = HyperConnection.input_expand, HyperConnection.output_contract

    def forward(self, tokens):  # tokens [s, b]
        x = self.embedding(tokens)
        hidden = self.expand(x, self.streams) if self.streams > 1 else x
        for layer in self.layers:
            hidden = layer(hidden)
        if self.streams > 1:
            hidden = self.contract(hidden, self.streams)
        return self.final_norm(hidden) @ self.embedding.weight.t()  # the block's exit, tied head


def _module_paths(m, ops):
    """``m`` computed by mhctool's module path: its forward by ``pre_path``, its post-path by
    ``post_path``, the dropout's key drawn from torch's random state as the call starts."""
    def pre(hidden_states):
        s, b, _ = hidden_states.shape
        alpha = torch.cat([m.alpha_pre, m.alpha_post, m.alpha_res])
        return ops["pre_path"](hidden_states.view(s, b, m.n, m.hidden_size), m.mapping_proj.weight, alpha, m.bias)

    def post(h_res, residual, h_post, layer_output_with_bias, dropout_prob, training, fused):
        x, bias = layer_output_with_bias
        s, b, _ = residual.shape
        p = dropout_prob if training else 0.0
        seed = int(torch.randint(0, 2**62, ())) if p else 0
        out = ops["post_path"](h_res, residual.view(s, b, m.n, m.hidden_size), h_post, x, bias, p, seed, 0)
        return out.reshape(s, b, -1)
    m.forward, m.fused_h_res_h_post_bda = pre, post


# the module's ops bench --engine times beside its entry points (the names of mhctool's step table)
MODULE_OPS = {"_compute_h": "compute_h", "apply_h_res": "h_res_product",
              "_apply_h_post": lambda x, *a, **k: "h_post_bias" if x.dim() == 1 else "h_post_y",
              "forward": "pre_path", "fused_h_res_h_post_bda": "post_path"}


def _timed(model, timer, families):
    """The entry points and the module's ops wrapped by mhctool's EntryTimer, as Megatron's are."""
    for m in model.modules():
        if isinstance(m, HyperConnection):
            for attr, name in {**{f"_{f}_op": f for f in families}, **MODULE_OPS}.items():
                setattr(m, attr, timer.wrap(name, getattr(m, attr)))
            m._bda = lambda *a, _get=m._bda: timer.wrap("dropout_add", _get(*a))
    model.expand, model.contract = timer.wrap("expand", model.expand), timer.wrap("contract", model.contract)


def train(tree, recipe, progress, ops):
    torch.manual_seed(recipe.seed)
    model = GPT(recipe)
    for m in model.modules():
        if isinstance(m, HyperConnection):
            for family, op in ops.items():
                if family not in ("pre_path", "post_path"):
                    setattr(m, f"_{family}_op", op)
            if "pre_path" in ops:
                _module_paths(m, ops)
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
        _timed(model, timer, calls)
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
