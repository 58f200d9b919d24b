#!/usr/bin/env bash
# What re-seeding a restarted standby costs its primary (issue 36, deliverable 5). One replicated shard (primary,
# standby, witness) and two workers on 127.0.0.1 train the MLP on Fashion-MNIST with the quickstart's sync (rounds
# of 16 local steps, topk2 both ways); once undisturbed, then with the standby SIGKILLed KILL_AT seconds in and
# started again 1 s later, when the primary seeds it with a state image and streams its log. From rank 0's run report
# (a loss point per step) it prints the workers' step rate in the BEFORE seconds before the kill and in the AFTER
# seconds from the moment the standby says it was seeded, for both runs over the same windows, and their ratio.
#
#   scripts/reseed.sh            (Fashion-MNIST must be installed: apt-get install dataset-fashion-mnist)
#
# Knobs: BIN (default target/release; target/debug is optimized too), EPOCHS (30), KILL_AT (6), BEFORE (3),
# AFTER (3), RUNS (1: disturbed runs, each against the one undisturbed run).
set -euo pipefail
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
EPOCHS=${EPOCHS:-30}
KILL_AT=${KILL_AT:-6}
BEFORE=${BEFORE:-3}
AFTER=${AFTER:-3}
RUNS=${RUNS:-1}
for b in tether-server tether-worker; do
  [ -x "$BIN/$b" ] || { echo "reseed: $BIN/$b is missing (cargo build --release -p $b)" >&2; exit 2; }
done
[ -d /usr/share/datasets/fashion-mnist ] || { echo "reseed: Fashion-MNIST is not installed" >&2; exit 2; }
D=$(mktemp -d)
cleanup() { kill -9 $(jobs -p) 2>/dev/null || true; [ -n "${KEEP:-}" ] && echo "reseed: kept $D" || rm -rf "$D"; }
trap cleanup EXIT
"$BIN/tether-server" keygen --out "$D/certs" --servers 1 --workers 2 --standbys >/dev/null
now_ms() { date +%s%3N; }

# run NAME DISTURB: one run; writes $D/NAME/times (worker start, kill, restart, seeded; wall ms) and the reports.
run() {
  local name=$1 disturb=$2 dir="$D/$1"
  mkdir -p "$dir"
  local p0=$((20000 + RANDOM % 20000))
  cat > "$dir/cluster.toml" <<CONF
[cluster]
servers = ["127.0.0.1:$p0"]
standbys = ["127.0.0.1:$((p0 + 1))"]
witness = "127.0.0.1:$((p0 + 2))"
workers = 2
staleness = 0
tls_dir = "$D/certs"
[model]
kind = "mlp"
hidden = [256, 128]
[data]
dataset = "fashion-mnist"
[train]
batch = 128
epochs = $EPOCHS
eval_every = 100
local_steps = 16
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
[checkpoint]
dir = "$dir/ckpt"
CONF
  local cfg="$dir/cluster.toml"
  "$BIN/tether-server" witness --config "$cfg" >"$dir/witness.log" 2>&1 &
  local witness=$!
  "$BIN/tether-server" --config "$cfg" --shard 0 --exit-after-workers 2 --report "$dir/primary.json" \
    >"$dir/primary.log" 2>&1 &
  local primary=$!
  "$BIN/tether-server" --config "$cfg" --shard 0 --standby >"$dir/standby.log" 2>&1 &
  local standby=$!
  local i
  for i in $(seq 300); do grep -q "following its log" "$dir/standby.log" && break; sleep 0.05; done
  local start; start=$(now_ms)
  "$BIN/tether-worker" --config "$cfg" --rank 0 --report "$dir/w0.json" >"$dir/w0.log" 2>&1 &
  local w0=$!
  "$BIN/tether-worker" --config "$cfg" --rank 1 --eval false >"$dir/w1.log" 2>&1 &
  local w1=$!
  local killed=0 restarted=0 seeded=0
  if [ "$disturb" = 1 ]; then
    sleep "$KILL_AT"
    kill -9 "$standby"; killed=$(now_ms)
    sleep 1
    "$BIN/tether-server" --config "$cfg" --shard 0 --standby >"$dir/standby2.log" 2>&1 &
    standby=$!; restarted=$(now_ms)
    for i in $(seq 600); do
      if grep -q "following its log" "$dir/standby2.log"; then seeded=$(now_ms); break; fi
      sleep 0.01
    done
  fi
  wait "$w0" "$w1"
  wait "$primary" || true
  kill "$standby" "$witness" 2>/dev/null || true
  echo "$start $killed $restarted $seeded" > "$dir/times"
}

# rate DIR FROM TO: steps per second of rank 0 between FROM and TO seconds after its start.
rate() {
  python3 - "$1/w0.json" "$2" "$3" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
lo, hi = float(sys.argv[2]), float(sys.argv[3])
pts = [p[1] for p in r["loss_curve"] if lo <= p[1] < hi]
print(f"{len(pts) / (hi - lo):.1f}")
PY
}

run undisturbed 0
for k in $(seq "$RUNS"); do
  run "killed-$k" 1
  read -r start killed restarted seeded < "$D/killed-$k/times"
  [ "$seeded" -gt 0 ] || { echo "run $k: the restarted standby was never seeded"; continue; }
  b0=$(python3 -c "print(($killed - $start) / 1000 - $BEFORE)")
  b1=$(python3 -c "print(($killed - $start) / 1000)")
  a0=$(python3 -c "print(($seeded - $start) / 1000)")
  a1=$(python3 -c "print(($seeded - $start) / 1000 + $AFTER)")
  rb=$(rate "$D/killed-$k" "$b0" "$b1"); ra=$(rate "$D/killed-$k" "$a0" "$a1")
  ub=$(rate "$D/undisturbed" "$b0" "$b1"); ua=$(rate "$D/undisturbed" "$a0" "$a1")
  image=$(grep -o 'image_bytes=[0-9]*' "$D/killed-$k/primary.log" | tail -1)
  echo "run $k: killed at $b1 s, restarted +$(( restarted - killed )) ms, seeded +$(( seeded - restarted )) ms ($image)"
  echo "  rank 0 steps/s  before the kill [$b0, $b1): $rb (undisturbed $ub)"
  echo "  rank 0 steps/s  after the seeding [$a0, $a1): $ra (undisturbed $ua)"
  python3 -c "print(f'  after/before: {$ra / $rb:.2f} (undisturbed over the same windows: {$ua / $ub:.2f})')"
  acc=$(python3 -c "import json; print(json.load(open('$D/killed-$k/w0.json'))['final_test_accuracy'])")
  applied=$(python3 -c "import json; print(json.load(open('$D/killed-$k/primary.json'))['updates_applied'])")
  echo "  final accuracy $acc, updates applied $applied"
done
