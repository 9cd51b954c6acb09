"""A tokenizer as GGUF's vocabulary (llama.cpp's byte-level BPE: `tokenizer.ggml.*`), and the chat template and
Ollama Modelfile that go with a chat model. llama.cpp splits text with one of a fixed set of named patterns
(`tokenizer.ggml.pre`), so only tokenizers whose split pattern is one of those can be written: GPT-2 BPE ('gpt-2')
and an own BPE with digits one per token ('qwen2') or up to three ('llama-bpe'). No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptforge.chat.template import CHAT_TEMPLATE
from gptforge.core.errors import UserError
from gptforge.tokenizer.bpe import split_pattern
from gptforge.tokenizer.gpt2 import gpt2_vocab_and_merges
from gptforge.tokenizer.hf_format import byte_to_char, merges_from_ranks
from gptforge.tokenizer.specials import BOS, GPT2_BOUNDARY, role_tokens

NORMAL, CONTROL = 1, 3  # llama.cpp's token types
PRE_BY_DIGITS = {1: "qwen2", 3: "llama-bpe"}  # an own BPE's split pattern -> llama.cpp's pre-tokenizer with it


@dataclass
class GGUFVocab:
    """What `tokenizer.ggml.*` holds: each id's text (bytes as GPT-2's printable characters), its type, the merges
    in priority order, the pre-tokenizer's name, and the ids of the boundary and end tokens."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos: int
    eos: int


def gguf_vocab(tok: Any, special_ids: dict[str, int], rows: int) -> GGUFVocab:
    """The vocabulary of `tok` for a model with `rows` token rows; `special_ids` (a chat model's role tokens) are
    control tokens, and the assistant's end token ends generation. Refuses (UserError) a tokenizer llama.cpp
    cannot split the same way."""
    if tok.kind == "char":
        raise UserError(
            "a character vocabulary cannot go into a GGUF file: llama.cpp reads byte-level BPE vocabularies only. "
            "Train on GPT-2 BPE (--tokenizer gpt2) or an own BPE (gptforge tokenizer train --max_digits 1), or "
            "export a Hugging Face folder instead (--to=FOLDER)"
        )
    if tok.kind == "gpt2":
        vocab, pairs = gpt2_vocab_and_merges(tok.enc)
        tokens = [""] * len(vocab)
        for text, i in vocab.items():
            tokens[i] = text
        merges, pre, boundary = [f"{a} {b}" for a, b in pairs], "gpt-2", tok.eot_token
        specials = {GPT2_BOUNDARY: boundary, **{k: v for k, v in special_ids.items() if k != BOS}}
    else:
        pre = _own_pre(tok)
        to_char = byte_to_char()
        tokens = ["".join(to_char[b] for b in t) for t in tok.ranks]
        text = dict(zip(tok.ranks, tokens, strict=True))
        merges = [f"{text[a]} {text[b]}" for a, b in merges_from_ranks(tok.ranks)]  # both halves are tokens
        specials, boundary = dict(tok.specials), tok.specials[BOS]
    tokens += [""] * (max(specials.values()) + 1 - len(tokens))
    types = [NORMAL] * len(tokens)
    for name, i in specials.items():
        tokens[i], types[i] = name, CONTROL
    if rows > len(tokens) or not all(tokens[:rows]):
        raise UserError(
            f"the model has {rows} token rows and its tokenizer {len(tokens)}: the checkpoint's "
            "tokenizer record is wrong"
        )
    tokens, types = tokens[:rows], types[:rows]
    end = special_ids.get(role_tokens("assistant")[1], boundary)
    return GGUFVocab(tokens, types, merges, pre, bos=boundary, eos=end)


def _own_pre(tok: Any) -> str:
    for digits, pre in PRE_BY_DIGITS.items():
        if tok.pattern == split_pattern(digits):
            return pre
    raise UserError(
        f"tokenizer {tok.name!r} splits text with a pattern llama.cpp has no pre-tokenizer for (gptforge's default "
        "cuts numbers into runs of two digits): train the tokenizer with --max_digits 1 (llama.cpp's 'qwen2') or "
        "--max_digits 3 ('llama-bpe'), or export a Hugging Face folder instead (--to=FOLDER)"
    )


def gguf_chat_template() -> str:
    """The Hugging Face chat template without transformers' {% generation %} markers, which plain Jinja (llama.cpp,
    llama-cpp-python) does not know; the text it renders is the same."""
    return CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


def modelfile(gguf_name: str, vocab: GGUFVocab, chat: bool, context: int) -> str:
    """An Ollama Modelfile for the GGUF file beside it: Ollama templates are Go templates, so the chat format is
    written again in Go's syntax (system, user and assistant turns; tool calls are not)."""
    lines = [
        '# Ollama: ollama create NAME -f THIS_FILE, then ollama run NAME (docs/USAGE.md "GGUF")',
        f"FROM ./{gguf_name}",
    ]
    if chat:
        turn = "<|{0}_start|>{{{{ .Content }}}}<|{0}_end|>"
        roles = "".join(
            f'{{{{- {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{turn.format(role)}'
            for i, role in enumerate(("system", "user", "assistant"))
        )
        bos = vocab.tokens[vocab.bos]
        lines.append(
            f'TEMPLATE """{bos}{{{{- range .Messages }}}}{roles}{{{{- end }}}}{{{{- end }}}}<|assistant_start|>"""'
        )
    else:
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    lines += [f'PARAMETER stop "{vocab.tokens[vocab.eos]}"', f"PARAMETER num_ctx {context}", ""]
    return "\n".join(lines)
