#!/usr/bin/env bash
# Many-worker runs on the link harness (issue 38): `tether-bench scale` puts 64 tether-worker processes and 8 shards,
# each with a standby, and the witness on 8 network-namespace hosts, each behind its own tbf-shaped link, training
# the quickstart's MLP on Fashion-MNIST with the quickstart's sync (BSP rounds of 16 local Adam steps, topk2 both
# ways, outer Nesterov 1.4/0.5) and a quorum of 3/4 (48), global batch 512 (8 per worker). Runs, one after the
# other: links at 1 Gbit/s; at 100 Mbit/s; at 1 Gbit/s with a random worker or shard node SIGKILLed every 10 s
# (started again 1 s later); at 1 Gbit/s with host 1 (shard 1's primary, shard 0's standby, 8 workers) cut off from
# every other host for 10 s from 10 s in; and the reference, 4 workers × 2 shards with standbys on 8 hosts at
# 1 Gbit/s (batch 128: the same global batch and samples). Needs root.
#
# Knobs: BIN (target/release: tether-bench, tether-server, tether-worker; build them with
# `cargo build --release -p tether-bench -p tether-server -p tether-worker`), EPOCHS (5), RUNS (all: "1g 100m kill
# cut ref"), OUT (bench/results/scale-<date>.jsonl: one JSON report per run, appended), KEEP (a folder: keep each
# run's logs, reports and histories under it).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
EPOCHS=${EPOCHS:-5}
RUNS=${RUNS:-1g 100m kill cut ref}
OUT=${OUT:-bench/results/scale-$(date +%Y-%m-%d).jsonl}
mkdir -p "$(dirname "$OUT")"
for b in tether-bench tether-server tether-worker; do
  [ -x "$BIN/$b" ] || { echo "scale: $BIN/$b is missing" >&2; exit 2; }
done
run() { # NAME FLAGS...
  local name=$1; shift
  local dir=()
  [ -n "${KEEP:-}" ] && dir=(--dir "$KEEP/$name")
  echo "== $name: tether-bench scale $*" >&2
  "$BIN/tether-bench" scale --bin-dir "$BIN" --epochs "$EPOCHS" --json "$OUT" "${dir[@]}" "$@"
}
for r in $RUNS; do
  case $r in
    1g) run 1g --hosts 8 --workers 64 --shards 8 --rate-mbit 1000 ;;
    100m) run 100m --hosts 8 --workers 64 --shards 8 --rate-mbit 100 ;;
    kill) run kill --hosts 8 --workers 64 --shards 8 --rate-mbit 1000 --kill-every 10 ;;
    cut) run cut --hosts 8 --workers 64 --shards 8 --rate-mbit 1000 --cut-host 1 --cut-at 10 --cut-for 10 ;;
    ref) run ref --hosts 8 --workers 4 --shards 2 --rate-mbit 1000 ;;
    *) echo "scale: unknown run $r" >&2; exit 2 ;;
  esac
done
echo "scale: reports appended to $OUT" >&2
