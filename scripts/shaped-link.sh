#!/usr/bin/env bash
# The quickstart on a shaped link: runs it in a private network namespace (its own loopback, which every shard and
# worker of the run shares) unshaped, at 1 Gbit/s and at 100 Mbit/s (tc tbf; this kernel has no netem, so no added
# delay), and prints the time per epoch of each against the unshaped one, plus accuracy and bytes. The namespace is
# the script's own: created at start, deleted at exit, and no traffic leaves it. Needs root (ip netns).
#
# Usage: scripts/shaped-link.sh [EPOCHS] [-- QUICKSTART ARGS...]     e.g. scripts/shaped-link.sh 3 -- --local-steps 0
set -euo pipefail
cd "$(dirname "$0")/.."
epochs=${1:-3}
shift || true
[ "${1:-}" = "--" ] && shift
ns=tether-shape-$$
bin=target/release/examples/quickstart
cargo build --release --example quickstart >/dev/null 2>&1
out=$(mktemp -d)
cleanup() {
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "$out"
}
trap cleanup EXIT
ip netns add "$ns"
ip netns exec "$ns" ip link set lo up

run() { # run NAME: one quickstart run in the namespace, its report in $out/NAME.json
  local name=$1
  shift
  ip netns exec "$ns" "$bin" --epochs "$epochs" --report "$out/$name.json" "$@" >"$out/$name.log" 2>&1 ||
    { tail -n 20 "$out/$name.log" >&2; echo "shaped-link: the $name run failed" >&2; exit 1; }
}
run unshaped "$@"
ip netns exec "$ns" tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 50ms
run 1gbit "$@"
ip netns exec "$ns" tc qdisc replace dev lo root tbf rate 100mbit burst 64kb latency 50ms
run 100mbit "$@"

python3 - "$out" "$epochs" "$*" <<'PY'
import json, sys
out, epochs, args = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [(n, json.load(open(f"{out}/{n}.json"))) for n in ("unshaped", "1gbit", "100mbit")]
base = rows[0][1]["wall_seconds"] / epochs
print(f"quickstart {args or '(defaults)'}, {epochs} epochs, in a network namespace")
print(f"{'link':10s} {'s/epoch':>8s} {'vs unshaped':>12s} {'accuracy':>9s} {'wire MB':>9s} {'vs fp32':>8s}")
for name, r in rows:
    per = r["wall_seconds"] / epochs
    wire = r["wire_bytes_pushed"] + r["wire_bytes_pulled"]
    fp32 = r["fp32_bytes_pushed"] + r.get("fp32_bytes_pulled", 0)
    print(f"{name:10s} {per:8.2f} {per / base:11.2f}x {r['final_test_accuracy']:9.4f} {wire / 1e6:9.1f} "
          f"{fp32 / max(wire, 1):7.1f}x")
PY
