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
