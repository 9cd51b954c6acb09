"""The parts train.setup() assembles: the model's source (new, resumed, GPT-2), the resolved config, batches and
evaluators, sinks, and the wrapped model the step calls."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gptforge.core.config import TrainConfig
from gptforge.core.device import available_memory, resolve_compile, resolve_dtype, resolve_fast_dropout
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.core.files import CONFIG, atomic_write
from gptforge.data.loader import Batches, loader_kind, make_batches
from gptforge.evaluate.hellaswag import check_tokenizer, evaluate_hellaswag, hellaswag_file, load_examples
from gptforge.model.gpt import GPT, MODEL_ARGS, GPTConfig, model_args, model_vocab_size
from gptforge.tokenizer.spec import from_spec, tokenizer_spec
from gptforge.train.memory import MemoryEstimate, check_fits, estimate_training_memory
from gptforge.train.metrics import Metrics
from gptforge.train.resume import resume_changes
from gptforge.weights.checkpoint import (
    checkpoint_model_args,
    load_model_state,
    load_optimizer_state,
    load_resumable,
    remove_stale_temporaries,
    restore_run_state,
)


def resume_checkpoint(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """When the run continues (init_from='resume', which --resume=auto sets when out_dir has a checkpoint): the
    checkpoint to continue (ckpt.pt, or the newest readable fallback; with --resume=auto the newest readable) and
    its path. Rank 0 says first which it is, and under torchrun which restart this is."""
    auto = cfg.resume == "auto"
    if env.is_main and env.restart:
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        print(f"torchrun restart {env.restart} (of --max-restarts={limit})", flush=True)
    if cfg.init_from != "resume":
        if env.is_main and auto:
            print(f"resume=auto: no checkpoint in {cfg.out_dir}; a new run (init_from={cfg.init_from})", flush=True)
        return None, ""
    ckpt, source, problems = load_resumable(cfg.out_dir, map_location=env.device, newest=auto)
    if env.is_main:
        for problem in problems:
            print(problem, flush=True)
        newest = " (the newest readable checkpoint)" if problems or auto else ""
        prefix = "resume=auto: " if auto else ""
        print(f"{prefix}resuming {cfg.out_dir} from iter {ckpt['iter_num']} ({source}){newest}", flush=True)
        changes = resume_changes(cfg)
        if changes:
            shown = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
            print(f"changed from the run's config.json: {shown}", flush=True)
    if ckpt.get("tokenizer") not in (None, tokenizer_spec(meta)):  # nanoGPT's checkpoints have none
        raise UserError(
            f"{source} was trained with another vocabulary than dataset {cfg.dataset!r} has; resume "
            "on the dataset the model was trained on (--dataset, --data_dir)"
        )
    return ckpt, source


def build_model(
    cfg: TrainConfig, env: DistEnv, meta: dict[str, Any], ckpt: dict[str, Any] | None, source: str
) -> tuple[GPT, dict[str, Any]]:
    """A new model sized from the config and the dataset's vocabulary, the checkpoint's model, or GPT-2's."""
    if cfg.init_from not in ("scratch", "resume"):
        model, args = pretrained_model(cfg, meta)
    else:
        args = checkpoint_model_args(ckpt) if ckpt is not None else model_args(cfg, model_vocab_size(meta))
        model = None
    if meta["vocab_size"] > args["vocab_size"]:
        raise UserError(
            f"dataset {cfg.dataset!r} has vocab_size {meta['vocab_size']} but the model only "
            f"{args['vocab_size']}; resume on the dataset the model was trained on"
        )
    check_memory(cfg, env, args)
    if model is None:
        model = GPT(GPTConfig(**args, dropout=cfg.dropout))
        if ckpt is not None:
            load_model_state(model, ckpt["model"], source)
    return model, args


def memory_estimate(cfg: TrainConfig, env: DistEnv, model_args: dict[str, Any]) -> MemoryEstimate:
    shards = env.world_size if env.ddp and cfg.parallel == "fsdp" else 1
    return estimate_training_memory(model_args, cfg.batch_size, cfg.dtype, shards)


