"""A hand-written PyTorch training loop: the baseline that bench/throughput.py measures
kempnerforge against.

Written the way a user writes one, in plain PyTorch and importing nothing from kempnerforge:
its own small Llama module (RMSNorm, RoPE, causal SDPA, SwiGLU), `torch.optim.AdamW` with
its default implementation, `F.cross_entropy` over the full logits, gradient clipping, a
warmup + cosine LambdaLR and `loss.item()` every step for logging. Nothing in it is tuned
(threads, allocator, fused kernels): that is the point of the comparison. Batches are random
windows of a uint16 token file (`--tokens`, e.g. the built-in corpus) or random ids.

Prints one JSON line: tokens_per_sec (wall clock from the end of warm-up step `--skip` to
the end of the last step) and peak_rss_gib (the process's peak resident memory).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = a.n_heads, a.n_kv_heads
        self.sdpa_gqa = getattr(a, "sdpa_gqa", False)
        self.head_dim = a.dim // a.n_heads
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads and not self.sdpa_gqa:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        gqa = self.n_kv_heads != self.n_heads and self.sdpa_gqa
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)
        if getattr(a, "tie_embeddings", False):
            self.head.weight = self.embed.weight
        head_dim = a.dim // a.n_heads
        freqs = 1.0 / a.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(a.seq_len).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's shape (what Llama reads), shared with bench/gpu/hand_loop.py."""
    p.add_argument("--vocab", type=int, default=259)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--ffn-hidden", type=int, default=768)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--tie-embeddings", action="store_true", help="the head reuses the embedding")
    p.add_argument(
        "--sdpa-gqa", action="store_true", help="grouped-query heads through SDPA, not copied"
    )
    p.add_argument("--seq-len", type=int, default=256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of timing")
    p.add_argument("--tokens", default="", help="a uint16 token file; empty: random ids")
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    model = Llama(a)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=a.lr, betas=tuple(a.betas), weight_decay=a.weight_decay
    )

    def lr_factor(step: int) -> float:
        if step < a.warmup_steps:
            return (step + 1) / a.warmup_steps
        progress = (step - a.warmup_steps) / max(1, a.steps - a.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    tokens = np.memmap(a.tokens, dtype=np.uint16, mode="r") if a.tokens else None
    rng = np.random.default_rng(a.seed)
    stamps = []
    for _ in range(a.steps):
        if tokens is None:
            window = torch.randint(0, a.vocab, (a.batch_size, a.seq_len + 1))
        else:
            starts = rng.integers(0, len(tokens) - a.seq_len - 1, size=a.batch_size)
            window = torch.from_numpy(
                np.stack([tokens[s : s + a.seq_len + 1] for s in starts]).astype(np.int64)
            )
        x, y = window[:, :-1], window[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
        scheduler.step()
        loss.item()
        stamps.append(time.perf_counter())
    timed = a.steps - a.skip
    seconds = stamps[-1] - stamps[a.skip - 1]
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        json.dumps(
            {
                "tokens_per_sec": timed * a.batch_size * a.seq_len / seconds,
                "peak_rss_gib": round(peak_rss_gib, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
