"""A small GPT with nanoGPT's architecture, written for this example.

Token and position embeddings, a stack of pre-LayerNorm transformer blocks (causal self-attention
through ``scaled_dot_product_attention``, then a 4x MLP with GELU), a final LayerNorm, and an output
head that shares its weight with the token embedding. ``forward(idx, targets=None)`` returns
``(logits, loss)`` as nanoGPT's model does: with targets, the logits of every position and the mean
cross-entropy; without, the logits of the last position only and ``loss=None``. That two-argument
forward is what lets ``distkit.Trainer`` train it with no ``loss_fn`` and no ``training_step``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "GPTConfig", "make_optimizer"]


@dataclass
class GPTConfig:
    """The model's shape. The defaults are nanoGPT's character-level Shakespeare model."""

    vocab_size: int = 65
    block_size: int = 256  # the longest context the position table covers
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    bias: bool = False  # biases in the linear layers and LayerNorms (GPT-2 had them)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(
                f"n_embd must be a multiple of n_head, got n_embd={config.n_embd}, n_head={config.n_head}."
            )
        self.n_head = config.n_head
        self.dropout = config.dropout
        # Queries, keys and values of every head come out of one matrix product.
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.out = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        # (B, T, 3C) -> three (B, heads, T, C/heads) tensors.
        q, k, v = self.qkv(x).view(batch, time, 3, self.n_head, channels // self.n_head).unbind(dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # The fused kernel applies the causal mask and the attention dropout itself.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, time, channels)
        return self.out_drop(self.out(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LN residual block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """A decoder-only transformer language model.

    Example:
        >>> model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16))
        >>> idx = torch.zeros(2, 8, dtype=torch.long)
        >>> logits, loss = model(idx, idx)
        >>> tuple(logits.shape), loss.dim()
        ((2, 8, 10), 0)
        >>> model(idx)[0].shape, model(idx)[1]
        (torch.Size([2, 1, 10]), None)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): the output layer reads logits with the embedding table.
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled initialisation: each residual branch's last projection gets a smaller
        # standard deviation, 0.02 / sqrt(number of residual additions), so the stream's variance
        # does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("out.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self, *, non_embedding: bool = True) -> int:
        """Parameters counted once (the tied head is the embedding); without the position table by default."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.pos_emb.weight.numel() if non_embedding else total

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, time = idx.shape
        if time > self.config.block_size:
            raise ValueError(
                f"sequence of length {time} is longer than block_size={self.config.block_size}; "
                f"crop the context to its last {self.config.block_size} tokens."
            )
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            # Generation needs the next token only: skip the head on the other positions.
            return self.head(x[:, -1:, :]), None
        logits = self.head(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to each row of ``idx`` (call ``model.eval()`` first)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


def make_optimizer(
    params: Iterable[nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
) -> torch.optim.AdamW:
    """AdamW with two groups, as nanoGPT has: matrices and embeddings (2-D and more) decay, biases
    and LayerNorm gains (1-D) do not.

    A function of the parameters, so that ``Trainer.fit(optimizer=functools.partial(make_optimizer,
    ...))`` builds it over the parameters it trains.
    """
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel is the fastest AdamW on CUDA; elsewhere the default (foreach) is used.
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)
