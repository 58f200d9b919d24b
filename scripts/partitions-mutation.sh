#!/usr/bin/env bash
# The partition checker's mutation run: builds the cluster in a box with tether-server's `mutation-unfenced` feature
# (the fence still elects, but a node serves whether or not it holds the lease, never steps down, and releases
# replies as soon as its standby is gone: the design before the fence) in its own target folder, then runs the
# nemesis schedules against it. The checker must fail; this script exits 0 only if it did, and prints on which
# schedules. Needs root (network namespaces, iptables).
#   scripts/partitions-mutation.sh [N [FIRST]]    N schedules (default 10) from seed FIRST (default 0)
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/mutation}"
features=(--features tether-server/mutation-unfenced)
cargo build -p tether-server -p tether-worker --bins "${features[@]}" || exit 2
export TETHER_PARTITION_SCHEDULES="${1:-10}"
export TETHER_PARTITION_FIRST="${2:-0}"
log="$CARGO_TARGET_DIR/partitions-mutation.log"
cargo test -p tether-bench --test partition "${features[@]}" nemesis_schedules -- --nocapture 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
echo "--- schedules the checker failed:"
grep -E '^seed [0-9]+: .*: [1-9][0-9]* violation' "$log" || true
if [ "$status" -eq 0 ]; then
    echo "the checker passed every schedule of the unfenced build: it did not catch the mutation" >&2
    exit 1
fi
echo "the checker caught the mutation"
