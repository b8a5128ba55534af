#!/usr/bin/env bash
# Everything a lent GPU should run, in one call, inside a short device budget:
#   1. the environment (nvidia-smi, torch, triton)            -> env.txt
#   2. build the CUDA extension in place (nvcc, sm_90 + PTX)   -> build.log
#   2b. the single-process engine's decode under CUDA's sync debug mode set to raise, greedy
#      and sampled, rollbacks included (tests/runtime/test_gpu_no_sync.py; one GPU) -> no-sync.log
#   3. the stage step and the AR step against their floors (graphed one-row stage of 3, 5, 9
#      layers, attention at 1k context, the whole-model AR step; Qwen3-4B and Qwen3-8B shapes)
#                                                               -> $OUT/<date>-stage-<dev>.json
#   3b. kernel microbenchmarks at Qwen3-4B shapes, the kernels the automatic choice runs (the two
#      open targets, PDM step and anchor projection, first)  -> bench-automatic.{log,json}
#   4. the same for the on-request kernels of those two ops (the whole step on the CUDA kernels,
#      the tensor-core anchor variant, programmatic dependent launch), one process per op
#                                                               -> bench-on-request-<op>.{log,json}
#   5. the gpu-marked tests with compiled Triton kernels        -> gpu-tests.{log,xml}
#      (pytest-xdist workers when installed, a per-test timeout when pytest-timeout is; a test
#       that faults a kernel fails alone, tests/cuda_guard.py)
#   6. the on-request rows of the step's other ops, one process per op
#   7. 3, 4 and 6 merged, targets and challengers over all rows -> $OUT/<date>-kernels-<dev>.json
#      (and where a kernel lost the CUDA context: its op once more under compute-sanitizer)
#   8. is drafting hidden? (PDM draft + verify vs one stage,
#      Qwen3-4B shapes, n = 4, 8, L_s = 2, 3, eager and graph) -> $OUT/<date>-draft-hiding-<dev>.json
#   8a. the draft step against the stage step like for like: both graphed, each against its
#      bytes / the measured copy bandwidth, beside the bytes-only projection (Qwen3-4B and
#      Qwen3-8B shapes, n = 4, 8, L_s = 1, 2, 3, Vd = 16k, 32k; bf16 and int8 drafts; the
#      draft-on-stage-0 split)                                  -> $OUT/<date>-draft-<dev>.json
#   8b. the distributed protocol's own cost per cycle, n + 1 processes and n (the draft rank in
#      stage 0's process, --draft-on-stage), compute emulated by a fixed wait of
#      F = 300, 600 us (ranks share the one GPU over gloo, so the wait is a host sleep:
#      spin kernels of different processes would be time-sliced) -> $OUT/<date>-protocol-<dev>.json
#   8c. token trees (tree drafting, W = 1, 2, 4, 8): the W-row tree step of the largest stage
#      against the one-row chain step (eager and graphed) at 512 cached positions, then the
#      acceptance of width-W trees on 12 held-out prompts (the default model, n = 4, 8, the
#      engine's drafter, greedy, every output checked against AR; stage rows first, so a run
#      cut by its cap keeps them)                              -> $OUT/<date>-tree-<dev>.json
#   9. the rest of the kernel tests compiled, if time is left   -> kernel-tests.log
#  10. torch.compile of four references, if time is left         -> <date>-kernels-compile-<dev>.json
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
    AUTO_OPS=verify_greedy,truncate_kv,fused_linear
    FIRST_TRIALS=(truncate_kv)
    MORE_TRIALS=(fused_linear)
    HIDING_ARGS=(--model smollm2-135m --stages 2 --pdm-layers 1 --iters 1 --context 64)
    DRAFT_ARGS=(--models qwen3-4b --stages 4 --pdm-layers 1 --draft-vocab 16384 --iters 1
                --warmup 0 --context 64)
    STAGE_ARGS=(--models smollm2-135m --layers 2 --context 64 --iters 1 --warmup 0)
    KERNEL_TESTS=(tests/kernels/test_kv_truncate.py)
    COMPILE_ARGS=(--models smollm2-135m --ops truncate_kv --iters 1 --warmup 0 --compile on)
    PROTOCOL_ARGS=(--device cpu --stages 2 --emulate-ms 2 --draft-on-stage none,0
                   --max-new-tokens 8)
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
    AUTO_OPS=pdm_step,anchor_projection,fused_linear,fused_swiglu,cache_attention,qkv_rope_append,truncate_kv,rejection_sample_logits,verify_greedy
    FIRST_TRIALS=(pdm_step anchor_projection)
    MORE_TRIALS=(fused_linear fused_swiglu cache_attention qkv_rope_append rejection_sample_logits)
    HIDING_ARGS=(--model qwen3-4b --stages 4,8 --pdm-layers 2,3 --pdm-intermediate 9728,4864
                 --iters 50)
    STAGE_ARGS=(--models qwen3-4b,qwen3-8b --layers 3,5,9 --context 1024 --iters 50)
    DRAFT_ARGS=(--models qwen3-4b,qwen3-8b --stages 4,8 --pdm-layers 1,2,3
                --draft-vocab 16384,32768 --context 1024 --iters 30)
    KERNEL_TESTS=(tests/kernels/test_*.py)
    COMPILE_ARGS=(--models qwen3-4b --ops verify_greedy,anchor_projection,truncate_kv,fused_swiglu
                  --compile on --iters 20)
    PROTOCOL_ARGS=(--device cuda --backend gloo --stages 2,4,8 --emulate-ms 0.3,0.6
                   --draft-on-stage none,0 --max-new-tokens 48)
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

