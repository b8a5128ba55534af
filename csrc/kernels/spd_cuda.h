// C++ interface of the spd_kernels CUDA kernels: raw device pointers, a cudaStream_t passed as
// void*, plain integers. No torch, no pybind11 here; every function returns a cudaError_t value
// (0 = success) so the bindings can turn it into a Python exception.
#pragma once
#include <cstdint>

namespace spd {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

int device_count(int* count);
// The CUDA device kernels launch on from this thread (cudaGetDevice).
int current_device(int* device);
const char* error_name(int err);
const char* error_string(int err);
int runtime_version();

// Programmatic dependent launch for every kernel launched after this call (process-wide; off by
// default). Returns the previous setting. common.cuh's SPD_LAUNCH reads it.
bool set_programmatic_launch(bool on);
bool programmatic_launch();

// Greedy verification: fused RMSNorm + LM-head GEMV + argmax (+ compare), logits never stored.
// Pass 1 writes per-vocabulary-block maxima to pval/pidx [R, verify_greedy_num_blocks(V)],
// pass 2 reduces them and writes target [R] (int64) and accepted [R] (bool).
int verify_greedy_num_blocks(int V);
int verify_greedy(const void* hidden, int64_t stride_h, const void* norm_weight, const void* weight,
                  int64_t stride_w, const void* draft, bool draft_i64, float* pval, int* pidx,
                  int64_t* target, bool* accepted, int R, int D, int V, float eps,
                  float norm_offset, int dtype, void* stream);

// KV truncation: lengths[c] = min(lengths[c], max(new_lengths[c * new_stride], 0)).
int kv_truncate(int64_t* lengths, const int64_t* new_lengths, int new_stride, int C, void* stream);
// Debug poison, run before kv_truncate: NaN rows [new, old) of every buffer. table: device array
// of n_buffers addresses, each buffer contiguous [C, outer, S, inner].
int kv_poison(const int64_t* lengths, const int64_t* new_lengths, int new_stride,
              const int64_t* table, int n_buffers, int C, int64_t outer, int64_t S, int64_t inner,
              int dtype, void* stream);

// Anchor concat-projection: out[r] = sum_{j<=e(r)} W_e[:, j*D:(j+1)*D] a[j, r] + b_e.
// table: device int64 [2, M]: weight addresses then bias addresses per type (0 = none).
int anchor_projection(const void* anchors, int64_t stride_am, int64_t stride_ar, const void* types,
                      bool types_i64, const int64_t* table, void* out, int64_t stride_or, int M,
                      int R, int D, int N, int dtype, bool vectorized, void* stream);

// The same on tensor cores (bf16 / f16, D % 8 == 0, 16-byte aligned anchors and weights): work
// items (type, K split of k_per columns, a multiple of 32), anchor_projection_items(M, D, k_per)
// of them (-1: too many); ws holds items * R * N fp32 partial sums.
int anchor_projection_items(int M, int D, int k_per);
int anchor_projection_mma(const void* anchors, int64_t stride_am, int64_t stride_ar,
                          const void* types, bool types_i64, const int64_t* table, void* out,
                          int64_t stride_or, float* ws, int M, int R, int D, int N, int k_per,
                          int dtype, void* stream);

// Rejection sampling, one block per row. x: logits (from_logits; p = softmax(x / T) with top-k /
// top-p, T = 0 greedy) or probabilities p [R, V]; q [R, Vq] with t2d [V] (target id -> q column or
// -1), or q on target ids when t2d is null; u [R, 2] fp32 uniforms, or null for Philox(seed[0],
// offset[0] + r). Writes out_tok [R] (int64) and out_acc [R] (bool).
int rejection_sample(const void* x, int64_t stride_x, int x_dtype, const void* q,
                     int64_t stride_q, int q_dtype, const int* t2d, const void* tok, bool tok_i64,
                     const float* u, int64_t stride_u, const int64_t* seed, const int64_t* offset,
                     int64_t* out_tok, bool* out_acc, int R, int V, float temperature, int top_k,
                     float top_p, bool from_logits, void* stream);

// Linear layers over R <= 16 rows on tensor cores (bf16 / f16), K % 8 == 0, 16-byte aligned rows:
// out [R, N] = epilogue(rms_norm(x) @ w0^T, rms_norm(x) @ w1^T) with SwiGLU when w1 is given and
// + residual when given. norm_weight (or null): xn [R, K] receives the normed rows. K is cut into
// `splits` ranges of k_per columns (a multiple of 32); with splits > 1, ws holds
// splits * (w1 ? 2 : 1) * R * N fp32 partial sums.
// One mma.m16n8k16 on one warp with fragments filled by the PTX ISA's layout (a check of it):
// c [16, 8] fp32 = a [16, 16] @ b [8, 16]^T, bf16 or f16 inputs.
int mma_selftest(const void* a, const void* b, float* c, int dtype, void* stream);
// The per-head step of qkv_rope_append after the products: qp [rows, H * HD], kp and vp
// [rows, KVH * HD] (row strides given) -> per-head RMSNorm of q and k (when q_norm / k_norm are
// given, both or neither), RoPE from the tables cos / sin [P, HD] (row stride stride_cs) at
// position *start + row, q to q_out [H, rows, HD], k and v into the caches [KVH, S, HD] (rows past
// S dropped). bf16 / f16, HD even and at most 256.
int rope_append(const void* qp, int64_t stride_qp, const void* kp, int64_t stride_kp,
                const void* vp, int64_t stride_vp, const void* q_norm, const void* k_norm,
                const void* cos, const void* sin, int64_t stride_cs, const int64_t* start,
                void* q_out, void* k_cache, void* v_cache, int rows, int H, int KVH, int S, int P,
                int HD, float eps, int dtype, void* stream);
// Attention of R rows (query heads H, q [H, R, HD] with strides (stride_qh, stride_qr, 1)) against
// KV caches [KVH, S, HD] (strides (stride_ch, stride_cs, 1)), row r seeing keys 0 .. *start + r;
// out [R, H * HD] (row stride stride_or). bf16 / f16, HD 64 or 128, 16-byte aligned rows. The keys
// are cut into `splits` ranges of `chunk` (a multiple of 32); with splits > 1, ws holds
// KVH * splits * R * (H / KVH) * (HD + 2) fp32. scale_log2 = softmax scale * log2(e).
int cache_attention(const void* q, int64_t stride_qh, int64_t stride_qr, const void* k,
                    const void* v, int64_t stride_ch, int64_t stride_cs, const int64_t* start,
                    void* out, int64_t stride_or, float* ws, int H, int R, int KVH, int S, int HD,
                    int splits, int chunk, float scale_log2, int dtype, void* stream);
int fused_linear(const void* x, int64_t stride_x, const void* norm_weight, void* xn,
                 const void* w0, const void* w1, const void* residual, int64_t stride_res,
                 void* out, int64_t stride_out, float* ws, int R, int N, int K, int splits,
                 int k_per, float eps, int dtype, void* stream);

#ifdef SPD_SIMT_HOST
namespace simt {
// Known-answer kernels of the host emulation (simt_host.cpp): 0 = warp collectives and a block
// barrier, 64 threads writing out[9 * 64]; 1 = a deadlock (must return cudaErrorLaunchFailure);
// 2 = a thread ending without pdl_wait() (must return cudaErrorNotPermitted).
int selftest(int which, int* out);
// The emulated device's multiprocessor count (3 unless set; cudaDevAttrMultiProcessorCount reads
// it), so launch plans sized for a large GPU can run in the emulation; returns the previous one.
int set_multiprocessors(int n);
}  // namespace simt
#endif

}  // namespace spd
