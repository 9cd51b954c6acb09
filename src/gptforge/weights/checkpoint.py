"""Checkpoint files: atomic writes, safe reads (weights_only), the fallback a resume takes past a damaged file, the
random-number and data state a resumed run needs, and the model a command loads (--out_dir / --ckpt /
--init_from). The keys: docs/ARCHITECTURE.md "Files"."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gptforge.core.console import log
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.core.files import BEST_CKPT, CKPT, STEP_FILE, atomic_write, step_checkpoint_name  # noqa: F401  (re-exported)
from gptforge.data.loader import ShardedBatches, read_meta
from gptforge.model.gpt import GPT, MODEL_ARGS, SWITCHES, GPTConfig
from gptforge.tokenizer.spec import Tokenizer, from_spec

FORMAT_VERSION = 1
_PREFIXES = ("_orig_mod.", "module.")  # added by torch.compile and by DDP wrappers
_TMP = re.compile(r"\..+\.(\d+)\.tmp")  # files.atomic_write's temporary files: .<name>.<pid>.tmp


def save_checkpoint(path: str, state: dict[str, Any], copies: Sequence[str] = ()) -> None:
    """Write `state` to `path` atomically (files.atomic_write). `copies` (the best or a step checkpoint, in the
    same folder) get the same bytes, each written the same way and renamed before `path` itself is replaced,
    so a crash at any moment leaves every name either old or new. One serialization for all of them."""
    try:
        with atomic_write(path) as fh:
            torch.save(state, fh)
            fh.flush()
            for copy in copies:
                with open(fh.name, "rb") as src, atomic_write(copy) as out:
                    shutil.copyfileobj(src, out)
    except BaseException as e:  # atomic_write removed every temporary file; say what went wrong
        cause = e  # torch.save reports a failed write as a RuntimeError raised from the OSError
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise  # not the disk's fault: a bug (or a second Ctrl-C) to see in full
        raise UserError(
            f"cannot write checkpoint {path}: {cause.strerror}; the previous checkpoint is intact. Free "
            "disk space (or choose another --out_dir) and continue with --init_from=resume"
        ) from None


def remove_stale_temporaries(folder: str) -> list[str]:
    """Delete the temporary files (checkpoints, config.json, metrics) of writers killed mid-write: their process
    is gone."""
    removed = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _TMP.fullmatch(name)
        if not match or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def step_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of the step checkpoints model_NNNNN.pt in `folder`, oldest first."""
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = STEP_FILE.fullmatch(name)
        if match:
            found.append((int(match.group(1)), os.path.join(folder, name)))
    return sorted(found)


def rotate_step_checkpoints(folder: str, keep_last: int) -> list[str]:
    """Keep the newest `keep_last` step checkpoints (0 = all); returns the paths deleted."""
    found = step_checkpoints(folder)
    old = [path for _, path in found[:-keep_last]] if keep_last > 0 else []
    for path in old:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return old


