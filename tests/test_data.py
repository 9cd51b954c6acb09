"""Data preparation and batch loading: real Tiny Shakespeare, real tiktoken, real files."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.data import prepare as prep
from gptforge.data.loader import RandomBatches, dataset_dir, open_tokens, read_meta
from gptforge.tokenizer.char import CharTokenizer
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from gptforge.tokenizer.spec import from_spec


def test_shakespeare_char_matches_nanogpt(tmp_path, shakespeare_path):
    meta = prep.prepare("shakespeare_char", data_dir=str(tmp_path), input_path=str(shakespeare_path))
    folder = tmp_path / "shakespeare_char"
    text = shakespeare_path.read_text()
    # nanoGPT's prepare.py prints: vocab 65, train 1,003,854 tokens, val 111,540 tokens
    assert meta["vocab_size"] == 65 and meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
    assert "".join(meta["itos"]) == "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    train, val = np.fromfile(folder / "train.bin", np.uint16), np.fromfile(folder / "val.bin", np.uint16)
    assert (len(train), len(val)) == (1_003_854, 111_540)
    tok = CharTokenizer(meta["itos"])
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text
    assert json.loads((folder / "meta.json").read_text()) == meta == read_meta(str(folder))
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_shakespeare_bpe_matches_nanogpt(tmp_path, shakespeare_path, tiktoken_cache):
    meta = prep.prepare("shakespeare", data_dir=str(tmp_path), input_path=str(shakespeare_path))
    folder = tmp_path / "shakespeare"
    train, val = np.fromfile(folder / "train.bin", np.uint16), np.fromfile(folder / "val.bin", np.uint16)
    assert (len(train), len(val)) == (301_966, 36_059)  # nanoGPT's figures for data/shakespeare
    assert meta["vocab_size"] == 50257 and meta["eot_token"] == 50256 and meta["tokenizer"] == "gpt2"
    tok = GPT2Tokenizer()
    text = shakespeare_path.read_text()
    assert tok.decode(train.tolist()) == text[: int(len(text) * 0.9)]
    assert tok.encode("Hello world") == [15496, 995]


def test_gpt2_tokenizer_from_local_bpe_files(monkeypatch, tiktoken_cache):
    bpe_dir = tiktoken_cache.parent / "gpt2-tokenizer"
    monkeypatch.setenv("GPTFORGE_GPT2_BPE_DIR", str(bpe_dir))
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995] and tok.eot_token == 50256
    monkeypatch.setenv("GPTFORGE_GPT2_BPE_DIR", str(tiktoken_cache.parent))
    with pytest.raises(UserError, match="needs encoder.json and vocab.bpe"):
        GPT2Tokenizer()


def test_gpt2_tokenizer_offline_without_cache_names_the_options(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # a dead port: no download can succeed
    monkeypatch.delenv("GPTFORGE_GPT2_BPE_DIR", raising=False)
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget encodings built earlier in this process
    with pytest.raises(UserError, match="TIKTOKEN_CACHE_DIR.*GPTFORGE_GPT2_BPE_DIR"):
        GPT2Tokenizer()


def test_download_used_when_no_input(tmp_path, monkeypatch):
    src = tmp_path / "remote.txt"
    src.write_text("to be or not to be, that is the question\n" * 20)
    monkeypatch.setattr(prep, "SHAKESPEARE_URL", src.as_uri())
    prep.prepare("shakespeare_char", data_dir=str(tmp_path / "data"))
    assert (tmp_path / "data/shakespeare_char/input.txt").read_text() == src.read_text()
    # a second run reuses input.txt in the folder instead of downloading again
    monkeypatch.setattr(prep, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")
    prep.prepare("shakespeare_char", data_dir=str(tmp_path / "data"))


def test_download_failure_names_input_option_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")
    with pytest.raises(UserError, match="Offline\\? Pass --input PATH"):
        prep.prepare("shakespeare_char", data_dir=str(tmp_path))
    assert os.listdir(tmp_path / "shakespeare_char") == []


def test_text_recipe_char_and_gpt2(tmp_path, tiktoken_cache):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha beta gamma\n" * 30)
    b.write_text("delta épsilon\n" * 30)
    meta = prep.prepare("text", data_dir=str(tmp_path / "d"), files=[str(a), str(b)], name="mine", val_fraction=0.2)
    ids = np.concatenate([np.fromfile(tmp_path / "d/mine" / f"{s}.bin", np.uint16) for s in ("train", "val")])
    assert CharTokenizer(meta["itos"]).decode(ids.tolist()) == a.read_text() + b.read_text()
    assert meta["tokens"]["val"] == len(ids) - int(len(ids) * 0.8)

    meta = prep.prepare("text", data_dir=str(tmp_path / "d"), files=[str(a), str(b)], name="bpe", tokenizer="gpt2")
    ids = np.concatenate([np.fromfile(tmp_path / "d/bpe" / f"{s}.bin", np.uint16) for s in ("train", "val")])
    tok = GPT2Tokenizer()
    expected = tok.encode(a.read_text()) + [50256] + tok.encode(b.read_text()) + [50256]
    assert ids.tolist() == expected and meta["eot_token"] == 50256


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recipe="text", files=[], name="x"), "needs one or more FILEs and --name"),
        (dict(recipe="text", files=["missing.txt"], name="x"), "input file 'missing.txt' not found"),
        (dict(recipe="wiki"), "unknown recipe 'wiki'"),
        (dict(recipe="shakespeare_char", val_fraction=1.5), "--val_fraction must be between 0 and 1"),
    ],
)
def test_prepare_errors(tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        prep.prepare(data_dir=str(tmp_path), **kwargs)


def test_non_utf8_input_is_named(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1") * 100)
    with pytest.raises(UserError, match="latin1.txt: not UTF-8"):
        prep.prepare("text", data_dir=str(tmp_path), files=[str(bad)], name="x")


@pytest.mark.parametrize("failing_file", ["meta.json", "train.bin", "val.bin"])  # val.bin: the others are staged
def test_failed_rewrite_keeps_the_previous_dataset(tmp_path, monkeypatch, failing_file):
    (tmp_path / "t.txt").write_text("abcdefgh\n" * 100)
    prep.prepare("text", data_dir=str(tmp_path), files=[str(tmp_path / "t.txt")], name="x")
    before = {p: (tmp_path / "x" / p).read_bytes() for p in ("train.bin", "val.bin", "meta.json")}
    (tmp_path / "t.txt").write_text("zyxwvut\n" * 100)
    real_write = prep.write_file

    def failing(fh, data):
        if os.path.basename(fh.name).startswith(f".{failing_file}."):  # its temporary file, files.temp_path
            raise OSError(28, "No space left on device")
        return real_write(fh, data)

    monkeypatch.setattr(prep, "write_file", failing)
    with pytest.raises(UserError, match="No space left on device"):
        prep.prepare("text", data_dir=str(tmp_path), files=[str(tmp_path / "t.txt")], name="x")
    assert {p: (tmp_path / "x" / p).read_bytes() for p in before} == before
    assert sorted(os.listdir(tmp_path / "x")) == ["meta.json", "train.bin", "val.bin"]


def test_batches_are_windows_shifted_by_one(tmp_path):
    data = np.arange(1000, dtype=np.uint16) % 500
    data.tofile(tmp_path / "train.bin")
    b = RandomBatches(str(tmp_path / "train.bin"), batch_size=6, block_size=16, vocab_size=500, device="cpu", seed=0)
    for _ in range(5):
        x, y = b.next_batch()
        assert x.shape == y.shape == (6, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y, strict=True):
            start = int(np.nonzero(data == row_x[0].item())[0][0])  # every window is a contiguous slice
            assert row_x.tolist() == data[start : start + 16].tolist()
            assert row_y.tolist() == data[start + 1 : start + 17].tolist()


def test_batches_reach_the_last_token_and_resume_exactly(tmp_path):
    data = np.arange(40, dtype=np.uint16)
    data.tofile(tmp_path / "train.bin")
    b = RandomBatches(str(tmp_path / "train.bin"), 64, 8, 40, "cpu", seed=1)
    seen = set()
    for _ in range(10):
        _, y = b.next_batch()
        seen |= set(y.flatten().tolist())
    assert max(seen) == 39 and min(seen) == 1
    state = b.state_dict()
    after = [b.next_batch()[0] for _ in range(3)]
    c = RandomBatches(str(tmp_path / "train.bin"), 64, 8, 40, "cpu", seed=999)
    c.load_state_dict(state)
    assert all(torch.equal(u, c.next_batch()[0]) for u in after)


def test_token_ids_beyond_vocab_are_an_error(tmp_path):
    np.array([1, 2, 3, 70, 5, 6, 7, 8, 9, 10] * 10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    b = RandomBatches(str(tmp_path / "train.bin"), 32, 8, vocab_size=65, device="cpu", seed=0)
    with pytest.raises(UserError, match=r"holds token id 70, but the model's vocab_size is 65"):
        b.next_batch()


def test_truncated_empty_and_short_token_files(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(UserError, match="3 bytes is not a whole number of uint16 tokens"):
        open_tokens(str(tmp_path / "odd.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(UserError, match="empty"):
        open_tokens(str(tmp_path / "empty.bin"))
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "short.bin")
    with pytest.raises(UserError, match="holds 10 tokens, not more than block_size=64"):
        RandomBatches(str(tmp_path / "short.bin"), 4, 64, 100, "cpu", seed=0)
    with pytest.raises(UserError, match="not found"):
        open_tokens(str(tmp_path / "none.bin"))


def test_missing_dataset_folder_says_how_to_make_it(tmp_path):
    with pytest.raises(UserError, match="gptforge prepare shakespeare_char"):
        dataset_dir(str(tmp_path), "shakespeare_char")


def test_nanogpt_meta_pkl_is_read(tmp_path):
    chars = sorted(set("hello world"))
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    got = read_meta(str(tmp_path))
    assert got["itos"] == chars and got["tokenizer"] == "char" and got["vocab_size"] == len(chars)
    assert from_spec(got).decode(from_spec(got).encode("hello")) == "hello"


class Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_meta_pkl_that_runs_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 3, "itos": Boom()}))
    with pytest.raises(UserError, match="refusing to load posix.system"):
        read_meta(str(tmp_path))
    assert not (tmp_path / "pwned").exists()


def test_bad_meta_json(tmp_path):
    (tmp_path / "meta.json").write_text('{"vocab_size": 65, "tokenizer": "char", "itos": ["a"]}')
    with pytest.raises(UserError, match="needs 'itos', a list of vocab_size=65"):
        read_meta(str(tmp_path))
    (tmp_path / "meta.json").write_text("{broken")
    with pytest.raises(UserError, match="meta.json: not readable JSON"):
        read_meta(str(tmp_path))


def test_folder_without_meta_is_nanogpt_gpt2_data(tmp_path):
    meta = read_meta(str(tmp_path))
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("gpt2", 50257, "uint16")
    np.array([464, 2068, 7586, 21831, 198, 50256], dtype=np.uint16).tofile(tmp_path / "train.bin")
    assert read_meta(str(tmp_path))["tokenizer"] == "gpt2"  # BPE ids: read as nanoGPT's GPT-2 data


def test_token_files_are_checked_against_the_meta(tmp_path):
    """Before training writes anything: a char folder that lost its meta, ids beyond vocab_size, wrong counts."""
    np.arange(40, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(UserError, match=r"no meta.json or meta.pkl.*below 256 \(largest 39\).*meta.json is missing"):
        read_meta(str(tmp_path))
    meta = {
        "vocab_size": 40,
        "tokenizer": "char",
        "itos": [chr(65 + i) for i in range(40)],
        "dtype": "uint16",
        "tokens": {"train": 40, "val": 10},
    }
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert read_meta(str(tmp_path))["vocab_size"] == 40
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "vocab_size": 30, "itos": meta["itos"][:30]}))
    with pytest.raises(UserError, match=r"train.bin holds token id 39, but .*meta.json gives vocab_size 30"):
        read_meta(str(tmp_path))
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))  # the files are uint16
    with pytest.raises(UserError, match=r"train.bin holds 20 train tokens of uint32, but .*meta.json records 40"):
        read_meta(str(tmp_path))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    np.arange(30, dtype=np.uint16).tofile(tmp_path / "train.bin")  # cut short
    with pytest.raises(UserError, match=r"holds 30 train tokens of uint16, but .*meta.json records 40"):
        read_meta(str(tmp_path))


def test_char_tokenizer_unknown_character_is_a_clear_error():
    tok = CharTokenizer.from_text("abc")
    assert tok.encode("cab") == [2, 0, 1] and tok.decode([2, 0, 1]) == "cab"
    with pytest.raises(UserError, match="character 'z' is not in this model's character vocabulary"):
        tok.encode("zap")
