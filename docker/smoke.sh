#!/usr/bin/env bash
# Docker smoke test of the compose demo, fully offline: builds the release binaries on the host, turns them into a
# runtime image with docker/build-rootfs.sh (`docker import`, nothing pulled), starts docker/docker-compose.yml
# (2 shards, each with a standby, the witness, 4 workers, Fashion-MNIST), checks that no running container can see
# the CA key (each mounts only its own bundle), waits for training progress, kills one worker and shard 1's primary,
# restarts the worker only (the primary stays dead: its standby takes over), waits for every worker to finish, and
# checks the exit codes and the run reports (both nodes of shard 0 applied the same updates; shard 1's standby is
# the only node of shard 1 that reports). Everything it created (containers, volumes, network, image, temp dir) is removed
# whatever happens. Exits non-zero with the reason on any failure; prints the timing of each phase.
#
# Knobs: TETHER_SMOKE_MIN_ACCURACY (default 0.80), TETHER_SUBNET / TETHER_NET (if 172.28.250.0/24 is taken),
# TETHER_SMOKE_SKIP_BUILD=1 (use target/release as it is), TETHER_BIN=DIR (use the binaries in DIR, build nothing),
# TETHER_SMOKE_KEEP=DIR (copy the reports and the service logs there before tearing down).
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd)
min_acc=${TETHER_SMOKE_MIN_ACCURACY:-0.80}
project=tethersmoke$$
image=tether:smoke-$$
work=$(mktemp -d "${TMPDIR:-/tmp}/tether-smoke.XXXXXX")
image_built=0
ok=0
services="certs server-0 server-1 standby-0 standby-1 witness worker-0 worker-1 worker-2 worker-3"

if docker-compose version >/dev/null 2>&1; then
  compose_bin=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
  compose_bin=(docker compose)
else
  echo "smoke: FAIL: neither docker-compose nor docker compose is available" >&2
  exit 1
fi
compose() { "${compose_bin[@]}" -p "$project" -f "$root/docker/docker-compose.yml" "$@"; }

export TETHER_IMAGE=$image
export TETHER_REPORTS=$work/reports
# The demo's config with more epochs (TETHER_SMOKE_EPOCHS, default 40): the demo's 15 take about 20 s here, less
# than bringing up nine containers, and the kill must land while the workers train.
export TETHER_CONFIG=$work/cluster.toml
sed "s/^epochs = .*/epochs = ${TETHER_SMOKE_EPOCHS:-40}/" "$root/docker/cluster.toml" > "$TETHER_CONFIG"
grep -q "^epochs = ${TETHER_SMOKE_EPOCHS:-40}\$" "$TETHER_CONFIG" || { echo "smoke: FAIL: cannot set the epochs" >&2; exit 1; }

t_start=$(date +%s)
t_phase=$t_start
phase() { # phase NAME: prints the time since the previous phase mark
  local now
  now=$(date +%s)
  printf 'smoke: %-28s %4d s (total %4d s)\n' "$1" $((now - t_phase)) $((now - t_start))
  t_phase=$now
}
mark() { # mark WHAT: time since the kill
  echo "smoke:   $1 $(($(date +%s) - t_kill)) s after the kill"
}
fail() {
  echo "smoke: FAIL: $*" >&2
  exit 1
}

