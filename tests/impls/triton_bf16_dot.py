"""A correct proj_rms whose forward multiplies bf16 tiles with ``tl.dot`` as shipped GPU kernels do
(no upcast for the interpreter's sake): the stand-in for a user's plain file that mhctool must judge
right on a CPU, where Triton's interpreter computes bf16 ``tl.dot`` wrong unless mhctool mends it.
Its backward is plain PyTorch (what is tested here is the forward's product)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _proj_fwd(x_ptr, w_ptr, proj_ptr, r_ptr, M, N, K, eps,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    sq = tl.zeros((BM,), tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc += tl.dot(x, w)  # the operands' own dtype: bf16 tiles on tensor cores
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    r = 1.0 / (tl.sqrt(sq / K) + eps)
    tl.store(proj_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))
    tl.store(r_ptr + rows, r, mask=rows < M)


class _ProjRms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        m, k = x2d.shape
        n = weight.shape[0]
        proj = torch.empty(m, n, dtype=torch.float32, device=x2d.device)
        r = torch.empty(m, dtype=torch.float32, device=x2d.device)
        _proj_fwd[(triton.cdiv(m, 16),)](x2d.contiguous(), weight.contiguous(), proj, r, m, n, k, eps,
                                         BM=16, BN=triton.next_power_of_2(max(n, 16)), BK=32)
        ctx.save_for_backward(x2d, weight)
        ctx.eps = eps
        return proj, r

    @staticmethod
    def backward(ctx, g_proj, g_r):
        x2d, weight = ctx.saved_tensors
        with torch.enable_grad():
            x = x2d.detach().float().requires_grad_()
            w = weight.detach().float().requires_grad_()
            proj = x @ w.t()
            r = 1.0 / (x.norm(dim=-1) / x.shape[-1] ** 0.5 + ctx.eps)
            gx, gw = torch.autograd.grad((proj, r), (x, w), (g_proj, g_r))
        return gx.to(x2d.dtype), gw.to(weight.dtype), None


def proj_rms(x2d, weight, eps=1e-6):
    return _ProjRms.apply(x2d, weight, eps)
