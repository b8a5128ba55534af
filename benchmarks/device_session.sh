#!/usr/bin/env bash
# Everything a lent GPU should run, in one call, inside a short device budget. In order of need
# (a step cut by the budget is skipped, the ones before it keep their results):
#   0. the environment (nvidia-smi, torch, triton)            -> env.txt
#   1. the one decode cycle's own cost in one process (benchmarks/bench_cycle.py): spin kernels
#      of F = 200 and 600 us per stage and draft step, n = 2, 4, 8, a chain and a token tree of
#      W = 4, greedy and sampled; cycle - F against 15 us    -> $OUT/<date>-cycle-<dev>.json
#      (first, and before the build: its host side is timed, and nvcc would share the cores)
#   2. build the CUDA extension IN THE BACKGROUND (nvcc, sm_90 + PTX; ~64 s on an H200), into a
#      staging folder, moved into spd_kernels/ in one rename when done: a benchmark starting
#      meanwhile sees the extension whole or not at all    -> build.log
#   3. while it builds, what runs on Triton alone:
#      3a. the graphed one-row stage step against its floor (3 and 9 layers, attention at 1k
#          context; Qwen3-4B and Qwen3-8B shapes), and the 9-layer stage step over B = 1, 2,
#          4, 8, 16 sequences' rows (issue 54)          -> $OUT/<date>-stage-<dev>.json
#      3b. the same stage rows with programmatic dependent launch (SPD_PDL=1)
#                                                          -> $OUT/<date>-stage-pdl-<dev>.json
#      3c. kernel microbenchmarks of the Triton ops the automatic choice runs (PDM step, dense
#          linear / SwiGLU, attention, QKV + RoPE)        -> bench-automatic-triton.{log,json}
#   4. wait for the build (the rest may pick CUDA kernels)
#   5. the gpu-marked tests with compiled Triton kernels and the built extension
#                                                          -> gpu-tests.{log,xml}
#      (pytest-xdist workers when installed, a per-test timeout when pytest-timeout is; a test
#       that faults a kernel fails alone, tests/cuda_guard.py)
#   6. the draft step against the stage step, both graphed, bf16, int8 and fp8 draft weights
#      (Qwen3-4B and Qwen3-8B shapes, n = 4, 8, L_s = 1, 3, Vd = 32k)
#                                                          -> $OUT/<date>-draft-<dev>.json
#   7. the whole-model AR step (its verify is a CUDA kernel) -> $OUT/<date>-stage-ar-<dev>.json
#   8. kernel microbenchmarks of the ops whose automatic choice is a CUDA kernel (anchor
#      projection, greedy verify, KV truncation)          -> bench-automatic-cuda.{log,json}
#   9. the on-request rows of the PDM step and the anchor projection, one process per op
#                                                          -> bench-on-request-<op>.{log,json}
#  10. the engine's decode under CUDA's sync debug mode set to raise: one process
#      (tests/runtime/test_gpu_no_sync.py), and over NCCL where there are 3+ GPUs (the
#      distributed tests named for it)                      -> no-sync.log
#  11. the on-request rows of the step's other ops, one process per op
#  12. 3c, 8, 9 and 11 merged, targets and challengers over all rows
#                                                          -> $OUT/<date>-kernels-<dev>.json
#      (and where a kernel lost the CUDA context: its op once more under compute-sanitizer)
#  13. if time is left: draft hiding, the distributed runtime's cost with emulated compute,
#      token trees, the rest of the kernel tests compiled, torch.compile of four references
#      (as before)
# A kernel never run on a GPU may fault, and a fault takes the process's CUDA context with it: so
# the on-request rows run apart from the automatic ones and one op per process, and a
# benchmark stops at a lost context (saying which row lost it) instead of filling its table with
# the same error. Each benchmark saves its JSON after every row, so a step stopped by its cap
# keeps its rows too.
# The whole run keeps inside SPD_DEVICE_BUDGET seconds (default 560): each step has its own cap
# and is also cut to the time left, so one that hangs cannot eat the others. The device tool
# brings back at most 8 files, so the logs travel as one $OUT/logs.tar.gz beside the JSONs
# and summary.txt; a summary table is printed last. No install is needed: the code runs from
# the working tree (PYTHONPATH).
#
#   OUT=/some/dir bash benchmarks/device_session.sh     # on the device machine
#   SPD_DEVICE_SMOKE=1 OUT=/tmp/x bash benchmarks/device_session.sh   # CPU: checks the script
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_steps.sh  # OUT, PY, DATE, BUDGET; step NAME CAP_S LOG CMD...
export TRITON_INTERPRET=0
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
LOGS="$OUT/logs"
mkdir -p "$LOGS"

