"""A model loaded to talk to (chat, serve): the network in eval mode, its tokenizer, whether it is a chat model (and
so how a conversation becomes its prompt), the tokens that end an answer, the vocabulary a token is drawn from and
the autocast context its forward passes run in.

A chat model is a run fine-tuned on conversations (its checkpoint's config says task='sft', or its Hugging Face
folder has a chat_template) whose tokenizer has the chat's role tokens; anything else is a base model, which
continues text (completion mode) and cannot answer a conversation."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from gptforge.chat.render import chat_special_ids, render_prompt
from gptforge.core.device import autocast_context, configure_backends, device_type, inference_dtype, resolve_device
from gptforge.core.errors import UserError
from gptforge.infer.textstream import TokenText
from gptforge.model.gpt import GPT
from gptforge.tokenizer.specials import BOS, role_tokens
from gptforge.weights.load import load_model

ANSWER_END = role_tokens("assistant")[1]  # <|assistant_end|>: a chat model's answer is over


@dataclass
class LoadedModel:
    model: GPT
    tokenizer: Any
    device: str
    dtype: str
    name: str  # the model's id in the API (the run folder's or weights' name)
    chat: bool
    special_ids: dict[str, int] = field(default_factory=dict)
    stop_ids: frozenset[int] = frozenset()  # a sampled one ends the answer (and is not part of it)
    vocab: int = 0  # tokens are drawn from ids below this: the tokenizer's (and the chat tokens'), not padding rows
    decode: Any = None  # the compiled one-token step (infer/decode.py), or None: eager

    def __post_init__(self):
        self.text = TokenText(self.tokenizer, {i: name for name, i in self.specials().items()})

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    @property
    def cache_row_bytes(self) -> int:
        """One row's keys and values in the KV cache, the whole context, in this model's dtype."""
        c = self.model.config
        return 2 * c.n_layer * c.block_size * c.n_embd * (4 if self.dtype == "float32" else 2)

    def autocast(self):
        return autocast_context(device_type(self.device), self.dtype)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids a chat model answers: the rendered conversation ending with <|assistant_start|>."""
        assert self.chat, "a base model has no chat format"
        return render_prompt(messages, self.tokenizer, self.special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def specials(self) -> dict[str, int]:
        """Special token text -> id: the end of text and, for a chat model, the role tokens."""
        return special_tokens(self.tokenizer, self.special_ids)

    def describe(self) -> str:
        kind = "chat model" if self.chat else "base model (not chat-tuned): completion mode, your text is continued"
        n = sum(p.numel() for p in self.model.parameters())
        where = f"{self.device} {self.dtype}"
        return f"{self.name}: {kind}; {n / 1e6:.1f}M parameters, context {self.block_size} tokens, {where}"


def special_tokens(tokenizer: Any, special_ids: dict[str, int] | None = None) -> dict[str, int]:
    """Special token text -> id on `tokenizer`: its own (an own BPE's reserved ones, GPT-2's <|endoftext|>) and the
    chat tokens of `special_ids`."""
    out = dict(getattr(tokenizer, "specials", None) or {})
    if getattr(tokenizer, "kind", None) == "gpt2":
        out["<|endoftext|>"] = tokenizer.eot_token
    out.update({name: i for name, i in (special_ids or {}).items() if name != BOS or tokenizer.kind != "gpt2"})
    return out


def encode_with_specials(tokenizer: Any, text: str, specials: dict[str, int]) -> list[int]:
    """Text in which the special tokens' strings are the special tokens (what a rendered chat template holds, and
    how Hugging Face tokenizers read added tokens); the rest is ordinary text."""
    if not specials:
        return list(tokenizer.encode(text))
    pattern = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
    ids: list[int] = []
    for i, piece in enumerate(pattern.split(text)):
        if i % 2:
            ids.append(specials[piece])
        elif piece:
            ids += tokenizer.encode(piece)
    return ids


def decode_with_specials(tokenizer: Any, ids: list[int], specials: dict[str, int]) -> str:
    """The reverse of encode_with_specials: special ids as their strings."""
    names = {i: name for name, i in specials.items()}
    out, run = [], []
    for i in ids:
        if i in names:
            out += [tokenizer.decode(run), names[i]]
            run = []
        else:
            run.append(i)
    return "".join(out) + tokenizer.decode(run)


def is_chat_model(tokenizer: Any, checkpoint: dict[str, Any] | None, init_from: str) -> bool:
    """Fine-tuned on conversations (task='sft' in the checkpoint's config, or a Hugging Face folder with a
    chat_template) and a tokenizer with the chat's role tokens."""
    try:
        chat_special_ids(tokenizer)
    except UserError:
        return False
    if checkpoint is not None:
        return (checkpoint.get("config") or {}).get("task") == "sft"
    path = os.path.join(init_from, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            return bool(json.load(fh).get("chat_template"))
    except (OSError, ValueError):
        return False


def model_name(out_dir: str, ckpt: str | None, init_from: str) -> str:
    if init_from != "resume":
        return os.path.basename(os.path.normpath(init_from)) or init_from
    return os.path.basename(os.path.normpath(ckpt or out_dir)) or "model"


def load_for_inference(
    out_dir: str, ckpt: str | None, init_from: str, device: str, dtype: str, name: str | None = None
) -> LoadedModel:
    """The model chat and serve talk to: loaded as sample loads it, on `device` (auto: the best there is)."""
    device = resolve_device(device)
    configure_backends(device_type(device))
    model, tokenizer, checkpoint = load_model(out_dir, ckpt, init_from, device)
    dtype = inference_dtype(dtype, device_type(device), model.config.n_embd)
    chat = is_chat_model(tokenizer, checkpoint, init_from)
    return in_memory(model, tokenizer, device, dtype, name or model_name(out_dir, ckpt, init_from), chat)


def in_memory(model: GPT, tokenizer: Any, device: str, dtype: str, name: str, chat: bool) -> LoadedModel:
    """A model already loaded (or being trained) as chat, serve and eval chat talk to it: its chat tokens, the
    tokens that end an answer, the ids it may draw."""
    special_ids = chat_special_ids(tokenizer) if chat else {}
    vocab = max([tokenizer.vocab_size, *(i + 1 for i in special_ids.values())])
    if chat:
        stop = {special_ids[ANSWER_END], special_ids[BOS], special_ids[role_tokens("user")[0]]}
    else:
        stop = {tokenizer.eot_token} if tokenizer.eot_token is not None else set()
    vocab = min(vocab, model.config.vocab_size)
    return LoadedModel(model, tokenizer, device, dtype, name, chat, special_ids, frozenset(stop), vocab)
