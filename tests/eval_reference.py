"""The reference `eval chat`'s batched greedy answers (evaluate/chat.py greedy_answers, through the serving engine's
continuous batching) are held against: one prompt at a time through the generation engine's Rows and its KV cache,
each closed call's output fed at once after the call."""

from __future__ import annotations

import torch

from gptforge.infer.engine import Rows
from gptforge.infer.toolcalls import CallWatcher


@torch.no_grad()
def one_row_answer(model, prompt: list[int], max_new_tokens: int, stop: frozenset[int], end: int, vocab: int, watcher):
    """(the text the model wrote after its last call (all it wrote without a watcher), whether it ended with `end`,
    how many calls it made). Greedy over ids below `vocab`; any of `stop` ends the answer; max_new_tokens counts
    what the model writes, not the tools' outputs."""
    rows = Rows(model)
    logits = rows.feed(torch.tensor([prompt], device=model.lm_head.weight.device))
    text: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, :vocab].argmax())
        if token in stop:
            return text, token == end, _calls(watcher)
        new = [token]
        inside = watcher is not None and watcher.in_call(token)
        call = watcher.push(token) if watcher is not None else None
        if call is not None:
            new += call.feed
            text = []
        elif not inside:
            text.append(token)
        if len(new) > rows.room:
            break
        logits = rows.feed(torch.tensor([new], device=logits.device))
    return text, False, _calls(watcher)


def _calls(watcher: CallWatcher | None) -> int:
    return len(watcher.calls) if watcher is not None else 0
