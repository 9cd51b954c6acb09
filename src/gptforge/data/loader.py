"""Reading prepared datasets: the meta (meta.json, or nanoGPT's meta.pkl) and batches of token windows, drawn at
random (RandomBatches, nanoGPT) or in order (ShardedBatches, build-nanogpt). Formats: docs/ARCHITECTURE.md "Files"."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import numpy as np
import torch

from gptforge.core.errors import UserError
from gptforge.tokenizer.gpt2 import GPT2_EOT, GPT2_VOCAB

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dataset_dir(data_dir: str, dataset: str) -> str:
    folder = os.path.join(data_dir, dataset)
    if not os.path.isdir(folder):
        raise UserError(
            f"dataset folder {folder!r} not found: create it with `gptforge prepare {dataset}` "
            "(or `gptforge prepare text FILE --name NAME`), or point --data_dir / --dataset at an existing one"
        )
    return folder


def read_meta(folder: str) -> dict[str, Any]:
    """The dataset's meta: vocab_size, tokenizer ('char' + itos, or 'gpt2'), dtype, eot_token.

    meta.json first; else nanoGPT's meta.pkl (char-level); else nanoGPT's GPT-2 BPE default.

    The token files present are checked against it (see _check_token_files), so a meta that does not belong
    to them is an error here, before training writes anything.
    """
    path = os.path.join(folder, "meta.json")
    pkl = os.path.join(folder, "meta.pkl")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not readable JSON ({e}); re-run `gptforge prepare`") from None
        if isinstance(meta, dict) and meta.get("format") == "chat":
            return meta  # packed conversations: their arrays are checked when a loader opens them (chat.pack)
        _check_meta(meta, path)
    elif os.path.isfile(pkl):
        meta, path = _read_meta_pkl(pkl), pkl
    else:
        meta, path = {"vocab_size": GPT2_VOCAB, "tokenizer": "gpt2", "dtype": "uint16", "eot_token": GPT2_EOT}, None
    _check_token_files(folder, meta, path)
    return meta


def _check_meta(meta: Any, path: str) -> None:
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] <= 0:
        raise UserError(f"{path}: needs a positive integer 'vocab_size'; re-run `gptforge prepare`")
    if meta.get("tokenizer") not in ("char", "gpt2", "bpe"):
        raise UserError(f"{path}: 'tokenizer' must be 'char', 'gpt2' or 'bpe', got {meta.get('tokenizer')!r}")
    if meta.get("dtype", "uint16") not in DTYPES:
        raise UserError(f"{path}: 'dtype' must be one of {', '.join(DTYPES)}, got {meta.get('dtype')!r}")
    if meta["tokenizer"] == "char":
        itos = meta.get("itos")
        if not isinstance(itos, list) or len(itos) != meta["vocab_size"]:
            raise UserError(f"{path}: a char dataset needs 'itos', a list of vocab_size={meta['vocab_size']} chars")
    if meta["tokenizer"] == "bpe":  # an own BPE: its spec (from_spec rebuilds it), the ranks and specials
        ranks, specials = meta.get("ranks"), meta.get("specials")
        if (
            not isinstance(ranks, list)
            or not isinstance(specials, dict)
            or len(ranks) + len(specials) != meta["vocab_size"]
        ):
            raise UserError(
                f"{path}: a bpe dataset needs its tokenizer's 'name', 'pattern', 'ranks' and 'specials' "
                f"(vocab_size={meta['vocab_size']} tokens in all); re-run `gptforge prepare`"
            )
    meta.setdefault("dtype", "uint16")


CHECK_TOKENS = 1 << 20  # token ids read per split by _check_token_files: the whole file when smaller


def _check_token_files(folder: str, meta: dict[str, Any], meta_path: str | None) -> None:
    """Do the split files fit the meta? Their sizes against its token counts, and a bounded read of their ids
    (the whole file up to CHECK_TOKENS, else 16 chunks spread over it) against its vocab_size. Without any meta
    (read as GPT-2 BPE), ids all below 256 mean a char-level folder that lost its meta.json. Files that are
    missing or not whole tokens are left to open_tokens, which names them."""
    dtype = DTYPES[meta["dtype"]]
    itemsize = np.dtype(dtype).itemsize
    where = meta_path or f"{folder} (no meta.json or meta.pkl: read as nanoGPT's GPT-2 BPE data)"
    tops = []
    for split in ("train", "val"):
        names = (meta.get("shards") or {}).get(split) or [f"{split}.bin"]
        paths = [os.path.join(folder, n) for n in names if isinstance(n, str)]
        if not all(os.path.isfile(p) for p in paths) or any(os.path.getsize(p) % itemsize for p in paths):
            continue
        count = sum(os.path.getsize(p) for p in paths) // itemsize
        recorded = (meta.get("tokens") or {}).get(split)
        if isinstance(recorded, int) and count and recorded != count:  # an empty file: open_tokens says so
            raise UserError(
                f"{paths[0] if len(paths) == 1 else folder} holds {count:,} {split} tokens of {meta['dtype']}, but "
                f"{where} records {recorded:,}: a file was cut short or replaced, or the meta belongs to other "
                "files. Re-run `gptforge prepare` for this dataset"
            )
        if count == 0:
            continue
        first = next(p for p in paths if os.path.getsize(p))  # the first non-empty file of the split
        data = np.memmap(first, dtype=dtype, mode="r")
        if len(data) <= CHECK_TOKENS:
            top = int(data.max())
        else:
            chunk = CHECK_TOKENS // 16
            top = max(int(data[s : s + chunk].max()) for s in np.linspace(0, len(data) - chunk, 16).astype(np.int64))
        if top >= meta["vocab_size"]:
            raise UserError(
                f"{first} holds token id {top}, but {where} gives vocab_size {meta['vocab_size']} "
                f"({meta['dtype']} tokens): the token files and the meta do not belong together. Re-run "
                "`gptforge prepare` for this dataset"
            )
        tops.append(top)
    if meta_path is None and tops and max(tops) < 256:
        raise UserError(
            f"{folder} has no meta.json or meta.pkl, so it would be read as GPT-2 BPE data, but its token ids are "
            f"all below 256 (largest {max(tops)}): it looks like a char-level dataset whose meta.json is missing. "
            "Put its meta.json back, or re-run `gptforge prepare` for this dataset"
        )


class _NoObjects(pickle.Unpickler):
    """Unpickles plain containers only: dict, list, str, int need no classes, so any class lookup is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: meta.pkl may hold only dicts, str and int")


