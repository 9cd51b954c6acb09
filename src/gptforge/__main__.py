"""`python -m gptforge ...` (and `torchrun -m gptforge ...`) runs the same CLI as the `gptforge` script."""

from gptforge.cli.main import entry

if __name__ == "__main__":
    entry()
