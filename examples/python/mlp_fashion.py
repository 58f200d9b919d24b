#!/usr/bin/env python3
"""A PyTorch MLP (784-256-128-10) trained on Fashion-MNIST by N Python worker processes through Tether shards on
loopback (the embedded digits set, 64 inputs, when Fashion-MNIST is not installed; it says so).

Run plainly, it writes the run's config and hands it to ``python -m tether.launch --standalone``, which starts the
shards, runs this script's preparing run (the module's weights become the model file: the shards start from them,
every worker pulls them first) and then one process per rank (this script again, with the rank in its environment);
it prints rank 0's test accuracy, the training time and the bytes on the wire against per-step fp32
synchronisation of the same steps.

    python examples/python/mlp_fashion.py                      # 2 workers, a gradient push every step (q4)
    python examples/python/mlp_fashion.py --diloco 16          # local-step rounds of 16 Adam steps, q4 both ways
    python examples/python/mlp_fashion.py --workers 4 --epochs 10 --shards 2

Needs the package (``maturin develop --release -m python/Cargo.toml``) and the ``tether-server`` binary
(``cargo build --release -p tether-server``, or ``--bin-dir`` / ``$TETHER_BIN_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--shards", type=int, default=2, help="parameter shards (default 2)")
    p.add_argument("--epochs", type=int, default=5, help="passes over each worker's share (default 5)")
    p.add_argument("--batch", type=int, default=128, help="per-worker batch (default 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (shards per step; inner with --diloco)")
    p.add_argument("--diloco", type=int, default=0, metavar="H",
                   help="local-step rounds of H inner Adam steps (0: push a gradient every step)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov lr with --diloco (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.5, help="outer momentum with --diloco (default 0.5)")
    p.add_argument("--staleness", default=None,
                   help="SSP bound in rounds, or inf (default: 3 per step, 0 with --diloco)")
    p.add_argument("--compression", default="q4", help="push codec: none, fp16, bf16, q8, q4, q2 (default q4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    p.add_argument("--work-dir", help="certificates, config, logs (default: a temporary directory)")
    p.add_argument("--bin-dir", help="folder holding tether-server (default: $TETHER_BIN_DIR, target/release, PATH)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the summary")
    # Internal: a rank under the launcher writes its figures here.
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.workers < 1 or a.shards < 1 or a.epochs < 1 or a.batch < 1 or a.diloco < 0:
        p.error("--workers, --shards, --epochs and --batch must be >= 1, --diloco >= 0")
    return a


def build_model(features: int, classes: int) -> torch.nn.Sequential:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, classes))


def worker(a: argparse.Namespace) -> None:
    """One rank, run by ``python -m tether.launch``: join, pull the initial weights, train this rank's share,
    evaluate on rank 0, report. The config, rank and bundle come from the launcher's environment."""
    import torch
    import torch.nn.functional as F

    import tether
    import tether.torch as tt

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data = tether.load_data(os.environ["TETHER_CONFIG"])
    model = build_model(int(data["features"]), int(data["classes"]))
    tt.prepare(model)  # the launcher's preparing run writes the model file (the initial weights) and ends here
    a.rank = int(os.environ["TETHER_RANK"])
    a.workers = int(os.environ["TETHER_WORLD_SIZE"])
    with tether.Worker() as w:
        sync: tt.DiLoCo | tt.PerStep
        if a.diloco:
            inner = torch.optim.Adam(model.parameters(), lr=a.lr)
            sync = tt.DiLoCo(model, inner, w, local_steps=a.diloco)
        else:
            sync = tt.PerStep(model, w)
        part = tether.Partition(len(data["y_train"]), a.rank, a.workers, 7)
        batch = min(a.batch, len(part.indices()))
        per_epoch = max(1, len(part.indices()) // batch)
        xt = torch.from_numpy(data["x_train"])
        yt = torch.from_numpy(data["y_train"]).long()
        t0 = time.perf_counter()
        steps = 0
        for epoch in range(a.epochs):
            order = torch.from_numpy(part.epoch_order(epoch))
            for i in range(per_epoch):
                idx = order[i * batch:(i + 1) * batch]
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xt[idx]), yt[idx])
                loss.backward()
                sync.step(loss=loss.detach())
                steps += 1
        if isinstance(sync, tt.DiLoCo):  # with --diloco
            sync.sync()
        train_s = time.perf_counter() - t0
        acc = None
        if a.rank == 0:
            with torch.no_grad():
                pred = model(torch.from_numpy(data["x_test"])).argmax(1).numpy()
            acc = float((pred == data["y_test"]).mean())
        report = w.close()
    out = {"rank": a.rank, "steps": steps, "train_s": train_s, "accuracy": acc, "report": report,
           "num_params": int(sum(p.numel() for p in model.parameters())), "note": data.get("note"),
           "dataset_features": int(data["features"])}
    Path(a.out_dir, f"rank-{a.rank}.json").write_text(json.dumps(out))


