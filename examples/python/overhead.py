#!/usr/bin/env python3
"""What the Python path adds to a round, against the Rust worker's own time for the same work.

One Python worker trains a PyTorch MLP (784-256-128-10 on Fashion-MNIST, or 64-256-128-10 on the embedded digits
set) per step through 2 local shards (staleness inf, so no round waits for another worker). For every round it
times, from Python: the pull (``FlatParams.pull``), the forward and backward pass, the gradient gather into the flat
buffer, and the push. The Rust worker times the same pull and push inside Rust (``report()``: ``pull_wait_seconds``,
``push_seconds``, measured around exactly the work the Rust worker does for a round: waiting for the replies,
decoding them into the parameters; clipping, error feedback, encoding, framing, queueing). The Python path's
overhead per round is

    (pull seen from Python - pull inside Rust) + (push seen from Python - push inside Rust) + gradient gather

(GIL hand-off, argument conversion, the lock hand-over from the keep-alive task, copying ``.grad`` tensors into the
flat buffer), reported as a fraction of the round time. Prints one JSON line.

    python examples/python/overhead.py [--steps 400] [--batch 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--bin-dir", help="folder holding tether-server")
    a = p.parse_args(argv)

    import torch

    import tether
    import tether.torch as tt
    from tether.cluster import LocalCluster

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="tether-overhead-"))
    fashion = Path(os.environ.get("TETHER_DATA_DIR", "/usr/share/datasets/fashion-mnist"))
    dataset = "fashion-mnist" if (fashion / "train-images-idx3-ubyte.gz").exists() else "digits"
    features = 784 if dataset == "fashion-mnist" else 64
    model = torch.nn.Sequential(
        torch.nn.Linear(features, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))
    model_file = work / "model.safetensors"
    tt.export_model(model, str(model_file))
    config = {
        "cluster": {"staleness": "inf"},
        "model": {"kind": "file", "file": str(model_file)},
        "data": {"dataset": dataset},
        "train": {"batch": a.batch, "epochs": 1},
        "optimizer": {"kind": "adam", "lr": 1e-3},
        "checkpoint": {"every_updates": 0},
    }
    with LocalCluster(work, config, shards=a.shards, workers=1, bin_dir=a.bin_dir) as cluster:
        data = tether.load_data(cluster.config_path)
        x = torch.from_numpy(data["x_train"])
        y = torch.from_numpy(data["y_train"])
        order = tether.Partition(len(y), 0, 1, 42).epoch_order(0)
        with tether.Worker(cluster.config_path, 0) as w:
            flat = tt.FlatParams(model, w)
            flat.pull()
            t_pull = t_compute = t_gather = t_push = 0.0
            start = time.perf_counter()
            for step in range(a.steps):
                at = (step * a.batch) % (len(order) - a.batch)
                idx = torch.from_numpy(order[at:at + a.batch])
                t0 = time.perf_counter()
                model.zero_grad(set_to_none=False)
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                t1 = time.perf_counter()
                grad = flat.gather_grads()
                t2 = time.perf_counter()
                w.push(grad, float(loss.item()))
                t3 = time.perf_counter()
                flat.pull()
                t4 = time.perf_counter()
                t_compute += t1 - t0
                t_gather += t2 - t1
                t_push += t3 - t2
                t_pull += t4 - t3
            wall = time.perf_counter() - start
            r = w.report()
    n = a.steps
    rust_pull = r["pull_wait_seconds"]
    rust_push = r["push_seconds"]
    # The initial pull (before the loop) is inside the Rust figure but outside the Python timing.
    rust_pull_loop = rust_pull * n / (n + 1)
    overhead = (t_pull - rust_pull_loop) + (t_push - rust_push) + t_gather
    out = {
        "dataset": dataset,
        "params": int(sum(p.numel() for p in model.parameters())),
        "shards": a.shards,
        "steps": n,
        "round_ms": 1e3 * wall / n,
        "compute_ms": 1e3 * t_compute / n,
        "pull_ms_python": 1e3 * t_pull / n,
        "pull_ms_rust": 1e3 * rust_pull_loop / n,
        "push_ms_python": 1e3 * t_push / n,
        "push_ms_rust": 1e3 * rust_push / n,
        "gather_ms": 1e3 * t_gather / n,
        "python_overhead_ms": 1e3 * overhead / n,
        "python_overhead_fraction": overhead / wall,
        "wire_bytes": r["wire_bytes_pushed"] + r["wire_bytes_pulled"],
        "fp32_bytes": r["fp32_bytes_pushed"] + r["fp32_bytes_pulled"],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
