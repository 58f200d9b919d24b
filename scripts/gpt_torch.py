#!/usr/bin/env python3
"""PyTorch twin of Tether's built-in byte-level GPT, for side-by-side CPU step times (never a dependency of the project).

Model: vocab 256 (bytes), context T, 4 layers, 4 heads, n_embd 128, biases everywhere, no dropout. Token embedding
wte [256, C] + position embedding wpe [T, C]; pre-norm blocks x += attn(ln_1(x)); x += mlp(ln_2(x)); attention is one
Linear C->3C (q, k, v), causal softmax attention scaled by 1/sqrt(head_dim) written as explicit matmuls + a masked
softmax (as the Rust side does; --sdpa switches to F.scaled_dot_product_attention), then Linear C->C; MLP Linear C->4C,
GELU (tanh approximation), Linear 4C->C; final LayerNorm (eps 1e-5); logits = x @ wte.T (tied); mean cross-entropy
over all B x T positions, targets = the input shifted by one. Init: N(0, 0.02) weights, zero biases, LayerNorm 1/0.

One step = forward + backward + Adam(lr 1e-3). ms_fwd_bwd times forward + backward alone inside each step (the
Tether worker step has no optimizer: the shards apply it); ms_step times the whole step. Medians over --steps steps
after --warmup steps. Prints one JSON line on stdout; tokens_per_s = batch * context / median fwd+bwd time.

Usage: gpt_torch.py [--batch 12] [--threads 2] [--steps 50] [--warmup 5] [--context 64] [--dtype fp32|bf16]
                    [--sdpa] [--text PATH] [--seed 0]
"""
import argparse
import json
import math
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--context", type=int, default=64, help="T, the sequence length (and the size of wpe)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: forward under torch.autocast('cpu', dtype=torch.bfloat16); weights stay fp32")
    p.add_argument("--sdpa", action="store_true",
                   help="use F.scaled_dot_product_attention(is_causal=True) instead of the explicit matmuls")
    p.add_argument("--text", metavar="PATH", help="train on the bytes of this file (default: seeded random bytes)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.n_embd % a.n_head:
        p.error("--n-embd must be a multiple of --n-head")
    if a.steps < 1 or a.warmup < 0 or a.batch < 1 or a.threads < 1 or a.context < 1:
        p.error("--steps, --batch, --threads and --context must be >= 1, --warmup >= 0")
    return a


def build_model(T=64, n_layer=4, n_head=4, n_embd=128, sdpa=False):
    """The GPT as an nn.Module whose forward(idx [B, T'], targets [B, T']) returns the mean cross-entropy."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    V, C, H, L = 256, n_embd, n_head, n_layer

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.hd = C // H
            self.scale = 1.0 / math.sqrt(self.hd)
            self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)), persistent=False)

        def forward(self, x):
            B, Tx, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q = q.view(B, Tx, H, self.hd).transpose(1, 2)  # [B, H, T, hd]
            k = k.view(B, Tx, H, self.hd).transpose(1, 2)
            v = v.view(B, Tx, H, self.hd).transpose(1, 2)
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * self.scale  # [B, H, T, T]
                att = att.masked_fill(~self.mask[:Tx, :Tx], float("-inf"))
                att = torch.softmax(att, dim=-1)
                y = att @ v  # [B, H, T, hd]
            y = y.transpose(1, 2).contiguous().view(B, Tx, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(C, 4 * C)
            self.gelu = nn.GELU(approximate="tanh")
            self.c_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=1e-5)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(C, eps=1e-5)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(C, eps=1e-5)
            self.apply(self._init)

        @staticmethod
        def _init(m):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

        def forward(self, idx, targets):
            B, Tx = idx.shape
            pos = torch.arange(Tx, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.h:
                x = blk(x)
            x = self.ln_f(x)
            logits = x @ self.wte.weight.t()  # weight tying: no separate lm_head
            return F.cross_entropy(logits.reshape(B * Tx, V).float(), targets.reshape(B * Tx))

    return GPT()


def main(argv=None):
    a = parse_args(argv)
    import torch  # after argument parsing, so --help works without torch

    # Thread pools first: set_num_interop_threads fails once any inter-op work has started.
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(a.threads)
    torch.manual_seed(a.seed)

    V, T, C, H, L = 256, a.context, a.n_embd, a.n_head, a.n_layer
    model = build_model(T, L, H, C, a.sdpa)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    expected = L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C
    if params != expected:
        print(f"warning: {params} parameters, formula says {expected}", file=sys.stderr)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)

    # Data: a byte stream (a file's bytes or seeded random bytes); each step takes B random windows of T + 1 bytes.
    g = torch.Generator().manual_seed(a.seed)
    if a.text:
        with open(a.text, "rb") as f:
            raw = f.read()
        if len(raw) < T + 2:
            sys.exit(f"{a.text}: needs at least {T + 2} bytes")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    else:
        data = torch.randint(0, V, (1 << 20,), generator=g)

    def batch():
        ix = torch.randint(0, data.numel() - T - 1, (a.batch,), generator=g)
        chunk = torch.stack([data[i:i + T + 1] for i in ix.tolist()])
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    use_bf16 = a.dtype == "bf16"
    fb_ms, step_ms, losses = [], [], []
    for it in range(a.warmup + a.steps):
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if it >= a.warmup:
            fb_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t0) * 1e3)
            losses.append(loss.item())

    def pct(xs, q):  # linear interpolation between closest ranks, q in [0, 1]
        s = sorted(xs)
        k = (len(s) - 1) * q
        lo = math.floor(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    med_fb = statistics.median(fb_ms)
    out = {
        "impl": "pytorch",
        "torch": torch.__version__,
        "threads": a.threads,
        "batch": a.batch,
        "context": T,
        "params": params,
        "ms_fwd_bwd": round(med_fb, 3),
        "ms_step": round(statistics.median(step_ms), 3),
        "ms_fwd_bwd_p10": round(pct(fb_ms, 0.10), 3),
        "ms_fwd_bwd_p90": round(pct(fb_ms, 0.90), 3),
        "tokens_per_s": round(a.batch * T / (med_fb / 1e3), 1),
        "dtype": a.dtype,
        "attention": "sdpa" if a.sdpa else "explicit",
        "steps": a.steps,
        "warmup": a.warmup,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
