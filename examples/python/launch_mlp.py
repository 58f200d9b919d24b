#!/usr/bin/env python3
"""One rank of a PyTorch MLP (784-256-128-10) on Fashion-MNIST, written for the launcher: no cluster code, no rank
or config arguments. ``python -m tether.launch`` starts the shards and runs this script once per rank with the
cluster's config, the rank and its bundle in the environment.

    python -m tether.launch --standalone --nproc 2 --shards 2 --config examples/python/mlp.toml \\
        examples/python/launch_mlp.py --epochs 5

Rank 0 prints its test accuracy and the bytes it sent and received as one JSON line. A rank started again after a
crash rejoins at the cluster's clock and trains only the rounds that are left.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tether
import tether.torch as tt


def build_model(features: int, classes: int) -> nn.Module:
    """The quickstart's MLP shape."""
    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, classes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5, help="passes over this rank's share (default 5)")
    p.add_argument("--lr", type=float, default=1e-3, help="inner Adam learning rate (default 1e-3)")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = os.environ["TETHER_CONFIG"]
    data = tether.load_data(config)
    model = build_model(int(data["features"]), int(data["classes"]))
    tt.prepare(model)  # the launcher's preparing run writes the model file (the initial weights) and ends here
    with tether.Worker() as w:
        sync = tt.DiLoCo(model, torch.optim.Adam(model.parameters(), lr=a.lr), w)
        part = tether.Partition(len(data["y_train"]), w.rank, int(os.environ["TETHER_WORLD_SIZE"]),
                                int(w.config["train"]["seed"]))
        batch = w.batch
        per_epoch = max(1, len(part.indices()) // batch)
        rounds = a.epochs * per_epoch // sync.local_steps
        xt = torch.from_numpy(data["x_train"])
        yt = torch.from_numpy(data["y_train"]).long()
        t0 = time.perf_counter()
        step = w.clock * sync.local_steps  # a restarted rank starts where the cluster is
        epoch, order = -1, torch.empty(0, dtype=torch.int64)
        while w.clock < rounds:
            if step // per_epoch != epoch:
                epoch = step // per_epoch
                order = torch.from_numpy(part.epoch_order(epoch))
            i = step % per_epoch
            idx = order[i * batch:(i + 1) * batch]
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            sync.step(loss=loss.detach())
            step += 1
        train_s = time.perf_counter() - t0
        if w.rank == 0:
            with torch.no_grad():
                pred = model(torch.from_numpy(data["x_test"])).argmax(1).numpy()
            r = w.report()
            print(json.dumps({
                "dataset_note": data["note"], "rounds": w.clock, "train_seconds": round(train_s, 2),
                "test_accuracy": round(float((pred == data["y_test"]).mean()), 4),
                "wire_bytes": r["wire_bytes_pushed"] + r["wire_bytes_pulled"],
                "fp32_bytes": r["fp32_bytes_pushed"] + r["fp32_bytes_pulled"],
            }), flush=True)


if __name__ == "__main__":
    main()
