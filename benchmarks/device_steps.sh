# Sourced by the device scripts (device_session.sh, device_train.sh): `step`, which runs one
# command inside the session's time budget and logs one line of it to $SUMMARY.
#   BUDGET=560 SUMMARY=$OUT/summary.txt; source benchmarks/device_steps.sh
#   step NAME CAP_S LOG CMD...   # CMD for at most min(CAP_S, time left - 25 s); returns its rc
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
