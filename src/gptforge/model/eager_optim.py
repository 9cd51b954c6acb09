"""torch's optimizers without the import of torch._dynamo that their methods make on first call.

torch.optim wraps Optimizer.add_param_group, zero_grad, state_dict and load_state_dict in `torch._disable_dynamo`
and each optimizer's step in `_use_grad_for_differentiable`. Both import torch._dynamo when first called (about
0.75 s of a training process on a 2-core CPU, more than a second on a slow one: docs/lab/2026-11-26-zen5.md), only to
keep torch.compile from tracing into the method or to break its graph there. An eager run needs neither.

EagerMethods, mixed in before a torch optimizer, calls the same functions without those two wrappers while
nothing is being compiled, and the wrapped ones otherwise (inside a compiled region, where dynamo needs them).
The arithmetic, the state dicts and the step hooks are torch's own: tests/test_eager_optim.py checks the
parameters and states against torch.optim.AdamW's, bit for bit, and that no torch._dynamo is imported.

    optimizer = EagerAdamW(groups, lr=6e-4, betas=(0.9, 0.95))   # torch.optim.AdamW in every other respect
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

# (function name, file) of the wrappers that only matter to dynamo: torch._disable_dynamo's `inner`,
# _use_grad_for_differentiable's `_use_grad` (its grad mode is set again in `step` below), and the step hook's
# `wrapper` (Optimizer._patch_step_function puts it around this class's own step, which runs the hooks once)
_DYNAMO_ONLY = {
    ("inner", ("torch", "_compile.py")),
    ("_use_grad", ("optim", "optimizer.py")),
    ("wrapper", ("optim", "optimizer.py")),
}


def bare(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn without torch's dynamo-only wrappers; fn itself where it is wrapped in anything else (a later torch
    that changes them then only costs the import again, never a different result)."""
    while True:
        inner = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        if inner is None or code is None:
            return fn
        where = tuple(os.path.normpath(code.co_filename).split(os.sep)[-2:])
        if (code.co_name, where) not in _DYNAMO_ONLY:
            return fn
        fn = inner


class EagerMethods:
    """Mixed in before a torch.optim.Optimizer subclass (see the module's docstring)."""

    def _eager(self, name: str) -> Callable[..., Any] | None:
        if torch.compiler.is_compiling():
            return None
        method = getattr(super(), name)  # the class's own (wrapped) method, bound
        return bare(method.__func__).__get__(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        return (self._eager("add_param_group") or super().add_param_group)(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        return (self._eager("zero_grad") or super().zero_grad)(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return (self._eager("state_dict") or super().state_dict)()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return (self._eager("load_state_dict") or super().load_state_dict)(state_dict)

    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        step = self._eager("step")
        if step is None:
            return super().step(closure)
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):  # what _use_grad sets
            return step(closure)


class EagerAdamW(EagerMethods, torch.optim.AdamW):
    """torch.optim.AdamW, without importing torch._dynamo in eager runs."""
