#!/usr/bin/env bash
# Runs deploy/slurm/tether.sbatch (with its default standbys and witness) on a real one-node Slurm cluster on this
# machine (Debian's slurmctld, slurmd and munge, configured here with 2 CPUs and oversubscription), twice:
#   1. the job runs to the end: exit 0, every worker's report, rank 0's accuracy above a floor, both nodes of each
#      shard hold the same number of applied pushes, and both shards the same;
#   2. shard 0's primary step is cancelled mid-run (`scancel JOB.STEP`, for good: its standby takes over), then the
#      worker step: the script starts the workers again, they rejoin, and the job still finishes with every report;
#   3. with TETHER_PYTHON (an interpreter with tether and torch): deploy/slurm/tether-torch.sbatch runs
#      python/tests/launched.py as 3 PyTorch ranks beside 2 shards with standbys, its ranks' step is cancelled
#      mid-run, started again, the ranks rejoin at the running clock and the job completes.
# Starts the daemons when none run (and stops what it started); every wait is bounded. Needs root and the packages
# (apt-get install slurmctld slurmd slurm-client munge).
#
# Usage: deploy/slurm/test.sh          (TETHER_BIN=DIR to use binaries other than target/release)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
bin=${TETHER_BIN:-${CARGO_TARGET_DIR:-$root/target}/release}
[ -x "$bin/tether-server" ] && [ -x "$bin/tether-worker" ] || cargo build --release -q -p tether-server -p tether-worker
work=$(mktemp -d "${TMPDIR:-/tmp}/tether-slurm.XXXXXX")
chmod 755 "$work"
started=()
t0=$(date +%s)
say() { echo "slurm: [$(($(date +%s) - t0)) s] $*"; }
fail() { echo "slurm: FAIL: $*" >&2; exit 1; }
cleanup() {
  local rc=$?
  scancel --user=root >/dev/null 2>&1 || true
  if [ "$rc" != 0 ]; then
    for f in "$work"/*/tether-*.out "$work"/*/*.log /var/log/slurm/slurmctld.log; do
      [ -f "$f" ] && { echo "--- $f" >&2; tail -n 12 "$f" >&2; }
    done
  fi
  for p in "${started[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

# --- a one-node cluster --------------------------------------------------------------------------------------------
if ! sinfo -h >/dev/null 2>&1; then
  h=$(hostname -s)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=tether
SlurmctldHost=$h
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
NodeName=$h CPUs=$(nproc) Sockets=1 CoresPerSocket=$(nproc) ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=main Nodes=$h Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
  [ -f /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
  chmod 400 /etc/munge/munge.key
  if ! pgrep -x munged >/dev/null; then
    runuser -u munge -- munged
    started+=("$(pgrep -x munged | head -n 1)")
  fi
  slurmctld
  slurmd
  for i in $(seq 60); do [ -f /run/slurmctld.pid ] && [ -f /run/slurmd.pid ] && break; sleep 0.5; done
  started+=("$(cat /run/slurmd.pid)" "$(cat /run/slurmctld.pid)")
fi
for i in $(seq 60); do sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)' && break; sleep 1; done
sinfo -h -o %t | grep -qE '^(idle|mix|alloc)' || fail "the node did not come up: $(sinfo -h 2>&1)"
say "cluster up: $(sinfo -h -o '%P %D %t %c CPUs')"

# Digits and a small MLP; the second run is longer (1,000 epochs: about 30 s here with standbys, more under load),
# so that its worker step is cancelled well before the end.
cat > "$work/base.toml" <<'EOF'
[model]
hidden = [64]
[data]
dataset = "digits"
[train]
epochs = 120
batch = 32
eval_every = 0
[checkpoint]
every_updates = 300
EOF

sed 's/^epochs = 120$/epochs = 1000/' "$work/base.toml" > "$work/long.toml"

submit() { # submit NAME PORT CONFIG: starts the job in $work/NAME; prints its id
  mkdir -p "$work/$1"
  (cd "$work/$1" && TETHER_BIN="$bin" TETHER_WORK="$work/$1" TETHER_CONFIG="$work/$3.toml" TETHER_PORT="$2" \
    TETHER_SHARDS=2 TETHER_WORKERS=3 sbatch --parsable --ntasks=5 "$root/deploy/slurm/tether.sbatch")
}
wait_gone() { # wait_gone JOB SECONDS
  local deadline=$(($(date +%s) + $2))
  while squeue -h -j "$1" 2>/dev/null | grep -q .; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "job $1 still running after $2 s"
    sleep 1
  done
}
check_run() { # check_run NAME JOB [EXACT]: exit 0, reports, accuracy; EXACT: every shard node applied every push
  local dir=$work/$1 state
  state=$(scontrol show job "$2" 2>/dev/null | grep -o 'JobState=[A-Z]*' || true)
  [ "$state" = "JobState=COMPLETED" ] || fail "job $2 ended as ${state:-unknown}"
  grep -q "shards finished" "$dir"/tether-*.out || fail "job $2 did not finish its shards"
  for f in worker-0 worker-1 worker-2; do [ -s "$dir/$f.json" ] || fail "no $f.json"; done
  python3 - "$dir" "${3:-}" <<'PY'
import json, os, sys
d, exact = sys.argv[1], sys.argv[2] == "exact"
w = [json.load(open(f"{d}/worker-{r}.json")) for r in range(3)]
# Each shard's reports: its primary's and its standby's, from the nodes that exited cleanly.
shards = [{n: json.load(open(f"{d}/{n}-{k}.json")) for n in ("server", "standby") if os.path.exists(f"{d}/{n}-{k}.json")}
          for k in range(2)]
applied = [{n: r["updates_applied"] for n, r in s.items()} for s in shards]
acc = w[0]["final_test_accuracy"]
print(f"slurm:   rank 0 accuracy {acc:.4f}, steps {[x['steps'] for x in w]}, updates applied per shard node {applied}")
assert all(s for s in shards), f"a shard has no report from any node: {applied}"
assert acc >= 0.85, f"accuracy {acc}"
assert all(x["steps"] == w[0]["steps"] for x in w), "a worker did not run its whole schedule"
if exact:
    # No fault: each node of a shard applied (or replayed) every push once, and every push reached both shards.
    assert all(len(set(a.values())) == 1 for a in applied), applied
    assert len({max(a.values()) for a in applied}) == 1, applied
PY
}

# --- 1. the whole job ---------------------------------------------------------------------------------------------
job=$(submit full 17400 base)
say "job $job submitted (2 shards + 3 workers)"
wait_gone "$job" 300
check_run full "$job" exact
say "job $job completed"

# --- 2. cancel shard 0's primary for good, then the worker step, mid-run -------------------------------------------
job=$(submit cancel 17500 long)
say "job $job submitted"
step=""
# Once rank 0 is connected to both shards and training (its first log line is the connection), give it a second.
for i in $(seq 120); do
  connected=$(grep -cs "reconnected" "$work/cancel/worker-0.log" || true)
  if [ "${connected:-0}" -ge 2 ]; then
    step=$(squeue -h -s -j "$job" -o '%i %j' | awk '$2 == "workers" {print $1}' | head -n 1)
    [ -n "$step" ] && break
  fi
  sleep 0.5
done
[ -n "$step" ] || fail "no running worker step to cancel"
primary=$(squeue -h -s -j "$job" -o '%i %j' | awk '$2 == "primary-0" {print $1}' | head -n 1)
[ -n "$primary" ] || fail "no primary-0 step to cancel"
sleep 1
grep -qs "final evaluation" "$work/cancel/worker-0.log" && fail "the workers ended before the primary could be cancelled"
scancel "$primary"
say "cancelled shard 0's primary step $primary mid-run"
sleep 2
grep -qs "final evaluation" "$work/cancel/worker-0.log" && fail "the worker step ended before it could be cancelled"
done_before=$( (grep -h "progress" "$work/cancel/worker-0.log" || true) | tail -n 1 | sed 's/.*step=\([0-9]*\).*/\1/')
scancel "$step"
say "cancelled worker step $step mid-run (rank 0 had logged step ${done_before:-?})"
wait_gone "$job" 300
grep -q "starting it again" "$work/cancel"/tether-*.out || fail "the worker step was not started again"
grep -q "standby took over" "$work/cancel/standby-0.log" || fail "shard 0's standby did not take over"
[ ! -s "$work/cancel/server-0.json" ] || fail "the cancelled primary wrote a report: it was not cancelled"
check_run cancel "$job"
grep -h "reconnected\|rejoin" "$work/cancel"/worker-*.log | head -n 2 | sed 's/^/slurm:   /'
say "job $job completed after both cancels"

# --- 3. PyTorch ranks through the launcher (tether-torch.sbatch), their step cancelled mid-run --------------------
py=${TETHER_PYTHON:-}
if [ -z "$py" ] || ! "$py" -c 'import tether, torch' 2>/dev/null; then
  say "PyTorch job SKIPPED: set TETHER_PYTHON to an interpreter with tether and torch (pip install ./python torch)"
  echo "slurm: PASS"
  exit 0
fi
mkdir -p "$work/torch"
job=$(cd "$work/torch" && TETHER_BIN="$bin" TETHER_WORK="$work/torch" TETHER_PYTHON="$py" TETHER_PORT=17600 \
  TETHER_SHARDS=2 TETHER_NPROC=3 LAUNCHED_ROUNDS=500 LAUNCHED_STEP_SLEEP=0.005 LAUNCHED_MARK="$work/torch/rank-0.clock" RUST_LOG=info \
  sbatch --parsable --nodes=1 --ntasks-per-node=1 "$root/deploy/slurm/tether-torch.sbatch" \
  "$root/python/tests/launched.py")
say "job $job submitted (PyTorch: 2 shards with standbys, 3 ranks through python -m tether.launch)"
step=""
for i in $(seq 240); do
  step=$(squeue -h -s -j "$job" -o '%i %j' | awk '$2 == "ranks" {print $1}' | head -n 1)
  [ -n "$step" ] && break
  sleep 0.5
done
[ -n "$step" ] || fail "no running ranks' step to cancel"
# Cancel once rank 0 has trained a few rounds (a fixed sleep cancelled a step still importing torch on a loaded
# machine: it restarted at clock 0 and nothing rejoined mid-run).
mark="$work/torch/rank-0.clock"
for i in $(seq 480); do
  [ "$(cat "$mark" 2>/dev/null || echo 0)" -ge 5 ] 2>/dev/null && break
  sleep 0.5
done
[ "$(cat "$mark" 2>/dev/null || echo 0)" -ge 5 ] 2>/dev/null || fail "rank 0 trained no 5 rounds in 240 s"
[ ! -s "$work/torch/worker-0.json" ] || fail "the ranks finished before their step could be cancelled"
scancel "$step"
say "cancelled the ranks' step $step mid-run"
wait_gone "$job" 400
state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z]*' || true)
[ "$state" = "JobState=COMPLETED" ] || fail "PyTorch job $job ended as ${state:-unknown}"
grep -q "starting it again" "$work/torch"/tether-torch-*.out || fail "the ranks' step was not started again"
grep -q "shards finished" "$work/torch"/tether-torch-*.out || fail "the shards did not finish"
for r in 0 1 2; do [ -s "$work/torch/worker-$r.json" ] || fail "rank $r wrote no report"; done
python3 - "$work/torch" <<'PY'
import json, sys
d = sys.argv[1]
acc = [json.loads(l) for l in open(f"{d}/logs/rank-0.log") if l.startswith("{")]
assert acc and acc[-1]["accuracy"] >= 0.85, acc
assert acc[-1]["start_clock"] > 0, f"rank 0 did not rejoin mid-run: {acc[-1]}"
print(f"slurm:   PyTorch rank 0 rejoined at clock {acc[-1]['start_clock']}, accuracy {acc[-1]['accuracy']:.4f}")
PY
say "job $job (PyTorch) completed after its ranks' step was cancelled"
echo "slurm: PASS"
