"""GPT-2's byte-pair encoding through tiktoken, with its offline routes (TIKTOKEN_CACHE_DIR, GPTFORGE_GPT2_BPE_DIR:
README "Commands")."""

from __future__ import annotations

import os
from typing import Any

from gptforge.core.errors import UserError
from gptforge.core.files import write_bytes
from gptforge.tokenizer.hf_format import GPTFORGE_FILE, byte_to_char, write_json

GPT2_EOT = 50256  # <|endoftext|>
GPT2_VOCAB = 50257
BPE_DIR_ENV = "GPTFORGE_GPT2_BPE_DIR"
EOT_TEXT = "<|endoftext|>"


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

    def token_byte_lengths(self) -> list[int]:
        """For each id, how many bytes of text it stands for (<|endoftext|>: 0): the denominator of bits per byte."""
        one = self.enc.decode_single_token_bytes
        return [0 if i == self.eot_token else len(one(i)) for i in range(self.vocab_size)]

    def spec(self) -> dict[str, Any]:
        return {"tokenizer": self.kind}

    def save(self, folder: str, model_max_length: int | None = None) -> None:
        """GPT-2's tokenizer files for transformers' GPT2Tokenizer, rebuilt from tiktoken's gpt2 encoding, and
        gptforge's record. vocab.json maps each token, written in GPT-2's byte-to-unicode alphabet, to its id;
        merges.txt lists the 50,000 merges in rank order. Both equal OpenAI's encoder.json and vocab.bpe."""
        vocab, merges = gpt2_vocab_and_merges(self.enc)
        write_json(folder, "vocab.json", vocab)
        merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
        write_bytes(os.path.join(folder, "merges.txt"), merges_text.encode("utf-8"), what=folder)
        special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
        write_json(folder, "special_tokens_map.json", special)
        config = {"tokenizer_class": "GPT2Tokenizer", **special, "model_max_length": model_max_length or 1024}
        config.update(add_prefix_space=False, add_bos_token=False, errors="replace")
        config["clean_up_tokenization_spaces"] = False  # decode gives back the text exactly, as tiktoken does
        write_json(folder, "tokenizer_config.json", config)
        write_json(folder, GPTFORGE_FILE, self.spec())


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


def gpt2_vocab_and_merges(enc: Any) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab.json's dict, merges.txt's pairs) from a tiktoken GPT-2 encoding.

    tiktoken keeps only each token's bytes and rank. A token of rank r >= 256 was made by one merge of two
    tokens of lower rank; which two is what byte-pair encoding of its bytes with only the merges below r
    ends with (the same procedure tiktoken applies to text), so the merges come back in rank order.
    """
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i != enc.eot_token}
    to_text = byte_to_char()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = enc.eot_token
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if rank < 256:
            assert len(token) == 1, f"GPT-2's first 256 tokens are single bytes; rank {rank} is {token!r}"
            continue
        parts = _bpe(ranks, token, max_rank=rank)
        assert len(parts) == 2, f"token {token!r} (rank {rank}) is not one merge of lower-ranked tokens: {parts}"
        merges.append((text(parts[0]), text(parts[1])))
    return vocab, merges


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-pair encode `token`, merging only pairs whose rank is below max_rank, lowest rank first."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts
