"""Where a run starts from, decided before anything is built or written: a resumed run's settings (its saved
config.json as the base, the options given again changing it where that makes sense, never the model's shape, each
change named), the checkpoint it continues (or that the run is already finished, which leaves its folder
untouched), the model's shape (a new model's, a checkpoint's, or Hugging Face weights'), the config resolved once
for this device and dataset, and the memory check. README "Interruptions, crashes and bad steps" has the rules."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from gptforge.core.config import FIELDS, TrainConfig, loader_kind
from gptforge.core.device import (
    available_memory,
    resolve_compile,
    resolve_dtype,
    resolve_fast_dropout,
    resolve_onednn_f32,
)
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.core.files import CKPT
from gptforge.core.memory import MemoryEstimate, check_fits, estimate_training_memory
from gptforge.core.shape import SHAPE_KEYS, model_args, model_vocab_size, saved_model_args
from gptforge.kernels.attention import saved_score_bytes
from gptforge.kernels.head_loss import head_loss_used
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.vocab import resize_vocab
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from gptforge.tokenizer.spec import folder_tokenizer, tokenizer_spec
from gptforge.weights.checkpoint import checkpoint_model_args, load_checkpoint, load_model_state, load_resumable


@dataclass
class Start:
    """The model a run begins with: a checkpoint to continue (`ckpt`, from `source`), or Hugging Face weights
    already loaded (`model`, from `source`), or neither (a new model); `args` its model_args."""

    args: dict[str, Any]
    ckpt: dict[str, Any] | None = None
    model: GPT | None = None
    source: str = ""
    memory: MemoryEstimate | None = None  # what training it needs, estimated before anything is allocated


def begin(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> tuple[TrainConfig, Start, GPT] | None:
    """Where the run starts, its settings resolved once for this device and dataset, the memory it needs checked
    against the device's, and its model built; None when it resumes a finished run (nothing to do)."""
    start = find_start(cfg, env, meta)
    if start is None:
        return None
    cfg = resolve_config(cfg, env, meta, start)  # the settings from here on: every 'auto' decided
    start.memory = check_memory(cfg, env, start.args)
    return cfg, start, build_model(cfg, start)


