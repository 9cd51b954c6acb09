"""The generation engine's cached interface (`Rows`): a sequence fed in pieces (a prompt, single tokens, then
several tokens at once, as a conversation's next turn is) gives the logits of one full recomputation, in float64."""

from __future__ import annotations

import pytest
import torch

from gptforge.infer.engine import Rows
from gptforge.model.gpt import GPT, GPTConfig


@pytest.mark.parametrize("rotary", [False, True])
def test_feeding_in_pieces_equals_recomputing_the_whole_sequence(rotary):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=40, vocab_size=29, n_layer=2, n_head=2, n_embd=16, rotary=rotary)).double().eval()
    seq = torch.randint(0, 29, (3, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.logits(model.hidden_states(seq)).float()  # (3, 30, V): every position's next-token logits
    rows = Rows(model)
    got = {9: rows.feed(seq[:, :10])}  # the prompt
    got.update({t: rows.feed(seq[:, t : t + 1]) for t in range(10, 14)})  # one token per step
    got[22] = rows.feed(seq[:, 14:23])  # a whole turn at once: computed against the cached 14
    got.update({t: rows.feed(seq[:, t : t + 1]) for t in range(23, 30)})
    assert rows.length == 30 and rows.room == 10
    for t, logits in got.items():
        torch.testing.assert_close(logits, full[:, t], rtol=0, atol=1e-6)


def test_more_than_the_room_is_refused():
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=8)).eval()
    rows = Rows(model)
    rows.feed(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="do not fit: 6 held of 8"):
        rows.feed(torch.zeros(1, 3, dtype=torch.long))


def block_diagonal(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T): a token attends to earlier tokens of its own document only."""
    T = doc_ids.size(1)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & torch.ones(T, T, dtype=torch.bool).tril()).unsqueeze(1)


@pytest.mark.parametrize("rotary", [False, True])
def test_packed_documents_with_their_mask_and_positions_equal_separate_runs(rotary):
    """Two documents packed in one row, each restarting its positions and seeing only itself, give each the logits
    it has alone (float64); so changing one document cannot change the other's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=23, n_layer=2, n_head=2, n_embd=16, rotary=rotary)).double().eval()
    a, b = torch.randint(0, 23, (1, 7)), torch.randint(0, 23, (1, 9))
    row = torch.cat([a, b], 1)  # (1, 16)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9])
    positions = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        packed = model.logits(model.hidden_states(row, positions=positions, mask=block_diagonal(doc_ids)))
        alone = [model.logits(model.hidden_states(d)) for d in (a, b)]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=0, atol=1e-10)


def test_rows_of_different_lengths_with_their_positions_and_padding_mask_equal_separate_runs():
    """Left-padded rows (the padding masked out as keys, each row's positions from 0) give each row's logits alone."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=23, n_layer=2, n_head=2, n_embd=16, rotary=True)).double().eval()
    rows = [torch.randint(0, 23, (n,)) for n in (5, 9)]
    T = 9
    idx = torch.stack([torch.cat([torch.zeros(T - len(r), dtype=torch.long), r]) for r in rows])
    real = torch.stack([torch.arange(T) >= T - len(r) for r in rows])  # (B, T) not padding
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    mask = (real[:, None, :] & torch.ones(T, T, dtype=torch.bool).tril()).unsqueeze(1)  # (B, 1, T, T)
    mask |= torch.eye(T, dtype=torch.bool)  # a padding query attends to itself (its output is not used)
    with torch.no_grad():
        batched = model.logits(model.hidden_states(idx, positions=positions, mask=mask))
        for i, r in enumerate(rows):
            alone = model.logits(model.hidden_states(r[None]))
            torch.testing.assert_close(batched[i, T - len(r) :], alone[0], rtol=0, atol=1e-10)
