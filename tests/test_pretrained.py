"""GPT-2 weights in and out, against transformers itself: a tiny random GPT2LMHeadModel saved to a folder is
loaded into GPT with the same logits, and GPT exported to a folder loads in transformers with the same logits,
a working text-generation pipeline and OpenAI's own tokenizer files. The hub is never reached."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers  # the [hf] extra; the [test] extra installs it

from conftest import SHARED, need_shared, run_cli
from gptforge.core.config import GPT2_NAMES
from gptforge.core.errors import UserError
from gptforge.core.shape import SWITCHES
from gptforge.infer.engine import generate
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.weights.checkpoint import save_checkpoint
from gptforge.weights.export import export_hf
from gptforge.weights.pretrained import load_pretrained

TOL = 1e-5
BPE_DIR = SHARED / "gpt2-tokenizer"


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (biases and LayerNorm too, which init leaves at 0 and 1), so each one counts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def hf_logits(hf_model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(idx).logits  # (B, T, V)


def gpt_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, idx)[0]  # with targets: every position's logits, (B, T, V)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A random 2-layer GPT2LMHeadModel saved by save_pretrained (safetensors); returns (model, folder)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=96)
    model = randomize_(transformers.GPT2LMHeadModel(cfg), seed=1)
    folder = tmp_path_factory.mktemp("hf-source")
    model.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    return model, folder


def test_load_hf_folder_gives_transformers_logits(hf_source):
    hf_model, folder = hf_source
    model, args = load_pretrained(str(folder))
    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, bias=True, vocab_size=96)
    assert args == dict(**shape, gelu="tanh", **SWITCHES)
    assert model.config.gelu == "tanh"  # GPT-2's gelu_new; every switch off
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight.requires_grad
    idx = torch.randint(0, 96, (3, 64), generator=torch.Generator().manual_seed(2))
    diff = max_diff(gpt_logits(model.eval(), idx), hf_logits(hf_model, idx))
    print(f"load safetensors: max |logits diff| = {diff:.2e}")
    assert diff < TOL


def test_load_openai_style_pytorch_model_bin(hf_source, tmp_path):
    """OpenAI's original upload: pytorch_model.bin with GPT2Model names (no `transformer.`) and mask buffers."""
    hf_model, folder = hf_source
    state = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    model, _ = load_pretrained(str(tmp_path))
    idx = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    diff = max_diff(gpt_logits(model.eval(), idx), hf_logits(hf_model, idx))
    print(f"load pytorch_model.bin: max |logits diff| = {diff:.2e}")
    assert diff < TOL


def test_block_size_crop_and_dropout_override(hf_source):
    hf_model, folder = hf_source
    model, args = load_pretrained(str(folder), dropout=0.1, block_size=16)
    assert args["block_size"] == 16 and model.transformer.wpe.weight.shape == (16, 32)
    assert model.config.dropout == 0.1 and model.transformer.drop.p == 0.1
    assert model.transformer.h[0].attn.dropout == 0.1 and model.transformer.h[1].mlp.dropout.p == 0.1
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    assert max_diff(gpt_logits(model.eval(), idx), hf_logits(hf_model, idx)) < TOL  # causal: the first 16 agree
    with pytest.raises(UserError, match="block_size 65 does not fit .* has 64 positions; use --block_size=64"):
        load_pretrained(str(folder), block_size=65)


def test_broken_folders_are_user_errors_naming_the_folder(hf_source, tmp_path):
    _, folder = hf_source
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(UserError, match=f"{tmp_path} has no config.json: pass --init_from="):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=f"{tmp_path} holds no model.safetensors or pytorch_model.bin"):
        load_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(
        UserError,
        match=rf"{tmp_path} does not hold GPT-2 weights matching its config.json: .*"
        r"has shape \(96, 32\), config.json implies \(96, 64\)",
    ):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(UserError, match="missing h.2.ln_1.weight"):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(UserError, match="activation_function='relu'"):
        load_pretrained(str(tmp_path))


