"""OpenAI's GPT-2 weights in, Hugging Face GPT-2 folders out.

    model, model_args = load_pretrained("gpt2")                   # HF hub (pip install 'gptforge[hf]')
    model, model_args = load_pretrained("path/to/folder", dropout=0.1, block_size=256)
    notes = export_hf(model, "hf-out", {"tokenizer": "gpt2"})     # then GPT2LMHeadModel.from_pretrained("hf-out")

A Hugging Face GPT-2 folder holds config.json and model.safetensors (or pytorch_model.bin). Its parameter
names are ours (`transformer.h.0.attn.c_attn.weight`, ... with or without the `transformer.` prefix), but
HF's GPT-2 stores its matrices as Conv1D, (in, out), the transpose of nn.Linear's (out, in): the four
matrices of each block are transposed on the way in and on the way out. A local folder is read with
safetensors / torch.load(weights_only=True) alone; only hub names need transformers (huggingface_hub).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from gptforge.errors import UserError
from gptforge.model import GPT, MODEL_ARGS, GPTConfig
from gptforge.tokenizer import GPT2_EOT, GPT2_VOCAB

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # 124M, 350M, 774M, 1558M parameters
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # stored (in, out)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
EOT_TEXT = "<|endoftext|>"
LOCAL_OPTION = ("pass --init_from=/path/to/folder holding config.json and model.safetensors "
                "(a Hugging Face GPT-2 folder)")
# Files `export_hf` writes, and other files of a Hugging Face model folder: --force replaces a folder
# holding only these, so it never deletes anything else (a run folder, a home directory).
HF_FOLDER_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json",
})


def load_pretrained(
    name_or_folder: str, dropout: float = 0.0, block_size: int | None = None
) -> tuple[GPT, dict[str, Any]]:
    """GPT-2 weights as a GPT (float32, CPU, train mode) and its model_args.

    name_or_folder: a local Hugging Face GPT-2 folder, or one of HUB_NAMES, downloaded once into the HF cache.
    dropout: the only setting that may differ from the source. block_size: crop the position table to fewer
    positions (fine-tuning on short contexts); None keeps the source's n_positions (1024 for GPT-2).
    """
    folder = name_or_folder if os.path.isdir(name_or_folder) else _download(name_or_folder)
    config = _read_config(folder)
    n_positions = config["n_positions"]
    if block_size is not None and not 0 < block_size <= n_positions:
        raise UserError(
            f"block_size {block_size} does not fit {name_or_folder}: its position table has {n_positions} "
            f"positions; use --block_size={n_positions} or less"
        )
    args = dict(n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                block_size=n_positions, bias=True, vocab_size=config["vocab_size"])
    state = _to_gpt_state(_read_weights(folder), args, config, folder)
    with torch.device("meta"):  # no random init of weights that are overwritten at once (gpt2-xl: 1.5B)
        model = GPT(GPTConfig(**args, dropout=dropout))
    model.load_state_dict(state, strict=True, assign=True)
    model.transformer.wte.weight = model.lm_head.weight  # assign=True replaced both: tie them again
    if block_size is not None and block_size < n_positions:
        model.crop_block_size(block_size)
    return model, {k: getattr(model.config, k) for k in MODEL_ARGS}


def _download(name: str) -> str:
    """A hub name's config.json and weights in the local HF cache; the folder holding them."""
    if name not in HUB_NAMES:
        looks_like_path = os.sep in name or name.startswith(".") or (os.altsep and os.altsep in name)
        what = f"folder {name} does not exist" if looks_like_path else f"{name!r} is not a folder nor a GPT-2 name"
        raise UserError(f"{what}: use one of {', '.join(HUB_NAMES)} (downloaded from the Hugging Face hub), or "
                        f"{LOCAL_OPTION}")
    hub, errors = _hf_hub()
    try:
        config_path = hub.hf_hub_download(name, "config.json")
        try:
            hub.hf_hub_download(name, WEIGHT_FILES[0])
        except errors.EntryNotFoundError as e:
            if isinstance(e, errors.LocalEntryNotFoundError):
                raise
            hub.hf_hub_download(name, WEIGHT_FILES[1])  # an older upload without safetensors
    except Exception as e:  # offline, no such file, HTTP errors: huggingface_hub has many exception types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot download {name} from the Hugging Face hub ({type(e).__name__}: {reason}). "
                        f"Offline? {LOCAL_OPTION[0].upper()}{LOCAL_OPTION[1:]}") from None
    return os.path.dirname(config_path)


def _hf_hub() -> tuple[Any, Any]:
    """huggingface_hub and its exceptions module; the [hf] extra installs it with transformers.

    Imported only for hub names, so that gptforge itself never needs transformers.
    """
    try:
        import huggingface_hub
        import transformers  # noqa: F401  (the [hf] extra: it brings huggingface_hub at a version that fits)
    except ImportError:
        raise UserError(f"downloading GPT-2 from the Hugging Face hub needs transformers: pip install "
                        f"'gptforge[hf]'; or {LOCAL_OPTION}") from None
    try:
        from huggingface_hub import errors
    except ImportError:  # huggingface_hub before 0.23 kept its exceptions in utils
        from huggingface_hub import utils as errors
    return huggingface_hub, errors