cleanup() {
  local rc=$?
  if [ "$ok" != 1 ]; then
    echo "smoke: --- last log lines of each service ---" >&2
    for s in $services; do
      echo "--- $s" >&2
      compose logs --no-color --tail 15 "$s" 2>&1 | tail -n 15 >&2 || true
    done
  fi
  if [ -n "${TETHER_SMOKE_KEEP:-}" ]; then
    mkdir -p "$TETHER_SMOKE_KEEP"
    cp -r "$TETHER_REPORTS"/. "$TETHER_SMOKE_KEEP"/ 2>/dev/null || true
    for s in $services; do
      compose logs --no-color "$s" >"$TETHER_SMOKE_KEEP/$s.log" 2>&1 || true
    done
  fi
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  [ "$image_built" = 1 ] && docker rmi -f "$image" >/dev/null 2>&1
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

declare -A ids=()
resolve_ids() { # container ids, resolved once (docker-compose v1 takes seconds per call)
  local s
  for s in $services; do ids[$s]=$(compose ps -q "$s"); done
}
cid() { echo "${ids[$1]}"; }
state() { docker inspect -f '{{.State.Status}}' "$(cid "$1")"; }
exit_code() { docker inspect -f '{{.State.ExitCode}}' "$(cid "$1")"; }
json_num() { # json_num FILE KEY: a top-level numeric field of a run report
  sed -n "s/.*\"$2\"[[:space:]]*:[[:space:]]*\([-0-9.eE+]*\).*/\1/p" "$1" | head -n 1
}
# wait_for SECONDS WHAT COMMAND...: polls COMMAND once a second until it succeeds; fails after SECONDS.
wait_for() {
  local limit=$1 what=$2
  shift 2
  local deadline=$(($(date +%s) + limit))
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out after ${limit}s waiting for $what"
    sleep 1
  done
}

# --- 1. image -------------------------------------------------------------------------------------------------
if [ -n "${TETHER_BIN:-}" ]; then
  bin_dir=$TETHER_BIN
else
  bin_dir=${CARGO_TARGET_DIR:-$root/target}/release
  [ "${TETHER_SMOKE_SKIP_BUILD:-0}" = 1 ] || cargo build --release -q -p tether-server -p tether-worker
fi
phase "cargo build"
image_built=1
docker/build-rootfs.sh "$image" "$bin_dir" || fail "cannot build the runtime image"
mkdir -p "$TETHER_REPORTS"
chown 10001:10001 "$TETHER_REPORTS" 2>/dev/null || chmod 777 "$TETHER_REPORTS"
phase "build image (docker import)"

# --- 2. up ----------------------------------------------------------------------------------------------------
compose up -d >"$work/up.log" 2>&1 || { cat "$work/up.log" >&2; fail "compose up failed"; }
resolve_ids
[ "$(exit_code certs)" = 0 ] || fail "the certs service exited $(exit_code certs)"
phase "compose up (servers healthy)"

# --- 2b. keys: every long-running container mounts its own bundle only; ca.key is in the CA volume alone --------
# Checked on the host: `find` over the source of every mount of every running node container (volumes and bind
# mounts alike), plus, inside each container, the key files its /certs holds.
for s in server-0 server-1 standby-0 standby-1 witness worker-0 worker-1 worker-2 worker-3; do
  [ "$(state "$s")" = running ] || fail "$s is not running for the key check"
  for src in $(docker inspect -f '{{range .Mounts}}{{.Source}} {{end}}' "$(cid "$s")"); do
    [ -r "$src" ] || fail "cannot read $s's mount $src to look for ca.key"
    found=$(find "$src" -name ca.key 2>/dev/null | head -n 1)
    [ -z "$found" ] || fail "$s mounts $src, which holds $found"
  done
  case $s in
    server-* | standby-*) want="/certs/checkpoint.key /certs/server.key" ;;
    witness) want=/certs/server.key ;;
    *) want=/certs/worker.key ;;
  esac
  keys=$(docker exec "$(cid "$s")" bash -c 'shopt -s nullglob; echo /certs/*.key')
  [ "$keys" = "$want" ] || fail "$s holds keys '$keys', expected only $want"
done
ca_volume=$(docker volume ls -q | grep -E "^${project}_pki-ca\$" | head -n 1)
[ -n "$ca_volume" ] || fail "no CA volume for project $project"
[ -f "$(docker volume inspect -f '{{.Mountpoint}}' "$ca_volume")/ca.key" ] ||
  fail "the CA volume holds no ca.key (so the search above could not have found one)"
echo "smoke: ca.key is in $ca_volume only; each of the 9 node containers holds only its own key"
phase "key isolation"

# --- 3. first progress ----------------------------------------------------------------------------------------
progress_lines() { compose logs --no-color "$1" 2>&1 | grep -c 'progress' || true; }
has_progress() { [ "$(progress_lines worker-0)" -ge 1 ]; }
wait_for 120 "training progress in worker-0's log" has_progress
# /metrics listens on the container's loopback only: read it from inside server-0's network namespace.
# The image has bash and no coreutils: read the answer with bash's own `read`, not cat.
scrape='exec 3<>/dev/tcp/127.0.0.1/9100 && printf "GET /metrics HTTP/1.0\r\n\r\n" >&3 &&
  while IFS= read -r -u 3 l || [ -n "$l" ]; do printf "%s\n" "$l"; done'
updates=$(compose exec -T server-0 bash -c "$scrape" | sed -n 's/^tether_updates_applied_total \([0-9]*\).*/\1/p')
echo "smoke: first progress: $(compose logs --no-color worker-0 2>&1 | grep progress | head -n 1 | sed 's/.*progress *//')"
echo "smoke: server-0 metrics: tether_updates_applied_total=${updates:-?}"
phase "first progress"

