"""The network's small layers: torch's modules (the same parameters, names and state_dict) whose forward is one call
of a kernels function, which chooses its own path (kernels/). Their switches, `fast_dropout` and `onednn`, are set
by GPT.use_fast_dropout and GPT.use_onednn_f32."""

from __future__ import annotations

import torch
import torch.nn as nn

from gptforge.kernels.activations import relu2
from gptforge.kernels.dropout import Norm, dropout, residual_add
from gptforge.kernels.linear import linear
from gptforge.kernels.norms import layer_norm, rms_norm


class Linear(nn.Linear):
    """nn.Linear; with `onednn` set, its float32 CPU products by oneDNN (kernels/linear.py)."""

    onednn = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.onednn)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm; on a CPU under bf16 autocast written straight into bf16 (kernels/norms.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Parameter-free RMSNorm before a linear layer: under autocast written straight in autocast's dtype, which the
    layer would convert it to anyway (one pass fewer each way); otherwise in x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        return rms_norm(x, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)


class ReLU2(nn.Module):
    """relu(x)^2, nanochat's and modded-nanogpt's MLP activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu2(x)


def residual(x: torch.Tensor, y: torch.Tensor, dropout: nn.Module) -> torch.Tensor:
    """x + dropout(y): a residual connection with dropout on its branch, the sum and the dropout taken together
    (Dropout.add_to); for any other module (torch's own nn.Dropout), the plain sum."""
    return dropout.add_to(x, y) if isinstance(dropout, Dropout) else x + dropout(y)


class Dropout(nn.Dropout):
    """nn.Dropout, with `fast_dropout` on cheaper masks (kernels/dropout.py). `add_to(x, y)`: x + self(y), a residual
    connection with this dropout on its branch, taken in one pass where a kernel has it; `norm_after`: the LayerNorm
    the sum goes through next, which that pass can compute too (set by GPT, not a submodule: no second name for it
    in the state_dict)."""

    fast_dropout = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.fast_dropout)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        norm = self.__dict__.get("norm_after")
        then: Norm | None = (norm.weight, norm.bias, norm.eps) if isinstance(norm, LayerNorm) else None
        return residual_add(x, y, self.p, self.training, self.fast_dropout, then)

    def follow_with(self, norm: nn.Module) -> None:
        self.__dict__["norm_after"] = norm
