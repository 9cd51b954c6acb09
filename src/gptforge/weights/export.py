"""A checkpoint out as a Hugging Face GPT-2 folder that transformers' GPT2LMHeadModel.from_pretrained and pipeline()
load: `export_hf`, and `gptforge export` (`export_run`). The mapping: docs/ARCHITECTURE.md "GPT-2 weights and
Hugging Face"."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from typing import Any

import torch

from gptforge.chat.render import chat_special_ids
from gptforge.chat.template import CHAT_TEMPLATE, add_chat_tokens_to_hf_folder, chat_generation_config
from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.core.shape import SWITCHES
from gptforge.model.gpt import GPT
from gptforge.tokenizer.spec import Tokenizer, from_spec
from gptforge.weights.checkpoint import checkpoint_path
from gptforge.weights.load import load_checkpoint_model
from gptforge.weights.pretrained import CONV1D, NANOCHAT, nanochat_names

# Files `export_hf` writes, and other files of a Hugging Face model folder: --force replaces a folder
# holding only these, so it never deletes anything else (a run folder, a home directory).
HF_FOLDER_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "vocab.json",
        "merges.txt",
        "tokenizer.json",
        "tokenizer.tiktoken",
        "token_bytes.json",
        "gptforge_tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
    }
)


def export_run(out_dir: str, ckpt: str | None, to: str, outtype: str, force: bool) -> str:
    """`gptforge export`: the checkpoint's model and tokenizer as a Hugging Face folder, or (--to=NAME.gguf) as one
    GGUF file; notes go to stderr, one summary line to stdout (what was written, and how its tokens are encoded).
    Returns the checkpoint path."""
    if to.endswith(".gguf"):
        return export_gguf_run(out_dir, ckpt, to, force, outtype)
    if importlib.util.find_spec("safetensors") is None:  # said before the checkpoint loads, not as a traceback
        raise UserError(
            "gptforge export writes model.safetensors, which needs safetensors: pip install 'gptforge[hf]' (or "
            "'gptforge[all]': every extra)"
        )
    path = checkpoint_path(out_dir, ckpt)
    model, tok, checkpoint = load_checkpoint_model(path, "cpu")
    chat = _is_chat(checkpoint)
    for note in export_hf(model, to, tok.spec(), force=force, chat=chat):
        log(f"note: {note}")
    step = checkpoint.get("iter_num", "?")
    kind = (
        "NanoChat folder (NanoChatForCausalLM)"
        if export_format(model.config) == "nanochat"
        else "GPT-2 folder (GPT2LMHeadModel)"
    )
    chat_note = "; a chat model: its chat_template and end token are in the folder" if chat else ""
    print(f"wrote {to}: a Hugging Face {kind} of {path}, step {step}; tokens: {describe_tokens(tok)}{chat_note}")
    return path


def export_gguf_run(out_dir: str, ckpt: str | None, to: str, force: bool, outtype: str) -> str:
    """`gptforge export --to=NAME.gguf`: everything that can be refused is refused before a byte is written."""
    from gptforge.weights.gguf_file import export_gguf, gguf_module

    gguf_module()  # the package's absence said before the checkpoint loads
    modelfile = f"{os.path.splitext(to)[0]}.Modelfile"
    existing = [p for p in (to, modelfile) if os.path.exists(p)]
    if os.path.isdir(to) or (existing and not force):
        what = "is a folder" if os.path.isdir(to) else "exists"
        raise UserError(
            f"--to={existing[0] if existing else to} {what}; choose a new file name, or add --force to "
            "replace a previous export"
        )
    path = checkpoint_path(out_dir, ckpt)
    model, tok, checkpoint = load_checkpoint_model(path, "cpu")
    chat = _is_chat(checkpoint)
    special_ids = chat_special_ids(tok) if chat else {}
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))  # the run folder's name
    for note in export_gguf(model, tok, to, outtype, chat, special_ids, name):
        log(f"note: {note}")
    step = checkpoint.get("iter_num", "?")
    chat_note = "; a chat model: its chat template and end token are in the file" if chat else ""
    tokens = "GPT-2 BPE" if tok.kind == "gpt2" else f"own byte-level BPE {tok.name!r} ({tok.vocab_size} tokens)"
    print(
        f"wrote {to} ({outtype}) and {modelfile}: a GGUF file of llama.cpp's gpt2 architecture from {path}, step "
        f"{step}; tokens: {tokens}{chat_note}"
    )
    return path


def _is_chat(checkpoint: dict[str, Any]) -> bool:
    """A run fine-tuned on conversations: its chat tokens, template and end token go into the export."""
    return (checkpoint.get("config") or {}).get("task") == "sft"


def describe_tokens(tok: Tokenizer) -> str:
    """How the exported folder's tokens are encoded, for the export's summary line."""
    if tok.kind == "char":
        return f"one per character ({tok.vocab_size} characters; tokenizer.json, AutoTokenizer loads it)"
    if tok.kind == "gpt2":
        return "GPT-2 BPE (vocab.json, merges.txt; AutoTokenizer loads them)"
    return f"own byte-level BPE {tok.name!r} ({tok.vocab_size} tokens; tokenizer.json, AutoTokenizer loads it)"


def export_hf(
    model: GPT, folder: str, tokenizer_spec: dict[str, Any] | None, force: bool = False, chat: bool = False
) -> list[str]:
    """Write `model` as a Hugging Face folder that GPT2LMHeadModel (or NanoChatForCausalLM) .from_pretrained loads,
    with its tokenizer's files, so that AutoTokenizer loads them and transformers.pipeline("text-generation") works.

    Writes config.json, generation_config.json, model.safetensors and the tokenizer (GPT-2 BPE: vocab.json,
    merges.txt; a character vocabulary or an own BPE: tokenizer.json; always tokenizer_config.json and
    gptforge_tokenizer.json, which gptforge reads the folder back with). A vocabulary padded past the tokenizer's
    is cut back; a model without biases gets zero biases (HF's GPT-2 always has them): the logits are the same.
    The folder is assembled under a temporary name and renamed into place; an existing non-empty folder is an
    error unless force=True, which replaces it only when it holds nothing but Hugging Face model files. `chat` (a
    model fine-tuned on chat data): the chat tokens and the Jinja chat_template go into the tokenizer files, the
    vocabulary keeps the chat tokens' rows, and generation_config.json ends generation at the assistant's end
    token. Returns notes for the user."""
    folder = os.path.abspath(folder)
    _check_target(folder, force)
    cfg = model.config
    nanochat = export_format(cfg) == "nanochat"
    tok = from_spec(tokenizer_spec) if tokenizer_spec else None  # None: the model alone (a Python caller's choice)
    special_ids = chat_special_ids(tok) if chat and tok else {}
    vocab_size = max([tok.vocab_size, *(i + 1 for i in special_ids.values())]) if tok else cfg.vocab_size
    if vocab_size > cfg.vocab_size:
        raise UserError(
            f"the model has {cfg.vocab_size} token rows, fewer than its tokenizer's {vocab_size}: the checkpoint's "
            "tokenizer record is wrong"
        )
    notes = [] if tok else ["no tokenizer given: only the model is written"]
    if cfg.vocab_size > vocab_size:
        notes.append(f"vocabulary cut from {cfg.vocab_size} (padded) to the tokenizer's {vocab_size} tokens")
    if not cfg.bias and not nanochat:
        notes.append("the model has no biases; HF's GPT-2 always has them, so they are written as zeros")
    tmp = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.export-{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        (_write_nanochat_model if nanochat else _write_model)(model, tmp, vocab_size)
        eot = tok.eot_token if tok else None
        gen = {"bos_token_id": eot, "eos_token_id": eot} if eot is not None else {}
        gen = chat_generation_config(special_ids) if special_ids else gen
        _write_json(os.path.join(tmp, "config.json"), _hf_config(model, vocab_size, gen, nanochat))
        _write_json(os.path.join(tmp, "generation_config.json"), gen)
        if tok:
            tok.save(tmp, model_max_length=cfg.block_size)
        if special_ids:
            make_chat_ready(tmp, tok, special_ids)
        _swap_into_place(tmp, folder)
    except OSError as e:
        raise UserError(f"cannot write {folder}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return notes


def make_chat_ready(folder: str, tok: Tokenizer, special_ids: dict[str, int]) -> None:
    """A chat model's tokenizer files: GPT-2 BPE gets the chat tokens as added special tokens (and a fast
    tokenizer.json) with the template; an own BPE tokenizer has its specials already and gets the template."""
    if tok.kind == "gpt2":
        add_chat_tokens_to_hf_folder(folder, special_ids)
        return
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    _write_json(path, {**config, "chat_template": CHAT_TEMPLATE})


def export_format(cfg: Any) -> str:
    """'gpt2' for GPT-2's model (every switch that changes the function off), 'nanochat' for nanochat's; any
    other mix is an error naming what each format lacks."""
    on = [f"{k}={getattr(cfg, k)!r}" for k, off in SWITCHES.items() if k != "zero_init" and getattr(cfg, k) != off]
    if not on:
        return "gpt2"
    missing = [f"{k}={v!r}" for k, v in NANOCHAT.items() if getattr(cfg, k) != v]
    if not missing:
        return "nanochat"
    raise UserError(
        f"this model uses {', '.join(on)}, which Hugging Face's GPT-2 format cannot express, and its NanoChat "
        f"format also needs {', '.join(missing)}: no Hugging Face format holds this model"
    )


def _write_nanochat_model(model: GPT, folder: str, vocab_size: int) -> None:
    """NanoChatForCausalLM's tensor names; c_attn split into q, k and v."""
    from safetensors.torch import save_file

    C = model.config.n_embd
    state = {k.removeprefix("_orig_mod."): v.detach() for k, v in model.state_dict().items()}
    tensors = {}
    for ours, theirs in nanochat_names(model.config.n_layer).items():
        if "{}" in theirs:  # c_attn: q, k and v
            tensors.update({theirs.format(x): t for x, t in zip("qkv", state[ours].split(C, dim=0), strict=True)})
        else:  # the embedding and the head lose any padding rows
            rows = vocab_size if ours in ("transformer.wte.weight", "lm_head.weight") else None
            tensors[theirs] = state[ours][:rows]
    tensors = {k: v.to(device="cpu", dtype=torch.float32).contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _check_target(folder: str, force: bool) -> None:
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--to={folder} is a file; give a folder to create")
    contents = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not contents:
        return
    if not force:
        raise UserError(
            f"--to={folder} is not empty; choose a new folder, or add --force to replace a previous export there"
        )
    foreign = [n for n in contents if n not in HF_FOLDER_FILES or not os.path.isfile(os.path.join(folder, n))]
    if foreign:
        raise UserError(
            f"--to={folder} holds files a Hugging Face export does not ({', '.join(foreign[:5])}); "
            "--force replaces only previous exports: choose another folder"
        )


def _swap_into_place(tmp: str, folder: str) -> None:
    """Rename the finished folder over `folder`: the target holds the old export or the new one, never half."""
    if not os.path.isdir(folder) or not os.listdir(folder):
        os.replace(tmp, folder)  # POSIX rename replaces an empty directory
        return
    old = f"{tmp}.old"
    os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _write_model(model: GPT, folder: str, vocab_size: int) -> None:
    from safetensors.torch import save_file

    cfg = model.config
    tensors = {}
    for key, value in model.state_dict().items():
        key = key.removeprefix("_orig_mod.")  # torch.compile's wrapper
        if key == "lm_head.weight":
            continue  # tied to transformer.wte.weight; HF's GPT2LMHeadModel ties it again on load
        value = value.detach()
        if key == "transformer.wte.weight":
            value = value[:vocab_size]  # (vocab_size, C): the padding rows never see a real token
        elif key.endswith(CONV1D):
            value = value.t()  # Linear (out, in) -> Conv1D (in, out)
        tensors[key] = value.to(device="cpu", dtype=torch.float32).clone(memory_format=torch.contiguous_format)
    if not cfg.bias:  # zero biases: the exact arithmetic of a bias-free model
        C = cfg.n_embd
        zeros = {
            "ln_1.bias": C,
            "ln_2.bias": C,
            "attn.c_attn.bias": 3 * C,
            "attn.c_proj.bias": C,
            "mlp.c_fc.bias": 4 * C,
            "mlp.c_proj.bias": C,
        }
        for i in range(cfg.n_layer):
            for name, size in zeros.items():
                tensors[f"transformer.h.{i}.{name}"] = torch.zeros(size)
        tensors["transformer.ln_f.bias"] = torch.zeros(C)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _hf_config(model: GPT, vocab_size: int, gen: dict[str, Any], nanochat: bool = False) -> dict[str, Any]:
    """config.json: GPT2LMHeadModel's, or NanoChatForCausalLM's for a nanochat-shaped model; the special ids as
    generation_config's `gen`."""
    cfg = model.config
    bos, eos = gen.get("bos_token_id"), gen.get("eos_token_id")
    common = {"vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": None}
    if nanochat:
        return {
            "architectures": ["NanoChatForCausalLM"],
            "model_type": "nanochat",
            **common,
            "hidden_size": cfg.n_embd,
            "intermediate_size": 4 * cfg.n_embd,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_head,
            "max_position_embeddings": cfg.block_size,
            "hidden_act": "relu2",
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
            "final_logit_softcapping": cfg.logit_softcap or None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "dtype": "float32",
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **common,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": {"erf": "gelu", "tanh": "gelu_new"}[cfg.gelu],  # exact GELU, or GPT-2's tanh form
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "use_cache": True,
        "tie_word_embeddings": True,
        "dtype": "float32",
    }


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