def launcher(a: argparse.Namespace) -> None:
    """Writes the run's config and runs every rank through ``python -m tether.launch --standalone`` (shards on
    loopback, one process per rank, the model file from the script's preparing run), then sums the ranks' reports."""
    from tether.cluster import toml_dumps

    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="tether-mlp-"))
    work.mkdir(parents=True, exist_ok=True)
    fashion = Path(os.environ.get("TETHER_DATA_DIR", "/usr/share/datasets/fashion-mnist"))
    dataset = "fashion-mnist" if (fashion / "train-images-idx3-ubyte.gz").exists() else "digits"
    if dataset == "digits":
        print("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist): training on the embedded "
              "digits set", file=sys.stderr)
    staleness = a.staleness if a.staleness is not None else (0 if a.diloco else 3)
    staleness = staleness if staleness == "inf" else int(staleness)
    train_n = 60000 if dataset == "fashion-mnist" else 1437
    steps_per_worker = (train_n // a.workers // min(a.batch, train_n // a.workers)) * a.epochs
    updates = steps_per_worker * a.workers
    cfg: dict[str, dict[str, Any]] = {
        "cluster": {"staleness": staleness},
        "model": {"kind": "file", "file": str(work / "mlp.safetensors")},
        "data": {"dataset": dataset},
        "train": {"batch": a.batch, "epochs": a.epochs, "seed": 7, "local_steps": a.diloco},
        "optimizer": {
            "kind": "adam", "lr": a.lr,
            "schedule": {"kind": "warmup_cosine", "warmup": 100, "total": max(updates, 101), "min_ratio": 0.01},
            "outer": {"kind": "nesterov", "lr": a.outer_lr, "momentum": a.outer_momentum},
        },
        "compression": {"scheme": a.compression},
        "checkpoint": {"every_updates": 0},
    }
    base = work / "base.toml"
    base.write_text(toml_dumps(cfg))
    cmd = [sys.executable, "-m", "tether.launch", "--standalone", "--nproc", str(a.workers), "--shards",
           str(a.shards), "--config", str(base), "--work-dir", str(work / "cluster"), "--log-dir", str(work / "logs")]
    cmd += ["--bin-dir", a.bin_dir] if a.bin_dir else []
    cmd += [os.path.abspath(__file__), "--out-dir", str(work), "--epochs", str(a.epochs), "--batch", str(a.batch),
            "--lr", str(a.lr), "--diloco", str(a.diloco), "--threads", str(a.threads), "--seed", str(a.seed)]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, timeout=3600).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"the launch failed ({rc}); rank logs in {work / 'logs'}")
    results = [json.loads((work / f"rank-{r}.json").read_text()) for r in range(a.workers)]
    n = results[0]["num_params"]
    steps = sum(r["steps"] for r in results)
    wire = sum(r["report"]["wire_bytes_pushed"] + r["report"]["wire_bytes_pulled"] for r in results)
    fp32 = 8 * n * steps  # per-step fp32 sync: every step pushes and pulls the whole model
    summary = {
        "dataset": dataset, "workers": a.workers, "shards": a.shards,
        "mode": f"diloco H={a.diloco}" if a.diloco else "per-step", "compression": a.compression,
        "staleness": staleness, "params": n, "steps": steps, "epochs": a.epochs,
        "test_accuracy": round(results[0]["accuracy"], 4),
        "train_seconds": round(max(r["train_s"] for r in results), 2), "wall_seconds": round(wall, 2),
        "wire_bytes": wire, "fp32_per_step_bytes": fp32, "reduction_vs_fp32": round(fp32 / max(1, wire), 1),
        "work_dir": str(work),
    }
    if a.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>22}  {v}")


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    if "TETHER_RANK" in os.environ:  # started by python -m tether.launch
        worker(a)
    else:
        launcher(a)


if __name__ == "__main__":
    main()
