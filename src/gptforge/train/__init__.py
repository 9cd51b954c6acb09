"""A training run: `setup` (everything built and checked before the first step), `loop` (train, the loop, one
step), `checkpointer` (which checkpoint files at which step), `resume` (a resumed run's settings), `metrics` (the
sinks every figure goes to) and `memory` (the estimate that refuses a config too big for the device). Imports every
stage below it: `core`, `model`, `tokenizer`, `data`, `weights`, `infer`, `evaluate`."""
