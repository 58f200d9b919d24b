#!/usr/bin/env bash
# The PyTorch GPT (examples/python/nanogpt_kjv.py: KJV bytes, 4 layers x 4 heads x 128 wide, AdamW 2e-3 with warm-up
# and cosine, clip 1.0) trained two ways over shaped links, one host per namespace, each host's link shaped to RATE
# Mbit/s both ways (`tether-bench hosts`: a star of namespaces, tc tbf on both ends of every link; root):
#   tether   Tether through the Python package: 2 shard hosts (2 shards, each with its standby on the other shard
#            host, the witness on host 0) and WORKERS worker hosts, every host started by python -m tether.launch;
#            DiLoCo rounds of H AdamW steps, the outer Nesterov step on the shards, q4 pushes, compressed pulls.
#   torchft  torchft 0.2.0's DiLoCo (scripts/gpt_torchft.py): WORKERS replica groups, one per worker host, gloo's
#            ring allreduce of fp32 pseudo-gradients over their links, the lighthouse on host 0; the same H, model,
#            data shares and recipe. Installed into its own venv (TORCHFT_VENV) when missing.
# Each run stops at TARGET nats/byte or at BUDGET_S seconds of training. Prints a markdown table (time to target,
# or the loss reached in the budget; bytes each way on the worker hosts' and shard hosts' links as the kernel
# counted them, headers included; the largest one-second burst on any link; the payload the run itself counted)
# and plots the validation curves; appends every run's line to OUT.
#
# Knobs (environment): RATES ("100 10", Mbit/s), WAYS ("tether torchft"), TARGET (1.465), BUDGET_S (480), WORKERS
# (4), BATCH (3 per worker), H (16), SHARDS (2), STANDBYS (1; 0: Tether's shards run without standbys and the
# witness, and its runs are labelled tether-no-standbys), COLOCATE (0; 1: Tether's shards on the worker hosts,
# labelled tether-colocated, SHARDS then WORKERS; the "shard hosts" columns are hosts 0-1 all the same), PYTHON (/tmp/tether-venv/bin/python: torch, numpy, tether),
# TORCHFT_VENV (/tmp/torchft-venv), BIN (target/release: tether-server and tether-bench), OUT
# (bench/results/peers-hosts-<date>.jsonl), PLOT (bench/results/peers-hosts-<date>.png), KEEP (a folder to keep the
# runs' work folders in; default: removed).
# Usage: sudo scripts/peers-hosts.sh
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -eq 0 ] || { echo "no arguments: set the knobs in the environment (--help)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 2; }

RATES=${RATES:-100 10} WAYS=${WAYS:-tether torchft} TARGET=${TARGET:-1.465} BUDGET_S=${BUDGET_S:-480}
WORKERS=${WORKERS:-4} BATCH=${BATCH:-3} H=${H:-16} STANDBYS=${STANDBYS:-1} COLOCATE=${COLOCATE:-0}
if [ "$COLOCATE" = 1 ]; then SHARDS=${SHARDS:-$WORKERS}; else SHARDS=${SHARDS:-2}; fi
PYTHON=${PYTHON:-/tmp/tether-venv/bin/python} TORCHFT_VENV=${TORCHFT_VENV:-/tmp/torchft-venv}
BIN=$(cd "${BIN:-target/release}" && pwd)
OUT=${OUT:-bench/results/peers-hosts-$(date +%Y-%m-%d).jsonl}
PLOT=${PLOT:-bench/results/peers-hosts-$(date +%Y-%m-%d).png}
hosts=$((2 + WORKERS))
work=$(mktemp -d /tmp/peers-hosts.XXXXXX)
[ -n "${KEEP:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$OUT")"

[ -x "$BIN/tether-bench" ] && [ -x "$BIN/tether-server" ] || {
  echo "$BIN lacks tether-bench or tether-server: cargo build --release -p tether-bench -p tether-server," \
    "or set BIN" >&2; exit 2; }
"$PYTHON" -c 'import torch, numpy, tether' 2>/dev/null || {
  echo "$PYTHON cannot import torch, numpy and tether (pip install torch numpy ./python)" >&2; exit 2; }
case " $WAYS " in *" torchft "*)
  if ! "$TORCHFT_VENV/bin/python" -c 'import torchft, numpy' 2>/dev/null; then
    echo "== creating $TORCHFT_VENV (torch 2.15.0, torchft 0.2.0, numpy)" >&2
    python3 -m venv "$TORCHFT_VENV" &&
      "$TORCHFT_VENV/bin/pip" install --quiet torch==2.15.0 torchft==0.2.0 numpy || {
        echo "could not install torchft into $TORCHFT_VENV" >&2; exit 2; }
  fi ;;
