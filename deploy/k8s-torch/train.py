#!/usr/bin/env python3
"""The training script of deploy/k8s-torch: a PyTorch MLP (784-256-128-10) on Fashion-MNIST in local-step rounds
(DiLoCo: train.local_steps inner Adam steps, then one push of theta_start - theta_end; the shards apply
[optimizer.outer]). It runs in two ways:

- once when the image is built (deploy/k8s-torch/Dockerfile), with TETHER_PREPARE=/model/model.safetensors:
  ``tether.torch.prepare`` writes the module's layout and initial weights there (the model file the shards and the
  workers read) and ends the process;
- once per rank under ``python -m tether.launch --role ranks``, which sets TETHER_CONFIG, TETHER_RANK and
  TETHER_TLS_DIR: ``tether.Worker()`` joins as that rank, the rank trains its share of the data for train.epochs
  passes and closes its worker (the launcher checks for the report ``close()`` writes). A rank started again after
  a crash rejoins at the cluster's clock and trains only the rounds that are left.

To bring your own model, keep the same shape: build the module (float32 parameters, the same on every run), call
``tether.torch.prepare(model)`` before ``tether.Worker()``, loop while ``w.clock`` is below your round count.
"""

import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tether
import tether.torch as tt

FEATURES, CLASSES = 784, 10  # Fashion-MNIST


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, CLASSES))


def main() -> None:
    torch.manual_seed(0)
    model = build_model()
    tt.prepare(model)  # the image build's run: writes the model file and exits here
    torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "1")))
    data = tether.load_data(os.environ["TETHER_CONFIG"])
    if int(data["features"]) != FEATURES:
        sys.exit(f"train.py: the data has {data['features']} features, the model takes {FEATURES} "
                 f"({data.get('note') or 'check [data] in cluster.toml'})")
    with tether.Worker() as w:  # config, rank and bundle from the launcher's environment
        cfg, rank = w.config, w.rank
        workers, epochs, seed = int(cfg["cluster"]["workers"]), int(cfg["train"]["epochs"]), int(cfg["train"]["seed"])
        inner = torch.optim.Adam(model.parameters(), lr=float(cfg["optimizer"]["lr"]))
        sync = tt.DiLoCo(model, inner, w)  # pulls the public weights; w.clock is now where this rank (re)joined
        part = tether.Partition(len(data["y_train"]), rank, workers, seed)
        share = len(part.indices())
        batch = min(w.batch, share)
        per_epoch = max(1, share // batch)
        rounds = epochs * per_epoch // sync.local_steps
        xt = torch.from_numpy(data["x_train"])
        yt = torch.from_numpy(data["y_train"]).long()
        joined = w.clock
        step = joined * sync.local_steps
        order, order_epoch = None, -1
        t0 = time.perf_counter()
        while w.clock < rounds:
            epoch, i = divmod(step, per_epoch)
            if epoch != order_epoch:
                order, order_epoch = torch.from_numpy(part.epoch_order(epoch)), epoch
            idx = order[i * batch:(i + 1) * batch]
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            if sync.step(loss=loss.detach()) and w.clock % 50 == 0:
                print(f"rank {rank}: round {w.clock}/{rounds}, loss {sync.last_round_loss:.4f}", flush=True)
            step += 1
        accuracy = None
        if rank == 0:
            with torch.no_grad():
                pred = model(torch.from_numpy(data["x_test"])).argmax(1).numpy()
            accuracy = float((pred == data["y_test"]).mean())
        report = w.close()
    print(json.dumps({"rank": rank, "joined_at_round": joined, "rounds": rounds,
                      "train_seconds": round(time.perf_counter() - t0, 2), "test_accuracy": accuracy,
                      "wire_bytes": report["wire_bytes_pushed"] + report["wire_bytes_pulled"]}), flush=True)


if __name__ == "__main__":
    main()
