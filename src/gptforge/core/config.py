"""Training configuration: one flat, frozen dataclass with nanoGPT's keys and defaults plus a few of our own, and
load_config, which reads nanoGPT's config files as data (`ast`, never executed) and `--key=value` overrides in
order, the last one winning. README "nanoGPT commands it accepts" has the rules; aliases.py build-nanogpt's names."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gptforge.core.aliases import ALIASES, EPOCH_NAMES, Given, derived_accumulation, resolve_aliases, show
from gptforge.core.config_file import FALSE_WORDS, TRUE_WORDS, given_settings
from gptforge.core.errors import UserError
from gptforge.core.files import CONFIG
from gptforge.core.settings import below_one, check_fields, not_negative, port_number, positive, setting
from gptforge.core.settings import help_text as settings_help
from gptforge.core.shape import WAS, ModelShape, check_shape

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # OpenAI's, on the Hugging Face hub: 124M-1558M
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # --dtype: here and in every command running a model
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")  # lr_schedule's values: train/loop.py's get_lr computes each


def _not_empty(value: str) -> str | None:
    return "must not be empty" if not value else None


def _share(value: float) -> str | None:
    return "must be in [0, 1] (the share of lr_decay_iters spent decaying)" if not 0.0 <= value <= 1.0 else None


def _muon(default: Any, doc: str, check: Any = None, **meta: Any) -> Any:
    """A setting only optimizer='muon' reads (MUON_ONLY: the run's header names one given to another optimizer)."""
    return setting(default, f"optimizer='muon': {doc}", check, muon=True, **meta)


def _model_source(value: str) -> str | None:
    if value in ("scratch", "resume", *GPT2_NAMES) or os.path.isdir(value):
        return None
    return (
        f"must be 'scratch', 'resume', one of {', '.join(GPT2_NAMES)}, or an existing folder: another run's (its "
        "ckpt.pt: train that run first) or a Hugging Face GPT-2 or NanoChat model's (config.json + model.safetensors)"
    )


@dataclass(frozen=True)
class TrainConfig(ModelShape):
    """Every run setting: the model's (ModelShape, core/shape.py) and these. Frozen: train resolves each 'auto' once,
    into a new TrainConfig (dataclasses.replace). Each key carries its doc, choices, check and --help section."""

    out_dir: str = setting("out", "run folder: ckpt.pt, config.json, metrics.jsonl, log.txt", _not_empty, section="I/O")
    eval_interval: int = setting(2000, "optimizer steps between evaluations (val loss, checkpoint)", positive)
    log_interval: int = setting(1, "optimizer steps between log lines; each line costs a host sync", positive)
    eval_iters: int = setting(200, "batches per split averaged by each evaluation; more = less noisy, slower", positive)
    eval_only: bool = setting(False, "evaluate once and exit (with init_from='resume' or a pretrained model)")
    always_save_checkpoint: bool = setting(True, "checkpoint at every evaluation, not only when val loss improves")
    ckpt_interval: int = setting(
        0,
        "also keep a step checkpoint model_{step:05d}.pt every this many steps and at the last "
        "step (build-nanogpt: 5000); 0 = off",
        not_negative,
    )
    keep_last: int = setting(
        0, "step checkpoints model_*.pt to keep, newest first (older ones are deleted); 0 = all", not_negative
    )
    init_from: str = setting(
        "scratch",
        "'scratch' (new model), 'resume' (out_dir/ckpt.pt), a GPT-2 name ('gpt2', "
        "'gpt2-medium', 'gpt2-large', 'gpt2-xl'), a Hugging Face GPT-2 or NanoChat folder, or another run's folder "
        "(its ckpt.pt's weights: e.g. SFT from a pretraining run; a fresh optimizer)",
        _model_source,
    )
    resume: str = setting(
        "never",
        "'never' (start as init_from says) or 'auto': continue from the newest readable checkpoint in out_dir when "
        "there is one, else start as init_from says (the same command starts and restarts a run: SLURM requeue, "
        "torchrun --max-restarts)",
        choices=("never", "auto"),
    )
    wandb_log: bool = setting(False, "log metrics to Weights & Biases (pip install 'gptforge[wandb]')", section="wandb")
    wandb_project: str = setting("owt", "wandb project name")
    wandb_run_name: str = setting("gpt2", "wandb run name")
    dataset: str = setting(
        "openwebtext", "dataset folder name under data_dir, made by `gptforge prepare`", section="data"
    )
    data_dir: str = setting("data", "folder holding dataset folders (relative to the current directory)")
    gradient_accumulation_steps: int = setting(
        5 * 8, "micro-batches per optimizer step, summed over all processes (nanoGPT: 40 = 5 x 8 GPUs)", positive
    )
    batch_size: int = setting(12, "sequences per micro-batch per process", positive)
    batch_warmup_iters: int = setting(
        0,
        "the first this many steps train on batch_warmup_size of each micro-batch's batch_size sequences (small "
        "batches while the loss falls fast: the same progress a step for fewer tokens); 0 = off",
        not_negative,
    )
    batch_warmup_size: int = setting(
        0, "batch_warmup_iters > 0: sequences per micro-batch in those steps, 1 to batch_size", not_negative
    )
    data_loader: str = setting(
        "auto",
        "'random' (nanoGPT: random windows), 'sharded' (build-nanogpt: sequential over shards, rank-aware), "
        "'chat' (the packed rows of a chat dataset) or 'auto' (the one the dataset is made for)",
        choices=("auto", "random", "sharded", "chat"),
    )
    task: str = setting(
        "pretrain",
        "'pretrain' (every next token is a target) or 'sft' (supervised fine-tuning on a chat dataset from "
        "`gptforge prepare chat`: the loss on the assistant's tokens only, packed conversations kept apart)",
        choices=("pretrain", "sft"),
    )
    sft_loss: str = setting(
        "assistant",
        "task=sft: the targets trained on: 'assistant' (the chat mask: the assistant's answers and end tokens) or "
        "'all' (every token of each conversation, user turns and role tokens too: to compare, not to use); the "
        "val loss and the tasks' accuracy always score the assistant's tokens",
        choices=("assistant", "all"),
    )
    total_batch_size: int = setting(
        0,
        "tokens per optimizer step (build-nanogpt); when > 0 it sets gradient_accumulation_steps. 0 = off",
        not_negative,
    )
    learning_rate: float = setting(
        6e-4, "peak learning rate (GPT-3 paper's value for 125M)", not_negative, section="AdamW"
    )
    embedding_lr_scale: float = setting(
        1.0,
        "the token embedding's peak learning rate as a multiple of learning_rate (AdamW, on the same schedule); "
        "not 1 needs untie_head=True (a tied embedding is also the output head)",
        not_negative,
    )
    max_iters: int = setting(600000, "optimizer steps to train for", not_negative)
    weight_decay: float = setting(1e-1, "AdamW weight decay, applied to matrices and embeddings only", not_negative)
    beta1: float = setting(0.9, "AdamW beta1", below_one)
    beta2: float = setting(0.95, "AdamW beta2 (0.95 is steadier than 0.999 for LLM pretraining)", below_one)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 = off", not_negative)
    optimizer: str = setting(
        "adamw",
        "'adamw' (nanoGPT's) or 'muon': Muon (momentum, then an orthogonalised update) for the blocks' 2-D "
        "matrices at muon_lr, AdamW at learning_rate for embeddings, head and gains",
        choices=("adamw", "muon"),
    )
    muon_lr: float = _muon(0.02, "peak learning rate of the Muon matrices, scheduled as learning_rate", not_negative)
    muon_momentum: float = _muon(0.95, "Nesterov momentum of the Muon matrices", below_one)
    muon_warmup: int = _muon(300, "steps over which the Muon momentum rises from 0.85 to muon_momentum", not_negative)
    muon_dtype: str = _muon(
        "auto",
        "the dtype of the Newton-Schulz iterations: 'bfloat16', 'float32', or 'auto' (bfloat16 on CUDA and on CPUs "
        "whose bf16 products measure at least 1.25x float32's, float32 elsewhere)",
        choices=("auto", "float32", "bfloat16"),
    )
    muon_split_qkv: bool = _muon(
        False,
        "orthogonalise the attention's query, key and value matrices each on its own (modded-nanogpt's way) instead "
        "of their fused c_attn matrix as one",
    )
    normuon: bool = _muon(
        False,
        "NorMuon (modded-nanogpt's): each neuron's share of the orthogonalised update divided by the root of a "
        "running mean of its squares (0.95), the matrix then scaled back to its norm",
    )
    max_bad_steps: int = setting(
        10,
        "a step whose loss or gradient norm is not finite is skipped (weights untouched); "
        "this many in a row stop the run, leaving the last good checkpoint",
        positive,
    )
    decay_lr: bool = setting(
        True,
        "warmup, then lr_schedule; False = constant learning_rate from step 0 (nanoGPT)",
        section="learning-rate schedule",
    )
    lr_schedule: str = setting(
        "cosine",
        "after warmup: 'cosine' (nanoGPT: cosine to min_lr at lr_decay_iters), 'linear' "
        "(straight to min_lr at lr_decay_iters), 'constant' (learning_rate) or 'wsd' "
        "(warmup-stable-decay: learning_rate, then linear to min_lr over the last decay_frac)",
        choices=LR_SCHEDULES,
    )
    warmup_iters: int = setting(2000, "steps of linear warmup (every lr_schedule)", not_negative)
    lr_decay_iters: int = setting(
        600000, "step where the decay reaches min_lr, kept after it (~max_iters per Chinchilla)", not_negative
    )
    min_lr: float = setting(6e-5, "floor of the schedule (~learning_rate / 10 per Chinchilla)", not_negative)
    decay_frac: float = setting(
        0.2,
        "lr_schedule='wsd': the share of lr_decay_iters spent decaying: the decay starts at "
        "step max(warmup_iters, (1 - decay_frac) * lr_decay_iters); 0 = a drop at lr_decay_iters",
        _share,
    )
    parallel: str = setting(
        "ddp",
        "with several processes: 'ddp' (a full copy per process) or 'fsdp' (FSDP2: parameters, "
        "gradients and optimizer state sharded per block, for models too big for one device)",
        section="system",
        choices=("ddp", "fsdp"),
    )
    backend: str = setting(
        "nccl",
        "torch.distributed backend: 'nccl', 'gloo', 'mpi', 'ucc' or 'auto' (nccl on CUDA, else gloo)",
        choices=("auto", "nccl", "gloo", "mpi", "ucc"),
    )
    device: str = setting("cuda", "'cpu', 'cuda', 'cuda:N', 'mps' or 'auto' (cuda > mps > cpu)")
    dtype: str = setting(
        "auto",
        "'float32', 'bfloat16', 'float16' (with a GradScaler) or 'auto' (CUDA: bf16 if supported, else float16; CPU: "
        "bf16 where its products measure at least 1.25x float32's and n_embd >= cpu_bf16_min_width, else float32; "
        "MPS: float32). A CPU run whose bf16 / fp16 products are emulated or slow says so in its header (sample, "
        "chat, serve and eval on stderr)",
        choices=DTYPE_CHOICES,
    )
    cpu_bf16_min_width: int = setting(
        256,
        "dtype='auto' on a CPU whose bf16 products measure faster: bfloat16 from this n_embd up, float32 below "
        "(256 keeps nanoGPT's README-size command in nanoGPT's float32 arithmetic; the 128-wide speedrun sets 128)",
        positive,
    )
    compile: bool | str = setting("auto", "torch.compile the model: True, False or 'auto' (on for CUDA, off elsewhere)")
    fast_dropout: bool | str = setting(
        "auto",
        "dropout masks from 16-bit random draws (a quarter of torch's bernoulli work, the same rule and "
        "expectation, other random numbers): True, False (nanoGPT's draws exactly) or 'auto' (on for CPU, off "
        "elsewhere)",
    )
    onednn_f32: bool | str = setting(
        "auto",
        "float32 CPU products of the Linear layers (forward and backward) by oneDNN instead of torch's BLAS (MKL, "
        "which runs its AVX2 code on AMD processors): the same sums in another order. True, False (torch's "
        "arithmetic exactly) or 'auto' (on for AMD CPUs of family 26 (Zen 5) and later with AVX-512, off "
        "elsewhere)",
    )
    sample_interval: int = setting(
        0,
        "optimizer steps between text samples during training (samples.jsonl); 0 = off",
        not_negative,
        section="samples and sinks (gptforge's own)",
    )
    num_samples: int = setting(4, "samples drawn at each sample_interval", positive)
    sample_prompt: str = setting("Hello, I'm a language model,", "prompt of the samples drawn during training")
    sample_tokens: int = setting(32, "tokens generated per sample during training (top-k 50)", positive)
    hellaswag_interval: int = setting(
        0, "optimizer steps between HellaSwag evaluations (GPT-2 BPE runs); 0 = off", not_negative
    )
    hellaswag_limit: int = setting(0, "examples per HellaSwag evaluation during training; 0 = all 10,042", not_negative)
    hellaswag_path: str = setting("", "local hellaswag_val.jsonl; '' = download it once into ~/.cache/gptforge")
    chat_eval_examples: int = setting(
        200,
        "task=sft on a chat dataset holding the synthetic tasks: held-out problems answered greedily at each "
        "evaluation (exact-match accuracy per task, and how many answers end with the end token); 0 = off",
        not_negative,
    )
    tensorboard_log: bool = setting(False, "also write TensorBoard event files to out_dir/tensorboard")
    dashboard: bool = setting(False, "serve this run's live web dashboard on 127.0.0.1 (needs gptforge[dashboard])")
    dashboard_port: int = setting(8765, "port of the dashboard dashboard=True starts; 0 = any free port", port_number)
    seed: int = setting(1337, "random seed; each process adds its rank", section="gptforge's own")
    peak_flops: float = setting(
        0.0, "peak FLOP/s for MFU; 0 = the machine's fastest product (GPU: a table, CPU: measured)", not_negative
    )


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
CHOICES = {name: f.metadata["choices"] for name, f in FIELDS.items() if f.metadata["choices"]}  # from the fields
MUON_ONLY = tuple(name for name, f in FIELDS.items() if f.metadata.get("muon"))  # what only optimizer='muon' reads


def load_config(args: Sequence[str], base: TrainConfig | None = None) -> TrainConfig:
    """Build a TrainConfig from nanoGPT-style arguments: config files and --key=value / --key value, in order."""
    given: Given = {}
    is_flag = lambda name: _kind(name) in ("bool", "bool | str")  # noqa: E731
    for name, value, where, from_text, source in given_settings(args, is_flag, check_key):
        if not from_text:
            check_key(name, where)
        given[name] = (coerce(name, value, where, from_text=from_text), where, source)
    values: dict[str, Any] = dataclasses.asdict(base or TrainConfig())
    values.update({name: value for name, (value, _, _) in given.items() if name in FIELDS})
    explicit = {name for name in given if name in FIELDS}
    resolve_aliases(given, values, explicit)
    values["gradient_accumulation_steps"] = derived_accumulation(values, explicit)
    cfg = TrainConfig(**values)
    if "lr_schedule" in explicit and not cfg.decay_lr and cfg.lr_schedule != "constant":
        raise UserError(
            f"{show('lr_schedule', *given['lr_schedule'])} decays the learning rate, but decay_lr=False "
            "keeps it constant; set --decay_lr=True to use the schedule"
        )
    validate(cfg)
    return cfg


def _kind(name: str) -> str:
    """The type (as written in TrainConfig) of a key or an alias."""
    return "int" if name in EPOCH_NAMES else FIELDS[ALIASES.get(name, name)].type


def check_key(key: str, where: str) -> None:
    if key not in FIELDS and key not in ALIASES and key not in EPOCH_NAMES:
        close = difflib.get_close_matches(key, [*FIELDS, *ALIASES, *EPOCH_NAMES], n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `gptforge train --help` lists them"
        raise UserError(f"{where}: unknown config key {key!r}{hint}")


def coerce(key: str, value: Any, where: str, from_text: bool) -> Any:
    """Check (and, for command-line text, parse) a value against the type of the key's default.

    `key` may be an alias (ALIASES, EPOCH_NAMES): the type is its key's, the messages name the alias.
    """
    kind = _kind(key)
    target = ALIASES.get(key, key)
    if from_text:
        text = value
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = text
        if kind == "str" and not isinstance(value, str):
            value = text  # --out_dir=2024 means the folder "2024"
        if kind in ("bool", "bool | str") and text.strip().lower() in TRUE_WORDS | FALSE_WORDS:
            value = text.strip().lower() in TRUE_WORDS  # --bias=false, --compile 0 and --compile=True alike
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool | str": isinstance(value, bool) or value == "auto",
    }[kind]
    if not ok:
        expected = {"bool | str": "True, False or 'auto'"}.get(kind, kind)
        raise UserError(f"{where}: {key} must be {expected}, got {value!r} ({type(value).__name__})")
    if kind == "float":
        value = float(value)
    if target in CHOICES and value not in CHOICES[target]:
        raise UserError(f"{where}: {key} must be one of {', '.join(CHOICES[target])}; got {value!r}")
    return value


def validate(cfg: TrainConfig) -> None:
    """Checks that need no data or device: each key's own (its field's check), then those between keys."""
    check_fields(cfg)
    if cfg.batch_warmup_iters and not 1 <= cfg.batch_warmup_size <= cfg.batch_size:
        raise UserError(
            f"--batch_warmup_iters={cfg.batch_warmup_iters} needs --batch_warmup_size from 1 to batch_size "
            f"({cfg.batch_size}), got {cfg.batch_warmup_size}: the sequences each micro-batch trains on in those steps"
        )
    check_shape(cfg)  # each model setting's shape rule (core/shape.py): before anything is built


def help_text() -> str:
    """Every key with its type, default and meaning, by section, for `gptforge train --help`."""
    return settings_help(TrainConfig)


def loader_kind(meta: dict[str, Any], choice: str = "auto") -> str:
    """'sharded', 'random' or 'chat': the data_loader setting, where 'auto' means the dataset's own (sharded for a
    shard dataset, chat for a chat dataset, else random)."""
    if choice == "auto":
        return {"shards": "sharded", "chat": "chat"}.get(meta.get("format"), "random")
    return choice


def saved_config(out_dir: str) -> TrainConfig | None:
    """The settings <out_dir>/config.json records (as train resolved them), or None when there is none. A model key
    it lacks (written before the key existed) takes what that run's model had (shape.WAS: gelu 'tanh')."""
    path = os.path.join(out_dir, CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path}: not readable JSON ({e}); restore it, or give the run's settings on the command "
            "line after moving it away"
        ) from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: not a run's config.json (a JSON object of settings)")
    values = {k: coerce(k, v, path, from_text=False) for k, v in saved.items() if k in FIELDS}
    return dataclasses.replace(TrainConfig(), **{**WAS, **values})