def find_start(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> Start | None:
    """What the run starts from, or None when it resumes a finished run (said once; nothing is opened for writing,
    so the folder stays byte for byte as it was)."""
    check_task(cfg, meta)
    if env.restart:
        env.say(
            f"torchrun restart {env.restart} (of --max-restarts={os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')})"
        )
    if cfg.resume == "auto" and cfg.init_from != "resume":
        env.say(f"resume=auto: no checkpoint in {cfg.out_dir}; a new run (init_from={cfg.init_from})")
    if cfg.init_from == "resume":
        ckpt, source = resume_checkpoint(cfg, env, meta)
        if ckpt is None:
            return None
        start = Start(checkpoint_model_args(ckpt, source), ckpt=ckpt, source=source)
    elif os.path.isfile(os.path.join(cfg.init_from, CKPT)):
        start = run_weights(cfg, env, meta)
    elif cfg.init_from != "scratch":
        model, args = pretrained_model(cfg, meta)
        fixed_by_weights(cfg, args, env)
        start = Start(args, model=model, source=cfg.init_from)
    else:
        start = Start(model_args(cfg, model_vocab_size(meta)))
    fit_context(cfg, env, meta, start)
    if meta["vocab_size"] > start.args["vocab_size"] and meta.get("format") == "chat" and start.model is not None:
        rows = model_vocab_size(meta)  # GPT-2's 50,257 rows lack the chat tokens: the padded vocabulary has them
        env.say(
            f"vocabulary padded from {start.args['vocab_size']} to {rows} rows for the chat tokens (new rows random)"
        )
        resize_vocab(start.model, rows)
        start.args = {**start.args, "vocab_size": rows}
    if meta["vocab_size"] > start.args["vocab_size"]:
        raise UserError(
            f"dataset {cfg.dataset!r} has vocab_size {meta['vocab_size']} but the model only "
            f"{start.args['vocab_size']}; resume on the dataset the model was trained on"
        )
    return start


def check_task(cfg: TrainConfig, meta: dict[str, Any]) -> None:
    """A chat dataset is for --task=sft and only it (its rows against the model's context: check_rows)."""
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
    if (loader_kind(meta, cfg.data_loader) == "chat") != chat:
        raise UserError(f"--data_loader={cfg.data_loader} does not read dataset {cfg.dataset!r}; leave it at auto")


def run_weights(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> Start:
    """Another run's weights (its folder's ckpt.pt) as a new run's start, e.g. SFT on a pretraining run: its shape
    and tokenizer hold (its context as fit_context makes it); the optimizer starts fresh, the iteration count at 0."""
    path = os.path.join(cfg.init_from, CKPT)
    ckpt = load_checkpoint(path, map_location="cpu")
    args = checkpoint_model_args(ckpt, path)
    fixed_by_weights(cfg, args, env)
    if ckpt.get("tokenizer") not in (None, tokenizer_spec(meta)):
        raise UserError(
            f"--init_from={cfg.init_from}: its model reads another vocabulary than dataset {cfg.dataset!r}; prepare "
            "the data with the run's tokenizer"
        )
    model = GPT(GPTConfig(**args, dropout=cfg.dropout))
    load_model_state(model, ckpt["model"], path)
    env.say(f"weights from {path} (iter {ckpt.get('iter_num', '?')} of that run); the optimizer starts fresh")
    return Start(args, model=model, source=path)


def resume_checkpoint(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint a resume continues (ckpt.pt, or the newest readable fallback; with --resume=auto the newest
    readable) and its path; (None, path) when that run is finished. Rank 0 says which it is."""
    auto = cfg.resume == "auto"
    prefix = "resume=auto: " if auto else ""
    ckpt, source, problems = load_resumable(cfg.out_dir, map_location=env.device, newest=auto)
    for problem in problems:
        env.say(problem)
    if int(ckpt["iter_num"]) >= cfg.max_iters and not cfg.eval_only:
        more = (
            "" if auto else "; raise --max_iters (and --lr_decay_iters) to train it on, or evaluate it with --eval_only"
        )
        env.say(
            f"{prefix}the run in {cfg.out_dir} is finished (iter {ckpt['iter_num']} of max_iters {cfg.max_iters}); "
            f"nothing to do{more}"
        )
        return None, source
    newest = " (the newest readable checkpoint)" if problems or auto else ""
    env.say(f"{prefix}resuming {cfg.out_dir} from iter {ckpt['iter_num']} ({source}){newest}")
    changes = resume_changes(cfg, ckpt["config"] if "format_version" in ckpt else {})  # nanoGPT's: other keys
    if changes:
        shown = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
        env.say(f"changed from the run's config.json: {shown}")
    saved_optimizer = (ckpt.get("config") or {}).get("optimizer", "adamw")  # nanoGPT's: AdamW
    if saved_optimizer != cfg.optimizer:
        raise UserError(
            f"--optimizer={cfg.optimizer}: {source} holds {saved_optimizer}'s optimizer state, which {cfg.optimizer} "
            f"cannot continue; resume with --optimizer={saved_optimizer}, or start a new run from its weights "
            f"(`gptforge export`, then --init_from=FOLDER) with a fresh {cfg.optimizer} state"
        )
    saved_scale = (ckpt.get("config") or {}).get("embedding_lr_scale", 1.0)
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
    return ckpt, source


def pretrained_model(cfg: TrainConfig, meta: dict[str, Any]) -> tuple[GPT, dict[str, Any]]:
    """GPT-2's weights (a hub name or a local Hugging Face folder), or a NanoChat folder's, to fine-tune;
    block_size cropped if smaller. The dataset must be tokenized as the weights read (GPT-2 BPE, or the
    tokenizer an export's gptforge_tokenizer.json names)."""
    from gptforge.weights.pretrained import load_pretrained

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
    chat = meta.get("format") == "chat"  # the weights' whole context: the rows are checked against it (fit_context)
    model, args = load_pretrained(cfg.init_from, dropout=cfg.dropout, block_size=None if chat else cfg.block_size)
    return model, saved_model_args(args)


def fit_context(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any], start: Start) -> None:
    """The model's context made the run's, before anything is written: a chat dataset's row length once check_rows
    has found it fits; otherwise a shorter --block_size crops the weights' (a longer one keeps theirs). A rotary
    model, whose positions are computed rather than learned, grows to longer rows (said)."""
    have, chat = start.args["block_size"], meta.get("format") == "chat"
    if chat:
        check_rows(cfg, meta, start)
    want = meta["block_size"] if chat else min(cfg.block_size, have)
    if want == have or start.model is None:
        return
    if want > have:
        env.say(f"rotary positions: the context grows from the weights' {have} tokens to the rows' {want}")
    start.model.crop_block_size(want)
    start.args = {**start.args, "block_size": want}


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


def fixed_by_weights(cfg: TrainConfig, args: dict[str, Any], env: DistEnv) -> None:
    """Hugging Face weights fix the model's shape: a shape key given a value of its own that differs from the
    weights' is refused; one left at its default takes the weights' value, said in one line (block_size: the
    weights' table cropped to it, as load_pretrained does; dropout applies)."""
    default = TrainConfig()
    keys = [k for k in SHAPE_KEYS if k != "block_size" and getattr(cfg, k) != args[k]]
    given = [k for k in keys if getattr(cfg, k) != getattr(default, k)]
    if given:
        shown = ", ".join(f"--{k}={getattr(cfg, k)!r} (the weights: {args[k]!r})" for k in given)
        raise UserError(
            f"{shown}: --init_from={cfg.init_from}'s weights fix the model's shape; leave these out to fine-tune "
            "them, or train a new model of your shape with --init_from=scratch"
        )
    if keys:
        env.say(f"from {cfg.init_from}: " + ", ".join(f"{k} {args[k]!r}" for k in keys) + " (the weights' shape)")


def resolve_config(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any], start: Start) -> TrainConfig:
    """The settings the run uses, as config.json and every checkpoint record them: each 'auto' decided for this
    device and dataset, HellaSwag off for a dataset it cannot read, and the shape of a resumed or GPT-2 model."""
    hellaswag_interval = cfg.hellaswag_interval
    if hellaswag_interval > 0 and meta["tokenizer"] != "gpt2":  # e.g. --eval_freq on a char-level dataset
        env.say(
            f"hellaswag_interval={hellaswag_interval} ignored: HellaSwag needs GPT-2 BPE tokens and dataset "
            f"{cfg.dataset!r} is {meta['tokenizer']}-level"
        )
        hellaswag_interval = 0
    shape = {k: start.args[k] for k in SHAPE_KEYS} if cfg.init_from != "scratch" else {}
    n_embd = shape.get("n_embd", cfg.n_embd)
    return dataclasses.replace(
        cfg,
        device=env.device,
        dtype=resolve_dtype(cfg.dtype, env.device_type, n_embd, cfg.cpu_bf16_min_width),
        compile=resolve_compile(cfg.compile, env.device_type),
        fast_dropout=resolve_fast_dropout(cfg.fast_dropout, env.device_type),
        onednn_f32=resolve_onednn_f32(cfg.onednn_f32, env.device_type),
        data_loader=loader_kind(meta, cfg.data_loader),
        hellaswag_interval=hellaswag_interval,
        **shape,
    )


def build_model(cfg: TrainConfig, start: Start) -> GPT:
    """The network with its dropout draws and float32 CPU products set: the Hugging Face weights already loaded, or a
    new GPT (the checkpoint's weights put in)."""
    model = start.model or GPT(GPTConfig(**start.args, dropout=cfg.dropout))
    model.use_fast_dropout(cfg.fast_dropout)
    model.use_onednn_f32(cfg.onednn_f32)
    if start.ckpt is not None:
        load_model_state(model, start.ckpt["model"], start.source)
    return model


def check_memory(cfg: TrainConfig, env: DistEnv, args: dict[str, Any]) -> MemoryEstimate:
    """The estimate of what training needs per process; a model that cannot train here stops before anything is
    allocated (exit 2 naming the keys to lower)."""
    shards = env.world_size if env.fsdp(cfg.parallel) else 1
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if env.device_type == "cpu" else 1
    estimate = training_estimate(
        args, cfg.batch_size, cfg.dtype, cfg.optimizer, env.device_type, cfg.dropout, cfg.fast_dropout, cfg.compile,
        shards,
    )  # fmt: skip
    check_fits(estimate, *available_memory(env.device, processes))
    return estimate


def training_estimate(
    args: dict[str, Any],
    batch_size: int,
    dtype: str,
    optimizer: str,
    device_type: str,
    dropout: float,
    fast_dropout: bool,
    compiled: bool,
    shards: int = 1,
) -> MemoryEstimate:
    """core/memory.estimate_training_memory with what this device's training path keeps: the head's loss step where
    it is taken (kernels/head_loss) and the attention's T x T scores (kernels/attention.saved_score_bytes). dtype,
    fast_dropout and compiled as resolved for the device; check_memory and `gptforge bench` both estimate so."""
    head = head_loss_used(device_type, args["vocab_size"], dtype != "float32", args.get("logit_softcap", 0))
    bf16 = dtype == "bfloat16"
    scores = saved_score_bytes(args["block_size"], args["n_head"], dropout, fast_dropout, device_type, bf16, compiled)
    return estimate_training_memory(args, batch_size, dtype, optimizer, shards, head, scores)


NOT_CHANGES = ("init_from", "resume")  # a resumed run's init_from is 'resume', whatever started it


def resume_changes(cfg: TrainConfig, saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (the run's value, this start's value)} for every setting a resume changes; `saved`: the settings the
    checkpoint was written with (its `config`, as the run's config.json held them)."""
    return {
        k: (saved[k], getattr(cfg, k))
        for k in FIELDS
        if k in saved and k not in NOT_CHANGES and saved[k] != getattr(cfg, k)
    }
