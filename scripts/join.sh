#!/usr/bin/env bash
# Elastic membership (issue 24): does a worker that joins mid-run add its samples per second to the cluster's? On the
# release binaries (`cargo build --release -p tether-server -p tether-worker`), 2 shards on 127.0.0.1 train the MLP
# on Fashion-MNIST with the quickstart's sync (BSP rounds of 16 local steps, topk2 both ways) and
# `cluster.workers = 1`, `cluster.max_workers = 2`, one compute thread per worker (this box has 2 cores: one per
# worker). First rank 0 alone; then rank 0 with rank 1 joining JOIN_AFTER seconds in (its bundle issued with
# `keygen issue`; it reads share 1 mod 1 = 0 in its own order). Prints each worker's samples per second
# (steps × batch / its wall time) and the cluster's, and rank 0's final accuracy.
#
#   scripts/join.sh          knobs: BIN (target/release), EPOCHS (10), JOIN_AFTER (2), QUORUM (0)
set -euo pipefail
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
EPOCHS=${EPOCHS:-10}
JOIN_AFTER=${JOIN_AFTER:-2}
QUORUM=${QUORUM:-0}
for b in tether-server tether-worker; do
  [ -x "$BIN/$b" ] || { echo "join: $BIN/$b is missing (cargo build --release -p $b)" >&2; exit 2; }
done
D=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$D"' EXIT
"$BIN/tether-server" keygen --out "$D/certs" --servers 2 --workers 1 >/dev/null
"$BIN/tether-server" keygen issue --ca "$D/certs/ca" --out "$D/certs" --worker 1 >/dev/null

# run NAME WORKERS: one cluster in $D/NAME with ranks 0..WORKERS-1 (rank 1 joins JOIN_AFTER s after rank 0).
run() {
  local name=$1 n=$2 dir="$D/$1" p0=$((20000 + RANDOM % 20000)) k r
  mkdir -p "$dir"
  cat > "$dir/cluster.toml" <<CONF
[cluster]
servers = ["127.0.0.1:$p0", "127.0.0.1:$((p0 + 1))"]
workers = 1
max_workers = 2
staleness = 0
quorum = $QUORUM
tls_dir = "$D/certs"
[model]
kind = "mlp"
hidden = [256, 128]
[data]
dataset = "fashion-mnist"
[train]
batch = 128
epochs = $EPOCHS
eval_every = 0
local_steps = 16
threads = 1
[optimizer]
kind = "adam"
lr = 1e-3
[optimizer.outer]
lr = 1.4
momentum = 0.5
[compression]
scheme = "topk2"
pull_scheme = "topk2"
bucket = 4096
keep = 16
CONF
  for k in 0 1; do
    (cd "$dir" && exec "$BIN/tether-server" --config cluster.toml --shard "$k" --exit-after-workers "$n" \
       --report "server-$k.json" >> "s$k.log" 2>&1) &
  done
  sleep 0.5
  for r in $(seq 0 $((n - 1))); do
    [ "$r" -gt 0 ] && sleep "$JOIN_AFTER"
    (cd "$dir" && exec "$BIN/tether-worker" --config cluster.toml --rank "$r" --report "worker-$r.json" \
       >> "w$r.log" 2>&1) &
  done
  wait
  python3 - "$dir" "$name" "$n" <<'PY'
import json, sys
d, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rates = []
for r in range(n):
    w = json.load(open(f"{d}/worker-{r}.json"))
    rates.append(w["steps"] * 128 / w["wall_seconds"])
acc = json.load(open(f"{d}/worker-0.json"))["final_test_accuracy"]
each = ", ".join(f"rank {r} {x:,.0f}" for r, x in enumerate(rates))
print(f"join: {name}: samples/s {each}; cluster {sum(rates):,.0f}; rank 0's final accuracy {acc:.4f}")
PY
}

run alone 1
run joined 2
