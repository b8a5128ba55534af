#!/usr/bin/env bash
# Everything a lent GPU should run, in one call, inside a short device budget:
#   1. the environment (nvidia-smi, torch, triton)            -> env.txt
#   2. build the CUDA extension in place (nvcc, sm_90 + PTX)   -> build.log
#   3. the gpu-marked tests with compiled Triton kernels        -> gpu-tests.{log,xml}
#      (pytest-xdist workers when installed, a per-test timeout when pytest-timeout is)
#   4. kernel microbenchmarks at Qwen3-4B shapes (but verify)   -> $OUT/<date>-kernels-<dev>.json
#      (the dense ops and the PDM step on Triton and on the CUDA kernel, each also as a graph,
#       and the CUDA kernels also as programmatic dependent launches: cuda_pdl(_cg))
#   5. is drafting hidden? (PDM draft + verify vs one stage,
#      Qwen3-4B shapes, n = 4, 8, L_s = 2, 3, eager and graph) -> $OUT/<date>-draft-hiding-<dev>.json
#   6. verify_greedy, once per CUDA kernel variant (SPD_VERIFY_VARIANT=0, 1, 2) -> verify-variant-*.json
#   7. the rest of the kernel tests compiled, if time is left   -> kernel-tests.log
#   8. torch.compile of four references, if time is left         -> <date>-kernels-compile-<dev>.json
# The whole run keeps inside SPD_DEVICE_BUDGET seconds (default 520): each step has its own cap
# and is also cut to the time left, so one that hangs cannot eat the others. The device tool
# brings back at most 8 files, so the logs travel as one $OUT/logs.tar.gz beside the two JSONs
# and summary.txt; a summary table is printed last. No install is needed: the code runs from
# the working tree (PYTHONPATH).
#
#   OUT=/some/dir bash benchmarks/device_session.sh     # on the device machine
#   SPD_DEVICE_SMOKE=1 OUT=/tmp/x bash benchmarks/device_session.sh   # CPU: checks the script
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/spd-device-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DATE="${SPD_DATE:-$(date +%F)}"
export PYTHONPATH="$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
BUDGET="${SPD_DEVICE_BUDGET:-520}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
step() {  # step NAME CAP_S LOG CMD...: run CMD for at most min(CAP_S, time left - 25 s)
    local name=$1 cap=$2 log=$3; shift 3
    local left=$((BUDGET - SECONDS - 25)) t0=$SECONDS rc
    local limit=$(( cap < left ? cap : left ))
    if (( limit < 10 )); then
        printf '%-22s skipped: %ss of the budget left\n' "$name" "$((BUDGET - SECONDS))" \
            | tee -a "$SUMMARY"
        return
    fi
    timeout -k 5 "$limit" "$@" > "$log" 2>&1
    rc=$?
    printf '%-22s rc=%-4s %4ss of %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" \
        "$(basename "$log")" | tee -a "$SUMMARY"
}

if [[ -n "${SPD_DEVICE_SMOKE:-}" ]]; then  # a CPU check of this script: tiny and quick
    export TRITON_INTERPRET=1 SPD_SKIP_CUDA_BUILD=1
    DEV=cpu
    KERNEL_ARGS=(--models smollm2-135m --ops verify_greedy,truncate_kv,fused_linear --iters 1 --warmup 0
                 --compile off)
    HIDING_ARGS=(--model smollm2-135m --stages 2 --pdm-layers 1 --iters 1 --context 64)
    KERNEL_TESTS=(tests/test_kernels_kv_truncate.py)
    COMPILE_ARGS=(--models smollm2-135m --ops truncate_kv --iters 1 --warmup 0 --compile on)
else
    DEV=$("$PY" - <<'EOF'
import torch
name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
print(next((k for k in ("h200", "h100", "a100", "b200") if k in name), "gpu" if name != "cpu" else "cpu"))
EOF
)
    # verify_greedy runs on its own below, once per CUDA kernel variant (a crash there cannot
    # take the other rows with it)
    # the two open targets first: a step cut off by its time cap keeps the rows it printed
    KERNEL_ARGS=(--models qwen3-4b --compile off --iters 20 --ops pdm_step,anchor_projection,fused_linear,fused_swiglu,cache_attention,qkv_rope_append,truncate_kv,rejection_sample_logits)
    HIDING_ARGS=(--model qwen3-4b --stages 4,8 --pdm-layers 2,3 --pdm-intermediate 9728,4864
                 --iters 50)
    KERNEL_TESTS=(tests/test_kernels_*.py)
    COMPILE_ARGS=(--models qwen3-4b --ops verify_greedy,anchor_projection,truncate_kv,fused_swiglu
                  --compile on --iters 20)
