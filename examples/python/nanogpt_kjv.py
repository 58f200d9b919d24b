#!/usr/bin/env python3
"""A nanoGPT-style PyTorch GPT on the King James Bible, in one plain process (``--single``, the peer) or as W
worker processes through M Tether shards on loopback; prints one JSON line with the time to a target validation
loss.

Model (as scripts/gpt_torch.py and Tether's built-in GPT): bytes as tokens (vocab 256), 4 layers, 4 heads, 128 wide,
64-byte context, token + position embeddings, pre-norm blocks (attention, MLP 4x with tanh GELU), final LayerNorm,
head tied to the token embedding, no dropout, N(0, 0.02) init. Data: ``tether.load_data`` with dataset ``kjv`` (the
same corpus, windows and split as the built-in GPT: non-overlapping 64-byte windows, the first 90 % for training, at
most 512 windows of the last 10 % for validation; the embedded Pentateuch when the KJV is not installed, and the
note says so). Optimizer (nanoGPT's CPU configuration): AdamW lr 2e-3, betas (0.9, 0.99), weight decay 0.1, batch 12,
100 warm-up steps then cosine to lr/10 over the run, gradient clip 1.0.

Modes:
  --single             one process, --threads torch threads (default 2): the reference.
  (default)            --workers W processes (1 thread each) x --shards M: a gradient push every step; the shards
                       run AdamW (weight decay on every tensor: the shards do not group parameters).
  --diloco H           local-step rounds: each worker runs H AdamW steps, pushes theta_start - theta_end; the shards
                       apply Nesterov (--outer-lr, --outer-momentum) to the mean delta.
  --on-hosts           the same cluster on the shaped namespace hosts of ``tether-bench hosts`` (root): shards with
                       standbys on --shard-hosts hosts, one worker per host, every host started by
                       ``python -m tether.launch`` (scripts/peers-hosts.sh).

Timing: ``train_seconds`` is training wall time with evaluation excluded (rank 0 evaluates in cluster mode and
subtracts its evaluation time; ``eval_seconds`` reports it). ``seconds_to_target`` is the training time at the first
evaluation with validation loss <= --target (nats per byte), null when never reached. Bytes: ``wire_bytes`` both
ways summed over workers, against ``fp32_per_step_bytes`` (every step pushing and pulling the whole model in f32).

    python examples/python/nanogpt_kjv.py --single
    python examples/python/nanogpt_kjv.py --workers 4 --shards 2 --diloco 16 --stop-at-target
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--single", action="store_true", help="one plain PyTorch process (the peer)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--shards", type=int, default=2, help="parameter shards (default 2)")
    p.add_argument("--diloco", type=int, default=0, metavar="H", help="local-step rounds of H steps (0: per step)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--staleness", default="0", help="SSP bound in rounds, or inf (default 0: BSP)")
    p.add_argument("--compression", default="q4", help="push codec (default q4)")
    p.add_argument("--dataset", default="kjv", help="kjv (default; falls back to the excerpt), kjv-excerpt")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the training windows (default 1)")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--explicit-attention", action="store_true",
                   help="matmul + masked softmax attention instead of F.scaled_dot_product_attention")
    p.add_argument("--eval-every", type=int, default=6000, help="evaluate every this many samples (all workers)")
    p.add_argument("--target", type=float, default=1.46, help="target validation loss, nats per byte")
    p.add_argument("--stop-at-target", action="store_true", help="stop once the target is reached")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 2 single, 1 per worker)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the single run's order")
    p.add_argument("--work-dir", help="config, certificates, logs (default: a temporary directory)")
    p.add_argument("--bin-dir", help="folder holding tether-server")
    p.add_argument("--timeout-s", type=float, default=7200, help="bound on the whole run")
    # Internal: a worker process.
    p.add_argument("--on-hosts", action="store_true",
                   help="place the cluster on the namespace hosts of `tether-bench hosts` (run as root inside it): "
                        "shards on the first --shard-hosts hosts, one worker per host after them, each host started "
                        "by python -m tether.launch")
    p.add_argument("--shard-hosts", type=int, default=2, help="with --on-hosts: hosts holding the shards (default 2)")
    p.add_argument("--no-standbys", action="store_true", help="with --on-hosts: no standbys and no witness")
    p.add_argument("--colocate", action="store_true",
                   help="with --on-hosts: the shards on the worker hosts (shard k's primary on worker host k mod "
                        "workers, its standby on the next one; the witness on host 0), so that no two hosts' links "
                        "carry every worker's traffic")
    p.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.dim % a.heads:
        p.error("--dim must be a multiple of --heads")
    if min(a.workers, a.shards, a.batch, a.layers, a.heads, a.context, a.eval_every) < 1 or a.epochs <= 0:
        p.error("sizes must be positive")
    return a


def build_model(a: argparse.Namespace) -> torch.nn.Module:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    V, T, C, H, L = 256, a.context, a.dim, a.heads, a.layers
    explicit = a.explicit_attention

    class CausalSelfAttention(nn.Module):
        mask: torch.Tensor  # a buffer

        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, Tx, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q = q.view(B, Tx, H, C // H).transpose(1, 2)
            k = k.view(B, Tx, H, C // H).transpose(1, 2)
            v = v.view(B, Tx, H, C // H).transpose(1, 2)
            if explicit:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
                att = att.masked_fill(~self.mask[:Tx, :Tx], float("-inf"))
                y = torch.softmax(att, dim=-1) @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out: torch.Tensor = self.c_proj(y.transpose(1, 2).contiguous().view(B, Tx, C))
            return out

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_fc = nn.Linear(C, 4 * C)
            self.gelu = nn.GELU(approximate="tanh")
            self.c_proj = nn.Linear(4 * C, C)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.c_proj(self.gelu(self.c_fc(x)))
            return out

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=1e-5)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(C, eps=1e-5)
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            out: torch.Tensor = x + self.mlp(self.ln_2(x))
            return out

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(C, eps=1e-5)
            self.apply(self._init)

        @staticmethod
        def _init(m: nn.Module) -> None:
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                bias = getattr(m, "bias", None)  # nn.Embedding has none
                if bias is not None:
                    nn.init.zeros_(bias)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            B, Tx = idx.shape
            x = self.wte(idx) + self.wpe(torch.arange(Tx, device=idx.device))
            for blk in self.h:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
            return F.cross_entropy(logits.reshape(B * Tx, V), targets.reshape(B * Tx))

    return GPT()


def adamw(model: torch.nn.Module, a: argparse.Namespace) -> torch.optim.AdamW:
    """nanoGPT's AdamW: weight decay on tensors of 2 or more dimensions only."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.99), eps=1e-8)