def check_memory(cfg: TrainConfig, env: DistEnv, model_args: dict[str, Any]) -> None:
    """Stop before allocating a model that cannot train here (exit 2 naming the keys to lower)."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if env.device_type == "cpu" else 1
    check_fits(memory_estimate(cfg, env, model_args), *available_memory(env.device, processes))


def pretrained_model(cfg: TrainConfig, meta: dict[str, Any]) -> tuple[GPT, dict[str, Any]]:
    """GPT-2's weights (a hub name or a local Hugging Face folder), or a NanoChat folder's, to fine-tune;
    block_size cropped if smaller."""
    from gptforge.weights.pretrained import load_pretrained

    if meta["tokenizer"] != "gpt2":
        raise UserError(
            f"--init_from={cfg.init_from} starts from Hugging Face weights, which read GPT-2 BPE tokens, but "
            f"dataset {cfg.dataset!r} is {meta['tokenizer']}-level: prepare it with GPT-2 BPE (`gptforge prepare "
            "shakespeare`, or `gptforge prepare text FILE --tokenizer gpt2`)"
        )
    model, args = load_pretrained(cfg.init_from, dropout=cfg.dropout, block_size=cfg.block_size)
    return model, {k: args[k] for k in MODEL_ARGS}


def resolve_config(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any], model_args: dict[str, Any]) -> TrainConfig:
    """The settings the run uses, as config.json and every checkpoint record them: each 'auto' decided for this
    device and dataset, HellaSwag off for a dataset it cannot read, and the shape of a resumed or GPT-2 model."""
    hellaswag_interval = cfg.hellaswag_interval
    if hellaswag_interval > 0 and meta["tokenizer"] != "gpt2":  # e.g. --eval_freq on a char-level dataset
        if env.is_main:
            print(
                f"hellaswag_interval={hellaswag_interval} ignored: HellaSwag needs GPT-2 BPE tokens and dataset "
                f"{cfg.dataset!r} is {meta['tokenizer']}-level",
                flush=True,
            )
        hellaswag_interval = 0
    shape = {k: model_args[k] for k in MODEL_ARGS if k != "vocab_size"} if cfg.init_from != "scratch" else {}
    return dataclasses.replace(
        cfg,
        device=env.device,
        dtype=resolve_dtype(cfg.dtype, env.device_type, cfg.n_embd),
        compile=resolve_compile(cfg.compile, env.device_type),
        fast_dropout=resolve_fast_dropout(cfg.fast_dropout, env.device_type),
        data_loader=loader_kind(meta, cfg.data_loader),
        hellaswag_interval=hellaswag_interval,
        **shape,
    )


def place_model(model: GPT, device: str, fsdp: bool) -> None:
    """Move the model to its device; under FSDP shard each block and the root across the ranks."""
    model.to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)


def open_batches(
    cfg: TrainConfig, env: DistEnv, folder: str, meta: dict[str, Any], vocab_size: int, accum: int
) -> tuple[Batches, Callable[[], dict[str, Batches]], int]:
    """The training batches, the loaders of one evaluation (by split), and its batches per split and rank."""
    open_split = functools.partial(
        make_batches,
        folder,
        meta,
        kind=cfg.data_loader,
        batch_size=cfg.batch_size,
        block_size=cfg.block_size,
        vocab_size=vocab_size,
        device=env.device,
        seed=cfg.seed,
        global_rng=True,
        rank=env.rank,
        world_size=env.world_size,
    )
    train_batches = open_split("train", micro_per_rank=accum)
    if cfg.data_loader == "sharded":

        def eval_batches() -> dict[str, Batches]:  # each evaluation: the first windows of each split, over the ranks
            return {split: open_split(split) for split in ("train", "val")}

        return train_batches, eval_batches, -(-cfg.eval_iters // env.world_size)
    # nanoGPT: evaluation batches from torch's global generator, drawn in its order between the training batches,
    # so a nanoGPT command gives nanoGPT's losses (docs/ARCHITECTURE.md, "Randomness and exact resume")
    fixed = {"train": train_batches, "val": open_split("val")}
    return train_batches, fixed.copy, cfg.eval_iters


def restore(
    ckpt: dict[str, Any],
    source: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: Batches,
    env: DistEnv,
    fsdp: bool,
    seed: int,
) -> tuple[int, float]:
    """A resumed run's optimizer, loss scale, RNGs and data position; returns (iter_num, best_val_loss)."""
    load_optimizer_state(model, optimizer, ckpt, fsdp, source)
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    told = restore_run_state(ckpt, env, batches, seed)
    if told and env.is_main:
        print(told, flush=True)
    return int(ckpt["iter_num"]), float(ckpt["best_val_loss"])


