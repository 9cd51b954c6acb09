"""Own byte-level BPE tokenizers (issue 26): training (tokenizer/train.py), encoding through tiktoken, the folder that
Hugging Face loads (tokenizer/bpe.py, hf_format.py), and every bad input as a UserError that writes nothing. Small
vocabularies on small text: each training takes well under a second."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SHAKESPEARE, need_shared
from gptforge.core.errors import UserError
from gptforge.tokenizer import bpe
from gptforge.tokenizer.bpe import PATTERN, BPETokenizer, load_tokenizer
from gptforge.tokenizer.spec import from_spec, tokenizer_spec
from gptforge.tokenizer.specials import BOS, SPECIALS
from gptforge.tokenizer.train import decode_ids, encode_text, token_texts, tokenizer_stats, train_tokenizer

# Text beyond Shakespeare's ASCII, so that multi-byte characters get merges of their own.
MIXED = (
    "日本語のテキストを書きます。東京は大きい都市です。中文的句子也在这里。한국어 문장도 있습니다.\n"
    "Ünïcödé façade naïve café — «quotes» and ‘curly’ ones… e\u0301 a\u0308\u0323\n"
    "Emoji: 🎉🎉 👩‍👩‍👧 🇫🇷🇩🇪 ❤️ 👍🏽 and numbers 3.14159 2025-11-24 1,234,567 0x7fff\n"
    "def encode(self, text: str) -> list[int]:\n    return [ord(c) for c in text]  # ok\n\n\n"
    "\tindented\ttabs\r\nwindows line\r\n    spaces    everywhere   \n"
)
# Hypothesis: any Unicode text except lone surrogates (which UTF-8 cannot hold), with special-token strings mixed in.
ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
TEXT_WITH_SPECIALS = st.lists(st.one_of(ANY_TEXT, st.sampled_from(SPECIALS)), max_size=6).map("".join)
VARIED = [
    "Hello, world! It's 9 o'clock; we'll see.",
    "日本語のテキスト。中文。한국어 and Ελληνικά, русский текст",
    "🎉👩‍👩‍👧🇫🇷 ❤️ e\u0301 a\u0308\u0323",
    "1234567890 3.14159 -42 1e-10 ١٢٣ ²³ Ⅻ",
    "   leading\n\n\n\ttabs  and   runs    of     spaces      \r\n\r\n",
    "def f(x):\n    if x > 0:\n        return x ** 2  # square\n    return {'a': [1, 2]}\n",
    "\x00\x01\x7f\x85\u2028\u00a0\u3000\ufeff\u200b",
    "",
    " ",
    "x" * 300,
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Tiny Shakespeare cut into a training part (first 90%) and a held-out part; a mixed-text file beside it."""
    root = tmp_path_factory.mktemp("corpus")
    text = need_shared(SHAKESPEARE).read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    (root / "train.txt").write_text(text[:cut], encoding="utf-8")
    (root / "held.txt").write_text(text[cut:], encoding="utf-8")
    (root / "mixed.txt").write_text(MIXED * 200 + text[:100_000], encoding="utf-8")
    return {"train": root / "train.txt", "held": root / "held.txt", "mixed": root / "mixed.txt", "root": root}


@pytest.fixture(scope="module")
def shakespeare_tok(corpus) -> tuple[BPETokenizer, str]:
    folder = train_tokenizer([str(corpus["train"])], 4096, "shk", out_root=str(corpus["root"] / "tokenizers"))
    return load_tokenizer(folder), folder


@pytest.fixture(scope="module")
def mixed_tok(corpus) -> tuple[BPETokenizer, str]:
    folder = train_tokenizer([str(corpus["mixed"])], 2048, "mixed", out_root=str(corpus["root"] / "tokenizers"))
    return load_tokenizer(folder), folder


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT_WITH_SPECIALS)
def test_round_trip_of_any_text(mixed_tok, text):
    tok, _ = mixed_tok
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert set(ids).isdisjoint(tok.specials.values()), "ordinary text never encodes to a special id"
    assert sum(tok.token_byte_lengths()[i] for i in ids) == len(text.encode("utf-8"))


