"""The command line: `args` (one argparse parser per subcommand) and `main` (the `gptforge` command: parse, then hand
the work to the stage that does it, imported only then). Nothing imports it."""