def load_resumable(
    out_dir: str, map_location: str | torch.device = "cpu", newest: bool = False
) -> tuple[dict[str, Any], str, list[str]]:
    """The checkpoint to resume from: ckpt.pt, or when it is missing or unreadable the newest readable of the
    step checkpoints and ckpt_best.pt (by the step stored in them). With `newest` (--resume=auto) a step
    checkpoint newer than a readable ckpt.pt wins over it. Returns (checkpoint, path, problems), where problems
    describe the files passed over; a clear error when none can be read."""
    main = os.path.join(out_dir, CKPT)
    problems: list[str] = []
    readable = []
    if not (newest and not os.path.isfile(main)):  # --resume=auto does not call a missing ckpt.pt a problem
        try:
            ckpt = load_checkpoint(main, map_location)
            if not newest:
                return ckpt, main, problems
            readable.append((int(ckpt.get("iter_num", 0)), main, ckpt))
        except UserError as e:
            problems.append(str(e))
    after = readable[0][0] if readable else -1  # a step file is named for its last step: model_N.pt holds N or N+1
    groups = [[path for step, path in reversed(step_checkpoints(out_dir)) if step + 1 > after]]
    groups += [[os.path.join(out_dir, BEST_CKPT)]] if not readable else []  # the best is never newer than ckpt.pt
    for group in groups:
        for path in filter(os.path.isfile, group):  # newest first: the first readable one of a group wins
            try:
                ckpt = load_checkpoint(path, map_location)
            except UserError as e:
                problems.append(str(e))
                continue
            readable.append((int(ckpt.get("iter_num", 0)), path, ckpt))
            break
    if not readable:
        advice = (
            "move these files away (or choose another --out_dir) to start a new run"
            if newest  # --resume=auto would find them again
            else "start again with --init_from=scratch"
        )
        found = " / ".join(problems) + "; no other readable checkpoint" if problems else "no checkpoint"
        raise UserError(f"{found} in {out_dir}: {advice}")
    _, path, ckpt = max(readable, key=lambda r: r[0])  # ckpt.pt, first, wins a tie
    return ckpt, path, problems


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with weights_only=True; every failure is a clear error naming the file."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} not found; train first, or point --out_dir at a run folder")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, KeyError... for unreadable files
        text = str(e)
        if "Unsupported global" in text or "GLOBAL " in text:  # the pickle names a class or function to call
            raise UserError(
                f"cannot read checkpoint {path}: it holds pickled objects other than tensors and plain "
                "data, and such files can run code; it was not loaded"
            ) from None
        # torch's own advice (load with weights_only=False) is exactly what must not be done with a stranger's file
        lines = [x.strip() for x in text.splitlines() if x.strip() and not re.search("eights.only", x)]
        detail = f"{type(e).__name__}: {lines[0].split('. ')[0][:160]}" if lines else type(e).__name__
        raise UserError(
            f"cannot read checkpoint {path}: the file is truncated, damaged or not a checkpoint "
            f"({detail}); point --out_dir or --ckpt at an intact one, or train again"
        ) from None
    if not isinstance(ckpt, dict) or not {"model", "model_args"} <= set(ckpt):
        raise UserError(f"{path} is not a gptforge or nanoGPT checkpoint (no 'model' and 'model_args' keys)")
    ckpt["model"] = clean_state_dict(ckpt["model"])
    return ckpt


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip torch.compile / DDP prefixes and drop the causal-mask buffers older nanoGPT versions saved."""
    out = {}
    for key, value in state.items():
        while key.startswith(_PREFIXES):  # in any order and nesting: DDP(compile(model)) gives both
            key = key.split(".", 1)[1]
        if key.endswith((".attn.bias", ".attn.masked_bias")) and value.dim() == 4:
            continue  # a (1, 1, T, T) mask buffer, not a parameter
        out[key] = value
    return out


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """load_state_dict with a clear error naming the file when the shapes or names do not match."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = [line.strip() for line in str(e).splitlines() if line.strip()][1:3]
        raise UserError(
            f"{path} does not fit this model ({'; '.join(first)}): it was saved with other model settings "
            "(n_layer, n_head, n_embd, block_size, vocab_size, bias)"
        ) from None


