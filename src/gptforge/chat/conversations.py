"""Conversations in: JSONL (or a JSON array) in OpenAI's messages format, ShareGPT or Alpaca, detected per record
or fixed by `fmt`, checked (roles, alternation, an assistant answer last) with errors naming FILE:LINE and what to
fix; and the human chit-chat conversations of the `chitchat-dataset` package (`read_chitchat`).

Every reader returns `Conversation`s: an optional system message, then user and assistant messages alternating,
starting with the user. A message marked `"train": false` (or OpenAI's `"weight": 0`) stays in the context but
is not trained on.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gptforge.chat.tools import call_text, check_callable, parse_tool_calls, tool_functions
from gptforge.core.errors import UserError

FORMATS = ("openai", "sharegpt", "alpaca")
ROLES = ("system", "user", "assistant")
OPENAI_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool_output",
}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
EXAMPLE = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}'
FORMATS_HELP = (
    'chat data is JSONL with one conversation per line: OpenAI\'s {"messages": [{"role", "content"}, ...]}, '
    'ShareGPT\'s {"conversations": [{"from", "value"}, ...]} or Alpaca\'s {"instruction", "input", "output"}'
)


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user", "assistant", "tool_call" (content: call_text) or "tool_output" (a tool's answer)
    content: str
    train: bool = True  # False: kept as context, never trained on (only matters for what the assistant writes)
    call_id: str = ""  # a tool call's id, or the id of the call a tool output answers


@dataclass
class Conversation:
    messages: list[Message]
    where: str = ""  # FILE:LINE (or the dataset's key) it was read from, for messages about it
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. a synthetic task's kind and answer
    tools: list[dict[str, Any]] = field(default_factory=list)  # the functions offered (chat/tools.py)

    def to_openai(self) -> dict[str, Any]:
        """As a line of OpenAI-format JSONL (what `read_file` reads back to the same conversation)."""
        messages: list[dict[str, Any]] = []
        for m in self.messages:
            if m.role == "tool_call":
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(openai_call(m))
            else:
                messages.append(as_dict(m))
        tools = [{"type": "function", "function": f} for f in self.tools]
        return {"messages": messages, **({"tools": tools} if tools else {})}


def as_dict(message: Message) -> dict[str, Any]:
    if message.role == "tool_output":
        return {"role": "tool", "tool_call_id": message.call_id, "content": message.content}
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    return out if message.train else {**out, "train": False}


def openai_call(message: Message) -> dict[str, Any]:
    """A tool_call message as an entry of OpenAI's "tool_calls"."""
    call = json.loads(message.content)
    arguments = call["arguments"]
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": message.call_id, "type": "function", "function": {"name": call["name"], "arguments": arguments}}


def read_conversations(paths: Iterable[str], fmt: str | None = None, training: bool = True) -> list[Conversation]:
    """Every conversation of every file, all checked before any is returned (so nothing is written on a bad
    line). training=True: each must end with an assistant message, the answer that is learned."""
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"unknown chat format {fmt!r}; choose one of {', '.join(FORMATS)} (or leave it out to detect)")
    return [conv for path in paths for conv in read_file(path, fmt, training)]


def read_file(path: str, fmt: str | None = None, training: bool = True) -> list[Conversation]:
    """One file: JSONL (one record a line; blank lines skipped), or a JSON array of records. `.gz` is read as gzip."""
    text = _read_text(path)
    if not text.strip():
        raise UserError(f"{path}:1: the file is empty; {FORMATS_HELP}")
    records = _json_array(path, text) if text.lstrip().startswith("[") else _jsonl_records(path, text)
    return [parse_record(obj, where, fmt, training) for where, obj in records]


def _read_text(path: str) -> str:
    if not os.path.isfile(path):
        raise UserError(f"chat file {path!r} not found")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                return fh.read()
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); {FORMATS_HELP}") from None
    except (OSError, EOFError) as e:
        raise UserError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None


