"""The math both stand-in layouts compute (float32 inside, as the library's kernels do)."""
import torch


def sinkhorn(x, repeat, eps):
    n = x.shape[-1]
    assert n & (n - 1) == 0, f"XOR-butterfly AllReduce requires a positive power of two, got {n}"
    p = x.float().softmax(-1) + eps
    p = p / (p.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


def apply_mix(x, mix):  # x [T, n, C] bf16, mix [T, n] fp32
    assert x.dtype == torch.bfloat16, f"{x.dtype=}"
    return (x.float() * mix.unsqueeze(-1)).sum(-2).bfloat16()


def post(x, residual, post_mix, comb):  # [.., C], [.., n, C], [.., n, 1], [.., n, n]
    assert x.dtype == torch.bfloat16 and residual.dtype == torch.bfloat16
    assert residual.shape[-1] % 128 == 0, "h_blk % 128 == 0"
    mixed = torch.einsum("...mn,...mc->...nc", comb.float(), residual.float())
    return (x.float().unsqueeze(-2) * post_mix + mixed).bfloat16()


def norm(out_mul, sqrsum, hidden, eps):  # [T, n3], [T] -> mixes [T, n3]
    return out_mul * torch.rsqrt(sqrsum / hidden + eps).unsqueeze(-1)


def split(mixes, scale, base, n, post_mult, pre_eps):
    cols = torch.cat([scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)])
    h = mixes * cols + base
    return torch.sigmoid(h[:, :n]) + pre_eps, torch.sigmoid(h[:, n:2 * n]) * post_mult, h[:, 2 * n:]


def grads(fn, inputs, grad_outputs):
    """The backward of ``fn`` at ``inputs`` (a kernel's backward, in the stand-in computed by autograd)."""
    leaves = [t.detach().float().requires_grad_(True) if t is not None else None for t in inputs]
    with torch.enable_grad():
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None]
        got = torch.autograd.grad([o.float() for o, _ in pairs], [t for t in leaves if t is not None],
                                  [g.float() for _, g in pairs], allow_unused=True)
    it = iter(got)
    return [next(it) if t is not None else None for t in leaves]
