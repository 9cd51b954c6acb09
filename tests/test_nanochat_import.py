"""A Hugging Face NanoChat folder in through --init_from=FOLDER: one written by transformers' own
NanoChatForCausalLM gives its logits within 1e-5 and its greedy text; gptforge's export loads back exactly;
training and sampling start from such a folder through the real CLI; what GPT cannot compute is refused."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, tiny_train_args
from gptforge.core.errors import UserError
from gptforge.infer.engine import generate
from gptforge.weights.export import export_hf
from gptforge.weights.pretrained import load_pretrained
from test_modern import ALL_ON, tiny

transformers = pytest.importorskip("transformers")


def their_model(folder, seed: int = 3, **overrides) -> torch.nn.Module:
    """A NanoChatForCausalLM with every weight random, saved by transformers into `folder`."""
    config = dict(
        vocab_size=50257,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        final_logit_softcapping=12.0,
    )
    torch.manual_seed(seed)
    model = transformers.NanoChatForCausalLM(transformers.NanoChatConfig(**{**config, **overrides}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(folder)
    return model.eval()


def test_a_folder_transformers_wrote_gives_its_logits_and_greedy_text(tmp_path):
    theirs = their_model(tmp_path / "hf")
    ours, args = load_pretrained(str(tmp_path / "hf"))
    ours.eval()
    assert args["rotary"] and args["untie_head"] and (args["rope_base"], args["logit_softcap"]) == (300.0, 12.0)
    idx = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx, idx)[0], theirs(idx).logits, rtol=0, atol=1e-5)
        prompt = idx[:1, :5]
        hf_text = theirs.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 20, temperature=0), hf_text)


def test_an_export_loads_back_to_the_same_weights(tmp_path):
    model = tiny(**{**ALL_ON, "rope_base": 500.0})
    export_hf(model, str(tmp_path / "hf"), None)
    back, args = load_pretrained(str(tmp_path / "hf"), block_size=16)
    assert {k: args[k] for k in (*ALL_ON, "rope_base")} == {**ALL_ON, "zero_init": False, "rope_base": 500.0}
    assert args["block_size"] == 16 and back.transformer.wte.weight is not back.lm_head.weight
    theirs = model.state_dict()
    assert set(back.state_dict()) == set(theirs)
    for key, value in back.state_dict().items():
        assert torch.equal(value, theirs[key]), key


@pytest.mark.parametrize(
    "setting, value",
    [("tie_word_embeddings", True), ("hidden_act", "gelu"), ("num_key_value_heads", 1), ("intermediate_size", 96)],
)
def test_settings_gpt_cannot_compute_are_refused_naming_them(tmp_path, setting, value):
    their_model(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config[setting] = value
    path.write_text(json.dumps(config))
    with pytest.raises(UserError, match=f"this NanoChat variant is not supported: {setting}={value!r}"):
        load_pretrained(str(tmp_path / "hf"))


def test_damaged_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    their_model(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(UserError, match=r"missing model\.layers\.1\.self_attn\.q/k/v_proj\.weight"):
        load_pretrained(str(tmp_path / "hf"))


def test_train_and_sample_start_from_a_nanochat_folder(tmp_path, bpe_data):
    from gptforge.weights.checkpoint import load_checkpoint

    their_model(tmp_path / "hf")
    args = tiny_train_args(
        bpe_data,
        tmp_path / "ft",
        dataset="bpe",
        init_from=tmp_path / "hf",
        n_layer=None,
        n_head=None,
        n_embd=None,
        max_iters=4,
        eval_interval=2,
        learning_rate=1e-3,
        optimizer="muon",
    )
    r = run_cli("train", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    model_args = load_checkpoint(str(tmp_path / "ft/ckpt.pt"))["model_args"]
    on = {k: model_args[k] for k in ("rotary", "rmsnorm", "qk_norm", "relu2", "untie_head", "bias", "logit_softcap")}
    assert on == dict(
        rotary=True, rmsnorm=True, qk_norm=True, relu2=True, untie_head=True, bias=False, logit_softcap=12.0
    )
    steps = [json.loads(x) for x in (tmp_path / "ft/metrics.jsonl").read_text().splitlines()]
    evals = [s["val_loss"] for s in steps if s["kind"] == "eval"]
    assert evals[-1] < evals[0]  # fine-tuning improved on the folder's weights

    r = run_cli("sample", f"--init_from={tmp_path / 'hf'}", "--start=To be", "--num_samples=1", "--max_new_tokens=5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be")
