#!/usr/bin/env bash
# Side-by-side timing on this machine: wall time to a target test accuracy (default 0.885) on Fashion-MNIST for
# scikit-learn's MLPClassifier (256,128) and for the Tether quickstart with its defaults (4 workers, 2 shards, local-step
# rounds of 16 steps, q4 + EF pushes, q4 delta pulls). Extra arguments after the epochs go to the quickstart.
# sklearn evaluates after every epoch, Tether twice per epoch (rank 0 every 58 of its steps; 117 = one pass).
# Usage: scripts/compare_sklearn.sh [TARGET] [EPOCHS] [QUICKSTART ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-0.885}
epochs=${2:-20}
shift 2 || shift $#
data=/usr/share/datasets/fashion-mnist
[ -d "$data" ] || { echo "needs $data (apt-get install dataset-fashion-mnist)"; exit 1; }
python3 -c 'import sklearn' 2>/dev/null || python3 -m pip install --quiet scikit-learn
cargo build --release --example quickstart >/dev/null 2>&1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== scikit-learn MLPClassifier(256,128), adam, batch 128"
python3 scripts/compare_sklearn.py "$data" "$target" "$epochs" > "$out/sk.json"

echo "== Tether quickstart ${*:-(defaults)}"
target/release/examples/quickstart --epochs "$epochs" --eval-every 58 --report "$out/tether.json" "$@" | tail -n 20

python3 - "$out/sk.json" "$out/tether.json" "$target" <<'PY'
import json, sys
sk = json.load(open(sys.argv[1])); te = json.load(open(sys.argv[2])); target = float(sys.argv[3])
te_t = next((t for _, t, a in te["accuracy_curve"] if a >= target), None)
print(f"\ntime to test accuracy {target}:")
print(f"  scikit-learn: {sk['seconds_to_target'] if sk['seconds_to_target'] is not None else 'not reached'}"
      f" (final {sk['final_accuracy']:.4f} after {sk['wall_seconds']:.1f} s)")
print(f"  tether:       {te_t if te_t is not None else 'not reached'}"
      f" (final {te['final_test_accuracy']:.4f} after {te['wall_seconds']:.1f} s)")
if te_t is not None and sk["seconds_to_target"]:
    print(f"  ratio tether/sklearn: {te_t / sk['seconds_to_target']:.2f}x")
PY