def test_hub_names_offline_unknown_and_without_transformers(hf_source, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # constants are read at import: patch the imported module too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(
        UserError,
        match=r"cannot download gpt2 from the Hugging Face hub .* Offline\? "
        r"Pass --init_from=/path/to/folder holding config.json and model.safetensors",
    ):
        load_pretrained("gpt2")
    with pytest.raises(UserError, match=r"'gpt-5' is not a folder nor a GPT-2 name: use one of gpt2, .*gpt2-xl"):
        load_pretrained("gpt-5")
    with pytest.raises(UserError, match="folder ./missing-folder does not exist.*--init_from=/path/to/folder"):
        load_pretrained("./missing-folder")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if `pip install gptforge` without [hf]
    for name in GPT2_NAMES:
        with pytest.raises(UserError, match=r"needs transformers: pip install 'gptforge\[hf\]'; or pass --init_from="):
            load_pretrained(name)
    _, folder = hf_source
    assert load_pretrained(str(folder))[1]["n_layer"] == 2  # a local folder needs no transformers


def test_an_unreachable_hub_fails_fast_through_the_cli(tmp_path):
    """No 25 s of huggingface_hub retries: a hub that does not answer is an exit-2 error naming the folder option."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    r = run_cli("sample", "--init_from=gpt2", "--device=cpu", "--num_samples=1", cwd=tmp_path, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "the Hugging Face hub (http://127.0.0.1:9) does not answer" in r.stderr
    assert "Pass --init_from=/path/to/folder holding config.json" in r.stderr  # the probe's message, not the retries'


def tiny_gpt(bias: bool, vocab_size: int = 50304, seed: int = 5, gelu: str = "erf") -> GPT:
    torch.manual_seed(seed)
    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=vocab_size, bias=bias, gelu=gelu)
    return randomize_(GPT(GPTConfig(**shape)), seed)


def load_hf(folder):
    model, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.fixture(scope="module")
def bpe_export(tmp_path_factory):
    """A bias-free GPT with a padded 50304 vocabulary (gptforge's default) exported with GPT-2 BPE."""
    need_shared(SHARED / "tiktoken-cache")
    model = tiny_gpt(bias=False)
    folder = tmp_path_factory.mktemp("export") / "hf"
    notes = export_hf(model, str(folder), {"tokenizer": "gpt2"})
    return model, folder, notes


@pytest.mark.parametrize("bias,gelu", [(True, "erf"), (False, "erf"), (True, "tanh")])
def test_export_loads_in_transformers_with_the_same_logits(bias, gelu, bpe_export, tmp_path):
    """The exact GELU is exported as activation_function 'gelu', GPT-2's tanh form as 'gelu_new'; either reads back
    into gptforge as it was."""
    if bias:
        model, folder = tiny_gpt(bias=True, gelu=gelu), tmp_path / "hf"
        export_hf(model, str(folder), {"tokenizer": "gpt2"})
    else:
        model, folder, notes = bpe_export
        assert any("cut from 50304" in n for n in notes) and any("zeros" in n for n in notes)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 50257 and config["n_positions"] == 64 and config["eos_token_id"] == 50256
    assert config["activation_function"] == {"erf": "gelu", "tanh": "gelu_new"}[gelu]
    hf_model = load_hf(folder)
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(6))
    diff = max_diff(hf_logits(hf_model, idx), gpt_logits(model, idx)[..., :50257])
    print(f"export bias={bias} gelu={gelu}: max |logits diff| = {diff:.2e}")
    assert diff < TOL
    back, args = load_pretrained(str(folder))
    assert args["gelu"] == gelu and max_diff(gpt_logits(back.eval(), idx), hf_logits(hf_model, idx)) < TOL


