// pybind11 bindings of the spd_kernels CUDA kernels (module spd_kernels._spd_cuda).
//
// Every tensor argument is a raw device address (Python int, e.g. tensor.data_ptr()) and the
// stream is a raw cudaStream_t (torch.cuda.current_stream().cuda_stream), so this module does not
// depend on torch's C++ API or ABI. Shapes, dtypes and value ranges are checked in Python
// (spd_kernels/*.py), and again here before any launch (checks.h: a wrong stride, dimension or
// dtype code is a ValueError naming the argument, not an out-of-bounds access); a missing device
// or a CUDA error becomes a RuntimeError naming it.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "checks.h"
#include "spd_cuda.h"

// The same bindings build two modules: _spd_cuda (the kernels compiled by nvcc) and _spd_simt
// (the same kernel sources compiled for the host emulation in simt_host.h, for tests).
#ifndef SPD_MODULE
#define SPD_MODULE _spd_cuda
#endif
#define SPD_STR2(x) #x
#define SPD_STR(x) SPD_STR2(x)
#define SPD_MODULE_NAME "spd_kernels." SPD_STR(SPD_MODULE)
// The name checks.h puts in its messages.
#define SPD_BINDING(fn) static constexpr const char* SPD_FN = SPD_MODULE_NAME "." fn

namespace py = pybind11;

namespace {

std::string describe(int err) {
  return std::string(spd::error_name(err)) + ": " + spd::error_string(err);
}

void check(int err, const char* what) {
  if (err != 0)
    throw std::runtime_error(std::string(SPD_MODULE_NAME ".") + what + " failed: " + describe(err));
}

int device_count() {
  int n = 0;
  const int err = spd::device_count(&n);
  if (err != 0)
    throw std::runtime_error(SPD_MODULE_NAME ": no usable CUDA device (cudaGetDeviceCount: " +
                             describe(err) + ")");
  if (n == 0) throw std::runtime_error(SPD_MODULE_NAME ": no usable CUDA device (none found)");
  return n;
}

void require_device() {
  static bool ok = false;  // one successful query is enough for the process
  if (!ok) {
    device_count();
    ok = true;
  }
}

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

}  // namespace

