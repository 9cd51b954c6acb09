"""`gptforge prepare RECIPE`: the one entry point of every recipe. Each option belongs to some recipes; one given
to a recipe it does not apply to is refused (naming the recipes it is for) rather than silently dropped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gptforge.core.errors import UserError
from gptforge.data import CHAT_RECIPE, RECIPES, SHARD_RECIPES

# option -> the recipes it applies to; an option left at None takes the recipe's own default
APPLIES = {
    "tokenizer": ("text", "shakespeare", *SHARD_RECIPES, CHAT_RECIPE),
    "val_fraction": (*RECIPES, CHAT_RECIPE),
    "block_size": (CHAT_RECIPE,),
    "include": (CHAT_RECIPE,),
    "synthetic_examples": (CHAT_RECIPE,),
    "synthetic_kinds": (CHAT_RECIPE,),
    "synthetic_tools": (CHAT_RECIPE,),
    "last_turn_only": (CHAT_RECIPE,),
    "chat_format": (CHAT_RECIPE,),
    "text_field": SHARD_RECIPES,
    "shard_size": SHARD_RECIPES,
    "val_tokens": SHARD_RECIPES,
    "num_proc": SHARD_RECIPES,
}


def prepare_command(
    recipe: str,
    files: Sequence[str],
    input_path: str | None,
    data_dir: str,
    name: str | None,
    tokenizer: str | None,
    val_fraction: float | None,
    text_field: str | None,
    shard_size: int | None,
    val_tokens: int | None,
    num_proc: int | None,
    block_size: int | None,
    include: str | None,
    synthetic_examples: int | None,
    synthetic_kinds: str | None,
    synthetic_tools: str | None,
    last_turn_only: bool | None,
    chat_format: str | None,
) -> dict[str, Any]:
    """Check which options apply to `recipe`, then run it; returns the meta.json it wrote."""
    given = dict(
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        text_field=text_field,
        shard_size=shard_size,
        val_tokens=val_tokens,
        num_proc=num_proc,
        block_size=block_size,
        include=include,
        synthetic_examples=synthetic_examples,
        synthetic_kinds=synthetic_kinds,
        synthetic_tools=synthetic_tools,
        last_turn_only=last_turn_only,
        chat_format=chat_format,
    )
    for option, value in given.items():
        if value is not None and recipe not in APPLIES[option]:
            raise UserError(f"--{option} applies to recipe(s) {', '.join(APPLIES[option])}, not {recipe!r}")
    options = {k: v for k, v in given.items() if v is not None}
    if recipe == CHAT_RECIPE:
        if input_path:
            raise UserError("recipe 'chat' takes its conversation files as PATH arguments, not --input")
        return prepare_chat_command(files, data_dir, name, **options)
    if recipe in SHARD_RECIPES:
        from gptforge.data.shards import prepare_shards

        if recipe == "files" and input_path:
            raise UserError("recipe 'files' takes its inputs as PATH arguments, not --input")
        return prepare_shards(recipe, data_dir, paths=files, name=name, input_path=input_path, **options)
    from gptforge.data.prepare import prepare

    if recipe != "text" and files:
        raise UserError(f"recipe {recipe!r} takes no FILE arguments; use --input PATH for a local copy")
    return prepare(recipe, data_dir, input_path=input_path, files=files, name=name, **options)


def prepare_chat_command(
    files: Sequence[str],
    data_dir: str,
    name: str | None,
    tokenizer: str = "gpt2",
    block_size: int = 256,
    include: str = "",
    val_fraction: float = 0.05,
    synthetic_examples: int = 20_000,
    synthetic_kinds: str = "",
    synthetic_tools: str = "none",
    last_turn_only: bool = False,
    chat_format: str | None = None,
) -> dict[str, Any]:
    """`gptforge prepare chat FILE... --name NAME`: conversations (JSONL files; --include chitchat,synthetic)
    rendered with their loss mask and packed into rows of block_size + 1 (chat/prepare.py)."""
    from gptforge.chat.prepare import prepare_chat

    if tokenizer == "char":
        raise UserError("--tokenizer=char: a character vocabulary has no chat tokens; use gpt2 or an own BPE tokenizer")
    if tokenizer == "gpt2":
        spec = {"tokenizer": "gpt2"}
    else:
        from gptforge.tokenizer.bpe import load_tokenizer

        spec = load_tokenizer(tokenizer).spec()
    recipes = [r for r in (include or "").split(",") if r]
    if synthetic_tools != "none" and "synthetic" not in recipes:
        raise UserError(f"--synthetic_tools={synthetic_tools} changes the synthetic tasks: add --include synthetic")
    return prepare_chat(
        list(files),
        name or "",
        spec,
        block_size,
        data_dir=data_dir,
        val_fraction=val_fraction,
        fmt=chat_format,
        last_turn_only=last_turn_only,
        recipes=recipes,
        synthetic_examples=synthetic_examples,
        synthetic_kinds=[k for k in synthetic_kinds.split(",") if k] or None,
        synthetic_tools=synthetic_tools,
    )
