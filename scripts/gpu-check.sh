#!/usr/bin/env bash
# GPU acceptance check of the CUDA backend (issue 8), in two halves:
#
#   scripts/gpu-check.sh --prepare   # HERE (Rust toolchain, no GPU): builds and strips everything into target/gpu/
#   scripts/gpu-check.sh             # ON THE GPU MACHINE (no toolchain), from the repository root, carrying target/gpu
#
# --prepare runs:
#   cargo build --release -p tether-server -p tether-worker --features tether-worker/cuda
#   cargo build --release -p tether-worker --features cuda --example gpu_check
#   cargo test  --release -p tether-worker --features cuda --test cuda --no-run
#   gpu_check --emit-ptx target/gpu/ptx   (needs libnvrtc 13.0 on LD_LIBRARY_PATH: the wheel nvidia-cuda-nvrtc==13.0.*;
#                                          PTX from a newer NVRTC may not load on driver 580 = CUDA 13.0)
# and leaves target/gpu/{tether-server,tether-worker,gpu_check,cuda-tests,ptx/*.ptx} (stripped; carry that folder).
#
# The GPU half prints: the device; the CUDA test suite (GPU vs CPU gradients, byte-identical frames); gpu_check
# (gradient max relative error, GPU frames through the CPU decoder: unbiasedness and error bound, q4 encode GB/s vs a
# device-to-device copy of the same buffer, samples/s GPU vs CPU); then a 2-shard cluster with worker 0 on cuda:0
# and worker 1 on the CPU (fashion-mnist when installed, else digits; 2 epochs) and its test accuracy.
# Kernels come from NVRTC when libnvrtc loads there, else from target/gpu/ptx; cuBLAS is used when it loads, else a
# tiled sgemm kernel (gpu_check's first line says which). Exit status: non-zero if any step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
G=target/gpu

if [ "${1:-}" = "--prepare" ]; then
  set -e
  cargo build --release -p tether-server -p tether-worker --features tether-worker/cuda
  cargo build --release -p tether-worker --features cuda --example gpu_check
  tests=$(cargo test --release -p tether-worker --features cuda --test cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])' | tail -1)
  rm -rf "$G" && mkdir -p "$G/ptx"
  cp target/release/tether-server target/release/tether-worker target/release/examples/gpu_check "$G/"
  cp "$tests" "$G/cuda-tests"
  strip "$G"/tether-server "$G"/tether-worker "$G"/gpu_check "$G"/cuda-tests 2>/dev/null || true
  if ! "$G/gpu_check" --emit-ptx "$G/ptx"; then
    echo "no PTX written: put libnvrtc 13.0 on LD_LIBRARY_PATH (the GPU machine then needs its own NVRTC)" >&2
  fi
  du -sh "$G"
  exit 0
fi

status=0
step() { echo; echo "== $*"; }
[ -x "$G/gpu_check" ] || { echo "missing $G/gpu_check: run scripts/gpu-check.sh --prepare and carry $G" >&2; exit 2; }
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
# CUDA libraries from pip wheels (PyTorch's nvidia-* packages) when the toolkit's folders lack them.
for d in $(python3 -c 'import glob, site
for p in site.getsitepackages(): print(" ".join(glob.glob(p + "/nvidia/*/lib")))' 2>/dev/null); do
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
export TETHER_CUDA_PTX_DIR="$PWD/$G/ptx"

step "device"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

step "CUDA test suite (CPU oracle vs GPU)"
if [ -x "$G/cuda-tests" ]; then
  TETHER_WORKER_BIN="$G/tether-worker" timeout 300 "$G/cuda-tests" --nocapture --test-threads 1 || status=1
else
  echo "SKIPPED: no $G/cuda-tests"
fi

step "gpu_check"
timeout 300 "$G/gpu_check" --device cuda:0 --seconds 2 || status=1

# The cluster runs once per device in CLUSTER_DEVICES (default: worker 0 on cuda:0, then the same run all on the CPU,
# for the accuracy comparison); GPU_CHECK_DEVICE=cpu rehearses it on a machine without a GPU.
# GPU_CHECK_DATA: a Fashion-MNIST folder carried along (the GPU machine has none); else digits.
data="${GPU_CHECK_DATA:-/usr/share/datasets/fashion-mnist}"
dataset=digits
[ -f "$data/train-images-idx3-ubyte.gz" ] && dataset=fashion-mnist
case "$data" in /*) ;; *) data="$PWD/$data" ;; esac
cluster() {
  local dev0=$1 port=$2 run ok=0
  step "cluster: 2 shards, worker 0 on $dev0, worker 1 on cpu, $dataset, ${GPU_CHECK_EPOCHS:-2} epochs"
  run=$(mktemp -d)
  "$G/tether-server" keygen --out "$run/certs" --servers 2 --workers 2 >/dev/null || return 1
  cat >"$run/cluster.toml" <<EOF
[cluster]
servers = ["127.0.0.1:$port", "127.0.0.1:$((port + 1))"]
workers = 2
staleness = 3
tls_dir = "certs"
[model]
kind = "mlp"
hidden = [256, 128]
seed = 42
[data]
dataset = "$dataset"
path = "$data"
[train]
batch = 128
epochs = ${GPU_CHECK_EPOCHS:-2}
[optimizer]
kind = "adam"
lr = 0.001
[compression]
scheme = "q4"
error_feedback = true
[checkpoint]
dir = "ckpt"
EOF
  local pids=() k w1 t0
  for k in 0 1; do
    timeout 600 "$G/tether-server" --config "$run/cluster.toml" --shard "$k" --exit-after-workers 2 \
      >"$run/server-$k.log" 2>&1 &
    pids+=($!)
  done
  sleep 1
  t0=$(date +%s.%N)
  timeout 600 "$G/tether-worker" --config "$run/cluster.toml" --rank 1 --device cpu >"$run/worker-1.log" 2>&1 &
  w1=$!
  if timeout 600 "$G/tether-worker" --config "$run/cluster.toml" --rank 0 --device "$dev0" \
    --report "$run/worker-0.json" >"$run/worker-0.log" 2>&1; then
    wait "$w1" || ok=1
    for k in "${pids[@]}"; do wait "$k" || ok=1; done
  else
    ok=1
    # The shards wait for two goodbyes that will not come: stop what this function started.
    kill "$w1" "${pids[@]}" 2>/dev/null
    wait 2>/dev/null
  fi
  echo "wall $(python3 -c "import time; print(round(time.time() - $t0, 2))" 2>/dev/null || echo '?') s"
  grep -h "training on\|test accuracy\|device" "$run"/worker-*.log
  [ "$ok" = 0 ] || tail -n 5 "$run"/*.log
  echo "logs: $run"
  return "$ok"
}
port=17410
for dev0 in ${CLUSTER_DEVICES:-${GPU_CHECK_DEVICE:-cuda:0 cpu}}; do
  cluster "$dev0" "$port" || status=1
  port=$((port + 2))
done

echo
if [ "$status" = 0 ]; then echo "gpu-check: OK"; else echo "gpu-check: FAILED (see above)"; fi
exit "$status"
