"""The one renderer: a conversation to token ids and the loss mask that training, packing, evaluation and the Hugging
Face template (chat/template.py) all agree on.

Format: <|bos|>, then each message as <|role_start|> + the content encoded as ordinary text + <|role_end|>; the
system message is a turn of its own (the functions a conversation offers listed at its end, chat/tools.py). An
assistant turn that uses tools stays one turn: <|assistant_start|>, its text, each call as <|tool_call_start|> +
call text + <|tool_call_end|>, each tool's answer as <|tool_output_start|> + output + <|tool_output_end|>, more
text, <|assistant_end|>. mask[i] = 1 when token i is trained as a prediction (its loss counts): exactly what the
assistant writes (its text, its calls with their start and end tokens, <|assistant_end|>), never bos,
<|assistant_start|>, a system, user or tool output, nor a message marked train=False. A user who types
"<|user_end|>" gets text tokens: only this module places special ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gptforge.chat.conversations import OPENAI_ROLES, Conversation, Message, openai_message
from gptforge.chat.tools import tools_text
from gptforge.core.errors import UserError
from gptforge.tokenizer.specials import BOS, ROLES, SPECIALS, gpt2_special_ids, role_tokens

TRAINED_ROLES = ("assistant", "tool_call")  # what the model writes; everything else is context
TURN_ROLES = ("assistant", "tool_call", "tool_output")  # the parts of one assistant turn


class TooLong(UserError):
    """Even a conversation's first exchange does not fit in max_tokens."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


def chat_special_ids(tokenizer: Any) -> dict[str, int]:
    """Each special token's id on `tokenizer`: GPT-2 BPE's spare rows, or an own BPE tokenizer's reserved specials
    (its `special_id(name)`, name as in tokenizer.specials.SPECIALS)."""
    if getattr(tokenizer, "kind", None) == "gpt2":
        return gpt2_special_ids()
    special_id = getattr(tokenizer, "special_id", None)
    if callable(special_id):
        return {name: special_id(name) for name in SPECIALS}
    raise UserError(
        f"chat needs GPT-2 BPE or an own BPE tokenizer with reserved special tokens, and this tokenizer is "
        f"{getattr(tokenizer, 'kind', type(tokenizer).__name__)!r}, which has no ids for the chat's role tokens: "
        "prepare the data with --tokenizer gpt2 (or a BPE tokenizer of your own)"
    )


def as_message(message: Message | dict[str, Any]) -> Message:
    """A Message from itself or from an OpenAI-style dict ({"role", "content", optional "train"})."""
    if isinstance(message, Message):
        return message
    return Message(message["role"], message["content"], bool(message.get("train", True)))


def _messages(conversation: Conversation | Sequence[Message | dict[str, Any]]) -> list[Message]:
    items = conversation.messages if isinstance(conversation, Conversation) else conversation
    messages = []
    for i, m in enumerate(items, 1):
        if isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool"):  # OpenAI's tool messages
            messages += openai_message(m, OPENAI_ROLES[m["role"]], "conversation", i)
        else:
            messages.append(as_message(m))
    for i, m in enumerate(messages, 1):
        if m.role not in ROLES:
            raise UserError(f"message {i} has role {m.role!r}; the roles are {', '.join(ROLES)}")
    return messages


