"""A training run: `resume` (a resumed run's settings, from its config.json), `start` (where the run starts: the
checkpoint it continues or the weights it fine-tunes, fitted to the dataset), `resolve` (its config resolved once,
the memory check, the model built), `setup` (everything else built and checked before the first step and before
anything is written), `parallel` (the model placed, sharded, compiled, wrapped), `runstate` (what a resume needs
besides the weights, captured and restored side by side), `checkpointer` (which checkpoint files at which step),
`metrics` (the run folder's records, the console line, the sinks) and `loop` (train, the loop, one step, the
learning-rate schedule).
Imports: core, dashboard, data, evaluate, infer, kernels, model, tokenizer, weights."""
