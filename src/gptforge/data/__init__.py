"""Datasets: the recipes that prepare them (`prepare`, `shards`, `chat_batches` for SFT's rows), the loaders that read
them (`loader`), documents streamed from files (`sources`) and `gptforge prepare` (`options`, `command`). This module
itself stays free of numpy and torch: the recipe names below make prepare's options (`options`).
Imports: chat, core, tokenizer."""

RECIPES = ("shakespeare_char", "shakespeare", "text")  # held in memory: data/prepare.py
SHARD_RECIPES = ("files", "openwebtext", "fineweb_edu")  # streamed into token shards: data/shards.py
CHAT_RECIPE = "chat"  # conversations rendered with their loss mask and packed for SFT: chat/prepare.py
