"""Training configuration: one flat, frozen dataclass with nanoGPT's keys and defaults plus a few of our own, and
load_config, which reads nanoGPT's config files as data (`ast`, never executed) and `--key=value` overrides in
order, the last one winning. README "nanoGPT commands it accepts" has the rules; aliases.py build-nanogpt's names."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gptforge.core.aliases import ALIASES, EPOCH_NAMES, Given, resolve_aliases, show
from gptforge.core.errors import UserError


def _f(default: Any, doc: str) -> Any:
    """A dataclass field carrying its documentation (shown by `gptforge train --help`)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class TrainConfig:
    """Every run setting. Frozen: train resolves each 'auto' once, into a new TrainConfig (dataclasses.replace)."""

    # --- I/O -------------------------------------------------------------------------------------------------
    out_dir: str = _f("out", "run folder: ckpt.pt, config.json, metrics.jsonl, log.txt")
    eval_interval: int = _f(2000, "optimizer steps between evaluations (val loss, checkpoint)")
    log_interval: int = _f(1, "optimizer steps between log lines; each line costs a host sync")
    eval_iters: int = _f(200, "batches per split averaged by each evaluation; more = less noisy, slower")
    eval_only: bool = _f(False, "evaluate once and exit (with init_from='resume' or a pretrained model)")
    always_save_checkpoint: bool = _f(True, "checkpoint at every evaluation, not only when val loss improves")
    ckpt_interval: int = _f(
        0,
        "also keep a step checkpoint model_{step:05d}.pt every this many steps and at the last "
        "step (build-nanogpt: 5000); 0 = off",
    )
    keep_last: int = _f(0, "step checkpoints model_*.pt to keep, newest first (older ones are deleted); 0 = all")
    init_from: str = _f(
        "scratch",
        "'scratch' (new model), 'resume' (out_dir/ckpt.pt), a GPT-2 name ('gpt2', "
        "'gpt2-medium', 'gpt2-large', 'gpt2-xl') or a Hugging Face GPT-2 or NanoChat folder",
    )
    resume: str = _f(
        "never",
        "'auto': continue from the newest readable checkpoint in out_dir when there is one, else start as "
        "init_from says (the same command starts and restarts a run: SLURM requeue, torchrun --max-restarts)",
    )
    # --- wandb ---------------------------------------------------------------------------------------------
    wandb_log: bool = _f(False, "log metrics to Weights & Biases (pip install 'gptforge[wandb]')")
    wandb_project: str = _f("owt", "wandb project name")
    wandb_run_name: str = _f("gpt2", "wandb run name")
    # --- data ----------------------------------------------------------------------------------------------
    dataset: str = _f("openwebtext", "dataset folder name under data_dir, made by `gptforge prepare`")
    data_dir: str = _f("data", "folder holding dataset folders (relative to the current directory)")
    gradient_accumulation_steps: int = _f(
        5 * 8, "micro-batches per optimizer step, summed over all processes (nanoGPT: 40 = 5 x 8 GPUs)"
    )
    batch_size: int = _f(12, "sequences per micro-batch per process")
    block_size: int = _f(1024, "context length in tokens (GPT-2: 1024)")
    data_loader: str = _f(
        "auto",
        "'random' (nanoGPT: random windows), 'sharded' (build-nanogpt: sequential over "
        "shards, rank-aware) or 'auto' (sharded for shard datasets, else random)",
    )
    total_batch_size: int = _f(
        0, "tokens per optimizer step (build-nanogpt); when > 0 it sets gradient_accumulation_steps. 0 = off"
    )
    # --- model ---------------------------------------------------------------------------------------------
    n_layer: int = _f(12, "transformer blocks (GPT-2 124M: 12)")
    n_head: int = _f(12, "attention heads; must divide n_embd")
    n_embd: int = _f(768, "embedding width")
    dropout: float = _f(0.0, "dropout probability; 0 for pretraining, 0.1+ for fine-tuning small data")
    bias: bool = _f(False, "biases in Linear and LayerNorm layers (GPT-2 has them; without is a bit better/faster)")
    # --- the modern recipe's model switches (all off: GPT-2's model) -----------------------------------------
    rotary: bool = _f(False, "rotary position embeddings (RoFormer; nanochat, modded-nanogpt) instead of learned ones")
    rope_base: float = _f(10000.0, "rotary=True: the wavelength base of the rotary angles")
    rmsnorm: bool = _f(False, "parameter-free RMSNorm instead of LayerNorm, also after the embedding (nanochat)")
    qk_norm: bool = _f(False, "RMS-normalise queries and keys per head, after rotary (nanochat, modded-nanogpt)")
    relu2: bool = _f(False, "ReLU(x)^2 in the MLP instead of GELU (Primer; nanochat, modded-nanogpt)")
    untie_head: bool = _f(False, "an output head of its own instead of the input embedding's transpose")
    zero_init: bool = _f(False, "attention's and the MLP's output projections start at zero (modded-nanogpt)")
    logit_softcap: float = _f(0.0, "> 0: logits = cap * tanh(logits / cap) (Gemma 2; nanochat uses 15)")
    # --- AdamW ---------------------------------------------------------------------------------------------
    learning_rate: float = _f(6e-4, "peak learning rate (GPT-3 paper's value for 125M)")
    max_iters: int = _f(600000, "optimizer steps to train for")
    weight_decay: float = _f(1e-1, "AdamW weight decay, applied to matrices and embeddings only")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2 (0.95 is steadier than 0.999 for LLM pretraining)")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 = off")
    optimizer: str = _f(
        "adamw",
        "'adamw' (nanoGPT's) or 'muon': Muon (momentum, then an orthogonalised update) for the blocks' 2-D "
        "matrices at muon_lr, AdamW at learning_rate for embeddings, head and gains",
    )
    muon_lr: float = _f(0.02, "optimizer='muon': peak learning rate of the Muon matrices, scheduled as learning_rate")
    muon_momentum: float = _f(0.95, "optimizer='muon': Nesterov momentum of the Muon matrices")
    muon_warmup: int = _f(300, "optimizer='muon': steps over which the Muon momentum rises from 0.85 to muon_momentum")
    max_bad_steps: int = _f(
        10,
        "a step whose loss or gradient norm is not finite is skipped (weights untouched); "
        "this many in a row stop the run, leaving the last good checkpoint",
    )
    # --- learning-rate schedule ----------------------------------------------------------------------------
    decay_lr: bool = _f(True, "warmup, then lr_schedule; False = constant learning_rate from step 0 (nanoGPT)")
    lr_schedule: str = _f(
        "cosine",
        "after warmup: 'cosine' (nanoGPT: cosine to min_lr at lr_decay_iters), 'linear' "
        "(straight to min_lr at lr_decay_iters), 'constant' (learning_rate) or 'wsd' "
        "(warmup-stable-decay: learning_rate, then linear to min_lr over the last decay_frac)",
    )
    warmup_iters: int = _f(2000, "steps of linear warmup (every lr_schedule)")
    lr_decay_iters: int = _f(600000, "step where the decay reaches min_lr, kept after it (~max_iters per Chinchilla)")
    min_lr: float = _f(6e-5, "floor of the schedule (~learning_rate / 10 per Chinchilla)")
    decay_frac: float = _f(
        0.2,
        "lr_schedule='wsd': the share of lr_decay_iters spent decaying: the decay starts at "
        "step max(warmup_iters, (1 - decay_frac) * lr_decay_iters); 0 = a drop at lr_decay_iters",
    )
    # --- system --------------------------------------------------------------------------------------------
    parallel: str = _f(
        "ddp",
        "with several processes: 'ddp' (a full copy per process) or 'fsdp' (FSDP2: parameters, "
        "gradients and optimizer state sharded per block, for models too big for one device)",
    )
    backend: str = _f("nccl", "torch.distributed backend: 'nccl', 'gloo' or 'auto' (nccl on CUDA, else gloo)")
    device: str = _f("cuda", "'cpu', 'cuda', 'cuda:N', 'mps' or 'auto' (cuda > mps > cpu)")
    dtype: str = _f(
        "auto",
        "'float32', 'bfloat16', 'float16' (with a GradScaler) or 'auto' (CUDA: bf16 if supported, else "
        "float16; CPU: bf16 with AMX/AVX512-BF16 and n_embd >= 256, else float32; MPS: float32)",
    )
    compile: bool | str = _f("auto", "torch.compile the model: True, False or 'auto' (on for CUDA, off elsewhere)")
    fast_dropout: bool | str = _f(
        "auto",
        "dropout masks from 16-bit random draws (a quarter of torch's bernoulli work, the same rule and "
        "expectation, other random numbers): True, False (nanoGPT's draws exactly) or 'auto' (on for CPU, off "
        "elsewhere)",
    )
    # --- samples and sinks (gptforge's own) --------------------------------------------------------------------
    sample_interval: int = _f(0, "optimizer steps between text samples during training (samples.jsonl); 0 = off")
    num_samples: int = _f(4, "samples drawn at each sample_interval")
    sample_prompt: str = _f("Hello, I'm a language model,", "prompt of the samples drawn during training")
    sample_tokens: int = _f(32, "tokens generated per sample during training (top-k 50)")
    hellaswag_interval: int = _f(0, "optimizer steps between HellaSwag evaluations (GPT-2 BPE runs); 0 = off")
    hellaswag_limit: int = _f(0, "examples per HellaSwag evaluation during training; 0 = all 10,042")
    hellaswag_path: str = _f("", "local hellaswag_val.jsonl; '' = download it once into ~/.cache/gptforge")
    tensorboard_log: bool = _f(False, "also write TensorBoard event files to out_dir/tensorboard")
    dashboard: bool = _f(False, "serve this run's live web dashboard on 127.0.0.1 (needs gptforge[dashboard])")
    dashboard_port: int = _f(8765, "port of the dashboard started by dashboard=True; 0 = any free port")
    # --- gptforge's own --------------------------------------------------------------------------------------
    seed: int = _f(1337, "random seed; each process adds its rank")
    peak_flops: float = _f(0.0, "peak FLOP/s for the MFU figure; 0 = a table for GPUs, a quick measure on CPU")


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
# the model switches above (model.SWITCHES has their off values): a resumed run cannot change them
MODEL_SWITCHES = ("rotary", "rope_base", "rmsnorm", "qk_norm", "relu2", "untie_head", "zero_init", "logit_softcap")
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # OpenAI's, on the Hugging Face hub: 124M-1558M
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
CHOICES = {  # the one list of each key's accepted values (device, optim and the CLI read them here)
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "backend": ("auto", "nccl", "gloo", "mpi", "ucc"),
    "data_loader": ("auto", "random", "sharded"),
    "parallel": ("ddp", "fsdp"),
    "lr_schedule": ("cosine", "linear", "constant", "wsd"),
    "optimizer": ("adamw", "muon"),
    "resume": ("never", "auto"),
}


