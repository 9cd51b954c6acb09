"""A run as one GGUF file, the format llama.cpp, Ollama and LM Studio read (`export_gguf`), and a GGUF file back as
a GPT and its tokenizer (`read_gguf`, for --init_from=model.gguf). gptforge's classic GPT is llama.cpp's `gpt2`
architecture tensor for tensor (fused QKV, learned positions, LayerNorm with biases, tied or untied head); the
modern recipe's switches have no llama.cpp architecture and are refused. Needs the `gguf` package
(pip install 'gptforge[gguf]'). docs/USAGE.md "GGUF" says how to run the file and what llama.cpp computes."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import numpy as np
import torch

from gptforge.core.errors import UserError
from gptforge.core.shape import SWITCHES
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokenizer.spec import Tokenizer, from_spec
from gptforge.weights.gguf_vocab import GGUFVocab, gguf_chat_template, gguf_vocab, modelfile
from gptforge.weights.pretrained import meta_gpt

FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's LlamaFileType (MOSTLY_*)
EXPRESSIBLE = ("zero_init", "untie_head")  # switches the gpt2 architecture holds: an initialisation, an output.weight
LAYER_NAMES = {  # gptforge's names -> llama.cpp's (gpt2 architecture), per block
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
TOP_NAMES = {
    "transformer.wte": "token_embd",
    "transformer.wpe": "position_embd",
    "transformer.ln_f": "output_norm",
    "lm_head": "output",
}
INSTALL = "pip install 'gptforge[gguf]' (or 'gptforge[all]': every extra)"


def gguf_module() -> Any:
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"GGUF files need the gguf package: {INSTALL}")
    import gguf

    return gguf


def check_gguf_model(cfg: Any) -> list[str]:
    """Refuse (UserError) a model llama.cpp's gpt2 architecture cannot compute; notes on what it computes alike."""
    on = [f"{k}={getattr(cfg, k)!r}" for k, off in SWITCHES.items() if k not in EXPRESSIBLE and getattr(cfg, k) != off]
    if on:
        raise UserError(
            f"this model uses {', '.join(on)}, which llama.cpp's gpt2 architecture (the one a GGUF of this model "
            "can use) cannot compute; export it as a Hugging Face folder instead (--to=FOLDER), or train without "
            "those switches for llama.cpp"
        )
    if cfg.gelu == "erf":
        return [
            "llama.cpp computes GPT-2's tanh GELU (through a float16 table); this model was trained with the "
            'exact erf GELU: its logits there differ a little more (docs/USAGE.md "GGUF")'
        ]
    return []


