"""What the HellaSwag tests share: a tiny random GPT (test_hellaswag.py scores it, test_hellaswag_cli.py saves it
as a run)."""

from __future__ import annotations

import torch

from gptforge.model.gpt import GPT, GPTConfig


def tiny_gpt(block_size: int = 64, vocab_size: int = 50257, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab_size, bias=True)
    ).eval()
