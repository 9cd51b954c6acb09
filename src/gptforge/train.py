"""The training loop: nanoGPT's train.py as a function of a TrainConfig.

    gptforge train config/train_shakespeare_char.py --device=cpu --compile=False --max_iters=2000
    torchrun --standalone --nproc_per_node=4 -m gptforge train config/train_gpt2.py

Each step: learning rate from the schedule; an evaluation every eval_interval (and at the last step) that
checkpoints when val loss improves or always_save_checkpoint; gradient_accumulation_steps micro-batches under
autocast, the next batch fetched while the current one computes; unscale, clip, AdamW step; a log line.
On the README CPU recipe expect val loss ~1.88 after 2000 steps. SIGINT / SIGTERM finish the current step,
write a checkpoint and return; a second signal stops at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gptforge.checkpoint import (
    FORMAT_VERSION,
    capture_rng,
    full_states,
    gather,
    load_model_state,
    load_optimizer_state,
    load_resumable,
    remove_stale_temporaries,
    restore_run_state,
    rotate_step_checkpoints,
    step_checkpoint_name,
)
from gptforge.checkpoint import save_checkpoint as write_checkpoint
from gptforge.config import TrainConfig
from gptforge.data.loader import RandomBatches, ShardedBatches, dataset_dir, read_meta, split_files
from gptforge.distributed import (
    DistEnv,
    StopFlag,
    all_reduce_mean,
    autocast_context,
    configure_backends,
    peak_flops,
    resolve_compile,
    resolve_dtype,
    setup_distributed,
    step_is_finite,
    teardown,
)
from gptforge.errors import UserError
from gptforge.evaluate.hellaswag import check_tokenizer, evaluate_hellaswag, hellaswag_file, load_examples
from gptforge.evaluate.loss import estimate_loss
from gptforge.metrics import Metrics
from gptforge.model import GPT, MODEL_ARGS, GPTConfig, model_vocab_size
from gptforge.optim import accumulate_gradients, configure_optimizer, get_lr
from gptforge.sample import Sampler
from gptforge.tokenizer import from_spec, tokenizer_spec


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns {'iter_num', 'best_val_loss', 'losses'} (the last evaluation)."""
    env = setup_distributed(cfg.device, cfg.backend)
    try:
        result = _train(cfg, env)
        if env.ddp:  # leave together: no rank tears its process group down while rank 0 still writes files
            torch.distributed.barrier()
        return result
    finally:
        teardown(env)


