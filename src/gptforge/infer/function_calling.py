"""OpenAI function calling in `gptforge serve`: a chat request's `tools` and `tool_choice` checked, its messages
(assistant `tool_calls`, `tool` messages) read and rendered by the one renderer with the offered functions in the
system turn (chat/tools.py), and the call the model writes to one of them returned as OpenAI's `tool_calls`
(finish_reason "tool_calls"), streamed as OpenAI streams them. Built-in tools (the calculator) stay server-side:
the engine runs them and the answer goes on (infer/toolcalls.py).

tool_choice: "auto" (the model decides), "none" (the functions are not offered: a call to one is answered with an
error text), "required" (the answer starts with a call), or {"type": "function", "function": {"name": NAME}} (the
answer starts with a call to NAME, its name already written)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from gptforge.chat.conversations import parse_record
from gptforge.chat.render import render_prompt
from gptforge.chat.tools import tool_functions
from gptforge.core.errors import UserError
from gptforge.infer.api_error import ApiError
from gptforge.infer.chat_model import LoadedModel
from gptforge.infer.toolcalls import CallWatcher, ToolCall

CHOICES = ("auto", "none", "required")


@dataclass
class ToolPlan:
    """What a request's tools change: the functions the client runs (a call to one ends the choice), their
    schemas (to check a call's arguments), and the call text the answer starts with (tool_choice)."""

    offered: frozenset[str] = frozenset()
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    inside: list[int] | None = None  # the forced call's text so far: None when the model starts freely

    def watcher(self, lm: LoadedModel, builtins: frozenset[str]) -> CallWatcher:
        watcher = CallWatcher(lm.special_ids, lm.text.text, lm.encode, builtins, self.offered)
        watcher.inside = None if self.inside is None else list(self.inside)
        watcher.new_id = lambda: "call_" + uuid.uuid4().hex[:24]
        return watcher

    def valid(self, call: ToolCall) -> bool:
        """The arguments are a JSON object holding every property the function's schema requires."""
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return False
        required = self.schemas.get(call.name, {}).get("parameters", {}).get("required", [])
        return isinstance(arguments, dict) and all(key in arguments for key in required)


def plain_message(m: Any, i: int) -> dict[str, str]:
    """A message of a chat request without tools: {role, content} with the content's text parts joined."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"{param} must be an object with 'role' and 'content'", param, "invalid_value")
    role = {"developer": "system"}.get(m["role"], m["role"])
    if role not in ("system", "user", "assistant"):
        raise ApiError(400, f"{param}.role '{m['role']}' is not one of system, user, assistant", param, "invalid_value")
    content = m.get("content")
    if isinstance(content, list):  # content parts: the text ones, joined
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{param}.content: only text parts are supported", param, "invalid_value")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param}.content must be a string", param, "invalid_value")
    return {"role": role, "content": content}


def uses_tools(body: dict, messages: list) -> bool:
    """Whether a chat request offers functions, chooses a tool, or holds tool calls or tool messages."""
    return (
        bool(body.get("tools"))
        or body.get("tool_choice") not in (None, "none")
        or any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)
    )


def tools_prompt(body: dict, messages: list, lm: LoadedModel) -> tuple[list[int], ToolPlan]:
    """The prompt of a chat request with tools, and its ToolPlan; every mistake a 400 naming its parameter."""
    try:
        functions = tool_functions(body.get("tools"), "'tools'")
    except UserError as e:
        raise ApiError(400, str(e), "tools", "invalid_value") from None
    choice = _choice(body.get("tool_choice"), functions)
    offered = functions if choice != "none" else []
    try:
        conversation = parse_record({"messages": messages, "tools": body.get("tools")}, "'messages'", training=False)
    except UserError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from None
    prompt = render_prompt(conversation, lm.tokenizer, lm.special_ids, tools=offered)
    plan = ToolPlan(frozenset(f["name"] for f in offered), {f["name"]: f for f in offered})
    if choice in ("auto", "none"):
        return prompt, plan
    # a named function: its call begun, up to the arguments' own first token (' {"' in GPT-2's BPE: no space here)
    plan.inside = [] if choice == "required" else lm.encode(f'{{"name": "{choice}", "arguments":')
    return prompt + [lm.special_ids["<|tool_call_start|>"], *plan.inside], plan


def _choice(value: Any, functions: list[dict[str, Any]]) -> str:
    """'auto', 'none', 'required' or the name of the function the answer must call."""
    names = [f["name"] for f in functions]
    if value is None:
        return "auto" if functions else "none"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        value = value["function"].get("name")
        if value not in names:
            listed = ", ".join(names) or "none"
            raise ApiError(
                400, f"'tool_choice' names the function {value!r}, which is not in 'tools' ({listed})",
                "tool_choice", "invalid_value",
            )  # fmt: skip
        return value
    if value not in CHOICES:
        raise ApiError(
            400, "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": "
            "{\"name\": ...}}", "tool_choice", "invalid_value",
        )  # fmt: skip
    if value == "required" and not functions:
        raise ApiError(400, "'tool_choice' 'required' needs functions in 'tools'", "tool_choice", "invalid_value")
    return value


def call_deltas(call: ToolCall, piece: int = 16) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: its id, type and name with empty arguments, then the arguments in pieces."""
    first = {"index": 0, "id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    rest = [
        {"index": 0, "function": {"arguments": call.arguments[i : i + piece]}}
        for i in range(0, len(call.arguments), piece)
    ]
    return [{"tool_calls": [delta]} for delta in (first, *rest)]
