"""Token ids to text while they are generated: each token's bytes go through an incremental UTF-8 decoder, so a
character split over several tokens appears whole (never as U+FFFD halves), and text that may be the start of a
stop string is held back until it is known not to be one. Special tokens (chat roles, end of text) carry no text."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any


def token_bytes_table(tokenizer: Any) -> list[bytes]:
    """The bytes each id stands for; special tokens and ids past the vocabulary stand for none."""
    kind = getattr(tokenizer, "kind", None)
    if kind == "gpt2":
        one = tokenizer.enc.decode_single_token_bytes
        return [b"" if i == tokenizer.eot_token else one(i) for i in range(tokenizer.vocab_size)]
    if kind == "bpe":
        return [bytes(t) for t in tokenizer.ranks] + [b""] * len(tokenizer.specials)
    if kind == "char":
        return [c.encode("utf-8") for c in tokenizer.itos]
    return [tokenizer.decode([i]).encode("utf-8") for i in range(tokenizer.vocab_size)]


class TokenText:
    """A tokenizer's per-token bytes, computed once: `bytes(i)` and `text(ids)` (what a list of ids decodes to,
    specials left out)."""

    def __init__(self, tokenizer: Any, names: dict[int, str] | None = None):
        self.table = token_bytes_table(tokenizer)
        self.names = names or {}  # special tokens' strings, for `token`

    def bytes(self, i: int) -> bytes:
        return self.table[i] if 0 <= i < len(self.table) else b""

    def text(self, ids: Sequence[int]) -> str:
        return b"".join(self.bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token(self, i: int) -> str:
        """One token as text on its own (a piece of a multi-byte character shows as U+FFFD, a special token as its
        string): what logprobs name tokens by."""
        return self.names.get(i) or self.bytes(i).decode("utf-8", errors="replace")


class TextStream:
    """Text of generated tokens, released as soon as it is safe: `push(token)` returns the new text that can be
    shown, `finish()` the rest. With `stop` strings, generation ends at the first one: `stopped` turns True and
    the text before it is all that is ever released (the stop string itself is not)."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str] = ()):
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self.pending = ""  # decoded, not yet released: it may be the start of a stop string
        self.text = ""  # released so far
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.pending += self.decoder.decode(self.token_bytes(token))
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.pending += self.decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if found:
            out, self.pending, self.stopped = self.pending[: min(found)], "", True
        else:
            keep = 0 if final else self._held_back()
            out = self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep :]
        self.text += out
        return out

    def _held_back(self) -> int:
        """Length of the longest end of `pending` that a stop string starts with."""
        for n in range(min(len(self.pending), max(map(len, self.stop), default=1) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
