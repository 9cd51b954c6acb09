"""`gptforge prepare RECIPE`: the one entry point of every recipe. Each option belongs to some recipes; one given
to a recipe it does not apply to is refused (naming the recipes it is for) rather than silently dropped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gptforge.core.errors import UserError
from gptforge.data import RECIPES, SHARD_RECIPES

# option -> the recipes it applies to; an option left at None takes the recipe's own default
APPLIES = {
    "tokenizer": ("text", "shakespeare", *SHARD_RECIPES),
    "val_fraction": RECIPES,
    "text_field": SHARD_RECIPES,
    "shard_size": SHARD_RECIPES,
    "val_tokens": SHARD_RECIPES,
    "num_proc": SHARD_RECIPES,
}


def prepare_command(
    recipe: str,
    files: Sequence[str] = (),
    input_path: str | None = None,
    data_dir: str = "data",
    name: str | None = None,
    tokenizer: str | None = None,
    val_fraction: float | None = None,
    text_field: str | None = None,
    shard_size: int | None = None,
    val_tokens: int | None = None,
    num_proc: int | None = None,
) -> dict[str, Any]:
    """Check which options apply to `recipe`, then run it; returns the meta.json it wrote."""
    given = dict(
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        text_field=text_field,
        shard_size=shard_size,
        val_tokens=val_tokens,
        num_proc=num_proc,
    )
    for option, value in given.items():
        if value is not None and recipe not in APPLIES[option]:
            raise UserError(f"--{option} applies to recipe(s) {', '.join(APPLIES[option])}, not {recipe!r}")
    options = {k: v for k, v in given.items() if v is not None}
    if recipe in SHARD_RECIPES:
        from gptforge.data.shards import prepare_shards

        if recipe == "files" and input_path:
            raise UserError("recipe 'files' takes its inputs as PATH arguments, not --input")
        return prepare_shards(recipe, data_dir, paths=files, name=name, input_path=input_path, **options)
    from gptforge.data.prepare import prepare

    if recipe != "text" and files:
        raise UserError(f"recipe {recipe!r} takes no FILE arguments; use --input PATH for a local copy")
    return prepare(recipe, data_dir, input_path=input_path, files=files, name=name, **options)
