"""Models and worker processes for the Python package's tests: a PyTorch MLP and a small nanoGPT-shaped GPT, the
worker loop (``python workers.py mlp|gpt ...``, one process per rank, as a user would run it) and the
single-process GPT reference. The tests start these as subprocesses and read the JSON result each writes.

Each worker: builds the module, joins with ``tether.Worker(config, rank)``, checks the layout, pulls the initial
weights (the model file's), trains its partition of ``tether.load_data(config)`` (``tether.Partition``: the same
shares and shuffles as the Rust worker) with ``tether.torch.PerStep`` or ``DiLoCo``, evaluates when asked and writes
``{"rank", "steps", "accuracy" | "val_loss", "report", ...}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def build_mlp(features: int, hidden, classes: int) -> nn.Module:
    """features -> hidden... (ReLU) -> classes, as the Rust MLP."""
    layers = []
    width = features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int):
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.heads = heads
        self.dim = dim
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, context: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, context)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT: token + position embeddings, pre-norm blocks, final LayerNorm, head tied to wte."""

    def __init__(self, layers: int = 2, heads: int = 4, dim: int = 64, context: int = 32):
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(256, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList([Block(dim, heads, context) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(b * t, 256), targets.reshape(b * t))


GPT_SHAPE = dict(layers=1, heads=2, dim=32, context=16)


def lm_tensors(x: np.ndarray, y: np.ndarray):
    """Rows of ``context`` byte tokens (floats) and the next byte -> (inputs, targets) int64 tensors."""
    idx = torch.from_numpy(np.ascontiguousarray(x)).long()
    nxt = torch.from_numpy(np.ascontiguousarray(y)).long().view(-1, 1)
    return idx, torch.cat([idx[:, 1:], nxt], dim=1)


@torch.no_grad()
def gpt_val_loss(model: nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 256) -> float:
    model.eval()
    idx, tgt = lm_tensors(x, y)
    total, n = 0.0, 0
    for i in range(0, idx.shape[0], batch):
        loss = model(idx[i:i + batch], tgt[i:i + batch])
        total += float(loss) * idx[i:i + batch].shape[0]
        n += idx[i:i + batch].shape[0]
    model.train()
    return total / n


@torch.no_grad()
def mlp_accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    pred = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    model.train()
    return float((pred == y).mean())


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """The shards' warmup_cosine schedule (common/src/optim.rs) as a factor of the base lr, for the 0-based
    ``step`` (update number t = step + 1): t / warmup while t < warmup, then cosine from 1 to ``min_ratio`` at
    ``total``."""
    t = step + 1
    if t < warmup:
        return t / warmup
    if t >= total:
        return min_ratio
    p = (t - warmup) / (total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


# ---------------------------------------------------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------------------------------------------------


def run_worker(a) -> dict:
    import tether
    import tether.torch as tt

    torch.set_num_threads(1)
    data = tether.load_data(a.config)
    with tether.Worker(a.config, a.rank, reconnect_deadline_s=a.reconnect_deadline_s) as w:
        if a.model == "mlp":
            model = build_mlp(int(data["features"]), a.hidden, int(data["classes"]))
        else:
            model = GPT(**GPT_SHAPE)
        tt.check_layout(model, w)
        if a.mode == "diloco":
            inner = torch.optim.Adam(model.parameters(), lr=a.inner_lr)
            sync = tt.DiLoCo(model, inner, w, local_steps=a.local_steps or None)
        else:
            inner = None
            sync = tt.PerStep(model, w)
        part = tether.Partition(len(data["y_train"]), a.rank, a.workers, a.seed)
        n = len(part.indices())
        batch = min(a.batch, max(1, n))
        per_epoch = max(1, n // batch)
        total = a.epochs * per_epoch
        if a.max_steps:
            total = min(total, a.max_steps)
        # With --resume (a restarted process) the worker skips the rounds its clock says were done: the shards
        # welcome a rejoining rank at its clock. A fresh worker runs every step, whatever clock it was welcomed at
        # (a worker that joins after the others have started is welcomed at their clock).
        first = min(int(w.clock) * (a.local_steps if a.mode == "diloco" else 1), total) if a.resume else 0
        print(f"rank {a.rank}: steps {first}..{total}", flush=True)
        xt, yt = data["x_train"], data["y_train"]
        order = None
        t0 = time.perf_counter()
        losses = []
        for step in range(first, total):
            epoch, within = divmod(step, per_epoch)
            if order is None or within == 0:
                order = part.epoch_order(epoch)
            idx = order[within * batch:(within + 1) * batch]
            model.zero_grad(set_to_none=True)
            if a.model == "mlp":
                out = model(torch.from_numpy(xt[idx]))
                loss = F.cross_entropy(out, torch.from_numpy(yt[idx]).long())
            else:
                inp, tgt = lm_tensors(xt[idx], yt[idx])
                loss = model(inp, tgt)
            loss.backward()
            if inner is not None:
                for g in inner.param_groups:
                    g["lr"] = a.inner_lr * warmup_cosine(step, a.warmup, total, a.min_ratio)
            sync.step(loss=loss.detach())
            losses.append(float(loss.detach()))
            if a.step_delay_ms:
                time.sleep(a.step_delay_ms / 1000.0)
            if (step + 1) % 10 == 0:
                print(f"rank {a.rank} step {step + 1}", flush=True)
        if a.mode == "diloco":
            sync.sync()  # the last partial round, as the Rust worker pushes it
        train_s = time.perf_counter() - t0
        result = {"rank": a.rank, "first": first, "steps": total - first, "total": total, "train_s": train_s,
                  "final_loss": float(np.mean(losses[-20:])) if losses else float("nan")}
        if a.evaluate:
            if a.model == "mlp":
                result["accuracy"] = mlp_accuracy(model, data["x_test"], data["y_test"])
            else:
                result["val_loss"] = gpt_val_loss(model, data["x_test"], data["y_test"])
        result["report"] = w.close(60.0)
    return result


def run_single_gpt(a) -> dict:
    """The peer: one plain PyTorch process, the same init (``--init``), data, samples and optimizer settings."""
    import tether

    torch.set_num_threads(1)
    data = tether.load_data(a.config)
    model = GPT(**GPT_SHAPE)
    model.load_state_dict(torch.load(a.init))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=a.weight_decay)
    xt, yt = data["x_train"], data["y_train"]
    n = len(yt)
    rng = np.random.default_rng(a.seed)
    total = a.updates
    order = rng.permutation(n)
    pos = 0
    t0 = time.perf_counter()
    for step in range(total):
        if pos + a.batch > n:
            order, pos = rng.permutation(n), 0
        idx = order[pos:pos + a.batch]
        pos += a.batch
        for g in opt.param_groups:
            g["lr"] = a.lr * warmup_cosine(step, a.warmup, total, a.min_ratio)
        inp, tgt = lm_tensors(xt[idx], yt[idx])
        opt.zero_grad(set_to_none=True)
        loss = model(inp, tgt)
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
    train_s = time.perf_counter() - t0
    return {"steps": total, "train_s": train_s, "val_loss": gpt_val_loss(model, data["x_test"], data["y_test"])}


def main(argv=None):
    p = argparse.ArgumentParser(description="a Tether test worker")
    p.add_argument("model", choices=["mlp", "gpt", "single-gpt"])
    p.add_argument("--config", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", choices=["perstep", "diloco"], default="perstep")
    p.add_argument("--local-steps", type=int, default=0)
    p.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",") if v], default=[64])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="cap on this worker's steps (0: none)")
    p.add_argument("--updates", type=int, default=0, help="single-gpt: optimizer steps")
    p.add_argument("--seed", type=int, default=7, help="train.seed (partition and shuffles)")
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--min-ratio", type=float, default=0.05)
    p.add_argument("--init", help="single-gpt: state_dict of the initial weights")
    p.add_argument("--evaluate", action="store_true")
    p.add_argument("--resume", action="store_true", help="skip the steps the welcomed clock says were done")
    p.add_argument("--step-delay-ms", type=float, default=0.0)
    p.add_argument("--reconnect-deadline-s", type=float, default=60.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    result = run_single_gpt(a) if a.model == "single-gpt" else run_worker(a)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, a.out)
    print(json.dumps({k: v for k, v in result.items() if k != "report"}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
