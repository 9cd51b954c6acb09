"""The chat format for Hugging Face tools: a Jinja `chat_template` that renders exactly what chat/render.py does, and
`add_chat_tokens_to_hf_folder`, which makes a GPT-2 tokenizer folder (`GPT2Tokenizer.save`)
chat-ready. Then `tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)` gives our ids and our loss mask, and `add_generation_prompt=True` gives
`render_prompt`'s ids.

The template wraps each trained assistant message's content and end token in {% generation %} ... {% endgeneration
%}, which is how transformers finds the assistant's tokens; that needs a fast tokenizer (token offsets), so the
folder gets a tokenizer.json. One difference remains by design: Hugging Face tokenizers split added tokens out of
any text, so a message that contains "<|user_end|>" as text gets the special id there, where our renderer keeps
the characters (transformers' `sanitize_control_tokens` would keep them, but not with the assistant mask).
No import of transformers: the files are written as plain JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

from gptforge.chat.tools import TOOLS_HEADER
from gptforge.core.errors import UserError
from gptforge.tokenizer.specials import BOS, CHAT_SPECIALS, GPT2_BOUNDARY, gpt2_special_ids, role_tokens

_CALL = (  # one call as chat/tools.call_text writes it
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{- '<|tool_call_start|>{\"name\": \"' ~ f['name'] ~ '\", \"arguments\": ' -}}"
    "{{- (f['arguments'] if f['arguments'] is string else f['arguments'] | tojson) ~ '}<|tool_call_end|>' -}}"
)
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(turn=false, listed='') -%}"
    "{%- if tools -%}{%- set ns.listed = '" + TOOLS_HEADER + "' -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.listed = ns.listed ~ '\n' ~ ((tool['function'] if tool['function'] is defined else tool) | tojson) -%}"
    "{%- endfor -%}"
    "{%- if not messages or messages[0]['role'] not in ['system', 'developer'] -%}"
    "{{- '<|system_start|>' ~ ns.listed ~ '<|system_end|>' -}}"
    "{%- endif -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = {'developer': 'system', 'tool': 'tool_output'}.get(message['role'], message['role']) -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- set trained = not (message['train'] is defined and not message['train']) -%}"
    "{%- if role in ['system', 'user'] -%}"
    "{%- if role == 'system' and loop.first and ns.listed -%}{%- set content = content ~ '\n\n' ~ ns.listed -%}"
    "{%- endif -%}"
    "{{- '<|' ~ role ~ '_start|>' ~ content ~ '<|' ~ role ~ '_end|>' -}}"
    "{%- elif role == 'tool_output' -%}"
    "{{- '<|tool_output_start|>' ~ content ~ '<|tool_output_end|>' -}}"
    "{%- elif role == 'assistant' -%}"
    "{%- if not ns.turn -%}{{- '<|assistant_start|>' -}}{%- set ns.turn = true -%}{%- endif -%}"
    "{%- set calls = message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else [] -%}"
    "{%- if trained -%}{%- generation -%}{{- content -}}"
    "{%- for call in calls -%}" + _CALL + "{%- endfor -%}"
    "{%- if not calls -%}{{- '<|assistant_end|>' -}}{%- endif -%}{%- endgeneration -%}"
    "{%- else -%}{{- content -}}"
    "{%- for call in calls -%}" + _CALL + "{%- endfor -%}"
    "{%- if not calls -%}{{- '<|assistant_end|>' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- if not calls -%}{%- set ns.turn = false -%}{%- endif -%}"
    "{%- else -%}"
    "{{- raise_exception('unknown chat role ' ~ message['role'] ~ '; the roles are system, user, assistant, tool') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not (messages and messages[-1]['role'] == 'tool') -%}"
    "{{- '<|assistant_start|>' -}}{%- endif -%}"
)


def _token_flags(content: str) -> dict[str, Any]:
    """An added special token that is never stripped, normalised or merged: it matches only its exact text."""
    return {
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def chat_added_tokens(special_ids: dict[str, int] | None = None) -> dict[int, str]:
    """id -> text of every special token a GPT-2 chat tokenizer has: <|endoftext|> (our <|bos|>) and the chat
    tokens on the spare rows."""
    ids = special_ids or gpt2_special_ids()
    return {ids[BOS]: GPT2_BOUNDARY, **{ids[name]: name for name in CHAT_SPECIALS}}


def add_chat_tokens_to_hf_folder(folder: str, special_ids: dict[str, int] | None = None) -> None:
    """Make a Hugging Face GPT-2 tokenizer folder (vocab.json, merges.txt, tokenizer_config.json, as
    `GPT2Tokenizer.save` writes them) chat-ready: the chat tokens as added special tokens at their ids
    (50257-50266), <|endoftext|> as bos, the chat template, and a fast tokenizer (tokenizer.json)."""
    added = chat_added_tokens(special_ids)
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = _read_json(config_path)
    vocab = _read_json(os.path.join(folder, "vocab.json"))
    merges = _read_merges(os.path.join(folder, "merges.txt"))
    if vocab.get(GPT2_BOUNDARY) != min(added):
        raise UserError(f"{folder}: not a GPT-2 tokenizer folder ({GPT2_BOUNDARY} is not id {min(added)})")
    chat = [added[i] for i in sorted(added) if added[i] != GPT2_BOUNDARY]
    config.update(
        bos_token=GPT2_BOUNDARY,
        added_tokens_decoder={str(i): _token_flags(text) for i, text in sorted(added.items())},
        additional_special_tokens=chat,
        chat_template=CHAT_TEMPLATE,
    )
    _write_json(config_path, config)
    special_map_path = os.path.join(folder, "special_tokens_map.json")
    special_map = _read_json(special_map_path) if os.path.isfile(special_map_path) else {}
    _write_json(special_map_path, {**special_map, "bos_token": GPT2_BOUNDARY, "additional_special_tokens": chat})
    _write_json(os.path.join(folder, "tokenizer.json"), _tokenizer_json(vocab, merges, added))


def chat_generation_config(special_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """generation_config.json for a chat model: generation stops at the assistant's end token."""
    ids = special_ids or gpt2_special_ids()
    return {"bos_token_id": ids[BOS], "eos_token_id": ids[role_tokens("assistant")[1]], "pad_token_id": ids[BOS]}


def _tokenizer_json(vocab: dict[str, int], merges: list[str], added: dict[int, str]) -> dict[str, Any]:
    """A `tokenizers` byte-level BPE equal to GPT-2's (no prefix space, offsets untrimmed), with the added tokens."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, **_token_flags(text)} for i, text in sorted(added.items())],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: missing or not JSON ({e}); write the GPT-2 tokenizer files first") from None


def _read_merges(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror}); write the GPT-2 tokenizer files first") from None
    return (
        [line for line in lines[1:] if line] if lines and lines[0].startswith("#version") else [x for x in lines if x]
    )


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
