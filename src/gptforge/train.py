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
import signal
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gptforge.checkpoint import FORMAT_VERSION, capture_rng, load_checkpoint, load_model_state, restore_rng
from gptforge.checkpoint import save_checkpoint as write_checkpoint
from gptforge.config import FIELDS, TrainConfig
from gptforge.data.loader import RandomBatches, ShardedBatches, dataset_dir, read_meta, split_files
from gptforge.distributed import (
    DistEnv,
    all_reduce_mean,
    autocast_context,
    configure_backends,
    peak_flops,
    resolve_compile,
    resolve_dtype,
    setup_distributed,
    teardown,
)
from gptforge.errors import UserError
from gptforge.evaluate.hellaswag import check_tokenizer, evaluate_hellaswag, hellaswag_file, load_examples
from gptforge.evaluate.loss import estimate_loss
from gptforge.metrics import Metrics
from gptforge.model import GPT, MODEL_ARGS, GPTConfig
from gptforge.optim import accumulate_gradients, configure_optimizer, get_lr
from gptforge.tokenizer import from_spec


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns {'iter_num', 'best_val_loss', 'losses'} (the last evaluation)."""
    env = setup_distributed(cfg.device, cfg.backend)
    try:
        return _train(cfg, env)
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
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = load_checkpoint(ckpt_path, map_location=env.device) if cfg.init_from == "resume" else None
    model, model_args = build_model(cfg, meta, ckpt, ckpt_path)
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
        load_optimizer_state(model, optimizer, ckpt, fsdp, ckpt_path)
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        iter_num, best_val_loss = int(ckpt["iter_num"]), float(ckpt["best_val_loss"])
        restore_run_state(ckpt, env, train_batches)
    if env.is_main:
        prepare_out_dir(cfg)  # config.json once every 'auto' is resolved
    wandb = None
    if cfg.wandb_log:
        wandb = dict(project=cfg.wandb_project, name=cfg.wandb_run_name, config=dataclasses.asdict(cfg),
                     id=ckpt.get("wandb_run_id") if ckpt else None)
    metrics = Metrics(cfg.out_dir, enabled=env.is_main, resume_step=iter_num if ckpt else None, wandb=wandb,
                      tensorboard=cfg.tensorboard_log)
    # a sharded model needs every rank in each forward pass, so under FSDP all ranks sample (rank 0 logs)
    sampler = Sampler(cfg, meta, env) if cfg.sample_interval > 0 and (env.is_main or fsdp) else None
    if cfg.hellaswag_interval > 0:  # checked and loaded up front: a mistake shows before any training
        hs_tok = from_spec(tokenizer_spec(meta))
        check_tokenizer(hs_tok)
        hs_examples = load_examples(hellaswag_file(cfg.hellaswag_path or None), cfg.hellaswag_limit or None)
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

    def checkpoint(reason: str) -> None:
        rngs, data_states = gather(capture_rng(), env), gather(next_data_state, env)  # every rank's, on rank 0
        model_state, optimizer_state = full_states(raw_model, optimizer, fsdp)  # all ranks take part under FSDP
        if not env.is_main:
            return
        write_checkpoint(ckpt_path, {
            "model": model_state, "optimizer": optimizer_state, "optimizer_format": "fqn" if fsdp else "torch",
            "model_args": model_args,
            "iter_num": iter_num, "best_val_loss": best_val_loss, "config": dataclasses.asdict(cfg),
            "scaler": scaler.state_dict(), "rng": rngs[0], "rng_per_rank": rngs,
            "data_state": {"train": data_states[0], "train_per_rank": data_states},
            "tokenizer": tokenizer_spec(meta), "wandb_run_id": metrics.wandb_id, "format_version": FORMAT_VERSION,
        })
        metrics.info(f"saved checkpoint {ckpt_path} at iter {iter_num} ({reason})")

    next_data_state = train_batches.state_dict()  # the state that yields X, Y below: what a resume must restore
    X, Y = train_batches.next_batch()
    losses: dict[str, float] = {}
    step_time, steps_timed, ema_dt, running_mfu = 0.0, 0, None, -1.0
    stop = StopFlag(env)
    with stop, cleanup:
        while True:
            lr = get_lr(iter_num, cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr, cfg.decay_lr,
                        cfg.lr_schedule, cfg.decay_frac)
            for group in optimizer.param_groups:
                group["lr"] = lr
            last = iter_num >= cfg.max_iters
            saved = False
            if (iter_num % cfg.eval_interval == 0 or last or cfg.eval_only) and not stop.requested:
                reduce = (lambda t: all_reduce_mean(t, env)) if env.ddp else None
                losses = estimate_loss(model, eval_loaders(), eval_iters, ctx, reduce=reduce)
                metrics.log(iter_num, "eval", train_loss=losses["train"], val_loss=losses["val"], lr=lr)
                improved = losses["val"] < best_val_loss
                best_val_loss = min(best_val_loss, losses["val"])
                if (improved or cfg.always_save_checkpoint) and iter_num > 0 and not cfg.eval_only:
                    checkpoint("val loss improved" if improved else "always_save_checkpoint")
                    saved = True
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
            grad_norm = None
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
                grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

            if iter_num % cfg.log_interval == 0:
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
                    iter_num, "train", loss=lossf, lr=lr,
                    grad_norm=float(grad_norm) if grad_norm is not None else None,
                    ms_per_iter=dt * 1000, tokens_per_s=tokens_per_iter / dt,
                    mfu=running_mfu if running_mfu >= 0 else None, eta_s=ema_dt * (cfg.max_iters - iter_num - 1),
                )
            else:
                step_time += time.perf_counter() - t0
                steps_timed += 1
            iter_num += 1
            stop.sync()
    return {"iter_num": iter_num, "best_val_loss": best_val_loss, "losses": losses}


class Sampler:
    """Text samples during training from a private generator (seed 42 + rank): training's RNG is untouched."""

    def __init__(self, cfg: TrainConfig, meta: dict[str, Any], env: DistEnv):
        self.tok, self.text = from_spec(tokenizer_spec(meta)), cfg.sample_prompt
        try:
            self.prompt = self.tok.encode(cfg.sample_prompt) or [self.tok.eot_token or 0]
        except UserError as e:
            if cfg.sample_prompt != FIELDS["sample_prompt"].default:
                raise UserError(f"--sample_prompt: {e}") from None
            # build-nanogpt's default prompt, for a character vocabulary that lacks some of its letters
            self.text, self.prompt = self.tok.decode([0]), [0]
        self.n, self.tokens, self.device = cfg.num_samples, cfg.sample_tokens, env.device
        self.generator = torch.Generator(device=env.device).manual_seed(42 + env.rank)

    def sample(self, model: GPT, ctx) -> list[str]:
        idx = torch.tensor([self.prompt] * self.n, dtype=torch.long, device=self.device)  # (n, T)
        was_training = model.training
        model.eval()
        try:
            with ctx:
                out = model.generate(idx, self.tokens, temperature=1.0, top_k=50, generator=self.generator)
        finally:
            model.train(was_training)
        return [self.tok.decode(row.tolist()) for row in out]


