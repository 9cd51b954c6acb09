"""build-nanogpt's flag names as aliases of TrainConfig keys, on the command line and in config files alike
(`--mini_batch_size=64` is `--batch_size=64`), and its total_batch_size (tokens per step), from which
gradient_accumulation_steps is derived. README "Coming from build-nanogpt" has the table and rules."""

from __future__ import annotations

from typing import Any

from gptforge.core.errors import UserError

# build-nanogpt's flag names -> our keys. Its --min_lr, --weight_decay, --total_batch_size and --seed are ours too.
ALIASES: dict[str, str] = {
    "mini_batch_size": "batch_size",
    "context_length": "block_size",
    "num_layers": "n_layer",
    "num_heads": "n_head",
    "embd_size": "n_embd",
    "max_lr": "learning_rate",
    "warmup_steps": "warmup_iters",
    "eval_freq": "eval_interval",
    "logdir": "out_dir",
}
SHARED_NAMES = ("min_lr", "weight_decay", "total_batch_size", "seed")
EPOCH_NAMES = ("steps_per_epoch", "num_epochs")  # no key of their own: max_iters = their product
EVAL_FREQ_ALSO = ("hellaswag_interval", "sample_interval")  # build-nanogpt does all three every eval_freq steps
LOGDIR_CKPT_INTERVAL = 5000  # build-nanogpt writes log_dir/model_{step:05d}.pt every 5000 steps and at the last

# What load_config collects: the name as written (key or alias) -> (value, where, source number). A source is
# the command line or one config file; later sources have higher numbers.
Given = dict[str, tuple[Any, str, int]]


def show(name: str, value: Any, where: str, source: int = 0) -> str:
    """How a value was given, for messages: `--name=value` or `name = value (file:line)`."""
    return f"--{name}={value}" if where.startswith("--") else f"{name} = {value!r} ({where})"


def resolve_aliases(given: Given, values: dict[str, Any], explicit: set[str]) -> None:
    """Apply build-nanogpt's names to `values` (keys they set join `explicit`).

    Within one source (the command line, or one config file) a key and its alias must agree; across sources the
    later one wins, as for any key: `config/train_gpt2_fineweb.py --mini_batch_size=32` overrides the file.
    """

    def claim(key: str, value: Any, source: int, shown: str, why: str) -> None:
        if key in given and given[key][0] != value:
            if given[key][2] == source:
                raise UserError(f"{shown} and {show(key, *given[key])} disagree ({why}); give one of them")
            if given[key][2] > source:
                return  # the key came later: it overrides the alias
        values[key] = value
        explicit.add(key)

    for alias, key in ALIASES.items():
        if alias in given:
            value, _, source = given[alias]
            claim(key, value, source, show(alias, *given[alias]), f"{alias} is build-nanogpt's name for {key}")
            if alias == "eval_freq":
                for other in EVAL_FREQ_ALSO:
                    if other not in given:
                        values[other] = value
            if alias == "logdir" and "ckpt_interval" not in given:
                values["ckpt_interval"] = LOGDIR_CKPT_INTERVAL  # its run layout: model_05000.pt ... and the last step
    if any(name in given for name in EPOCH_NAMES):
        for name in EPOCH_NAMES:
            if name in given and given[name][0] <= 0:
                raise UserError(f"{show(name, *given[name])}: {name} must be a positive integer")
        steps, epochs = (given[name][0] if name in given else 1 for name in EPOCH_NAMES)
        shown = " and ".join(show(name, *given[name]) for name in EPOCH_NAMES if name in given)
        source = max(given[name][2] for name in EPOCH_NAMES if name in given)
        claim(
            "max_iters", steps * epochs, source, shown, f"max_iters = steps_per_epoch * num_epochs = {steps * epochs}"
        )
        if "lr_decay_iters" not in given:
            values["lr_decay_iters"] = steps * epochs


def alias_help() -> str:
    """build-nanogpt's flag names, for `gptforge train --help`."""
    lines = [f"  --{alias:<18} -> {key}" for alias, key in ALIASES.items() if alias not in ("eval_freq", "logdir")]
    lines += [
        f"  --{'eval_freq':<18} -> eval_interval, and {' and '.join(EVAL_FREQ_ALSO)} unless given",
        f"  --{'logdir':<18} -> out_dir, and ckpt_interval={LOGDIR_CKPT_INTERVAL} unless given (step checkpoints)",
        "  --steps_per_epoch, --num_epochs -> max_iters = their product (one alone: the other is 1), and",
        "                        lr_decay_iters unless given",
        f"  {', '.join('--' + n for n in SHARED_NAMES)}: the same names here",
        "They work in config files too (`max_lr = 6e-4`). An alias and its key given with different values in one",
        "place (the command line, or one file) is an error naming both; otherwise the later one wins.",
    ]
    return "\n".join(lines)


def derived_accumulation(values: dict[str, Any], explicit: set[str]) -> int:
    """gradient_accumulation_steps (summed over ranks), or what build-nanogpt's total_batch_size (tokens per
    step) makes of it."""
    total, accum = values["total_batch_size"], values["gradient_accumulation_steps"]
    if total <= 0:
        return accum
    batch, block = values["batch_size"], values["block_size"]
    per_micro = batch * block
    if per_micro <= 0 or total % per_micro:
        raise UserError(
            f"--total_batch_size={total} is not a multiple of batch_size * block_size = "
            f"{batch} * {block} = {per_micro}; change one of them"
        )
    steps = total // per_micro
    if "gradient_accumulation_steps" in explicit and accum != steps:
        raise UserError(
            f"gradient_accumulation_steps={accum} contradicts total_batch_size="
            f"{total} (which gives {steps}); set only one of them"
        )
    return steps