def gguf_tensors(model: GPT, rows: int) -> dict[str, torch.Tensor]:
    """The model's tensors under llama.cpp's names (float32); the vocabulary cut to `rows`; zero biases for a
    model without them (llama.cpp's gpt2 needs them); no output.weight for a tied head."""
    cfg = model.config
    state = {k.removeprefix("_orig_mod."): v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    out = {}
    for key, value in state.items():
        stem, _, kind = key.rpartition(".")
        if stem.startswith("transformer.h."):
            i, _, inner = stem.removeprefix("transformer.h.").partition(".")
            name = f"blk.{i}.{LAYER_NAMES[inner]}"
        elif stem == "lm_head" and not cfg.untie_head:
            continue
        else:
            name = TOP_NAMES[stem]
        out[f"{name}.{kind}"] = value[:rows] if stem in ("transformer.wte", "lm_head") else value
    for name, value in list(out.items()):
        bias = name.removesuffix(".weight") + ".bias"
        if name.endswith(".weight") and bias not in out and not name.startswith(("token_embd", "position", "output.")):
            out[bias] = torch.zeros(value.shape[0])
    return dict(sorted(out.items()))


def export_gguf(
    model: GPT, tok: Tokenizer, path: str, outtype: str, chat: bool, special_ids: dict[str, int], name: str
) -> list[str]:
    """Write `model` with its tokenizer as the GGUF file `path` (assembled under a temporary name, then renamed)
    and an Ollama Modelfile beside it. Returns notes for the user."""
    gguf = gguf_module()
    cfg = model.config
    notes = check_gguf_model(cfg)
    rows = max([tok.vocab_size, *(i + 1 for i in special_ids.values())])
    vocab = gguf_vocab(tok, special_ids, rows)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        writer = gguf.GGUFWriter(tmp, "gpt2")
        _write_metadata(writer, gguf, model, tok, vocab, outtype, chat, name)
        kept = []
        for tensor_name, value in gguf_tensors(model, rows).items():
            qtype = _tensor_type(gguf, value, outtype)
            if outtype == "q8_0" and value.dim() == 2 and qtype != gguf.GGMLQuantizationType.Q8_0:
                kept.append(tensor_name)
            writer.add_tensor(tensor_name, gguf.quants.quantize(value.numpy(), qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if kept:
            notes.append(f"{', '.join(kept)}: rows not a multiple of 32, written as float16 (Q8_0 needs 32)")
        stem = os.path.splitext(path)[0]
        with open(f"{stem}.Modelfile", "w", encoding="utf-8") as fh:
            fh.write(modelfile(os.path.basename(path), vocab, chat, cfg.block_size))
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return notes


def _tensor_type(gguf: Any, value: torch.Tensor, outtype: str) -> Any:
    Q = gguf.GGMLQuantizationType
    if value.dim() < 2 or outtype == "f32":
        return Q.F32  # norms and biases stay float32, as llama.cpp's own converter keeps them
    if outtype == "q8_0":
        return Q.Q8_0 if value.shape[-1] % 32 == 0 else Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16}[outtype]


def _write_metadata(
    w: Any, gguf: Any, model: GPT, tok: Tokenizer, vocab: GGUFVocab, outtype: str, chat: bool, name: str
) -> None:
    cfg = model.config
    w.add_name(name)
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(4 * cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(1e-5)
    w.add_file_type(FILE_TYPE[outtype])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_add_bos_token(False)  # gptforge never puts a boundary before a prompt; the chat template writes its own
    if chat:
        w.add_eot_token_id(vocab.eos)
        w.add_chat_template(gguf_chat_template())
    args = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "gelu", *SWITCHES)}
    w.add_string("gptforge.model_args", json.dumps(args))
    w.add_string("gptforge.tokenizer", json.dumps(tok.spec()))
    w.add_bool("gptforge.chat", chat)


def read_gguf(path: str) -> tuple[GPT, Tokenizer, bool]:
    """A GGUF file of the gpt2 architecture as a GPT (float32, CPU, eval mode; quantised tensors dequantised), its
    tokenizer (the one gptforge recorded; GPT-2 BPE for a file from elsewhere with GPT-2's vocabulary), and
    whether it is a chat model."""
    gguf = gguf_module()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a foreign or damaged file: whatever the parser meets (struct, index, value errors)
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    fields = {
        k: f.contents()
        for k, f in reader.fields.items()
        if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    }
    if fields.get("general.architecture") != "gpt2":
        raise UserError(
            f"{path}: a GGUF of llama.cpp's {fields.get('general.architecture')!r} architecture; "
            "gptforge reads its own architecture, gpt2"
        )
    tensors = {
        t.name: torch.from_numpy(
            np.ascontiguousarray(
                gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
            ).astype(np.float32)
        )
        for t in reader.tensors
    }
    args = _model_args(fields, tensors, path)
    tok = _file_tokenizer(fields, path)
    model = meta_gpt(GPTConfig(**args, vocab_size=tensors["token_embd.weight"].shape[0], dropout=0.0))
    model.load_state_dict(_gpt_state(tensors, args), strict=True, assign=True)
    if not model.config.untie_head:
        model.transformer.wte.weight = model.lm_head.weight  # assign=True replaced both: tie them again
    return model.eval(), tok, bool(fields.get("gptforge.chat", False))


def _model_args(fields: dict[str, Any], tensors: dict[str, torch.Tensor], path: str) -> dict[str, Any]:
    if "gptforge.model_args" in fields:
        return json.loads(fields["gptforge.model_args"])
    try:
        return {
            "n_layer": int(fields["gpt2.block_count"]),
            "n_head": int(fields["gpt2.attention.head_count"]),
            "n_embd": int(fields["gpt2.embedding_length"]),
            "block_size": int(fields["gpt2.context_length"]),
            "bias": True,
            "gelu": "tanh",
            "untie_head": "output.weight" in tensors,
        }
    except KeyError as e:
        raise UserError(f"{path}: the gpt2 key {e.args[0]!r} is missing; not a complete GGUF file") from None


def _file_tokenizer(fields: dict[str, Any], path: str) -> Tokenizer:
    if "gptforge.tokenizer" in fields:
        return from_spec(json.loads(fields["gptforge.tokenizer"]))
    if fields.get("tokenizer.ggml.pre") == "gpt-2":
        return from_spec({"tokenizer": "gpt2"})
    raise UserError(
        f"{path}: a GGUF file gptforge did not write, with a vocabulary other than GPT-2's; gptforge "
        "reads the tokenizers it records and GPT-2 BPE"
    )


def _gpt_state(tensors: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    ours = {v: k for k, v in TOP_NAMES.items()}
    ours.update(
        {f"blk.{i}.{v}": f"transformer.h.{i}.{k}" for i in range(args["n_layer"]) for k, v in LAYER_NAMES.items()}
    )
    state = {}
    for name, value in tensors.items():
        stem, _, kind = name.rpartition(".")
        if kind == "bias" and not args.get("bias", True):
            continue  # the zeros written for llama.cpp
        state[f"{ours[stem]}.{kind}"] = value
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state
