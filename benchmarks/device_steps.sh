# Sourced by the device scripts (device_session.sh, device_train.sh) from the repository root:
# their common settings, and `step`, which runs one command inside the session's time budget and
# logs one line of it to $SUMMARY.
#   cd "$(dirname "$0")/.."; source benchmarks/device_steps.sh; SUMMARY=$OUT/summary.txt
#   step NAME CAP_S LOG CMD...   # CMD for at most min(CAP_S, time left - 25 s); returns its rc
OUT="${OUT:-/tmp/spd-device-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DATE="${SPD_DATE:-$(date +%F)}"
BUDGET="${SPD_DEVICE_BUDGET:-560}"
export PYTHONPATH="$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

step() {
    local name=$1 cap=$2 log=$3; shift 3
    local left=$((BUDGET - SECONDS - 25)) t0=$SECONDS rc
    local limit=$(( cap < left ? cap : left ))
    if (( limit < 10 )); then
        printf '%-26s skipped: %ss of the budget left\n' "$name" "$((BUDGET - SECONDS))" \
            | tee -a "$SUMMARY"
        return 1
    fi
    timeout -k 5 "$limit" "$@" > "$log" 2>&1
    rc=$?
    printf '%-26s rc=%-4s %4ss of %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" \
        "$(basename "$log")" | tee -a "$SUMMARY"
    return $rc
}
