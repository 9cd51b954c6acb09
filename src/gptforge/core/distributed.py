"""Several processes under torchrun: the process group, ranks, collectives, and the stop flag they agree on.
Without torchrun's variables this is a single process (rank 0 of 1) and no process group is created."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gptforge.core.device import configure_backends, device_type, resolve_device


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    ddp: bool = False  # a process group exists (launched by torchrun)
    restart: int = 0  # torchrun --max-restarts: how many times the group has been started again

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return device_type(self.device)

    def fsdp(self, parallel: str) -> bool:
        """Whether the model is sharded: parallel='fsdp' and more than one process (one process never shards)."""
        return self.ddp and parallel == "fsdp"

    def micro_steps(self, gradient_accumulation_steps: int) -> int:
        """Micro-batches per optimizer step on this rank (the setting counts them over all ranks)."""
        return gradient_accumulation_steps // self.world_size

    def say(self, message: str) -> None:
        """A message for the person running training, from rank 0 only (the run's own lines go to stdout)."""
        if self.is_main and message:
            print(message, flush=True)


def setup_distributed(device: str, backend: str) -> DistEnv:
    """One process per device under torchrun (RANK etc. set); otherwise a single process on `device`. The device's
    backends are configured (CPU threads, TF32) before anything runs on it."""
    if "RANK" not in os.environ:
        env = DistEnv(device=resolve_device(device))
        configure_backends(env.device_type)
        return env
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(device)
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if backend == "auto" or (backend == "nccl" and not device.startswith("cuda")):
        backend = "nccl" if device.startswith("cuda") else "gloo"  # NCCL needs GPUs; gloo runs anywhere
    # FSDP's and distributed checkpoint's modules first: imported once a group exists, they keep the default group
    # as a default argument (torch 2.13's ShardedGradScaler: process_group=dist.group.WORLD), so
    # destroy_process_group no longer ends it and gloo's threads run into the interpreter's shutdown, which aborts a
    # rank now and then ("terminate called without an active exception", SIGABRT, after its work is done). FSDP
    # training, every checkpoint's state_dict gathering and HellaSwag's check for a sharded model import them late.
    import torch.distributed.checkpoint.state_dict as _dcp  # noqa: F401  (`import torch....` would make `torch`
    import torch.distributed.fsdp as _fsdp  # noqa: F401  a local name of this function)

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restart:
        # torchrun --max-restarts keeps one store across a group's restarts, and the process group's keys from
        # the attempt before (the dead ranks' addresses) would be read again: gloo then waits on them for ever
        # (torch 2.13). Each attempt's own prefix keeps them apart.
        store, _, _ = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"gptforge/restart-{restart}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend=backend)
    env = DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device, ddp=True, restart=restart)
    configure_backends(env.device_type)
    return env


def teardown(env: DistEnv) -> None:
    """End the process group, and with it gloo's threads, while the interpreter still runs normally. Whatever holds
    the group from C++ must be gone first: DDP's Reducer does (torch 2.13), and a group freed through it is
    destroyed with the GIL held, while its runloop thread may need the GIL to free the last collective's tensors: a
    rank then hangs at exit after its work (or, freed during the interpreter's shutdown, aborts with "terminate
    called without an active exception"). So callers drop their wrappers before this (train does), and the
    collection here frees the ones a reference cycle still holds; the group itself then goes through
    destroy_process_group, which releases the GIL."""
    if env.ddp and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean of a tensor over all ranks (identity on one process)."""
    if env.ddp:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


def gather(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's `obj`, in rank order (all ranks must call)."""
    if not env.ddp:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def step_is_finite(loss_sum: torch.Tensor, grad_norm: torch.Tensor, scaled: bool, env: DistEnv) -> bool:
    """Whether this step may reach the weights: a finite loss and gradient norm on every rank.

    Under float16 loss scaling an infinite gradient is the GradScaler's business (it skips the step and lowers
    the scale), so only the loss counts then. One host sync (`.item()`) every step; all ranks agree.
    """
    bad = (
        torch.stack([~torch.isfinite(loss_sum.detach().float()), ~torch.isfinite(grad_norm.float()) & (not scaled)])
        .any()
        .float()
    )
    if env.ddp:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


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
            print(
                f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                "(send it again to stop at once)",
                flush=True,
            )

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
        """Under DDP: stop when any rank was asked to (one all-reduce and host sync per step)."""
        if self.env.ddp:
            flag = torch.tensor(float(self.requested), device=self.env.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.requested = bool(flag.item())
