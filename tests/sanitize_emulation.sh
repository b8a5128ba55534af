#!/usr/bin/env bash
# The CUDA kernels once more in their host emulation (spd_kernels._spd_simt), this time built
# with AddressSanitizer and the alignment check: an out-of-bounds or misaligned access in a kernel,
# which faults on a GPU or silently reads a neighbour's memory, stops the run with a report that
# names the kernel's source line. Runs the tests that launch the CUDA kernels (names with "cuda"
# or "emulation"). Called by .ci/run after the main test run; a few minutes on 2 cores. Skipped,
# saying why, where the emulation is not built or g++ has no sanitizer runtimes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! why=$("$PY" -c "from spd_kernels import _cuda; print(_cuda.simt_unavailable_reason() or '')") \
        || [[ -n "$why" ]]; then
    echo "sanitize_emulation: skipped: ${why:-spd_kernels does not import}"
    exit 0
fi
CXX="${CXX:-g++}"
asan=$("$CXX" -print-file-name=libasan.so)
ubsan=$("$CXX" -print-file-name=libubsan.so)
if [[ "$asan" != /* || "$ubsan" != /* ]]; then
    echo "sanitize_emulation: skipped: $CXX has no libasan / libubsan"
    exit 0
fi
mkdir -p build
echo "sanitize_emulation: building the emulation with sanitizers (build/simt-sanitized)"
if ! SPD_SIMT_SANITIZE=1 "$PY" setup.py build_ext --build-lib build/simt-sanitized \
        --build-temp build/tmp-sanitized > build/simt-sanitized.log 2>&1; then
    cat build/simt-sanitized.log
    exit 1
fi
lib=$(ls build/simt-sanitized/spd_kernels/_spd_simt*.so)
export SPD_SIMT_LIBRARY="$PWD/$lib" TRITON_INTERPRET=1 LD_PRELOAD="$asan:$ubsan" \
    ASAN_OPTIONS=detect_leaks=0:new_delete_type_mismatch=0:alloc_dealloc_mismatch=0 \
    UBSAN_OPTIONS=print_stacktrace=1

# Canaries first: a truncation kernel told of one cache more than the lengths hold (reads past
# the tensor), and a poison kernel given a buffer one byte off (misaligned bf16 stores), each
# through the raw binding. Both must be stopped with their report, or this run proves nothing.
canary() {  # canary WHAT EXPECTED: runs the python snippet on stdin, which must abort with EXPECTED
    local out
    if out=$("$PY" - 2>&1); then
        echo "sanitize_emulation: the $1 canary was not caught: the sanitizers are not active"
        exit 1
    fi
    if ! grep -q "$2" <<<"$out"; then
        echo "sanitize_emulation: the $1 canary failed without the expected report:"
        echo "$out" | tail -n 20
        exit 1
    fi
    echo "sanitize_emulation: $1 canary caught ($2)"
}
canary out-of-bounds heap-buffer-overflow <<'PYEOF'
import torch
from spd_kernels import _cuda
with _cuda.simulated() as sim:
    lengths, new = torch.full((4,), 9, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    sim.kv_truncate(lengths.data_ptr(), new.data_ptr(), 1, 5, 0)
PYEOF
canary misaligned "misaligned address" <<'PYEOF'
import torch
from spd_kernels import _cuda
from spd_kernels._triton import dtype_code
with _cuda.simulated() as sim:
    lengths, new = torch.full((1,), 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    buf = torch.zeros(64, dtype=torch.uint8)
    table = torch.tensor([buf.data_ptr() + 1], dtype=torch.int64)
    sim.kv_poison(lengths.data_ptr(), new.data_ptr(), 1, table.data_ptr(), 1, 1, 1, 8, 1,
                  dtype_code(torch.bfloat16), 0)
PYEOF

# --capture=sys: a report goes to file descriptor 2 just before the process aborts, and pytest's
# fd capture would swallow it. Python's own allocations are not checked (no leak check either).
"$PY" -m pytest -q --capture=sys -p no:cacheprovider tests/kernels/test_*.py -k "cuda or emulation"
