"""A small mHC language model: what ``mhctool train`` trains with each implementation.

Written like the references: plain PyTorch, each line the formula it implements. The mHC pieces
are not called directly. Every layer calls them through ``ops``, with the families' signatures
(``mapping(x2d, weight, alpha, h_bias)``, ``sinkhorn(logits)``, ``h_aggregate(x, h_pre)``,
``h_post_bda(h_res, x, h_post, y, bias)``), so the same model runs an implementation under test,
the native one, or the float64 reference. Everything else (embedding, attention, MLP, norms,
head) is ordinary PyTorch and the same in every run.

One layer (DESIGN.md, the mHC layer)::

    h_pre, h_post, logits = mapping(x.flatten(n, C), phi, alpha, h_bias)
    h_res = sinkhorn(logits)
    y = F(h_aggregate(x, h_pre))            # F: causal self-attention, then an MLP
    x = h_post_bda(h_res, x, h_post, y, b)  # sum_j H_res[i, j] x[j] + H_post[i] (y + b)

The token embedding is expanded to n streams, the streams are contracted (averaged) after the
last layer, then a final RMSNorm and the LM head. Parameters are fp32; activations run at the
dtype asked for, the mapping path in fp32 (the families' contract).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .mhc import contract, expand


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    layers: int = 4
    streams: int = 4  # n
    hidden: int = 32  # C
    heads: int = 2
    ffn: int = 128
    seq: int = 16
    # initial logits of H_res: this much on the diagonal, plus seeded noise of this size everywhere
    # (H_res starts near identity, and not symmetric: H and H^T mix the streams differently); and
    # noise of this size on H_pre's and H_post's logits, so that the streams part from the first
    # layer on and are read unequally (the embedding is copied into every stream, and equal streams,
    # averaged, mix alike under any doubly stochastic H and its transpose)
    res_diagonal: float = 3.0
    res_noise: float = 1.0
    gate_noise: float = 1.0
    # the mHC paper's gating factor: alpha's initial value (Megatron's --mhc-init-gating-factor)
    gating: float = 0.01


class LayerOps(Protocol):
    """The mHC pieces one layer calls (one layer's; an implementation may record what it saw)."""

    def mapping(self, x2d, weight, alpha, h_bias): ...
    def sinkhorn(self, logits): ...
    def h_aggregate(self, x, h_pre): ...
    def h_post_bda(self, h_res, x, h_post, y, bias): ...
    # a whole-module variant's: the pre-path in one call, where ``whole`` is true
    whole: bool
    def pre_path(self, x, weight, alpha, h_bias): ...


class Ops(Protocol):
    def layer(self, index: int) -> LayerOps: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / rms(x) * weight``, computed in fp32, returned at ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` at ``x``'s dtype (fp32 parameters cast, as autocast does)."""
    return x @ weight.to(x.dtype).t()


class Layer(nn.Module):
    """One mHC layer: the mapping's parameters, and the sublayer F (attention, then an MLP)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        n, c = cfg.streams, cfg.hidden
        self.cfg, self.index = cfg, index
        # the mapping: phi [n^2 + 2n, n C], alpha [3], h_bias [n^2 + 2n] ordered [pre | post | res]
        self.phi = nn.Parameter(torch.randn(n * n + 2 * n, n * c) / math.sqrt(n * c))
        self.alpha = nn.Parameter(torch.full((3,), cfg.gating))
        # H_pre = sigmoid(h_pre): about 1/n each (the mean of the streams), unequal
        pre = -math.log(n - 1) + cfg.gate_noise * torch.randn(n)
        post = cfg.gate_noise * torch.randn(n)  # H_post = 2 sigmoid(h_post): about 1 each, unequal
        res = (cfg.res_diagonal * torch.eye(n) + cfg.res_noise * torch.randn(n, n)).flatten()
        self.h_bias = nn.Parameter(torch.cat([pre, post, res]))
        # F: pre-norm causal self-attention, then a pre-norm MLP; its output bias is h_post_bda's
        depth = 1.0 / math.sqrt(2 * cfg.layers)
        self.attn_norm = nn.Parameter(torch.ones(c))
        self.qkv = nn.Parameter(torch.randn(3 * c, c) / math.sqrt(c))
        self.proj = nn.Parameter(torch.randn(c, c) / math.sqrt(c) * depth)
        self.mlp_norm = nn.Parameter(torch.ones(c))
        self.fc1 = nn.Parameter(torch.randn(cfg.ffn, c) / math.sqrt(c))
        self.fc2 = nn.Parameter(torch.randn(c, cfg.ffn) / math.sqrt(cfg.ffn) * depth)
        self.bias = nn.Parameter(torch.zeros(c))

    def sublayer(self, y: torch.Tensor) -> torch.Tensor:
        """``F(y)`` for ``y[s, b, C]``: the attention's and the MLP's outputs (no residual of its
        own: the streams carry it)."""
        s, b, c = y.shape
        h = self.cfg.heads
        q, k, v = linear(rms_norm(y, self.attn_norm), self.qkv).split(c, dim=-1)
        heads = [t.reshape(s, b, h, c // h).permute(1, 2, 0, 3) for t in (q, k, v)]  # [b, h, s, d]
        att = F.scaled_dot_product_attention(*heads, is_causal=True)
        a = linear(att.permute(2, 0, 1, 3).reshape(s, b, c), self.proj)
        m = linear(F.gelu(linear(rms_norm(y + a, self.mlp_norm), self.fc1)), self.fc2)
        return a + m

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        s, b, n, c = x.shape
        if getattr(ops, "whole", False):  # the pre-path in one call: the layer's input, H_post, H_res
            agg, h_post, h_res = ops.pre_path(x, self.phi.to(x.dtype), self.alpha, self.h_bias)[:3]
            return ops.h_post_bda(h_res, x, h_post, self.sublayer(agg), self.bias.to(x.dtype))
        h_pre, h_post, logits = ops.mapping(x.reshape(s * b, n * c), self.phi.to(x.dtype), self.alpha,
                                            self.h_bias)[:3]
        h_res = ops.sinkhorn(logits.reshape(s, b, n, n))
        y = self.sublayer(ops.h_aggregate(x, h_pre.reshape(s, b, n)))
        return ops.h_post_bda(h_res, x, h_post.reshape(s, b, n), y, self.bias.to(x.dtype))


class MHCLanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.randn(cfg.vocab, cfg.hidden) * 0.5)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden))
        self.head = nn.Parameter(torch.randn(cfg.vocab, cfg.hidden) / math.sqrt(cfg.hidden))

    def forward(self, tokens: torch.Tensor, ops: Ops, dtype: torch.dtype) -> torch.Tensor:
        """Logits ``[s, b, vocab]`` (fp32) for ``tokens[s, b]``, activations at ``dtype``."""
        x = expand(self.embed[tokens].to(dtype), self.cfg.streams)  # [s, b, n, C]
        for i, layer in enumerate(self.layers):
            x = layer(x, ops.layer(i))
        return linear(rms_norm(contract(x), self.final_norm), self.head).float()

    def loss(self, tokens: torch.Tensor, ops: Ops, dtype: torch.dtype) -> torch.Tensor:
        """Next-token cross entropy over ``tokens[s + 1, b]``."""
        logits = self(tokens[:-1], ops, dtype)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[1:].reshape(-1))
