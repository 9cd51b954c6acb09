"""The GPT-2 model: token + position embeddings, pre-LayerNorm blocks, a weight-tied LM head, KV-cache generation.
Parameter names are OpenAI's / Hugging Face's (`transformer.h.0.attn.c_attn`, ...), so nanoGPT checkpoints and HF
weights map onto it one to one. Torch only; nothing else of the package."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptforge.core.shape import ModelShape
from gptforge.model.activations import ReLU2
from gptforge.model.attention import attention, own_attention_pays, split_heads
from gptforge.model.head_loss import compiled_loss, head_loss, head_loss_pays
from gptforge.model.layers import (
    Dropout,
    KVCache,
    LayerNorm,
    RMSNorm,
    add_dropped,
    add_dropped_norm,
    apply_rotary,
    rms_norm,
    rotary_angles,
    rotary_rms_norm,
)
from gptforge.model.linear import Linear


@dataclass(frozen=True)
class GPTConfig(ModelShape):
    """The network's settings: the model's shape, dropout and switches (core/shape.py, written once there) and
    the vocabulary, which comes from the data."""

    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64: faster matmuls, the extra rows go unused


Rope = tuple[torch.Tensor, torch.Tensor]  # rotary cos and sin (T, head_size / 2)


def norm_layer(config: GPTConfig) -> nn.Module:
    return RMSNorm() if config.rmsnorm else LayerNorm(config.n_embd, bias=config.bias)


def heads_second(angles: torch.Tensor) -> torch.Tensor:
    """Rotary cos or sin, (T, hs / 2) or (B, 1, T, hs / 2) as rotary_angles gives them, made to broadcast over
    (B, T, nh, hs / 2). Under torch.compile q and k are rotated and normalised before the heads move to dimension
    1: the gradients of q, k and v then come back in c_attn's own (B, T, 3 C) order, and attention's inputs and
    output are strided views of it (no copy that transposes them, forward or backward)."""
    return angles.unsqueeze(-2) if angles.dim() == 2 else angles.transpose(1, 2)


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
        self.resid_dropout = Dropout(config.dropout)

    def rotate_and_norm(self, q: torch.Tensor, k: torch.Tensor, rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by rope and normalised (qk-norm), as the model's settings say; rope broadcasts over q."""
        if rope is not None and self.qk_norm:  # one step: on a CPU one pass each way (layers.rotary_rms_norm)
            return rotary_rms_norm(q, *rope), rotary_rms_norm(k, *rope)
        if rope is not None:
            return apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.qk_norm:
            return rms_norm(q), rms_norm(k)
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        rope: Rope | None = None,
        mask: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        norm: nn.Module | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rope: the rotary (cos, sin) of these positions, computed once per forward by GPT.hidden_states. mask: a
        bool mask broadcastable to (B, nh, T, keys), True where a query may attend (the caller's whole rule: causal,
        documents, padding); None: causal, after any cached tokens. residual: returns residual + the output, the
        sum taken with the dropout (layers.add_dropped); with `norm` too, that sum and norm(sum)
        (layers.add_dropped_norm)."""
        B, T, C = x.size()
        qkv = self.c_attn(x)  # (B, T, 3 C): q, k, v side by side
        p = self.dropout if self.training else 0.0
        own = cache is None and (self.fast_dropout and 0.0 < p < 1.0 or p == 0.0 and own_attention_pays(qkv))
        compiling = torch.compiler.is_compiling()
        if own and rope is None and not self.qk_norm and not compiling:
            q, k, v = split_heads(qkv, self.n_head)  # (B, nh, T, hs) each, contiguous, as `attention` takes them
        else:
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in qkv.split(self.n_embd, dim=2))
            if compiling:  # rotated and normalised before the heads move: see heads_second
                turned = None if rope is None else (heads_second(rope[0]), heads_second(rope[1]))
                q, k = self.rotate_and_norm(q, k, turned)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
            if not compiling:
                q, k = self.rotate_and_norm(q, k, rope)
        causal = mask is None
        if cache is not None:
            # A prefill (empty cache) is causal over the prompt; one new token attends to every cached one, all in
            # its past; several new tokens after cached ones (a conversation's next turn) see all the cached ones
            # and, among themselves, their past.
            past = cache.length
            assert past == 0 or T == 1 or not cache.ring, "a ring cache takes one token at a time after its prefill"
            causal = causal and past == 0
            if mask is None and past and T > 1:
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)  # (T, past + T)
            k, v = cache.update(layer, k, v)  # (B, nh, past + T, hs)
        if cache is not None and hasattr(cache, "attend"):  # a cache with its own attention (infer/decode.py)
            y = cache.attend(q, k, v, mask)
        elif own:
            y = attention(q, k, v, p, mask)  # gptforge's own: cheap dropout masks; bf16 CPU training
        else:  # SDPA picks a fused (flash / memory-efficient) kernel where one exists; is_causal masks the future
            masked = {"attn_mask": mask} if mask is not None else {}
            # a Python bool, also when the compiler traces T as a symbol (a branch guards on it; SDPA refuses a SymBool)
            is_causal = True if causal and T > 1 else False  # noqa: SIM210
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal, **masked)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        if residual is not None and norm is not None:
            return add_dropped_norm(self.resid_dropout, residual, self.c_proj(y), norm)
        if residual is not None:
            return add_dropped(self.resid_dropout, residual, self.c_proj(y))
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # gelu 'erf': nanoGPT's exact GELU; 'tanh': GPT-2's approximation, which its weights were trained with
        approximate = {"erf": "none", "tanh": "tanh"}[config.gelu]
        self.gelu = ReLU2() if config.relu2 else nn.GELU(approximate=approximate)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: nn.Module | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """residual: returns residual + the output, the sum taken with the dropout (layers.add_dropped); with `norm`
        too, that sum and norm(sum) (layers.add_dropped_norm)."""
        out = self.c_proj(self.gelu(self.c_fc(x)))
        if residual is not None and norm is not None:
            return add_dropped_norm(self.dropout, residual, out, norm)
        return self.dropout(out) if residual is None else add_dropped(self.dropout, residual, out)


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = norm_layer(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm_layer(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        rope: Rope | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.attn(self.ln_1(x), cache, layer, rope, mask, residual=x)  # x + attn(ln_1(x))
        return self.mlp(self.ln_2(x), residual=x)  # x + mlp(ln_2(x))

    def forward_normed(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        layer: int,
        rope: Rope | None,
        mask: torch.Tensor | None,
        norm: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward for GPT.hidden_states' chain of norms: h is ln_1(x), given; returns the block's output and `norm`
        of it (the next block's ln_1, or ln_f), each residual sum taken with the norm after it
        (layers.add_dropped_norm: one pass each way where keep_mask.c has both). The same values as forward."""
        x, h = self.attn(h, None, layer, rope, mask, residual=x, norm=self.ln_2)
        return self.mlp(h, residual=x, norm=norm)


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
        once: buffers that move with the model and stay out of its state_dict. Computed in each forward instead, they
        are fused by torch.compile into every kernel that uses them, pow, cos and sin per element of q and k: 190 of
        1,250 ms of a GPT-2 124M modern-recipe step on an H200 (docs/lab/2026-11-26-h200.md). A model built on the meta
        device calls this again once its weights are in place."""
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
        (model/linear.py): the same sums in another order. Off (a new model's default), torch's arithmetic, rounding
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
        step): the logits may be None, when the loss comes from head_loss (CPU training, large vocabularies).
        """
        x = self.hidden_states(idx, cache, positions, mask)  # (B, T, C)
        if targets is None:
            # Generation needs only the next-token distribution: skip the (B, T, V) projection.
            return self.logits(x[:, [-1], :]), None  # (B, 1, V)
        cap, weight = self.config.logit_softcap, self.lm_head.weight
        if not need_logits and head_loss_pays(x, weight.size(0), cap):
            return None, head_loss(x, weight, targets, cap, reduction)
        if not need_logits and torch.compiler.is_compiling():  # the loss's passes in as few kernels as inductor fuses
            return None, compiled_loss(self.lm_head(x), targets, cap, reduction)
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
        if self.config.rmsnorm:
            x = rms_norm(x)  # nanochat normalises the embedding too
        x = self.transformer.drop(x)
        blocks, ln_f = self.transformer.h, self.transformer.ln_f
        if self._chain_norms(x, cache):
            h = blocks[0].ln_1(x)
            for layer, block in enumerate(blocks):
                x, h = block.forward_normed(
                    x, h, layer, rope, mask, blocks[layer + 1].ln_1 if layer + 1 < len(blocks) else ln_f
                )
            return h  # ln_f of the last block's output
        for layer, block in enumerate(blocks):
            x = block(x, cache, layer, rope, mask)
        if cache is not None:
            cache.advance(T)
        return ln_f(x)  # (B, T, C)

    def _chain_norms(self, x: torch.Tensor, cache: KVCache | None) -> bool:
        """Whether hidden_states takes each residual sum together with the norm after it (Block.forward_normed):
        in CPU training with residual dropout and LayerNorm (nanoGPT's recipes), no cache, outside torch.compile,
        not sharded (FSDP's hooks run on the blocks' own forward). layers.Dropout.add_norm then fuses each pair where
        keep_mask.c has both (bf16 autocast, fast dropout); elsewhere the same operations as the blocks' forward."""
        cfg = self.config
        return (
            cache is None
            and self.training
            and x.device.type == "cpu"
            and not cfg.rmsnorm
            and 0.0 < cfg.dropout < 1.0
            and type(self.transformer.ln_f.weight) is nn.Parameter
            and not torch.compiler.is_compiling()
        )

    def resize_vocab(self, rows: int) -> None:
        """Grow the embedding (and an untied head) to `rows` rows: the existing rows kept, the new ones drawn as a
        new model's are (normal, std 0.02). For tokens the weights never had, e.g. chat tokens on GPT-2's."""
        old = self.config.vocab_size
        assert rows >= old, "resize_vocab only grows the vocabulary"
        weight = self.transformer.wte.weight
        grown = torch.empty(rows, weight.size(1), dtype=weight.dtype, device=weight.device)
        nn.init.normal_(grown, mean=0.0, std=0.02)
        with torch.no_grad():
            grown[:old] = weight
        self.transformer.wte = nn.Embedding.from_pretrained(grown, freeze=False)
        if self.config.untie_head:
            head = torch.empty_like(grown)
            nn.init.normal_(head, mean=0.0, std=0.02)
            with torch.no_grad():
                head[:old] = self.lm_head.weight
            head_weight = nn.Parameter(head)
        else:
            head_weight = self.transformer.wte.weight  # tied again
        onednn = self.lm_head.onednn
        self.lm_head = Linear(weight.size(1), rows, bias=False).to(weight.device, weight.dtype)
        self.lm_head.weight, self.lm_head.onednn = head_weight, onednn
        self.config = dataclasses.replace(self.config, vocab_size=rows)

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


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) attention mask of packed documents whose positions restart at each document start: token i
    sees token j when j <= i and j is in i's document (j >= i - positions[i])."""
    T = positions.size(1)
    i = torch.arange(T, device=positions.device)
    start = (i - positions).unsqueeze(-1)  # (B, T, 1): where each token's document starts
    return ((i[None, :] <= i[:, None]) & (i[None, None, :] >= start)).unsqueeze(1)


def model_vocab_size(meta: dict) -> int:
    """The embedding rows a new model gets for a dataset's vocabulary: a BPE's (GPT-2's 50257, an own one's) padded
    to a multiple of 64 (50304), which matmul kernels prefer (the extra rows never occur in data; the export cuts
    them); a char vocabulary as it is (nanoGPT's shape)."""
    vocab = meta["vocab_size"]
    return -(-vocab // 64) * 64 if meta["tokenizer"] in ("gpt2", "bpe") else vocab
