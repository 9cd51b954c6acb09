"""gptforge: train GPT language models from scratch, resume them, sample from them and evaluate them.

Run `gptforge --help` for the commands; README.md has the quickstart.
"""

__version__ = "0.1.0"
