"""The GPT-2 model: token + position embeddings, pre-LayerNorm blocks, a weight-tied LM head, KV-cache generation.
Parameter names are OpenAI's / Hugging Face's (`transformer.h.0.attn.c_attn`, ...), so nanoGPT checkpoints and HF
weights map onto it one to one. The modern recipe's switches (rotary, RMSNorm, qk-norm, relu2, an untied and
soft-capped head) are settings of the same modules. Each module has one forward; the speed paths (CPU kernels,
compiled layouts) are behind kernels/' functions, which choose their own."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptforge.core.shape import ModelShape
from gptforge.kernels.attention import attend, attention_heads, own_attention
from gptforge.kernels.head_loss import loss_without_logits
from gptforge.kernels.norms import rms_norm
from gptforge.kernels.rotary import Rope, rotary_angles
from gptforge.model.cache import KVCache, cached_rule, document_mask
from gptforge.model.modules import Dropout, LayerNorm, Linear, ReLU2, RMSNorm, residual


@dataclass(frozen=True)
class GPTConfig(ModelShape):
    """The network's settings: the model's shape, dropout and switches (core/shape.py, written once there) and
    the vocabulary, which comes from the data."""

    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64: faster matmuls, the extra rows go unused


def norm_layer(config: GPTConfig) -> nn.Module:
    return RMSNorm() if config.rmsnorm else LayerNorm(config.n_embd, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.fast_dropout = False  # GPT.use_fast_dropout sets it
        self.qk_norm = config.qk_norm
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = Dropout(config.dropout)  # taken with the residual sum: Block.forward

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """rope: the rotary (cos, sin) of these positions, computed once per forward by GPT.hidden_states. mask: a
        bool mask broadcastable to (B, nh, T, keys), True where a query may attend (the caller's whole rule: causal,
        documents, padding); None: causal, after any cached tokens. Returns the projection before resid_dropout."""
        B, T, C = x.size()
        qkv = self.c_attn(x)  # (B, T, 3 C): q, k, v side by side
        p = self.dropout if self.training else 0.0
        own = own_attention(qkv, p, self.fast_dropout, cache is not None)  # gptforge's attention, or SDPA
        q, k, v = attention_heads(qkv, self.n_head, rope, self.qk_norm, own)  # (B, nh, T, hs) each
        causal = mask is None
        if cache is not None:
            mask, causal = cached_rule(cache, T, mask, x.device)
            k, v = cache.update(layer, k, v)  # (B, nh, past + T, hs)
        if cache is not None and hasattr(cache, "attend"):  # a cache with its own attention (infer/decode.py)
            y = cache.attend(q, k, v, mask)
        else:
            y = attend(q, k, v, p, mask, causal, own)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # gelu 'erf': nanoGPT's exact GELU; 'tanh': GPT-2's approximation, which its weights were trained with
        approximate = {"erf": "none", "tanh": "tanh"}[config.gelu]
        self.gelu = ReLU2() if config.relu2 else nn.GELU(approximate=approximate)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)  # taken with the residual sum: Block.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = norm_layer(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm_layer(config)
        self.mlp = MLP(config)
        self.attn.resid_dropout.follow_with(self.ln_2)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        # each branch's dropout taken with its residual sum (modules.residual: one pass where a kernel has it)
        x = residual(x, self.attn(self.ln_1(x), rope, mask, cache, layer), self.attn.resid_dropout)  # x + attn(ln_1(x))
        return residual(x, self.mlp(self.ln_2(x)), self.mlp.dropout)  # x + mlp(ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.vocab_size > 0 and config.block_size > 0, "vocab_size and block_size must be positive"
        self.config = config
        parts = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if not config.rotary:
            parts["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        parts.update(
            drop=Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=norm_layer(config),
        )
        self.transformer = nn.ModuleDict(parts)
        blocks = self.transformer.h
        for block, norm in zip(blocks, [*(b.ln_1 for b in blocks[1:]), self.transformer.ln_f], strict=True):
            block.mlp.dropout.follow_with(norm)  # the norm each block's output goes through next
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if not config.untie_head:
            # Weight tying (Press & Wolf 2017): input embedding and output projection share one matrix.
            self.transformer.wte.weight = self.lm_head.weight
        if config.rotary:
            self.reset_rope()
        self.apply(self._init_weights)
        # Residual projections add into the stream once per attention and MLP, 2 * n_layer times in all;
        # scaling their init keeps the stream's variance from growing with depth (GPT-2 paper).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
                if config.zero_init:  # modded-nanogpt: each block starts as the identity
                    nn.init.zeros_(p)

    def reset_rope(self) -> None:
        """The rotary cos and sin of positions 0 .. block_size - 1 (float32, (block_size, head_size / 2) each), computed
        once: buffers that move with the model and stay out of its state_dict (computed in each forward instead,
        torch.compile fuses pow, cos and sin into every kernel that uses them: docs/lab/2026-11-26-h200.md). A model
        built on the meta device calls this again once its weights are in place."""
        cfg, device = self.config, self.transformer.wte.weight.device
        positions = torch.arange(cfg.block_size, dtype=torch.long, device=device)
        cos, sin = rotary_angles(positions, cfg.n_embd // cfg.n_head, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def use_onednn_f32(self, on: bool) -> None:
        """Compute every Linear's float32 CPU products (forward and backward) with oneDNN's matmul instead of torch's
        (kernels/linear.py): the same sums in another order. Off (a new model's default), torch's arithmetic, rounding
        for rounding."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.onednn = on

    def use_fast_dropout(self, on: bool) -> None:
        """Draw every dropout mask (embeddings, attention, residual) with keep_mask instead of torch's bernoulli:
        the same rule and expectation, other random numbers. Off, the model is nanoGPT's, draw for draw."""
        for module in self.modules():
            if isinstance(module, (Dropout, CausalSelfAttention)):
                module.fast_dropout = on

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. Tied wte/lm_head counts once; non_embedding leaves out the position table."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        reduction: str = "mean",
        need_logits: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) token ids -> (logits, loss). Without targets only the last position's logits (B, 1, V).

        With a KVCache, idx continues the cached tokens (positions start at cache.position) and the cache grows.
        positions and mask: see hidden_states. Targets of -1 are not scored; reduction 'sum' adds the scored
        targets' losses (0 when there are none), 'mean' averages them (nanoGPT's). need_logits=False (training's
        step): the logits may be None, the loss taken without them (kernels/head_loss.py).
        """
        x = self.hidden_states(idx, cache, positions, mask)  # (B, T, C)
        if targets is None:
            # Generation needs only the next-token distribution: skip the (B, T, V) projection.
            return self.logits(x[:, [-1], :]), None  # (B, 1, V)
        cap, head = self.config.logit_softcap, self.lm_head
        loss = None if need_logits else loss_without_logits(x, head.weight, head, targets, cap, reduction)
        if loss is not None:
            return None, loss
        logits = self.logits(x)  # (B, T, V)
        # Cross-entropy in float32 even under autocast: the softmax over 50k entries needs the range.
        flat = logits.float().view(-1, logits.size(-1))
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1, reduction=reduction)
        return logits, loss

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head on hidden states (..., C), then the soft-cap when logit_softcap > 0."""
        logits = self.lm_head(x)
        cap = self.config.logit_softcap
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    def hidden_states(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """idx (B, T) token ids -> the final LayerNorm's output (B, T, C), which lm_head turns into logits.

        forward() without lm_head, for callers that need the logits at a few positions only (HellaSwag).
        positions: (T,) or (B, T) each token's position (default: after the cached tokens, from 0 without a cache);
        packed documents restart theirs, batched rows of different lengths have their own. mask: the attention
        rule, a bool mask broadcastable to (B, 1, T, keys), True where a query may attend (default: causal).
        """
        B, T = idx.size()
        start = cache.position if cache is not None else 0
        counted = positions is None  # start, start + 1, ...: the rotary table holds their angles
        if positions is None:
            if start + T > self.config.block_size and not (cache is not None and cache.ring and T <= cache.max_len):
                raise ValueError(f"sequence of length {start + T} is longer than block_size {self.config.block_size}")
            positions = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # after the cached ones
        else:
            if (  # a compiled decode step's callers keep positions inside the context themselves
                not self.config.rotary
                and not torch.compiler.is_compiling()
                and int(positions.max()) >= self.config.block_size
            ):
                raise ValueError(f"position {int(positions.max())} is past block_size {self.config.block_size}")
            if mask is None and cache is None and positions.dim() == 2:
                mask = document_mask(positions)  # packed documents: each token sees its own document only
        x = self.transformer.wte(idx)  # (B, T, C)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(positions)
        cfg, rope = self.config, None
        if cfg.rotary and counted and start + T <= self.rope_cos.size(0):
            rope = self.rope_cos[start : start + T], self.rope_sin[start : start + T]  # rotary_angles' values
        elif cfg.rotary:
            rope = rotary_angles(positions, cfg.n_embd // cfg.n_head, cfg.rope_base)
        if cfg.rmsnorm:
            x = rms_norm(x)  # nanochat normalises the embedding too
        x = self.transformer.drop(x)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, rope, mask, cache, layer)
        if cache is not None:
            cache.advance(T)
        return self.transformer.ln_f(x)  # (B, T, C)

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context length (e.g. GPT-2's 1024 to a smaller block_size for fine-tuning), or with rotary, which
        learns no position table, set any (the rotary cos / sin computed again for it: longer chat rows)."""
        fits = self.config.rotary or block_size <= self.config.block_size
        assert 0 < block_size and fits, "a learned position table only shrinks"
        self.config = dataclasses.replace(self.config, block_size=block_size)
        if "wpe" in self.transformer:
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].detach().clone())
        else:
            self.reset_rope()

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