if [[ -n "${SPD_DEVICE_SMOKE:-}" ]]; then  # a CPU check of this script: tiny and quick
    export TRITON_INTERPRET=1 SPD_SKIP_CUDA_BUILD=1
    DEV=cpu
    KERNEL_ARGS=(--models smollm2-135m --iters 1 --warmup 0 --compile off)
    TRITON_AUTO_OPS=fused_linear
    CUDA_AUTO_OPS=verify_greedy,truncate_kv
    FIRST_TRIALS=(truncate_kv)
    MORE_TRIALS=(fused_linear)
    HIDING_ARGS=(--model smollm2-135m --stages 2 --pdm-layers 1 --iters 1 --context 64)
    # --measure: the measured rows (bf16, int8 and fp8 drafts) run eagerly on the CPU too
    DRAFT_ARGS=(--models smollm2-135m --stages 2 --pdm-layers 1 --draft-vocab 8192 --iters 1
                --warmup 0 --context 64 --measure --draft-weights bf16,int8,fp8)
    STAGE_ARGS=(--models smollm2-135m --layers 2 --context 64 --iters 1 --warmup 0
                --rows stage,attention,batch --batches 1,4)
    STAGE_PDL_ARGS=(--models smollm2-135m --layers 1 --context 64 --iters 1 --warmup 0
                    --rows stage)
    AR_ARGS=(--models smollm2-135m --layers 1 --context 64 --iters 1 --warmup 0 --rows ar)
    KERNEL_TESTS=(tests/kernels/test_kv_truncate.py)
    COMPILE_ARGS=(--models smollm2-135m --ops truncate_kv --iters 1 --warmup 0 --compile on)
    PROTOCOL_ARGS=(--device cpu --stages 2 --emulate-ms 2 --draft-on-stage none,0
                   --max-new-tokens 8)
    CYCLE_ARGS=(--device cpu --n 2 --widths 1,4 --tokens 8)
    TREE_ARGS=(--device cpu --quick --limit 1 --max-new-tokens 8 --context 32 --iters 1
               --warmup 0 --rounds 1)
