"""cache_attention on csrc/kernels/attention.cu (on request: see spd_kernels.on_request).

bf16 / fp16, head_dim 64 or 128: block (kv head, key split, up to 64 pairs), 32-key tiles through
shared memory (the next tile's loads in flight), scores on tensor cores with the q and K pieces as
fragments as loaded, online softmax a warp per pair, P V in fp32 FMAs; the same split-and-merge
plan as the Triton kernel's.
"""
from __future__ import annotations

import torch

from spd_kernels import _alloc, _cuda, dispatch
from spd_kernels._host import dtype_code
from spd_kernels.attention import attention_layout, attention_output, key_splits
from spd_kernels.cache_positions import start_tensor

CUDA_ATTENTION_TILE = 32             # keys per tile (kTile in attention.cu)
CUDA_ATTENTION_PAIRS = 64            # (row, query head) pairs per block (kMaxPairs)
CUDA_ATTENTION_HEAD_DIMS = (64, 128)  # the kernel's instantiations


def _attention_cuda_supports(q, k_cache, v_cache, start, scale):
    hd = q.shape[2]
    if k_cache.dtype not in (torch.bfloat16, torch.float16):
        return (f"the CUDA kernel runs bf16 / fp16 caches (scores on tensor cores), got "
                f"{k_cache.dtype} (the Triton kernel takes fp32)")
    if hd not in CUDA_ATTENTION_HEAD_DIMS:
        return f"the CUDA kernel is built for head_dim 64 or 128, got {hd}"
    return attention_layout(q, k_cache, v_cache, pieces16=True)


def attention_cuda_plan(kv_heads: int, pairs: int, S: int, device,
                        splits: int | None = None) -> tuple[int, int]:
    """(splits, keys per split) of the CUDA kernel over the cache capacity S (not the position,
    so one graph serves every position): about four blocks per SM when the cache is full, each
    split a whole number of 32-key tiles."""
    if splits is None:
        blocks_z = -(-pairs // CUDA_ATTENTION_PAIRS)
        splits = round(4 * _cuda.multiprocessors(device) / (kv_heads * blocks_z))
    return key_splits(S, CUDA_ATTENTION_TILE, splits)


def attention_cuda_launch(q, k_cache, v_cache, start, scale, *, splits: int | None = None):
    """The CUDA cache attention (see cache_attention); `splits` forces the key split."""
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    out = attention_output(q, k_cache)
    if R == 0:
        return out
    start = start_tensor(start, q.device)
    group = H // kvh
    n_splits, chunk = attention_cuda_plan(kvh, R * group, S, q.device, splits)
    ws = (_alloc.empty(kvh * n_splits * R * group * (hd + 2), dtype=torch.float32,
                       device=q.device) if n_splits > 1 else None)
    scale = hd ** -0.5 if scale is None else scale
    _cuda.ext().cache_attention(
        q, q.stride(0), q.stride(1), k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), start, out, out.stride(0),
        ws, H, R, kvh, S, hd, n_splits, chunk,
        float(scale) * 1.4426950408889634, dtype_code(k_cache.dtype), _cuda.stream_of(q))
    return out


@dispatch.register("cache_attention", "cuda", supports=_attention_cuda_supports,
                   automatic=False)
def cache_attention_cuda(q, k_cache, v_cache, start, scale):
    return attention_cuda_launch(q, k_cache, v_cache, start, scale)
