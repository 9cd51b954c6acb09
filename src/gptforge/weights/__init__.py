"""Weights in and out of files: `checkpoint` (gptforge's checkpoint files: atomic save, safe load, rotation),
`pretrained` (GPT-2 and NanoChat weights from the hub or a Hugging Face folder), `export` (a run as a Hugging Face
folder). Imports `core`, `model` and `tokenizer`."""
