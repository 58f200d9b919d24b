#!/usr/bin/env bash
# A real Prometheus against a real Tether cluster, all on 127.0.0.1: checks the rules (promtool check + unit tests),
# starts 2 shards and 2 workers (release binaries) with --metrics, starts Prometheus scraping them every second with
# deploy/prometheus/alerts.yml loaded, waits until all 4 targets are up, checks that every metric the Grafana
# dashboard queries is scraped, stops shard 1 (SIGKILL) and waits until TetherShardDown fires for it, and only for it.
# Every wait is bounded; everything started is killed at exit. Needs promtool and prometheus (Debian: prometheus).
#
# Usage: deploy/prometheus/firing-test.sh            (TETHER_BIN=DIR to use binaries other than target/release)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
bin=${TETHER_BIN:-${CARGO_TARGET_DIR:-$root/target}/release}
work=$(mktemp -d "${TMPDIR:-/tmp}/tether-prom.XXXXXX")
pids=()
cleanup() {
  local rc=$?
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$rc" != 0 ]; then
    for f in "$work"/*.log; do echo "--- $f" >&2; tail -n 15 "$f" >&2; done
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
fail() { echo "prometheus: FAIL: $*" >&2; exit 1; }
t0=$(date +%s)
say() { echo "prometheus: [$(($(date +%s) - t0)) s] $*"; }

promtool check rules deploy/prometheus/alerts.yml
promtool test rules deploy/prometheus/alerts_test.yml
python3 -c 'import json,sys; json.load(open(sys.argv[1]))' deploy/grafana/tether.json

[ -x "$bin/tether-server" ] && [ -x "$bin/tether-worker" ] ||
  cargo build --release -q -p tether-server -p tether-worker
port() { python3 -c 'import socket,sys; s=socket.socket(socket.AF_INET, int(sys.argv[1])); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' "$1"; }
s0=$(port 2); s1=$(port 2)   # UDP (QUIC)
m0=$(port 1); m1=$(port 1); w0=$(port 1); w1=$(port 1); pp=$(port 1)

cd "$work"
"$bin/tether-server" keygen --out certs --servers 2 --workers 2 >/dev/null
cat > cluster.toml <<EOF
[cluster]
servers = ["127.0.0.1:$s0", "127.0.0.1:$s1"]
workers = 2
staleness = 2
worker_timeout_ms = 3000
[model]
kind = "mlp"
hidden = [32]
[data]
dataset = "digits"
[train]
epochs = 2000
batch = 32
eval_every = 0
[checkpoint]
every_updates = 200
EOF
"$bin/tether-server" --config cluster.toml --shard 0 --metrics "127.0.0.1:$m0" > s0.log 2>&1 & pids+=($!)
"$bin/tether-server" --config cluster.toml --shard 1 --metrics "127.0.0.1:$m1" > s1.log 2>&1 & pids+=($!)
s1_pid=$!
for i in $(seq 100); do grep -q "listening on" s0.log s1.log 2>/dev/null && [ "$(grep -l "listening on" s0.log s1.log | wc -l)" = 2 ] && break; sleep 0.1; done
"$bin/tether-worker" --config cluster.toml --rank 0 --metrics "127.0.0.1:$w0" --step-delay-ms 20 > w0.log 2>&1 & pids+=($!)
"$bin/tether-worker" --config cluster.toml --rank 1 --metrics "127.0.0.1:$w1" --step-delay-ms 20 > w1.log 2>&1 & pids+=($!)

cat > prometheus.yml <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["$root/deploy/prometheus/alerts.yml"]
scrape_configs:
  - job_name: tether-shards
    static_configs: [{targets: ["127.0.0.1:$m0", "127.0.0.1:$m1"]}]
  - job_name: tether-workers
    static_configs: [{targets: ["127.0.0.1:$w0", "127.0.0.1:$w1"]}]
EOF
prometheus --config.file=prometheus.yml --storage.tsdb.path=tsdb --web.listen-address="127.0.0.1:$pp" \
  > prometheus.log 2>&1 & pids+=($!)
api() { curl -fsS "http://127.0.0.1:$pp/api/v1/$1"; }

# 1. All four targets up.
up_count() { api targets | python3 -c 'import json,sys; print(sum(t["health"]=="up" for t in json.load(sys.stdin)["data"]["activeTargets"]))'; }
for i in $(seq 120); do [ "$(up_count 2>/dev/null || echo 0)" = 4 ] && break; sleep 0.5; done
[ "$(up_count)" = 4 ] || fail "targets up: $(up_count) of 4"
say "4 targets up (2 shards, 2 workers)"

# 2. Every metric the dashboard queries is scraped (after a few scrapes with training going on).
sleep 3
api "label/__name__/values" > names.json
# A labelled family (rejections by reason) has no series before its first event; it must still be registered.
curl -fsS "http://127.0.0.1:$m0/metrics" > shard0.txt
python3 - "$root/deploy/grafana/tether.json" names.json shard0.txt <<'PY'
import json, re, sys
dash = json.load(open(sys.argv[1])); names = set(json.load(open(sys.argv[2]))["data"])
exposition = open(sys.argv[3]).read()
used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"tether_[a-z_]+", t["expr"])}
def registered(m):
    base = re.sub(r"_(total|bucket|sum|count)$", "", m)
    return f"# TYPE {base} " in exposition
missing = sorted(m for m in used - names if not registered(m))
if missing:
    sys.exit(f"dashboard metrics neither scraped nor registered: {missing}")
print(f"prometheus: the dashboard's {len(used)} metrics are all scraped "
      f"({len(used - names)} registered, no event yet: {sorted(used - names)})")
PY

# 3. No alert fires on the healthy cluster; stop shard 1; TetherShardDown fires for it alone.
firing() { api alerts | python3 -c 'import json,sys; print(" ".join(sorted(a["labels"]["alertname"]+"@"+a["labels"].get("instance","") for a in json.load(sys.stdin)["data"]["alerts"] if a["state"]=="firing")))'; }
[ -z "$(firing)" ] || fail "alerts firing on a healthy cluster: $(firing)"
kill -9 "$s1_pid"
say "shard 1 killed"
for i in $(seq 120); do firing | grep -q "TetherShardDown@127.0.0.1:$m1" && break; sleep 0.5; done
got=$(firing)
echo "$got" | grep -q "TetherShardDown@127.0.0.1:$m1" || fail "TetherShardDown did not fire (firing: '$got')"
echo "$got" | grep -q "TetherShardDown@127.0.0.1:$m0" && fail "TetherShardDown fired for the live shard 0"
say "alert firing: $got"
echo "prometheus: PASS"