esac

# on_hosts WAY RATE CMD...: runs CMD under tether-bench hosts; keeps its JSON line and the links' report.
on_hosts() {
  local way=$1 rate=$2; shift 2
  local tag="$way-$rate" rc=0
  echo "== $way at $rate Mbit/s per host: $*" >&2
  timeout --kill-after=30 $((BUDGET_S + 300)) "$BIN/tether-bench" hosts --hosts "$hosts" --rate-mbit "$rate" \
    --limit $((BUDGET_S + 240)) --json "$work/links-$tag.json" -- "$@" >"$work/$tag.out" 2>"$work/$tag.log" || rc=$?
  python3 - "$way" "$rate" "$rc" "$work/$tag.out" "$work/links-$tag.json" "$work/$tag.log" "$WORKERS" \
    >>"$work/all.jsonl" <<'PY'
import json, sys
way, rate, rc, out, links, log, workers = sys.argv[1:]
workers = int(workers)
lines = [l for l in open(out).read().splitlines() if l.strip().startswith("{")]
try:
    r = json.loads(lines[-1]) if lines else None
except ValueError:
    r = None
if r is None:
    r = {"error": f"exit {rc}", "log_tail": open(log, errors="replace").read().splitlines()[-8:]}
try:
    l = json.loads(open(links).read().splitlines()[-1])
except (OSError, ValueError, IndexError):
    l = None
if l is not None:
    ls = l["links"]
    r["links"] = ls
    r["link_seconds"] = round(l["seconds"], 1)
    r["worker_hosts_sent"] = sum(x["sent"] for x in ls[2:2 + workers])
    r["worker_hosts_received"] = sum(x["received"] for x in ls[2:2 + workers])
    r["shard_hosts_sent"] = sum(x["sent"] for x in ls[:2])
    r["shard_hosts_received"] = sum(x["received"] for x in ls[:2])
    r["largest_burst_1s"] = max(max(x["burst_sent_1s"], x["burst_received_1s"]) for x in ls)
r.update(way=way, rate_mbit=int(rate))
print(json.dumps(r))
PY
  [ "$rc" = 0 ] || { echo "   $way at $rate Mbit/s failed ($rc): see $work/$tag.log" >&2; tail -n 8 "$work/$tag.log" >&2; }
}

for rate in $RATES; do
  for way in $WAYS; do
    case $way in
      tether)
        standby_flags=() label=tether
        [ "$STANDBYS" = 1 ] || { standby_flags=(--no-standbys); label=tether-no-standbys; }
        [ "$COLOCATE" = 1 ] && { standby_flags+=(--colocate); label=tether-colocated${label#tether}; }
        on_hosts "$label" "$rate" "$PYTHON" examples/python/nanogpt_kjv.py --on-hosts --shard-hosts 2 "${standby_flags[@]}" \
          --workers "$WORKERS" --shards "$SHARDS" --batch "$BATCH" --diloco "$H" --stop-at-target \
          --target "$TARGET" --timeout-s "$BUDGET_S" --bin-dir "$BIN" --work-dir "$work/tether-$rate" ;;
      torchft)
        # The driver and its lighthouse run inside host 0's namespace; the workers on hosts 2 and after.
        on_hosts torchft "$rate" sh -c 'exec ip netns exec "${TETHER_HOSTS_NETNS%%,*}" "$@"' sh \
          "$TORCHFT_VENV/bin/python" scripts/gpt_torchft.py --on-hosts --first-worker-host 2 \
          --workers "$WORKERS" --batch "$BATCH" --sync-every "$H" --stop-at-target --target "$TARGET" \
          --timeout-s "$BUDGET_S" --tether-python "$PYTHON" --work-dir "$work/torchft-$rate" ;;
      *) echo "unknown way in WAYS: $way" >&2; exit 1 ;;
    esac
  done
