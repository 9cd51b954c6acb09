"""Tools in conversations: OpenAI's function-calling messages read and checked, each call written as the text the
model learns to write, the functions a conversation offers written into its system turn, and the built-in tools
the engine runs itself (the calculator, chat/calculator.py).

In OpenAI's format an assistant message may carry `tool_calls` ([{"id", "type": "function", "function": {"name",
"arguments": a JSON object as text}}]); each call is answered by a `{"role": "tool", "tool_call_id", "content"}`
message; the assistant then goes on. A conversation (or a request) may list the functions it offers in `tools`
([{"type": "function", "function": {"name", "description", "parameters"}}]). The renderer (chat/render.py) keeps
the whole exchange in one assistant turn: the calls are the model's to write (trained), the outputs are not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from gptforge.chat.calculator import calculate
from gptforge.core.errors import UserError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOLS_HEADER = "Tools:"
BUILTIN = {  # name -> (schema, run): functions the engine runs itself, whether a request lists them or not
    "calculator": (
        {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
        lambda arguments: calculate(arguments.get("expression", "")),
    )
}


LENGTH_UNITS = {"mm": 1, "cm": 10, "m": 1000, "km": 1_000_000}  # in millimetres
# name -> (schema, run): made-up functions with checkable results, for synthetic tasks. The schema is kept short
# (no enum, no required list): listed in the system turn it costs ~100 tokens of a 4k-vocabulary tokenizer, and the
# chat recipe's whole conversation must fit a 257-token row (with the enums it did not, and prepare left it out).
EXAMPLE_FUNCTIONS = {
    "convert_length": (
        {
            "name": "convert_length",
            "description": "Convert a length between mm, cm, m and km.",
            "parameters": {
                "type": "object",
                "properties": {"value": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
            },
        },
        lambda arguments: convert_length(arguments.get("value"), arguments.get("from"), arguments.get("to")),
    )
}


def convert_length(value: Any, unit: Any, to: Any) -> str:
    """`value` `unit` in `to`, exactly (the calculator's way of writing numbers), or an error text."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or unit not in LENGTH_UNITS
        or to not in LENGTH_UNITS
    ):
        return f"error: give a number value and units from {', '.join(LENGTH_UNITS)}"
    return calculate(f"{value!r}*{LENGTH_UNITS[unit]}/{LENGTH_UNITS[to]}")


def call_text(name: str, arguments: str | dict[str, Any]) -> str:
    """What the model writes for a call: {"name": NAME, "arguments": ARGUMENTS}, the arguments as they were given
    (OpenAI's JSON text), or as JSON when given as an object; the Hugging Face template writes the same."""
    written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{{"name": "{name}", "arguments": {written}}}'


def parse_call_text(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call the model wrote, or None when it is not one."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    arguments = call["arguments"]
    return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def run_tool(run: Callable[[dict[str, Any]], str], arguments: str) -> str:
    """The output of a tool's `run` on `arguments` (JSON text); bad arguments come back as an error text."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    if not isinstance(parsed, dict):
        return "error: the arguments must be a JSON object"
    return run(parsed)


def tool_functions(tools: Any, where: str) -> list[dict[str, Any]]:
    """The function schemas of an OpenAI `tools` list, checked: [{"type": "function", "function": {"name", ...}}]
    (a bare {"name", ...} is taken too), each name once."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise UserError(f'{where}: "tools" must be a list of {{"type": "function", "function": {{"name", ...}}}}')
    functions, names = [], set()
    for i, tool in enumerate(tools, 1):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise UserError(f'{where}: tool {i} has type {tool.get("type")!r}; only "function" tools exist')
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise UserError(f"{where}: tool {i} needs a function name of 1-64 letters, digits, _ or -")
        if not isinstance(function.get("parameters", {}), dict):
            raise UserError(f'{where}: tool {i} ({name}): "parameters" must be a JSON schema object')
        if name in names:
            raise UserError(f"{where}: tool {i}: the function {name!r} is listed twice")
        names.add(name)
        functions.append(function)
    return functions


def tools_text(functions: list[dict[str, Any]]) -> str:
    """The functions as the system turn lists them: TOOLS_HEADER, then one JSON schema a line."""
    return "\n".join([TOOLS_HEADER, *(json.dumps(f, ensure_ascii=False) for f in functions)])


def parse_tool_calls(item: dict[str, Any], where: str, i: int) -> list[tuple[str, str, str | dict[str, Any]]]:
    """(id, name, arguments) of each call in an assistant message's "tool_calls", checked: a name, and arguments
    that are a JSON object (as text, as OpenAI sends them, or as an object)."""
    calls = item.get("tool_calls") or []
    if not isinstance(calls, list):
        raise UserError(f'{where}: message {i}: "tool_calls" must be a list')
    out = []
    for j, call in enumerate(calls, 1):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise UserError(f'{where}: message {i}, call {j}: needs {{"function": {{"name", "arguments"}}}}')
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError as e:
            raise UserError(f"{where}: message {i}, call {j} ({name}): arguments are not valid JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise UserError(f"{where}: message {i}, call {j} ({name}): arguments must be a JSON object")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise UserError(f'{where}: message {i}, call {j}: "id" must be a string')
        out.append((call_id, name, arguments))
    return out


def check_callable(name: str, functions: list[dict[str, Any]], where: str) -> None:
    """A call must name a function the conversation lists, or a built-in tool."""
    offered = {f["name"] for f in functions}
    if name not in offered and name not in BUILTIN:
        known = ", ".join(sorted(offered | set(BUILTIN)))
        raise UserError(f"{where}: a call to {name!r}, which is not in the conversation's tools ({known})")