@pytest.mark.parametrize("text", VARIED)
def test_round_trip_of_edge_cases(mixed_tok, shakespeare_tok, text):
    for tok, _ in (mixed_tok, shakespeare_tok):
        assert tok.decode(tok.encode(text)) == text
        assert tok.encode_batch([text, text]) == [tok.encode(text)] * 2


def test_special_token_strings_stay_text(mixed_tok):
    tok, _ = mixed_tok
    assert tok.vocab_size == 2048 and list(tok.specials) == list(SPECIALS)
    assert sorted(tok.specials.values()) == list(range(2048 - len(SPECIALS), 2048)), "specials take the top ids"
    assert tok.eot_token == tok.special_id(BOS) == 2048 - len(SPECIALS)
    for special in SPECIALS:
        text = f"before {special} after{special}"
        ids = tok.encode(text)
        assert set(ids).isdisjoint(tok.specials.values()) and tok.decode(ids) == text
        assert tok.special_id(special) not in tok.encode_batch([text])[0]
        assert tok.decode([tok.special_id(special)]) == special  # the id itself decodes to its string
        assert tok.token_byte_lengths()[tok.special_id(special)] == 0


def test_tiktoken_equals_the_trainer_and_hugging_face(corpus):
    """The three encoders hold the same merges: rustbpe's own encode, tiktoken (ours), tokenizer.json (HF)."""
    rustbpe = pytest.importorskip("rustbpe")
    tokenizers = pytest.importorskip("tokenizers")
    text = corpus["mixed"].read_bytes().decode("utf-8")  # read_text would turn \r\n into \n
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator([text], vocab_size=2048 - len(SPECIALS), pattern=PATTERN)
    ranks = [bytes(t) for t, _ in sorted(trainer.get_mergeable_ranks(), key=lambda pair: pair[1])]
    ours = BPETokenizer(ranks, "direct")
    folder = train_tokenizer([str(corpus["mixed"])], 2048, "again", out_root=str(corpus["root"] / "again"))
    assert load_tokenizer(folder).ranks == ranks, "train_tokenizer learns what rustbpe learns from the same text"
    hf = tokenizers.Tokenizer.from_file(os.path.join(folder, bpe.HF_FILE))
    held = corpus["held"].read_text(encoding="utf-8")
    for sample in [*VARIED, MIXED, held[:20_000], text[-5_000:]]:
        ids = ours.encode(sample)
        assert ids == trainer.encode(sample)
        assert ids == hf.encode(sample, add_special_tokens=False).ids
        assert hf.decode(ids, skip_special_tokens=False) == sample


