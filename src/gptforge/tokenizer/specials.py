"""The reserved special tokens: a document boundary and the chat roles' start and end markers. Ordinary text never
encodes to them (a user who types "<|user_end|>" gets the characters, not the token); only the chat renderer and
the document packer place them. Every tokenizer that chat can use gives each name an id: an own BPE tokenizer
reserves them at its top, GPT-2 BPE keeps <|endoftext|> as the boundary and puts the others on spare rows of the
padded vocabulary (50257 on), so GPT-2 weights need no resize."""

from __future__ import annotations

BOS = "<|bos|>"  # document boundary: every document (and conversation) starts with it
ROLES = ("system", "user", "assistant", "tool_call", "tool_output")
CHAT_SPECIALS = tuple(f"<|{role}_{edge}|>" for role in ROLES for edge in ("start", "end"))
SPECIALS = (BOS, *CHAT_SPECIALS)  # in id order after the ordinary tokens of an own tokenizer

GPT2_BOUNDARY = "<|endoftext|>"  # GPT-2 BPE's document boundary, id 50256
GPT2_FIRST_SPARE = 50257  # the first row of a GPT-2 model's padded vocabulary no text token uses


def role_tokens(role: str) -> tuple[str, str]:
    """The (start, end) special-token strings of a chat role."""
    assert role in ROLES, f"unknown role {role!r}; roles are {ROLES}"
    return f"<|{role}_start|>", f"<|{role}_end|>"


def gpt2_special_ids() -> dict[str, int]:
    """Each special token's id on GPT-2 BPE: the boundary is <|endoftext|> (50256), the chat tokens 50257-50266."""
    return {BOS: 50256, **{name: GPT2_FIRST_SPARE + i for i, name in enumerate(CHAT_SPECIALS)}}