PYBIND11_MODULE(SPD_MODULE, m) {
  m.doc() = "CUDA kernels of spd_kernels (raw device pointers, no torch C++ API)";
#ifdef SPD_SIMT_HOST
  m.attr("host_emulation") = true;  // kernels run as fibers on the CPU, on host addresses
  m.def(
      "selftest",
      [](int which, uintptr_t out) {
        check(spd::simt::selftest(which, ptr<int>(out)), "selftest");
      },
      py::arg("which"), py::arg("out"),
      "known-answer kernels of the emulation: 0 warp collectives, 1 a deadlock, 2 a thread "
      "that skips pdl_wait()");
  m.def("set_multiprocessors", &spd::simt::set_multiprocessors, py::arg("n"),
        "the emulated device's multiprocessor count, which launch plans read (n >= 1); returns "
        "the previous one");
#else
  m.attr("host_emulation") = false;
#endif
  m.def("device_count", &device_count, "number of CUDA devices; raises when none is usable");
  m.def("runtime_version", &spd::runtime_version, "CUDA runtime version compiled in");
  m.def("verify_greedy_num_blocks", &spd::verify_greedy_num_blocks, py::arg("V"));
  m.def("set_programmatic_launch", &spd::set_programmatic_launch, py::arg("on"),
        "programmatic dependent launch for the kernels launched from now on (sm_90+); returns "
        "the previous setting");
  m.def("programmatic_launch", &spd::programmatic_launch,
        "whether kernels are launched as programmatic dependent launches");

  m.def(
      "verify_greedy",
      [](uintptr_t hidden, int64_t stride_h, uintptr_t norm_weight, uintptr_t weight,
         int64_t stride_w, uintptr_t draft, bool draft_i64, uintptr_t pval, uintptr_t pidx,
         uintptr_t target, uintptr_t accepted, int R, int D, int V, float eps, int dtype,
         uintptr_t stream) {
        require_device();
        SPD_BINDING("verify_greedy");
        if (R > 0) {  // R == 0 launches nothing
          SPD_CHECK_GE(D, 1, "a row of hidden");
          SPD_CHECK_GE(V, 1, "rows of weight");
          SPD_CHECK_DTYPE(dtype, 0, 2);
          if (R > 1) SPD_CHECK_GE(stride_h, D, "D: rows of hidden must not overlap");
          if (V > 1) SPD_CHECK_GE(stride_w, D, "D: rows of weight must not overlap");
          SPD_CHECK_PTR(hidden); SPD_CHECK_PTR(norm_weight); SPD_CHECK_PTR(weight);
          SPD_CHECK_PTR(draft); SPD_CHECK_PTR(pval); SPD_CHECK_PTR(pidx);
          SPD_CHECK_PTR(target); SPD_CHECK_PTR(accepted);
        }
        check(spd::verify_greedy(ptr<const void>(hidden), stride_h, ptr<const void>(norm_weight),
                                 ptr<const void>(weight), stride_w, ptr<const void>(draft),
                                 draft_i64, ptr<float>(pval), ptr<int>(pidx), ptr<int64_t>(target),
                                 ptr<bool>(accepted), R, D, V, eps, dtype, ptr<void>(stream)),
              "verify_greedy");
      },
      py::arg("hidden"), py::arg("stride_h"), py::arg("norm_weight"), py::arg("weight"),
      py::arg("stride_w"), py::arg("draft"), py::arg("draft_i64"), py::arg("pval"),
      py::arg("pidx"), py::arg("target"), py::arg("accepted"), py::arg("R"), py::arg("D"),
      py::arg("V"), py::arg("eps"), py::arg("dtype"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "rejection_sample",
      [](uintptr_t x, int64_t stride_x, int x_dtype, uintptr_t q, int64_t stride_q, int q_dtype,
         uintptr_t t2d, uintptr_t tok, bool tok_i64, uintptr_t u, int64_t stride_u,
         uintptr_t seed, uintptr_t offset, uintptr_t out_tok, uintptr_t out_acc, int R, int V,
         float temperature, int top_k, float top_p, bool from_logits, uintptr_t stream) {
        require_device();
        SPD_BINDING("rejection_sample");
        if (R > 0) {
          SPD_CHECK_GE(V, 1, "a row of x");
          SPD_CHECK_DTYPE(x_dtype, 0, 2);
          SPD_CHECK_DTYPE(q_dtype, 0, 2);
          if (R > 1) SPD_CHECK_GE(stride_x, V, "V: rows of x must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_q, 1, "rows of q");
          SPD_CHECK_PTR(x); SPD_CHECK_PTR(q); SPD_CHECK_PTR(tok);
          SPD_CHECK_PTR(out_tok); SPD_CHECK_PTR(out_acc);
          if (u != 0) {
            if (R > 1) SPD_CHECK_GE(stride_u, 2, "two uniforms per row of u");
          } else {
            SPD_CHECK(seed != 0 && offset != 0,
                      "seed, offset: expected both buffers when u is null, got seed=", seed,
                      " offset=", offset);
          }
          SPD_CHECK_GE(top_k, 0, "0 is no top-k");
        }
        check(spd::rejection_sample(ptr<const void>(x), stride_x, x_dtype, ptr<const void>(q),
                                    stride_q, q_dtype, ptr<const int>(t2d), ptr<const void>(tok),
                                    tok_i64, ptr<const float>(u), stride_u,
                                    ptr<const int64_t>(seed), ptr<const int64_t>(offset),
                                    ptr<int64_t>(out_tok), ptr<bool>(out_acc), R, V, temperature,
                                    top_k, top_p, from_logits, ptr<void>(stream)),
              "rejection_sample");
      },
      py::arg("x"), py::arg("stride_x"), py::arg("x_dtype"), py::arg("q"), py::arg("stride_q"),
      py::arg("q_dtype"), py::arg("t2d"), py::arg("tok"), py::arg("tok_i64"), py::arg("u"),
      py::arg("stride_u"), py::arg("seed"), py::arg("offset"), py::arg("out_tok"),
      py::arg("out_acc"), py::arg("R"), py::arg("V"), py::arg("temperature"), py::arg("top_k"),
      py::arg("top_p"), py::arg("from_logits"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "mma_selftest",
      [](uintptr_t a, uintptr_t b, uintptr_t c, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("mma_selftest");
        SPD_CHECK_DTYPE(dtype, 1, 2);
        SPD_CHECK_PTR(a); SPD_CHECK_PTR(b); SPD_CHECK_PTR(c);
        check(spd::mma_selftest(ptr<const void>(a), ptr<const void>(b), ptr<float>(c), dtype,
                                ptr<void>(stream)),
              "mma_selftest");
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("dtype"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  m.def("anchor_projection_items", &spd::anchor_projection_items, py::arg("M"), py::arg("D"),
        py::arg("k_per"));
  m.def(
      "anchor_projection_mma",
      [](uintptr_t anchors, int64_t stride_am, int64_t stride_ar, uintptr_t types, bool types_i64,
         uintptr_t table, uintptr_t out, int64_t stride_or, uintptr_t ws, int M, int R, int D,
         int N, int k_per, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("anchor_projection_mma");
        if (R > 0 && N > 0) {
          SPD_CHECK_GE(M, 1, "anchor types");
          SPD_CHECK_GE(D, 1, "a row of anchors");
          if (R > 1) SPD_CHECK_GE(stride_ar, D, "D: rows of anchors must not overlap");
          if (M > 1) SPD_CHECK_GE(stride_am, D, "D: anchors of two types must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_or, N, "N: rows of out must not overlap");
          SPD_CHECK_PTR(anchors); SPD_CHECK_PTR(types); SPD_CHECK_PTR(table); SPD_CHECK_PTR(out);
          SPD_CHECK_DTYPE(dtype, 1, 2);  // tensor cores: 16-bit only
          SPD_CHECK(D % 8 == 0, "D: expected a multiple of 8 (16-byte rows), got ", D);
          SPD_CHECK(k_per > 0 && k_per % 32 == 0,
                    "k_per: expected a positive multiple of 32 (the mma chunk), got ", k_per);
          SPD_CHECK(spd::anchor_projection_items(M, D, k_per) > 0,
                    "k_per: expected a split with at most 2^31 work items, got ", k_per);
          SPD_CHECK_PTR(ws);
        }
        check(spd::anchor_projection_mma(ptr<const void>(anchors), stride_am, stride_ar,
                                         ptr<const void>(types), types_i64,
                                         ptr<const int64_t>(table), ptr<void>(out), stride_or,
                                         ptr<float>(ws), M, R, D, N, k_per, dtype,
                                         ptr<void>(stream)),
              "anchor_projection_mma");
      },
      py::arg("anchors"), py::arg("stride_am"), py::arg("stride_ar"), py::arg("types"),
      py::arg("types_i64"), py::arg("table"), py::arg("out"), py::arg("stride_or"), py::arg("ws"),
      py::arg("M"), py::arg("R"), py::arg("D"), py::arg("N"), py::arg("k_per"), py::arg("dtype"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "fused_linear",
      [](uintptr_t x, int64_t stride_x, uintptr_t norm_weight, uintptr_t xn, uintptr_t w0,
         uintptr_t w1, uintptr_t residual, int64_t stride_res, uintptr_t out, int64_t stride_out,
         uintptr_t ws, int R, int N, int K, int splits, int k_per, float eps, int dtype,
         uintptr_t stream) {
        require_device();
        SPD_BINDING("fused_linear");
        if (R > 0 && N > 0) {
          SPD_CHECK(R <= 16, "R: expected at most 16 rows, got ", R);
          SPD_CHECK(K > 0 && K % 8 == 0, "K: expected a positive multiple of 8, got ", K);
          SPD_CHECK_DTYPE(dtype, 1, 2);  // tensor cores: 16-bit only
          if (R > 1) SPD_CHECK_GE(stride_x, K, "K: rows of x must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_out, N, "N: rows of out must not overlap");
          if (R > 1 && residual != 0) SPD_CHECK_GE(stride_res, N, "N: rows of residual");
          SPD_CHECK(k_per > 0 && k_per % 32 == 0,
                    "k_per: expected a positive multiple of 32 (the mma chunk), got ", k_per);
          SPD_CHECK(splits >= 1 && (int64_t)splits * k_per >= K &&
                        (int64_t)(splits - 1) * k_per < K,
                    "splits: expected the splits of k_per=", k_per, " columns to cover K=", K,
                    " with none empty, got ", splits);
          SPD_CHECK(splits == 1 || ws != 0, "ws: expected a workspace with splits=", splits,
                    ", got null");
          SPD_CHECK(norm_weight == 0 || xn != 0,
                    "xn: expected a buffer for the normed rows (norm_weight given), got null");
          SPD_CHECK_PTR(x); SPD_CHECK_PTR(w0); SPD_CHECK_PTR(out);
        }
        check(spd::fused_linear(ptr<const void>(x), stride_x, ptr<const void>(norm_weight),
                                ptr<void>(xn), ptr<const void>(w0), ptr<const void>(w1),
                                ptr<const void>(residual), stride_res, ptr<void>(out), stride_out,
                                ptr<float>(ws), R, N, K, splits, k_per, eps, dtype,
                                ptr<void>(stream)),
              "fused_linear");
      },
      py::arg("x"), py::arg("stride_x"), py::arg("norm_weight"), py::arg("xn"), py::arg("w0"),
      py::arg("w1"), py::arg("residual"), py::arg("stride_res"), py::arg("out"),
      py::arg("stride_out"), py::arg("ws"), py::arg("R"), py::arg("N"), py::arg("K"),
      py::arg("splits"), py::arg("k_per"), py::arg("eps"), py::arg("dtype"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "rope_append",
      [](uintptr_t qp, int64_t stride_qp, uintptr_t kp, int64_t stride_kp, uintptr_t vp,
         int64_t stride_vp, uintptr_t q_norm, uintptr_t k_norm, uintptr_t cos, uintptr_t sin,
         int64_t stride_cs, uintptr_t start, uintptr_t q_out, uintptr_t k_cache,
         uintptr_t v_cache, int rows, int H, int KVH, int S, int P, int HD, float eps, int dtype,
         uintptr_t stream) {
        require_device();
        SPD_BINDING("rope_append");
        if (rows > 0) {
          SPD_CHECK(H >= 1 && KVH >= 1, "H, KVH: expected positive head counts, got H=", H,
                    " KVH=", KVH);
          SPD_CHECK(HD > 0 && HD % 2 == 0 && HD <= 256,
                    "HD: expected an even head size of at most 256, got ", HD);
          SPD_CHECK_GE(S, 1, "cache slots");
          SPD_CHECK_GE(P, 1, "rows of the RoPE tables");
          SPD_CHECK_DTYPE(dtype, 1, 2);
          if (rows > 1) {
            SPD_CHECK_GE(stride_qp, (int64_t)H * HD, "H * HD: rows of qp must not overlap");
            SPD_CHECK_GE(stride_kp, (int64_t)KVH * HD, "KVH * HD: rows of kp must not overlap");
            SPD_CHECK_GE(stride_vp, (int64_t)KVH * HD, "KVH * HD: rows of vp must not overlap");
          }
          if (P > 1) SPD_CHECK_GE(stride_cs, HD, "HD: rows of cos / sin must not overlap");
          SPD_CHECK((q_norm == 0) == (k_norm == 0),
                    "q_norm, k_norm: expected both or neither, got q_norm=", q_norm,
                    " k_norm=", k_norm);
          SPD_CHECK_PTR(qp); SPD_CHECK_PTR(kp); SPD_CHECK_PTR(vp); SPD_CHECK_PTR(cos);
          SPD_CHECK_PTR(sin); SPD_CHECK_PTR(start); SPD_CHECK_PTR(q_out);
          SPD_CHECK_PTR(k_cache); SPD_CHECK_PTR(v_cache);
        }
        check(spd::rope_append(ptr<const void>(qp), stride_qp, ptr<const void>(kp), stride_kp,
                               ptr<const void>(vp), stride_vp, ptr<const void>(q_norm),
                               ptr<const void>(k_norm), ptr<const void>(cos),
                               ptr<const void>(sin), stride_cs, ptr<const int64_t>(start),
                               ptr<void>(q_out), ptr<void>(k_cache), ptr<void>(v_cache), rows, H,
                               KVH, S, P, HD, eps, dtype, ptr<void>(stream)),
              "rope_append");
      },
      py::arg("qp"), py::arg("stride_qp"), py::arg("kp"), py::arg("stride_kp"), py::arg("vp"),
      py::arg("stride_vp"), py::arg("q_norm"), py::arg("k_norm"), py::arg("cos"), py::arg("sin"),
      py::arg("stride_cs"), py::arg("start"), py::arg("q_out"), py::arg("k_cache"),
      py::arg("v_cache"), py::arg("rows"), py::arg("H"), py::arg("KVH"), py::arg("S"),
      py::arg("P"), py::arg("HD"), py::arg("eps"), py::arg("dtype"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "cache_attention",
      [](uintptr_t q, int64_t stride_qh, int64_t stride_qr, uintptr_t k, uintptr_t v,
         int64_t stride_ch, int64_t stride_cs, uintptr_t start, uintptr_t out, int64_t stride_or,
         uintptr_t ws, int H, int R, int KVH, int S, int HD, int splits, int chunk,
         float scale_log2, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("cache_attention");
        if (R > 0) {
          SPD_CHECK(KVH >= 1 && H >= KVH && H % KVH == 0,
                    "H: expected a multiple of KVH=", KVH, ", got ", H);
          SPD_CHECK(HD == 64 || HD == 128, "HD: expected 64 or 128, got ", HD);
          SPD_CHECK_GE(S, 1, "cache slots");
          SPD_CHECK_DTYPE(dtype, 1, 2);
          if (R > 1) SPD_CHECK_GE(stride_qr, HD, "HD: rows of q must not overlap");
          if (H > 1) SPD_CHECK_GE(stride_qh, HD, "HD: heads of q must not overlap");
          if (S > 1) SPD_CHECK_GE(stride_cs, HD, "HD: cache slots must not overlap");
          if (KVH > 1) SPD_CHECK_GE(stride_ch, HD, "HD: cache heads must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_or, (int64_t)H * HD, "H * HD: rows of out");
          SPD_CHECK(chunk > 0 && chunk % 32 == 0,
                    "chunk: expected a positive multiple of 32, got ", chunk);
          SPD_CHECK(splits >= 1 && (int64_t)splits * chunk >= S &&
                        (int64_t)(splits - 1) * chunk < S,
                    "splits: expected the splits of chunk=", chunk, " keys to cover S=", S,
                    " with none empty, got ", splits);
          SPD_CHECK(splits == 1 || ws != 0, "ws: expected a workspace with splits=", splits,
                    ", got null");
          SPD_CHECK_PTR(q); SPD_CHECK_PTR(k); SPD_CHECK_PTR(v); SPD_CHECK_PTR(start);
          SPD_CHECK_PTR(out);
        }
        check(spd::cache_attention(ptr<const void>(q), stride_qh, stride_qr, ptr<const void>(k),
                                   ptr<const void>(v), stride_ch, stride_cs,
                                   ptr<const int64_t>(start), ptr<void>(out), stride_or,
                                   ptr<float>(ws), H, R, KVH, S, HD, splits, chunk, scale_log2,
                                   dtype, ptr<void>(stream)),
              "cache_attention");
      },
      py::arg("q"), py::arg("stride_qh"), py::arg("stride_qr"), py::arg("k"), py::arg("v"),
      py::arg("stride_ch"), py::arg("stride_cs"), py::arg("start"), py::arg("out"),
      py::arg("stride_or"), py::arg("ws"), py::arg("H"), py::arg("R"), py::arg("KVH"),
      py::arg("S"), py::arg("HD"), py::arg("splits"), py::arg("chunk"), py::arg("scale_log2"),
      py::arg("dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "kv_truncate",
      [](uintptr_t lengths, uintptr_t new_lengths, int new_stride, int C, uintptr_t stream,
         int64_t lengths_numel, int64_t new_lengths_numel) {
        require_device();
        SPD_BINDING("kv_truncate");
        if (C > 0) {
          SPD_CHECK(new_stride == 0 || new_stride == 1,
                    "new_stride: expected 1 (a length per cache) or 0 (one for all), got ",
                    new_stride);
          SPD_CHECK_PTR(lengths); SPD_CHECK_PTR(new_lengths);
          // The buffers' element counts, when the caller gives them (-1: not given), so a C
          // past the end of either is refused instead of read and written.
          if (lengths_numel >= 0)
            SPD_CHECK(lengths_numel >= C, "lengths: expected at least C=", C,
                      " int64 elements, got ", lengths_numel);
          const int64_t need = new_stride == 1 ? C : 1;
          if (new_lengths_numel >= 0)
            SPD_CHECK(new_lengths_numel >= need, "new_lengths: expected at least ", need,
                      " int64 elements, got ", new_lengths_numel);
        }
        check(spd::kv_truncate(ptr<int64_t>(lengths), ptr<const int64_t>(new_lengths), new_stride,
                               C, ptr<void>(stream)),
              "kv_truncate");
      },
      py::arg("lengths"), py::arg("new_lengths"), py::arg("new_stride"), py::arg("C"),
      py::arg("stream"), py::arg("lengths_numel") = -1, py::arg("new_lengths_numel") = -1,
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "kv_poison",
      [](uintptr_t lengths, uintptr_t new_lengths, int new_stride, uintptr_t table, int n_buffers,
         int C, int64_t outer, int64_t S, int64_t inner, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("kv_poison");
        if (C > 0) {
          SPD_CHECK(new_stride == 0 || new_stride == 1,
                    "new_stride: expected 1 (a length per cache) or 0 (one for all), got ",
                    new_stride);
          SPD_CHECK_PTR(lengths); SPD_CHECK_PTR(new_lengths);
          SPD_CHECK_GE(n_buffers, 1, "buffers in table");
          SPD_CHECK(outer >= 1 && S >= 1 && inner >= 1,
                    "outer, S, inner: expected a positive layout, got ", outer, ", ", S, ", ",
                    inner);
          SPD_CHECK_DTYPE(dtype, 0, 2);
          SPD_CHECK_PTR(table);
        }
        check(spd::kv_poison(ptr<const int64_t>(lengths), ptr<const int64_t>(new_lengths),
                             new_stride, ptr<const int64_t>(table), n_buffers, C, outer, S, inner,
                             dtype, ptr<void>(stream)),
              "kv_poison");
      },
      py::arg("lengths"), py::arg("new_lengths"), py::arg("new_stride"), py::arg("table"),
      py::arg("n_buffers"), py::arg("C"), py::arg("outer"), py::arg("S"), py::arg("inner"),
      py::arg("dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  m.def(
      "anchor_projection",
      [](uintptr_t anchors, int64_t stride_am, int64_t stride_ar, uintptr_t types, bool types_i64,
         uintptr_t table, uintptr_t out, int64_t stride_or, int M, int R, int D, int N, int dtype,
         bool vectorized, uintptr_t stream) {
        require_device();
        SPD_BINDING("anchor_projection");
        if (R > 0 && N > 0) {
          SPD_CHECK_GE(M, 1, "anchor types");
          SPD_CHECK_GE(D, 1, "a row of anchors");
          if (R > 1) SPD_CHECK_GE(stride_ar, D, "D: rows of anchors must not overlap");
          if (M > 1) SPD_CHECK_GE(stride_am, D, "D: anchors of two types must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_or, N, "N: rows of out must not overlap");
          SPD_CHECK_PTR(anchors); SPD_CHECK_PTR(types); SPD_CHECK_PTR(table); SPD_CHECK_PTR(out);
          SPD_CHECK_DTYPE(dtype, 0, 2);
        }
        check(spd::anchor_projection(ptr<const void>(anchors), stride_am, stride_ar,
                                     ptr<const void>(types), types_i64, ptr<const int64_t>(table),
                                     ptr<void>(out), stride_or, M, R, D, N, dtype, vectorized,
                                     ptr<void>(stream)),
              "anchor_projection");
      },
      py::arg("anchors"), py::arg("stride_am"), py::arg("stride_ar"), py::arg("types"),
      py::arg("types_i64"), py::arg("table"), py::arg("out"), py::arg("stride_or"), py::arg("M"),
      py::arg("R"), py::arg("D"), py::arg("N"), py::arg("dtype"), py::arg("vectorized"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());
}
