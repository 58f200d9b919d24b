#!/usr/bin/env bash
# The same PyTorch GPT (examples/python/nanogpt_kjv.py: bytes as tokens, 4 layers x 4 heads x 128 wide, 64-byte
# context, KJV windows and split from tether.load_data, AdamW 2e-3 with warm-up and cosine, clip 1.0) trained three
# ways on this machine, one after the other (never concurrently), each to a validation loss of $TARGET nats/byte:
#   tether   nanogpt_kjv.py --workers TETHER_WORKERS --shards TETHER_SHARDS --batch TETHER_BATCH --diloco TETHER_H
#   single   nanogpt_kjv.py --single (one process, batch 12, 2 threads)
#   torchft  scripts/gpt_torchft.py: torchft 0.2.0 DiLoCo, TORCHFT_WORKERS replica groups x TORCHFT_BATCH, H = TORCHFT_H,
#            ProcessGroupGloo on loopback, a lighthouse with min_replicas = TORCHFT_WORKERS
# Prints a markdown table (time to target excluding evaluation, final validation loss, bytes on the wire, ratios)
# and appends every run's JSON line, tagged with "way", to bench/results/gpt-side-by-side-<date>.jsonl.
#
# Knobs (environment): TARGET (1.465), TETHER_WORKERS (2), TETHER_SHARDS (2), TETHER_BATCH (6), TETHER_H (32),
# TORCHFT_H (16, torchft's DiLoCo recipe as measured in issue 37), TETHER_FLAGS (extra
# nanogpt_kjv.py flags, last wins), TORCHFT_WORKERS (4), TORCHFT_BATCH (3), TORCHFT_FLAGS (extra gpt_torchft.py
# flags), BUDGET_S (600: bound on each run), WAYS ("tether single torchft"), PYTHON (/tmp/tether-venv/bin/python: a
# python with torch, numpy and the tether package; tether-server found as tether.cluster.find_binary does, e.g.
# cargo build --release -p tether-server, or TETHER_BIN_DIR), TORCHFT_VENV (/tmp/torchft-venv: made when missing
# with python3 -m venv + pip install torch==2.15.0 torchft==0.2.0 numpy, plus TORCHFT_PIP_ARGS; torchft is never a
# dependency of the package), OUT (the .jsonl file).
# Usage: scripts/gpt-side-by-side.sh
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -eq 0 ] || { echo "no arguments: set the knobs in the environment (--help)" >&2; exit 1; }

TARGET=${TARGET:-1.465}
TETHER_WORKERS=${TETHER_WORKERS:-2} TETHER_SHARDS=${TETHER_SHARDS:-2} TETHER_BATCH=${TETHER_BATCH:-6}
TETHER_FLAGS=${TETHER_FLAGS:-} TORCHFT_FLAGS=${TORCHFT_FLAGS:-}
TORCHFT_WORKERS=${TORCHFT_WORKERS:-4} TORCHFT_BATCH=${TORCHFT_BATCH:-3}
BUDGET_S=${BUDGET_S:-600} WAYS=${WAYS:-tether single torchft}
PYTHON=${PYTHON:-/tmp/tether-venv/bin/python} TORCHFT_VENV=${TORCHFT_VENV:-/tmp/torchft-venv}
OUT=${OUT:-bench/results/gpt-side-by-side-$(date +%Y-%m-%d).jsonl}
TETHER_H=${TETHER_H:-32} TORCHFT_H=${TORCHFT_H:-16}
work=$(mktemp -d /tmp/gpt-side-by-side.XXXXXX)
mkdir -p "$(dirname "$OUT")"

"$PYTHON" -c 'import torch, numpy, tether' 2>/dev/null || {
  echo "$PYTHON cannot import torch, numpy and tether: set PYTHON to one that can" \
    "(pip install torch numpy ./python)" >&2
  exit 2
}
case " $WAYS " in *" tether "*)
  "$PYTHON" -c 'from tether.cluster import find_binary; find_binary()' >/dev/null || {
    echo "tether-server not found: cargo build --release -p tether-server, or set TETHER_BIN_DIR" >&2; exit 2; } ;;
esac
case " $WAYS " in *" torchft "*)
  if ! "$TORCHFT_VENV/bin/python" -c 'import torchft, numpy' 2>/dev/null; then
    echo "== creating $TORCHFT_VENV (torch 2.15.0, torchft 0.2.0, numpy)" >&2
    python3 -m venv "$TORCHFT_VENV" &&
      "$TORCHFT_VENV/bin/pip" install --quiet ${TORCHFT_PIP_ARGS:-} torch==2.15.0 torchft==0.2.0 numpy || {
        echo "could not install torchft into $TORCHFT_VENV" >&2; exit 2; }
  fi ;;
esac