# --- 4. kill one worker and shard 1's primary; restart the worker only -------------------------------------------
since=$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)
t_kill=$(date +%s)
docker kill "$(cid worker-2)" "$(cid server-1)" >/dev/null
echo "smoke: killed worker-2 and server-1 (for good) at $since"
took_over() { docker logs --since "$since" "$(cid standby-1)" 2>&1 | grep -q 'standby took over'; }
wait_for 60 "standby-1 to take over" took_over
mark "standby-1 took over"
sleep 1
# `docker start` restarts the same container (same volume, same fixed address); `compose up -d --no-deps worker-2`
# does the same but costs seconds of docker-compose start-up on a loaded machine.
docker start "$(cid worker-2)" >/dev/null || fail "cannot restart worker-2"
progress_after() { docker logs --since "$1" "$(cid "$2")" 2>&1 | grep -q 'progress'; }
since_takeover=$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)
wait_for 120 "worker-0 progress after the takeover" progress_after "$since_takeover" worker-0
mark "worker-0 progressing again"
docker logs --since "$since" "$(cid worker-0)" 2>&1 | grep -E 'reconnecting|progress' | head -n 2 |
  sed 's/^[^ ]* *[A-Z]* */smoke:   worker-0: /'
wait_for 60 "worker-2 progress after its restart" progress_after "$since" worker-2
mark "worker-2 progressing again"
echo "smoke: restarted worker-2: $(docker logs --since "$since" "$(cid worker-2)" 2>&1 | grep progress | head -n 1 | sed 's/.*progress *//')"
phase "kill + takeover"

# --- 5. completion --------------------------------------------------------------------------------------------
workers_done() {
  local w
  for w in worker-0 worker-1 worker-2 worker-3; do [ "$(state "$w")" = exited ] || return 1; done
}
wait_for 420 "every worker to finish" workers_done
for w in worker-0 worker-1 worker-2 worker-3; do
  [ "$(exit_code "$w")" = 0 ] || fail "$w exited $(exit_code "$w")"
done
servers_done() {
  local s
  for s in server-0 standby-0 standby-1; do [ "$(state "$s")" = exited ] || return 1; done
}
wait_for 60 "the shard nodes to exit after the last goodbye" servers_done
for s in server-0 standby-0 standby-1; do
  [ "$(exit_code "$s")" = 0 ] || fail "$s exited $(exit_code "$s")"
done
[ "$(exit_code server-1)" = 137 ] || fail "server-1 exited $(exit_code server-1), not 137 (SIGKILL): was it restarted?"
phase "completion"

# --- 6. reports -----------------------------------------------------------------------------------------------
for f in worker-0 worker-1 worker-2 worker-3 server-0 standby-0 standby-1; do
  [ -s "$TETHER_REPORTS/$f.json" ] || fail "no report $f.json"
done
[ ! -e "$TETHER_REPORTS/server-1.json" ] || fail "the killed server-1 wrote a report"
acc=$(json_num "$TETHER_REPORTS/worker-0.json" final_test_accuracy)
[ -n "$acc" ] || fail "worker-0.json has no final_test_accuracy"
awk -v a="$acc" -v m="$min_acc" 'BEGIN { exit !(a >= m) }' || fail "final test accuracy $acc < $min_acc"
reconnects=0
for w in worker-0 worker-1 worker-3; do
  n=$(compose logs --no-color "$w" 2>&1 | grep -c 'reconnecting' || true)
  reconnects=$((reconnects + n))
done
echo "smoke: worker-2 (restarted) ran $(json_num "$TETHER_REPORTS/worker-2.json" steps) steps;" \
  "the other workers logged $reconnects reconnects"
a0=$(json_num "$TETHER_REPORTS/server-0.json" updates_applied)
s0=$(json_num "$TETHER_REPORTS/standby-0.json" updates_applied)
s1=$(json_num "$TETHER_REPORTS/standby-1.json" updates_applied)
echo "smoke: updates_applied: server-0 $a0, standby-0 (followed) $s0, standby-1 (took over) $s1"
# A push a killed worker sent to one shard only may differ between the shards; both nodes of shard 0 must agree.
[ "$a0" = "$s0" ] || fail "shard 0's standby applied $s0 updates, its primary $a0"
echo "smoke: worker-0 final_test_accuracy=$acc (threshold $min_acc)"
phase "reports"
ok=1
echo "smoke: PASS"
