#!/usr/bin/env bash
# The study behind BENCHMARKS.md: builds the release binaries and runs `tether-bench study`, which creates its own
# network namespaces (veth star, tc tbf; needs root), runs every configuration --repeats times, and writes
# BENCHMARKS.md and bench/plots/*.png. Fashion-MNIST from /usr/share/datasets/fashion-mnist when installed
# (apt-get install dataset-fashion-mnist), else the embedded digits set. About 25-30 minutes on 2 cores.
#
# Usage: scripts/study.sh [tether-bench study flags...]   e.g. scripts/study.sh --repeats 1 --sections sim
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "study.sh: needs root (ip netns, tc)" >&2; exit 1; }
cargo build --release -p tether-bench -p tether-server -p tether-worker
exec "${CARGO_TARGET_DIR:-target}/release/tether-bench" study --out BENCHMARKS.md --plots bench/plots --repeats 3 --epochs 4 --target 0.80 "$@"
