"""Weights in and out of files: `checkpoint` (gptforge's checkpoint files: atomic save, safe load, rotation),
`pretrained` (GPT-2 and NanoChat weights from the hub or a Hugging Face folder), `load` (the model a command reads),
`export` (a run as a Hugging Face folder, with its tokenizer and chat template, or as a GGUF file: `gguf_file`,
`gguf_vocab`), `options` (where a command's model
comes from and the device it runs on, and `gptforge export`'s options).
Imports: chat, core, data, model, tokenizer."""
