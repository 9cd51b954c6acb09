"""A character vocabulary (nanoGPT's shakespeare_char): one token per distinct character of the training text, the
list of characters (`itos`) stored in meta.json and every checkpoint."""

from __future__ import annotations

from typing import Any

from gptforge.core.errors import UserError
from gptforge.tokenizer.hf_format import GPTFORGE_FILE, char_tokenizer_json, write_json


class CharTokenizer:
    kind = "char"

    def __init__(self, itos: list[str]):
        assert all(isinstance(c, str) and len(c) == 1 for c in itos), "a char vocabulary holds single characters"
        self.itos = list(itos)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.vocab_size = len(self.itos)
        self.eot_token: int | None = None

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise UserError(
                f"character {e.args[0]!r} is not in this model's character vocabulary "
                f"({self.vocab_size} characters); use only characters from its training text"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids if 0 <= i < self.vocab_size)

    def token_byte_lengths(self) -> list[int]:
        """For each id, the UTF-8 bytes of its character: the denominator of bits per byte (1 each on ASCII)."""
        return [len(c.encode("utf-8")) for c in self.itos]

    def spec(self) -> dict[str, Any]:
        return {"tokenizer": self.kind, "itos": self.itos}

    def save(self, folder: str, model_max_length: int | None = None) -> None:
        """The vocabulary as Hugging Face tokenizer files (AutoTokenizer loads them) and gptforge's record."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        write_json(folder, "tokenizer.json", char_tokenizer_json(self.itos))
        write_json(folder, "tokenizer_config.json", {**config, "model_max_length": model_max_length or 10**9})
        write_json(folder, GPTFORGE_FILE, {**self.spec(), "vocab_size": self.vocab_size})
