#!/usr/bin/env bash
# Time to a validation loss on the KJV: the built-in GPT quickstart (4 workers x 2 shards in one process, local-step
# rounds) against one PyTorch process with nanoGPT's CPU recipe (examples/python/nanogpt_kjv.py --single: the same
# shape, corpus, split and validation windows; AdamW lr 2e-3, betas 0.9/0.99, weight decay 0.1 on matrices, 100
# warm-up steps, cosine to lr/10, clip 1.0, batch 12, 2 threads). Both run one after the other on this machine and
# the ratio is computed from the same run. Prints a markdown table; writes both JSON results to --out.
# The PyTorch side needs a python with torch, numpy and Tether's package (pip install ./python).
# Usage: scripts/gpt_vs_torch.sh [--target 1.46] [--out DIR] [-- QUICKSTART_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."

target=1.46 out=$(mktemp -d) qs_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target=${2:?--target needs a value}; shift 2 ;;
    --out) out=${2:?--out needs a value}; shift 2 ;;
    --) shift; qs_args=("$@"); break ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 1 ;;
  esac
done
mkdir -p "$out"
py=${TORCH_PY:-python3}
"$py" -c 'import torch, numpy, tether' 2>/dev/null || {
  echo "$py cannot import torch, numpy and tether: set TORCH_PY to a python that can (pip install torch numpy ./python)" >&2
  exit 2
}

echo "== pytorch: examples/python/nanogpt_kjv.py --single --stop-at-target --target $target" >&2
"$py" examples/python/nanogpt_kjv.py --single --stop-at-target --target "$target" --threads 2 \
  --work-dir "$out/torch" >"$out/torch.json" 2>"$out/torch.log" || { tail -n 20 "$out/torch.log" >&2; exit 1; }

echo "== tether: cargo run --release --example quickstart -- --model gpt ${qs_args[*]:-}" >&2
cargo build --release --quiet --example quickstart
/usr/bin/time -f '%M' -o "$out/tether.rss" target/release/examples/quickstart --model gpt \
  --report "$out/tether.json" ${qs_args[@]+"${qs_args[@]}"} >"$out/tether.log" 2>&1 ||
  { tail -n 20 "$out/tether.log" >&2; exit 1; }

"$py" - "$out" "$target" <<'PY'
import json, sys
out, target = sys.argv[1], float(sys.argv[2])
t = json.load(open(f"{out}/torch.json"))
q = json.load(open(f"{out}/tether.json"))
rss_mb = int(open(f"{out}/tether.rss").read().split()[-1]) / 1024
reached_t = t.get("seconds_to_target")
curve = q.get("val_loss_curve", [])
reached_q = next((s for (_, s, v) in curve if v <= target), None)
best_q = min((v for (_, _, v) in curve), default=float("nan"))
fmt = lambda x: "not reached" if x is None else f"{x:.1f} s"
print(f"| run | time to {target} nats/byte | best val loss | wall time | peak RSS |")
print("|---|---|---|---|---|")
best_t = min((v for (_, _, v) in t.get("val_curve", [])), default=float("nan"))
print(f"| one PyTorch process (nanoGPT recipe, 2 threads) | {fmt(reached_t)} | {best_t:.4f} | "
      f"{t['train_seconds'] + t['eval_seconds']:.1f} s | – |")
print(f"| tether quickstart --model gpt ({q['workers']} x {q['shards']}, H={q['local_steps']}) | {fmt(reached_q)} | "
      f"{best_q:.4f} | {q['wall_seconds']:.1f} s | {rss_mb:.0f} MB |")
if reached_t and reached_q:
    print(f"\nratio tether/pytorch (time to {target}): {reached_q / reached_t:.2f}x")
elif reached_t:
    print(f"\nratio tether/pytorch: > {q['wall_seconds'] / reached_t:.2f}x (tether did not reach {target})")
print(f"pytorch times exclude its evaluations ({t['eval_seconds']:.1f} s); tether's include worker 0's")
print(f"compute CPU s {q.get('compute_cpu_seconds', 0):.1f} of process CPU s {q.get('process_cpu_seconds', 0):.1f}, "
      f"{q.get('compute_threads', 0)} thread(s) per worker")
PY