# the host emulation of the CUDA kernels (spd_kernels._spd_simt) is for machines without a GPU
SPD_SKIP_SIMT_BUILD=1 step build 150 "$LOGS/build.log" "$PY" setup.py build_ext --inplace
# a decode loop that never synchronises: short, and first, so a tight budget still checks it
step no-sync 120 "$LOGS/no-sync.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
    tests/runtime/test_gpu_no_sync.py
# the stage and AR steps first: the figures the stage-graphs issue is judged by
step stage 120 "$LOGS/stage.log" "$PY" benchmarks/bench_stage.py "${STAGE_ARGS[@]}" \
    --json-out "$OUT/$DATE-stage-$DEV.json"
step bench-automatic 150 "$LOGS/bench-automatic.log" "$PY" benchmarks/bench_kernels.py \
    "${KERNEL_ARGS[@]}" --rows automatic --ops "$AUTO_OPS" --json-out "$LOGS/bench-automatic.json"
bench_on_request 90 "${FIRST_TRIALS[0]}"  # the PDM step: compiles its PDL variants first
for op in "${FIRST_TRIALS[@]:1}"; do bench_on_request 45 "$op"; done
step gpu-tests 200 "$LOGS/gpu-tests.log" "$PY" -m pytest -q -m gpu -rfEs -p no:cacheprovider \
    "${PYTEST_EXTRA[@]}" --junitxml "$LOGS/gpu-tests.xml" tests/kernels/test_*.py \
    tests/draft/test_pdm_graphs.py tests/distributed/test_distributed.py \
    tests/model/test_stage_step.py tests/model/test_default_model.py tests/runtime/test_engine_tiny.py \
    tests/distributed/test_draft_on_stage.py tests/runtime/test_tree_drafting.py
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
step draft 150 "$LOGS/draft.log" "$PY" benchmarks/bench_draft.py "${DRAFT_ARGS[@]}" \
    --json-out "$OUT/$DATE-draft-$DEV.json"
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
echo "---- draft vs stage"; show draft.log | grep -E "measured|^model|^---" | head -n 30
echo "---- protocol";     show protocol.log | tail -n 22
echo "---- tree";           show tree.log | grep -vE "^wrote" | tail -n 26
echo "---- stage";          show stage.log | tail -n 16
echo "---- kernel tests";   show kernel-tests.log | tail -n 2
echo "---- steps";          cat "$SUMMARY"
