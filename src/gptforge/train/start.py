"""Where a run starts from, decided before anything is built or written: the checkpoint a resume continues (or
that the run is already finished, which leaves its folder untouched; each setting the resume changes named), another
run's weights, Hugging Face weights, or a new model; the model's shape, context and vocabulary fitted to the
dataset. train/resolve.py then resolves the settings for the device, checks the memory and builds the model.
README "Interruptions, crashes and bad steps" has the rules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gptforge.core.config import FIELDS, TrainConfig
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.core.files import CKPT
from gptforge.core.memory import MemoryEstimate
from gptforge.core.shape import SHAPE_KEYS, model_args, model_vocab_size, saved_model_args
from gptforge.model.gpt import GPT
from gptforge.model.vocab import resize_vocab
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from gptforge.tokenizer.spec import folder_tokenizer, tokenizer_spec
from gptforge.weights.checkpoint import checkpoint_model_args, load_checkpoint, load_resumable
from gptforge.weights.load import checkpoint_model


@dataclass
class Start:
    """The model a run begins with: a checkpoint to continue (`ckpt`, from `source`), or Hugging Face weights
    already loaded (`model`, from `source`), or neither (a new model); `args` its model_args."""

    args: dict[str, Any]
    ckpt: dict[str, Any] | None = None
    model: GPT | None = None
    source: str = ""
    memory: MemoryEstimate | None = None  # what training it needs, estimated before anything is allocated
    dtype_why: str = ""  # what decided an automatic dtype (the run's header says it)
    slow_products: str = ""  # a warning where this CPU runs the run's bf16 / fp16 products slowly


def find_start(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> Start | None:
    """What the run starts from, or None when it resumes a finished run (said once; nothing is opened for writing,
    so the folder stays byte for byte as it was); its context and vocabulary then fitted to the dataset."""
    check_task(cfg, meta)
    if cfg.init_from == "resume":
        start = resumed_start(cfg, env, meta)
        if start is None:
            return None
    elif cfg.init_from != "scratch":
        start = weights_start(cfg, env, meta)
    else:
        start = Start(model_args(cfg, model_vocab_size(meta)))
    fit_start(cfg, env, meta, start)
    return start


def check_task(cfg: TrainConfig, meta: dict[str, Any]) -> None:
    """A chat dataset is for --task=sft and only it (its rows against the model's context: check_rows), read by the
    chat loader, without the batch warm-up."""
    chat = meta.get("format") == "chat"
    if chat and cfg.task != "sft":
        raise UserError(
            f"dataset {cfg.dataset!r} is a chat dataset (`gptforge prepare chat`): fine-tune on it with --task=sft"
        )
    if cfg.task == "sft" and not chat:
        raise UserError(
            f"--task=sft trains on a chat dataset (`gptforge prepare chat FILE... --name NAME`), but dataset "
            f"{cfg.dataset!r} is plain text: prepare one, or train on this one with --task=pretrain"
        )
    if cfg.data_loader != "auto" and (cfg.data_loader == "chat") != chat:
        raise UserError(f"--data_loader={cfg.data_loader} does not read dataset {cfg.dataset!r}; leave it at auto")
    if cfg.batch_warmup_iters and chat:
        raise UserError(
            f"--batch_warmup_iters={cfg.batch_warmup_iters}: a chat dataset's rows are packed conversations whose "
            "loss is weighted over the whole step; the batch warm-up is for pretraining data. Leave it at 0 here"
        )


def resumed_start(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> Start | None:
    """The checkpoint a resume continues (ckpt.pt, or the newest readable fallback; with --resume=auto the newest
    readable) as the start; None when that run is finished. Rank 0 says which it is, and each setting changed."""
    auto = cfg.resume == "auto"
    prefix = "resume=auto: " if auto else ""
    ckpt, source, told = load_resumable(cfg.out_dir, map_location=env.device, newest=auto)
    if int(ckpt["iter_num"]) >= cfg.max_iters and not cfg.eval_only:
        more = (
            "" if auto else "; raise --max_iters (and --lr_decay_iters) to train it on, or evaluate it with --eval_only"
        )
        told.append(
            f"{prefix}the run in {cfg.out_dir} is finished (iter {ckpt['iter_num']} of max_iters {cfg.max_iters}); "
            f"nothing to do{more}"
        )
        env.say("\n".join(told))
        return None
    saved = ckpt["config"] if "format_version" in ckpt else {}  # nanoGPT's: other keys
    saved_optimizer, saved_scale = saved.get("optimizer", "adamw"), saved.get("embedding_lr_scale", 1.0)
    if saved_optimizer != cfg.optimizer:  # nanoGPT's: AdamW
        raise UserError(
            f"--optimizer={cfg.optimizer}: {source} holds {saved_optimizer}'s optimizer state, which {cfg.optimizer} "
            f"cannot continue; resume with --optimizer={saved_optimizer}, or start a new run from its weights "
            f"(`gptforge export`, then --init_from=FOLDER) with a fresh {cfg.optimizer} state"
        )
    if (saved_scale == 1.0) != (cfg.embedding_lr_scale == 1.0):  # the embedding in a group of its own, or not
        raise UserError(
            f"--embedding_lr_scale={cfg.embedding_lr_scale}: {source} was written with embedding_lr_scale="
            f"{saved_scale}; at 1 the embedding shares the matrices' optimizer group, at any other value it has its "
            f"own, and the one state does not fit the other; resume with --embedding_lr_scale={saved_scale}, or "
            "start a new run from its weights (`gptforge export`, then --init_from=FOLDER)"
        )
    if ckpt.get("tokenizer") not in (None, tokenizer_spec(meta)):  # nanoGPT's checkpoints have none
        raise UserError(
            f"{source} was trained with another vocabulary than dataset {cfg.dataset!r} has; resume "
            "on the dataset the model was trained on (--dataset, --data_dir)"
        )
    changed = [k for k in FIELDS if k in saved and k not in NOT_CHANGES and saved[k] != getattr(cfg, k)]
    newest = " (the newest readable checkpoint)" if told or auto else ""
    told.append(f"{prefix}resuming {cfg.out_dir} from iter {ckpt['iter_num']} ({source}){newest}")
    if changed:
        shown = ", ".join(f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in changed)
        told.append(f"changed from the run's config.json: {shown}")
    env.say("\n".join(told))
    return Start(checkpoint_model_args(ckpt, source), ckpt=ckpt, source=source)


def weights_start(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> Start:
    """Weights to fine-tune as a new run's start (the optimizer fresh, the iteration count at 0): another run's (its
    folder's ckpt.pt, e.g. SFT on a pretraining run), GPT-2's (a hub name or a local Hugging Face folder), or a
    NanoChat folder's; block_size cropped to --block_size if smaller (fit_start). The dataset must be tokenized as
    the weights read (the run's tokenizer, GPT-2 BPE, or the one an export's gptforge_tokenizer.json names)."""
    from gptforge.weights.pretrained import load_pretrained

    path = os.path.join(cfg.init_from, CKPT)
    if os.path.isfile(path):
        ckpt = load_checkpoint(path, map_location="cpu")
        if ckpt.get("tokenizer") not in (None, tokenizer_spec(meta)):
            raise UserError(
                f"--init_from={cfg.init_from}: its model reads another vocabulary than dataset {cfg.dataset!r}; "
                "prepare the data with the run's tokenizer"
            )
        model, args = checkpoint_model(ckpt, path, cfg.dropout)
        env.say(f"weights from {path} (iter {ckpt.get('iter_num', '?')} of that run); the optimizer starts fresh")
        return Start(args, model=model, source=path)
    reads = folder_tokenizer(cfg.init_from) if os.path.isdir(cfg.init_from) else GPT2Tokenizer()
    if reads.spec() != tokenizer_spec(meta):
        raise UserError(
            f"--init_from={cfg.init_from} starts from weights that read {reads.kind} tokens, but dataset "
            f"{cfg.dataset!r} is tokenized otherwise ({meta['tokenizer']}): prepare it with the weights' tokenizer"
            + (
                " (`gptforge prepare shakespeare`, or `gptforge prepare text FILE --tokenizer gpt2`)"
                if reads.kind == "gpt2"
                else ""
            )
        )
    chat = meta.get("format") == "chat"  # the weights' whole context: the rows are checked against it (fit_start)
    model, args = load_pretrained(cfg.init_from, dropout=cfg.dropout, block_size=None if chat else cfg.block_size)
    return Start(saved_model_args(args), model=model, source=cfg.init_from)


def fit_start(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any], start: Start) -> None:
    """The start made the run's, before anything is written: weights' shape against the shape keys given
    (fixed_by_weights); the context (a chat dataset's row length once check_rows has found it fits, otherwise a
    shorter --block_size crops the weights'; a rotary model, whose positions are computed rather than learned, grows
    to longer rows); GPT-2's vocabulary padded for a chat dataset's tokens. Decided first, then done, then said."""
    told = [fixed_by_weights(cfg, start.args)] if start.model is not None else []
    have, chat = start.args["block_size"], meta.get("format") == "chat"
    if chat:
        check_rows(cfg, meta, start)
    want = meta["block_size"] if chat else min(cfg.block_size, have)
    rows = model_vocab_size(meta)  # GPT-2's 50,257 rows lack the chat tokens: the padded vocabulary has them
    pad = meta["vocab_size"] > start.args["vocab_size"] and chat and start.model is not None
    if meta["vocab_size"] > (rows if pad else start.args["vocab_size"]):
        raise UserError(
            f"dataset {cfg.dataset!r} has vocab_size {meta['vocab_size']} but the model only "
            f"{start.args['vocab_size']}; resume on the dataset the model was trained on"
        )
    if want != have and start.model is not None:
        if want > have:
            told.append(f"rotary positions: the context grows from the weights' {have} tokens to the rows' {want}")
        start.model.crop_block_size(want)
        start.args = {**start.args, "block_size": want}
    if pad:
        told.append(
            f"vocabulary padded from {start.args['vocab_size']} to {rows} rows for the chat tokens (new rows random)"
        )
        resize_vocab(start.model, rows)
        start.args = {**start.args, "vocab_size": rows}
    env.say("\n".join(t for t in told if t))


def check_rows(cfg: TrainConfig, meta: dict[str, Any], start: Start) -> None:
    """A chat dataset's rows against the model's context (start.args' block_size: the weights' whole table), with
    advice that works for this start: a resumed model keeps its context, learned positions cannot reach past the
    weights' table, and a new model (or weights with room, or rotary ones) trains at --block_size=ROWS."""
    rows, context, rotary = meta["block_size"], start.args["block_size"], start.args["rotary"]
    data = f"dataset {cfg.dataset!r} holds rows of {rows} tokens"

    def again(size: int) -> str:
        return (
            f"prepare the chat data again with --block_size {size} "
            f"(`gptforge prepare chat FILE... --name NAME --block_size {size}`)"
        )

    if cfg.init_from == "resume" and rows != context:
        raise UserError(
            f"{data}, and the run in {cfg.out_dir} reads {context} tokens (its block_size, which a resumed model "
            f"keeps): resume on the dataset it was trained on, or {again(context)}"
        )
    if cfg.init_from not in ("resume", "scratch") and rows > context and not rotary:
        raise UserError(
            f"{data}, more than the {context} positions --init_from={cfg.init_from} learned (its block_size; a "
            f"learned position table cannot grow, whatever --block_size says); rows of at most {context} fit it: "
            f"{again(context)}"
        )
    if cfg.init_from != "resume" and cfg.block_size != rows:
        fits = cfg.init_from == "scratch" or rotary or cfg.block_size <= context
        raise UserError(
            f"--block_size={cfg.block_size}: {data}; train with --block_size={rows}, or "
            f"{again(cfg.block_size if fits else context)}"
        )


def fixed_by_weights(cfg: TrainConfig, args: dict[str, Any]) -> str:
    """Weights fix the model's shape: a shape key given a value of its own that differs from the weights' is
    refused; those left at their default take the weights' values, named in the line returned ('' when none differ;
    block_size: the weights' table cropped to it, as load_pretrained does; dropout applies)."""
    default = TrainConfig()
    keys = [k for k in SHAPE_KEYS if k != "block_size" and getattr(cfg, k) != args[k]]
    given = [k for k in keys if getattr(cfg, k) != getattr(default, k)]
    if given:
        shown = ", ".join(f"--{k}={getattr(cfg, k)!r} (the weights: {args[k]!r})" for k in given)
        raise UserError(
            f"{shown}: --init_from={cfg.init_from}'s weights fix the model's shape; leave these out to fine-tune "
            "them, or train a new model of your shape with --init_from=scratch"
        )
    return (
        f"from {cfg.init_from}: " + ", ".join(f"{k} {args[k]!r}" for k in keys) + " (the weights' shape)"
        if keys
        else ""
    )


NOT_CHANGES = ("init_from", "resume")  # a resumed run's init_from is 'resume', whatever started it
