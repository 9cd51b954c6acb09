"""One conversation with a model, kept in the model's KV cache between turns: a turn feeds only its own tokens (the
cache already holds the rest; `prefilled` counts the tokens fed at once, `stepped` those fed one by one), then the
answer is generated token by token until the stop rule says so (a chat model's end token, a stop string, the token
budget, an interrupt). When the conversation outgrows the model's context, the oldest whole exchanges are dropped
(the system message stays), the caller is told, and the rest is fed again: it never crashes at the context's end.

A chat model's conversation is rendered by chat/render.py's format; a base model's is plain text that each turn
continues (completion mode), and its overflow keeps the last half of the context."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gptforge.chat.conversations import read_file
from gptforge.chat.render import encode as encode_conversation
from gptforge.chat.tools import BUILTIN
from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.core.files import atomic_write
from gptforge.infer.chat_model import LoadedModel
from gptforge.infer.engine import Rows
from gptforge.infer.sampling import RowSampler, SamplingParams
from gptforge.infer.textstream import TextStream
from gptforge.infer.toolcalls import CallWatcher, ToolCall
from gptforge.tokenizer.specials import role_tokens


@dataclass
class Reply:
    text: str
    tokens: int  # generated, the stop token not counted
    finish_reason: str  # 'stop' (end token or stop string), 'length' (budget or context), 'interrupted'
    calls: list[ToolCall] = field(default_factory=list)  # the tool calls the answer made, with their outputs


class Answer:
    """An answer being generated: its sampler, the text since its last tool call (stream), the messages before
    that (parts: assistant text with a call, the tool's output), where that text's tokens start (segment), and
    how many tokens the answer holds (made: text, calls and outputs; segment: those before the text)."""

    def __init__(self, sampler: RowSampler, stop: list[str], lm: LoadedModel, tools: frozenset[str]):
        self.sampler, self.stop, self.lm = sampler, stop, lm
        self.stream = TextStream(lm.text.bytes, stop)
        self.watcher = CallWatcher(lm.special_ids, lm.text.text, lm.encode, tools) if lm.chat else None
        self.parts: list[dict[str, Any]] = []
        self.segment, self.made, self.finish = 0, 0, "length"

    def push(self, token: int) -> Iterator[str]:
        """The text a token adds, unless it is part of a tool call."""
        if self.watcher is not None and self.watcher.in_call(token):
            if token == self.watcher.start:
                rest = self.stream.finish()
                if rest:
                    yield rest
            return
        piece = self.stream.push(token)
        if piece:
            yield piece

    def called(self, call: ToolCall) -> None:
        """A call closed and its output fed: the text before it and the call become messages, new text starts."""
        self.parts.append({"role": "assistant", "content": self.stream.text or None, "tool_calls": [call.openai()]})
        self.parts.append({"role": "tool", "tool_call_id": call.call_id, "content": call.output or ""})
        self.stream = TextStream(self.lm.text.bytes, self.stop)
        self.segment = self.made


class Session:
    """A conversation: `answer(text, ...)` streams the reply to a user message, `set_system`, `clear`, `save` and
    `load` change or keep it. `notify` receives what the user should know (turns dropped from the context)."""

    def __init__(
        self,
        lm: LoadedModel,
        system: str | None = None,
        notify: Callable[[str], None] = log,
        tools: frozenset[str] = frozenset(BUILTIN),
    ):
        self.lm, self.notify, self.tools = lm, notify, tools  # tools: the built-in tools the engine runs
        self.rows = Rows(lm.model, step=lm.decode)
        self.prefilled = self.stepped = 0
        self.messages: list[dict[str, str]] = []
        self.ids: list[int] = []  # the conversation's tokens; the cache holds the first rows.length of them
        self.last: Reply | None = None
        self.clear(system)

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    def clear(self, system: str | None = None) -> None:
        """A new conversation (with `system` as its system message, if any)."""
        self._reset([{"role": "system", "content": system}] if system else [])

    def set_system(self, text: str | None) -> None:
        """Replace the system message: the conversation's start changes, so it is all fed again next turn."""
        rest = [m for m in self.messages if m["role"] != "system"]
        self._reset(([{"role": "system", "content": text}] if text else []) + rest)

    def _reset(self, messages: list[dict[str, str]]) -> None:
        if not self.lm.chat and any(m["role"] == "system" for m in messages):
            raise UserError("a base model has no system message (it continues text); use a chat model")
        self.messages = messages
        self.ids = self._render(messages)
        self.rows.truncate(0)

    def _render(self, messages: list[dict[str, str]], first: int = 0) -> list[int]:
        """The tokens of whole messages (exchanges[first:] after the header, for a chat model)."""
        if not self.lm.chat:
            return self.lm.encode("".join(m["content"] for m in messages))
        return encode_conversation(messages, self.lm.tokenizer).render(self.lm.special_ids, first)[0]

    def _turn(self, text: str) -> list[int]:
        """A user message's tokens after the conversation so far (a chat model's: with the answer's start)."""
        if not self.lm.chat:
            return self.lm.encode(text)
        sid = self.lm.special_ids
        start, end = role_tokens("user")
        return [sid[start], *self.lm.encode(text), sid[end], sid[role_tokens("assistant")[0]]]

    def answer(
        self,
        text: str,
        params: SamplingParams,
        max_new_tokens: int,
        stop: list[str] | None = None,
        interrupted: Callable[[], bool] = lambda: False,
        on_tool: Callable[[ToolCall], None] | None = None,
    ) -> Iterator[str]:
        """Stream the reply to `text` in pieces of text; afterwards `last` holds the Reply. A message that cannot
        fit in the context even alone is a UserError (the conversation is left as it was). A call to a built-in
        tool is run and its output fed (infer/toolcalls.py); `on_tool` sees each call with its output."""
        new = self._turn(text)
        self.messages.append({"role": "user", "content": text})
        reserve = min(max_new_tokens, self.lm.block_size // 4)
        if len(self.ids) + len(new) + reserve <= self.lm.block_size:
            self.ids += new
        elif not self._make_room(self.ids + new, reserve):
            self.messages.pop()
            raise UserError(
                f"this message is {len(new)} tokens, too many for this model's context of {self.lm.block_size} "
                f"with the system message ({len(self._render(self.messages[:1] if self.system else []))} tokens) "
                "and room for an answer: shorten it"
            )
        sampler = RowSampler(params, self.lm.vocab, self.lm.device, self.ids)
        answer = Answer(sampler, stop or [], self.lm, self.tools)
        with torch.no_grad(), self.lm.autocast():
            yield from self._generate(answer, max_new_tokens, interrupted, on_tool or (lambda call: None))
        self._close(answer)

    def _generate(self, answer: Answer, max_new_tokens: int, interrupted, on_tool) -> Iterator[str]:
        logits = self._catch_up()
        while answer.made < max_new_tokens:
            if interrupted():
                answer.finish = "interrupted"
                break
            token = answer.sampler.choose(logits[0, : self.lm.vocab]).token
            if token in self.lm.stop_ids:
                answer.finish = "stop"
                break
            self.ids.append(token)
            answer.made += 1
            yield from answer.push(token)
            call = answer.watcher.push(token) if answer.watcher else None
            if call is not None:
                self.ids += call.feed  # the tool's output: the answer goes on after it
                answer.made += len(call.feed)
                answer.called(call)
                on_tool(call)
            if answer.stream.stopped:
                answer.finish = "stop"
                break
            if answer.made >= max_new_tokens or not self._room(answer.made):
                break
            logits = self._catch_up()
        rest = answer.stream.finish()
        if rest:
            yield rest

    def _catch_up(self) -> torch.Tensor:
        """Feed the tokens the cache does not hold yet; the next token's logits (1, V)."""
        new = self.ids[self.rows.length :]
        if len(new) == 1:
            self.stepped += 1
        else:
            self.prefilled += len(new)
        return self.rows.feed(torch.tensor([new], dtype=torch.long, device=self.lm.device))

    def _room(self, made: int) -> bool:
        """Room to feed the newest token; when the context is full, make room and go on. False when nothing is
        left to drop: the answer ends there."""
        if len(self.ids) <= self.lm.block_size:
            return True
        if self._make_room(self.ids, self.lm.block_size // 4, made):
            return True
        self.notify(f"context full ({self.lm.block_size} tokens): the answer ends here")
        return False

    def _make_room(self, tokens: list[int], reserve: int, made: int = 0) -> bool:
        """Make `tokens` (the conversation with a new turn, or ending with the `made` tokens of an answer) fit with
        `reserve` tokens to spare: a chat model's oldest whole exchanges are dropped (the system message stays), what is
        kept is rendered again; a base model's oldest tokens are dropped. All of it is fed again next. False when
        even the last exchange alone does not fit."""
        block = self.lm.block_size
        if not self.lm.chat:
            keep = max(1, block - reserve)
            self.notify(f"context full ({block} tokens): dropped the oldest {len(tokens) - keep} tokens")
            self.ids = tokens[-keep:]
            self.rows.truncate(0)
            return True
        conv = encode_conversation(self.messages, self.lm.tokenizer)
        answer = tokens[len(tokens) - made :]
        lengths, extra = conv.exchange_lengths(), 1 + len(answer)  # <|assistant_start|> and the answer so far

        def fits(first: int, spare: int) -> bool:
            return conv.header + sum(lengths[first:]) + extra + spare <= block

        first = next((k for k in range(len(lengths)) if fits(k, reserve)), len(lengths) - 1)
        if not fits(first, 1):
            return False
        dropped = {m for a, b in conv.exchanges()[:first] for m in range(a, b)}
        self.messages = [m for i, m in enumerate(self.messages) if i not in dropped]
        self.ids = self._render(self.messages) + [self.lm.special_ids[role_tokens("assistant")[0]], *answer]
        self.rows.truncate(0)
        if first:
            kept = " (the system message is kept)" if self.system is not None else ""
            self.notify(
                f"context full ({block} tokens): dropped the oldest {first} exchange(s), {sum(lengths[:first])} "
                f"tokens{kept}"
            )
        return True

    def _close(self, answer: Answer) -> None:
        """The answer becomes messages (with its tool calls and outputs, if any); the conversation's tokens end as
        the renderer ends an answer. A stop string cut the text short of the tokens: the last text's tokens are
        those of its text."""
        text, start = answer.stream.text, len(self.ids) - answer.made + answer.segment
        if answer.stream.stopped:
            self.ids[start:] = self.lm.encode(text)
            self.rows.truncate(min(self.rows.length, start))
        if self.lm.chat:
            self.ids.append(self.lm.special_ids[role_tokens("assistant")[1]])
        self.messages += [*answer.parts, {"role": "assistant", "content": text}]
        visible = "".join(p["content"] or "" for p in answer.parts if p["role"] == "assistant") + text
        self.last = Reply(visible, answer.made, answer.finish, answer.watcher.calls if answer.watcher else [])

    def save(self, path: str) -> None:
        """The conversation as one line of OpenAI-format JSONL, the format `gptforge prepare chat` reads."""
        try:
            with atomic_write(path, "w", encoding="utf-8") as fh:
                fh.write(json.dumps({"messages": self.messages}, ensure_ascii=False) + "\n")
        except OSError as e:
            raise UserError(f"/save {path}: cannot write it ({e.strerror or e})") from None

    def load(self, path: str) -> int:
        """The last conversation of a JSONL file (OpenAI, ShareGPT or Alpaca), fed again at the next turn.
        Returns how many conversations the file holds."""
        conversations = read_file(path, training=False)
        messages = conversations[-1].to_openai()["messages"]
        if messages[-1]["role"] != "assistant":
            raise UserError(
                f"/load {path}: its conversation ends with a {messages[-1]['role']} message; the chat goes "
                "on after an answer, so end it with the assistant's"
            )
        self._reset(messages)
        return len(conversations)
