#!/usr/bin/env bash
# CPU step time of Tether's built-in byte-level GPT (candle, examples/gpt_step.rs) against a PyTorch twin
# (scripts/gpt_torch.py) on the same batch, threads and context (64). Both print one JSON line with the same keys;
# this prints a markdown table and the ratio tether/pytorch of the median forward+backward time (ms_fwd_bwd: the
# worker step has no optimizer, the shards apply it; ms_step adds the optimizer update on each side where it has one).
# PyTorch is never a dependency of the project: it runs from ${TORCH_PY:-/work/torch-venv/bin/python}.
# Extra arguments after `--` go to gpt_torch.py only (e.g. -- --sdpa, -- --dtype bf16).
# Usage: scripts/gpt_cpu_bench.sh [--batch 12] [--threads 2] [--steps 30] [-- GPT_TORCH_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."

batch=12 threads=2 steps=30
torch_args=()
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --batch) batch=${2:?--batch needs a value}; shift 2 ;;
    --threads) threads=${2:?--threads needs a value}; shift 2 ;;
    --steps) steps=${2:?--steps needs a value}; shift 2 ;;
    --batch=*) batch=${1#*=}; shift ;;
    --threads=*) threads=${1#*=}; shift ;;
    --steps=*) steps=${1#*=}; shift ;;
    --) shift; torch_args=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 1 ;;
  esac
done
for v in "$batch" "$threads" "$steps"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "--batch, --threads and --steps take positive integers (got '$v')" >&2; exit 1; }
done

torch_py=${TORCH_PY:-/work/torch-venv/bin/python}
if [ ! -x "$torch_py" ] || ! "$torch_py" -c 'import torch' 2>/dev/null; then
  cat >&2 <<EOF
no PyTorch at $torch_py (set TORCH_PY to a python that can 'import torch'). To install it (PyPI's default
wheel needs its nvidia-* wheels to import, about 5.4 GB in all; no GPU is needed to run it):
  python3 -m venv /work/torch-venv && /work/torch-venv/bin/pip install torch numpy
EOF
  exit 2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# last_json FILE: the last line of FILE that is a JSON object (cargo and the programs may log other lines).
last_json() { grep -E '^[[:space:]]*\{' "$1" | tail -n 1; }

echo "== tether (candle): cargo run --release --example gpt_step -- --batch $batch --threads $threads --steps $steps --json" >&2
if ! cargo run --release --quiet --example gpt_step -- \
    --batch "$batch" --threads "$threads" --steps "$steps" --json >"$out/tether.out" 2>"$out/tether.err"; then
  echo "gpt_step failed:" >&2; tail -n 30 "$out/tether.err" >&2; exit 1
fi
last_json "$out/tether.out" >"$out/tether.json"
[ -s "$out/tether.json" ] || { echo "gpt_step printed no JSON line:" >&2; cat "$out/tether.out" >&2; exit 1; }

echo "== pytorch ($torch_py): scripts/gpt_torch.py --batch $batch --threads $threads --steps $steps ${torch_args[*]:-}" >&2
if ! "$torch_py" scripts/gpt_torch.py --batch "$batch" --threads "$threads" --steps "$steps" ${torch_args[@]+"${torch_args[@]}"} \
    >"$out/torch.out" 2>"$out/torch.err"; then
  echo "gpt_torch.py failed:" >&2; tail -n 30 "$out/torch.err" >&2; exit 1
fi
last_json "$out/torch.out" >"$out/torch.json"
[ -s "$out/torch.json" ] || { echo "gpt_torch.py printed no JSON line:" >&2; cat "$out/torch.out" >&2; exit 1; }

"$torch_py" - "$out/tether.json" "$out/torch.json" <<'PY'
import json, sys
rows = [json.load(open(p)) for p in sys.argv[1:3]]
def cell(r, k):
    v = r.get(k)
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.1f}" if k == "tokens_per_s" else f"{v:.2f}"
    if isinstance(v, int) and k == "params":
        return f"{v:,}"
    return str(v)
cols = ["impl", "threads", "batch", "context", "dtype", "params", "ms_fwd_bwd", "ms_fwd_bwd_p10", "ms_fwd_bwd_p90",
        "ms_step", "tokens_per_s"]
print("| " + " | ".join(cols) + " |")
print("|" + "|".join("---" for _ in cols) + "|")
for r in rows:
    print("| " + " | ".join(cell(r, k) for k in cols) + " |")
te, pt = rows
if pt.get("torch"):
    print(f"\npytorch {pt['torch']}, attention {pt.get('attention', '?')}")
for k in ("threads", "batch", "context", "params"):
    if te.get(k) is not None and pt.get(k) is not None and te[k] != pt[k]:
        print(f"warning: {k} differs: tether {te[k]}, pytorch {pt[k]}")
a, b = te.get("ms_fwd_bwd"), pt.get("ms_fwd_bwd")
if a and b:
    print(f"\nratio tether/pytorch (ms_fwd_bwd): {a / b:.2f}x")
else:
    print("\nratio tether/pytorch (ms_fwd_bwd): n/a (a side reported no ms_fwd_bwd)")
PY
