#!/usr/bin/env bash
# Everything a lent GPU should run, in one call, within a short device budget (~8 minutes):
#   1. the environment (nvidia-smi, torch, triton)            -> $OUT/env.txt
#   2. build the CUDA extension in place (nvcc, sm_90 + PTX)   -> $OUT/build.log
#   3. the gpu-marked tests with compiled Triton kernels        -> $OUT/gpu-tests.{log,xml}
#   4. kernel microbenchmarks at Qwen3-4B shapes                -> $OUT/<date>-kernels-<dev>.json
#   5. is drafting hidden? (PDM draft + verify vs one stage,
#      Qwen3-4B shapes, n = 4, 8, L_s = 2, 3, eager and graph) -> $OUT/<date>-draft-hiding-<dev>.json
#   6. the rest of the kernel tests compiled, if time is left   -> $OUT/kernel-tests.log
# Each step has its own time limit, so one that hangs cannot eat the others; a summary table is
# printed last. No install is needed: the code runs from the working tree (PYTHONPATH).
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
step() {  # step NAME LIMIT_S LOG CMD...
    local name=$1 limit=$2 log=$3; shift 3
    local t0=$SECONDS
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    printf '%-22s rc=%-4s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(basename "$log")" \
        | tee -a "$SUMMARY"
}

if [[ -n "${SPD_DEVICE_SMOKE:-}" ]]; then  # a CPU check of this script: tiny and quick
    export TRITON_INTERPRET=1 SPD_SKIP_CUDA_BUILD=1
    DEV=cpu
    KERNEL_ARGS=(--models smollm2-135m --ops verify_greedy,truncate_kv,fused_linear --iters 1 --warmup 0
                 --compile off)
    HIDING_ARGS=(--model smollm2-135m --stages 2 --pdm-layers 1 --iters 1 --context 64)
else
    DEV=$("$PY" - <<'EOF'
import torch
name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
print(next((k for k in ("h200", "h100", "a100", "b200") if k in name), "gpu" if name != "cpu" else "cpu"))
EOF
)
    KERNEL_ARGS=(--models qwen3-4b --compile off --iters 20)
    HIDING_ARGS=(--model qwen3-4b --stages 4,8 --pdm-layers 2,3 --pdm-intermediate 9728,4864
                 --iters 50)
fi

{ nvidia-smi 2>&1 || echo "no nvidia-smi"; "$PY" -c "
import torch, triton, transformers
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)
print('cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1

step build 240 "$OUT/build.log" "$PY" setup.py build_ext --inplace
step gpu-tests 240 "$OUT/gpu-tests.log" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider \
    --junitxml "$OUT/gpu-tests.xml" tests/test_kernels_*.py tests/test_pdm_graphs.py \
    tests/test_distributed.py
step bench-kernels 180 "$OUT/bench-kernels.log" "$PY" benchmarks/bench_kernels.py \
    "${KERNEL_ARGS[@]}" --json-out "$OUT/$DATE-kernels-$DEV.json"
step draft-hiding 120 "$OUT/draft-hiding.log" "$PY" benchmarks/bench_draft_hiding.py \
    "${HIDING_ARGS[@]}" --json-out "$OUT/$DATE-draft-hiding-$DEV.json"
step kernel-tests 150 "$OUT/kernel-tests.log" "$PY" -m pytest -q -x -m "not gpu" \
    -p no:cacheprovider tests/test_kernels_*.py

echo "---- gpu tests";      tail -n 15 "$OUT/gpu-tests.log"
echo "---- kernel targets"; grep -E "^target:" "$OUT/bench-kernels.log" || tail -n 5 "$OUT/bench-kernels.log"
echo "---- draft hiding";   tail -n 12 "$OUT/draft-hiding.log"
echo "---- kernel tests";   tail -n 3 "$OUT/kernel-tests.log"
echo "---- steps";          cat "$SUMMARY"
