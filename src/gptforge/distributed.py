"""Device, dtype and torchrun/DDP setup, written once for the whole package.

    env = setup_distributed(device="auto", backend="auto")   # reads RANK / LOCAL_RANK / WORLD_SIZE from torchrun
    ctx = autocast_context(env.device_type, "bfloat16")
    ...
    teardown(env)                                              # on every exit path

Without torchrun's variables this is a single process (rank 0 of 1) and no process group is created.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gptforge.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Dense (no sparsity) tensor-core peaks in FLOP/s from the vendors' data sheets, by device-name fragment.
# float32 is the TF32 tensor-core figure on Ampere and later, since configure_backends turns TF32 on.
GPU_PEAK_FLOPS = {
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "A10G": {"bfloat16": 70e12, "float16": 70e12, "float32": 35e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12},
    "4090": {"bfloat16": 165e12, "float16": 165e12, "float32": 83e12},
    "3090": {"bfloat16": 71e12, "float16": 71e12, "float32": 36e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
    "T4": {"float16": 65e12, "float32": 8.1e12},
}


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    ddp: bool = False  # a process group exists (launched by torchrun)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]


def resolve_device(name: str) -> str:
    """'auto' -> cuda > mps > cpu; an unavailable device is a user error naming --device."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device={name}: no CUDA device is available here; use --device=cpu or --device=auto")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device={name}: MPS is not available here; use --device=cpu or --device=auto")
    if kind not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device must be 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto'; got {name!r}")
    return name


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bfloat16 matrices in hardware (AMX tiles or AVX512-BF16).

    Without them oneDNN emulates bfloat16 and it runs several times slower than float32 (measured on a
    Skylake-SP: 50 vs 250 GFLOP/s); with AMX it runs 5-6x faster than float32.
    """
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


# Below this width bfloat16 does not pay on a CPU even with AMX: the matmuls are too small to gain and the
# bf16 flash-attention backward costs more than it saves (4 layers x 128 wide: 38.6 ms/step vs 31 in fp32).
CPU_BF16_MIN_WIDTH = 256


def resolve_dtype(name: str, device_type: str, n_embd: int | None = None) -> str:
    """'auto' -> bfloat16 on CUDA when supported, else float16 (with a GradScaler); on CPU bfloat16 when the
    hardware has it (AMX / AVX512-BF16) and the model is at least CPU_BF16_MIN_WIDTH wide, else float32;
    float32 on MPS."""
    if name == "auto":
        if device_type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        wide = n_embd is None or n_embd >= CPU_BF16_MIN_WIDTH
        if device_type == "cpu" and wide and cpu_has_fast_bf16():
            return "bfloat16"
        return "float32"
    if name not in DTYPES:
        raise UserError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    if name == "bfloat16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype=bfloat16: this GPU does not support bfloat16; use --dtype=float16")
    return name


def resolve_compile(value: bool | str, device_type: str) -> bool:
    """'auto' -> compile on CUDA, where it pays back its compile time; not on CPU/MPS, where it measured no faster."""
    return device_type == "cuda" if value == "auto" else bool(value)


def autocast_context(device_type: str, dtype: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass; float32 runs without autocast at all."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def configure_backends(device_type: str) -> None:
    """TF32 tensor cores for float32 matmuls on Ampere+ GPUs: ~8x the throughput at ~1e-3 relative precision."""
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def setup_distributed(device: str, backend: str) -> DistEnv:
    """One process per device under torchrun (RANK etc. set); otherwise a single process on `device`."""
    if "RANK" not in os.environ:
        return DistEnv(device=resolve_device(device))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(device)
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if backend == "auto" or (backend == "nccl" and not device.startswith("cuda")):
        backend = "nccl" if device.startswith("cuda") else "gloo"  # NCCL needs GPUs; gloo runs anywhere
    dist.init_process_group(backend=backend)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device, ddp=True)


def teardown(env: DistEnv) -> None:
    if env.ddp and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean of a tensor over all ranks (identity on one process)."""
    if env.ddp:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


def measure_matmul_flops(device: str, dtype: str, n: int = 2048, reps: int = 3) -> float:
    """Best FLOP/s of an n x n matrix product on this device and dtype: the machine's practical ceiling.

    The operands come from a private generator: measuring must not shift the training run's random stream.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(DTYPES[dtype])
    b = torch.randn(n, n, device=device, generator=gen).to(DTYPES[dtype])
    best = float("inf")
    for _ in range(reps + 1):  # the first product warms up kernels and caches
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: str, dtype: str, configured: float = 0.0) -> float:
    """The peak MFU is measured against: configured, else a GPU data-sheet figure, else a measured matmul ceiling."""
    if configured > 0:
        return configured
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name and dtype in table:
                return table[dtype]
    return measure_matmul_flops(device, dtype)


def step_is_finite(loss_sum: torch.Tensor, grad_norm: torch.Tensor, scaled: bool, env: DistEnv) -> bool:
    """Whether this step may reach the weights: a finite loss and gradient norm on every rank.

    Under float16 loss scaling an infinite gradient is the GradScaler's business (it skips the step and lowers
    the scale), so only the loss counts then. One host sync per step; all ranks agree.
    """
    bad = torch.stack([~torch.isfinite(loss_sum.detach().float()),
                       ~torch.isfinite(grad_norm.float()) & (not scaled)]).any().float()
    if env.ddp:
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
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