def _read_meta_pkl(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = _NoObjects(fh).load()
    except Exception as e:  # any unpickling failure is the file's fault, never a reason to run its code
        raise UserError(f"{path}: not a plain nanoGPT meta.pkl ({e})") from None
    itos = raw.get("itos") if isinstance(raw, dict) else None
    ok = isinstance(raw.get("vocab_size") if isinstance(raw, dict) else None, int) and isinstance(itos, dict)
    if not ok or sorted(itos) != list(range(len(itos))) or not all(isinstance(c, str) for c in itos.values()):
        raise UserError(f"{path}: expected nanoGPT's {{'vocab_size': int, 'itos': {{int: str}}, 'stoi': ...}}")
    meta = {"vocab_size": raw["vocab_size"], "tokenizer": "char", "itos": [itos[i] for i in range(len(itos))]}
    _check_meta(meta, path)
    return meta


def open_tokens(path: str, dtype: str = "uint16") -> np.memmap:
    """A read-only view of a token file, checked for being whole tokens."""
    if not os.path.isfile(path):
        raise UserError(f"token file {path!r} not found; run `gptforge prepare` for this dataset")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise UserError(
            f"{path}: {size} bytes is not a whole number of {dtype} tokens; the file is truncated or "
            "not this dataset's format. Re-run `gptforge prepare`"
        )
    if size == 0:
        raise UserError(f"{path} is empty; re-run `gptforge prepare` with more text")
    return np.memmap(path, dtype=DTYPES[dtype], mode="r")


class RandomBatches:
    """nanoGPT's get_batch: each batch is batch_size windows of block_size + 1 tokens at random offsets.

    A fresh memmap per batch (numpy memmaps hold on to pages otherwise); one vectorised fancy-index read.

    Offsets come from torch's global generator, as in nanoGPT, so a run draws exactly the batches nanoGPT
    draws for the same seed and reproduces its losses. The loader's resumable state is then that generator's
    state before the next draw (state_dict); with `seed`, a private generator is used instead.
    """

    def __init__(
        self,
        path: str,
        batch_size: int,
        block_size: int,
        vocab_size: int,
        device: str,
        seed: int | None = None,
        dtype: str = "uint16",
    ):
        self.path, self.dtype = path, dtype
        self.batch_size, self.block_size, self.vocab_size = batch_size, block_size, vocab_size
        self.device = torch.device(device)
        self.n_tokens = len(open_tokens(path, dtype))
        if self.n_tokens <= block_size:
            raise UserError(
                f"{path} holds {self.n_tokens} tokens, not more than block_size={block_size}; "
                "use a smaller --block_size or more data"
            )
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.offsets = np.arange(block_size + 1, dtype=np.int64)  # (T+1,)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        ix = torch.randint(self.n_tokens - self.block_size, (self.batch_size,), generator=self.generator)
        windows = data[ix.numpy()[:, None] + self.offsets]  # (B, T+1), one gather from the page cache
        top = int(windows.max())
        if top >= self.vocab_size:
            raise UserError(
                f"{self.path} holds token id {top}, but the model's vocab_size is {self.vocab_size}: the data "
                "and the model do not match. Re-run `gptforge prepare`, or check the dataset's meta.json"
            )
        buf = torch.from_numpy(windows.astype(np.int64))  # (B, T+1)
        x, y = buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # (B, T) each
        if self.device.type == "cuda":
            # Page-locked host memory lets the copy overlap with the GPU's work on the previous batch.
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        """Where the batch sequence stands: the generator's state before the next draw."""
        state = self.generator.get_state() if self.generator is not None else torch.get_rng_state()
        return {"kind": "random", "generator": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sequence; with the global generator this sets torch's global RNG state."""
        assert state.get("kind") == "random", f"data state of kind {state.get('kind')!r} given to RandomBatches"
        generator_state = state["generator"].cpu()  # a checkpoint loaded onto a GPU holds it there
        if self.generator is not None:
            self.generator.set_state(generator_state)
        else:
            torch.set_rng_state(generator_state)


def split_files(folder: str, split: str, meta: dict[str, Any]) -> list[str]:
    """The token files of a split in order: meta.json's shard list, else `<split>.bin`, else `*_<split>_NNNNNN.bin`."""
    names = (meta.get("shards") or {}).get(split)
    if names:
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, f"{split}.bin")
    if os.path.isfile(single):
        return [single]
    marker = f"_{split}_"
    found = sorted(n for n in os.listdir(folder) if marker in n and n.endswith(".bin") and n[-10:-4].isdigit())
    if not found:
        raise UserError(f"{folder}: no {split}.bin and no *_{split}_NNNNNN.bin shards; run `gptforge prepare`")
    return [os.path.join(folder, n) for n in found]


class ShardedBatches:
    """build-nanogpt's sequential loader, made rank-aware and resumable.

    The windows (block_size + 1 tokens, consecutive windows sharing one token) of all shards form one global
    order per epoch: shards in an order shuffled with seed + epoch, each read front to back. Optimizer step s
    takes the next `global_micro * batch_size` windows, global_micro = micro-batches per step summed over
    ranks; rank r's micro-step m reads the batch_size windows at (m * world_size + r) * batch_size in it. So
    a step consumes the same windows whatever the world size, ranks never read the same window, and every
    window of an epoch is read once. The whole state is how many batches this rank has drawn.
    """

    def __init__(
        self,
        files: list[str],
        batch_size: int,
        block_size: int,
        vocab_size: int,
        device: str,
        micro_per_rank: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 1337,
        dtype: str = "uint16",
    ):
        assert 0 <= rank < world_size and micro_per_rank > 0, "0 <= rank < world_size, micro_per_rank > 0"
        self.files, self.dtype = files, dtype
        self.batch_size, self.block_size, self.vocab_size = batch_size, block_size, vocab_size
        self.device = torch.device(device)
        self.micro, self.rank, self.world, self.seed = micro_per_rank, rank, world_size, seed
        self.windows = np.array([(len(open_tokens(f, dtype)) - 1) // block_size for f in files], dtype=np.int64)
        if self.windows.sum() < batch_size * world_size:
            raise UserError(
                f"{os.path.dirname(files[0]) or '.'}: {int(self.windows.sum())} windows of block_size={block_size} "
                f"in {len(files)} file(s), fewer than one batch of all ranks ({batch_size} x {world_size}); use a "
                "smaller --block_size or --batch_size, or more data"
            )
        self.per_epoch = int(self.windows.sum())
        self.calls = 0
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None

    def _epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, cumulative window counts in that order) for an epoch."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
            self._epoch_cache = (epoch, order, np.cumsum(self.windows[order]))
        return self._epoch_cache[1], self._epoch_cache[2]

    def window_indices(self, call: int) -> np.ndarray:
        """Global window numbers (B,) of this rank's `call`-th batch."""
        step, micro = divmod(call, self.micro)
        per_step = self.micro * self.world * self.batch_size
        start = step * per_step + (micro * self.world + self.rank) * self.batch_size
        return np.arange(start, start + self.batch_size, dtype=np.int64)

    def locate(self, window: int) -> tuple[int, int]:
        """(file index, first token) of a global window number."""
        epoch, index = divmod(int(window), self.per_epoch)
        order, cum = self._epoch_layout(epoch)
        pos = int(np.searchsorted(cum, index, side="right"))
        before = int(cum[pos - 1]) if pos else 0
        return int(order[pos]), (index - before) * self.block_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        mapped: dict[int, np.memmap] = {}
        for window in self.window_indices(self.calls):
            f, start = self.locate(window)
            if f not in mapped:
                mapped[f] = np.memmap(self.files[f], dtype=DTYPES[self.dtype], mode="r")
            rows.append(mapped[f][start : start + self.block_size + 1])
        self.calls += 1
        windows = np.stack(rows)  # (B, T+1)
        top = int(windows.max())
        if top >= self.vocab_size:
            raise UserError(
                f"{os.path.dirname(self.files[0]) or '.'} holds token id {top}, but the model's vocab_size is "
                f"{self.vocab_size}: the data and the model do not match. Re-run `gptforge prepare`"
            )
        buf = torch.from_numpy(windows.astype(np.int64))
        x, y = buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # (B, T) each
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "sharded", "calls": self.calls, "world_size": self.world, "micro": self.micro}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state.get("kind") == "sharded", f"data state of kind {state.get('kind')!r} given to ShardedBatches"
        if (state["world_size"], state["micro"]) != (self.world, self.micro):
            # same global position, other split: count the steps done, then map them onto this layout
            steps = state["calls"] // state["micro"]
            self.calls = steps * self.micro
        else:
            self.calls = int(state["calls"])


Batches = RandomBatches | ShardedBatches


def make_batches(
    folder: str,
    meta: dict[str, Any],
    split: str,
    kind: str,
    batch_size: int,
    block_size: int,
    vocab_size: int,
    device: str,
    seed: int,
    global_rng: bool = False,
    micro_per_rank: int = 1,
    rank: int = 0,
    world_size: int = 1,
    train_on: str = "assistant",
) -> Batches:
    """The loader of one split. Random: offsets from a private generator seeded with `seed`, or with `global_rng`
    from torch's global generator (training: nanoGPT's stream). Sharded: `seed` shuffles the shards per epoch,
    and the ranks read disjoint parts of one global order."""
    if kind == "chat":
        from gptforge.data.chat_batches import ChatBatches

        return ChatBatches(
            folder, meta, split, batch_size, vocab_size, device, seed, micro_per_rank, rank, world_size, train_on
        )
    if kind == "sharded":
        return ShardedBatches(
            split_files(folder, split, meta),
            batch_size,
            block_size,
            vocab_size,
            device,
            micro_per_rank,
            rank,
            world_size,
            seed,
            meta["dtype"],
        )
    return RandomBatches(
        os.path.join(folder, f"{split}.bin"),
        batch_size,
        block_size,
        vocab_size,
        device,
        seed=None if global_rng else seed,
        dtype=meta["dtype"],
    )
