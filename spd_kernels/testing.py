"""Helpers for testing the ops and their kernels (used by tests/test_kernels_*.py).

- `poisoned_outputs(mode)`: buffers allocated by kernel launchers start as sentinels.
- `chi2_pvalue(counts, probs)`: goodness of fit of sampled counts against probabilities.
- `TRITON_DEVICE`: where the Triton kernels can run in this process ("cpu" under the interpreter,
  "cuda" when compiled for a GPU, None when neither), so one test body covers both.
- `cuda_context_error()`: why this process's CUDA context is lost to a kernel fault (tests stop
  using it; benchmarks stop timing in it), None while it works.
- `SIMT_SKIP_REASON`: None when the CUDA C++ kernels' host emulation (`spd_kernels._spd_simt`) is
  built, so tests can run the cuda backend on CPU tensors inside `_cuda.simulated()`.
"""
from __future__ import annotations

import contextlib

import torch

from spd_kernels import _alloc, _cuda
from spd_kernels._triton import HAS_TRITON, INTERPRET

if not HAS_TRITON:
    TRITON_DEVICE = None
elif INTERPRET:
    TRITON_DEVICE = "cpu"
else:
    TRITON_DEVICE = "cuda" if torch.cuda.is_available() else None

TRITON_SKIP_REASON = ("the Triton kernels need TRITON_INTERPRET=1 set before import (CPU) or a "
                      "CUDA device with TRITON_INTERPRET unset")


SIMT_SKIP_REASON = _cuda.simt_unavailable_reason()


