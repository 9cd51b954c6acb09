"""Train an own byte-level BPE tokenizer on local text, and look at one (issue 26).

    train_tokenizer(["notes/", "book.txt"], vocab_size=4096, name="mine")   # -> tokenizers/mine/
    tokenizer_stats("mine", "held_out.txt")                                 # bytes per token, ours and GPT-2's

The documents of files and folders stream into rustbpe (measured against Hugging Face tokenizers and bpeasy: the
same merges in about half their time; docs/lab/2026-11-24-tokenizer.md), which learns the merges with the split pattern
(bpe.split_pattern) that the tokenizer then stores and encodes with; memory grows with the distinct text pieces,
not with the input's size. The folder is assembled under a temporary name and renamed into place, so a failed or
interrupted run writes nothing. The CLI (`gptforge tokenizer train|stats|encode|decode`) calls these.
"""

from __future__ import annotations

import codecs
import os
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import Any

from gptforge.core.console import log, progress
from gptforge.core.errors import UserError
from gptforge.core.files import fsync_path, temp_path
from gptforge.data.sources import iter_jsonl, iter_parquet
from gptforge.tokenizer.bpe import GPTFORGE_FILE, MAX_DIGITS, BPETokenizer, load_tokenizer, split_pattern
from gptforge.tokenizer.spec import BUILT_IN
from gptforge.tokenizer.specials import SPECIALS

# A folder contributes the files with these endings; a file named on its own is read whatever its name.
TEXT_EXTENSIONS = (
    ".txt",
    ".md",
    ".markdown",
    ".rst",
    ".tex",
    ".py",
    ".pyi",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".rs",
    ".go",
    ".java",
    ".js",
    ".ts",
    ".html",
    ".css",
    ".sh",
    ".toml",
    ".yaml",
    ".yml",
)
RECORD_EXTENSIONS = (".jsonl", ".jsonl.gz", ".parquet")  # one document per record, its text field
MIN_VOCAB = 256 + len(SPECIALS)  # every byte, then the reserved specials
MAX_CHARS = 1_000_000_000  # default cap on the characters read: about 10 minutes on 2 cores
PIECE_CHARS = 1 << 18  # a long document reaches the trainer in pieces of about this many characters (cut at lines)
TRAINER_BUFFER = 1024  # pieces the trainer holds at once: with PIECE_CHARS, at most ~256 M characters
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def train_tokenizer(
    paths: Sequence[str],
    vocab_size: int,
    name: str,
    out_root: str = "tokenizers",
    max_chars: int | None = MAX_CHARS,
    doc_chars: int | None = None,
    force: bool = False,
    text_field: str = "text",
    max_digits: int = MAX_DIGITS,
) -> str:
    """Train a byte-level BPE of `vocab_size` ids (the 256 bytes, the learned merges, then the reserved specials) on
        the text of `paths` and write it to `<out_root>/<name>/`; returns that folder.

        paths: files or folders. .jsonl / .jsonl.gz / .parquet files give one document per record (`text_field`); any
        other file is one UTF-8 document; a folder gives its files with TEXT_EXTENSIONS or RECORD_EXTENSIONS, sorted,
        recursively. max_chars caps the characters read in all (None: no cap), doc_chars those of each document.
    max_digits: numbers are cut into runs of at most this many digits before merging (bpe.split_pattern).
        An existing tokenizer folder is replaced only with force=True. Every mistake is a UserError naming the flag or
        file, raised before anything is written.
    """
    folder = _check_request(paths, vocab_size, name, out_root, max_chars, doc_chars, force)
    if max_digits not in (1, 2, 3):
        raise UserError(f"--max_digits {max_digits}: give 1 (a token per digit), 2 (nanochat's) or 3 (GPT-4's)")
    pattern = split_pattern(max_digits)
    files = input_files(paths)
    corpus = Corpus(files, max_chars, doc_chars, text_field)
    start = time.perf_counter()
    ranks = _learn_ranks(corpus.documents(), vocab_size - len(SPECIALS), pattern)
    seconds = time.perf_counter() - start
    if corpus.chars == 0:
        raise UserError(f"the input holds no text ({corpus.describe()}); give files with text in them")
    if len(ranks) + len(SPECIALS) < vocab_size:
        raise UserError(
            f"--vocab_size {vocab_size}: the input ({corpus.describe()}) has too little distinct text for more than "
            f"{len(ranks) + len(SPECIALS)} tokens; give more text or a --vocab_size of at most that"
        )
    info = {"trainer": _trainer_info(seconds), "corpus": corpus.summary()}
    tokenizer = BPETokenizer(ranks, name, pattern, info=info)
    _write_folder(tokenizer, folder)
    log(f"tokenizer {name!r}: {tokenizer.vocab_size} tokens from {corpus.describe()} in {seconds:.1f} s -> {folder}")
    return folder