def test_an_exact_gelu_gpt2_folder_loads_as_erf(tmp_path):
    """A Hugging Face GPT-2 with activation_function 'gelu' (the exact GELU, as nanoGPT's model) loads with it."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=96, activation_function="gelu"
    )
    hf_model = randomize_(transformers.GPT2LMHeadModel(cfg), seed=1)
    hf_model.save_pretrained(tmp_path)
    model, args = load_pretrained(str(tmp_path))
    assert args["gelu"] == model.config.gelu == "erf"
    idx = torch.randint(0, 96, (3, 64), generator=torch.Generator().manual_seed(2))
    assert max_diff(gpt_logits(model.eval(), idx), hf_logits(hf_model, idx)) < TOL
    tanh = GPT(GPTConfig(**{**args, "gelu": "tanh"})).eval()
    tanh.load_state_dict(model.state_dict())
    assert max_diff(gpt_logits(tanh, idx), hf_logits(hf_model, idx)) > TOL  # the other GELU fails the 1e-5 bar


def test_exported_tokenizer_is_openais_and_the_pipeline_generates(bpe_export):
    model, folder, _ = bpe_export
    assert json.loads((folder / "vocab.json").read_text()) == json.loads((BPE_DIR / "encoder.json").read_text())
    assert (folder / "merges.txt").read_text().splitlines() == (BPE_DIR / "vocab.bpe").read_text().splitlines()

    from gptforge.tokenizer.gpt2 import GPT2Tokenizer

    tok = GPT2Tokenizer()
    text = "Hello, I'm a language model,\n\n  with 2 spaces, émigrés and 日本語!"
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok(text)["input_ids"] == tok.encode(text) and hf_tok.decode(tok.encode(text)) == text
    assert hf_tok("a<|endoftext|>")["input_ids"][-1] == hf_tok.eos_token_id == 50256
    prompt = "To be, or not to be"
    pipe = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    out = pipe(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    ours = generate(model, torch.tensor([tok.encode(prompt)]), max_new_tokens=6, temperature=0)[0].tolist()
    assert out == tok.decode(ours) and len(ours) == len(tok.encode(prompt)) + 6  # greedy: the same tokens


def test_export_char_model_carries_its_vocabulary_and_force_rules(tmp_path):
    itos = list("\n !abcdefghijklmnopqrstuvwxyz")
    model, folder = tiny_gpt(bias=False, vocab_size=len(itos)), tmp_path / "hf"
    folder.mkdir()  # an existing empty folder is fine
    export_hf(model, str(folder), {"tokenizer": "char", "itos": itos})
    tokenizer_files = ["gptforge_tokenizer.json", "tokenizer.json", "tokenizer_config.json"]
    model_files = ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(model_files + tokenizer_files)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == len(itos) and config["eos_token_id"] is None
    idx = torch.randint(0, len(itos), (1, 20), generator=torch.Generator().manual_seed(7))
    assert max_diff(hf_logits(load_hf(folder), idx), gpt_logits(model, idx)) < TOL

    with pytest.raises(UserError, match="is not empty; choose a new folder, or add --force"):
        export_hf(model, str(folder), None)
    (folder / "vocab.json").write_text("{}")  # a stale file of an earlier export: --force removes it
    export_hf(model, str(folder), None, force=True)
    assert not (folder / "vocab.json").exists()
    (folder / "ckpt.pt").write_text("precious")
    with pytest.raises(UserError, match=r"holds files a Hugging Face export does not \(ckpt.pt\)"):
        export_hf(model, str(folder), None, force=True)
    assert (folder / "ckpt.pt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left behind


def save_run(out_dir, model: GPT, tokenizer: dict) -> None:
    out_dir.mkdir(parents=True)
    args = {k: getattr(model.config, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")}
    save_checkpoint(
        str(out_dir / "ckpt.pt"),
        {
            "model": model.state_dict(),
            "model_args": args,
            "iter_num": 3,
            "best_val_loss": 9.0,
            "config": {},
            "tokenizer": tokenizer,
        },
    )


def test_cli_export(tmp_path, tiktoken_cache):
    model = tiny_gpt(bias=False)
    save_run(tmp_path / "run", model, {"tokenizer": "gpt2"})
    r = run_cli("export", "--out_dir=run", "--to=hf", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote hf" in r.stdout and "vocabulary cut from 50304" in r.stderr
    idx = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(8))
    assert max_diff(hf_logits(load_hf(tmp_path / "hf"), idx), gpt_logits(model, idx)[..., :50257]) < TOL
    assert (tmp_path / "hf/merges.txt").is_file()

    r = run_cli("export", "--out_dir=run", "--to=hf", cwd=tmp_path)
    assert r.returncode == 2 and "--to=" in r.stderr and "is not empty" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("export", "--out_dir=nowhere", "--to=hf2", cwd=tmp_path)
    assert r.returncode == 2 and "checkpoint nowhere/ckpt.pt not found" in r.stderr
    assert not (tmp_path / "hf2").exists()

    itos = list("\nabc ")
    save_run(tmp_path / "char", tiny_gpt(bias=True, vocab_size=len(itos)), {"tokenizer": "char", "itos": itos})
    r = run_cli("export", "--ckpt=char/ckpt.pt", "--to=hf", "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "tokens: one per character (5 characters; tokenizer.json, AutoTokenizer loads it)" in r.stdout
    assert json.loads((tmp_path / "hf/config.json").read_text())["vocab_size"] == 5
    assert not (tmp_path / "hf/merges.txt").exists()


def test_finetune_from_hf_folder_trains_checkpoints_resumes_and_samples(tmp_path, bpe_data, hellaswag_path):
    """init_from=<HF folder>: training starts from its weights, checkpoints, resumes; sample loads it too."""
    import json

    from conftest import run_cli, tiny_train_args
    from gptforge.core.config import load_config
    from gptforge.train.loop import train
    from gptforge.weights.checkpoint import load_checkpoint

    torch.manual_seed(0)
    hf = randomize_(
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
        ),
        seed=2,
    )
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    common = dict(
        dataset="bpe",
        init_from=str(folder),
        block_size=32,
        n_layer=None,
        n_head=None,
        n_embd=None,
        max_iters=4,
        eval_interval=2,
        learning_rate=1e-3,
    )
    first = train(load_config(tiny_train_args(tmp_path / "data", tmp_path / "ft", **common)))
    ckpt = load_checkpoint(str(tmp_path / "ft/ckpt.pt"))
    assert ckpt["iter_num"] == 4 and ckpt["model_args"] == dict(
        n_layer=2, n_head=2, n_embd=32, block_size=32, bias=True, vocab_size=50257, gelu="tanh", **SWITCHES
    )  # fine-tuning GPT-2's weights keeps its tanh GELU
    config = json.loads((tmp_path / "ft/config.json").read_text())
    assert (config["n_embd"], config["bias"], config["init_from"]) == (32, True, str(folder))
    step0 = [json.loads(x) for x in (tmp_path / "ft/metrics.jsonl").read_text().splitlines()][0]
    assert step0["kind"] == "eval" and step0["val_loss"] > first["losses"]["val"]  # fine-tuning improved on it

    resumed = dict(common, max_iters=6, init_from="resume")
    train(load_config(tiny_train_args(tmp_path / "data", tmp_path / "ft", **resumed)))
    assert load_checkpoint(str(tmp_path / "ft/ckpt.pt"))["iter_num"] == 6

    r = run_cli(
        "sample",
        f"--init_from={folder}",
        "--start=To be",
        "--num_samples=1",
        "--max_new_tokens=5",
        "--temperature=0",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be") and r.stdout.endswith("---------------\n")
    r = run_cli(
        "eval", "hellaswag", f"--init_from={folder}", "--limit=8", f"--hellaswag_path={hellaswag_path}", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hellaswag: 8 examples, acc ")  # HellaSwag straight from a Hugging Face folder
    r = run_cli(
        "train",
        *tiny_train_args(
            "data", "x", dataset="bpe", init_from="gpt2", block_size=32, n_layer=None, n_head=None, n_embd=None
        ),
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 2 and "--init_from" in r.stderr and "Traceback" not in r.stderr, r.stderr
