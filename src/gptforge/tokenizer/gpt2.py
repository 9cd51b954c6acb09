"""GPT-2's byte-pair encoding through tiktoken, with its offline routes (TIKTOKEN_CACHE_DIR, GPTFORGE_GPT2_BPE_DIR:
README "Commands")."""

from __future__ import annotations

import os
from typing import Any

from gptforge.core.errors import UserError

GPT2_EOT = 50256  # <|endoftext|>
GPT2_VOCAB = 50257
BPE_DIR_ENV = "GPTFORGE_GPT2_BPE_DIR"


class GPT2Tokenizer:
    kind = "gpt2"

    def __init__(self) -> None:
        self.enc = _gpt2_encoding()
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_token: int | None = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        """Ordinary text: a literal "<|endoftext|>" in it is encoded as plain characters, never as the EOT token."""
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        # Ids past 50257 exist only as padding rows of a 50304 vocabulary; they carry no text.
        return self.enc.decode([i for i in ids if 0 <= i < self.vocab_size])

    def spec(self) -> dict[str, Any]:
        return {"tokenizer": self.kind}


def _gpt2_encoding():
    import tiktoken

    bpe_dir = os.environ.get(BPE_DIR_ENV)
    if bpe_dir:
        return _encoding_from_files(bpe_dir)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken raises whatever requests raises when the download fails
        raise UserError(
            f"could not load GPT-2's BPE files through tiktoken ({type(e).__name__}: {e}). Offline? Set "
            f"TIKTOKEN_CACHE_DIR to a folder of tiktoken's cached files, or {BPE_DIR_ENV} to a folder holding "
            "encoder.json and vocab.bpe (or r50k_base.tiktoken)"
        ) from None


def _encoding_from_files(bpe_dir: str):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex, as tiktoken has it

    vocab, encoder, r50k = (os.path.join(bpe_dir, n) for n in ("vocab.bpe", "encoder.json", "r50k_base.tiktoken"))
    if os.path.isfile(vocab) and os.path.isfile(encoder):
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab, encoder_json_file=encoder)
    elif os.path.isfile(r50k):
        ranks = load_tiktoken_bpe(r50k)
    else:
        raise UserError(f"{BPE_DIR_ENV}={bpe_dir}: needs encoder.json and vocab.bpe, or r50k_base.tiktoken")
    return tiktoken.Encoding(
        name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": GPT2_EOT}
    )
