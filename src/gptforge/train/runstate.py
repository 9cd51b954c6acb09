"""Everything a resumed run needs besides the weights, captured and restored side by side: every random stream
(python, numpy, torch, CUDA), each rank's data position, and the optimizer state in either layout (one process /
DDP: numbered; FSDP: by parameter name). docs/ARCHITECTURE.md "Randomness and exact resume"."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from gptforge.core.distributed import DistEnv, gather
from gptforge.core.errors import UserError


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
    names (`named_optimizer_state`), an 'fqn' one to a plain model through torch's state-dict helpers.

    The checkpoint gives the state (moments, momentum buffers, step counts); the resuming run's own settings give
    every group's hyperparameters (lr_scale from muon_lr, betas, weight_decay, momentum, ns_dtype...), which
    torch's load_state_dict would take from the checkpoint instead: a setting changed on resume, which start.py
    announces, then takes effect (nanoGPT's train.py keeps the checkpoint's betas and weight decay silently)."""
    ours = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    fqn = ckpt.get("optimizer_format") == "fqn"
    if not fqn and not fsdp:
        optimizer.load_state_dict(ckpt["optimizer"])
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = ckpt["optimizer"] if fqn else named_optimizer_state(model, optimizer, ckpt["optimizer"], path)
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    for group, settings in zip(optimizer.param_groups, ours, strict=True):
        params = group["params"]
        group.clear()  # a key this run does not set goes too (a muon_split_qkv run's row_blocks, resumed without it)
        group.update({"params": params, **settings})  # in the order a freshly built group has


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
    if state and state.get("kind") == batches.state_dict()["kind"]:
        if same_world or state["kind"] in ("sharded", "chat"):  # a global position: any number of processes
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


def capture(model, optimizer, scaler, fsdp: bool, env: DistEnv, data_state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds of the run besides its settings: the weights and optimizer state (gathered whole
    under FSDP), the loss scale, and every rank's random streams and data position (all ranks call; the result
    matters on rank 0). `restore` reads it back."""
    rngs, data_states = gather(capture_rng(), env), gather(data_state, env)
    model_state, optimizer_state = full_states(model, optimizer, fsdp)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "optimizer_format": "fqn" if fsdp else "torch",
        "scaler": scaler.state_dict(),
        "rng": rngs[0],
        "rng_per_rank": rngs,
        "data_state": {"train": data_states[0], "train_per_rank": data_states},
    }


def restore(ckpt: dict[str, Any], source: str, model, optimizer, scaler, batches, env: DistEnv, fsdp: bool, seed: int):
    """What `capture` saved, back into a resumed run: optimizer, loss scale, RNGs and data position; returns
    (iter_num, best_val_loss, a line to print or '')."""
    load_optimizer_state(model, optimizer, ckpt, fsdp, source)
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    told = restore_run_state(ckpt, env, batches, seed)
    return int(ckpt["iter_num"]), float(ckpt["best_val_loss"]), told
