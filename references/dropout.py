"""The dropout mask of the mHC post-path, as the contract draws it: counter-based, so that a
kernel, its recompute, its backward, every tensor-parallel rank and this reference draw the very
same mask from the same key, whatever the launch grid.

The generator is Philox-4x32-10 (Salmon et al., SC'11; Random123's and Triton's ``tl.philox``),
keyed by a 64-bit seed (low word first) and counted by a 64-bit counter in its first two words
(the last two zero). One counter gives four 32-bit words, which cover four consecutive channels.
Element ``(t, i, c)`` of an ``[T, n, C]`` tensor (token, stream, channel) takes

- counter ``offset + (t * n + i) * ceil(C / 4) + c // 4`` (each row of C channels starts its own
  counter, so the mask of a row does not depend on C's divisibility),
- word ``c % 4`` of that counter's output,

and is kept where the word is at least ``threshold(p) = floor(p * 2**32)``, so a kept element's
chance is ``1 - p`` to within ``2**-32``. Kept elements are scaled by ``1 / (1 - p)``.

The words are computed here in int64 arithmetic (the 32 x 32-bit products split into 16-bit
halves, so nothing overflows), on the tensors' device, in slices of counters.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # the key's increments per round (Weyl sequence)
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # the round multipliers
ROUNDS = 10
WORDS = 4  # channels per counter
_M32 = 0xFFFFFFFF
_SLICE = 1 << 22  # counters per slice (a few int64 temporaries of 32 MiB each)


def _mul(const: int, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``const * a`` for a 32-bit constant and 32-bit words ``a`` (int64 tensor): (high, low) words."""
    c_hi, c_lo = const >> 16, const & 0xFFFF
    lo_part = a * c_lo  # < 2**48
    hi_part = a * c_hi  # < 2**48
    high = (hi_part + (lo_part >> 16)) >> 16
    low = (((hi_part & 0xFFFF) << 16) + lo_part) & _M32
    return high, low


def philox(seed: int, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four 32-bit words (int64 tensors) Philox-4x32-10 gives at 64-bit ``counter`` (int64
    tensor of values in [0, 2**63)) under the 64-bit ``seed``."""
    c0, c1 = counter & _M32, (counter >> 32) & _M32
    c2 = c3 = torch.zeros_like(counter)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(ROUNDS):
        hi_b, lo_b = _mul(ROUND_B, c2)
        hi_a, lo_a = _mul(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & _M32, (k1 + KEY_B) & _M32
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The smallest word kept at drop probability ``p`` (``0 <= p < 1``)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    return int(p * 2.0**32)


def counters_per_row(c: int) -> int:
    return -(-c // WORDS)


def counters_used(tokens: int, n: int, c: int) -> int:
    """How many counters a mask over ``[tokens, n, c]`` takes (the next draw starts past them)."""
    return tokens * n * counters_per_row(c)


def keep(shape: tuple[int, int, int], p: float, seed: int, offset: int, device="cpu") -> torch.Tensor:
    """The contract's keep mask over ``shape = (T, n, C)`` (bool): True where kept."""
    t, n, c = shape
    thr = threshold(p)
    if thr == 0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    g = counters_per_row(c)
    rows = t * n
    out = torch.empty((rows, g * WORDS), dtype=torch.bool, device=device)
    step = max(1, _SLICE // max(1, g))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        ctr = offset + torch.arange(r0 * g, r1 * g, dtype=torch.int64, device=device)
        words = torch.stack(philox(seed, ctr), dim=-1)  # [(r1 - r0) * g, 4]
        out[r0:r1] = (words >= thr).view(r1 - r0, g * WORDS)
    return out[:, :c].reshape(shape)


def scale(p: float) -> float:
    return 1.0 / (1.0 - p)


class Key(NamedTuple):
    """What a kernel needs to draw the mask of rows of ``c`` channels (``threshold`` 0: no dropout)."""
    seed: int
    offset: int
    counters_per_row: int
    threshold: int
    scale: float


def key(c: int, p: float, seed: int, offset: int) -> Key:
    """The mask's key for a kernel, checked: ``seed`` in [0, 2**63) and ``offset`` in [0, 2**62)
    (so a counter stays below 2**63)."""
    thr = threshold(p)
    if not thr:
        return Key(0, 0, 0, 0, 1.0)
    if not (0 <= seed < 2**63 and 0 <= offset < 2**62):
        raise ValueError(f"h_post_bda: dropout_seed must be in [0, 2**63) and dropout_offset in [0, 2**62); "
                         f"got {seed}, {offset}")
    return Key(int(seed), int(offset), counters_per_row(c), thr, scale(p))


def apply(post: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """``post`` ([T, n, C] or any shape of that many elements, rows of C last) dropped by the
    contract's mask and scaled, in ``post``'s dtype; ``post`` itself when ``p`` is 0."""
    if not p:
        return post
    c = post.shape[-1]
    rows = post.numel() // c
    kept = keep((rows, 1, c), p, seed, offset, device=post.device).view(post.shape)
    return post * kept.to(post.dtype) * scale(p)
