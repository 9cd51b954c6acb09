"""Batches of a chat dataset (`gptforge prepare chat`: packed rows of block_size + 1 tokens, a 0/1 mask of the
trained targets, each row's document boundaries) for supervised fine-tuning.

A micro-batch is (X, Y, P, w): inputs, targets (-1 where the mask says "not trained": system and user turns, role
tokens, padding), each token's position inside its own document (positions restart at every document, and the
model lets a token see only its own document: packed conversations never attend to each other), and w, what the
summed loss of the micro-batch's trained targets is multiplied by so that a step's loss is the mean over every
trained target of the whole step (all micro-batches, all ranks), not a mean of per-micro-batch means. A
micro-batch with no trained target adds 0 to the loss and to the gradients. With sft_loss='all' (a comparison, not
a recipe) every target inside a conversation is trained, user turns and role tokens included, as pretraining would.

Order: every epoch a permutation of the rows (seeded with seed + epoch); step s reads the next accum x world x
batch rows of it; rank r's micro-step m takes the batch at (m * world_size + r) * batch_size, so a step reads the
same rows for any number of processes, and the state is one counter (exact resume, any world size)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gptforge.chat.pack import read_packed
from gptforge.core.errors import UserError

ChatBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]


class ChatBatches:
    def __init__(
        self,
        folder: str,
        meta: dict[str, Any],
        split: str,
        batch_size: int,
        vocab_size: int,
        device: str,
        seed: int,
        micro_per_rank: int = 1,
        rank: int = 0,
        world_size: int = 1,
        train_on: str = "assistant",
    ):
        self.packed = read_packed(folder, split, meta)
        self.rows = len(self.packed)
        if self.rows == 0:
            raise UserError(f"{folder}: the {split} split of this chat dataset holds no rows; prepare more data")
        if int(meta["vocab_size"]) > vocab_size:
            raise UserError(
                f"{folder}: its token ids reach {meta['vocab_size'] - 1} but the model has {vocab_size} rows: the data "
                "and the model do not match"
            )
        self.batch_size, self.device, self.seed = batch_size, torch.device(device), seed
        self.micro, self.rank, self.world = micro_per_rank, rank, world_size
        self.every_token = train_on == "all"  # sft_loss='all': every target inside a conversation (no mask)
        if self.every_token:
            self.trained = np.array(
                [self._in_document(r, self._positions(r))[1:].sum() for r in range(self.rows)], dtype=np.int64
            )
        else:
            self.trained = np.asarray(self.packed.mask[:, 1:], dtype=np.int64).sum(1)  # trained targets per row
        self.position = 0  # rows of the epoch order consumed by earlier steps, over all ranks
        self.in_step = 0  # micro-batches of the current step this rank has taken
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def _rows(self, start: int, n: int) -> np.ndarray:
        """n row indices from global position `start` of the endless sequence of epoch permutations."""
        out = []
        while n > 0:
            epoch, offset = divmod(start, self.rows)
            if epoch != self._epoch:
                rng = np.random.default_rng(self.seed + epoch)
                self._epoch, self._order = epoch, rng.permutation(self.rows)
            take = min(n, self.rows - offset)
            out.append(self._order[offset : offset + take])
            start, n = start + take, n - take
        return np.concatenate(out)

    def next_batch(self) -> ChatBatch:
        per_step = self.micro * self.world * self.batch_size
        step_rows = self._rows(self.position, per_step)
        total = int(self.trained[step_rows].sum())  # every trained target of this step, on every rank
        at = (self.in_step * self.world + self.rank) * self.batch_size
        rows = np.sort(step_rows[at : at + self.batch_size])
        self.in_step += 1
        if self.in_step == self.micro:
            self.position, self.in_step = self.position + per_step, 0
        weight = self.world / total if total else 0.0  # DDP averages the ranks' gradients: undo it
        return (*self._tensors(rows), weight)

    def _tensors(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = torch.from_numpy(np.asarray(self.packed.tokens[rows], dtype=np.int64))  # (B, T + 1)
        rows_positions = [self._positions(r) for r in rows]
        if self.every_token:
            mask = torch.from_numpy(
                np.stack([self._in_document(r, p) for r, p in zip(rows, rows_positions, strict=True)])
            )
        else:
            mask = torch.from_numpy(np.asarray(self.packed.mask[rows], dtype=np.bool_))
        positions = torch.from_numpy(np.stack(rows_positions))  # (B, T + 1)
        x, y = tokens[:, :-1], tokens[:, 1:].masked_fill(~mask[:, 1:], -1)  # (B, T) each
        return x.to(self.device), y.to(self.device), positions[:, :-1].to(self.device)

    def _positions(self, row: int) -> np.ndarray:
        """Each token's position in its own document: counting restarts at every document start (the padding
        after the last document is one more)."""
        bounds = self.packed.row_bounds(row)
        T = self.packed.tokens.shape[1]
        starts = np.zeros(T, dtype=np.int64)
        starts[bounds[:-1][bounds[:-1] < T]] = 1
        if bounds[-1] < T:
            starts[bounds[-1]] = 1  # the padding
        index = np.arange(T)
        last_start = np.maximum.accumulate(np.where(starts > 0, index, 0))
        return index - last_start

    def _in_document(self, row: int, positions: np.ndarray) -> np.ndarray:
        """True where a token continues its document (from the row's `_positions`): neither a document's first
        token nor padding."""
        inside = positions > 0
        inside[min(int(self.packed.row_bounds(row)[-1]), len(inside)) :] = False
        return inside

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "chat", "position": self.position, "in_step": self.in_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state.get("kind") == "chat", f"data state of kind {state.get('kind')!r} given to ChatBatches"
        self.position, self.in_step = int(state["position"]), int(state["in_step"])
