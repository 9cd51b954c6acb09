"""Tool calls while generating: one row's tokens watched as they are sampled; when the row closes a call
(<|tool_call_start|> ... <|tool_call_end|>), a built-in tool (chat/tools.py BUILTIN, the calculator) is run and
its output comes back as the tokens to feed that row next (<|tool_output_start|> output <|tool_output_end|>), so
the answer goes on from there; a call to any other function is handed to the caller (serve returns it to the
client as OpenAI's tool_calls). The chat CLI, `eval chat` and serve share this; `--tools none` turns the built-in
tools off (a call then gets an error text back, as a call to a function nobody offers does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gptforge.chat.tools import BUILTIN, parse_call_text, run_tool
from gptforge.core.errors import UserError
from gptforge.infer.options import TOOL_CHOICES


def builtin_tools(choice: str) -> frozenset[str]:
    """The built-in tools a --tools value turns on."""
    if choice not in TOOL_CHOICES:
        raise UserError(f"--tools={choice}: choose one of {', '.join(TOOL_CHOICES)}")
    return frozenset() if choice == "none" else frozenset(BUILTIN) & {choice}


@dataclass
class ToolCall:
    """A call the model wrote: the function's name and its arguments (JSON text), the call's text as written, and
    the output when the engine ran it (None: the caller must answer it)."""

    name: str
    arguments: str
    text: str
    output: str | None = None
    call_id: str = ""
    feed: list[int] = field(default_factory=list)  # the output's tokens to feed the row next

    def openai(self) -> dict:
        """As an entry of OpenAI's tool_calls."""
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class CallWatcher:
    """Watches one row: push(token) after each sampled token; returns a ToolCall when that token closed a call."""

    def __init__(
        self,
        special_ids: dict[str, int],
        decode: Callable[[Sequence[int]], str],
        encode: Callable[[str], list[int]],
        builtins: frozenset[str] = frozenset(BUILTIN),
        offered: frozenset[str] = frozenset(),
        runners: dict[str, Callable[[dict], str]] | None = None,
    ):
        self.ids = special_ids
        self.decode, self.encode = decode, encode
        self.builtins, self.offered = builtins, offered
        self.runners = runners or {}  # functions run here on the client's behalf (eval chat's synthetic ones)
        self.inside: list[int] | None = None  # the call's tokens so far, while the row writes one
        self.calls: list[ToolCall] = []
        self.new_id: Callable[[], str] = lambda: f"call_{len(self.calls)}"

    @property
    def start(self) -> int:
        return self.ids["<|tool_call_start|>"]

    @property
    def end(self) -> int:
        return self.ids["<|tool_call_end|>"]

    def in_call(self, token: int) -> bool:
        """Whether `token` (just sampled, not yet pushed) is part of a call: its start token or anything inside."""
        return self.inside is not None or token == self.start

    def push(self, token: int) -> ToolCall | None:
        if token == self.start:
            self.inside = []
            return None
        if self.inside is None:
            return None
        if token != self.end:
            self.inside.append(token)
            return None
        text, self.inside = self.decode(self.inside), None
        call = self.closed(text)
        call.call_id = self.new_id()
        self.calls.append(call)
        return call

    def closed(self, text: str) -> ToolCall:
        """What happens to a call whose text is `text`: run here, handed to the caller, or answered with an error."""
        parsed = parse_call_text(text)
        if parsed is None:
            return self.answered(ToolCall("", "", text), 'error: a call is {"name": ..., "arguments": {...}}')
        name, arguments = parsed
        if name in self.offered:
            return ToolCall(name, arguments, text)  # the caller's function: it answers
        if name in self.builtins or name in self.runners:
            run = self.runners.get(name) or BUILTIN[name][1]
            return self.answered(ToolCall(name, arguments, text), run_tool(run, arguments))
        return self.answered(ToolCall(name, arguments, text), f"error: there is no tool named {name!r}")

    def answered(self, call: ToolCall, output: str) -> ToolCall:
        call.output = output
        call.feed = [self.ids["<|tool_output_start|>"], *self.encode(output), self.ids["<|tool_output_end|>"]]
        return call


def scored_tokens(tokens: Sequence[int], special_ids: dict[str, int]) -> list[int]:
    """The text tokens of an answer the engine ran calls in (watched by a CallWatcher; the tools' outputs fed among
    its tokens or not): what follows its last call and that call's output, the calls' and the outputs' tokens left
    out: the text `eval chat` and RL's reward score."""
    closing = {
        special_ids["<|tool_call_start|>"]: special_ids["<|tool_call_end|>"],
        special_ids["<|tool_output_start|>"]: special_ids["<|tool_output_end|>"],
    }
    text: list[int] = []
    until = None  # inside a call or an output: the token that closes it
    for token in tokens:
        if until is not None:
            if token == until:
                until, text = None, []
        elif token in closing:
            until = closing[token]
        else:
            text.append(token)
    return text
