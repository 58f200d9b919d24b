#!/usr/bin/env bash
# The quickstart on a shaped link: runs it in a private network namespace (its own loopback, which every shard and
# worker of the run shares) unshaped and then at each rate of RATES (default "1gbit 100mbit 10mbit"; tc tbf; this
# kernel has no netem, so no added delay), and prints the time per epoch of each against the unshaped one, plus
# accuracy, bytes, the inner steps per round at the end, and the largest push and pull of a worker (its bursts). The namespace is the script's own: created at start,
# deleted at exit, and no traffic leaves it. Needs root (ip netns).
#
# Usage: [RATES="10mbit"] scripts/shaped-link.sh [EPOCHS] [-- QUICKSTART ARGS...]
#        e.g. scripts/shaped-link.sh 3 -- --local-steps 0
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
rates=${RATES:-1gbit 100mbit 10mbit}
run unshaped "$@"
for rate in $rates; do
  # A bucket of 4 ms of traffic, at least 64 KiB (tbf needs one packet; QUIC datagrams are ≤ 1,500 B).
  ip netns exec "$ns" tc qdisc replace dev lo root tbf rate "$rate" burst 64kb latency 50ms
  run "$rate" "$@"
done

python3 - "$out" "$epochs" "$*" unshaped $rates <<'PY'
import json, sys
out, epochs, args, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rows = [(n, json.load(open(f"{out}/{n}.json"))) for n in names]
base = rows[0][1]["wall_seconds"] / epochs
print(f"quickstart {args or '(defaults)'}, {epochs} epochs, in a network namespace")
print(f"{'link':10s} {'s/epoch':>8s} {'vs unshaped':>12s} {'accuracy':>9s} {'wire MB':>9s} {'vs fp32':>8s} {'H':>4s} "
      f"{'push KB':>8s} {'pull KB':>8s}")
for name, r in rows:
    per = r["wall_seconds"] / epochs
    wire = r["wire_bytes_pushed"] + r["wire_bytes_pulled"]
    fp32 = r["fp32_bytes_pushed"] + r.get("fp32_bytes_pulled", 0)
    h = r.get("local_steps_picked") or r.get("local_steps", 0)
    print(f"{name:10s} {per:8.2f} {per / base:11.2f}x {r['final_test_accuracy']:9.4f} {wire / 1e6:9.1f} "
          f"{fp32 / max(wire, 1):7.1f}x {h:4d} {r.get('max_push_bytes', 0) / 1e3:8.1f} "
          f"{r.get('max_pull_bytes', 0) / 1e3:8.1f}")
PY
