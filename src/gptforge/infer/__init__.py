"""Using a trained model: `sample` (`gptforge sample`, and samples during training). Imports `core`, `model`,
`tokenizer`, `data` and `weights`."""