def load_config(args: Sequence[str], base: TrainConfig | None = None) -> TrainConfig:
    """Build a TrainConfig from nanoGPT-style arguments: config files and --key=value / --key value, in order."""
    given: Given = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            for name, value, where in read_config_file(arg):
                given[name] = (coerce(name, value, where, from_text=False), where, i)  # this file: source i
            continue
        name, sep, text = arg[2:].partition("=")
        name = name.replace("-", "_")
        check_key(name, f"--{name}")
        if not sep:  # `--key value`, or a bare `--flag` meaning True for booleans
            nxt = args[i] if i < len(args) else None
            boolean = _kind(name) in ("bool", "bool | str")
            if boolean and (nxt is None or nxt.lower() not in _TRUE | _FALSE | {"auto"}):
                text = "True"
            elif nxt is None or (nxt.startswith("--") and len(nxt) > 2):
                raise UserError(f"--{name} needs a value: --{name}=VALUE or --{name} VALUE")
            else:
                text, i = nxt, i + 1
        given[name] = (coerce(name, text, f"--{name}", from_text=True), f"--{name}", len(args) + 1)  # one source
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


def read_config_file(path: str) -> list[tuple[str, Any, str]]:
    """Parse a nanoGPT config file as data: [(key, value, 'file:line')]. Nothing in it is executed."""
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a folder; give a config file in it (e.g. {path}/train_gpt2.py)")
    if not os.path.isfile(path):
        hint = " (options start with --, e.g. --device=cpu)" if "=" in path else ""
        raise UserError(f"config file {path!r} not found{hint}; check the path (relative to {os.getcwd()})")
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except UnicodeDecodeError as e:
        raise UserError(
            f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start}): a config file "
            "holds `name = value` lines; was another file given in its place?"
        ) from None
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: not a valid config file: {e.msg}") from None
    except ValueError as e:  # e.g. NUL bytes: a binary file
        raise UserError(f"config file {path} is not text ({e}); a config file holds `name = value` lines") from None
    out = []
    for node in tree.body:
        where = f"{path}:{node.lineno}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue  # nanoGPT configs sometimes import time; harmless when nothing is executed
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring or a bare string
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise UserError(f"{where}: config files hold only `name = value` lines; found {ast.unparse(node)!r}")
        key = node.targets[0].id
        check_key(key, where)
        try:
            value = _literal(node.value)
        except ValueError:
            raise UserError(
                f"{where}: the value of {key} must be a literal (number, string, bool, or arithmetic on numbers); "
                f"got {ast.unparse(node.value)!r}. Config files are read as data, never run."
            ) from None
        out.append((key, value, where))
    return out


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}


