"""Counter-based uniforms: a sampled decode's draws as a pure function of (key, offset).

A sampled sequence's cycle draws D uniforms (spd.runtime.cycle: the draft's, then the
verifier's). Drawn from a generator, each sequence's draw is a launch of its own and a CUDA
graph must register every generator it advances. Drawn from a counter, they are Philox4x32-10
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) of
  key     the request's seed (its 64 bits as an int64), and
  offset  the draw's index in the decode: cycle * D + j for its j-th uniform of a cycle,
so one program writes every sequence's draws inside the op that lays out the cycle
(spd_kernels.control.cycle_open, spd_kernels.tree_control.tree_open), a graph replays them with
no generator state, and a sequence draws the same alone as in any batch.

The stream is Triton's `tl.rand(key, offset)`: the counter (offset's low and high 32 bits, 0,
0), the key (seed's low and high 32 bits), ten rounds, the first output word read as an int32 x
and mapped to [0, 1) as (x < 0 ? -x - 1 : x) * 4.6566127342e-10 in float32. `philox_uniform`
is its PyTorch reference, bit for bit, in int64 arithmetic that never overflows.
"""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # the round multipliers
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85      # the key's increments (Weyl sequence)
ROUNDS = 10
SCALE = 4.6566127342e-10                    # the largest s with (2**31 - 1) * s < 1 in float32


def _mulhilo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * x (a: a 32-bit constant, x int64 in [0, 2**32)): in
    16-bit halves of x, so that no product exceeds 2**49."""
    p_lo, p_hi = (x & 0xFFFF) * a, (x >> 16) * a
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (t >> 32), t & M32


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS):
    """Philox4x32 of counter (c0, c1, c2, c3) and key (k0, k1): int64 tensors (broadcast
    together) holding 32-bit words -> the four output words, int64 in [0, 2**32)."""
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & M32, (k1 + KEY_B) & M32
    return c0, c1, c2, c3


def philox_words(key: torch.Tensor, offset: torch.Tensor):
    """Triton's tl.randint4x(key, offset): Philox of counter (offset's low and high 32 bits, 0,
    0) and key (key's low and high 32 bits); key and offset int64 tensors that broadcast
    together -> the four words, int64 in [0, 2**32)."""
    zero = torch.zeros_like(offset)
    return philox4x32(offset & M32, (offset >> 32) & M32, zero, zero, key & M32,
                      (key >> 32) & M32)


def to_uniform(word: torch.Tensor) -> torch.Tensor:
    """A 32-bit word (int64) as Triton's uniform_float maps it: float32 in [0, 1)."""
    x = torch.where(word >= 2**31, word - 2**32, word)  # the word as an int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(SCALE, dtype=torch.float32, device=x.device)


def philox_uniform(key: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """key [B] int64, offset [B, D] int64 -> [B, D] float32 uniforms in [0, 1): Triton's
    tl.rand(key[b], offset[b, j]) (module docstring)."""
    return to_uniform(philox_words(key.view(-1, 1), offset)[0])


def seed_key(seed: int) -> int:
    """A request's seed in [0, 2**64) as the int64 with its bits (the key)."""
    return seed - 2**64 if seed >= 2**63 else seed


__all__ = ["philox4x32", "philox_uniform", "philox_words", "seed_key", "to_uniform"]