def _read_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        raise UserError(f"{folder} has no config.json: {LOCAL_OPTION}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    missing = [k for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if k not in config]
    if not isinstance(config, dict) or missing:
        raise UserError(f"{path} is not a GPT-2 config (it lacks {', '.join(missing)})")
    # Settings under which HF's GPT-2 computes something other than this GPT: refuse rather than differ.
    n_embd = config["n_embd"]
    different = {
        "model_type": (config.get("model_type", "gpt2"), ("gpt2",)),
        "activation_function": (config.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "layer_norm_epsilon": (config.get("layer_norm_epsilon", 1e-5), (1e-5,)),
        "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
        "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
    }
    bad = [f"{k}={v!r} (supported: {', '.join(map(repr, ok))})" for k, (v, ok) in different.items() if v not in ok]
    if bad:
        raise UserError(f"{path}: this GPT-2 variant is not supported: {'; '.join(bad)}")
    return config


def _read_weights(folder: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
        except ImportError:
            raise UserError(f"reading {path} needs safetensors: pip install 'gptforge[hf]'") from None
        except Exception as e:  # torch / safetensors raise several types for a damaged file
            reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise UserError(f"cannot read {path}: {reason}") from None
    sharded = os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    raise UserError(f"{folder} holds no {' or '.join(WEIGHT_FILES)}"
                    + (" (sharded checkpoints are not supported)" if sharded else f": {LOCAL_OPTION}"))


def _to_gpt_state(
    hf: dict[str, torch.Tensor], args: dict[str, Any], config: dict[str, Any], folder: str
) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors renamed and transposed into GPT's state_dict (float32), checked name by name."""
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}  # GPT2LMHeadModel prefix; GPT2Model has none
    for key in [k for k in hf if k.endswith((".attn.bias", ".attn.masked_bias"))]:
        del hf[key]  # causal-mask buffers older transformers saved (c_attn's bias is `.attn.c_attn.bias`)
    lm_head = hf.pop("lm_head.weight", None)
    if lm_head is not None and not config.get("tie_word_embeddings", True) and "wte.weight" in hf:
        if lm_head.shape != hf["wte.weight"].shape or not torch.equal(lm_head, hf["wte.weight"]):
            raise UserError(f"{folder}: lm_head.weight differs from wte.weight (untied embeddings); GPT ties them")
    with torch.device("meta"):
        expected = GPT(GPTConfig(**args)).state_dict()
    state, problems = {}, []
    for key, like in expected.items():
        if key == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        src_key = key.removeprefix("transformer.")
        tensor = hf.pop(src_key, None)
        if tensor is None:
            problems.append(f"missing {src_key}")
            continue
        if key.endswith(CONV1D) and tensor.dim() == 2:
            tensor = tensor.t()
        if tensor.shape != like.shape:
            problems.append(f"{src_key} has shape {tuple(tensor.shape)}, config.json implies {tuple(like.shape)}")
            continue
        state[key] = tensor.to(torch.float32).contiguous()
    problems += [f"unexpected {k}" for k in sorted(hf)]
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise UserError(f"{folder} does not hold GPT-2 weights matching its config.json: "
                        f"{'; '.join(problems[:4])}{more}")
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def export_hf(model: GPT, folder: str, tokenizer_spec: dict[str, Any] | None, force: bool = False) -> list[str]:
    """Write `model` as a Hugging Face GPT-2 folder that GPT2LMHeadModel.from_pretrained(folder) loads.

    Writes config.json, generation_config.json and model.safetensors, and for GPT-2 BPE the tokenizer files
    (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json), so that
    transformers.pipeline("text-generation", model=folder) works. A vocabulary padded past GPT-2's 50,257
    tokens is cut back; a model without biases gets zero biases (HF's GPT-2 always has them): the logits
    are the same. The folder is assembled under a temporary name and renamed into place; an existing
    non-empty folder is an error unless force=True, which replaces it only when it holds nothing but
    Hugging Face model files. Returns notes for the user (e.g. that a char-level model has no HF tokenizer).
    """
    folder = os.path.abspath(folder)
    _check_target(folder, force)
    bpe = bool(tokenizer_spec) and tokenizer_spec.get("tokenizer") == "gpt2"
    cfg = model.config
    vocab_size = GPT2_VOCAB if bpe else cfg.vocab_size
    if vocab_size > cfg.vocab_size:
        raise UserError(f"the model has {cfg.vocab_size} token rows, fewer than GPT-2 BPE's {GPT2_VOCAB}: "
                        "its checkpoint's tokenizer record is wrong")
    notes = []
    if bpe and cfg.vocab_size > GPT2_VOCAB:
        notes.append(f"vocabulary cut from {cfg.vocab_size} (padded) to GPT-2's {GPT2_VOCAB} tokens")
    if not cfg.bias:
        notes.append("the model has no biases; HF's GPT-2 always has them, so they are written as zeros")
    if not bpe:
        kind = (tokenizer_spec or {}).get("tokenizer", "unknown")
        notes.append(f"no Hugging Face tokenizer exists for this model's tokenizer ({kind!r}): only the model is "
                     f"exported (vocab_size {vocab_size}); encode and decode with gptforge's tokenizer")

    tmp = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.export-{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        _write_model(model, tmp, vocab_size)
        _write_json(os.path.join(tmp, "config.json"), _hf_config(model, vocab_size, bpe))
        gen = {"bos_token_id": GPT2_EOT, "eos_token_id": GPT2_EOT} if bpe else {}
        _write_json(os.path.join(tmp, "generation_config.json"), gen)
        if bpe:
            write_gpt2_tokenizer(tmp, model_max_length=cfg.block_size)
        _swap_into_place(tmp, folder)
    except OSError as e:
        raise UserError(f"cannot write {folder}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return notes


def _check_target(folder: str, force: bool) -> None:
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--to={folder} is a file; give a folder to create")
    contents = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not contents:
        return
    if not force:
        raise UserError(f"--to={folder} is not empty; choose a new folder, or add --force to replace a previous "
                        "export there")
    foreign = [n for n in contents if n not in HF_FOLDER_FILES or not os.path.isfile(os.path.join(folder, n))]
    if foreign:
        raise UserError(f"--to={folder} holds files a Hugging Face export does not ({', '.join(foreign[:5])}); "
                        "--force replaces only previous exports: choose another folder")


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
        zeros = {"ln_1.bias": C, "ln_2.bias": C, "attn.c_attn.bias": 3 * C, "attn.c_proj.bias": C,
                 "mlp.c_fc.bias": 4 * C, "mlp.c_proj.bias": C}
        for i in range(cfg.n_layer):
            for name, size in zeros.items():
                tensors[f"transformer.h.{i}.{name}"] = torch.zeros(size)
        tensors["transformer.ln_f.bias"] = torch.zeros(C)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _hf_config(model: GPT, vocab_size: int, bpe: bool) -> dict[str, Any]:
    cfg = model.config
    eot = GPT2_EOT if bpe else None
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab_size, "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "add_cross_attention": False, "use_cache": True,
        "tie_word_embeddings": True, "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": None,
        "dtype": "float32",
    }


def write_gpt2_tokenizer(folder: str, model_max_length: int = 1024) -> None:
    """GPT-2's tokenizer files for transformers' GPT2Tokenizer, rebuilt from tiktoken's gpt2 encoding.

    vocab.json maps each token, written in GPT-2's byte-to-unicode alphabet, to its id; merges.txt lists the
    50,000 merges in rank order. Both equal OpenAI's encoder.json and vocab.bpe.
    """
    from gptforge.tokenizer import GPT2Tokenizer

    vocab, merges = gpt2_vocab_and_merges(GPT2Tokenizer().enc)
    _write_json(os.path.join(folder, "vocab.json"), vocab)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as fh:
        fh.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    _write_json(os.path.join(folder, "special_tokens_map.json"), special)
    _write_json(os.path.join(folder, "tokenizer_config.json"), {
        "tokenizer_class": "GPT2Tokenizer", **special, "model_max_length": model_max_length,
        "add_prefix_space": False, "add_bos_token": False, "errors": "replace",
        "clean_up_tokenization_spaces": False,  # decode gives back the text exactly, as tiktoken does
    })


def gpt2_vocab_and_merges(enc: Any) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab.json's dict, merges.txt's pairs) from a tiktoken GPT-2 encoding.

    tiktoken keeps only each token's bytes and rank. A token of rank r >= 256 was made by one merge of two
    tokens of lower rank; which two is what byte-pair encoding of its bytes with only the merges below r
    ends with (the same procedure tiktoken applies to text), so the merges come back in rank order.
    """
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i != enc.eot_token}
    to_text = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = enc.eot_token
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if rank < 256:
            assert len(token) == 1, f"GPT-2's first 256 tokens are single bytes; rank {rank} is {token!r}"
            continue
        parts = _bpe(ranks, token, max_rank=rank)
        assert len(parts) == 2, f"token {token!r} (rank {rank}) is not one merge of lower-ranked tokens: {parts}"
        merges.append((text(parts[0]), text(parts[1])))
    return vocab, merges


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-pair encode `token`, merging only pairs whose rank is below max_rank, lowest rank first."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves, the other
    68 bytes (controls, space, ...) take the characters from U+0100 on, in byte order."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in own}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
