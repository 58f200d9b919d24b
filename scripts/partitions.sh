#!/usr/bin/env bash
# Runs N random nemesis schedules (default 200) on the cluster in a box: one replicated shard, the witness and two
# workers, each in its own network namespace; cuts one way and both, an isolated witness, flapping links, pauses and
# kills of every process, kills during partitions (bench/tests/partition.rs). Each schedule's nodes record their
# histories and the checker reads them. Needs root (network namespaces, iptables). About 15 s a schedule.
#   scripts/partitions.sh [N [FIRST]]         N schedules from seed FIRST (default 0)
#   TETHER_PARTITION_SEED=S scripts/partitions.sh   replay one
# TETHER_TEST_KEEP_LOGS=DIR keeps the last schedule's logs and histories.
set -euo pipefail
cd "$(dirname "$0")/.."
export TETHER_PARTITION_SCHEDULES="${1:-200}"
export TETHER_PARTITION_FIRST="${2:-0}"
# --workspace keeps the unified features of `cargo test --workspace`, so nothing compiles again.
exec cargo test --workspace --test partition nemesis_schedules -- --nocapture