def test_max_digits_cuts_numbers_alike_in_every_encoder(corpus, tmp_path):
    """--max_digits 1: every digit its own token, the pattern stored in the folder; tiktoken (ours), Hugging Face's
    tokenizer.json and a reload agree; the default keeps nanochat's runs of two."""
    tokenizers = pytest.importorskip("tokenizers")
    text = "".join(
        f"What is {a} + {b}? {a + b}.\n" for a, b in zip(range(100, 999, 7), range(999, 100, -7), strict=True)
    )
    (tmp_path / "sums.txt").write_text(text * 20 + corpus["mixed"].read_text(encoding="utf-8")[:50_000])
    folder = train_tokenizer([str(tmp_path / "sums.txt")], 512, "d1", out_root=str(tmp_path), max_digits=1)
    one = load_tokenizer(folder)
    assert one.pattern == bpe.split_pattern(1) and one.pattern != PATTERN
    pieces = [one.decode([i]) for i in one.encode("Compute 1234 + 567890.")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("1234567890")
    hf = tokenizers.Tokenizer.from_file(os.path.join(folder, bpe.HF_FILE))
    assert hf.encode(text, add_special_tokens=False).ids == one.encode(text) == load_tokenizer(folder).encode(text)
    two = load_tokenizer(train_tokenizer([str(tmp_path / "sums.txt")], 512, "d2", out_root=str(tmp_path)))
    assert max(len(two.decode([i])) for i in two.encode("1234567890") if two.decode([i]).isdigit()) == 2


def test_transformers_loads_the_folder(mixed_tok):
    transformers = pytest.importorskip("transformers")
    tok, folder = mixed_tok
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(auto) == tok.vocab_size
    assert auto.bos_token == auto.eos_token == BOS and auto.bos_token_id == tok.special_id(BOS)
    for text in [*VARIED, MIXED]:
        ids = auto(text)["input_ids"]
        assert ids == tok.encode(text), "no tokens added, the same ids"
        assert auto.decode(ids) == text
    # Hugging Face maps special strings to their ids (what a chat template needs); ours keeps them as text
    assert auto(f"{BOS}hi")["input_ids"] == [tok.special_id(BOS), *tok.encode("hi")]


def test_save_load_and_the_folder_files(mixed_tok, tmp_path):
    from tiktoken.load import load_tiktoken_bpe

    tok, folder = mixed_tok
    assert sorted(os.listdir(folder)) == sorted(bpe.FOLDER_FILES)
    meta = json.loads(Path(folder, bpe.GPTFORGE_FILE).read_text())
    assert meta["vocab_size"] == 2048 and meta["pattern"] == PATTERN and meta["specials"] == tok.specials
    assert meta["trainer"]["name"] == "rustbpe" and meta["corpus"]["files"] == 1
    ranks = load_tiktoken_bpe(os.path.join(folder, bpe.RANKS_FILE))
    assert ranks == {t: i for i, t in enumerate(tok.ranks)}
    assert json.loads(Path(folder, bpe.TOKEN_BYTES_FILE).read_text()) == tok.token_byte_lengths()
    tok.save(str(tmp_path / "copy"), model_max_length=256)
    again = BPETokenizer.load(str(tmp_path / "copy"))
    assert again.spec() == tok.spec() and again.info["corpus"] == tok.info["corpus"]
    assert json.loads((tmp_path / "copy" / bpe.HF_CONFIG_FILE).read_text())["model_max_length"] == 256
    assert again.encode(MIXED) == tok.encode(MIXED)


def test_spec_round_trip(mixed_tok):
    tok, _ = mixed_tok
    spec = json.loads(json.dumps(tok.spec()))  # plain JSON, as meta.json and checkpoints store it
    again = from_spec(spec)
    assert isinstance(again, BPETokenizer) and again.spec() == tok.spec()
    assert again.encode(MIXED) == tok.encode(MIXED) and again.vocab_size == tok.vocab_size
    assert tokenizer_spec({**spec, "vocab_size": tok.vocab_size, "dtype": "uint16"}) == spec
    with pytest.raises(UserError, match="damaged"):
        from_spec({**spec, "ranks": spec["ranks"][:10] + ["not base64!"]})
    with pytest.raises(UserError, match="single byte"):
        from_spec({**spec, "ranks": spec["ranks"][1:], "specials": {s: i - 1 for s, i in spec["specials"].items()}})


def test_compression_on_held_out_shakespeare(shakespeare_tok, corpus):
    """4,096 tokens learned on 90% of Tiny Shakespeare cut the other 10% into fewer tokens than GPT-2's 50,257."""
    pytest.importorskip("tiktoken")
    _, folder = shakespeare_tok
    stats = tokenizer_stats(folder, str(corpus["held"]))
    assert stats["gpt2_bytes_per_token"] is not None, stats.get("gpt2_note")
    assert stats["bytes_per_token"] >= stats["gpt2_bytes_per_token"], stats
    assert stats["char_bytes_per_token"] == 1.0 and stats["bytes"] == stats["characters"]  # Shakespeare is ASCII


def test_cli_helpers_resolve_names_and_folders(shakespeare_tok, corpus, monkeypatch):
    tok, folder = shakespeare_tok
    monkeypatch.chdir(corpus["root"])  # tokenizers/shk is the name "shk" from here
    ids = encode_text("shk", "To be, or not to be")
    assert ids == tok.encode("To be, or not to be") == encode_text(folder, "To be, or not to be")
    assert decode_ids("shk", [*ids, 10**6]) == "To be, or not to be"
    assert "".join(token_texts("shk", ids)) == "To be, or not to be"
    with pytest.raises(UserError, match="not found"):
        encode_text("nosuch", "x")


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "tokenizers"


@pytest.mark.parametrize(
    "case",
    ["empty", "small_vocab", "not_utf8", "missing_path", "bad_name", "too_little_text", "empty_folder", "max_chars"],
)
def test_bad_inputs_are_user_errors_that_write_nothing(case, tmp_path, out, corpus):
    good = str(corpus["mixed"])
    args: dict = {"paths": [good], "vocab_size": 512, "name": "bad", "out_root": str(out)}
    expect = {
        "empty": ("holds no text", {"paths": [_write(tmp_path / "empty.txt", b"")]}),
        "small_vocab": ("--vocab_size 266", {"vocab_size": 266}),
        "not_utf8": ("latin1.txt: not UTF-8", {"paths": [good, _write(tmp_path / "latin1.txt", b"caf\xe9 " * 99)]}),
        "missing_path": ("nowhere.txt", {"paths": [str(tmp_path / "nowhere.txt")]}),
        "bad_name": ("--name", {"name": "../escape"}),
        "too_little_text": ("too little distinct text", {"paths": [_write(tmp_path / "tiny.txt", b"ab ab")]}),
        "empty_folder": ("holds no text files", {"paths": [str(_mkdir(tmp_path / "nothing"))]}),
        "max_chars": ("--max_chars", {"max_chars": 0}),
    }
    match, change = expect[case]
    with pytest.raises(UserError, match=match):
        train_tokenizer(**{**args, **change})
    assert not out.exists(), f"{case}: nothing is written, not even {out}"


def test_an_existing_name_needs_force(tmp_path, out, corpus):
    folder = train_tokenizer([str(corpus["mixed"])], 300, "mine", out_root=str(out))
    before = {p: Path(folder, p).read_bytes() for p in os.listdir(folder)}
    with pytest.raises(UserError, match="--force"):
        train_tokenizer([str(corpus["train"])], 400, "mine", out_root=str(out))
    assert {p: Path(folder, p).read_bytes() for p in os.listdir(folder)} == before
    with pytest.raises(UserError, match="not UTF-8"):  # a failed --force run leaves the old tokenizer whole
        train_tokenizer([_write(tmp_path / "bin.txt", b"\xff\xfe")], 400, "mine", out_root=str(out), force=True)
    assert {p: Path(folder, p).read_bytes() for p in os.listdir(folder)} == before
    train_tokenizer([str(corpus["train"])], 400, "mine", out_root=str(out), force=True)
    assert load_tokenizer(folder).vocab_size == 400 and os.listdir(out) == ["mine"], "no temporaries left"
    _mkdir(out / "notatokenizer")
    with pytest.raises(UserError, match="no tokenizer folder"):
        train_tokenizer([str(corpus["train"])], 400, "notatokenizer", out_root=str(out), force=True)


def test_folders_records_and_caps(tmp_path, out):
    src = _mkdir(tmp_path / "src")
    _write(src / "a.md", b"# Title\n\nSome *markdown* text. " * 50)
    _write(src / "b.py", b"def f(x):\n    return x + 1\n" * 50)
    _write(src / "skip.bin", b"\xff\x00 binary, not read")
    _write(src / ".hidden.txt", b"\xff not read either")
    rows = [json.dumps({"text": f"record {i}: " + "word " * 40}) for i in range(30)]
    _write(src / "c.jsonl", "\n".join(rows).encode())
    folder = train_tokenizer([str(src)], 280, "docs", out_root=str(out), doc_chars=100)
    corpus = load_tokenizer(folder).info["corpus"]
    assert corpus["files"] == 3 and corpus["documents"] == 32 and corpus["characters"] == 32 * 100
    folder = train_tokenizer([str(src)], 270, "capped", out_root=str(out), max_chars=1000)
    corpus = load_tokenizer(folder).info["corpus"]
    assert corpus["characters"] == 1000 and corpus["stopped_at_max_chars"]


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path