def tokenizer_stats(tokenizer: str, file: str, root: str = "tokenizers") -> dict[str, Any]:
    """Bytes per token of the own tokenizer `tokenizer` (a name under `root` or a folder) on a UTF-8 `file`, beside
    GPT-2's BPE (tiktoken; None when its files cannot be loaded offline, with the reason) and a character-level
    vocabulary (bytes per character: 1.0 on ASCII text). Higher is better: fewer tokens for the same text."""
    ours = load_tokenizer(tokenizer, root)
    gpt2, gpt2_note = _gpt2_or_reason()
    n_bytes = n_chars = n_ours = n_gpt2 = 0
    for piece in _text_pieces(file, None):
        n_bytes += len(piece.encode("utf-8"))
        n_chars += len(piece)
        n_ours += len(ours.encode(piece))
        n_gpt2 += len(gpt2.encode(piece)) if gpt2 else 0
    if n_bytes == 0:
        raise UserError(f"{file}: empty; give a file with text to measure")
    stats = {
        "file": file,
        "bytes": n_bytes,
        "characters": n_chars,
        "tokenizer": ours.name,
        "vocab_size": ours.vocab_size,
        "tokens": n_ours,
        "bytes_per_token": n_bytes / n_ours,
        "gpt2_tokens": n_gpt2 if gpt2 else None,
        "gpt2_bytes_per_token": n_bytes / n_gpt2 if gpt2 else None,
        "char_bytes_per_token": n_bytes / n_chars,
    }
    if gpt2_note:
        stats["gpt2_note"] = gpt2_note
    return stats


def encode_text(tokenizer: str, text: str, root: str = "tokenizers") -> list[int]:
    """`text` as ids of the own tokenizer `tokenizer` (special-token strings stay text)."""
    return load_tokenizer(tokenizer, root).encode(text)


def decode_ids(tokenizer: str, ids: Sequence[int], root: str = "tokenizers") -> str:
    """The text of `ids` (ids past the vocabulary dropped, special tokens as their strings)."""
    return load_tokenizer(tokenizer, root).decode(list(ids))


def token_texts(tokenizer: str, ids: Sequence[int], root: str = "tokenizers") -> list[str]:
    """Each id's own text, to show where a text was cut (bytes short of a UTF-8 character as \\x.. escapes)."""
    tok = load_tokenizer(tokenizer, root)
    return [tok.token_bytes(i).decode("utf-8", "backslashreplace") if 0 <= i < tok.vocab_size else "" for i in ids]


def input_files(paths: Sequence[str]) -> list[str]:
    """The files to read, in the order given; a folder contributes its text and record files, sorted, recursively
    (hidden folders and files skipped)."""
    if not paths:
        raise UserError("no input: give files or folders of text to train the tokenizer on")
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in sorted(names) if _wanted(n)]
            if not found:
                endings = ", ".join(TEXT_EXTENSIONS + RECORD_EXTENSIONS)
                raise UserError(f"folder {path!r} holds no text files ({endings}); give files or another folder")
            files += found
        elif not os.path.exists(path):
            raise UserError(f"input {path!r} not found; give existing files or folders")
        elif not os.access(path, os.R_OK):
            raise UserError(f"{path}: not readable (permission denied); fix its permissions")
        else:
            files.append(path)
    return files


class Corpus:
    """The training documents of `files`, streamed under the caps, with a progress bar and counts for the record."""

    def __init__(self, files: list[str], max_chars: int | None, doc_chars: int | None, text_field: str):
        self.files, self.max_chars, self.doc_chars, self.text_field = files, max_chars, doc_chars, text_field
        self.chars = self.documents_read = self.files_read = 0
        self.truncated = False

    def documents(self) -> Iterator[str]:
        """Pieces of documents: a long document is cut at line ends into pieces of ~PIECE_CHARS characters."""
        sizes = sum(os.path.getsize(f) for f in self.files)
        total = min(sizes, self.max_chars) if self.max_chars else sizes
        bar = progress(total, "reading text", "B", unit_scale=True, unit_divisor=1000)
        try:
            yield from self._pieces(bar)
        finally:
            bar.close()
        if self.truncated:
            log(f"stopped reading at --max_chars {self.max_chars:,} characters")
        log(f"learning merges from {self.describe()} (no progress is shown for this part)")

    def _pieces(self, bar: Any) -> Iterator[str]:
        for path in self.files:
            self.files_read += 1
            for document in self._file_documents(path):
                self.documents_read += 1
                for piece in document:
                    if self.max_chars is not None and self.chars + len(piece) > self.max_chars:
                        piece, self.truncated = piece[: self.max_chars - self.chars], True
                    self.chars += len(piece)
                    bar.update(len(piece.encode("utf-8")))
                    yield piece
                    if self.truncated:
                        return

    def _file_documents(self, path: str) -> Iterator[Iterator[str]]:
        if path.endswith(RECORD_EXTENSIONS):
            reader = iter_parquet if path.endswith(".parquet") else iter_jsonl
            for text in reader(path, self.text_field):
                yield _cut(text[: self.doc_chars] if self.doc_chars else text)
        else:
            yield _text_pieces(path, self.doc_chars)

    def describe(self) -> str:
        shown = ", ".join(self.files[:3]) + (f" and {len(self.files) - 3} more files" if len(self.files) > 3 else "")
        return f"{self.chars:,} characters of {shown}"

    def summary(self) -> dict[str, Any]:
        return {
            "files": len(self.files),
            "paths": self.files[:20],
            "files_read": self.files_read,
            "documents": self.documents_read,
            "characters": self.chars,
            "max_chars": self.max_chars,
            "doc_chars": self.doc_chars,
            "stopped_at_max_chars": self.truncated,
        }