else
    DEV=$("$PY" - <<'EOF'
import torch
name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
print(next((k for k in ("h200", "h100", "a100", "b200") if k in name), "gpu" if name != "cpu" else "cpu"))
EOF
)
    KERNEL_ARGS=(--models qwen3-4b --compile off --iters 20)
    # the two open targets first: a step cut off by its time cap keeps the rows it saved
    # the automatic choice's Triton ops (timed while the extension builds), then its CUDA ones
    TRITON_AUTO_OPS=pdm_step,fused_linear,fused_swiglu,cache_attention,qkv_rope_append,rejection_sample_logits
    CUDA_AUTO_OPS=anchor_projection,verify_greedy,truncate_kv
    FIRST_TRIALS=(pdm_step anchor_projection)
    MORE_TRIALS=(fused_linear fused_swiglu cache_attention qkv_rope_append rejection_sample_logits)
    HIDING_ARGS=(--model qwen3-4b --stages 4,8 --pdm-layers 2,3 --pdm-intermediate 9728,4864
                 --iters 50)
    STAGE_ARGS=(--models qwen3-4b,qwen3-8b --layers 3,9 --context 1024 --iters 50
                --rows stage,attention,batch)
    STAGE_PDL_ARGS=(--models qwen3-4b,qwen3-8b --layers 9 --context 1024 --iters 50
                    --rows stage,attention)
    AR_ARGS=(--models qwen3-4b,qwen3-8b --layers 1 --context 1024 --iters 30 --rows ar)
    # bf16, int8 and fp8 drafts of one random PDM per config, each graphed
    DRAFT_ARGS=(--models qwen3-4b,qwen3-8b --stages 4,8 --pdm-layers 1,3
                --draft-vocab 32768 --context 1024 --iters 30 --draft-weights bf16,int8,fp8)
    KERNEL_TESTS=(tests/kernels/test_*.py)
    COMPILE_ARGS=(--models qwen3-4b --ops verify_greedy,anchor_projection,truncate_kv,fused_swiglu
                  --compile on --iters 20)
    PROTOCOL_ARGS=(--device cuda --backend gloo --stages 2,4,8 --emulate-ms 0.3,0.6
                   --draft-on-stage none,0 --max-new-tokens 48)
    CYCLE_ARGS=(--device cuda --n 2,4,8 --widths 1,4 --spin-us 200,600 --tokens 64)
    TREE_ARGS=(--device cuda --stages 4,8 --widths 1,2,4,8 --limit 12 --max-new-tokens 64
               --lookup default --context 512 --iters 30)
fi

