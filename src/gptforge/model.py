"""The GPT-2 model: token + position embeddings, pre-LayerNorm transformer blocks, weight-tied LM head.

Parameter names follow OpenAI's GPT-2 / Hugging Face (`transformer.wte`, `transformer.h.0.attn.c_attn`, ...)
so that nanoGPT checkpoints and HF weights map onto it one to one. Torch only; nothing else of the package.

    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65))
    logits, loss = model(idx, targets)          # idx, targets: (B, T) int64
    out = model.generate(idx, max_new_tokens=100, temperature=0.8, top_k=200)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest context the position table covers
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64: faster matmuls, the extra rows go unused
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm; False is slightly better and faster


# The GPTConfig fields a checkpoint's `model_args` must fix (dropout may change between runs).
MODEL_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        # SDPA picks a fused (flash / memory-efficient) kernel where one exists; is_causal masks the future.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's own ("gelu_new"), so HF weights give HF's logits
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.vocab_size > 0 and config.block_size > 0, "vocab_size and block_size must be positive"
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): input embedding and output projection share one matrix.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # Residual projections add into the stream once per attention and MLP, 2 * n_layer times in all;
        # scaling their init keeps the stream's variance from growing with depth (GPT-2 paper).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. Tied wte/lm_head counts once; non_embedding leaves out the position table."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids -> (logits, loss). Without targets only the last position's logits (B, 1, V)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)  # (B, T, C)
        if targets is None:
            # Generation needs only the next-token distribution: skip the (B, T, V) projection.
            return self.lm_head(x[:, [-1], :]), None  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        # Cross-entropy in float32 even under autocast: the softmax over 50k entries needs the range.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context length (e.g. GPT-2's 1024 to a smaller block_size for fine-tuning)."""
        assert 0 < block_size <= self.config.block_size, "can only crop to a smaller block_size"
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6N for the matmuls + 12 L H Q T for attention.

        PaLM paper, appendix B. N excludes the position table, which is a lookup, not a matmul.
        """
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, seq_len or cfg.block_size
        return 6 * self.get_num_params() + 12 * L * H * Q * T

    def estimate_mfu(self, fwdbwd_per_iter: float, dt: float, peak_flops: float, seq_len: int | None = None) -> float:
        """Model FLOPs utilisation: achieved FLOP/s (fwdbwd_per_iter sequences in dt seconds) / peak_flops."""
        flops_per_iter = self.flops_per_token(seq_len) * (seq_len or self.config.block_size) * fwdbwd_per_iter
        return flops_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T). temperature 0 = greedy; top_k keeps the k likeliest."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :].float()  # (B, V)
            if temperature <= 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.size(-1):
                    kth = torch.topk(logits, top_k).values[:, [-1]]  # (B, 1): the k-th largest logit
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                probs = F.softmax(logits, dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
