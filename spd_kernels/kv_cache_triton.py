"""truncate_kv_ on Triton (see spd_kernels.kv_cache)."""
from __future__ import annotations

from spd_kernels import dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, tl, triton
from spd_kernels.kv_cache import _kernel_supports, _layout, _pointer_table

if HAS_TRITON:

    @triton.jit
    def _lengths_kernel(len_ptr, new_ptr, new_stride, C, BLOCK_C: tl.constexpr):
        offs = tl.arange(0, BLOCK_C)
        mask = offs < C
        old = tl.load(len_ptr + offs, mask=mask, other=0)
        new = tl.maximum(tl.load(new_ptr + offs * new_stride, mask=mask, other=0), 0)
        tl.store(len_ptr + offs, tl.minimum(old, new), mask=mask)

    @triton.jit
    def _poison_kernel(len_ptr, new_ptr, new_stride, table_ptr, OUTER, S, INNER,
                       CODE: tl.constexpr, BLOCK: tl.constexpr):
        """Program (c, b * OUTER + o): NaN rows [new, old) of slice o of cache c of buffer b
        (a contiguous span of (old - new) * INNER elements)."""
        c = tl.program_id(0).to(tl.int64)
        bo = tl.program_id(1)
        b = bo // OUTER
        o = bo % OUTER
        old = tl.minimum(tl.load(len_ptr + c), S)  # never past the buffer, checked or not
        new = tl.minimum(tl.maximum(tl.load(new_ptr + c * new_stride), 0), old)
        addr = tl.load(table_ptr + b)
        if CODE == 1:
            base = addr.to(tl.pointer_type(tl.bfloat16))
        elif CODE == 2:
            base = addr.to(tl.pointer_type(tl.float16))
        else:
            base = addr.to(tl.pointer_type(tl.float32))
        base += ((c * OUTER + o) * S) * INNER
        end = old * INNER
        for start in range(new * INNER, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(base + offs, float("nan"), mask=offs < end)


@dispatch.register("truncate_kv", "triton", supports=_kernel_supports)
def truncate_kv_triton(lengths, new_lengths, buffers, seq_dim, poison):
    new_lengths = new_lengths.contiguous()
    C = lengths.shape[0]
    new_stride = 1 if new_lengths.dim() == 1 else 0
    if C == 0:
        return lengths
    if poison and buffers:
        outer, S, inner = _layout(buffers[0], seq_dim)
        block = min(next_pow2(max(inner, 1) * 8), 1024 if not INTERPRET else 4096)
        _poison_kernel[(C, len(buffers) * outer)](
            lengths, new_lengths, new_stride, _pointer_table(buffers), outer, S, inner,
            CODE=dtype_code(buffers[0].dtype), BLOCK=block)
    _lengths_kernel[(1,)](lengths, new_lengths, new_stride, C, BLOCK_C=next_pow2(C))
    return lengths