{ nvidia-smi 2>&1 || echo "no nvidia-smi"; nproc; "$PY" -c "
import torch, triton, transformers
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)
print('cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; } > "$LOGS/env.txt" 2>&1

# Parallel test workers and a per-test timeout where the plugins are there (the device image has
# both); the GPU tests mostly wait on Triton's compiler, which is CPU work.
PYTEST_EXTRA=()
"$PY" -c "import xdist" 2>/dev/null && PYTEST_EXTRA+=(-n "${SPD_TEST_WORKERS:-8}")
# thread method: a test stuck in a CUDA call (a signal cannot interrupt it) ends its worker
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_EXTRA+=(--timeout 150 --timeout-method thread)

bench_on_request() {  # bench_on_request CAP OP: one op's on-request rows in a process of its own
    step "on-request-$2" "$1" "$LOGS/bench-on-request-$2.log" "$PY" benchmarks/bench_kernels.py \
        "${KERNEL_ARGS[@]}" --rows on-request --ops "$2" --json-out "$LOGS/bench-on-request-$2.json"
}

# 1. The one decode cycle's own cost: roles on streams, one graph a cycle, spin kernels of F
step cycle 120 "$LOGS/cycle.log" "$PY" benchmarks/bench_cycle.py "${CYCLE_ARGS[@]}" \
    --json-out "$OUT/$DATE-cycle-$DEV.json"

# 2. The CUDA extension, built in the background while the Triton rows run (no host emulation:
# spd_kernels._spd_simt is for machines without a GPU). Built into a staging folder, then each
# library copied beside its final name and renamed over it: a process importing spd_kernels
# meanwhile finds the extension whole or not at all (it then falls back to Triton, and says so).
BUILD_STAGE="build/device-ext"
rm -rf "$BUILD_STAGE"
BUILD_CMD='SPD_SKIP_SIMT_BUILD=1 "$0" setup.py build_ext --build-lib "$1/lib" --build-temp "$1/tmp" || exit $?
for f in "$1"/lib/spd_kernels/_spd_cuda*.so; do
    [[ -e $f ]] || continue
    n=$(basename "$f"); cp "$f" "spd_kernels/.$n.part" && mv -f "spd_kernels/.$n.part" "spd_kernels/$n" || exit 1
done'
( step build 240 "$LOGS/build.log" bash -c "$BUILD_CMD" "$PY" "$BUILD_STAGE" ) &
BUILD_PID=$!

# 3. Triton alone (the stage's ops, the attention, the PDM step): real stage steps at Qwen3-4B
# and Qwen3-8B shapes first
step stage 130 "$LOGS/stage.log" "$PY" benchmarks/bench_stage.py "${STAGE_ARGS[@]}" \
    --json-out "$OUT/$DATE-stage-$DEV.json"
SPD_PDL=1 step stage-pdl 60 "$LOGS/stage-pdl.log" "$PY" benchmarks/bench_stage.py \
    "${STAGE_PDL_ARGS[@]}" --json-out "$OUT/$DATE-stage-pdl-$DEV.json"
step bench-automatic-triton 100 "$LOGS/bench-automatic-triton.log" "$PY" \
    benchmarks/bench_kernels.py "${KERNEL_ARGS[@]}" --rows automatic --ops "$TRITON_AUTO_OPS" \
    --json-out "$LOGS/bench-automatic-triton.json"

# 4. the rest may run CUDA kernels: wait for the extension
wait "$BUILD_PID"
ls spd_kernels/_spd_cuda*.so >> "$LOGS/build.log" 2>&1 || echo "no extension built" >> "$LOGS/build.log"

# 5.-10.
step gpu-tests 150 "$LOGS/gpu-tests.log" "$PY" -m pytest -q -m gpu -rfEs -p no:cacheprovider \
    "${PYTEST_EXTRA[@]}" --junitxml "$LOGS/gpu-tests.xml" tests/kernels/test_*.py \
    tests/draft/test_pdm_graphs.py tests/distributed/test_distributed.py \
    tests/model/test_stage_step.py tests/model/test_default_model.py tests/runtime/test_engine_tiny.py \
    tests/distributed/test_draft_on_stage.py tests/runtime/test_tree_drafting.py \
    tests/runtime/test_quantized_drafter.py
step draft 110 "$LOGS/draft.log" "$PY" benchmarks/bench_draft.py "${DRAFT_ARGS[@]}" \
    --json-out "$OUT/$DATE-draft-$DEV.json"
step stage-ar 50 "$LOGS/stage-ar.log" "$PY" benchmarks/bench_stage.py "${AR_ARGS[@]}" \
    --json-out "$OUT/$DATE-stage-ar-$DEV.json"
step bench-automatic-cuda 40 "$LOGS/bench-automatic-cuda.log" "$PY" benchmarks/bench_kernels.py \
    "${KERNEL_ARGS[@]}" --rows automatic --ops "$CUDA_AUTO_OPS" \
    --json-out "$LOGS/bench-automatic-cuda.json"
bench_on_request 60 "${FIRST_TRIALS[0]}"  # the PDM step: compiles its PDL variants first
for op in "${FIRST_TRIALS[@]:1}"; do bench_on_request 40 "$op"; done
# one process, and the distributed tests named for it (over NCCL: they run where there are 3+
# GPUs); a test module that does not import leaves the others to run
step no-sync 60 "$LOGS/no-sync.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
    --continue-on-collection-errors -k "synchronis or no_sync" tests/runtime/test_gpu_no_sync.py \
    tests/distributed
# 11.-13. if time is left
for op in "${MORE_TRIALS[@]}"; do bench_on_request 35 "$op"; done
shopt -s nullglob
BENCH_JSONS=("$LOGS"/bench-*.json)
shopt -u nullglob
if (( ${#BENCH_JSONS[@]} )); then
    step bench-merge 30 "$LOGS/bench-merge.log" "$PY" benchmarks/bench_kernels.py \
        --merge "${BENCH_JSONS[@]}" --json-out "$OUT/$DATE-kernels-$DEV.json"
fi
# Where a kernel lost the context: that op's on-request rows once more, one call each, under
# compute-sanitizer, which names the kernel, the thread and the address of the bad access.
LOST_OPS=$(cat "$LOGS"/bench-on-request-*.log 2>/dev/null | awk '/^CUDA context lost at/ {print $6}' \
           | sort -u | paste -sd, -)
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [[ -n "$LOST_OPS" && -n "$SANITIZER" ]]; then
    step sanitize 90 "$LOGS/sanitize.log" "$SANITIZER" --tool memcheck --print-limit 10 \
        "$PY" benchmarks/bench_kernels.py "${KERNEL_ARGS[@]}" --rows on-request --ops "$LOST_OPS" \
        --iters 1 --warmup 0 --no-flush --json-out "$LOGS/sanitize.json"
fi
step draft-hiding 100 "$LOGS/draft-hiding.log" "$PY" benchmarks/bench_draft_hiding.py \
    "${HIDING_ARGS[@]}" --json-out "$OUT/$DATE-draft-hiding-$DEV.json"
step protocol 150 "$LOGS/protocol.log" "$PY" benchmarks/bench_protocol.py "${PROTOCOL_ARGS[@]}" \
    --json-out "$OUT/$DATE-protocol-$DEV.json"
step tree 150 "$LOGS/tree.log" "$PY" benchmarks/bench_tree.py "${TREE_ARGS[@]}" \
    --json-out "$OUT/$DATE-tree-$DEV.json"
step kernel-tests 150 "$LOGS/kernel-tests.log" "$PY" -m pytest -q -m "not gpu" -p no:cacheprovider \
    "${PYTEST_EXTRA[@]}" "${KERNEL_TESTS[@]}"

# torch.compile of the references, last: it only fills the comparison column
step bench-compile 120 "$LOGS/bench-compile.log" "$PY" benchmarks/bench_kernels.py \
    "${COMPILE_ARGS[@]}" --json-out "$LOGS/$DATE-kernels-compile-$DEV.json"

cp "$SUMMARY" "$LOGS/"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
show() { tar -xzOf "$OUT/logs.tar.gz" "logs/$1" 2>/dev/null; }
echo "---- cycle";          show cycle.log | tail -n 52
echo "---- no sync";        show no-sync.log | grep -E "^(FAILED|ERROR|SKIPPED)" | cut -c1-200
show no-sync.log | tail -n 1
echo "---- gpu tests";      show gpu-tests.log | grep -E "^(FAILED|ERROR)" | cut -c1-200 | head -n 25
show gpu-tests.log | tail -n 2
benches() { tar -xzOf "$OUT/logs.tar.gz" --wildcards 'logs/bench-*.log' 2>/dev/null; }
echo "---- kernel targets"; show bench-merge.log | grep -E "^(target|context lost):" | cut -c1-240
benches | grep -E "ERROR|^CUDA context lost" | cut -c1-240 | head -n 20
[[ -n "$LOST_OPS" ]] && { echo "---- sanitizer ($LOST_OPS)"; show sanitize.log | grep -E "^=========" | cut -c1-200 | head -n 30; }
echo "---- on request";     show bench-merge.log | grep -E "^challenger:" | cut -c1-150 | head -n 45
echo "---- step ops";       benches | grep -E "anchor_projection .*(cuda|triton)|verify_greedy|(qkv_rope_append|cache_attention|fused_linear|fused_swiglu|pdm_step) .*_cg" | cut -c1-110 | head -n 80
echo "---- draft hiding";   show draft-hiding.log | tail -n 12
echo "---- draft vs stage"; show draft.log | grep -E "measured|^model|^---" | head -n 40
echo "---- protocol";       show protocol.log | tail -n 30
echo "---- tree";           show tree.log | grep -vE "^wrote" | tail -n 26
echo "---- stage";          show stage.log | tail -n 12
echo "---- stage, PDL";     show stage-pdl.log | tail -n 6
echo "---- AR step";        show stage-ar.log | tail -n 4
echo "---- build";          show build.log | tail -n 3
echo "---- kernel tests";   show kernel-tests.log | tail -n 2
echo "---- steps";          cat "$SUMMARY"
