#!/usr/bin/env bash
# False takeovers under full CPU load: runs tests/faults.rs's `no_false_takeover_under_full_cpu_load` (one shard with
# its standby and the witness, two workers, two spinning threads keeping both cores busy) once per failover_ms value
# and prints one line per run: leases won, step-downs, takeovers, terms, the longest worker stall, and whether the
# test held (no step-down, no takeover, one term).
#
#   scripts/false-takeovers.sh [MS ...]        (default: 1000 500 300 200)
#
# Knobs: REPEATS (runs per value, default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
values=("$@")
[ ${#values[@]} -gt 0 ] || values=(1000 500 300 200)
cargo test -q -p tether --test faults --no-run
for ms in "${values[@]}"; do
  for ((i = 0; i < ${REPEATS:-1}; i++)); do
    out=$(TETHER_FAILOVER_MS=$ms cargo test -q -p tether --test faults no_false_takeover_under_full_cpu_load \
      -- --nocapture 2>&1 || true)
    line=$(grep -m1 "^failover_ms" <<<"$out" || echo "failover_ms $ms: no result line")
    if grep -q "test result: ok. 1 passed" <<<"$out"; then verdict=held; else verdict=FAILED; fi
    echo "$line => $verdict"
  done
done
