"""The command line: `args` (the subcommands: each one's options class, kept by its stage, and handler), `parsers`
(argparse's parsers built from an options class, and the parsed options checked), `handlers` (what each subcommand
does: a thin function that imports its stage only when it runs) and `main` (the `gptforge` command: parse, then hand
the options to the handler). Nothing imports it.
Imports: bench, core, dashboard, data, evaluate, infer, pipeline, rl, tokenizer, train, weights."""