def capture_rng() -> dict[str, Any]:
    """Every random-number generator a training step draws from, in plain containers and tensors."""
    keys, pos, has_gauss, gauss = np.random.get_state()[1:]
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the random streams saved by rng_state; its tensors may have been loaded onto a GPU (map_location)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def full_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    """Model and optimizer state as one process would hold them. Under FSDP the shards are gathered (to CPU)
    and the optimizer state is keyed by parameter name ('fqn'); otherwise torch's own state dicts."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model, optimizer, ckpt: dict[str, Any], fsdp: bool, path: str) -> None:
    """Resume the optimizer from a checkpoint written by one process / DDP ('torch': states keyed by position) or
    by FSDP ('fqn': keyed by parameter name), in either kind of run: a 'torch' state goes to FSDP through its
    names (`named_optimizer_state`), an 'fqn' one to a plain model through torch's state-dict helpers."""
    fqn = ckpt.get("optimizer_format") == "fqn"
    if not fqn and not fsdp:
        optimizer.load_state_dict(ckpt["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = ckpt["optimizer"] if fqn else named_optimizer_state(model, optimizer, ckpt["optimizer"], path)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def named_optimizer_state(model, optimizer, state: dict[str, Any], path: str) -> dict[str, Any]:
    """A torch optimizer state dict (parameters numbered in param_groups order) keyed by parameter names instead,
    the layout FSDP's state-dict helpers read. The numbering is this optimizer's, whose groups are built the
    same way from the same model (optim.configure_optimizer), so position i names the same parameter."""
    names = {id(p): name for name, p in model.named_parameters()}
    ours = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    theirs = [group["params"] for group in state["param_groups"]]
    if [len(g) for g in ours] != [len(g) for g in theirs]:
        raise UserError(
            f"{path}: its optimizer state has parameter groups of {[len(g) for g in theirs]} tensors, this run's "
            f"optimizer {[len(g) for g in ours]}: resume with the optimizer settings it was written with"
        )
    by_index = {i: name for g_o, g_t in zip(ours, theirs, strict=True) for i, name in zip(g_t, g_o, strict=True)}
    return {
        "state": {by_index[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": n} for g, n in zip(state["param_groups"], ours, strict=True)],
    }


def restore_run_state(ckpt: dict[str, Any], env: DistEnv, batches, seed: int) -> str:
    """This rank's RNGs and data position from a checkpoint; returns a line saying what was done.

    Written with the same world size: each rank gets its own saved streams back (bit-identical resume). On
    another world size the saved streams do not map onto the ranks, so every rank's are re-derived from the
    run's seed, the step and the rank (`derived_seed`), the same on every such resume. A sharded loader's
    position is global, so it carries over to any world size; the random loader's is the global generator's
    state, so it follows the RNGs.
    """
    saved = ckpt.get("rng_per_rank") or [ckpt.get("rng")]
    same_world = len(saved) == env.world_size
    iter_num = int(ckpt.get("iter_num", 0))
    told = ""
    if same_world:
        if saved[env.rank] is not None:  # nanoGPT's checkpoints hold none: the run's seed stands, as in nanoGPT
            restore_rng(saved[env.rank])
    else:
        seed_rngs(derived_seed(seed, iter_num, env.rank))
        told = (
            f"checkpoint written by {len(saved)} process(es), resumed on {env.world_size}: each rank's random streams "
            f"(dropout, the random loader's batches) re-derived from (seed {seed}, iter {iter_num}, rank)"
        )
    data = ckpt.get("data_state") or {}
    per_rank = data.get("train_per_rank") or []
    state = per_rank[env.rank] if same_world and env.rank < len(per_rank) else data.get("train")
    if state and state.get("kind") == ("sharded" if isinstance(batches, ShardedBatches) else "random"):
        if same_world or state["kind"] == "sharded":
            batches.load_state_dict(state)  # after the RNGs: the random loader's state is torch's generator
    return told


def derived_seed(seed: int, iter_num: int, rank: int) -> int:
    """The seed of a rank's random streams when a run resumes at `iter_num` on another number of processes."""
    return (seed * 1_000_003 + iter_num * 65_537 + rank * 257 + 1) % 2**63


def seed_rngs(seed: int) -> None:
    """Seed every generator capture_rng saves: Python's, NumPy's, torch's (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def checkpoint_path(out_dir: str, ckpt: str | None = None) -> str:
    """The checkpoint file to read: `ckpt` (--ckpt, e.g. out/model_05000.pt) when given, else <out_dir>/ckpt.pt."""
    if not ckpt:
        return os.path.join(out_dir, CKPT)
    if os.path.isdir(ckpt):
        raise UserError(
            f"--ckpt={ckpt} is a folder: --ckpt names a checkpoint file (such as "
            f"{os.path.join(ckpt, CKPT)}); a run folder goes to --out_dir"
        )
    if not os.path.isfile(ckpt):
        raise UserError(f"--ckpt={ckpt}: no such checkpoint file (a run's {CKPT}, or a step checkpoint model_NNNNN.pt)")
    return ckpt


def checkpoint_model_args(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The model a checkpoint holds; one written before the modern switches existed has them off."""
    return {k: ckpt["model_args"].get(k, SWITCHES[k]) if k in SWITCHES else ckpt["model_args"][k] for k in MODEL_ARGS}


def load_checkpoint_model(path: str, device: str) -> tuple[GPT, Tokenizer, dict[str, Any]]:
    """A checkpoint file's model (eval mode, on `device`), its tokenizer, and the checkpoint itself."""
    ckpt = load_checkpoint(path, map_location="cpu")
    model = GPT(GPTConfig(**checkpoint_model_args(ckpt), dropout=0.0))
    load_model_state(model, ckpt["model"], path)
    model.eval().to(device)
    return model, checkpoint_tokenizer(ckpt), ckpt


def checkpoint_tokenizer(ckpt: dict[str, Any]) -> Tokenizer:
    """The tokenizer a checkpoint records; for nanoGPT's (which record none) its dataset's meta, else GPT-2 BPE."""
    if ckpt.get("tokenizer"):
        return from_spec(ckpt["tokenizer"])
    config = ckpt.get("config") or {}
    if "dataset" in config:  # nanoGPT: the dataset folder's meta.pkl, if it is still where it was
        folder = os.path.join(config.get("data_dir", "data"), config["dataset"])
        if os.path.isdir(folder):
            return from_spec(read_meta(folder))
    log("no tokenizer recorded in the checkpoint and no dataset meta found: assuming GPT-2 BPE")
    return from_spec({"tokenizer": "gpt2"})


def load_model(
    out_dir: str, ckpt: str | None, init_from: str, device: str
) -> tuple[GPT, Tokenizer, dict[str, Any] | None]:
    """The model `sample` and `eval` read, in eval mode on `device`: a run's checkpoint (init_from 'resume':
    --ckpt, else <out_dir>/ckpt.pt) or GPT-2's weights (a hub name or a Hugging Face folder). Returns (model,
    tokenizer, the checkpoint or None)."""
    if ckpt and init_from != "resume":
        raise UserError(f"--ckpt={ckpt} and --init_from={init_from} each name the model to load; give one of them")
    if init_from == "resume":
        return load_checkpoint_model(checkpoint_path(out_dir, ckpt), device)
    from gptforge.weights.pretrained import load_pretrained

    model, _ = load_pretrained(init_from)
    return model.eval().to(device), from_spec({"tokenizer": "gpt2"}), None