def _literal(node: ast.AST) -> Any:
    """ast.literal_eval plus arithmetic on numbers and + on strings (nanoGPT writes `5 * 8`, `2**19`)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _literal(node.left), _literal(node.right)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        strings = isinstance(node.op, ast.Add) and isinstance(a, str) and isinstance(b, str)
        if not (numbers or strings) or (isinstance(node.op, ast.Pow) and abs(b) > 1024):
            raise ValueError("unsupported operands")
        return _BINOPS[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _literal(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    return ast.literal_eval(node)


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
        if kind in ("bool", "bool | str") and text.strip().lower() in _TRUE | _FALSE:
            value = text.strip().lower() in _TRUE  # --bias=false, --compile 0 and --compile=True alike
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


def validate(cfg: TrainConfig) -> None:
    """Checks that need no data or device: each names the key and what would be accepted."""
    positive = [
        "batch_size",
        "block_size",
        "n_layer",
        "n_head",
        "n_embd",
        "gradient_accumulation_steps",
        "eval_interval",
        "log_interval",
        "eval_iters",
        "num_samples",
        "sample_tokens",
        "max_bad_steps",
    ]
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise UserError(f"--{key} must be a positive integer, got {getattr(cfg, key)}")
    for key in [
        "learning_rate",
        "min_lr",
        "weight_decay",
        "grad_clip",
        "max_iters",
        "warmup_iters",
        "lr_decay_iters",
        "peak_flops",
        "total_batch_size",
        "sample_interval",
        "hellaswag_interval",
        "hellaswag_limit",
        "ckpt_interval",
        "keep_last",
        "muon_lr",
        "muon_warmup",
        "logit_softcap",
    ]:
        if getattr(cfg, key) < 0:
            raise UserError(f"--{key} must not be negative, got {getattr(cfg, key)}")
    if cfg.rope_base <= 0:
        raise UserError(f"--rope_base must be positive (the rotary wavelength base, e.g. 10000), got {cfg.rope_base}")
    for key, f in FIELDS.items():
        if f.type == "float" and not math.isfinite(getattr(cfg, key)):
            raise UserError(f"--{key} must be a finite number, got {getattr(cfg, key)}")
    if cfg.n_embd % cfg.n_head:
        raise UserError(
            f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head} (each head gets n_embd / "
            "n_head channels); change --n_embd or --n_head"
        )
    if not 0.0 <= cfg.decay_frac <= 1.0:
        raise UserError(
            f"--decay_frac must be in [0, 1] (the share of lr_decay_iters spent decaying), got {cfg.decay_frac}"
        )
    if not 0.0 <= cfg.dropout < 1.0:
        raise UserError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    for key in ("beta1", "beta2", "muon_momentum"):
        if not 0.0 <= getattr(cfg, key) < 1.0:
            raise UserError(f"--{key} must be in [0, 1), got {getattr(cfg, key)}")
    if cfg.init_from not in ("scratch", "resume", *GPT2_NAMES) and not os.path.isdir(cfg.init_from):
        raise UserError(
            f"--init_from must be 'scratch', 'resume', one of {', '.join(GPT2_NAMES)}, or a folder holding a Hugging "
            f"Face GPT-2 or NanoChat model (config.json + model.safetensors); got {cfg.init_from!r}"
        )
    if not cfg.out_dir:
        raise UserError("--out_dir must not be empty")
    if not 0 <= cfg.dashboard_port <= 65535:
        raise UserError(f"--dashboard_port must be a port number 0-65535 (0 = any free port), got {cfg.dashboard_port}")


def help_text() -> str:
    """Every key with its type, default and meaning, for `gptforge train --help`."""
    default = TrainConfig()
    lines = []
    for name, f in FIELDS.items():
        lines.append(f"  --{name}={getattr(default, name)!r}  ({f.type})\n      {f.metadata['doc']}")
    return "\n".join(lines)
