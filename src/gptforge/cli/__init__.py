"""The command line: `args` (one argparse parser per subcommand, each naming the handler that does its work), with
`tokenizer_args`, `chat_args` and `bench_args` for those commands' own options, and `main` (the `gptforge` command:
parse, then hand the work to the stage that does it, imported only then). Nothing imports it.
Imports: bench, chat, core, data, infer, train."""
