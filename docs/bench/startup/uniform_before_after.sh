#!/bin/bash
# Start-up of the uniform spec (8 distinct factor shapes at tp 1) before bounded tuning
# (commit 3f0b4cf, a worktree at $OLD) and now, interleaved: command to exit, seconds.
# Usage: uniform_before_after.sh SPEC CHECKPOINT OLD_WORKTREE NEW_CHECKOUT [REPS]
set -euo pipefail
spec=$1 ck=$2 old=$3 new=$4 reps=${5:-2}
run() {  # label folder tp cache -> one line
    local label=$1 dir=$2 tp=$3 cache=$4 t0 t1 answer
    t0=$(date +%s.%N)
    answer=$(cd "$dir" && DEINFER_CACHE_DIR=$cache python -m cli.main run --spec "$spec" \
        --checkpoint "$ck" --tp "$tp" --prompt "The capital of France is" --max-tokens 8 2>/dev/null)
    t1=$(date +%s.%N)
    printf '%s tp %s %.1f s %q\n' "$label" "$tp" "$(echo "$t1 - $t0" | bc)" "$answer"
}
for tp in 1 3; do
    for rep in $(seq "$reps"); do
        old_cache=$(mktemp -d) cold=$(mktemp -d)  # each version starts from nothing
        run before "$old" "$tp" "$old_cache"
        run "now-cold" "$new" "$tp" "$cold"
        run "now-warm" "$new" "$tp" "$cold"
        rm -rf "$old_cache" "$cold"
    done
done