@contextlib.contextmanager
def poisoned_outputs(mode: str = "a"):
    """Inside the block, every buffer a kernel launcher allocates starts as a sentinel."""
    if mode not in ("a", "b"):
        raise ValueError("mode is 'a' or 'b'")
    old = _alloc.POISON
    _alloc.POISON = mode
    try:
        yield
    finally:
        _alloc.POISON = old


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper gamma)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed counts against probabilities; cells expected < min_expected pooled.

    Fails (AssertionError) if a zero-probability outcome was observed.
    """
    counts = counts.double().cpu()
    probs = probs.double().cpu()
    total = counts.sum().item()
    exp = probs * total
    big = exp >= min_expected
    obs_cells = list(counts[big])
    exp_cells = list(exp[big])
    if (~big).any():
        obs_cells.append(counts[~big].sum())
        exp_cells.append(exp[~big].sum())
    obs = torch.stack(obs_cells)
    e = torch.stack(exp_cells)
    keep = e > 0
    assert (obs[~keep] == 0).all(), "a zero-probability outcome was observed"
    stat = ((obs[keep] - e[keep]) ** 2 / e[keep]).sum().item()
    return chi2_sf(stat, int(keep.sum()) - 1)


def cuda_context_error() -> str | None:
    """Why this process's CUDA context can no longer run anything, or None while it can.

    A kernel fault (illegal or misaligned address, trap, device-side assert) is sticky: every
    later CUDA call in the process fails with it. Errors that are not (out of memory, a bad launch
    configuration) surface at their own call and leave the context usable, so a device-wide
    synchronize that raises means the context is lost. Never initialises CUDA itself."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}"
    return None


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at |x| (fp32 result)."""
    x = x.float().abs().clamp_min(1e-30)
    return torch.exp2(torch.floor(torch.log2(x)) - 7)


# --- ahead-of-time compilation of the Triton kernels for a GPU target ------------------------------

def _variants():
    """(name, kernel, signature, constexprs) for the kernel variants the launchers use. The
    kernels of the PDM step's graph take PDL (programmatic dependent launch); one variant of each
    compiles with it on, the rest with it off."""
    from spd_kernels import dispatch, features, kv_cache, verify
    dispatch.load_deferred()  # the Triton modules are imported on first use (dispatch.defer)
    from spd_kernels.attention import triton_kernel as attention
    from spd_kernels.linear import triton_kernel as linear
    from spd_kernels.qkv_rope import triton_kernel as qkv_rope
    ptr = lambda t: f"*{t}"
    out = []
    for tag, dt, code, br, bv, bd in (("bf16-R1", "bf16", 1, 1, 32, 256),
                                       ("bf16-R4", "bf16", 1, 4, 16, 256),
                                       ("fp32-R2", "fp32", 0, 2, 16, 256)):
        out.append((f"verify._greedy_partial_kernel[{tag}]", verify.triton_greedy._greedy_partial_kernel,
                    dict(h_ptr=ptr(dt), g_ptr=ptr(dt), w_ptr=ptr(dt), pval_ptr="*fp32",
                         pidx_ptr="*i32", R="i32", D="i32", V="i32", NB="i32", stride_h="i32",
                         stride_w="i32", eps="fp32", norm_offset="fp32",
                         CENTRED="constexpr", R_H="constexpr", R_G="constexpr",
                         R_L="constexpr", BLOCK_R="constexpr", BLOCK_V="constexpr",
                         BLOCK_D="constexpr"),
                    dict(CENTRED=False, R_H=code, R_G=code, R_L=code, BLOCK_R=br, BLOCK_V=bv, BLOCK_D=bd)))
    out.append(("verify._greedy_reduce_kernel", verify.triton_greedy._greedy_reduce_kernel,
                dict(pval_ptr="*fp32", pidx_ptr="*i32", draft_ptr="*i64", target_ptr="*i64",
                     accepted_ptr="*i8", NB="i32", BLOCK_NB="constexpr"), dict(BLOCK_NB=1024)))
    # one program a row: the probs kernel (rejection_sample) has no flags; the logits kernel
    # (rejection_sample_logits) every combination its launcher makes (greedy: no top-k / top-p)
    from spd_kernels.verify import triton_rejection
    out.append(("verify.triton_rejection._rejection_probs_kernel",
                triton_rejection._rejection_probs_kernel,
                dict(p_ptr="*fp32", stride_p="i32", q_ptr="*fp32", stride_q="i32",
                     tok_ptr="*i64", u_ptr="*fp32", stride_u="i32", out_tok_ptr="*i64",
                     out_acc_ptr="*i8", V="i32", BLOCK="constexpr"), dict(BLOCK=2048)))
    logits_sig = dict(x_ptr="*fp32", stride_x="i32", q_ptr="*fp32", stride_q="i32",
                      t2d_ptr="*i32", tok_ptr="*i64", u_ptr="*fp32", stride_u="i32",
                      seed_ptr="*i64", offset_ptr="*i64", out_tok_ptr="*i64", out_acc_ptr="*i8",
                      V="i32", temperature="fp32", top_k="i32", top_p="fp32", GREEDY="constexpr",
                      TOP_K="constexpr", TOP_P="constexpr", PHILOX="constexpr",
                      BLOCK="constexpr")
    for greedy, top_k, top_p in ((True, False, False), (False, False, False),
                                 (False, True, False), (False, False, True),
                                 (False, True, True)):
        for philox in (False, True):
            tag = "-".join(["greedy"] * greedy + ["topk"] * top_k + ["topp"] * top_p
                           + ["philox" if philox else "uniforms"])
            out.append((f"verify.triton_rejection._rejection_logits_kernel[{tag}]",
                        triton_rejection._rejection_logits_kernel, logits_sig,
                        dict(GREEDY=greedy, TOP_K=top_k, TOP_P=top_p, PHILOX=philox,
                             BLOCK=2048)))
    for greedy in (False, True):
        out.append((f"verify._split_stats_kernel[greedy={greedy}]", verify.triton_split._split_stats_kernel,
                    dict(x_ptr="*fp32", stride_x="i32", pmax_ptr="*fp32", psum_ptr="*fp32",
                         parg_ptr="*i32", V="i32", CHUNK="i32", NB="i32", temperature="fp32",
                         GREEDY="constexpr", BLOCK="constexpr"), dict(GREEDY=greedy, BLOCK=1024)))
    split_common = dict(x_ptr="*fp32", stride_x="i32", q_ptr="*fp32", stride_q="i32",
                        t2d_ptr="*i32", pmax_ptr="*fp32", psum_ptr="*fp32", parg_ptr="*i32")
    for tag, logits, mapped, top in (("logits", True, True, False),
                                     ("logits-topk-topp", True, True, True),
                                     ("probs", False, False, False)):
        out.append((f"verify._split_residual_kernel[{tag}]", verify.triton_split._split_residual_kernel,
                    dict(split_common, thr_ptr="*i32", zsel_ptr="*fp32", mass_ptr="*fp32",
                         V="i32", CHUNK="i32", NB="i32", temperature="fp32",
                         FROM_LOGITS="constexpr", GREEDY="constexpr", TOP_K="constexpr",
                         TOP_P="constexpr", Q_MAPPED="constexpr", NB_PAD="constexpr",
                         BLOCK="constexpr"),
                    dict(FROM_LOGITS=logits, GREEDY=False, TOP_K=top, TOP_P=top,
                         Q_MAPPED=mapped, NB_PAD=128, BLOCK=1024)))
    for tag, logits, greedy, philox, top in (
            ("logits-philox", True, False, True, False),
            ("logits-topk-topp-philox", True, False, True, True),
            ("logits-greedy-uniforms", True, True, False, False),
            ("probs-uniforms", False, False, False, False)):
        sig = dict(x_ptr="*fp32", stride_x="i32", q_ptr="*fp32", stride_q="i32", t2d_ptr="*i32",
                   tok_ptr="*i64", u_ptr="*fp32", stride_u="i32", seed_ptr="*i64",
                   offset_ptr="*i64", pmax_ptr="*fp32", psum_ptr="*fp32", parg_ptr="*i32",
                   thr_ptr="*i32", zsel_ptr="*fp32", mass_ptr="*fp32", out_tok_ptr="*i64",
                   out_acc_ptr="*i8", V="i32", CHUNK="i32", NB="i32", temperature="fp32",
                   FROM_LOGITS="constexpr", GREEDY="constexpr", TOP_K="constexpr",
                   TOP_P="constexpr", Q_MAPPED="constexpr", PHILOX="constexpr",
                   NB_PAD="constexpr", BLOCK="constexpr")
        out.append((f"verify._split_finish_kernel[{tag}]", verify.triton_split._split_finish_kernel, sig,
                    dict(FROM_LOGITS=logits, GREEDY=greedy, TOP_K=top, TOP_P=top,
                         Q_MAPPED=logits, PHILOX=philox, NB_PAD=128, BLOCK=1024)))
    radix_flags = dict(SHIFT="constexpr", PHASE_P="constexpr", TOP_K="constexpr",
                       NEED_MASS="constexpr", NB_PAD="constexpr")
    # the last round (shift 0) of each phase stores the tie count (top-p's in float64)
    for shift, phase_p, need_mass in ((24, False, False), (0, False, True), (24, True, True),
                                      (8, True, True), (0, True, True)):
        flags = dict(SHIFT=shift, PHASE_P=phase_p, TOP_K=True, NEED_MASS=need_mass, NB_PAD=128)
        tag = f"{'top-p' if phase_p else 'top-k'}-shift{shift}"
        out.append((f"verify._radix_hist_kernel[{tag}]", verify.triton_split._radix_hist_kernel,
                    dict(x_ptr="*fp32", stride_x="i32", pmax_ptr="*fp32", psum_ptr="*fp32",
                         parg_ptr="*i32", prefix_ptr="*i64", thr_ptr="*i32", cnt_ptr="*i32",
                         mass_ptr="*fp32", V="i32", CHUNK="i32", NB="i32", temperature="fp32",
                         BLOCK="constexpr", **radix_flags),
                    dict(flags, BLOCK=verify.triton_split.RADIX_BLOCK)))
        out.append((f"verify._radix_select_kernel[{tag}]", verify.triton_split._radix_select_kernel,
                    dict(pmax_ptr="*fp32", psum_ptr="*fp32", parg_ptr="*i32", cnt_ptr="*i32",
                         mass_ptr="*fp32", prefix_ptr="*i64", above_ptr="*i32",
                         above_mass_ptr="*fp32", thr_ptr="*i32", zsel_ptr="*fp32",
                         tie_ptr="*i32", NB="i32", top_k="i32", top_p="fp32", **radix_flags),
                    flags))
    # the id cutting the tie group at each threshold (slot 0: top-k's, 2: top-p's)
    for slot in (0, 2):
        out.append((f"verify._tie_count_kernel[slot{slot}]", verify.triton_split._tie_count_kernel,
                    dict(x_ptr="*fp32", stride_x="i32", thr_ptr="*i32", tcnt_ptr="*i32",
                         V="i32", CHUNK="i32", NB="i32", temperature="fp32", SLOT="constexpr",
                         BLOCK="constexpr"), dict(SLOT=slot, BLOCK=1024)))
        out.append((f"verify._tie_pick_kernel[slot{slot}]", verify.triton_split._tie_pick_kernel,
                    dict(x_ptr="*fp32", stride_x="i32", thr_ptr="*i32", tcnt_ptr="*i32",
                         tie_ptr="*i32", V="i32", CHUNK="i32", NB="i32", temperature="fp32",
                         SLOT="constexpr", NB_PAD="constexpr", BLOCK="constexpr"),
                    dict(SLOT=slot, NB_PAD=128, BLOCK=1024)))
    out.append(("kv_cache._lengths_kernel", kv_cache._lengths_kernel,
                dict(len_ptr="*i64", new_ptr="*i64", new_stride="i32", C="i32",
                     BLOCK_C="constexpr"), dict(BLOCK_C=64)))
    for code in (0, 1):
        out.append((f"kv_cache._poison_kernel[{code}]", kv_cache._poison_kernel,
                    dict(len_ptr="*i64", new_ptr="*i64", new_stride="i32", table_ptr="*i64",
                         OUTER="i32", S="i32", INNER="i32", CODE="constexpr",
                         BLOCK="constexpr"), dict(CODE=code, BLOCK=1024)))
    # bf16 (aligned, D a multiple of BLOCK_K); fp32 anchors with bf16 weights (mixed: fp32 dot,
    # ragged K); fp32 with many rows; bf16 with int8 / fp8 e4m3 weights (spd_kernels.quant)
    for tag, dt, w_code, fp32_dot, even, r_scan in (("bf16", "bf16", 1, False, True, 16),
                                                     ("fp32-bf16w", "fp32", 1, True, False, 32),
                                                     ("fp32", "fp32", 0, True, True, 256),
                                                     ("bf16-int8w", "bf16", 3, False, True, 16),
                                                     ("bf16-fp8w", "bf16", 4, False, False, 16)):
        out.append((f"features._anchor_kernel[{tag}-R{r_scan}]", features._anchor_kernel,
                    dict(a_ptr=ptr(dt), stride_am="i32", stride_ar="i32", types_ptr="*i64",
                         table_ptr="*i64", out_ptr=ptr(dt), stride_or="i32", M="i32", R="i32",
                         D="i32", N="i32", W_CODE="constexpr", OUT_CODE="constexpr",
                         QUANT="constexpr", FP32_DOT="constexpr", W_ALIGNED="constexpr", EVEN_K="constexpr",
                         R_SCAN="constexpr", BLOCK_R="constexpr", BLOCK_N="constexpr",
                         BLOCK_K="constexpr", PDL="constexpr"),
                    dict(W_CODE=w_code, OUT_CODE=1 if dt == "bf16" else 0, QUANT=w_code > 2,
                         FP32_DOT=fp32_dot,
                         W_ALIGNED=even, EVEN_K=even, R_SCAN=r_scan, BLOCK_R=16, BLOCK_N=16,
                         BLOCK_K=256, PDL=tag == "bf16")))
    for code, dt, hd, qkn in ((1, "bf16", 128, True), (0, "fp32", 64, False)):
        out.append((f"qkv_rope._qk_rope_append_kernel[{dt}-{hd}]", qkv_rope._qk_rope_append_kernel,
                    dict(qp_ptr=ptr(dt), stride_qp="i32", kp_ptr=ptr(dt), stride_kp="i32",
                         vp_ptr=ptr(dt), stride_vp="i32", qn_ptr=ptr(dt),
                         kn_ptr=ptr(dt), cos_ptr=ptr(dt), sin_ptr=ptr(dt), stride_cs="i32",
                         start_ptr="*i64", q_ptr=ptr(dt), kc_ptr=ptr(dt), vc_ptr=ptr(dt),
                         T="i32", H="i32", KVH="i32", S="i32", eps="fp32", HD="constexpr",
                         QK_NORM="constexpr", R="constexpr", PDL="constexpr"),
                    dict(HD=hd, QK_NORM=qkn, R=code, PDL=code == 1)))
    for code, dt, hd, block_m, block_n, partial in ((1, "bf16", 128, 64, 64, True),
                                                   (1, "bf16", 64, 16, 64, False),
                                                   (1, "bf16", 8, 16, 64, True),
                                                   (0, "fp32", 64, 16, 64, True)):
        out.append((f"attention._cache_attention_kernel[{dt}-{hd}-m{block_m}{'-split' * partial}]",
                    attention._cache_attention_kernel,
                    dict(q_ptr=ptr(dt), stride_qh="i32", stride_qr="i32", k_ptr=ptr(dt),
                         v_ptr=ptr(dt), stride_ch="i32", stride_cs="i32", start_ptr="*i64",
                         out_ptr=ptr(dt), stride_or="i32", ws_ptr="*fp32", R="i32", S="i32",
                         G="i32", SPLITS="i32", CHUNK="i32", scale_log2="fp32",
                         HD="constexpr", HD_PAD="constexpr", BLOCK_M="constexpr",
                         BLOCK_N="constexpr", OUT="constexpr", PARTIAL="constexpr", IEEE="constexpr",
                         UPCAST="constexpr", PDL="constexpr"),
                    dict(HD=hd, HD_PAD=max(16, hd), BLOCK_M=block_m, BLOCK_N=block_n, OUT=code,
                         PARTIAL=partial, IEEE=code == 0, UPCAST=False, PDL=hd == 128)))
        out.append((f"attention._attention_combine_kernel[{dt}-{hd}-m{block_m}]",
                    attention._attention_combine_kernel,
                    dict(ws_ptr="*fp32", start_ptr="*i64", out_ptr=ptr(dt), stride_or="i32",
                         R="i32", S="i32", G="i32", SPLITS="i32", CHUNK="i32",
                         HD="constexpr", HD_PAD="constexpr", BLOCK_S="constexpr",
                         OUT="constexpr", PDL="constexpr"),
                    dict(HD=hd, HD_PAD=max(16, hd), BLOCK_S=16, OUT=code, PDL=hd == 128)))
    lin_sig = lambda dt, wt: dict(
        x_ptr=ptr(dt), stride_x="i32", g_ptr=ptr(dt), w_ptr=ptr(wt), w2_ptr=ptr(wt),
        res_ptr=ptr(dt), stride_res="i32", out_ptr=ptr(dt), stride_out="i32", ws_ptr="*fp32",
        SET_STRIDE="i32", sc_ptr="*fp32", sc2_ptr="*fp32", R="i32", N="i32", K="i32",
        K_PER="i32", eps="fp32", NORM="constexpr", SWIGLU="constexpr", RESIDUAL="constexpr",
        PARTIAL="constexpr", QUANT="constexpr", DT="constexpr", FP32_DOT="constexpr",
        R_PAD="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", PDL="constexpr")
    # weight-only quantised draft weights (spd_kernels.quant): int8 and fp8 e4m3 (fp8e4nv)
    for tag, dt, wt, code, norm, swiglu, res, partial in (
            ("bf16-residual", "bf16", "bf16", 1, False, False, True, False),
            ("bf16-residual-split", "bf16", "bf16", 1, False, False, True, True),
            ("bf16-norm-head", "bf16", "bf16", 1, True, False, False, False),
            ("bf16-swiglu-split", "bf16", "bf16", 1, True, True, False, True),
            ("fp32-swiglu", "fp32", "fp32", 0, True, True, False, False),
            ("bf16-int8-norm-head", "bf16", "i8", 1, True, False, False, False),
            ("bf16-int8-swiglu-split", "bf16", "i8", 1, True, True, False, True),
            ("bf16-fp8-residual-split", "bf16", "fp8e4nv", 1, False, False, True, True)):
        # every autotuning config for the widest variant, the first one for the others
        for bn, bk, _ in linear.GPU_CONFIGS if tag == "bf16-swiglu-split" else \
                linear.GPU_CONFIGS[:1]:
            out.append((f"linear._linear_kernel[{tag}-{bn}x{bk}]", linear._linear_kernel,
                        lin_sig(dt, wt),
                        dict(NORM=norm, SWIGLU=swiglu, RESIDUAL=res, PARTIAL=partial,
                             QUANT=wt != dt, DT=code, FP32_DOT=code == 0, R_PAD=16, BLOCK_N=bn,
                             BLOCK_K=bk, PDL=tag == "bf16-residual-split")))
    for tag, swiglu, res, quant in (("residual", False, True, False),
                                    ("swiglu", True, False, False),
                                    ("swiglu-quant", True, False, True)):
        out.append((f"linear._reduce_kernel[bf16-{tag}]", linear._reduce_kernel,
                    dict(ws_ptr="*fp32", SET_STRIDE="i32", res_ptr="*bf16", stride_res="i32",
                         out_ptr="*bf16", stride_out="i32", sc_ptr="*fp32", sc2_ptr="*fp32",
                         R="i32", N="i32", SPLITS="i32", SWIGLU="constexpr",
                         RESIDUAL="constexpr", QUANT="constexpr", DT="constexpr",
                         R_PAD="constexpr", BLOCK_N="constexpr", PDL="constexpr"),
                    dict(SWIGLU=swiglu, RESIDUAL=res, QUANT=quant, DT=1, R_PAD=16, BLOCK_N=64,
                         PDL=tag == "residual")))
    out += _control_variants()
    return out


def _control_variants():
    """The decode cycle's control kernels (spd_kernels.control_triton, a chain's, and
    spd_kernels.tree_control_triton, a token tree's), as their launchers call them: n = 4 stages,
    a tree W = 1 and W = 4 rows a position (k = W children a leaf), fp32 and bf16 anchors (and
    embeddings, final features), the optional inputs off (their pointers the launcher's int64
    dummy) and on. Bool tensors are *u1, Python ints i32."""
    from spd_kernels import control, control_triton, tree_control, tree_control_triton
    from spd_kernels._triton import next_pow2
    ptr = lambda t: f"*{t}"
    i32, i64, u1, f32 = "i32", "*i64", "*u1", "*fp32"
    cx = "constexpr"
    n, C, d, T, L = 4, 4096, 2048, 4, control.LOOKUP_MAX
    block_d = min(next_pow2(d), control_triton.ROW_BLOCK)
    out = []
    # a chain: cycle_open (post-step drafting: extra), cycle_candidate, cycle_commit
    draw_sig = dict(draws=f32, dr_b=i32, D=i32, HAS_DRAWS=cx, BLOCK_DR=cx)
    for dt, extra, draws in (("fp32", 0, True), ("bf16", 1, False)):
        out.append((f"control._open_kernel[{dt}-n{n}-extra{extra}{'-draws' * draws}]",
                    control_triton._open_kernel,
                    dict(state=i64, s_b=i32, units=i64, u_b=i32, u_n=i32, consts=i64, c_b=i32,
                         tokens=i64, t_b=i32, C=i32, anchors=ptr(dt), a_b=i32, a_m=i32,
                         a_c=i32, window=ptr(dt), w_b=i32, w_m=i32, w_k=i32, d=i32, tod=i64,
                         plan=i64, p_b=i32, **draw_sig, NS=cx, EXTRA=cx, MAXL=cx, BLOCK_N=cx,
                         BLOCK_L=cx, BLOCK_C=cx, BLOCK_D=cx, HEAD=cx),
                    dict(NS=n, EXTRA=extra, MAXL=L, BLOCK_N=next_pow2(n + 1),
                         BLOCK_L=next_pow2(L), BLOCK_C=min(next_pow2(C), 256), BLOCK_D=block_d,
                         HEAD=len(control.PLAN), HAS_DRAWS=draws, BLOCK_DR=4)))
    for tag, dt, has_p, has_q, has_ids, has_final in (
            ("greedy", None, False, False, False, False),
            ("gate-q-final-fp32", "fp32", True, True, False, True),
            ("gate-q-ids-final-bf16", "bf16", True, True, True, True)):
        out.append((f"control._candidate_kernel[{tag}]", control_triton._candidate_kernel,
                    dict(plan=i64, p_b=i32, draft=i64, draft_p=f32 if has_p else i64,
                         trust=f32 if has_p else i64, l_tok=i64, l_alive=u1, l_look=u1,
                         l_fill=i64, l_b=i32, cand=i64, c_b=i32, q=f32 if has_q else i64,
                         q_b=i32, q_ids=i64, Vq=i32, ring=f32 if has_q else i64, r_b=i32,
                         r_r=i32, Vr=i32, judged=f32 if has_q else i64, j_b=i32,
                         final=ptr(dt) if has_final else i64, f_b=i32, f_c=i32,
                         hidden=ptr(dt) if has_final else i64, h_b=i32, d=i32, NS=cx,
                         HAS_P=cx, HAS_Q=cx, HAS_IDS=cx, HAS_FINAL=cx, BLOCK=cx),
                    dict(NS=n, HAS_P=has_p, HAS_Q=has_q, HAS_IDS=has_ids, HAS_FINAL=has_final,
                         BLOCK=control_triton.ROW_BLOCK)))
    H = len(control.UNIT) + 1
    for dt, has_acc in (("fp32", False), ("bf16", True)):
        out.append((f"control._commit_kernel[{dt}-{'sampled' if has_acc else 'greedy'}]",
                    control_triton._commit_kernel,
                    dict(state=i64, s_b=i32, units=i64, u_b=i32, u_n=i32, consts=i64, c_b=i32,
                         plan=i64, p_b=i32, cand=i64, ca_b=i32, l_tok=i64, l_alive=u1,
                         l_look=u1, l_fill=i64, l_b=i32, tokens=i64, t_b=i32, emb=ptr(dt),
                         e_b=i32, e_c=i32, weight=ptr(dt), w_v=i32, d=i32, stops=i64,
                         st_b=i32, T=i32, verdict=i64, accepted=u1 if has_acc else i64,
                         margin=i32, NS=cx, H=cx, HAS_ACC=cx, BLOCK_N=cx, BLOCK_H=cx,
                         BLOCK_T=cx, BLOCK_D=cx, HEAD=cx, FIELDS=cx),
                    dict(NS=n, H=H, HAS_ACC=has_acc, BLOCK_N=next_pow2(n), BLOCK_H=next_pow2(H),
                         BLOCK_T=next_pow2(T), BLOCK_D=block_d, HEAD=len(control.PLAN),
                         FIELDS=len(control.STATE))))
    # a token tree: tree_open, tree_children, tree_commit
    for W, dt, extra in ((1, "fp32", 0), (4, "bf16", 1)):
        RW = (n + 1) * W
        out.append((f"tree_control._open_kernel[{dt}-n{n}-W{W}-extra{extra}]",
                    tree_control_triton._open_kernel,
                    dict(state=i64, s_b=i32, units=i64, u_b=i32, u_n=i32, consts=i64, c_b=i32,
                         l_tok=i64, l_alive=u1, l_score=f32, l_b=i32, l_anc=i64, la_b=i32,
                         l_clane=i64, lc_b=i32, tokens=i64, t_b=i32, C=i32, anchors=ptr(dt),
                         a_b=i32, a_m=i32, a_c=i32, window=ptr(dt), w_b=i32, w_m=i32, w_k=i32,
                         d=i32, tod=i64, tplan=i64, p_b=i32, mask=u1, m_b=i32, m_r=i32,
                         **draw_sig, NS=cx, W=cx, EXTRA=cx, MAXL=cx, BLOCK_N=cx,
                         BLOCK_W=cx, BLOCK_RW=cx, BLOCK_L=cx, BLOCK_C=cx, BLOCK_D=cx, HEAD=cx),
                    dict(NS=n, W=W, EXTRA=extra, MAXL=L, BLOCK_N=next_pow2(n + 1),
                         BLOCK_W=next_pow2(W), BLOCK_RW=next_pow2(RW), BLOCK_L=next_pow2(L),
                         BLOCK_C=min(next_pow2(C), 256), BLOCK_D=block_d,
                         HEAD=len(tree_control.TPLAN), HAS_DRAWS=True,
                         BLOCK_DR=next_pow2(W + 2))))
    for W, dt in ((1, None), (4, "bf16")):
        kc = W
        out.append((f"tree_control._children_kernel[n{n}-W{W}-k{kc}"
                    f"{'-final-' + dt if dt else ''}]", tree_control_triton._children_kernel,
                    dict(tplan=i64, p_b=i32, l_tok=i64, l_alive=u1, l_look=u1, l_score=f32,
                         l_b=i32, l_anc=i64, la_b=i32, l_fill=i64, lf_b=i32, top=f32,
                         tp_b=i32, tp_w=i32, top_ids=i64, ti_b=i32, ti_w=i32, pmax=f32,
                         pm_b=i32, trust=f32, log_trust=f32, kids=i64, k_b=i32, k_w=i32,
                         kid_score=f32, ks_b=i32, judge=i64, j_b=i32,
                         final=ptr(dt) if dt else i64, f_b=i32, f_c=i32,
                         hidden=ptr(dt) if dt else i64, h_b=i32, d=i32, NS=cx, W=cx, KC=cx,
                         HAS_FINAL=cx, BLOCK_W=cx, BLOCK_S=cx, BLOCK_R=cx, BLOCK=cx),
                    dict(NS=n, W=W, KC=kc, HAS_FINAL=dt is not None, BLOCK_W=next_pow2(W),
                         BLOCK_S=next_pow2(1 + W * kc), BLOCK_R=next_pow2(n + 1),
                         BLOCK=control_triton.ROW_BLOCK)))
    for W, dt, has_acc in ((1, "fp32", False), (4, "bf16", True)):
        H = tree_control.tree_unit_size(n, W)
        out.append((f"tree_control._commit_kernel[{dt}-n{n}-W{W}-"
                    f"{'sampled' if has_acc else 'greedy'}]", tree_control_triton._commit_kernel,
                    dict(state=i64, s_b=i32, units=i64, u_b=i32, u_n=i32, consts=i64, c_b=i32,
                         tplan=i64, p_b=i32, kids=i64, k_b=i32, k_w=i32, kid_score=f32,
                         ks_b=i32, judge=i64, j_b=i32, l_tok=i64, l_par=i64, l_score=f32,
                         l_alive=u1, l_look=u1, l_b=i32, l_anc=i64, la_b=i32, l_clane=i64,
                         l_fill=i64, lc_b=i32, tokens=i64, t_b=i32, anchors=ptr(dt), a_b=i32,
                         a_m=i32, a_c=i32, m=i32, weight=ptr(dt), w_v=i32, d=i32, stops=i64,
                         st_b=i32, T=i32, verdict=i64, accepted=i64, margin=i32,
                         NS=cx, W=cx, H=cx, HAS_ACC=cx, BLOCK_N=cx, BLOCK_W=cx, BLOCK_R=cx,
                         BLOCK_NW=cx, BLOCK_H=cx, BLOCK_T=cx, BLOCK_D=cx, HEAD=cx, FIELDS=cx,
                         UH=cx),
                    dict(NS=n, W=W, H=H, HAS_ACC=has_acc, BLOCK_N=next_pow2(n + 1),
                         BLOCK_W=next_pow2(W), BLOCK_R=next_pow2(n + 1),
                         BLOCK_NW=next_pow2(n * W), BLOCK_H=next_pow2(H),
                         BLOCK_T=next_pow2(T), BLOCK_D=block_d, HEAD=len(tree_control.TPLAN),
                         FIELDS=len(control.STATE), UH=len(control.UNIT))))
    return out


def compile_for_gpu(arch: int = 90) -> dict[str, str]:
    """Compile every Triton kernel variant to a cubin for sm_<arch> without a GPU (Triton's own
    ptxas). Needs TRITON_INTERPRET unset when spd_kernels was imported. Returns name -> "ok" or
    the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRET:
        raise RuntimeError("compile_for_gpu needs TRITON_INTERPRET unset at import time")
    results = {}
    for name, kernel, signature, constexprs in _variants():
        try:
            src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
            # PDL: the kernel must wait for its predecessor (griddepcontrol.wait), else not
            waits = "griddepcontrol.wait" in compiled.asm.get("ptx", "")
            if not compiled.asm.get("cubin"):
                results[name] = "no cubin"
            elif waits != bool(constexprs.get("PDL")):
                results[name] = f"griddepcontrol.wait {'without PDL' if waits else 'missing'}"
            else:
                results[name] = "ok"
        except Exception as exc:  # report every variant, not just the first failure
            results[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return results


if __name__ == "__main__":  # python -m spd_kernels.testing: compile check, one line per kernel
    import sys
    res = compile_for_gpu(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
    for k, v in res.items():
        print(f"{k}: {v}")
    sys.exit(0 if all(v == "ok" for v in res.values()) else 1)
