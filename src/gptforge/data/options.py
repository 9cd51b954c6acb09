"""`gptforge prepare`'s options, each written once (default, type, allowed values, help text); the command line is
built from them (cli/parsers.py). An option left at None takes the recipe's own default (data/command.py says which
recipes each applies to). No numpy or torch here, so `gptforge prepare --help` stays instant."""

from __future__ import annotations

from dataclasses import dataclass

from gptforge.chat.synthetic import ALL_KINDS, KINDS
from gptforge.core.settings import REQUIRED, setting
from gptforge.data import CHAT_RECIPE, RECIPES, SHARD_RECIPES

TOKENIZER_HELP = (
    "char, gpt2, or an own tokenizer (`gptforge tokenizer train`: its name under tokenizers/, or its folder) for "
    "recipes text (char when not given), shakespeare, the sharded recipes and chat (gpt2 when not given; chat "
    "takes no char)"
)
OTHER_KINDS = ",".join(k for k in ALL_KINDS if k not in KINDS)


@dataclass(frozen=True, kw_only=True)
class PrepareArgs:
    recipe: str = setting(REQUIRED, "what to prepare", choices=(*RECIPES, *SHARD_RECIPES, CHAT_RECIPE), positional=True)
    files: list[str] = setting(
        [],
        "input files: UTF-8 text (recipe 'text'); .jsonl, .jsonl.gz, .parquet, .txt files or folders of them "
        "(recipe 'files')",
        positional=True,
        metavar="PATH",
    )
    input_path: str | None = setting(
        None,
        "local copy of the recipe's source (skips the download): a text file for the Shakespeare recipes; for "
        "openwebtext / fineweb_edu a datasets save_to_disk folder or data files",
        flags=("--input",),
        metavar="PATH",
    )
    data_dir: str = setting("data", "folder that receives the dataset folder")
    name: str | None = setting(
        None, "dataset name (folder <data_dir>/<name>); needed by 'text' and 'files', else the recipe's"
    )
    tokenizer: str | None = setting(None, TOKENIZER_HELP, metavar="NAME_OR_FOLDER")
    val_fraction: float | None = setting(
        None, "share of the tokens held out for validation (shakespeare*, text; default: 0.1)"
    )
    text_field: str | None = setting(None, "field / column holding the text (sharded recipes; default: text)")
    shard_size: int | None = setting(None, "tokens per shard (sharded recipes; default: 100,000,000)")
    val_tokens: int | None = setting(
        None, "the first documents go to val until it holds this many tokens (sharded recipes; default: 1,000,000)"
    )
    num_proc: int | None = setting(
        None, "tokenizer worker processes (sharded recipes; default: the CPU count, at most 8)"
    )
    # conversations packed for SFT
    block_size: int | None = setting(None, "chat: tokens per training row (default: 256)")
    include: str | None = setting(
        None,
        "chat: comma-separated built-in conversations to add: chitchat (the chitchat-dataset package, 4,017 human "
        "conversations), synthetic (offline tasks scored exactly: arithmetic, spelling, counting, recall, system "
        "instructions)",
        metavar="RECIPES",
    )
    synthetic_examples: int | None = setting(None, "chat: synthetic conversations (default: 20,000)")
    synthetic_kinds: str | None = setting(
        None,
        "chat: the synthetic task kinds, taken in turn; a kind named twice comes twice as often (default: each "
        f"once: {','.join(KINDS)}; also: {OTHER_KINDS})",
        metavar="KINDS",
    )
    synthetic_tools: str | None = setting(
        None,
        "chat: calculator: the synthetic arithmetic answers call the calculator tool and give its output (the model "
        "learns when to call it); default none",
        choices=("none", "calculator"),
    )
    last_turn_only: bool | None = setting(None, "chat: train on each conversation's last assistant turn only")
    chat_format: str | None = setting(
        None, "chat: the files' format (default: detected per line)", choices=("openai", "sharegpt", "alpaca")
    )
