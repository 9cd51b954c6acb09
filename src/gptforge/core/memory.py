"""What a training run needs in memory, estimated from its settings before anything is allocated, so that a
config far too big for the machine is a clear error instead of an allocation traceback (docs/PERFORMANCE.md,
"Memory")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptforge.core.errors import UserError
from gptforge.core.shape import parameter_count, saved_model_args

GB = 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process: weights, gradients and the optimizer's state (float32), and the activations one
    micro-batch keeps for its backward pass."""

    parameters: int  # count
    states: float  # weights + gradients + optimizer state
    activations: float
    optimizer: str = "adamw"

    @property
    def total(self) -> float:
        return self.states + self.activations

    def describe(self) -> str:
        return (
            f"~{self.total / GB:.2f} GB ({self.parameters / 1e6:,.2f}M parameters: {self.states / GB:.2f} GB with "
            f"gradients and {'Muon / AdamW' if self.optimizer == 'muon' else 'AdamW'} state; activations "
            f"{self.activations / GB:.2f} GB)"
        )


def estimate_training_memory(
    model_args: dict[str, Any],
    batch_size: int,
    dtype: str,
    optimizer: str = "adamw",
    shards: int = 1,
    head_loss: bool = False,
    score_bytes: int = 0,
) -> MemoryEstimate:
    """A lower-bound estimate, so that it never refuses a config that fits: every parameter the model has
    (core/shape.parameter_count: the untied head and the position table included as the model has them) at 4 bytes
    for the weight, 4 for the gradient and 8 for AdamW's two moments (4 for Muon's one momentum on the blocks'
    matrices), divided over `shards` under FSDP; and per token of the micro-batch about 16 C saved values per block
    (norm outputs, q, k, v, attention output, the MLP's 4C input and activation) and the logits (3 copies of V
    floats: logits, their float32 cast, the softmax gradient; with `head_loss` (kernels/head_loss.py) one, in the
    compute dtype: the logits' gradient written over them). score_bytes: what the attention keeps per sequence and
    layer where it materialises its T x T probabilities (kernels/attention.saved_score_bytes; 0 where SDPA's kernels
    keep only their output)."""
    total, matrices = parameter_count(saved_model_args(model_args))
    moments = 8 * total - (4 * matrices if optimizer == "muon" else 0)
    states = (8 * total + moments) / shards
    L, C, T, V = model_args["n_layer"], model_args["n_embd"], model_args["block_size"], model_args["vocab_size"]
    width = 4 if dtype == "float32" else 2  # autocast keeps most saved activations in 16 bits
    tokens = batch_size * T
    logits = V * width if head_loss else 3 * V * 4
    activations = tokens * (16 * L * C * width + logits) + batch_size * L * score_bytes
    return MemoryEstimate(total, states, activations, optimizer)


def check_fits(estimate: MemoryEstimate, available: float | None, where: str) -> None:
    """A UserError naming the keys to lower when the estimate exceeds the memory `available` on `where`."""
    if available is None or estimate.total <= available:
        return
    raise UserError(
        f"this config needs {estimate.describe()} per process, but {where} has {available / GB:.2f} GB available: "
        "lower --n_embd or --n_layer (parameters), --batch_size or --block_size (activations; keep the tokens per "
        "step with --gradient_accumulation_steps)"
    )