def full_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """Model and optimizer state as one process would hold them. Under FSDP the shards are gathered (to CPU)
    and the optimizer state is keyed by parameter name ('fqn'); otherwise torch's own state dicts."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model, optimizer, ckpt: dict[str, Any], fsdp: bool, path: str) -> None:
    """Resume the optimizer from a checkpoint written by one process / DDP ('torch') or by FSDP ('fqn')."""
    fqn = ckpt.get("optimizer_format") == "fqn"
    if not fqn and not fsdp:
        optimizer.load_state_dict(ckpt["optimizer"])
        return
    if not fqn:
        raise UserError(f"{path} was written without FSDP: resume it with --parallel=ddp (its model weights load "
                        "anywhere; only the optimizer state is laid out for DDP)")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))


def gather(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's `obj`, in rank order (all ranks must call)."""
    if not env.ddp:
        return [obj]
    out: list[Any] = [None] * env.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def restore_run_state(ckpt: dict[str, Any], env: DistEnv, batches) -> None:
    """This rank's RNGs and data position from a checkpoint, when it was written with the same world size.

    A sharded loader's position is global, so it carries over to another world size; RNG states and the
    random loader's (which is the global generator's state) only fit the rank that saved them.
    """
    same_world = len(ckpt.get("rng_per_rank") or [ckpt.get("rng")]) == env.world_size
    if same_world and ckpt.get("rng") is not None:
        restore_rng((ckpt.get("rng_per_rank") or [ckpt["rng"]])[env.rank])
    data = ckpt.get("data_state") or {}
    state = (data.get("train_per_rank") or [data.get("train")])[env.rank] if same_world else data.get("train")
    if state and state.get("kind") == ("sharded" if isinstance(batches, ShardedBatches) else "random"):
        if same_world or state["kind"] == "sharded":
            batches.load_state_dict(state)  # after the RNGs: the random loader's state is torch's generator


def build_model(cfg: TrainConfig, meta: dict[str, Any], ckpt: dict[str, Any] | None, ckpt_path: str):
    """A new model sized from the config and the dataset's vocabulary, the checkpoint's model on resume, or
    GPT-2's weights."""
    model = None
    if cfg.init_from not in ("scratch", "resume"):
        model, model_args = pretrained_model(cfg, meta)
    elif ckpt is None:
        vocab = meta["vocab_size"]
        if meta["tokenizer"] == "gpt2":
            vocab = math.ceil(vocab / 64) * 64  # 50257 -> 50304: matmul-friendly; the extra rows never occur
        model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                          bias=cfg.bias, vocab_size=vocab)
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


def tokenizer_spec(meta: dict[str, Any]) -> dict[str, Any]:
    return {"tokenizer": meta["tokenizer"], **({"itos": meta["itos"]} if meta["tokenizer"] == "char" else {})}


def prepare_out_dir(cfg: TrainConfig) -> None:
    """Create out_dir and write the resolved config.json (atomically)."""
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        path = os.path.join(cfg.out_dir, "config.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2)
            fh.write("\n")
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise UserError(f"--out_dir={cfg.out_dir}: cannot write there ({e.strerror}); choose another folder") from None


class StopFlag(contextlib.AbstractContextManager):
    """SIGINT / SIGTERM ask the loop to stop after the current step; a second signal stops at once.

    Under DDP every rank must stop at the same step, so `sync()` takes the max of the flag over ranks.
    """

    def __init__(self, env: DistEnv):
        self.env, self.requested, self._previous = env, False, {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.env.is_main:
            print(f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                  "(send it again to stop at once)", flush=True)

    def __enter__(self):
        with contextlib.suppress(ValueError):  # signals can only be handled in the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return None

    def sync(self) -> None:
        if self.env.ddp:
            flag = torch.tensor(float(self.requested), device=self.env.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            self.requested = bool(flag.item())
