"""The one renderer: a conversation to token ids and the loss mask that training, packing, evaluation and the Hugging
Face template (chat/template.py) all agree on.

Format: <|bos|>, then each message as <|role_start|> + the content encoded as ordinary text + <|role_end|>; the
system message is a turn of its own. mask[i] = 1 when token i is trained as a prediction (its loss counts): exactly
the content and end token of the assistant's messages (and tool calls, which the assistant writes), never bos, a
start token, a system, user or tool-output turn, nor a message marked train=False. A user who types "<|user_end|>"
gets text tokens: only this module places special ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gptforge.chat.conversations import Conversation, Message
from gptforge.core.errors import UserError
from gptforge.tokenizer.specials import BOS, ROLES, SPECIALS, gpt2_special_ids, role_tokens

TRAINED_ROLES = ("assistant", "tool_call")  # what the model writes; everything else is context


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
    messages = [as_message(m) for m in items]
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
        return 1 + sum(len(self.contents[i]) + 2 for i in self.system)

    def exchanges(self) -> list[tuple[int, int]]:
        """(first, end) message indices of each exchange; trailing messages with no answer form the last one."""
        out, first = [], len(self.system)
        for i in range(first, len(self.messages)):
            if self.messages[i].role == "assistant" or i == len(self.messages) - 1:
                out.append((first, i + 1))
                first = i + 1
        return out

    def exchange_lengths(self) -> list[int]:
        return [sum(len(self.contents[i]) + 2 for i in range(a, b)) for a, b in self.exchanges()]

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
        ids, mask = [special_ids[BOS]], [0]
        for i in self.system + picked:
            m = self.messages[i]
            trained = m.role in TRAINED_ROLES and m.train and (not last_turn_only or i == last)
            start, stop = role_tokens(m.role)
            ids += [special_ids[start], *self.contents[i], special_ids[stop]]
            mask += [0, *[int(trained)] * len(self.contents[i]), int(trained)]
        return ids, mask


def encode(conversation: Conversation | Sequence[Message | dict[str, Any]], tokenizer: Any) -> Encoded:
    """Each message's content as ordinary text (a special token's string stays text: the tokenizer's `encode`
    must never produce special ids, as GPT2Tokenizer.encode does not)."""
    messages = _messages(conversation)
    return Encoded(messages, [list(tokenizer.encode(m.content)) for m in messages])


def render(
    conversation: Conversation | Sequence[Message | dict[str, Any]],
    tokenizer: Any,
    special_ids: dict[str, int],
    max_tokens: int | None = None,
    last_turn_only: bool = False,
) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation. Longer than max_tokens: cut after the last exchange that fits (whole
    exchanges dropped from the end); raises TooLong (a UserError) when even the first one does not fit.
    last_turn_only: only the last assistant message rendered is trained."""
    encoded = encode(conversation, tokenizer)
    end = None if max_tokens is None else encoded.fitting(max_tokens)
    if end == 0 and encoded.exchanges():
        needed = encoded.header + encoded.exchange_lengths()[0]
        raise TooLong(f"the first exchange needs {needed} tokens, more than {max_tokens}", needed)
    return encoded.render(special_ids, 0, end, last_turn_only)


def render_prompt(
    messages: Sequence[Message | dict[str, Any]], tokenizer: Any, special_ids: dict[str, int]
) -> list[int]:
    """The ids a model continues to answer: the conversation so far, then <|assistant_start|>."""
    ids, _ = encode(messages, tokenizer).render(special_ids)
    return [*ids, special_ids[role_tokens("assistant")[0]]]