def hellaswag_task(cfg: TrainConfig, env: DistEnv, meta: dict[str, Any]) -> Callable[..., dict[str, Any]] | None:
    """HellaSwag scoring during training, its examples loaded (and checked) before any training."""
    if cfg.hellaswag_interval <= 0:
        return None
    tokenizer = from_spec(tokenizer_spec(meta))
    check_tokenizer(tokenizer)
    examples = load_examples(hellaswag_file(cfg.hellaswag_path or None), cfg.hellaswag_limit or None)
    return functools.partial(
        evaluate_hellaswag,
        tokenizer=tokenizer,
        examples=examples,
        device=env.device,
        rank=env.rank,
        world_size=env.world_size,
        progress=env.is_main,
    )


def prepare_out_dir(cfg: TrainConfig) -> None:
    """Create out_dir and write the resolved config.json."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        remove_stale_temporaries(cfg.out_dir)  # left by a run killed while writing a checkpoint
        with atomic_write(os.path.join(cfg.out_dir, CONFIG), "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)
            fh.write("\n")
    except OSError as e:
        raise UserError(f"--out_dir={cfg.out_dir}: cannot write there ({e.strerror}); choose another folder") from None


def open_sinks(cfg: TrainConfig, env: DistEnv, ckpt: dict[str, Any] | None) -> tuple[Metrics, contextlib.ExitStack]:
    """Metrics (console, files, wandb, TensorBoard) and the dashboard, with what closes them."""
    wandb = None
    if cfg.wandb_log:
        wandb = dict(
            project=cfg.wandb_project,
            name=cfg.wandb_run_name,
            config=dataclasses.asdict(cfg),
            id=ckpt.get("wandb_run_id") if ckpt else None,
        )
    with contextlib.ExitStack() as cleanup:
        metrics = Metrics(
            cfg.out_dir,
            enabled=env.is_main,
            resume_step=int(ckpt["iter_num"]) if ckpt else None,
            wandb=wandb,
            tensorboard=cfg.tensorboard_log,
        )
        cleanup.enter_context(contextlib.closing(metrics))
        if cfg.dashboard and env.is_main:
            from gptforge.dashboard import start_dashboard  # standard library only: cheap to import

            try:
                server, url = start_dashboard([cfg.out_dir], "127.0.0.1", cfg.dashboard_port)
            except UserError as e:
                raise UserError(f"--dashboard_port={cfg.dashboard_port}: {e}") from None
            cleanup.callback(server.stop)
            metrics.info(f"dashboard: open {url} (it stops when training ends)")
        return metrics, cleanup.pop_all()


def compile_and_wrap(model: GPT, cfg: TrainConfig, env: DistEnv, fsdp: bool, metrics: Metrics) -> torch.nn.Module:
    """What the training step calls: the model compiled when asked, inside DDP with several processes (FSDP
    shards the model itself)."""
    if cfg.compile:
        metrics.info("compiling the model with torch.compile (the first step takes a while)...")
        model = torch.compile(model)
    if env.ddp and not fsdp:
        model = DDP(model, device_ids=[env.local_rank] if env.device_type == "cuda" else None)
    return model


def gradient_sync(model: torch.nn.Module, raw_model: GPT, env: DistEnv, fsdp: bool) -> Callable[[bool], None] | None:
    """What accumulate_gradients calls before each micro-batch, so that gradients are reduced on the last only."""
    if fsdp:
        return raw_model.set_requires_gradient_sync
    if not env.ddp:
        return None

    def sync(last: bool) -> None:
        model.require_backward_grad_sync = last

    return sync