# run WAY LABEL CMD...: runs CMD bounded by BUDGET_S (+2 min for start-up and the last evaluation), keeps its JSON
# line (the last line of stdout) tagged with the way, or an error line.
run() {
  local way=$1 label=$2; shift 2
  echo "== $way: $*" >&2
  local t0=$SECONDS rc=0
  timeout --kill-after=10 $((BUDGET_S + 120)) "$@" >"$work/$way.out" 2>"$work/$way.log" || rc=$?
  python3 - "$way" "$label" "$rc" $((SECONDS - t0)) "$work/$way.out" "$work/$way.log" "$*" >>"$work/all.jsonl" <<'PY'
import json, sys
way, label, rc, wall, out, log, cmd = sys.argv[1:]
lines = [l for l in open(out).read().splitlines() if l.strip().startswith("{")]
try:
    r = json.loads(lines[-1]) if rc == "0" and lines else None
except ValueError:
    r = None
if r is None:
    tail = open(log, errors="replace").read().splitlines()[-5:]
    r = {"error": "timeout" if rc in ("124", "137") else f"exit {rc}", "log_tail": tail}
r.update(way=way, label=label, wall_seconds=int(wall), command=cmd)
print(json.dumps(r))
PY
  [ "$rc" = 0 ] || { echo "   $way failed ($rc): see $work/$way.log" >&2; tail -n 5 "$work/$way.log" >&2; }
}

for way in $WAYS; do
  case $way in
    tether)
      # shellcheck disable=SC2086  # TETHER_FLAGS is a list of flags
      run tether "Tether DiLoCo H=$TETHER_H, $TETHER_SHARDS shards" "$PYTHON" examples/python/nanogpt_kjv.py \
        --workers "$TETHER_WORKERS" --shards "$TETHER_SHARDS" --batch "$TETHER_BATCH" --diloco "$TETHER_H" \
        --stop-at-target --target "$TARGET" --timeout-s "$BUDGET_S" --work-dir "$work/tether" $TETHER_FLAGS ;;
    single)
      run single "one PyTorch process (2 threads)" "$PYTHON" examples/python/nanogpt_kjv.py --single \
        --stop-at-target --target "$TARGET" --work-dir "$work/single" ;;
    torchft)
      # shellcheck disable=SC2086
      run torchft "torchft 0.2.0 DiLoCo H=$TORCHFT_H, gloo" "$TORCHFT_VENV/bin/python" scripts/gpt_torchft.py \
        --workers "$TORCHFT_WORKERS" --batch "$TORCHFT_BATCH" --sync-every "$TORCHFT_H" --stop-at-target \
        --target "$TARGET" --timeout-s "$BUDGET_S" --tether-python "$PYTHON" --work-dir "$work/torchft" \
        $TORCHFT_FLAGS ;;
    *) echo "unknown way in WAYS: $way" >&2; exit 1 ;;
  esac
done
cat "$work/all.jsonl" >>"$OUT"

python3 - "$work/all.jsonl" "$TARGET" "$(nproc)" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
target, cores = float(sys.argv[2]), sys.argv[3]
by = {r["way"]: r for r in runs}

def shape(r):
    if r["way"] == "single":
        return f"1 x {r.get('batch', 12)}"
    return f"{r.get('workers', '?')} x {r.get('batch', '?')}"

def wire(r):
    if r["way"] == "single" or "error" in r:
        return None
    if "wire_bytes_pushed" in r:  # Tether: pushed + pulled, every worker
        return r["wire_bytes_pushed"] + r["wire_bytes_pulled"]
    return r.get("wire_bytes")

def secs(r):
    return None if "error" in r else r.get("seconds_to_target")

def ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "–"

def mb(b):
    return "–" if b is None else f"{b / 1e6:.1f} MB"

single, tft = by.get("single"), by.get("torchft")
print(f"| way | workers x batch | seconds to {target} | final val loss | bytes sent | time / single | "
      f"time / torchft | bytes / torchft |")
print("|---|---|---|---|---|---|---|---|")
for r in runs:
    s = secs(r)
    if "error" in r:
        when = f"failed ({r['error']})"
    elif s is None:
        best = min((v for (_, _, v) in r.get("val_curve", [])), default=float("nan"))
        when = f"not reached (best {best:.4f}, {r.get('train_seconds', 0):.0f} s)"
    else:
        when = f"{s:.1f} s"
    loss = "–" if "error" in r else f"{r['final_val_loss']:.4f}"
    print(f"| {r['label']} | {shape(r)} | {when} | {loss} | {mb(wire(r))} | "
          f"{ratio(s, single and secs(single))} | {ratio(s, tft and secs(tft))} | "
          f"{ratio(wire(r), tft and wire(tft))} |")
print(f"\nOne after the other on this machine ({cores} cores). Seconds are training time with evaluation excluded "
      "(rank 0's in the distributed runs), to the first evaluation at or under the target; evaluations every "
      "6000 samples on the same validation windows.")
print("Bytes: Tether, the workers' wire_bytes_pushed + wire_bytes_pulled (encoded push frames and pull reply bodies) "
      "summed over workers; torchft, the fp32 allreduce buffers x 2(n-1)/n per worker (gloo's ring, n participants) "
      "summed over workers. Both are payload only (no QUIC/TLS or TCP/gloo headers, no lighthouse or manager RPCs) "
      "and count every byte on the wire once.")
PY
echo "raw JSON lines appended to $OUT (work dir $work)" >&2