fi

{ nvidia-smi 2>&1 || echo "no nvidia-smi"; nproc; "$PY" -c "
import torch, triton, transformers
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)
print('cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; } > "$LOGS/env.txt" 2>&1

# Parallel test workers and a per-test timeout where the plugins are there (the device image has
# both); the GPU tests mostly wait on Triton's compiler, which is CPU work.
PYTEST_EXTRA=()
"$PY" -c "import xdist" 2>/dev/null && PYTEST_EXTRA+=(-n "${SPD_TEST_WORKERS:-8}")
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_EXTRA+=(--timeout 150)

# the host emulation of the CUDA kernels (spd_kernels._spd_simt) is for machines without a GPU
SPD_SKIP_SIMT_BUILD=1 step build 150 "$LOGS/build.log" "$PY" setup.py build_ext --inplace
step gpu-tests 200 "$LOGS/gpu-tests.log" "$PY" -m pytest -q -m gpu -rfEs -p no:cacheprovider \
    "${PYTEST_EXTRA[@]}" --junitxml "$LOGS/gpu-tests.xml" tests/test_kernels_*.py \
    tests/test_pdm_graphs.py tests/test_distributed.py
step bench-kernels 150 "$LOGS/bench-kernels.log" "$PY" benchmarks/bench_kernels.py \
    "${KERNEL_ARGS[@]}" --json-out "$OUT/$DATE-kernels-$DEV.json"
step draft-hiding 100 "$LOGS/draft-hiding.log" "$PY" benchmarks/bench_draft_hiding.py \
    "${HIDING_ARGS[@]}" --json-out "$OUT/$DATE-draft-hiding-$DEV.json"
if [[ -z "${SPD_DEVICE_SMOKE:-}" ]]; then  # the greedy-verify CUDA kernel's other shapes
    for vv in 0 1 2; do  # (SPD_VERIFY_VARIANT is read once per process)
        step "verify-variant-$vv" 40 "$LOGS/verify-variant-$vv.log" env SPD_VERIFY_VARIANT=$vv \
            "$PY" benchmarks/bench_kernels.py --models qwen3-4b --ops verify_greedy \
            --compile off --iters 20 --json-out "$LOGS/verify-variant-$vv.json"
    done
fi
step kernel-tests 150 "$LOGS/kernel-tests.log" "$PY" -m pytest -q -m "not gpu" -p no:cacheprovider \
    "${PYTEST_EXTRA[@]}" "${KERNEL_TESTS[@]}"

# torch.compile of the references, last: it only fills the comparison column
step bench-compile 120 "$LOGS/bench-compile.log" "$PY" benchmarks/bench_kernels.py \
    "${COMPILE_ARGS[@]}" --json-out "$LOGS/$DATE-kernels-compile-$DEV.json"

cp "$SUMMARY" "$LOGS/"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
show() { tar -xzOf "$OUT/logs.tar.gz" "logs/$1" 2>/dev/null; }
echo "---- gpu tests";      show gpu-tests.log | grep -E "^(FAILED|ERROR)" | cut -c1-200 | head -n 25
show gpu-tests.log | tail -n 2
echo "---- kernel targets"; show bench-kernels.log | grep -E "^target:|ERROR" | cut -c1-240
echo "---- on request";     show bench-kernels.log | grep -E "^challenger:" | cut -c1-150 | head -n 45
echo "---- step ops";       show bench-kernels.log | grep -E "anchor_projection .*(cuda|triton)|(qkv_rope_append|cache_attention|fused_linear|fused_swiglu|pdm_step) .*_cg" | cut -c1-110 | head -n 80
echo "---- verify variants"; for vv in 0 1 2; do show verify-variant-$vv.log | grep -E "verify_greedy|ERROR|Error" | cut -c1-120 | sed "s/^/v$vv /"; done
echo "---- draft hiding";   show draft-hiding.log | tail -n 12
echo "---- kernel tests";   show kernel-tests.log | tail -n 2
echo "---- steps";          cat "$SUMMARY"
