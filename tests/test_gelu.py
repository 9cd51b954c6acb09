"""The MLP's GELU is a model setting (`gelu`): 'erf', the exact GELU nanoGPT's MLP has (the default for new models
and for nanoGPT's checkpoints), or 'tanh', GPT-2's approximation (Hugging Face's gelu_new: GPT-2's weights, and the
checkpoints and config.json files gptforge wrote before the setting existed). Checkpoints record it, a resumed run
keeps it, and an old run resumed through the real CLI trains on with the tanh GELU it had."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli, tiny_train_args
from gptforge.core.config import TrainConfig, saved_config
from gptforge.core.errors import UserError
from gptforge.core.shape import saved_model_args
from gptforge.model.gpt import GPT, MLP, GPTConfig
from gptforge.weights.checkpoint import checkpoint_model_args, load_checkpoint, save_checkpoint
from gptforge.weights.load import load_checkpoint_model

ARGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=True, vocab_size=40)


def mlp(gelu: str) -> MLP:
    torch.manual_seed(0)
    return MLP(GPTConfig(**ARGS, gelu=gelu)).double()


def test_the_erf_mlp_is_torchs_exact_gelu_and_the_tanh_one_is_gpt2s():
    x = torch.randn(3, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    erf, tanh = mlp("erf"), mlp("tanh")
    with torch.no_grad():
        h = erf.c_fc(x)
        exact = erf.c_proj(0.5 * h * (1 + torch.erf(h / 2**0.5)))  # the GELU's definition, written out
        gpt2 = erf.c_proj(0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3))))
        torch.testing.assert_close(erf(x), exact, rtol=0, atol=1e-12)
        torch.testing.assert_close(erf(x), erf.c_proj(F.gelu(h)), rtol=0, atol=0)
        torch.testing.assert_close(tanh(x), gpt2, rtol=0, atol=1e-12)
        assert (erf(x) - tanh(x)).abs().max() > 1e-4  # two functions, not one


def test_new_models_are_erf_and_the_setting_is_checked():
    assert TrainConfig().gelu == GPTConfig().gelu == "erf"
    from gptforge.core.config import load_config

    assert load_config(["--gelu=tanh"]).gelu == "tanh"
    with pytest.raises(UserError, match="--gelu: gelu must be one of erf, tanh; got 'exact'"):
        load_config(["--gelu=exact"])
    with pytest.raises(UserError, match="model_args gelu='relu' is not one of erf, tanh"):
        saved_model_args({**ARGS, "gelu": "relu"})
    with pytest.raises(UserError, match="^run/ckpt.pt: model_args gelu='relu'"):  # a checkpoint's names its file
        checkpoint_model_args({"model_args": {**ARGS, "gelu": "relu"}, "format_version": 1}, "run/ckpt.pt")


def save_old_run(path, model: GPT, nanogpt: bool = False) -> None:
    """A checkpoint written before the setting existed: model_args without gelu (nanoGPT's: no format_version)."""
    state = {"model": model.state_dict(), "model_args": dict(ARGS), "iter_num": 3, "best_val_loss": 9.0}
    ours = {"config": {}, "tokenizer": {"tokenizer": "char", "itos": [chr(65 + i) for i in range(40)]}}
    save_checkpoint(str(path), state if nanogpt else {**state, **ours, "format_version": 1})


@pytest.mark.parametrize("nanogpt,gelu", [(False, "tanh"), (True, "erf")], ids=["old gptforge", "nanoGPT"])
def test_a_checkpoint_without_the_key_loads_as_its_model_was(tmp_path, nanogpt, gelu):
    """Older gptforge's MLP had the tanh GELU and nanoGPT's the exact one: each loads with its own, and its
    logits are bit for bit those of the model that wrote it."""
    torch.manual_seed(2)
    before = GPT(GPTConfig(**ARGS, gelu=gelu)).eval()
    save_old_run(tmp_path / "ckpt.pt", before, nanogpt)
    assert checkpoint_model_args(load_checkpoint(str(tmp_path / "ckpt.pt")), "x")["gelu"] == gelu
    model, _, _ = load_checkpoint_model(str(tmp_path / "ckpt.pt"), "cpu")
    assert model.config.gelu == gelu
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(idx, idx)[0], before(idx, idx)[0])


def test_an_old_config_json_reads_as_tanh(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 2, "dataset": "tiny"}))
    assert saved_config(str(tmp_path)).gelu == "tanh"
    (tmp_path / "config.json").write_text(json.dumps({"gelu": "erf"}))
    assert saved_config(str(tmp_path)).gelu == "erf"
    (tmp_path / "config.json").write_text(json.dumps({"gelu": "exact"}))
    with pytest.raises(UserError, match="gelu must be one of erf, tanh"):
        saved_config(str(tmp_path))


def test_a_run_written_before_the_setting_resumes_with_tanh_bit_for_bit(char_data, tmp_path):
    """An old run (config.json and checkpoint without gelu) resumed through the CLI keeps the tanh GELU it was
    trained with: its weights after the resume equal those of a tanh run trained in one go, and its new checkpoint
    records the setting; --gelu=erf on the resume is refused (a resumed model keeps its shape)."""
    run = dict(max_iters=6, lr_decay_iters=6, eval_interval=3, gelu="tanh")
    whole, old = tmp_path / "whole", tmp_path / "old"
    for out, steps in ((whole, 6), (old, 3)):
        r = run_cli("train", *tiny_train_args(char_data, out, **{**run, "max_iters": steps}), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "gelu"}))
    ckpt = torch.load(old / "ckpt.pt", weights_only=True)
    ckpt["model_args"].pop("gelu")
    ckpt["config"].pop("gelu")
    torch.save(ckpt, old / "ckpt.pt")

    refused = run_cli("train", f"--out_dir={old}", "--init_from=resume", "--max_iters=6", "--gelu=erf", cwd=tmp_path)
    assert refused.returncode == 2 and "--gelu=erf: the run in" in refused.stderr and "Traceback" not in refused.stderr
    r = run_cli("train", f"--out_dir={old}", "--init_from=resume", "--max_iters=6", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "recipe: model switches on: gelu=tanh" in r.stdout + r.stderr
    a, b = load_checkpoint(str(whole / "ckpt.pt")), load_checkpoint(str(old / "ckpt.pt"))
    assert b["model_args"]["gelu"] == "tanh" and json.loads((old / "config.json").read_text())["gelu"] == "tanh"
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