def _text_pieces(path: str, doc_chars: int | None) -> Iterator[str]:
    """A UTF-8 file's text in pieces of about PIECE_CHARS characters, cut after a line end where there is one,
    stopping after doc_chars characters; bytes that are not UTF-8 are a UserError naming the file and the place."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, left, rest = 0, doc_chars, ""
    try:
        with open(path, "rb") as fh:
            while True:
                block = fh.read(PIECE_CHARS)
                try:
                    rest += decoder.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    raise UserError(
                        f"{path}: not UTF-8 text (near byte {offset + e.start:,}: {e.reason}); convert it to UTF-8 "
                        "or leave it out"
                    ) from None
                offset += len(block)
                if block and len(rest) < PIECE_CHARS:
                    continue
                cut = (rest.rfind("\n", 0, 2 * PIECE_CHARS) + 1 or len(rest)) if block else len(rest)
                piece, rest = rest[:cut], rest[cut:]
                if left is not None:
                    piece, left = piece[:left], left - min(left, len(piece))
                if piece:
                    yield piece
                if not block or left == 0:
                    return
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None


def _cut(text: str) -> Iterator[str]:
    """A record's text in pieces of about PIECE_CHARS characters, cut after line ends."""
    while len(text) > PIECE_CHARS * 2:
        cut = text.rfind("\n", 0, PIECE_CHARS * 2) + 1 or PIECE_CHARS
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def _learn_ranks(documents: Iterator[str], n_ranks: int, pattern: str) -> list[bytes]:
    """rustbpe's byte-level BPE on the documents: the 256 bytes, then one token per merge, in rank order."""
    import rustbpe

    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(documents, vocab_size=n_ranks, buffer_size=TRAINER_BUFFER, pattern=pattern)
    pairs = sorted(trainer.get_mergeable_ranks(), key=lambda pair: pair[1])
    assert [rank for _, rank in pairs] == list(range(len(pairs))), "rustbpe's ranks are not 0..n-1"
    return [bytes(token) for token, _ in pairs]


def _check_request(paths, vocab_size, name, out_root, max_chars, doc_chars, force) -> str:
    """The flags' mistakes, before any reading; returns the target folder."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise UserError(
            f"--vocab_size {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB} tokens (256 bytes + "
            f"{len(SPECIALS)} special tokens); give a larger --vocab_size (e.g. 4096 or 32768)"
        )
    for flag, value in (("--max_chars", max_chars), ("--doc_chars", doc_chars)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} {value}: give a positive number of characters (or leave it out)")
    if not NAME.fullmatch(name or ""):
        raise UserError(f"--name {name!r}: use letters, digits, '.', '_' and '-' only (it names {out_root}/NAME)")
    if name in BUILT_IN:
        raise UserError(f"--name {name}: {name!r} means the built-in tokenizer to --tokenizer; choose another name")
    folder = os.path.join(out_root, name)
    if os.path.lexists(folder):
        if not force:
            raise UserError(f"tokenizer {name!r} already exists ({folder}); pass --force to replace it or a new --name")
        if not os.path.isfile(os.path.join(folder, GPTFORGE_FILE)):
            raise UserError(f"{folder} exists but is no tokenizer folder (--force replaces only tokenizers); move it")
    return folder


def _write_folder(tokenizer: BPETokenizer, folder: str) -> None:
    """Assemble the folder under a temporary name, then rename it into place (an old one moved aside first)."""
    root = os.path.dirname(os.path.abspath(folder))
    tmp, old = temp_path(folder), temp_path(folder) + ".old"
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer.save(tmp)
        if os.path.lexists(folder):
            os.replace(folder, old)
        os.replace(tmp, folder)
        fsync_path(root)
    except OSError as e:
        raise UserError(f"cannot write {folder}: {e.strerror or e}; check the folder and its free space") from None
    finally:  # interrupted between the two renames: the old tokenizer goes back
        if os.path.lexists(old) and not os.path.lexists(folder):
            os.replace(old, folder)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _trainer_info(seconds: float) -> dict[str, Any]:
    from importlib.metadata import version

    return {"name": "rustbpe", "version": version("rustbpe"), "seconds": round(seconds, 2)}


def _gpt2_or_reason():
    from gptforge.tokenizer.gpt2 import GPT2Tokenizer

    try:
        return GPT2Tokenizer(), None
    except UserError as e:
        return None, str(e)


def _wanted(name: str) -> bool:
    return not name.startswith(".") and name.endswith(TEXT_EXTENSIONS + RECORD_EXTENSIONS)
