#!/usr/bin/env python3
"""torchft 0.2.0's DiLoCo on the KJV GPT: the third way of scripts/gpt-side-by-side.sh (never a dependency of the
project; it runs in its own virtual environment with torch and torchft, e.g. /tmp/torchft-venv).

Same model, data and recipe as examples/python/nanogpt_kjv.py, imported from it (``build_model``, ``adamw``,
``lr_factor``, ``lm_batch``, ``Evaluator``): bytes as tokens, 4 layers x 4 heads x 128 wide, 64-byte context; AdamW
lr 2e-3, betas (0.9, 0.99), weight decay 0.1 on matrices, 100 warm-up steps then cosine to lr/10, clip 1.0 (the
inner optimizer); evaluation on the same validation windows every --eval-every samples (all workers' samples).

torchft setup: W replica groups of one rank each, one process per group, on loopback (with --on-hosts: worker r
on namespace host --first-worker-host + r of `tether-bench hosts`, gloo on its link, the driver and lighthouse on
host 0; scripts/peers-hosts.sh). The driver starts a
``torchft.coordination.LighthouseServer`` (min_replicas = W). Each worker starts its own ``TCPStore`` (its replica
group's store) and a ``torchft.Manager`` (ProcessGroupGloo, min_replica_size = W, use_async_quorum = False as
DiLoCo requires, init_sync = False: every worker seeds the same initial weights with --seed, as the Tether run's
launcher does), then trains under ``torchft.local_sgd.DiLoCo(manager, [model], inner AdamW, outer SGD(lr
--outer-lr, momentum --outer-momentum, nesterov=True), sync_every=H)``: H inner steps, then an allreduce of the fp32
pseudo-gradients (theta_global - theta_local; torchft's default: one allreduce per parameter tensor, --bucketize for
one flat buffer) and one outer step.

Data: the tether package is not installed in torchft's environment, so the driver first asks a python that has it
(--tether-python, default $TETHER_PYTHON or /tmp/tether-venv/bin/python) to run this script with --prepare-data:
``tether.load_data`` (dataset kjv, as nanogpt_kjv.py) and ``tether.Partition(n, rank, W, 7).epoch_order(e)`` (the
Tether run's disjoint shares and per-epoch shuffles) are saved to an .npz cache that the workers read with NumPy.
All workers run the same number of steps (the smallest share's, cut down to a multiple of H so that every round is
synchronised: torchft's replicas must stay in lockstep).

Timing: as nanogpt_kjv.py. Rank 0's ``train_seconds`` excludes its evaluation time; ``seconds_to_target`` is the
training time at the first evaluation with validation loss <= --target. With --stop-at-target, rank 0 then asks
every worker (a stop file) to stop at the end of the current round (a worker can only leave at a synchronisation
point without stalling the others' quorum). --timeout-s T bounds the run: at T - max(T/10, min(30 s, T/2)) rank 0
stops the workers the same way (the JSON line then says ``"stopped": "deadline"``); at T the driver kills them.

Bytes: gloo's CPU allreduce is the ring algorithm (reduce-scatter then allgather), in which each of the n
participants sends 2 (n-1)/n of the buffer and receives as much. Each worker wraps ``manager.allreduce`` and adds
up, per call, the tensor's size S (numel x element size, fp32) and 2 (n-1)/n S, n the number of participants in
that quorum. ``wire_bytes`` is the sum over workers of the bytes sent (every byte on the wire counted once: the same
as the Tether run's pushed + pulled); payload only, without TCP/IP and gloo headers, the lighthouse and manager
RPCs (quorum, heartbeats, should_commit) or the TCPStore traffic.

    # driver (runs the lighthouse and W worker processes, prints one JSON line):
    /tmp/torchft-venv/bin/python scripts/gpt_torchft.py --workers 4 --batch 3 --sync-every 16 \\
        --target 1.465 --stop-at-target --timeout-s 600
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "python"))
import nanogpt_kjv as K  # noqa: E402  (the one definition of the model, data helpers and recipe)

PARTITION_SEED = 7  # nanogpt_kjv.py's tether.Partition seed


def parse_args(argv=None):
    d = K.parse_args([])  # nanogpt_kjv.py's defaults, so that every way shares one recipe
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workers", type=int, default=4, help="replica groups = worker processes (default 4)")
    p.add_argument("--sync-every", type=int, default=16, metavar="H", help="inner steps per round (default 16)")
    p.add_argument("--outer-lr", type=float, default=d.outer_lr)
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum)
    p.add_argument("--bucketize", action="store_true",
                   help="one flat allreduce buffer per round (torchft's default: one allreduce per tensor)")
    p.add_argument("--dataset", default=d.dataset)
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--batch", type=int, default=3, help="per worker (default 3)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip", type=float, default=d.clip)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--context", type=int, default=d.context)
    p.add_argument("--explicit-attention", action="store_true")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--target", type=float, default=d.target)
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--max-steps", type=int, default=0, help="cap on each worker's steps (0: the epochs'; smoke tests)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default 1)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--work-dir", help="data cache, logs, per-worker results (default: a temporary directory)")
    p.add_argument("--data", help="the .npz cache (default: WORK_DIR/data-<dataset>-w<W>.npz, made when missing)")
    p.add_argument("--tether-python", default=os.environ.get("TETHER_PYTHON", "/tmp/tether-venv/bin/python"),
                   help="a python with the tether package, to write the data cache")
    p.add_argument("--timeout-s", type=float, default=7200, help="bound on the whole run")
    p.add_argument("--collective-timeout-s", type=float, default=300, help="torchft/gloo operation timeout")
    # Internal.
    p.add_argument("--on-hosts", action="store_true",
                   help="place worker r on namespace host --first-worker-host + r of `tether-bench hosts` "
                        "(TETHER_HOSTS_NETNS, TETHER_HOSTS_ADDRS); run the driver inside host 0's namespace, where "
                        "the lighthouse then listens")
    p.add_argument("--first-worker-host", type=int, default=2, help="with --on-hosts (default 2)")
    p.add_argument("--host-addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--prepare-data", metavar="NPZ", help=argparse.SUPPRESS)
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.dim % a.heads:
        p.error("--dim must be a multiple of --heads")
    if min(a.workers, a.sync_every, a.batch, a.layers, a.heads, a.context, a.eval_every) < 1 or a.epochs <= 0:
        p.error("sizes must be positive")
    return a


# --- data cache (written with a python that has tether) ----------------------------------------------------------


def prepare_data(a):
    """Writes tether.load_data's arrays and tether.Partition's per-rank epoch orders to ``a.prepare_data``."""
    import numpy as np

    import tether

    out = Path(a.prepare_data)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = tether.load_data(K.data_config(a, out.with_suffix(".toml")))
    arrays = {}
    for key in ("x_train", "y_train", "x_test", "y_test"):
        v = np.asarray(data[key])
        small = v.astype(np.uint8)
        arrays[key] = small if np.array_equal(small, v) else v  # byte values: uint8 is exact and 4x smaller
    n = len(arrays["y_train"])
    for r in range(a.workers):
        part = tether.Partition(n, r, a.workers, PARTITION_SEED)
        for e in range(max(1, math.ceil(a.epochs))):
            arrays[f"order_{r}_{e}"] = np.asarray(part.epoch_order(e), dtype=np.int64)
    meta = {"workers": a.workers, "epochs": max(1, math.ceil(a.epochs)), "dataset": a.dataset, "context": a.context,
            "note": data.get("note"), "partition": f"tether.Partition(n, rank, {a.workers}, {PARTITION_SEED})"}
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, out)


def load_cache(path, workers, epochs):
    import numpy as np

    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    if meta["workers"] != workers or meta["epochs"] < max(1, math.ceil(epochs)):
        sys.exit(f"{path} was made for {meta['workers']} workers x {meta['epochs']} epochs, not {workers} x {epochs}")
    data = {k: z[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    data["note"] = meta.get("note")
    orders = {(r, e): z[f"order_{r}_{e}"] for r in range(workers) for e in range(meta["epochs"])}
    return data, orders, meta


# --- one worker (one replica group of one rank) ------------------------------------------------------------------


class ByteCounter:
    """Wraps ``manager.allreduce``: per call, the buffer's bytes S and the ring allreduce's 2 (n-1)/n S sent."""

    def __init__(self, manager):
        self.manager = manager
        self.inner = manager.allreduce
        self.calls = 0
        self.payload = 0
        self.sent = 0.0
        self.participants = set()
        manager.allreduce = self

    def __call__(self, tensor, *args, **kwargs):
        errored = self.manager.errored() is not None
        work = self.inner(tensor, *args, **kwargs)
        if not errored:  # an errored manager skips the collective
            n = self.manager.num_participants()  # the quorum is settled once allreduce returns
            size = tensor.numel() * tensor.element_size()
            self.calls += 1
            self.payload += size
            self.sent += 2 * (n - 1) / n * size if n > 1 else 0.0
            self.participants.add(n)
        return work


def write_stop(path, stop_at, reason):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps({"stop_at": stop_at, "reason": reason}))
    os.replace(tmp, path)


def run_worker(a):
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(a.threads or 1)
    r, W, H, B = a.worker_rank, a.workers, a.sync_every, a.batch
    data, orders, _ = load_cache(a.data, W, a.epochs)
    x, y = data["x_train"], data["y_train"]
    # One step count for every worker (lockstep), the schedule's length as nanogpt_kjv.py computes it per worker.
    total = max(1, min(int(len(orders[(q, 0)]) // B * a.epochs) for q in range(W)))
    run_steps = (total // H) * H
    if a.max_steps:
        run_steps = min(run_steps, max(H, (a.max_steps // H) * H))
    if run_steps < H:
        sys.exit(f"{total} steps per worker: fewer than one round of {H}")
    per_epoch = len(orders[(r, 0)]) // B

    torch.manual_seed(a.seed)  # identical initial weights on every replica (init_sync=False)
    model = K.build_model(a)
    inner = K.adamw(model, a)
    outer = torch.optim.SGD(model.parameters(), lr=a.outer_lr, momentum=a.outer_momentum, nesterov=True)

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    timeout = timedelta(seconds=a.collective_timeout_s)
    store = dist.TCPStore(host_name=a.host_addr, port=0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=W,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=max(a.collective_timeout_s, a.timeout_s)),
        connect_timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr=a.host_addr,
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        replica_id=f"tft_{r}",
        hostname=a.host_addr,
        init_sync=False,
    )
    counter = ByteCounter(manager)
    stop = Path(a.stop_file)
    ev = K.Evaluator(a, model, data) if r == 0 else None
    t0 = time.perf_counter()
    steps, stop_at, stopped = 0, None, "done"
    with DiLoCo(manager, [model], inner, outer, sync_every=H, use_bucketization=a.bucketize):
        for step in range(run_steps):
            epoch, within = divmod(step, per_epoch)
            idx = orders[(r, epoch)][within * B:(within + 1) * B]
            for g in inner.param_groups:
                g["lr"] = a.lr * K.lr_factor(step, total, a)
            inp, tgt = K.lm_batch(x, y, idx)
            inner.zero_grad(set_to_none=True)
            loss = model(inp, tgt)
            loss.backward()
            if a.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            inner.step()  # DiLoCo's post-step hook syncs every H steps
            steps += 1
            if ev is not None:
                reached = ev.maybe(steps * B * W)
                if stop_at is None:
                    reason = ("target" if reached and a.stop_at_target else
                              "deadline" if a.deadline and time.time() > a.deadline else None)
                    if reason:
                        # The end of the current round: no worker can have finished that round's allreduce yet.
                        stop_at, stopped = (steps // H + 1) * H, reason
                        write_stop(stop, stop_at, reason)
            elif stop_at is None and stop.exists():
                s = json.loads(stop.read_text())
                stop_at, stopped = s["stop_at"], s["reason"]
            if stop_at is not None and steps >= stop_at:
                break
    train_s = ev.train_seconds() if ev else time.perf_counter() - t0
    result = {"rank": r, "steps": steps, "run_steps": run_steps, "schedule_steps": total,
              "train_seconds": train_s, "stopped": stopped, "note": data.get("note"), "commits": manager.current_step(),
              "batches_committed": manager.batches_committed(), "params": sum(p.numel() for p in model.parameters()),
              "allreduce_calls": counter.calls, "allreduce_payload_bytes": counter.payload,
              "ring_bytes_sent": round(counter.sent), "participants": sorted(counter.participants)}
    if ev is not None:
        if not ev.curve or ev.curve[-1][0] != steps * B * W:
            ev.maybe(steps * B * W, force=True)
        result.update(eval_seconds=ev.eval_s, curve=ev.curve, reached=ev.reached)
    Path(a.out).write_text(json.dumps(result))
    manager.shutdown(wait=False)


# --- driver ------------------------------------------------------------------------------------------------------


def pass_through(a):
    out = []
    for flag in ("workers", "sync_every", "outer_lr", "outer_momentum", "dataset", "epochs", "batch", "lr",
                 "min_lr_ratio", "warmup", "weight_decay", "clip", "layers", "heads", "dim", "context", "eval_every",
                 "target", "max_steps", "seed", "timeout_s", "collective_timeout_s"):
        out += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
    if a.threads:
        out += ["--threads", str(a.threads)]
    for flag in ("explicit_attention", "stop_at_target", "bucketize"):
        if getattr(a, flag):
            out.append("--" + flag.replace("_", "-"))
    return out


def run_driver(a, work):
    from torchft.coordination import LighthouseServer

    try:
        from importlib.metadata import version
        tft_version, torch_version = version("torchft"), version("torch")
    except Exception:  # noqa: BLE001
        tft_version = torch_version = None
    start = time.monotonic()
    data = Path(a.data) if a.data else work / f"data-{a.dataset}-w{a.workers}-e{max(1, math.ceil(a.epochs))}.npz"
    if not data.exists():
        cmd = [a.tether_python, os.path.abspath(__file__), "--prepare-data", str(data)] + pass_through(a)
        print(f"== data cache: {' '.join(cmd[:4])}", file=sys.stderr, flush=True)
        rc = subprocess.run(cmd, stdout=sys.stderr).returncode
        if rc != 0 or not data.exists():
            sys.exit(f"could not write the data cache {data} with {a.tether_python} (a python with tether and numpy)")
    a.data = str(data)

    # With --on-hosts: worker r runs inside its host's namespace and binds that host's address; the driver (and
    # the lighthouse) run inside host 0's.
    netns = os.environ.get("TETHER_HOSTS_NETNS", "").split(",") if a.on_hosts else []
    addrs = os.environ.get("TETHER_HOSTS_ADDRS", "").split(",") if a.on_hosts else []
    if a.on_hosts and (not netns[0] or len(addrs) < a.first_worker_host + a.workers):
        sys.exit(f"--on-hosts: run inside `tether-bench hosts` with at least {a.first_worker_host + a.workers} hosts")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=a.workers)
    port = lighthouse.address().rsplit(":", 1)[1]
    lighthouse_addr = f"http://{addrs[0] if a.on_hosts else '127.0.0.1'}:{port}"
    stop_file = work / "stop"
    if stop_file.exists():
        stop_file.unlink()
    # Rank 0's soft deadline leaves time for the rest of a round and its final evaluation before the hard one.
    margin = max(0.1 * a.timeout_s, min(30.0, 0.5 * a.timeout_s))
    deadline = time.time() + a.timeout_s - margin - (time.monotonic() - start)
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "e0" if a.on_hosts else "lo"),
               TORCHFT_LIGHTHOUSE=lighthouse_addr)
    procs = []
    try:
        for r in range(a.workers):
            out = work / f"torchft-worker-{r}.json"
            if out.exists():
                out.unlink()
            log = open(work / f"torchft-worker-{r}.log", "wb")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker-rank", str(r), "--lighthouse",
                   lighthouse_addr, "--data", a.data, "--out", str(out), "--stop-file", str(stop_file),
                   "--deadline", repr(deadline)] + pass_through(a)
            if a.on_hosts:
                h = a.first_worker_host + r
                cmd = ["ip", "netns", "exec", netns[h]] + cmd + ["--host-addr", addrs[h]]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), out, log))
        hard = start + a.timeout_s
        failed = None
        for p, out, log in procs:
            try:
                rc = p.wait(timeout=max(1.0, hard - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0 and failed is None:
                failed = (rc, log.name)
                for q, _, _ in procs:
                    if q.poll() is None:
                        q.kill()
        if failed:
            tail = Path(failed[1]).read_text(errors="replace").splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr)
            sys.exit(f"torchft worker failed ({failed[0]}); see {failed[1]}")
    finally:
        for p, _, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        lighthouse.shutdown()
    results = [json.loads(out.read_text()) for _, out, _ in procs]
    r0 = results[0]
    nparams = r0["params"]
    steps = sum(r["steps"] for r in results)
    sent = sum(r["ring_bytes_sent"] for r in results)
    fp32 = 8 * nparams * steps
    return {
        "mode": f"torchft diloco H={a.sync_every}", "framework": f"torchft {tft_version} (torch {torch_version})",
        "workers": a.workers, "shards": None, "process_group": "gloo", "outer": "sgd nesterov",
        "outer_lr": a.outer_lr, "outer_momentum": a.outer_momentum, "bucketized": a.bucketize,
        "dataset": a.dataset, "note": r0.get("note"), "params": nparams, "batch": a.batch,
        "steps": steps, "samples": steps * a.batch, "rounds": r0["commits"], "stopped": r0["stopped"],
        "train_seconds": round(r0["train_seconds"], 3), "eval_seconds": round(r0["eval_seconds"], 3),
        "target": a.target, "seconds_to_target": r0["reached"] and r0["reached"]["seconds"],
        "samples_to_target": r0["reached"] and r0["reached"]["samples"], "final_val_loss": r0["curve"][-1][2],
        "val_curve": r0["curve"], "wire_bytes": sent, "wire_bytes_sent": sent, "wire_bytes_received": sent,
        "allreduce_calls": sum(r["allreduce_calls"] for r in results),
        "allreduce_payload_bytes": sum(r["allreduce_payload_bytes"] for r in results),
        "bytes_counted": "sum over workers of 2(n-1)/n x fp32 allreduce buffer bytes (gloo ring, n participants); "
                         "payload only, no TCP/gloo headers or lighthouse/manager RPCs; every byte counted once",
        "fp32_per_step_bytes": fp32, "reduction_vs_fp32": round(fp32 / max(1, sent), 1), "work_dir": str(work),
        **({"placement": {"lighthouse": lighthouse_addr, "worker_hosts": addrs[a.first_worker_host:][:a.workers]}}
           if a.on_hosts else {}),
    }


def main(argv=None):
    a = parse_args(argv)
    if a.prepare_data:
        prepare_data(a)
        return
    if a.worker_rank is not None:
        run_worker(a)
        return
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="torchft-gpt-"))
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run_driver(a, work)), flush=True)


if __name__ == "__main__":
    main()