@dataclass
class Encoded:
    """A conversation with each message's content encoded once: what rendering and the packer's cuts work on.

    An exchange is a run of messages after the system message that ends with an assistant message (normally a
    user message and its answer): a conversation is cut only between exchanges, and every piece of it starts
    with the header (bos and the system turn)."""

    messages: list[Message]
    contents: list[list[int]]

    @property
    def system(self) -> list[int]:
        return [0] if self.messages and self.messages[0].role == "system" else []

    @property
    def header(self) -> int:
        return 1 + sum(self.length(i) for i in self.system)

    def exchanges(self) -> list[tuple[int, int]]:
        """(first, end) message indices of each exchange; trailing messages with no answer form the last one."""
        out, first = [], len(self.system)
        for i in range(first, len(self.messages)):
            if self.closes(i) or i == len(self.messages) - 1:
                out.append((first, i + 1))
                first = i + 1
        return out

    def opens(self, i: int) -> bool:
        """Message i starts an assistant turn."""
        return self.messages[i].role in TURN_ROLES and (i == 0 or self.messages[i - 1].role not in TURN_ROLES)

    def closes(self, i: int) -> bool:
        """Message i ends an assistant turn (its text is the turn's last part)."""
        last = i + 1 == len(self.messages) or self.messages[i + 1].role not in TURN_ROLES
        return self.messages[i].role == "assistant" and last

    def tokens(self, i: int, special_ids: dict[str, int]) -> tuple[list[int], list[int]]:
        """Message i's ids and whether each is written by the assistant (before train flags)."""
        role, content = self.messages[i].role, self.contents[i]
        if role not in TURN_ROLES:
            start, stop = role_tokens(role)
            return [special_ids[start], *content, special_ids[stop]], [0] * (len(content) + 2)
        ids, written = ([special_ids[role_tokens("assistant")[0]]], [0]) if self.opens(i) else ([], [])
        if role == "assistant":
            end = [special_ids[role_tokens("assistant")[1]]] if self.closes(i) else []
            return ids + content + end, written + [1] * (len(content) + len(end))
        start, stop = role_tokens(role)
        ids += [special_ids[start], *content, special_ids[stop]]
        return ids, written + [int(role == "tool_call")] * (len(content) + 2)

    def length(self, i: int) -> int:
        role = self.messages[i].role
        if role == "assistant":
            return len(self.contents[i]) + self.opens(i) + self.closes(i)
        return len(self.contents[i]) + 2 + self.opens(i)

    def exchange_lengths(self) -> list[int]:
        return [sum(self.length(i) for i in range(a, b)) for a, b in self.exchanges()]

    def fitting(self, max_tokens: int, first: int = 0) -> int:
        """How many exchanges from exchange `first` on fit in max_tokens with the header."""
        total, count = self.header, 0
        for length in self.exchange_lengths()[first:]:
            total += length
            if total > max_tokens:
                break
            count += 1
        return count

    def render(
        self, special_ids: dict[str, int], first: int = 0, end: int | None = None, last_turn_only: bool = False
    ) -> tuple[list[int], list[int]]:
        """(ids, mask) of the header and exchanges[first:end]."""
        picked = [i for a, b in self.exchanges()[first:end] for i in range(a, b)]
        last = max((i for i in picked if self.messages[i].role in TRAINED_ROLES), default=-1)
        last_turn = max((i for i in picked if i <= last and self.opens(i)), default=-1)
        ids, mask = [special_ids[BOS]], [0]
        for i in self.system + picked:
            trained = self.messages[i].train and (not last_turn_only or i >= last_turn)
            more, written = self.tokens(i, special_ids)
            ids += more
            mask += [w & trained for w in written]
        return ids, mask


def encode(
    conversation: Conversation | Sequence[Message | dict[str, Any]], tokenizer: Any, tools: list | None = None
) -> Encoded:
    """Each message's content as ordinary text (a special token's string stays text: the tokenizer's `encode`
    must never produce special ids, as GPT2Tokenizer.encode does not). `tools`: the function schemas offered
    (default: the conversation's own), listed at the end of the system turn."""
    messages = with_tools(_messages(conversation), getattr(conversation, "tools", []) if tools is None else tools)
    return Encoded(messages, [list(tokenizer.encode(m.content)) for m in messages])


def with_tools(messages: list[Message], functions: list[dict[str, Any]]) -> list[Message]:
    """The messages with the functions listed at the end of the system message (one made when there is none)."""
    if not functions:
        return messages
    if messages and messages[0].role == "system":
        return [Message("system", f"{messages[0].content}\n\n{tools_text(functions)}"), *messages[1:]]
    return [Message("system", tools_text(functions)), *messages]


def render(
    conversation: Conversation | Sequence[Message | dict[str, Any]],
    tokenizer: Any,
    special_ids: dict[str, int],
    max_tokens: int | None = None,
    last_turn_only: bool = False,
    tools: list | None = None,
) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation. Longer than max_tokens: cut after the last exchange that fits (whole
    exchanges dropped from the end); raises TooLong (a UserError) when even the first one does not fit.
    last_turn_only: only the last assistant message rendered is trained."""
    encoded = encode(conversation, tokenizer, tools)
    end = None if max_tokens is None else encoded.fitting(max_tokens)
    if end == 0 and encoded.exchanges():
        needed = encoded.header + encoded.exchange_lengths()[0]
        raise TooLong(f"the first exchange needs {needed} tokens, more than {max_tokens}", needed)
    return encoded.render(special_ids, 0, end, last_turn_only)


def render_prompt(
    messages: Conversation | Sequence[Message | dict[str, Any]],
    tokenizer: Any,
    special_ids: dict[str, int],
    tools: list | None = None,
) -> list[int]:
    """The ids a model continues to answer: the conversation so far, then <|assistant_start|> (none after a tool's
    output: the assistant's turn goes on)."""
    encoded = encode(messages, tokenizer, tools)
    ids, _ = encoded.render(special_ids)
    going_on = encoded.messages and encoded.messages[-1].role == "tool_output"
    return ids if going_on else [*ids, special_ids[role_tokens("assistant")[0]]]