done
cat "$work/all.jsonl" >>"$OUT"

# The curves: one JSON file per run for tether-bench curves (val_curve points are [samples, seconds, loss]).
series=()
i=0
while read -r line; do
  f="$work/curve-$i.json"
  echo "$line" >"$f"
  label=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["way"], r["rate_mbit"], "Mbit/s")' "$line")
  python3 -c 'import json,sys; sys.exit(0 if "val_curve" in json.loads(sys.argv[1]) else 1)' "$line" &&
    series+=("$label=$f")
  i=$((i + 1))
done <"$work/all.jsonl"
[ ${#series[@]} -eq 0 ] || "$BIN/tether-bench" curves --curve val_curve --out "$PLOT" \
  --title "GPT on the KJV over shaped host links: validation loss (nats/byte)" "${series[@]}" >&2

python3 - "$work/all.jsonl" "$TARGET" "$BUDGET_S" "$(nproc)" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
target, budget, cores = float(sys.argv[2]), sys.argv[3], sys.argv[4]

def mb(b):
    return "–" if b is None else f"{b / 1e6:.1f}"

def when(r):
    if "error" in r:
        return f"failed ({r['error']})"
    if r.get("seconds_to_target") is not None:
        return f"{r['seconds_to_target']:.1f} s"
    best = min((v for (_, _, v) in r.get("val_curve", [])), default=float("nan"))
    return f"not in {r.get('train_seconds', 0):.0f} s (best {best:.4f})"

def payload(r):
    if "wire_bytes_pushed" in r:
        return r["wire_bytes_pushed"] + r["wire_bytes_pulled"]
    return r.get("wire_bytes")

by = {(r["way"], r["rate_mbit"]): r for r in runs}
print(f"| link per host | way | time to {target} | final val loss | worker hosts sent / received MB | "
      "shard hosts sent / received MB | largest 1 s burst MB | payload MB | time / torchft |")
print("|---|---|---|---|---|---|---|---|---|")
for r in runs:
    t = by.get(("torchft", r["rate_mbit"]))
    s, ts = r.get("seconds_to_target"), t and t.get("seconds_to_target")
    ratio = f"{s / ts:.2f}x" if s is not None and ts else "–"
    if s is not None and t is not None and ts is None and "error" not in t:
        ratio = f"< {s / t['train_seconds']:.2f}x (torchft did not reach it)"
    loss = "–" if "error" in r else f"{r['final_val_loss']:.4f}"
    print(f"| {r['rate_mbit']} Mbit/s | {r['way']} | {when(r)} | {loss} | "
          f"{mb(r.get('worker_hosts_sent'))} / {mb(r.get('worker_hosts_received'))} | "
          f"{mb(r.get('shard_hosts_sent'))} / {mb(r.get('shard_hosts_received'))} | "
          f"{mb(r.get('largest_burst_1s'))} | {mb(payload(r))} | {ratio} |")
print(f"\nOne run at a time on this machine ({cores} cores shared by every host's processes); training time with "
      f"evaluation excluded, bounded by {budget} s. Link bytes are the kernel's counters at each host's end of its "
      "link (IP, UDP/TCP, TLS and control traffic included), summed over hosts; payload is what each run counted "
      "(Tether: push frames and pull bodies; torchft: gloo ring allreduce buffers).")
PY
echo "raw JSON lines appended to $OUT; plot $PLOT (work dir $work)" >&2
