#!/usr/bin/env bash
# Every fuzz target (fuzz/, its own workspace) for FUZZ_SECONDS each (default 10) under AddressSanitizer, one build
# of all of them first. Needs a nightly toolchain and cargo-fuzz (installed here when missing). Moved out of .ci/run,
# where the nightly AddressSanitizer build of the whole graph took 7.5 of the run's 47 minutes on 2 cores; run it by
# hand after touching a decoder of untrusted bytes (docs/security.md#fuzzing).
# Usage: scripts/fuzz.sh [TARGET...]     (default: every target)
set -euo pipefail
cd "$(dirname "$0")/.."
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame_decoder codec_decoder control_decoder checkpoint_loader config_parser
  reply_decoder replica_decoder image_loader)
rustup toolchain list 2>/dev/null | grep -q '^nightly' || { echo "fuzz: no nightly toolchain (rustup toolchain install nightly)" >&2; exit 2; }
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# One build of every target. fuzz/Cargo.toml builds the dependencies that only link at opt-level 1 without debug info.
(cd fuzz && cargo +nightly fuzz build)
for target in "${targets[@]}"; do
  if ! (cd fuzz && cargo +nightly fuzz run "$target" -- -max_total_time="${FUZZ_SECONDS:-10}" \
      -print_final_stats=1) >"$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz $target FAILED" >&2
    exit 1
  fi
  grep -E "^stat::number_of_executed_units" "$log" | sed "s/^/$target: /" || true
done
echo "fuzz: ${#targets[@]} target(s) ran ${FUZZ_SECONDS:-10} s each without a crash"