def _jsonl_records(path: str, text: str) -> Iterator[tuple[str, Any]]:
    first = True
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            if first and not line.lstrip().startswith("{"):
                raise UserError(
                    f"{path}:{number}: this looks like plain text (pretraining data), not conversations; "
                    f"{FORMATS_HELP}. To pretrain on text, use `gptforge prepare text` or `gptforge prepare files`"
                ) from None
            raise UserError(
                f"{path}:{number}: not valid JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')}); "
                f"each line must hold one whole JSON object, e.g. {EXAMPLE}"
            ) from None
        first = False
        yield f"{path}:{number}", obj


def _json_array(path: str, text: str) -> Iterator[tuple[str, Any]]:
    try:
        items = json.loads(text)
    except ValueError as e:
        where = f"{path}:{getattr(e, 'lineno', 1)}"
        raise UserError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}); a .json file must be one array") from None
    if not items:
        raise UserError(f"{path}:1: the JSON array is empty: no conversations")
    for i, obj in enumerate(items):
        yield f"{path}:item {i + 1}", obj


def detect_format(obj: Any) -> str | None:
    """The format a record is in, from its keys; None when it holds no conversation."""
    if not isinstance(obj, dict):
        return None
    if "messages" in obj:
        return "openai"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    return None


def parse_record(obj: Any, where: str, fmt: str | None = None, training: bool = True) -> Conversation:
    """One JSON record as a checked Conversation; `where` (FILE:LINE) starts every error message."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}; {FORMATS_HELP}")
    kind = fmt or detect_format(obj)
    if kind is None:
        if "text" in obj:
            raise UserError(
                f'{where}: a pretraining document ({{"text": ...}}), not a conversation; {FORMATS_HELP}. To '
                "pretrain on it, use `gptforge prepare files`"
            )
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise UserError(f"{where}: no conversation in this record (keys: {keys}); {FORMATS_HELP}")
    conversation = Conversation(PARSERS[kind](obj, where), where)
    if kind == "openai" and obj.get("tools") is not None:
        conversation.tools = tool_functions(obj["tools"], where)
    check_conversation(conversation, training)
    return conversation


def _openai(obj: dict[str, Any], where: str) -> list[Message]:
    items = obj.get("messages")
    if not isinstance(items, list) or not items:
        raise UserError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    messages = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict) or "role" not in item or ("content" not in item and "tool_calls" not in item):
            raise UserError(f'{where}: message {i} needs "role" and "content", e.g. {{"role": "user", "content": ...}}')
        role = OPENAI_ROLES.get(item["role"]) if isinstance(item["role"], str) else None
        if role is None:
            raise UserError(
                f"{where}: message {i} has role {item['role']!r}; chat knows 'system', 'user', 'assistant' and "
                "'tool': rename or remove it"
            )
        messages += openai_message(item, role, where, i)
    return messages


def openai_message(item: dict[str, Any], role: str, where: str, i: int) -> list[Message]:
    """One OpenAI message as Messages: an assistant message with tool_calls is its text (if any), then a
    tool_call message for each call; a tool message is a tool_output that names the call it answers."""
    train = _train_flag(item, where, i)
    if role == "tool_output":
        call_id = item.get("tool_call_id", "")
        if not isinstance(call_id, str):
            raise UserError(f'{where}: message {i} (tool): "tool_call_id" must be the id of the call it answers')
        return [Message(role, _content(item.get("content"), where, i), False, call_id)]
    calls = parse_tool_calls(item, where, i) if role == "assistant" else []
    text = _content(item.get("content"), where, i) if item.get("content") is not None or not calls else ""
    head = [Message(role, text, train)] if text or not calls else []
    return head + [Message("tool_call", call_text(name, arguments), train, cid) for cid, name, arguments in calls]


def _sharegpt(obj: dict[str, Any], where: str) -> list[Message]:
    items = obj.get("conversations")
    if not isinstance(items, list) or not items:
        raise UserError(f'{where}: "conversations" must be a non-empty list of {{"from", "value"}} objects')
    messages = [Message("system", _content(obj["system"], where, 0))] if obj.get("system") else []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict) or "from" not in item or "value" not in item:
            raise UserError(f'{where}: turn {i} needs "from" and "value", e.g. {{"from": "human", "value": ...}}')
        role = SHAREGPT_ROLES.get(item["from"]) if isinstance(item["from"], str) else None
        if role is None:
            raise UserError(
                f"{where}: turn {i} is from {item['from']!r}; ShareGPT turns are from 'system', 'human' (or 'user') "
                "and 'gpt' (or 'assistant'): rename or remove it"
            )
        messages.append(Message(role, _content(item["value"], where, i), _train_flag(item, where, i)))
    return messages


def _alpaca(obj: dict[str, Any], where: str) -> list[Message]:
    for key in ("instruction", "output"):
        if not isinstance(obj.get(key), str):
            raise UserError(f'{where}: an Alpaca record needs "instruction" and "output" strings ("input" optional)')
    extra = obj.get("input") or ""
    if not isinstance(extra, str):
        raise UserError(f'{where}: "input" must be a string')
    system = [Message("system", _content(obj["system"], where, 0))] if obj.get("system") else []
    prompt = obj["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
    return [*system, Message("user", prompt), Message("assistant", obj["output"])]


PARSERS: dict[str, Callable[[dict[str, Any], str], list[Message]]] = {
    "openai": _openai,
    "sharegpt": _sharegpt,
    "alpaca": _alpaca,
}


def _content(value: Any, where: str, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)  # OpenAI's content parts, text only
    raise UserError(f"{where}: message {i}'s content must be a string, got {type(value).__name__}")


def _train_flag(item: dict[str, Any], where: str, i: int) -> bool:
    train, weight = item.get("train", True), item.get("weight", 1)
    if not isinstance(train, bool) or weight not in (0, 1):
        raise UserError(f'{where}: message {i}: "train" must be true or false ("weight", OpenAI\'s, 0 or 1)')
    return train and weight == 1


# what may follow each role after the system message (None: the start); an assistant turn is a run of
# assistant text, tool calls and tool outputs
FOLLOWS = {
    None: ("user",),
    "user": ("assistant", "tool_call"),
    "assistant": ("user", "tool_call"),
    "tool_call": ("tool_call", "tool_output"),
    "tool_output": ("tool_output", "tool_call", "assistant"),
}


def check_conversation(conversation: Conversation, training: bool = True) -> None:
    """An optional system message first, then user messages and assistant turns alternating from the user (an
    assistant turn may call tools: its calls, each answered by a tool output, then more text); training: an
    assistant message last. Contents may be empty only in assistant messages that are not trained."""
    where, messages = conversation.where or "conversation", conversation.messages
    offset = 1 if messages and messages[0].role == "system" else 0
    body = messages[offset:]
    if not body:
        raise UserError(f"{where}: only a system message; add the user's message and the assistant's answer")
    previous = None
    for i, message in enumerate(body, offset + 1):
        if message.role == "system":
            raise UserError(f"{where}: message {i} is a second system message; only the first may be one")
        if message.role not in FOLLOWS[previous]:
            raise UserError(f"{where}: message {i} is {_named(message.role)} after {_named(previous)}: " + _ORDER)
        previous = message.role
    _check_calls(conversation, where)
    if training and body[-1].role != "assistant":
        if len(body) < 2:
            raise UserError(f"{where}: no assistant message; a training conversation needs an answer to learn from")
        raise UserError(
            f"{where}: the last message is {_named(body[-1].role)}, with no answer; end with an assistant message"
        )
    for i, message in enumerate(messages, 1):
        if not message.content.strip() and (message.role != "assistant" or message.train):
            raise UserError(
                f"{where}: message {i} ({message.role}) is empty; give it text"
                + (' (or mark it "train": false to keep it as context)' if message.role == "assistant" else "")
            )


_ORDER = (
    "after an optional system message, user messages and assistant answers alternate, starting with the user's; "
    "an answer's tool calls are each answered by a tool message before it goes on"
)


def _named(role: str | None) -> str:
    return {None: "the start", "tool_call": "a tool call", "tool_output": "a tool message"}.get(role, f"{role!r}")


def _check_calls(conversation: Conversation, where: str) -> None:
    """Each round of tool calls is answered by as many tool messages, each naming one of those calls (when the
    calls have ids), before anything else; every call is to a function the conversation offers or a built-in one."""
    group, answered = [], 0  # the ids of the round of calls under way, and how many are answered
    for i, message in enumerate(conversation.messages, 1):
        if message.role != "tool_output" and answered < len(group) and (answered or message.role != "tool_call"):
            raise UserError(
                f"{where}: message {i}: {len(group) - answered} tool call(s) before it have no tool message"
            )
        if message.role == "tool_call":
            group, answered = (group, answered) if not answered else ([], 0)
            group.append(message.call_id)
            check_callable(json.loads(message.content)["name"], conversation.tools, f"{where}: message {i}")
        elif message.role == "tool_output":
            answered += 1
            if answered > len(group):
                raise UserError(f"{where}: message {i} (tool) answers no call: more tool messages than calls")
            if any(group) and message.call_id not in group:
                raise UserError(
                    f"{where}: message {i} (tool) answers call id {message.call_id!r}, which none of the calls before "
                    f"it has ({', '.join(map(repr, group))})"
                )
        else:
            group, answered = [], 0
    if answered < len(group):
        raise UserError(f"{where}: {len(group) - answered} tool call(s) at the end have no tool message")


# The Chit-Chat Challenge conversations of BYU's Perception, Control and Cognition lab: the `chitchat-dataset`
# package on PyPI (MIT licence, (c) 2019 the PCC lab; https://github.com/BYU-PCCL/chitchat-dataset) ships them as
# chitchat_dataset/dataset.json: {conversation UUID: {"prompt", "ratings", "start", "messages"}}, where "messages"
# is a list of turns, each a list of utterances {"text", "timestamp", "sender"} from one sender, the two senders
# alternating. 7,168 conversations, 138,737 turns, 258,145 utterances; 3,150 conversations have one speaker only.
CHITCHAT_URL = "https://raw.githubusercontent.com/BYU-PCCL/chitchat-dataset/master/chitchat_dataset/dataset.json"


def chitchat_path(path: str | None = None) -> str:
    """dataset.json of the installed chitchat-dataset package, or `path` (a downloaded copy)."""
    if path:
        if not os.path.isfile(path):
            raise UserError(f"chit-chat file {path!r} not found")
        return path
    spec = importlib.util.find_spec("chitchat_dataset")
    found = os.path.join(os.path.dirname(spec.origin), "dataset.json") if spec and spec.origin else None
    if not found or not os.path.isfile(found):
        raise UserError(
            "the chit-chat conversations come from the chitchat-dataset package: `pip install chitchat-dataset` "
            f"(MIT), or download {CHITCHAT_URL} and pass its path"
        )
    return found


def read_chitchat(path: str | None = None) -> list[Conversation]:
    """The chit-chat conversations as user / assistant turns: the first speaker is the user, the other the
    assistant; a turn's utterances joined by newlines. A conversation ends at its first empty turn and at its
    last assistant turn; those left with no exchange (one speaker only) are skipped: 4,017 remain."""
    path = chitchat_path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not the chit-chat dataset's JSON ({e}); reinstall chitchat-dataset") from None
    conversations = []
    for key, record in data.items():
        turns = []
        for turn in record.get("messages", []):
            text = "\n".join(u["text"].strip() for u in turn if isinstance(u.get("text"), str) and u["text"].strip())
            if not text:
                break
            turns.append(text)
        turns = turns[: len(turns) // 2 * 2]
        if turns:
            messages = [Message(("user", "assistant")[i % 2], text) for i, text in enumerate(turns)]
            conversations.append(Conversation(messages, f"{path}:{key}"))
    return conversations
