"""Checkpoints: round trip, atomic replacement, safe loading, nanoGPT compatibility, RNG capture."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.optim import configure_optimizer
from gptforge.train import runstate
from gptforge.weights import checkpoint as ck
from gptforge.weights.load import checkpoint_model

ARGS = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=False, vocab_size=20)


def trained_pair():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ARGS))
    opt = configure_optimizer(model, 0.1, 1e-2, (0.9, 0.95), "cpu")
    idx = torch.randint(0, 20, (4, 8))
    for _ in range(3):
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def test_round_trip_with_weights_only(tmp_path):
    model, opt = trained_pair()
    path = str(tmp_path / "ckpt.pt")
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "model_args": ARGS,
        "iter_num": 3,
        "best_val_loss": 2.5,
        "config": {"dataset": "x", "lr": 0.1},
        "rng": runstate.capture_rng(),
        "format_version": ck.FORMAT_VERSION,
    }
    ck.save_checkpoint(path, state)
    loaded = ck.load_checkpoint(path)
    assert loaded["iter_num"] == 3 and loaded["best_val_loss"] == 2.5 and loaded["config"]["dataset"] == "x"
    assert torch.load(path, weights_only=True)["model_args"] == ARGS  # plain torch can read it safely too
    model2, _ = checkpoint_model(loaded, path)
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    opt2 = configure_optimizer(model2, 0.1, 1e-2, (0.9, 0.95), "cpu")
    opt2.load_state_dict(loaded["optimizer"])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    assert [f for f in os.listdir(tmp_path) if f != "ckpt.pt"] == []


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    ck.save_checkpoint(path, {"model": {}, "model_args": ARGS, "iter_num": 1})
    before = open(path, "rb").read()

    def full_disk(obj, fh):
        fh.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match="No space left on device; the previous checkpoint is intact"):
        ck.save_checkpoint(path, {"model": {}, "model_args": ARGS, "iter_num": 2})
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_missing_truncated_and_foreign_files_are_named(tmp_path):
    with pytest.raises(UserError, match="checkpoint .*nope.pt not found"):
        ck.load_checkpoint(str(tmp_path / "nope.pt"))
    model, opt = trained_pair()
    good = tmp_path / "good.pt"
    ck.save_checkpoint(str(good), {"model": model.state_dict(), "model_args": ARGS})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError, match="cannot read checkpoint .*cut.pt"):
        ck.load_checkpoint(str(cut))
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(UserError, match="not a gptforge or nanoGPT checkpoint"):
        ck.load_checkpoint(str(other))


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickle_that_runs_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "model_args": ARGS, "payload": RunsCode()}, evil)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(UserError, match="evil.pt: it holds pickled objects other than tensors"):
        ck.load_checkpoint(str(evil))
    assert not (tmp_path / "pwned").exists()


def test_nanogpt_checkpoint_loads_as_it_is(tmp_path):
    """nanoGPT saves a compiled model's state dict (`_orig_mod.` prefix) and best_val_loss as a tensor."""
    model, opt = trained_pair()
    nanogpt = {
        "model": {"_orig_mod." + k: v for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "model_args": {**ARGS, "dropout": 0.0},
        "iter_num": 250,
        "best_val_loss": torch.tensor(1.4697),
        "config": {"dataset": "shakespeare_char", "batch_size": 64},
    }
    path = tmp_path / "ckpt.pt"
    torch.save(nanogpt, path)
    loaded = ck.load_checkpoint(str(path))
    assert all(not k.startswith("_orig_mod.") for k in loaded["model"])
    fresh, _ = checkpoint_model(loaded, str(path))
    idx = torch.randint(0, 20, (2, 8))
    torch.testing.assert_close(fresh(idx, idx)[0], model(idx, idx)[0], rtol=0, atol=0)
    assert float(loaded["best_val_loss"]) == pytest.approx(1.4697)


def test_clean_state_dict_strips_prefixes_and_mask_buffers():
    t = torch.zeros(2)
    sd = {
        "module._orig_mod.transformer.wte.weight": t,
        "module.lm_head.weight": t,
        "transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4),
        "transformer.h.0.attn.c_attn.bias": t,
    }
    assert sorted(ck.clean_state_dict(sd)) == [
        "lm_head.weight",
        "transformer.h.0.attn.c_attn.bias",
        "transformer.wte.weight",
    ]


def test_checkpoint_of_another_shape_is_named(tmp_path):
    model, _ = trained_pair()
    other = {"model": model.state_dict(), "model_args": {**ARGS, "n_embd": 32}, "format_version": ck.FORMAT_VERSION}
    with pytest.raises(UserError, match=r"x.pt does not fit this model .*n_embd"):
        checkpoint_model(other, "x.pt")


def test_rng_capture_restores_every_generator():
    state = runstate.capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    runstate.restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_copies_get_the_same_bytes_and_a_failed_copy_changes_nothing(tmp_path, monkeypatch):
    path, best = str(tmp_path / "ckpt.pt"), str(tmp_path / "ckpt_best.pt")
    ck.save_checkpoint(path, {"model": {}, "model_args": ARGS, "iter_num": 1}, copies=[best])
    assert open(path, "rb").read() == open(best, "rb").read()
    before = {p: open(p, "rb").read() for p in (path, best)}

    def full_disk(src, dst):
        dst.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.shutil, "copyfileobj", full_disk)
    with pytest.raises(UserError, match=f"cannot write checkpoint {path}: No space left on device"):
        ck.save_checkpoint(path, {"model": {}, "model_args": ARGS, "iter_num": 2}, copies=[best])
    assert {p: open(p, "rb").read() for p in (path, best)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt_best.pt"]


def test_rotation_keeps_the_newest_step_checkpoints(tmp_path):
    for step in (5, 10, 15, 100000):
        (tmp_path / ck.step_checkpoint_name(step)).write_bytes(b"x")
    (tmp_path / "model_final.pt").write_bytes(b"x")  # not a step checkpoint: never touched
    assert ck.rotate_step_checkpoints(str(tmp_path), 0) == []
    removed = ck.rotate_step_checkpoints(str(tmp_path), 2)
    assert [os.path.basename(p) for p in removed] == ["model_00005.pt", "model_00010.pt"]
    assert sorted(os.listdir(tmp_path)) == ["model_00015.pt", "model_100000.pt", "model_final.pt"]


def test_an_interrupt_inside_a_write_whose_clean_up_fails_is_still_the_interrupt(tmp_path):
    """torch.save's zip writer, interrupted mid-write, fails again closing the file ("unexpected pos"): the
    command must still end as interrupted (exit 130), the old file intact and no temporary left."""
    from gptforge.core.files import atomic_write

    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(str(target)) as fh:
            try:
                fh.write(b"half")
                raise KeyboardInterrupt
            finally:
                raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["ckpt.pt"]
    with pytest.raises(RuntimeError):  # an error with no interrupt behind it stays itself
        with atomic_write(str(target)) as fh:
            raise RuntimeError("disk on fire")
