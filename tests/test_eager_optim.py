"""model/eager_optim.py: torch's AdamW (and MuonAdamW's torch.optim methods) without importing torch._dynamo in
eager runs. The reference is torch.optim.AdamW itself: the same parameters and states bit for bit, state dicts
that load into either, the step hooks run once; under dynamo the wrapped methods run as before."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gptforge.model.eager_optim import EagerAdamW, bare


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() == 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 3) -> None:
    data = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(5, 6, generator=data)
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (i + 1) / steps  # a schedule, as training sets it
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


@pytest.mark.parametrize("foreach", [None, True])
def test_eager_adamw_steps_as_torchs_adamw(foreach):
    ours, theirs = _model(1), _model(1)
    opt_ours = EagerAdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.95), foreach=foreach)
    opt_theirs = torch.optim.AdamW(_groups(theirs), lr=1e-2, betas=(0.9, 0.95), foreach=foreach)
    _train(ours, opt_ours, 6)
    _train(theirs, opt_theirs, 6)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q)
    _assert_same_state(opt_ours.state_dict(), opt_theirs.state_dict())
    assert isinstance(opt_ours, torch.optim.AdamW)


def test_state_dicts_load_into_either_and_continue_alike():
    """A checkpoint's optimizer state moves between torch's AdamW and ours (nanoGPT's checkpoints hold torch's)."""
    first = _model(2)
    opt = torch.optim.AdamW(_groups(first), lr=1e-2)
    _train(first, opt, 3)
    saved_model, saved_opt = first.state_dict(), opt.state_dict()
    continued = []
    for kind in (torch.optim.AdamW, EagerAdamW):
        model = _model(9)
        model.load_state_dict(saved_model)
        optimizer = kind(_groups(model), lr=1e-2)
        optimizer.load_state_dict(copy.deepcopy(saved_opt))  # loading keeps the dict's tensors, which steps change
        _train(model, optimizer, 3, seed=4)
        continued.append((model, optimizer))
    (m1, o1), (m2, o2) = continued
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)
    _assert_same_state(o1.state_dict(), o2.state_dict())
    back = torch.optim.AdamW(_groups(_model(9)), lr=1e-2)
    back.load_state_dict(o2.state_dict())  # and ours back into torch's
    _assert_same_state(back.state_dict(), o1.state_dict())


def test_step_hooks_run_once_a_step():
    model = _model(3)
    optimizer = EagerAdamW(_groups(model), lr=1e-2)
    calls = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    handle = register_optimizer_step_post_hook(lambda *_: calls.append("global"))
    try:
        _train(model, optimizer, 2)
    finally:
        handle.remove()
    assert calls == ["pre", "post", "global"] * 2


def test_step_runs_without_grad_and_leaves_the_mode_as_it_was():
    """The step's in-place updates of leaf parameters need grad mode off (what torch's wrapper sets); after it the
    caller's mode is back, and torch's own class is left as it was."""
    model = _model(4)
    optimizer = EagerAdamW(_groups(model), lr=1e-2)
    modes = []
    optimizer.register_step_pre_hook(lambda *_: modes.append(torch.is_grad_enabled()))
    model(torch.randn(2, 6)).sum().backward()
    original = torch.optim.Adam.step
    optimizer.step()
    assert modes == [True] and torch.is_grad_enabled() and torch.optim.Adam.step is original
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "weight_decay": 0.0})
    assert optimizer.param_groups[-1]["lr"] == 1e-2 and optimizer.param_groups[-1]["betas"] == (0.9, 0.999)


def test_bare_unwraps_only_torchs_dynamo_wrappers():
    def plain(x):
        return x

    @functools.wraps(plain)
    def other_wrapper(x):
        return plain(x) + 1

    assert bare(other_wrapper) is other_wrapper  # a wrapper it does not know stays
    assert bare(plain) is plain
    unwrapped = bare(torch.optim.Optimizer.zero_grad)
    assert unwrapped is not torch.optim.Optimizer.zero_grad and unwrapped.__code__.co_name == "zero_grad"
    assert bare(torch.optim.AdamW.step).__code__.co_name == "step"


def test_under_dynamo_the_wrapped_methods_run():
    """Inside a compiled function (here dynamo with its eager backend) the methods go through torch's wrappers,
    as torch.optim.AdamW's do, and step alike."""
    results = []
    for kind in (torch.optim.AdamW, EagerAdamW):
        model = _model(5)
        optimizer = kind(_groups(model), lr=1e-2)
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(1))).sum().backward()
        torch.compile(optimizer.step, backend="eager")()
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results, strict=True):
        assert torch.equal(p, q)


PROGRAM = textwrap.dedent(
    """
    import sys, torch
    from gptforge.model.gpt import GPT, GPTConfig
    from gptforge.model.optim import MuonSettings, configure_optimizer
    muon = None if sys.argv[1] == "adamw" else MuonSettings(lr=0.02, momentum=0.95, warmup=10, dtype="float32")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=11, dropout=0.2, bias=False))
    model.use_fast_dropout(True)
    optimizer = configure_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu", muon=muon)
    idx = torch.randint(0, 11, (2, 16))
    for _ in range(2):
        model(idx, idx)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer.load_state_dict(optimizer.state_dict())
    if sys.argv[2] == "torch":  # the control: torch's own AdamW imports it
        torch.optim.AdamW(model.parameters()).step()
    print("torch._dynamo" in sys.modules)
    """
)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_eager_training_does_not_import_dynamo(optimizer):
    """Building the optimizer, dropout's masks, steps, zero_grad and the state dict's round trip: torch._dynamo is
    never imported (it cost ~0.75 s of every training process); torch's own AdamW, the control, imports it."""
    answers = []
    for control in ("ours", "torch"):
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM, optimizer, control], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        answers.append(done.stdout.split()[-1])
    assert answers == ["False", "True"]