def lr_factor(step: int, total: int, a: argparse.Namespace) -> float:
    """Linear warm-up over --warmup steps, then cosine to --min-lr-ratio at ``total``."""
    warmup: int = a.warmup
    min_ratio: float = a.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def lm_batch(x: NDArray[Any], y: NDArray[Any], idx: NDArray[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    inp = torch.from_numpy(x[idx]).long()
    nxt = torch.from_numpy(y[idx]).long().view(-1, 1)
    return inp, torch.cat([inp[:, 1:], nxt], dim=1)


def val_loss(model: torch.nn.Module, data: Mapping[str, Any], batch: int = 128) -> float:
    import numpy as np
    import torch

    model.eval()
    n = len(data["y_test"])
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, batch):
            idx = np.arange(i, min(n, i + batch))
            inp, tgt = lm_batch(data["x_test"], data["y_test"], idx)
            total += float(model(inp, tgt)) * len(idx)
    model.train()
    return total / n


class Evaluator:
    """Evaluates every --eval-every samples, keeping training time apart from evaluation time."""

    def __init__(self, a: argparse.Namespace, model: torch.nn.Module, data: Mapping[str, Any]) -> None:
        self.a, self.model, self.data = a, model, data
        self.t0 = time.perf_counter()
        self.eval_s = 0.0
        self.next = a.eval_every
        self.curve: list[list[float]] = []
        self.reached: dict[str, float] | None = None

    def train_seconds(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_s

    def maybe(self, samples: int, force: bool = False) -> bool:
        """Evaluates when ``samples`` crossed the next multiple of --eval-every; returns whether the target was
        reached at this evaluation."""
        if not force and samples < self.next:
            return False
        while self.next <= samples:
            self.next += self.a.eval_every
        t = self.train_seconds()
        e0 = time.perf_counter()
        v = val_loss(self.model, self.data)
        self.eval_s += time.perf_counter() - e0
        self.curve.append([samples, round(t, 3), round(v, 5)])
        print(f"samples {samples} train {t:.1f}s val {v:.4f}", file=sys.stderr, flush=True)
        if v <= self.a.target and self.reached is None:
            self.reached = {"samples": samples, "seconds": round(t, 3), "val_loss": round(v, 5)}
            return True
        return False


def data_config(a: argparse.Namespace, path: Path, model_file: Path | None = None) -> str:
    """A minimal cluster.toml for ``tether.load_data`` (the built-in GPT kind, or the model file, with --context)."""
    from tether.cluster import toml_dumps

    cfg = {
        "cluster": {"servers": ["127.0.0.1:9"]},
        "model": ({"kind": "file", "file": str(model_file)} if model_file else
                  {"kind": "gpt", "layers": a.layers, "heads": a.heads, "dim": a.dim}),
        "data": {"dataset": a.dataset},
    }
    cfg["model"]["context"] = a.context
    Path(path).write_text(toml_dumps(cfg))
    return str(path)


def run_single(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    import numpy as np
    import torch

    import tether

    torch.set_num_threads(a.threads or 2)
    data = tether.load_data(data_config(a, work / "data.toml"))
    torch.manual_seed(a.seed)
    model = build_model(a)
    opt = adamw(model, a)
    x, y = data["x_train"], data["y_train"]
    n = len(y)
    per_epoch = n // a.batch
    total = max(1, int(per_epoch * a.epochs))
    rng = np.random.default_rng(a.seed)
    ev = Evaluator(a, model, data)
    order = None
    samples = 0
    for step in range(total):
        within = step % per_epoch
        if within == 0:
            order = rng.permutation(n)
        assert order is not None  # drawn at the first step of every epoch
        idx = order[within * a.batch:(within + 1) * a.batch]
        for g in opt.param_groups:
            g["lr"] = a.lr * lr_factor(step, total, a)
        inp, tgt = lm_batch(x, y, idx)
        opt.zero_grad(set_to_none=True)
        loss = model(inp, tgt)
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        samples += a.batch
        if ev.maybe(samples) and a.stop_at_target:
            break
    train_s = ev.train_seconds()
    if not ev.curve or ev.curve[-1][0] != samples:
        ev.maybe(samples, force=True)
    return {
        "mode": "single", "threads": a.threads or 2, "dataset": a.dataset, "note": data.get("note"),
        "params": sum(p.numel() for p in model.parameters()), "batch": a.batch, "steps": step + 1,
        "samples": samples, "train_seconds": round(train_s, 3), "eval_seconds": round(ev.eval_s, 3),
        "target": a.target, "seconds_to_target": ev.reached and ev.reached["seconds"],
        "samples_to_target": ev.reached and ev.reached["samples"], "final_val_loss": ev.curve[-1][2],
        "val_curve": ev.curve,
    }


def run_worker(a: argparse.Namespace) -> None:
    """One rank of the cluster run."""
    import torch

    import tether
    import tether.torch as tt

    torch.set_num_threads(a.threads or 1)
    if a.launched:  # a rank under python -m tether.launch: who and where from its environment
        a.config, a.rank = os.environ["TETHER_CONFIG"], int(os.environ["TETHER_RANK"])
        a.workers = int(os.environ["TETHER_WORLD_SIZE"])
        a.out = a.out.replace("{rank}", str(a.rank))
    data = tether.load_data(a.config)
    model = build_model(a)
    with tether.Worker(a.config, a.rank) as w:
        opt = adamw(model, a) if a.diloco else None
        sync: tt.DiLoCo | tt.PerStep = (
            tt.DiLoCo(model, opt, w, local_steps=a.diloco) if opt is not None else tt.PerStep(model, w))
        part = tether.Partition(len(data["y_train"]), a.rank, a.workers, 7)
        per_epoch = len(part.indices()) // a.batch
        total = max(1, int(per_epoch * a.epochs))
        x, y = data["x_train"], data["y_train"]
        ev = Evaluator(a, model, data) if a.rank == 0 else None
        t0 = time.perf_counter()
        order = None
        steps = 0
        stop = Path(a.stop_file) if a.stop_file else None
        for step in range(total):
            epoch, within = divmod(step, per_epoch)
            if within == 0:
                order = part.epoch_order(epoch)
            assert order is not None  # drawn at the first step of every epoch
            idx = order[within * a.batch:(within + 1) * a.batch]
            if opt is not None:
                for g in opt.param_groups:
                    g["lr"] = a.lr * lr_factor(step, total, a)
            inp, tgt = lm_batch(x, y, idx)
            model.zero_grad(set_to_none=True)
            loss = model(inp, tgt)
            loss.backward()
            if opt is not None and a.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            sync.step(loss=loss.detach())
            steps += 1
            if ev is not None:
                # Rank 0 counts every worker's samples: they run in lockstep within the staleness bound.
                if ev.maybe(steps * a.batch * a.workers) and a.stop_at_target:
                    assert stop is not None  # the launcher always passes --stop-file
                    stop.touch()
                    break
                # The run's soft deadline (--timeout-s less a margin): rank 0 stops everyone and reports what the
                # budget reached, as gpt_torchft.py does.
                if a.deadline is not None and stop is not None and time.time() > a.deadline:
                    ev.maybe(steps * a.batch * a.workers, force=True)
                    stop.touch()
                    break
            elif stop is not None and (a.stop_at_target or a.deadline is not None) and stop.exists():
                break
        if isinstance(sync, tt.DiLoCo):  # with --diloco
            sync.sync()
        train_s = ev.train_seconds() if ev else time.perf_counter() - t0
        result = {"rank": a.rank, "steps": steps, "train_seconds": train_s,
                  "params": sum(p.numel() for p in model.parameters()), "note": data.get("note")}
        if ev is not None:
            if not ev.curve or ev.curve[-1][0] != steps * a.batch * a.workers:
                ev.maybe(steps * a.batch * a.workers, force=True)
            result.update(eval_seconds=ev.eval_s, curve=ev.curve, reached=ev.reached)
        result["report"] = w.close()
    Path(a.out).write_text(json.dumps(result))


def run_cluster(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tether.cluster import LocalCluster

    cfg = cluster_sections(a, work)
    stop_file = work / "stop"
    if stop_file.exists():
        stop_file.unlink()
    deadline = time.monotonic() + a.timeout_s
    with LocalCluster(work / "cluster", cfg, shards=a.shards, workers=a.workers, bin_dir=a.bin_dir) as c:
        procs = []
        for r in range(a.workers):
            out = work / f"worker-{r}.json"
            log = open(work / f"worker-{r}.log", "wb")
            cmd = [sys.executable, os.path.abspath(__file__), "--config", c.config_path, "--rank", str(r),
                   "--out", str(out), "--stop-file", str(stop_file)]
            cmd += pass_through(a)
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out, log))
        results = []
        for p, out, log in procs:
            rc: int | str
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            log.close()
            if rc != 0:
                for q, _, _ in procs:
                    if q.poll() is None:
                        q.kill()
                sys.exit(f"worker failed ({rc}); see {log.name}")
            results.append(json.loads(out.read_text()))
    return summarize(a, results, work)


def node_hosts(a: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The host index of each shard's primary and of its standby with --on-hosts: shard k's primary on shard host
    k mod S and its standby on the next shard host; with --colocate, on worker host k mod W and the next one."""
    first, count = (a.shard_hosts, a.workers) if a.colocate else (0, a.shard_hosts)
    return ([first + k % count for k in range(a.shards)], [first + (k + 1) % count for k in range(a.shards)])


def host_placement(a: argparse.Namespace, addrs: Sequence[str]) -> dict[str, Any]:
    """Where each node listens with --on-hosts (ports 17400 + k for shard k's primary, 17500 + k for its standby,
    17600 for the witness on host 0; see `node_hosts`); worker i on host S + i."""
    hosts = a.shard_hosts
    if hosts < 1 or len(addrs) < hosts + a.workers:
        sys.exit(f"--on-hosts: {len(addrs)} hosts for {hosts} shard host(s) and {a.workers} worker host(s)")
    standbys = not a.no_standbys
    if standbys and (a.workers if a.colocate else hosts) < 2:
        sys.exit("--on-hosts: standbys need two hosts to hold shards (a standby never shares its primary's host)")
    primary, standby = node_hosts(a)
    place: dict[str, Any] = {
        "servers": [f"{addrs[h]}:{17400 + k}" for k, h in enumerate(primary)],
        "workers": a.workers,
    }
    if standbys:
        place["standbys"] = [f"{addrs[h]}:{17500 + k}" for k, h in enumerate(standby)]
        place["witness"] = f"{addrs[0]}:17600"
    return place


def run_on_hosts(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The cluster on the namespace hosts `tether-bench hosts` holds (TETHER_HOSTS_NETNS, TETHER_HOSTS_ADDRS): one
    ``python -m tether.launch --role nodes`` per shard host, one ``--role ranks`` per worker host, each inside its
    host's namespace; certificates name each node's address."""
    from tether.cluster import find_binary, toml_dumps

    netns = os.environ.get("TETHER_HOSTS_NETNS", "").split(",")
    addrs = os.environ.get("TETHER_HOSTS_ADDRS", "").split(",")
    if not netns[0] or len(netns) != len(addrs):
        sys.exit("--on-hosts runs inside `tether-bench hosts` (TETHER_HOSTS_NETNS and TETHER_HOSTS_ADDRS unset)")
    place = host_placement(a, addrs)
    cfg = cluster_sections(a, work)
    certs = work / "certs"
    cfg["cluster"].update(place, tls_dir=str(certs))
    config = work / "cluster.toml"
    config.write_text(toml_dumps(cfg))
    server = str(find_binary("tether-server", a.bin_dir))
    hosts = a.shard_hosts

    def keygen(*args: str) -> None:
        subprocess.run([server, "keygen", *args], check=True, stdout=subprocess.DEVNULL)

    primary, standby = node_hosts(a)
    if not (certs / "ca").exists():
        keygen("--out", str(certs), "--hosts", ",".join(addrs[h] for h in primary),
               "--servers", str(a.shards), "--workers", str(a.workers), *(["--standbys"] if "standbys" in place else []))
        # A standby runs on another host than its primary: its certificate names that host.
        for k in range(a.shards if "standbys" in place else 0):
            keygen("issue", "--ca", str(certs / "ca"), "--out", str(certs), "--standby", str(k),
                   "--host", addrs[standby[k]], "--force")
        # The witness runs on host 0, which `--hosts` names only when shard 0's primary is there too.
        if "witness" in place:
            keygen("issue", "--ca", str(certs / "ca"), "--out", str(certs), "--witness", "--host", addrs[0],
                   "--force")
    stop_file = work / "stop"
    if stop_file.exists():
        stop_file.unlink()
    launch = [sys.executable, "-m", "tether.launch", "--config", str(config), "--work-dir", str(work / "run"),
              "--log-dir", str(work / "logs"), "--max-restarts", "0"] + (["--bin-dir", a.bin_dir] if a.bin_dir else [])
    script = os.path.abspath(__file__)
    logs: list[Any] = []

    def start(h: int, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(work / f"launch-{h}.log", "wb")
        logs.append(log)
        return subprocess.Popen(["ip", "netns", "exec", netns[h], *launch, "--host", addrs[h], *args],
                                stdout=log, stderr=subprocess.STDOUT)

    deadline = time.monotonic() + a.timeout_s
    # Rank 0's soft deadline leaves time for the rest of a round, the last sync, the goodbyes and the final
    # evaluation before the hard one (at 10 Mbit/s per host a round alone took about 15 s).
    soft = time.time() + a.timeout_s - max(0.2 * a.timeout_s, min(60.0, 0.5 * a.timeout_s))
    # With --colocate a worker host's one launcher runs its shard nodes and its rank (role all); host 0 holds only
    # the witness, and host 1 nothing.
    node_hosts_used = ([0] if "standbys" in place else []) if a.colocate else list(range(hosts))
    nodes = [start(h, ["--role", "nodes", script]) for h in node_hosts_used]
    rank_role = [] if a.colocate else ["--role", "ranks"]
    ranks = [start(hosts + i, ["--node-rank", str(i), *rank_role, script, "--launched",
                               "--out", str(work / "worker-{rank}.json"), "--stop-file", str(stop_file),
                               "--deadline", repr(soft)] + pass_through(a)) for i in range(a.workers)]
    failed = None
    try:
        for i, p in enumerate(ranks):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = -1
            if rc != 0 and failed is None:
                failed = f"worker host {hosts + i} ended with {rc}; see {work}/launch-{hosts + i}.log"
                break
        for h, p in enumerate(nodes):
            try:
                # A launcher holding only the witness (host 0 with --colocate) runs until it is stopped.
                p.wait(timeout=60 if failed is None and not a.colocate else 5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in nodes + ranks:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs:
            log.close()
    if failed:
        sys.exit(failed)
    results = [json.loads((work / f"worker-{r}.json").read_text()) for r in range(a.workers)]
    out = summarize(a, results, work)
    out.update(placement={"shard_hosts": 0 if a.colocate else hosts, "worker_hosts": a.workers,
                          "colocated": a.colocate, **place})
    return out


def cluster_sections(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Exports the model file into ``work`` and returns the cluster's config sections (``[cluster]`` without
    addresses): the model file, the data, the recipe (AdamW with warm-up and cosine over every worker's steps),
    the outer Nesterov step of --diloco, the push codec."""
    import torch

    import tether
    import tether.torch as tt

    torch.manual_seed(a.seed)
    model_file = work / "gpt.safetensors"
    tt.export_model(build_model(a), str(model_file))
    data = tether.load_data(data_config(a, work / "data.toml", model_file))
    n = len(data["y_train"])
    per_worker = [int(len(tether.Partition(n, r, a.workers, 7).indices()) // a.batch * a.epochs)
                  for r in range(a.workers)]
    updates = sum(per_worker)
    staleness = a.staleness if a.staleness == "inf" else int(a.staleness)
    return {
        "cluster": {"staleness": staleness},
        "model": {"kind": "file", "file": str(model_file), "context": a.context},
        "data": {"dataset": a.dataset},
        "train": {"batch": a.batch, "epochs": max(1, math.ceil(a.epochs)), "seed": 7, "local_steps": a.diloco,
                  "clip_norm": a.clip},
        "optimizer": {
            "kind": "adamw", "lr": a.lr, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": a.weight_decay,
            "schedule": {"kind": "warmup_cosine", "warmup": a.warmup, "total": max(updates, a.warmup + 1),
                         "min_ratio": a.min_lr_ratio},
            "outer": {"kind": "nesterov", "lr": a.outer_lr, "momentum": a.outer_momentum},
        },
        "compression": {"scheme": a.compression},
        "checkpoint": {"every_updates": 0},
    }


def summarize(a: argparse.Namespace, results: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    """The run's JSON line from every rank's result (rank 0's first)."""
    staleness = a.staleness if a.staleness == "inf" else int(a.staleness)
    r0 = results[0]
    nparams = r0["params"]
    steps = sum(r["steps"] for r in results)
    wire_push = sum(r["report"]["wire_bytes_pushed"] for r in results)
    wire_pull = sum(r["report"]["wire_bytes_pulled"] for r in results)
    fp32 = 8 * nparams * steps
    return {
        "mode": f"diloco H={a.diloco}" if a.diloco else "per-step", "workers": a.workers, "shards": a.shards,
        "staleness": staleness, "compression": a.compression, "dataset": a.dataset, "note": r0.get("note"),
        "params": nparams, "batch": a.batch, "steps": steps, "samples": steps * a.batch,
        "train_seconds": round(r0["train_seconds"], 3), "eval_seconds": round(r0["eval_seconds"], 3),
        "target": a.target, "seconds_to_target": r0["reached"] and r0["reached"]["seconds"],
        "samples_to_target": r0["reached"] and r0["reached"]["samples"], "final_val_loss": r0["curve"][-1][2],
        "val_curve": r0["curve"], "wire_bytes_pushed": wire_push, "wire_bytes_pulled": wire_pull,
        "fp32_per_step_bytes": fp32, "reduction_vs_fp32": round(fp32 / max(1, wire_push + wire_pull), 1),
        "pull_wait_seconds": round(sum(r["report"].get("pull_wait_seconds", 0.0) for r in results), 3),
        "work_dir": str(work),
    }


def pass_through(a: argparse.Namespace) -> list[str]:
    """The flags a worker process needs, from the launcher's."""
    out = []
    for flag in ("workers", "diloco", "epochs", "batch", "lr", "min_lr_ratio", "warmup", "weight_decay", "clip",
                 "layers", "heads", "dim", "context", "eval_every", "target", "seed"):
        out += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
    if a.threads:
        out += ["--threads", str(a.threads)]
    if a.explicit_attention:
        out.append("--explicit-attention")
    if a.stop_at_target:
        out.append("--stop-at-target")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    if a.rank is not None or a.launched:
        run_worker(a)
        return
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="tether-gpt-"))
    work.mkdir(parents=True, exist_ok=True)
    result = run_single(a, work) if a.single else run_on_hosts(a, work) if a.on_hosts else run_cluster(a, work)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
