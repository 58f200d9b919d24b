"""A training script as a user writes it for ``python -m tether.launch``: the launcher's tests and deploy/slurm/test.sh
run it. A small MLP on the configured data set (digits in the tests), DiLoCo rounds of ``train.local_steps`` Adam
steps, until the worker's clock reaches ``LAUNCHED_ROUNDS`` (default 40), so that a rank started again after a crash
trains only the rounds that are left. Rank 0 prints its test accuracy as one JSON line.

Knobs (environment) for the tests' faults:
  LAUNCHED_CRASH_RANK, LAUNCHED_CRASH_AT   that rank exits with status 3 at that clock on its first run
                                            (``TETHER_RESTARTS`` = 0); LAUNCHED_CRASH_ALWAYS=1: on every run
  LAUNCHED_EARLY=1                         every rank exits 0 right after joining, without closing its worker
  LAUNCHED_STEP_SLEEP                      seconds to sleep after each inner step (slow runs for signal tests)
  LAUNCHED_MARK                            a file rank 0 rewrites with its clock after each round (tests wait on it
                                            to cancel a run that is surely under way)
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


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = os.environ["TETHER_CONFIG"]
    data = tether.load_data(config)
    model = nn.Sequential(nn.Linear(int(data["features"]), 64), nn.ReLU(), nn.Linear(64, int(data["classes"])))
    tt.prepare(model)  # the launcher's preparing run writes the model file here and ends
    rounds = int(os.environ.get("LAUNCHED_ROUNDS", "40"))
    crash_rank = int(os.environ.get("LAUNCHED_CRASH_RANK", "-1"))
    crash_at = int(os.environ.get("LAUNCHED_CRASH_AT", "5"))
    crash_always = os.environ.get("LAUNCHED_CRASH_ALWAYS") == "1"
    sleep_s = float(os.environ.get("LAUNCHED_STEP_SLEEP", "0"))
    restarts = int(os.environ.get("TETHER_RESTARTS", "0"))
    mark = os.environ.get("LAUNCHED_MARK", "")
    w = tether.Worker()
    if os.environ.get("LAUNCHED_EARLY") == "1":
        sys.exit(0)
    with w:
        sync = tt.DiLoCo(model, torch.optim.Adam(model.parameters(), lr=3e-3), w)
        start_clock = w.clock
        world = int(os.environ["TETHER_WORLD_SIZE"])
        part = tether.Partition(len(data["y_train"]), w.rank, world, 7)
        xt = torch.from_numpy(data["x_train"])
        yt = torch.from_numpy(data["y_train"]).long()
        batch = 32
        epoch, i = 0, 0
        marked = -1
        order = torch.from_numpy(part.epoch_order(epoch))
        while w.clock < rounds:
            if (i + 1) * batch > len(order):
                epoch, i = epoch + 1, 0
                order = torch.from_numpy(part.epoch_order(epoch))
            idx = order[i * batch:(i + 1) * batch]
            i += 1
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            sync.step(loss=loss.detach())
            if sleep_s:
                time.sleep(sleep_s)
            if mark and w.rank == 0 and w.clock != marked:
                marked = w.clock
                with open(mark, "w") as f:
                    f.write(f"{marked}\n")
            if w.rank == crash_rank and w.clock >= crash_at and (restarts == 0 or crash_always):
                os._exit(3)
        if w.rank == 0:
            with torch.no_grad():
                pred = model(torch.from_numpy(data["x_test"])).argmax(1).numpy()
            acc = float((pred == data["y_test"]).mean())
            print(json.dumps({"rank": 0, "accuracy": acc, "clock": w.clock, "start_clock": start_clock,
                              "restarts": restarts}), flush=True)
        elif restarts:
            print(json.dumps({"rank": w.rank, "start_clock": start_clock, "restarts": restarts}), flush=True)


if __name__ == "__main__":
    main()
