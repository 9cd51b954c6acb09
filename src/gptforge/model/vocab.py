"""Growing a model's vocabulary (resize_vocab): new rows for tokens its weights never had, e.g. the chat tokens on
GPT-2's 50,257 rows. Torch only."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from gptforge.model.gpt import GPT
from gptforge.model.modules import Linear


def resize_vocab(model: GPT, rows: int) -> None:
    """Grow the embedding (and an untied head) to `rows` rows: the existing rows kept, the new ones drawn as a
    new model's are (normal, std 0.02). For tokens the weights never had, e.g. chat tokens on GPT-2's."""
    old = model.config.vocab_size
    assert rows >= old, "resize_vocab only grows the vocabulary"
    weight = model.transformer.wte.weight
    grown = torch.empty(rows, weight.size(1), dtype=weight.dtype, device=weight.device)
    nn.init.normal_(grown, mean=0.0, std=0.02)
    with torch.no_grad():
        grown[:old] = weight
    model.transformer.wte = nn.Embedding.from_pretrained(grown, freeze=False)
    if model.config.untie_head:
        head = torch.empty_like(grown)
        nn.init.normal_(head, mean=0.0, std=0.02)
        with torch.no_grad():
            head[:old] = model.lm_head.weight
        head_weight = nn.Parameter(head)
    else:
        head_weight = model.transformer.wte.weight  # tied again
    onednn = model.lm_head.onednn
    model.lm_head = Linear(weight.size(1), rows, bias=False).to(weight.device, weight.dtype)
    model.lm_head.weight, model.lm_head.onednn = head_weight, onednn
    model.config = dataclasses.replace(model.config, vocab_size=rows)
