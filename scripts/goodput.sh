#!/usr/bin/env bash
# Goodput under a failure schedule (issue 24, deliverable 4), on the release binaries (build them first:
# `cargo build --release -p tether-server -p tether-worker`). A real cluster of 2 shard and 4 worker processes on
# 127.0.0.1 trains the MLP on Fashion-MNIST with the quickstart's sync (BSP rounds of 16 local steps, topk2 both
# ways, outer lr 1.4, momentum 0.5), first undisturbed, then once per period T with a random process among workers
# 1-3 and the two shards SIGKILLed every T seconds and started again 1 s later (a shard with --resume from its
# newest checkpoint, a worker with the same rank), and once with shard 1 killed 8 s in and never started again.
# Rank 0 is never killed: its run report's accuracy curve gives the time to the target.
#
#   scripts/goodput.sh [T ...]          periods in seconds (default: 30 10 5; `none`: no periodic runs)
#
# Knobs: BIN (default target/release), EPOCHS (30), TARGET (0.885), LIMIT (300: seconds a run may take before it is
# stopped and counted as not reaching the target), SEED (the victims' order; default 1), QUORUM (cluster.quorum,
# default 0: every live worker), GRACE (cluster.grace_factor, default 0.5), VICTIMS (the processes a kill picks from,
# default "w1 w2 w3 s0 s1") and LOST (0: skip the shard-lost run). MODEL=gpt runs the built-in GPT on
# the KJV instead (the quickstart's GPT recipe: q4 both ways, 16 local steps, AdamW; STEPS steps per worker,
# default 300, validation every EVAL = 25 steps) with TARGET a validation loss (default auto: the undisturbed run's
# final validation loss + 1%).
# STANDBY=1 gives every shard a standby (cluster.standbys, `tether-server --standby`; FAILOVER sets
# cluster.failover_ms, default 1000): the shard-lost run then fails over instead of ending, and periodic kills pick
# from workers 1-3 and both nodes of each shard (VICTIMS default "w1 w2 w3 s0 s1 b0 b1"); a killed shard node is
# started again 1 s later with the same flags and is seeded by the node that leads (no --resume). With
# standbys the witness (cluster.witness, `tether-server witness`) runs too; it is no victim.
# A shard's recovery time is measured from its kill to the first update its restarted process applies (polled on
# its /metrics every 20 ms; without standbys), or, in the shard-lost run with standbys, to the first update the
# standby applies as the primary; the table gives the median and the largest.
# PLOT=FILE.png also plots rank 0's curve (accuracy, or validation loss for the GPT) against wall time for every run
# (`tether-bench curves`; build it with `cargo build --release -p tether-bench`).
# Prints one line per run and a table: time to the target and rank 0's whole run, each with its goodput (the
# undisturbed run's time / this run's), and the final accuracy. A run whose rank 0 wrote no report (it gave up on a
# shard that never came back) shows dashes.
set -euo pipefail
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
EPOCHS=${EPOCHS:-30}
if [ "${MODEL:-mlp}" = gpt ]; then TARGET=${TARGET:-auto}; else TARGET=${TARGET:-0.885}; fi
LIMIT=${LIMIT:-300}
RANDOM=${SEED:-1}
MODEL=${MODEL:-mlp}
QUORUM=${QUORUM:-0}
STEPS=${STEPS:-300}
EVAL=${EVAL:-25}
GRACE=${GRACE:-0.5}
VICTIMS=${VICTIMS:-w1 w2 w3 s0 s1}
LOST=${LOST:-1}
STANDBY=${STANDBY:-0}
FAILOVER=${FAILOVER:-1000}
[ "$STANDBY" = 1 ] && VICTIMS=${VICTIMS_SET:-w1 w2 w3 s0 s1 b0 b1}
periods=("$@")
[ ${#periods[@]} -gt 0 ] || periods=(30 10 5)
[ "${periods[0]}" = none ] && periods=()
for b in tether-server tether-worker; do
  [ -x "$BIN/$b" ] || { echo "goodput: $BIN/$b is missing (cargo build --release -p $b)" >&2; exit 2; }
done
D=$(mktemp -d)
cleanup() { kill -9 $(jobs -p) 2>/dev/null || true; [ -n "${KEEP:-}" ] && echo "goodput: kept $D" || rm -rf "$D"; }
trap cleanup EXIT
standbys_flag=""
[ "$STANDBY" = 1 ] && standbys_flag="--standbys"
"$BIN/tether-server" keygen --out "$D/certs" --servers 2 --workers 4 $standbys_flag >/dev/null
results="$D/results.tsv"

# recovery KILLED_MS PORT: prints the milliseconds from a shard's kill to the first update its restarted process
# applied (tether_updates_applied_total > 0 on its /metrics), or nothing after 60 s or once the run is over.
recovery() {
  local killed=$1 port=$2 i
  for i in $(seq 3000); do
    [ -e "$dir/done" ] && return
    if curl -s --max-time 1 "http://127.0.0.1:$port/metrics" 2>/dev/null \
        | awk '$1 == "tether_updates_applied_total" && $2 > 0 { found = 1 } END { exit !found }'; then
      echo $(( $(date +%s%3N) - killed ))
      return
    fi
    sleep 0.02
  done
}

# table: the runs so far as a Markdown table. Time to the target comes from rank 0's accuracy curve (MLP: accuracy
# >= TARGET) or validation-loss curve (GPT: loss <= TARGET; TARGET=auto takes the undisturbed run's final validation
# loss + 1%). Goodput = the undisturbed run's time / this run's.
table() {
  python3 - "$results" "$TARGET" "$MODEL" <<'PY'
import json, sys
runs = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
target, gpt = sys.argv[2], sys.argv[3] == "gpt"
def report(d):
    try:
        return json.load(open(f"{d}/worker-0.json"))
    except (OSError, ValueError):
        return None
if target == "auto":
    r = report(runs[0][2])
    target = f"{r['final_val_loss'] * 1.01:.3f}" if r and r.get("final_val_loss") is not None else "nan"
t = float(target)
rows = []
for name, kills, d in runs:
    try:
        rec = sorted(int(l) for l in open(f"{d}/recovery.txt") if l.strip().isdigit())
    except OSError:
        rec = []
    recovery = f"{rec[len(rec) // 2] / 1000:.2f} / {rec[-1] / 1000:.2f} ({len(rec)})" if rec else "-"
    r = report(d)
    if r is None:
        rows.append((name, kills, "-", "-", "-", recovery))
        continue
    if gpt:
        hit = next((tt for _, tt, v in r.get("val_loss_curve", []) if v <= t), None)
        final = f"{r['final_val_loss']:.3f}" if r.get("final_val_loss") is not None else "-"
    else:
        hit = next((tt for _, tt, a in r.get("accuracy_curve", []) if a >= t), None)
        final = f"{r['final_test_accuracy']:.4f}"
    rows.append((name, kills, "-" if hit is None else f"{hit:.1f}", final, f"{r['wall_seconds']:.1f}", recovery))
base, base_wall = rows[0][2], rows[0][4]
ratio = lambda a, b: "-" if "-" in (a, b) else f"{float(a) / float(b):.2f}"
metric = "final validation loss (rank 0)" if gpt else "final accuracy (rank 0)"
print(f"| run | kills | time to {'val loss ' if gpt else ''}{target} (s) | goodput to the target | rank 0's whole run (s) "
      f"| goodput over the run | {metric} | shard recovery median / max (s) (kills) |")
print("|---|---|---|---|---|---|---|---|")
for name, kills, hit, final, wall, rec in rows:
    print(f"| {name} | {kills} | {hit} | {ratio(base, hit)} | {wall} | {ratio(base_wall, wall)} | {final} | {rec} |")
PY
}

# run NAME MODE [T]: one cluster in $D/NAME; MODE is none, every (kill a random process every T s) or shard (kill
# shard 1 once, 8 s in, never restart it).
run() {
  local name=$1 mode=$2 period=${3:-0}
  local dir="$D/$name"
  mkdir -p "$dir"
  local p0=$((20000 + RANDOM % 20000))
  # The cluster section both models share, then the model, data and training sections.
  cat > "$dir/cluster.toml" <<CONF
[cluster]
servers = ["127.0.0.1:$p0", "127.0.0.1:$((p0 + 1))"]
workers = 4
staleness = 0
quorum = $QUORUM
grace_factor = $GRACE
tls_dir = "$D/certs"
CONF
  if [ "$STANDBY" = 1 ]; then
    cat >> "$dir/cluster.toml" <<CONF
standbys = ["127.0.0.1:$((p0 + 2))", "127.0.0.1:$((p0 + 3))"]
witness = "127.0.0.1:$((p0 + 4))"
failover_ms = $FAILOVER
CONF
  fi
  if [ "$MODEL" = gpt ]; then
    cat >> "$dir/cluster.toml" <<CONF
[model]
kind = "gpt"
[data]
dataset = "kjv"
[train]
batch = 4
epochs = 1
max_steps = $STEPS
eval_every = $EVAL
local_steps = 16
clip_norm = 1.0
[optimizer]
kind = "adamw"
lr = 2e-3
weight_decay = 0.1
beta2 = 0.99
decay = "matrices"
schedule = { kind = "warmup_cosine", warmup = 100, total = $STEPS, min_ratio = 0.1 }
[optimizer.outer]
lr = 0.7
momentum = 0.5
[compression]
scheme = "q4"
pull_scheme = "q4"
bucket = 512
[checkpoint]
dir = "$dir/ckpt"
every_updates = 40
keep = 3
CONF
  else
  cat >> "$dir/cluster.toml" <<CONF
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
every_updates = 40
keep = 3
CONF
  fi
  declare -A pid
  start() { # start VICTIM [--resume]
    local v=$1
    case $v in
      s*) (cd "$dir" && exec "$BIN/tether-server" --config cluster.toml --shard "${v#s}" --exit-after-workers 4 \
             --metrics "127.0.0.1:$((p0 + 10 + ${v#s}))" --report "server-${v#s}.json" ${2:-} >> "$v.log" 2>&1) & ;;
      v) (cd "$dir" && exec "$BIN/tether-server" witness --config cluster.toml >> witness.log 2>&1) & ;;
      b*) (cd "$dir" && exec "$BIN/tether-server" --config cluster.toml --shard "${v#b}" --standby --exit-after-workers 4 \
             --metrics "127.0.0.1:$((p0 + 20 + ${v#b}))" --report "standby-${v#b}.json" >> "$v.log" 2>&1) & ;;
      w*) (cd "$dir" && exec "$BIN/tether-worker" --config cluster.toml --rank "${v#w}" --report "worker-${v#w}.json" \
             >> "$v.log" 2>&1) & ;;
    esac
    pid[$v]=$!
  }
  # With standbys, the witness (the fence's third vote) first; it is no victim.
  if [ "$STANDBY" = 1 ]; then start v; fi
  start s0; start s1
  if [ "$STANDBY" = 1 ]; then start b0; start b1; fi
  sleep 0.5
  for r in 0 1 2 3; do start "w$r"; done
  local t0=$SECONDS kills=0 next=$period
  [ "$mode" = shard ] && next=8
  while kill -0 "${pid[w0]}" 2>/dev/null; do
    if [ $((SECONDS - t0)) -ge "$LIMIT" ]; then
      echo "goodput: $name stopped after $LIMIT s"
      break
    fi
    if [ "$mode" != none ] && [ $((SECONDS - t0)) -ge "$next" ]; then
      local victims=($VICTIMS) v
      if [ "$mode" = shard ]; then v=s1; else v=${victims[$((RANDOM % ${#victims[@]}))]}; fi
      kill -9 "${pid[$v]}" 2>/dev/null || true
      local killed_ms
      killed_ms=$(date +%s%3N)
      kills=$((kills + 1))
      if [ "$mode" = shard ]; then
        next=$((LIMIT + 1))
        # With a standby, recovery is the kill to the first update the standby applies as the primary.
        [ "$STANDBY" = 1 ] && recovery "$killed_ms" "$((p0 + 21))" >> "$dir/recovery.txt" &
      else
        sleep 1
        if [ "$STANDBY" = 1 ] && [ "${v:0:1}" != w ]; then
          # The shard's other node leads (or takes over); this one comes back as its standby, seeded by it.
          start "$v"
        elif [ "${v:0:1}" = s ]; then
          start "$v" --resume
          recovery "$killed_ms" "$((p0 + 10 + ${v#s}))" >> "$dir/recovery.txt" &
        else
          start "$v"
        fi
        next=$((next + period))
      fi
    fi
    sleep 0.2
  done
  local wall=$((SECONDS - t0))
  touch "$dir/done"
  for v in "${!pid[@]}"; do kill -9 "${pid[$v]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  printf '%s\t%s\t%s\n' "$name" "$kills" "$dir" >> "$results"
  table | tail -1 | sed "s/^/goodput: /"
}

# Bash reports each SIGKILLed job on stderr ("Killed"); those lines are the schedule itself, not errors.
run undisturbed none 2>/dev/null
for t in "${periods[@]+"${periods[@]}"}"; do run "kill-every-${t}s" every "$t" 2>/dev/null; done
[ "$LOST" = 0 ] || run shard-lost shard 2>/dev/null
echo
table
if [ -n "${PLOT:-}" ]; then
  args=()
  while IFS=$'\t' read -r name _ d; do
    [ -f "$d/worker-0.json" ] && args+=("$name=$d/worker-0.json")
  done < "$results"
  curve=accuracy_curve
  [ "$MODEL" = gpt ] && curve=val_loss_curve
  "$BIN/tether-bench" curves --curve "$curve" --title "rank 0 under failure schedules ($MODEL)" --out "$PLOT" "${args[@]}"
fi
