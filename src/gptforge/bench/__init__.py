"""Measurements: `profile` (where one step's time goes), `speed` (`gptforge bench`: the training step's tokens/s, MFU
and memory, generation and tokenizer timings) and `time_to_loss` (`bench --target_loss`: whole training runs raced
to a val loss); `options`: `gptforge bench`'s own options.
Imports: core, data, infer, model, tokenizer, train."""
