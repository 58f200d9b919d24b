#!/usr/bin/env bash
# The two multi-process scenarios of the protocol-cores issue, on the release binaries (build them first:
# `cargo build --release -p tether-server -p tether-worker`). Everything runs on 127.0.0.1 in a temp directory.
#
#   scripts/fault-scenarios.sh slow            2 workers, 1 shard, worker_timeout_ms = 1000, rank 1 with
#                                              --step-delay-ms 1500 (digits, 11 steps each): pushes applied/refused
#   scripts/fault-scenarios.sh kill K AT       2 shards, 4 workers, SSP s=3, Fashion-MNIST MLP 256-128, 12 epochs,
#                                              Adam 1e-3; shard K SIGKILLed AT seconds in, restarted with --resume
#                                              (K = none: undisturbed): clock leads, refusals, accuracy
set -euo pipefail
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
mode=${1:-}
D=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$D"' EXIT
cd "$D"
port() { echo $((20000 + RANDOM % 20000)); }

case "$mode" in
slow)
  "$BIN/tether-server" keygen --out certs --workers 2 >/dev/null
  P=$(port)
  cat > cluster.toml <<CONF
[cluster]
servers = ["127.0.0.1:$P"]
workers = 2
staleness = 3
worker_timeout_ms = 1000
[model]
hidden = [64]
[data]
dataset = "digits"
[train]
batch = 64
epochs = 1
eval_every = 0
[optimizer]
lr = 0.003
[checkpoint]
every_updates = 0
CONF
  "$BIN/tether-server" --config cluster.toml --shard 0 --exit-after-workers 2 --report server-0.json > s0.log 2>&1 &
  S=$!
  sleep 0.5
  "$BIN/tether-worker" --config cluster.toml --rank 0 --report w0.json > w0.log 2>&1 &
  A=$!
  "$BIN/tether-worker" --config cluster.toml --rank 1 --report w1.json --step-delay-ms 1500 > w1.log 2>&1 &
  B=$!
  wait $A $B $S
  python3 - <<'PY'
import json
s = json.load(open("server-0.json")); w = [json.load(open(f"w{r}.json")) for r in (0, 1)]
print(f"slow step: shard applied {s['updates_applied']} of {w[0]['steps'] + w[1]['steps']} pushes, rejected "
      f"{s['updates_rejected']}; refused by worker {[x['pushes_refused'] for x in w]}; reconnects "
      f"{[x['reconnects'] for x in w]}; slow worker's wall {w[1]['wall_seconds']:.1f} s")
PY
  echo "evictions in the shard log: $(grep -c 'evicted silent' s0.log || true)"
  ;;
kill)
  K=${2:-0}; AT=${3:-14}
  "$BIN/tether-server" keygen --out certs --servers 2 --workers 4 >/dev/null
  P0=$(port); P1=$((P0 + 1))
  cat > cluster.toml <<CONF
[cluster]
servers = ["127.0.0.1:$P0", "127.0.0.1:$P1"]
workers = 4
staleness = 3
[model]
hidden = [256, 128]
[train]
batch = 128
epochs = 12
eval_every = 0
[optimizer]
kind = "adam"
lr = 1e-3
[checkpoint]
every_updates = 500
CONF
  start_server() {
    "$BIN/tether-server" --config cluster.toml --shard "$1" --exit-after-workers 4 --report "server-$1.json" \
      ${2:+"$2"} >> "s$1.log" 2>&1 &
    echo $!
  }
  S0=$(start_server 0); S1=$(start_server 1)
  sleep 0.5
  W=()
  for r in 0 1 2 3; do
    "$BIN/tether-worker" --config cluster.toml --rank $r --report w$r.json > w$r.log 2>&1 &
    W+=($!)
  done
  if [ "$K" != none ]; then
    sleep "$AT"
    if [ "$K" = 0 ]; then kill -9 "$S0"; else kill -9 "$S1"; fi
    sleep 1
    start_server "$K" --resume >/dev/null
  fi
  wait "${W[@]}"
  sleep 1
  python3 - <<'PY'
import json
w = [json.load(open(f"w{r}.json")) for r in range(4)]
print("leads", [x["max_clock_lead_observed"] for x in w], "(bound 3); stale replies dropped",
      [x["stale_replies_dropped"] for x in w], "refused", [x["pushes_refused"] for x in w], "reconnects",
      [x["reconnects"] for x in w], "; accuracy %.4f, wall %.1f s" % (w[0]["final_test_accuracy"], w[0]["wall_seconds"]))
PY
  grep -h "resumed from checkpoint" s*.log | sed 's/.*resumed/resumed/' || true
  ;;
*)
  sed -n '2,10p' "$0"; exit 2 ;;
esac
