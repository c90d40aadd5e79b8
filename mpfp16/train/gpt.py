"""A GPT-2-style decoder-only transformer: the transformer the benchmarks measure.

Pre-LayerNorm blocks (LayerNorm, causal self-attention, LayerNorm, a 4x-wide GELU
MLP), learned position embeddings, a final LayerNorm, and an output projection tied
to the token embedding (one Parameter, as in GPT-2). ``to_half`` keeps the
LayerNorms in fp32, as it does every normalization layer.

The weights start as GPT-2's do: normal with std 0.02, zero biases, and the two
projections that add into the residual stream in each block with std 0.02 / sqrt(2
layers). torch's default N(0, 1) embedding, which the output projection shares, would
start the logits with std sqrt(width): 28 for ``gpt2``, a first loss near 460
rather than ln(50257) = 10.8.

Two sizes are named:

``gpt2``
    GPT-2 small (Radford et al. 2019): vocabulary 50257, 1024 positions, width 768,
    12 blocks, 12 heads; 124,439,808 parameters in 148 tensors.
``imagegpt-s``
    the ImageGPT-sized model of Lightning's ``no_sync`` issue: 512 colour clusters
    plus a start token, 32x32 = 1024 positions, width 512, 6 blocks, 8 heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPT_SIZES", "build_gpt", "next_token_loss"]

GPT_SIZES = {
    "gpt2": dict(vocab_size=50257, seq_len=1024, width=768, layers=12, heads=12),
    "imagegpt-s": dict(vocab_size=513, seq_len=1024, width=512, layers=6, heads=8),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``GPT(...)(tokens)`` maps int64 token ids of shape (batch, t <= seq_len) to
    logits of shape (batch, t, vocab_size)."""

    def __init__(self, vocab_size: int, seq_len: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(_init_weights)
        for block in self.blocks:
            for residual_proj in (block.attn.c_proj, block.mlp[2]):
                nn.init.normal_(residual_proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's {self.seq_len} positions")
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_gpt(name: str, **overrides) -> GPT:
    """A named size (``GPT_SIZES``), with any of its settings overridden."""
    if name not in GPT_SIZES:
        raise ValueError(f"unknown GPT size {name!r}; known: {', '.join(GPT_SIZES)}")
    return GPT(**{**GPT_SIZES[name], **overrides})


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, in fp32, of predicting token t+1 from the tokens up to t;
    ``tokens`` has shape (batch, t + 1)."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
