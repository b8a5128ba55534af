// pybind11 bindings of the spd_kernels CUDA kernels (module spd_kernels._spd_cuda).
//
// Every buffer argument is a raw device address (Python int, e.g. tensor.data_ptr(); None for
// null) or the torch.Tensor itself, read through Python attributes, and the stream is a raw
// cudaStream_t (torch.cuda.current_stream().cuda_stream), so this module does not depend on
// torch's C++ API or ABI. Shapes, dtypes and value ranges are checked in Python
// (spd_kernels/*.py), and again here before any launch (checks.h: a wrong stride, dimension or
// dtype code is a ValueError naming the argument, not an out-of-bounds access; handed tensors,
// a binding also checks their dtype, device and that each holds the bytes the kernel will touch);
// a missing device or a CUDA error becomes a RuntimeError naming it.
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
template <typename T>
T* ptr(const spd_checks::Buf& b) { return reinterpret_cast<T*>(b.addr); }

using spd_checks::Buf;
using spd_checks::Dim;
using spd_checks::code;
using spd_checks::flag;
using Acc = spd_checks::Access;
using El = spd_checks::Elem;

El index_elem(bool i64) { return i64 ? El::kI64 : El::kI32; }

}  // namespace

PYBIND11_MODULE(SPD_MODULE, m) {
  m.doc() = "CUDA kernels of spd_kernels (tensors or raw addresses, checked; no torch C++ API)";
#ifdef SPD_SIMT_HOST
  m.attr("host_emulation") = true;  // kernels run as fibers on the CPU, on host addresses
  m.def(
      "selftest",
      [](int which, Buf out) {
        SPD_BINDING("selftest");
        SPD_CHECK(which >= 0 && which <= 2, "which: expected 0, 1 or 2, got ", which);
        SPD_CHECK_PTR(out);
        spd_checks::Call c(SPD_FN);
        SPD_BUFFER(c, out, Acc::kWrite, El::kI32,
                   {Dim("threads", 64), Dim("results a thread", which == 0 ? 9 : 1)});
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
      [](Buf hidden, int64_t stride_h, Buf norm_weight, Buf weight, int64_t stride_w, Buf draft,
         bool draft_i64, Buf pval, Buf pidx, Buf target, Buf accepted, int R, int D, int V,
         float eps, float norm_offset, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("verify_greedy");
        SPD_CHECK_GE(R, 0, "rows of hidden");
        if (R > 0) {  // R == 0 launches nothing
          SPD_CHECK_GE(D, 1, "a row of hidden");
          SPD_CHECK_GE(V, 1, "rows of weight");
          SPD_CHECK_DTYPE(dtype, 0, 2);
          if (R > 1) SPD_CHECK_GE(stride_h, D, "D: rows of hidden must not overlap");
          if (V > 1) SPD_CHECK_GE(stride_w, D, "D: rows of weight must not overlap");
          SPD_CHECK_PTR(hidden); SPD_CHECK_PTR(norm_weight); SPD_CHECK_PTR(weight);
          SPD_CHECK_PTR(draft); SPD_CHECK_PTR(pval); SPD_CHECK_PTR(pidx);
          SPD_CHECK_PTR(target); SPD_CHECK_PTR(accepted);
          spd_checks::Call c(SPD_FN);
          const El el = spd_checks::elem_of_code(dtype);
          const int NB = spd::verify_greedy_num_blocks(V);
          SPD_BUFFER(c, hidden, Acc::kRead, el, {Dim("R", R, "stride_h", stride_h), Dim("D", D)},
                     code("dtype", dtype));
          SPD_BUFFER(c, norm_weight, Acc::kRead, el, {Dim("D", D)}, code("dtype", dtype));
          SPD_BUFFER(c, weight, Acc::kRead, el, {Dim("V", V, "stride_w", stride_w), Dim("D", D)},
                     code("dtype", dtype));
          SPD_BUFFER(c, draft, Acc::kRead, index_elem(draft_i64), {Dim("R", R)},
                     flag("draft_i64", draft_i64));
          SPD_BUFFER(c, pval, Acc::kReadWrite, El::kF32,
                     {Dim("R", R), Dim("verify_greedy_num_blocks(V)", NB)});
          SPD_BUFFER(c, pidx, Acc::kReadWrite, El::kI32,
                     {Dim("R", R), Dim("verify_greedy_num_blocks(V)", NB)});
          SPD_BUFFER(c, target, Acc::kWrite, El::kI64, {Dim("R", R)});
          SPD_BUFFER(c, accepted, Acc::kWrite, El::kBool, {Dim("R", R)});
        }
        check(spd::verify_greedy(ptr<const void>(hidden), stride_h, ptr<const void>(norm_weight),
                                 ptr<const void>(weight), stride_w, ptr<const void>(draft),
                                 draft_i64, ptr<float>(pval), ptr<int>(pidx), ptr<int64_t>(target),
                                 ptr<bool>(accepted), R, D, V, eps, norm_offset, dtype,
                                 ptr<void>(stream)),
              "verify_greedy");
      },
      py::arg("hidden"), py::arg("stride_h"), py::arg("norm_weight"), py::arg("weight"),
      py::arg("stride_w"), py::arg("draft"), py::arg("draft_i64"), py::arg("pval"),
      py::arg("pidx"), py::arg("target"), py::arg("accepted"), py::arg("R"), py::arg("D"),
      py::arg("V"), py::arg("eps"), py::arg("norm_offset"), py::arg("dtype"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "rejection_sample",
      [](Buf x, int64_t stride_x, int x_dtype, Buf q, int64_t stride_q, int q_dtype, Buf t2d,
         Buf tok, bool tok_i64, Buf u, int64_t stride_u, Buf seed, Buf offset, Buf out_tok,
         Buf out_acc, int R, int V, float temperature, int top_k, float top_p, bool from_logits,
         uintptr_t stream, int64_t q_cols) {
        require_device();
        SPD_BINDING("rejection_sample");
        SPD_CHECK_GE(R, 0, "rows of x");
        if (R > 0) {
          SPD_CHECK_GE(V, 1, "a row of x");
          SPD_CHECK_DTYPE(x_dtype, 0, 2);
          SPD_CHECK_DTYPE(q_dtype, 0, 2);
          if (R > 1) SPD_CHECK_GE(stride_x, V, "V: rows of x must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_q, 1, "rows of q");
          SPD_CHECK_PTR(x); SPD_CHECK_PTR(q); SPD_CHECK_PTR(tok);
          SPD_CHECK_PTR(out_tok); SPD_CHECK_PTR(out_acc);
          if (u.addr != 0) {
            if (R > 1) SPD_CHECK_GE(stride_u, 2, "two uniforms per row of u");
          } else {
            SPD_CHECK(seed.addr != 0 && offset.addr != 0,
                      "seed, offset: expected both buffers when u is null, got seed=", seed.addr,
                      " offset=", offset.addr);
          }
          SPD_CHECK_GE(top_k, 0, "0 is no top-k");
          // q's row: V entries on target ids; through t2d, the draft columns its entries name
          // (q_cols of them when given, else only the row's first is known to be read).
          const bool mapped = t2d.addr != 0;
          if (mapped && q_cols >= 0) SPD_CHECK_GE(q_cols, 1, "columns of q that t2d maps to");
          const int64_t cols = !mapped ? V : q_cols >= 0 ? q_cols : 1;
          spd_checks::Call c(SPD_FN);
          SPD_BUFFER(c, x, Acc::kRead, spd_checks::elem_of_code(x_dtype),
                     {Dim("R", R, "stride_x", stride_x), Dim("V", V)}, code("x_dtype", x_dtype));
          SPD_BUFFER(c, q, Acc::kRead, spd_checks::elem_of_code(q_dtype),
                     {Dim("R", R, "stride_q", stride_q),
                      Dim(!mapped ? "V" : q_cols >= 0 ? "q_cols" : "q_cols (not given)", cols)},
                     code("q_dtype", q_dtype));
          SPD_BUFFER(c, t2d, Acc::kRead, El::kI32, {Dim("V", V)});
          SPD_BUFFER(c, tok, Acc::kRead, index_elem(tok_i64), {Dim("R", R)},
                     flag("tok_i64", tok_i64));
          if (u.addr != 0) {
            SPD_BUFFER(c, u, Acc::kRead, El::kF32,
                       {Dim("R", R, "stride_u", stride_u), Dim("uniforms a row", 2)});
          } else {  // Philox(seed[0], offset[0] + r)
            SPD_BUFFER(c, seed, Acc::kRead, El::kI64, {});
            SPD_BUFFER(c, offset, Acc::kRead, El::kI64, {});
          }
          SPD_BUFFER(c, out_tok, Acc::kWrite, El::kI64, {Dim("R", R)});
          SPD_BUFFER(c, out_acc, Acc::kWrite, El::kBool, {Dim("R", R)});
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
      py::arg("top_p"), py::arg("from_logits"), py::arg("stream"), py::arg("q_cols") = -1,
      "q_cols: the columns of q's rows when t2d maps target ids into them (-1: not given; "
      "without t2d a row of q is V entries)",
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "mma_selftest",
      [](Buf a, Buf b, Buf c, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("mma_selftest");
        SPD_CHECK_DTYPE(dtype, 1, 2);
        SPD_CHECK_PTR(a); SPD_CHECK_PTR(b); SPD_CHECK_PTR(c);
        spd_checks::Call call(SPD_FN);
        const El el = spd_checks::elem_of_code(dtype);
        SPD_BUFFER(call, a, Acc::kRead, el, {Dim("rows", 16), Dim("columns", 16)},
                   code("dtype", dtype));
        SPD_BUFFER(call, b, Acc::kRead, el, {Dim("rows", 8), Dim("columns", 16)},
                   code("dtype", dtype));
        SPD_BUFFER(call, c, Acc::kWrite, El::kF32, {Dim("rows", 16), Dim("columns", 8)});
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
      [](Buf anchors, int64_t stride_am, int64_t stride_ar, Buf types, bool types_i64, Buf table,
         Buf out, int64_t stride_or, Buf ws, int M, int R, int D, int N, int k_per, int dtype,
         uintptr_t stream) {
        require_device();
        SPD_BINDING("anchor_projection_mma");
        SPD_CHECK_GE(R, 0, "rows of anchors");
        SPD_CHECK_GE(N, 0, "columns of out");
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
          const int items = spd::anchor_projection_items(M, D, k_per);
          SPD_CHECK(items > 0, "k_per: expected a split with at most 2^31 work items, got ",
                    k_per);
          SPD_CHECK_PTR(ws);
          SPD_CHECK_STRIDE16(stride_am, M > 1);
          SPD_CHECK_STRIDE16(stride_ar, R > 1);
          spd_checks::Call c(SPD_FN);
          const El el = spd_checks::elem_of_code(dtype);
          SPD_BUFFER(c, anchors, Acc::kRead, el,
                     {Dim("M", M, "stride_am", stride_am), Dim("R", R, "stride_ar", stride_ar),
                      Dim("D", D)},
                     code("dtype", dtype), 16);
          SPD_BUFFER(c, types, Acc::kRead, index_elem(types_i64), {Dim("R", R)},
                     flag("types_i64", types_i64));
          SPD_BUFFER(c, table, Acc::kRead, El::kI64, {Dim("weights and biases", 2), Dim("M", M)});
          SPD_BUFFER(c, out, Acc::kWrite, el, {Dim("R", R, "stride_or", stride_or), Dim("N", N)},
                     code("dtype", dtype));
          SPD_BUFFER(c, ws, Acc::kReadWrite, El::kF32,
                     {Dim("anchor_projection_items(M, D, k_per)", items), Dim("R", R),
                      Dim("N", N)});
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
      [](Buf x, int64_t stride_x, Buf norm_weight, Buf xn, Buf w0, Buf w1, Buf residual,
         int64_t stride_res, Buf out, int64_t stride_out, Buf ws, int R, int N, int K,
         int splits, int k_per, float eps, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("fused_linear");
        SPD_CHECK_GE(R, 0, "rows of x");
        SPD_CHECK_GE(N, 0, "columns of out");
        if (R > 0 && N > 0) {
          SPD_CHECK(R <= 16, "R: expected at most 16 rows, got ", R);
          SPD_CHECK(K > 0 && K % 8 == 0, "K: expected a positive multiple of 8, got ", K);
          SPD_CHECK_DTYPE(dtype, 1, 2);  // tensor cores: 16-bit only
          if (R > 1) SPD_CHECK_GE(stride_x, K, "K: rows of x must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_out, N, "N: rows of out must not overlap");
          if (R > 1 && residual.addr != 0) SPD_CHECK_GE(stride_res, N, "N: rows of residual");
          SPD_CHECK(k_per > 0 && k_per % 32 == 0,
                    "k_per: expected a positive multiple of 32 (the mma chunk), got ", k_per);
          SPD_CHECK(splits >= 1 && (int64_t)splits * k_per >= K &&
                        (int64_t)(splits - 1) * k_per < K,
                    "splits: expected the splits of k_per=", k_per, " columns to cover K=", K,
                    " with none empty, got ", splits);
          SPD_CHECK(splits == 1 || ws.addr != 0, "ws: expected a workspace with splits=", splits,
                    ", got null");
          SPD_CHECK(norm_weight.addr == 0 || xn.addr != 0,
                    "xn: expected a buffer for the normed rows (norm_weight given), got null");
          SPD_CHECK_PTR(x); SPD_CHECK_PTR(w0); SPD_CHECK_PTR(out);
          // Without a norm the kernel reads x in 16-byte pieces; with one it reads xn so.
          const bool normed = norm_weight.addr != 0;
          SPD_CHECK_STRIDE16(stride_x, R > 1 && !normed);
          spd_checks::Call c(SPD_FN);
          const El el = spd_checks::elem_of_code(dtype);
          SPD_BUFFER(c, x, Acc::kRead, el, {Dim("R", R, "stride_x", stride_x), Dim("K", K)},
                     code("dtype", dtype), normed ? 0 : 16);
          SPD_BUFFER(c, norm_weight, Acc::kRead, el, {Dim("K", K)}, code("dtype", dtype));
          if (normed)
            SPD_BUFFER(c, xn, Acc::kReadWrite, el, {Dim("R", R), Dim("K", K)},
                       code("dtype", dtype), 16);
          SPD_BUFFER(c, w0, Acc::kRead, el, {Dim("N", N), Dim("K", K)}, code("dtype", dtype), 16);
          SPD_BUFFER(c, w1, Acc::kRead, el, {Dim("N", N), Dim("K", K)}, code("dtype", dtype), 16);
          SPD_BUFFER(c, residual, Acc::kRead, el,
                     {Dim("R", R, "stride_res", stride_res), Dim("N", N)}, code("dtype", dtype));
          SPD_BUFFER(c, out, Acc::kWrite, el, {Dim("R", R, "stride_out", stride_out), Dim("N", N)},
                     code("dtype", dtype));
          if (splits > 1)
            SPD_BUFFER(c, ws, Acc::kReadWrite, El::kF32,
                       {Dim("splits", splits), Dim("weights (2 with w1)", w1.addr != 0 ? 2 : 1),
                        Dim("R", R), Dim("N", N)});
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
      [](Buf qp, int64_t stride_qp, Buf kp, int64_t stride_kp, Buf vp, int64_t stride_vp,
         Buf q_norm, Buf k_norm, Buf cos, Buf sin, int64_t stride_cs, Buf start, Buf q_out,
         Buf k_cache, Buf v_cache, int rows, int H, int KVH, int S, int P, int HD, float eps,
         int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("rope_append");
        SPD_CHECK_GE(rows, 0, "rows of qp");
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
          SPD_CHECK((q_norm.addr == 0) == (k_norm.addr == 0),
                    "q_norm, k_norm: expected both or neither, got q_norm=", q_norm.addr,
                    " k_norm=", k_norm.addr);
          SPD_CHECK_PTR(qp); SPD_CHECK_PTR(kp); SPD_CHECK_PTR(vp); SPD_CHECK_PTR(cos);
          SPD_CHECK_PTR(sin); SPD_CHECK_PTR(start); SPD_CHECK_PTR(q_out);
          SPD_CHECK_PTR(k_cache); SPD_CHECK_PTR(v_cache);
          spd_checks::Call c(SPD_FN);
          const El el = spd_checks::elem_of_code(dtype);
          SPD_BUFFER(c, qp, Acc::kRead, el,
                     {Dim("rows", rows, "stride_qp", stride_qp), Dim("H", H), Dim("HD", HD)},
                     code("dtype", dtype));
          SPD_BUFFER(c, kp, Acc::kRead, el,
                     {Dim("rows", rows, "stride_kp", stride_kp), Dim("KVH", KVH), Dim("HD", HD)},
                     code("dtype", dtype));
          SPD_BUFFER(c, vp, Acc::kRead, el,
                     {Dim("rows", rows, "stride_vp", stride_vp), Dim("KVH", KVH), Dim("HD", HD)},
                     code("dtype", dtype));
          SPD_BUFFER(c, q_norm, Acc::kRead, el, {Dim("HD", HD)}, code("dtype", dtype));
          SPD_BUFFER(c, k_norm, Acc::kRead, el, {Dim("HD", HD)}, code("dtype", dtype));
          SPD_BUFFER(c, cos, Acc::kRead, el, {Dim("P", P, "stride_cs", stride_cs), Dim("HD", HD)},
                     code("dtype", dtype));
          SPD_BUFFER(c, sin, Acc::kRead, el, {Dim("P", P, "stride_cs", stride_cs), Dim("HD", HD)},
                     code("dtype", dtype));
          SPD_BUFFER(c, start, Acc::kRead, El::kI64, {});
          SPD_BUFFER(c, q_out, Acc::kWrite, el, {Dim("H", H), Dim("rows", rows), Dim("HD", HD)},
                     code("dtype", dtype));
          SPD_BUFFER(c, k_cache, Acc::kWrite, el, {Dim("KVH", KVH), Dim("S", S), Dim("HD", HD)},
                     code("dtype", dtype));
          SPD_BUFFER(c, v_cache, Acc::kWrite, el, {Dim("KVH", KVH), Dim("S", S), Dim("HD", HD)},
                     code("dtype", dtype));
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
      [](Buf q, int64_t stride_qh, int64_t stride_qr, Buf k, Buf v, int64_t stride_ch,
         int64_t stride_cs, Buf start, Buf out, int64_t stride_or, Buf ws, int H, int R, int KVH,
         int S, int HD, int splits, int chunk, float scale_log2, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("cache_attention");
        SPD_CHECK_GE(R, 0, "rows of q");
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
          SPD_CHECK(splits == 1 || ws.addr != 0, "ws: expected a workspace with splits=", splits,
                    ", got null");
          SPD_CHECK_PTR(q); SPD_CHECK_PTR(k); SPD_CHECK_PTR(v); SPD_CHECK_PTR(start);
          SPD_CHECK_PTR(out);
          SPD_CHECK_STRIDE16(stride_qh, H > 1);
          SPD_CHECK_STRIDE16(stride_qr, R > 1);
          SPD_CHECK_STRIDE16(stride_ch, KVH > 1);
          SPD_CHECK_STRIDE16(stride_cs, S > 1);
          spd_checks::Call c(SPD_FN);
          const El el = spd_checks::elem_of_code(dtype);
          SPD_BUFFER(c, q, Acc::kRead, el,
                     {Dim("H", H, "stride_qh", stride_qh), Dim("R", R, "stride_qr", stride_qr),
                      Dim("HD", HD)},
                     code("dtype", dtype), 16);
          SPD_BUFFER(c, k, Acc::kRead, el,
                     {Dim("KVH", KVH, "stride_ch", stride_ch), Dim("S", S, "stride_cs", stride_cs),
                      Dim("HD", HD)},
                     code("dtype", dtype), 16);
          SPD_BUFFER(c, v, Acc::kRead, el,
                     {Dim("KVH", KVH, "stride_ch", stride_ch), Dim("S", S, "stride_cs", stride_cs),
                      Dim("HD", HD)},
                     code("dtype", dtype), 16);
          SPD_BUFFER(c, start, Acc::kRead, El::kI64, {});
          SPD_BUFFER(c, out, Acc::kWrite, el,
                     {Dim("R", R, "stride_or", stride_or), Dim("H", H), Dim("HD", HD)},
                     code("dtype", dtype));
          if (splits > 1)
            SPD_BUFFER(c, ws, Acc::kReadWrite, El::kF32,
                       {Dim("KVH", KVH), Dim("splits", splits), Dim("R", R),
                        Dim("H / KVH", H / KVH), Dim("HD + 2", HD + 2)});
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
      [](Buf lengths, Buf new_lengths, int new_stride, int C, uintptr_t stream,
         int64_t lengths_numel, int64_t new_lengths_numel) {
        require_device();
        SPD_BINDING("kv_truncate");
        SPD_CHECK_GE(C, 0, "caches");
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
          spd_checks::Call c(SPD_FN);
          SPD_BUFFER(c, lengths, Acc::kReadWrite, El::kI64, {Dim("C", C)});
          SPD_BUFFER(c, new_lengths, Acc::kRead, El::kI64,
                     {Dim(new_stride == 1 ? "C (new_stride=1)" : "one for all (new_stride=0)",
                          need)});
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
      [](Buf lengths, Buf new_lengths, int new_stride, Buf table, int n_buffers, int C,
         int64_t outer, int64_t S, int64_t inner, int dtype, uintptr_t stream) {
        require_device();
        SPD_BINDING("kv_poison");
        SPD_CHECK_GE(C, 0, "caches");
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
          // The buffers behind the table are device data: their sizes cannot be checked here.
          spd_checks::Call c(SPD_FN);
          SPD_BUFFER(c, lengths, Acc::kRead, El::kI64, {Dim("C", C)});
          SPD_BUFFER(c, new_lengths, Acc::kRead, El::kI64,
                     {Dim(new_stride == 1 ? "C (new_stride=1)" : "one for all (new_stride=0)",
                          new_stride == 1 ? C : 1)});
          SPD_BUFFER(c, table, Acc::kRead, El::kI64, {Dim("n_buffers", n_buffers)});
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
      [](Buf anchors, int64_t stride_am, int64_t stride_ar, Buf types, bool types_i64, Buf table,
         Buf out, int64_t stride_or, int M, int R, int D, int N, int dtype, bool vectorized,
         uintptr_t stream) {
        require_device();
        SPD_BINDING("anchor_projection");
        SPD_CHECK_GE(R, 0, "rows of anchors");
        SPD_CHECK_GE(N, 0, "columns of out");
        if (R > 0 && N > 0) {
          SPD_CHECK_GE(M, 1, "anchor types");
          SPD_CHECK_GE(D, 1, "a row of anchors");
          if (R > 1) SPD_CHECK_GE(stride_ar, D, "D: rows of anchors must not overlap");
          if (M > 1) SPD_CHECK_GE(stride_am, D, "D: anchors of two types must not overlap");
          if (R > 1) SPD_CHECK_GE(stride_or, N, "N: rows of out must not overlap");
          SPD_CHECK_PTR(anchors); SPD_CHECK_PTR(types); SPD_CHECK_PTR(table); SPD_CHECK_PTR(out);
          SPD_CHECK_DTYPE(dtype, 0, 2);
          if (vectorized) {  // rows read 8 elements at a time
            SPD_CHECK(D % 8 == 0, "D: expected a multiple of 8 with vectorized=True, got ", D);
            SPD_CHECK_STRIDE16(stride_am, M > 1);
            SPD_CHECK_STRIDE16(stride_ar, R > 1);
          }
          spd_checks::Call c(SPD_FN);
          const El el = spd_checks::elem_of_code(dtype);
          SPD_BUFFER(c, anchors, Acc::kRead, el,
                     {Dim("M", M, "stride_am", stride_am), Dim("R", R, "stride_ar", stride_ar),
                      Dim("D", D)},
                     code("dtype", dtype), vectorized ? 16 : 0);
          SPD_BUFFER(c, types, Acc::kRead, index_elem(types_i64), {Dim("R", R)},
                     flag("types_i64", types_i64));
          SPD_BUFFER(c, table, Acc::kRead, El::kI64, {Dim("weights and biases", 2), Dim("M", M)});
          SPD_BUFFER(c, out, Acc::kWrite, el, {Dim("R", R, "stride_or", stride_or), Dim("N", N)},
                     code("dtype", dtype));
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