def _train(cfg: TrainConfig, env: DistEnv) -> dict[str, Any]:
    cfg = dataclasses.replace(cfg, device=env.device)
    cfg.dtype = resolve_dtype(cfg.dtype, env.device_type, cfg.n_embd)
    cfg.compile = resolve_compile(cfg.compile, env.device_type)
    if cfg.gradient_accumulation_steps % env.world_size:
        raise UserError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} (micro-batches per step over all "
            f"processes) does not divide across {env.world_size} processes; make it a multiple of {env.world_size}"
        )
    accum = cfg.gradient_accumulation_steps // env.world_size
    torch.manual_seed(cfg.seed)  # every rank builds the same initial weights (FSDP keeps each rank's shard of them)
    configure_backends(env.device_type)

    folder = dataset_dir(cfg.data_dir, cfg.dataset)
    meta = read_meta(folder)
    if cfg.hellaswag_interval > 0 and meta["tokenizer"] != "gpt2":  # e.g. --eval_freq on a char-level dataset
        if env.is_main:
            print(f"hellaswag_interval={cfg.hellaswag_interval} ignored: HellaSwag needs GPT-2 BPE tokens and dataset "
                  f"{cfg.dataset!r} is {meta['tokenizer']}-level", flush=True)
        cfg.hellaswag_interval = 0
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt, source = None, ckpt_path
    if cfg.init_from == "resume":
        ckpt, source, problems = load_resumable(cfg.out_dir, map_location=env.device)
        if problems and env.is_main:
            print(f"{'; '.join(problems)}\nresuming from {source} (iter {ckpt['iter_num']}) instead", flush=True)
        if ckpt.get("tokenizer") not in (None, tokenizer_spec(meta)):  # nanoGPT's checkpoints have none
            raise UserError(f"{source} was trained with another vocabulary than dataset {cfg.dataset!r} has; resume "
                            "on the dataset the model was trained on (--dataset, --data_dir)")
    model, model_args = build_model(cfg, meta, ckpt, source)
    if env.rank:
        torch.manual_seed(cfg.seed + env.rank)  # then each rank its own stream: batches and dropout differ
    model.to(env.device)
    fsdp = env.ddp and cfg.parallel == "fsdp"
    if fsdp and cfg.hellaswag_interval > 0:
        # ranks score different numbers of batches, and every forward of a sharded model needs all ranks
        raise UserError("--hellaswag_interval does not work with --parallel=fsdp yet; use parallel=ddp, or evaluate "
                        "the checkpoint afterwards with `gptforge eval hellaswag`")
    if fsdp:  # before the optimizer: it must hold the sharded parameters
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)

    scaler = torch.amp.GradScaler(env.device_type, enabled=cfg.dtype == "float16")
    optimizer = configure_optimizer(model, cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), env.device_type)
    iter_num, best_val_loss = 0, float("inf")
    sharded = cfg.data_loader == "sharded" or (cfg.data_loader == "auto" and meta.get("format") == "shards")
    cfg.data_loader = "sharded" if sharded else "random"
    if sharded:
        # Sequential windows in one global order (see ShardedBatches); each evaluation reads the same windows,
        # split across ranks, eval_iters batches in all.
        def shard_batches(split: str, micro: int) -> ShardedBatches:
            return ShardedBatches(split_files(folder, split, meta), cfg.batch_size, cfg.block_size,
                                  model_args["vocab_size"], env.device, micro, env.rank, env.world_size, cfg.seed,
                                  meta["dtype"])

        train_batches = shard_batches("train", accum)
        eval_loaders = lambda: {split: shard_batches(split, 1) for split in ("train", "val")}  # noqa: E731
        eval_iters = -(-cfg.eval_iters // env.world_size)
    else:
        # Batches and evaluation draw from torch's global generator in nanoGPT's order, so a nanoGPT command
        # gives nanoGPT's losses (README CPU recipe: val 1.8858 at step 2000 here, nanoGPT 1.8857).
        random_batches = {split: RandomBatches(os.path.join(folder, f"{split}.bin"), cfg.batch_size, cfg.block_size,
                                               model_args["vocab_size"], env.device, dtype=meta["dtype"])
                          for split in ("train", "val")}
        train_batches = random_batches["train"]
        eval_loaders, eval_iters = (lambda: random_batches), cfg.eval_iters
    if ckpt is not None:
        load_optimizer_state(model, optimizer, ckpt, fsdp, source)
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        iter_num, best_val_loss = int(ckpt["iter_num"]), float(ckpt["best_val_loss"])
        restore_run_state(ckpt, env, train_batches)
    next_data_state = train_batches.state_dict()  # the state that yields X, Y below: what a resume must restore
    X, Y = train_batches.next_batch()  # (its token ids are checked against the vocabulary here, before any write)
    # a sharded model needs every rank in each forward pass, so under FSDP all ranks sample (rank 0 logs)
    sampler = Sampler(cfg, meta, env) if cfg.sample_interval > 0 and (env.is_main or fsdp) else None
    if cfg.hellaswag_interval > 0:  # checked and loaded up front: a mistake shows before any training
        hs_tok = from_spec(tokenizer_spec(meta))
        check_tokenizer(hs_tok)
        hs_examples = load_examples(hellaswag_file(cfg.hellaswag_path or None), cfg.hellaswag_limit or None)
    if env.is_main:  # every input is checked by now: a mistake above leaves the run folder as it was
        prepare_out_dir(cfg)  # config.json once every 'auto' is resolved
    wandb = None
    if cfg.wandb_log:
        wandb = dict(project=cfg.wandb_project, name=cfg.wandb_run_name, config=dataclasses.asdict(cfg),
                     id=ckpt.get("wandb_run_id") if ckpt else None)
    metrics = Metrics(cfg.out_dir, enabled=env.is_main, resume_step=iter_num if ckpt else None, wandb=wandb,
                      tensorboard=cfg.tensorboard_log)
    cleanup = contextlib.ExitStack()  # what must close on every way out, errors included
    cleanup.enter_context(contextlib.closing(metrics))
    if cfg.dashboard and env.is_main:
        from gptforge.dashboard import start_dashboard  # standard library only: cheap to import

        try:
            server, url = start_dashboard([cfg.out_dir], "127.0.0.1", cfg.dashboard_port)
        except UserError as e:
            raise UserError(f"--dashboard_port={cfg.dashboard_port}: {e}") from None
        cleanup.callback(server.stop)
        metrics.info(f"dashboard: open {url} (it stops when training ends)")
    del ckpt  # the optimizer and model hold their own copies now

    raw_model = model
    if cfg.compile:
        metrics.info("compiling the model with torch.compile (the first step takes a while)...")
        model = torch.compile(model)
    sync = None
    if fsdp:
        sync = raw_model.set_requires_gradient_sync
    elif env.ddp:
        model = DDP(model, device_ids=[env.local_rank] if env.device_type == "cuda" else None)
        sync = lambda last: setattr(model, "require_backward_grad_sync", last)  # noqa: E731
    ctx = autocast_context(env.device_type, cfg.dtype)
    tokens_per_iter = accum * env.world_size * cfg.batch_size * cfg.block_size
    metrics.info(
        f"model: {raw_model.get_num_params() / 1e6:.2f}M parameters | device {env.device}, dtype {cfg.dtype}, "
        f"compile {cfg.compile}, {env.world_size} process(es)\n"
        f"tokens per iteration: {tokens_per_iter:,} = {accum} accumulation x {env.world_size} processes x "
        f"{cfg.batch_size} batch x {cfg.block_size} block"
    )
    peak = peak_flops(env.device, cfg.dtype, cfg.peak_flops) if env.is_main else 1.0  # only rank 0 reports MFU

    def checkpoint(reason: str, latest: bool = True, best: bool = False, step: int | None = None) -> None:
        """ckpt.pt (latest), ckpt_best.pt and the step checkpoint model_{step:05d}.pt, as asked: one state."""
        rngs, data_states = gather(capture_rng(), env), gather(next_data_state, env)  # every rank's, on rank 0
        model_state, optimizer_state = full_states(raw_model, optimizer, fsdp)  # all ranks take part under FSDP
        if not env.is_main:
            return
        paths = [ckpt_path] if latest else []
        paths += [os.path.join(cfg.out_dir, "ckpt_best.pt")] if best else []
        paths += [os.path.join(cfg.out_dir, step_checkpoint_name(step))] if step is not None else []
        write_checkpoint(paths[0], {
            "model": model_state, "optimizer": optimizer_state, "optimizer_format": "fqn" if fsdp else "torch",
            "model_args": model_args,
            "iter_num": iter_num, "best_val_loss": best_val_loss, "config": dataclasses.asdict(cfg),
            "scaler": scaler.state_dict(), "rng": rngs[0], "rng_per_rank": rngs,
            "data_state": {"train": data_states[0], "train_per_rank": data_states},
            "tokenizer": tokenizer_spec(meta), "wandb_run_id": metrics.wandb_id, "format_version": FORMAT_VERSION,
        }, copies=paths[1:])
        if step is not None:
            rotate_step_checkpoints(cfg.out_dir, cfg.keep_last)
        names = ", ".join(os.path.basename(p) for p in paths)
        metrics.info(f"saved checkpoint {names} in {cfg.out_dir} at iter {iter_num} ({reason})")

    losses: dict[str, float] = {}
    step_time, steps_timed, ema_dt, running_mfu = 0.0, 0, None, -1.0
    stop, bad_steps, start_iter = StopFlag(env), 0, iter_num
    with stop, cleanup:
        while True:
            lr = get_lr(iter_num, cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr, cfg.decay_lr,
                        cfg.lr_schedule, cfg.decay_frac)
            for group in optimizer.param_groups:
                group["lr"] = lr
            last = iter_num >= cfg.max_iters
            write_latest = improved = False
            if (iter_num % cfg.eval_interval == 0 or last or cfg.eval_only) and not stop.requested:
                reduce = (lambda t: all_reduce_mean(t, env)) if env.ddp else None
                losses = estimate_loss(model, eval_loaders(), eval_iters, ctx, reduce=reduce)
                metrics.log(iter_num, "eval", train_loss=losses["train"], val_loss=losses["val"], lr=lr)
                improved = losses["val"] < best_val_loss
                best_val_loss = min(best_val_loss, losses["val"])
                write_latest = improved or cfg.always_save_checkpoint
            # build-nanogpt's names: model_05000.pt after 5000 steps; the last one is named for the last step taken
            step_ckpt = cfg.ckpt_interval > 0 and (iter_num % cfg.ckpt_interval == 0 or last) and not stop.requested
            fresh = iter_num > start_iter and not cfg.eval_only  # the state resumed from is on disk already
            saved = fresh and write_latest
            if fresh and (write_latest or step_ckpt):
                reason = "val loss improved" if improved else "always_save_checkpoint" if saved else "ckpt_interval"
                checkpoint(reason, latest=write_latest, best=improved,
                           step=(iter_num - 1 if last else iter_num) if step_ckpt else None)
            if cfg.hellaswag_interval > 0 and (iter_num % cfg.hellaswag_interval == 0 or last) and not stop.requested:
                # the uncompiled model: evaluation shapes vary, and compiling each of them would cost more
                hs = evaluate_hellaswag(raw_model, hs_tok, hs_examples, env.device, ctx, rank=env.rank,
                                        world_size=env.world_size, progress=env.is_main)
                metrics.log(iter_num, "hellaswag", acc=hs["acc"], acc_norm=hs["acc_norm"], n=hs["n"])
            if sampler and ((iter_num > 0 and iter_num % cfg.sample_interval == 0) or last) and not stop.requested:
                metrics.log_samples(iter_num, sampler.text, sampler.sample(raw_model, ctx))
            if last or cfg.eval_only:
                if last and not cfg.eval_only:
                    metrics.log(iter_num, "end", reason="max_iters reached")  # the dashboard reads: finished
                break
            if stop.requested:
                if not saved:
                    checkpoint("stop requested")
                metrics.info(f"stopped at iter {iter_num}; continue with --init_from=resume")
                break

            t0 = time.perf_counter()
            loss_sum, X, Y, next_data_state = accumulate_gradients(model, X, Y, train_batches, accum, ctx, scaler,
                                                                   sync)
            scaler.unscale_(optimizer)  # clip and check the true gradients, not the loss-scaled ones
            # the norm is measured even without clipping (an infinite max_norm scales by exactly 1): the NaN guard
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP
            if step_is_finite(loss_sum, grad_norm, scaler.is_enabled(), env):
                scaler.step(optimizer)
                bad_steps = 0
            else:  # the weights and the optimizer state stay as they were
                bad_steps += 1
                metrics.log(iter_num, "skip", loss=all_reduce_mean(loss_sum, env).item(), grad_norm=float(grad_norm),
                            in_a_row=bad_steps, max_bad_steps=cfg.max_bad_steps)
                if bad_steps >= cfg.max_bad_steps:
                    raise UserError(
                        f"iter {iter_num}: the loss or gradient norm was not finite {bad_steps} steps in a row "
                        f"(--max_bad_steps={cfg.max_bad_steps}); they were skipped and the run stops here. The last "
                        f"good checkpoint is intact in {cfg.out_dir}: try a lower --learning_rate, --grad_clip, or "
                        "dtype float32 / bfloat16 before continuing with --init_from=resume"
                    )
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

            if bad_steps:
                step_time += time.perf_counter() - t0
                steps_timed += 1
            elif iter_num % cfg.log_interval == 0:
                lossf = all_reduce_mean(loss_sum, env).item()  # the one host sync of a logged step
                step_time += time.perf_counter() - t0
                steps_timed += 1
                dt = step_time / steps_timed
                step_time, steps_timed = 0.0, 0
                ema_dt = dt if ema_dt is None else 0.9 * ema_dt + 0.1 * dt
                if iter_num >= 5:  # the first steps include warm-up and would drag the average down
                    mfu = raw_model.estimate_mfu(cfg.batch_size * accum, dt, peak)
                    running_mfu = mfu if running_mfu < 0 else 0.9 * running_mfu + 0.1 * mfu
                metrics.log(
                    iter_num, "train", loss=lossf, lr=lr, grad_norm=float(grad_norm),
                    ms_per_iter=dt * 1000, tokens_per_s=tokens_per_iter / dt,
                    mfu=running_mfu if running_mfu >= 0 else None, eta_s=ema_dt * (cfg.max_iters - iter_num - 1),
                )
            else:
                step_time += time.perf_counter() - t0
                steps_timed += 1
            iter_num += 1
            stop.sync()
    return {"iter_num": iter_num, "best_val_loss": best_val_loss, "losses": losses}


def build_model(cfg: TrainConfig, meta: dict[str, Any], ckpt: dict[str, Any] | None, ckpt_path: str):
    """A new model sized from the config and the dataset's vocabulary, the checkpoint's model on resume, or
    GPT-2's weights."""
    model = None
    if cfg.init_from not in ("scratch", "resume"):
        model, model_args = pretrained_model(cfg, meta)
    elif ckpt is None:
        model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                          bias=cfg.bias, vocab_size=model_vocab_size(meta))
    else:
        model_args = {k: ckpt["model_args"][k] for k in MODEL_ARGS}
    if cfg.init_from != "scratch":
        for key in MODEL_ARGS:  # the source's shape wins; record it so config.json tells the truth
            if key != "vocab_size":
                setattr(cfg, key, model_args[key])
    if meta["vocab_size"] > model_args["vocab_size"]:
        raise UserError(
            f"dataset {cfg.dataset!r} has vocab_size {meta['vocab_size']} but the model only "
            f"{model_args['vocab_size']}; resume on the dataset the model was trained on"
        )
    if model is None:
        model = GPT(GPTConfig(**model_args, dropout=cfg.dropout))
        if ckpt is not None:
            load_model_state(model, ckpt["model"], ckpt_path)
    return model, model_args


def pretrained_model(cfg: TrainConfig, meta: dict[str, Any]):
    """GPT-2's weights (a hub name or a local Hugging Face folder) to fine-tune; block_size cropped if smaller."""
    from gptforge.pretrained import load_pretrained

    if meta["tokenizer"] != "gpt2":
        raise UserError(
            f"--init_from={cfg.init_from} starts from GPT-2, which reads GPT-2 BPE tokens, but dataset {cfg.dataset!r} "
            f"is {meta['tokenizer']}-level: prepare it with GPT-2 BPE (`gptforge prepare shakespeare`, or "
            "`gptforge prepare text FILE --tokenizer gpt2`)"
        )
    model, model_args = load_pretrained(cfg.init_from, dropout=cfg.dropout, block_size=cfg.block_size)
    return model, {k: model_args[k] for k in MODEL_ARGS}


def prepare_out_dir(cfg: TrainConfig) -> None:
    """Create out_dir and write the resolved config.json (atomically)."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        remove_stale_temporaries(cfg.out_dir)  # left by a run killed while writing a checkpoint
        path = os.path.join(cfg.out_dir, "config.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)
            fh.write("\n")
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise UserError(f"--out_dir={cfg.out_dir}: cannot write there ({e.strerror}); choose another folder") from None
