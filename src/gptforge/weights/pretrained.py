"""OpenAI's GPT-2 weights in: a Hugging Face GPT-2 folder (config.json + model.safetensors) or a hub name, mapped
onto GPT (HF stores the four block matrices as Conv1D, the transpose of nn.Linear); and a Hugging Face NanoChat
folder (what `gptforge export` writes for a nanochat-shaped model) onto GPT with the modern switches on. Only hub
names need transformers. The mapping: docs/ARCHITECTURE.md "GPT-2 weights and Hugging Face"; export.py goes the
other way."""

from __future__ import annotations

import json
import os
import socket
import urllib.parse
import urllib.request
from typing import Any

import torch

from gptforge.core.config import GPT2_NAMES
from gptforge.core.errors import UserError
from gptforge.core.shape import MODEL_ARGS, saved_model_args
from gptforge.model.gpt import GPT, GPTConfig

# what Hugging Face's NanoChatForCausalLM computes; zero_init only changes the start, rope_base and
# logit_softcap are in its config (export.export_format and _nanochat_args both read it)
NANOCHAT = {"rotary": True, "rmsnorm": True, "qk_norm": True, "relu2": True, "untie_head": True, "bias": False}
# Hugging Face's GPT-2 activation_function -> GPT's gelu: OpenAI's GPT-2 is "gelu_new" (the tanh form), an exact-GELU
# model (nanoGPT's, a gptforge export of one) "gelu"
HF_GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # stored (in, out)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LOCAL_OPTION = (
    "pass --init_from=/path/to/folder holding config.json and model.safetensors (a Hugging Face GPT-2 folder)"
)


class _NoInitOnMeta(torch.overrides.TorchFunctionMode):
    """nn.init.normal_ does nothing to a meta tensor, and runs torch's Python reference for it, whose first call
    imports torch._dynamo, a slow import for a model that is only shapes (docs/lab/2026-11-30-epyc-zen4-suite.md).
    Skipped. (A rotary model's tables still take that route: their arange and pow on the meta device.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if func is torch.nn.init.normal_ and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def meta_gpt(config: GPTConfig) -> GPT:
    """A GPT of `config` on the meta device (shapes, no storage), for weights that are assigned afterwards."""
    with torch.device("meta"), _NoInitOnMeta():
        return GPT(config)


def load_pretrained(
    name_or_folder: str, dropout: float = 0.0, block_size: int | None = None
) -> tuple[GPT, dict[str, Any]]:
    """GPT-2 weights as a GPT (float32, CPU, train mode) and its model_args.

    name_or_folder: a local Hugging Face GPT-2 folder, or one of GPT2_NAMES, downloaded once into the HF cache.
    dropout: the only setting that may differ from the source. block_size: crop the position table to fewer
    positions (fine-tuning on short contexts); None keeps the source's n_positions (1024 for GPT-2).
    """
    folder = name_or_folder if os.path.isdir(name_or_folder) else _download(name_or_folder)
    config = _read_config(folder)
    nanochat = config.get("model_type") == "nanochat"
    path = os.path.join(folder, "config.json")
    args = (_nanochat_args if nanochat else _gpt2_args)(config, path)
    try:
        saved_model_args(args)  # a shape GPT cannot build (rotary on an odd head size) stops before it is built
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    n_positions = args["block_size"]
    if block_size is not None and not 0 < block_size <= n_positions:
        raise UserError(
            f"block_size {block_size} does not fit {name_or_folder}: it has {n_positions} "
            f"positions; use --block_size={n_positions} or less"
        )
    weights = _read_weights(folder)
    state = _from_nanochat(weights, args, folder) if nanochat else _to_gpt_state(weights, args, config, folder)
    model = meta_gpt(GPTConfig(**args, dropout=dropout))  # no random init of weights overwritten at once (1.5B)
    model.load_state_dict(state, strict=True, assign=True)
    if model.config.rotary:
        model.reset_rope()  # built on the meta device with the model: now where the weights are
    if not model.config.untie_head:
        model.transformer.wte.weight = model.lm_head.weight  # assign=True replaced both: tie them again
    if block_size is not None and block_size < n_positions:
        model.crop_block_size(block_size)
    return model, {k: getattr(model.config, k) for k in MODEL_ARGS}


def _download(name: str) -> str:
    """A hub name's config.json and weights in the local HF cache; the folder holding them."""
    if name not in GPT2_NAMES:
        looks_like_path = os.sep in name or name.startswith(".") or (os.altsep and os.altsep in name)
        what = f"folder {name} does not exist" if looks_like_path else f"{name!r} is not a folder nor a GPT-2 name"
        raise UserError(
            f"{what}: use one of {', '.join(GPT2_NAMES)} (downloaded from the Hugging Face hub), or {LOCAL_OPTION}"
        )
    hub, errors = _hf_hub()
    cached = isinstance(hub.try_to_load_from_cache(name, "config.json"), str)
    if not cached and not hub.constants.HF_HUB_OFFLINE and not _reachable(hub.constants.ENDPOINT):
        # huggingface_hub itself would retry for ~25 s before failing
        raise UserError(
            f"cannot download {name}: the Hugging Face hub ({hub.constants.ENDPOINT}) does not answer within "
            f"{HUB_PROBE_TIMEOUT_S:g} s. Offline? {LOCAL_OPTION[0].upper()}{LOCAL_OPTION[1:]}"
        )
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
        raise UserError(
            f"cannot download {name} from the Hugging Face hub ({type(e).__name__}: {reason}). "
            f"Offline? {LOCAL_OPTION[0].upper()}{LOCAL_OPTION[1:]}"
        ) from None
    return os.path.dirname(config_path)


HUB_PROBE_TIMEOUT_S = 3.0


def _reachable(url: str) -> bool:
    """Whether a TCP connection to `url`'s host (or to the HTTPS proxy, when one is set) opens quickly."""
    proxy = urllib.request.getproxies().get("https")
    parts = urllib.parse.urlsplit(proxy or url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except (OSError, ValueError):
        return False
    return True


def _hf_hub() -> tuple[Any, Any]:
    """huggingface_hub and its exceptions module; the [hf] extra installs it with transformers.

    Imported only for hub names, so that gptforge itself never needs transformers.
    """
    try:
        import huggingface_hub
        import transformers  # noqa: F401  (the [hf] extra: it brings huggingface_hub at a version that fits)
    except ImportError:
        raise UserError(
            f"downloading GPT-2 from the Hugging Face hub needs transformers: pip install "
            f"'gptforge[hf]'; or {LOCAL_OPTION}"
        ) from None
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
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a model config (a JSON object)")
    if config.get("model_type", "gpt2") not in ("gpt2", "nanochat"):
        raise UserError(
            f"{path}: model_type {config['model_type']!r} is not supported; gptforge reads Hugging Face GPT-2 "
            "(model_type 'gpt2') and NanoChat ('nanochat') folders"
        )
    return config


def _gpt2_args(config: dict[str, Any], path: str) -> dict[str, Any]:
    """GPT's model_args for a GPT-2 config.json; settings under which HF's GPT-2 computes something else refused."""
    missing = [k for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if k not in config]
    if missing:
        raise UserError(f"{path} is not a GPT-2 config (it lacks {', '.join(missing)})")
    n_embd = config["n_embd"]
    _refuse_differences(
        path,
        "GPT-2",
        {
            "activation_function": (config.get("activation_function", "gelu_new"), tuple(HF_GELUS)),
            "layer_norm_epsilon": (config.get("layer_norm_epsilon", 1e-5), (1e-5,)),
            "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
            "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
            "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
            "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
        },
    )
    names = dict(n_layer="n_layer", n_head="n_head", n_embd="n_embd", block_size="n_positions", vocab_size="vocab_size")
    gelu = HF_GELUS[config.get("activation_function", "gelu_new")]
    return {ours: config[theirs] for ours, theirs in names.items()} | {"bias": True, "gelu": gelu}


def _nanochat_args(config: dict[str, Any], path: str) -> dict[str, Any]:
    """GPT's model_args (the nanochat switches on) for a NanoChat config.json; what GPT cannot compute refused."""
    need = ("num_hidden_layers", "num_attention_heads", "hidden_size", "max_position_embeddings", "vocab_size")
    missing = [k for k in need if k not in config]
    if missing:
        raise UserError(f"{path} is not a NanoChat config (it lacks {', '.join(missing)})")
    C, heads = config["hidden_size"], config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    _refuse_differences(
        path,
        "NanoChat",
        {
            "hidden_act": (config.get("hidden_act", "relu2"), ("relu2",)),
            "intermediate_size": (config.get("intermediate_size"), (4 * C,)),
            "num_key_value_heads": (config.get("num_key_value_heads"), (None, heads)),
            "head_dim": (config.get("head_dim"), (None, C // heads)),
            "rms_norm_eps": (config.get("rms_norm_eps", 1e-6), (1e-6,)),
            "attention_bias": (config.get("attention_bias", False), (False,)),
            "tie_word_embeddings": (config.get("tie_word_embeddings", False), (False,)),
            "rope_type": (rope.get("rope_type", "default"), ("default",)),
        },
    )
    softcap = config.get("final_logit_softcapping")
    return dict(
        n_layer=config["num_hidden_layers"],
        n_head=heads,
        n_embd=C,
        block_size=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        rope_base=float(rope.get("rope_theta", 10000.0)),
        logit_softcap=float(softcap or 0.0),
        **NANOCHAT,
    )


def nanochat_names(n_layer: int) -> dict[str, str]:
    """GPT's tensor names -> NanoChatForCausalLM's. c_attn's maps to a pattern: its q, k and v thirds are
    NanoChat's `{q,k,v}_proj` (`pattern.format("q")`...). Used both ways: _from_nanochat and export."""
    names = {"transformer.wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
    for i in range(n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        names[ours + "attn.c_attn.weight"] = theirs + "self_attn.{}_proj.weight"
        names[ours + "attn.c_proj.weight"] = theirs + "self_attn.o_proj.weight"
        names[ours + "mlp.c_fc.weight"] = theirs + "mlp.fc1.weight"
        names[ours + "mlp.c_proj.weight"] = theirs + "mlp.fc2.weight"
    return names


def _refuse_differences(path: str, kind: str, settings: dict[str, tuple[Any, tuple[Any, ...]]]) -> None:
    """Refuse rather than compute something other than the Hugging Face model: settings maps a config.json key to
    (its value, the values GPT matches)."""
    bad = [f"{k}={v!r} (supported: {', '.join(map(repr, ok))})" for k, (v, ok) in settings.items() if v not in ok]
    if bad:
        raise UserError(f"{path}: this {kind} variant is not supported: {'; '.join(bad)}")


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
    raise UserError(
        f"{folder} holds no {' or '.join(WEIGHT_FILES)}"
        + (" (sharded checkpoints are not supported)" if sharded else f": {LOCAL_OPTION}")
    )


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
    expected = meta_gpt(GPTConfig(**args)).state_dict()
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
    _refuse_problems(problems + [f"unexpected {k}" for k in sorted(hf)], folder, "GPT-2")
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def _from_nanochat(hf: dict[str, torch.Tensor], args: dict[str, Any], folder: str) -> dict[str, torch.Tensor]:
    """NanoChatForCausalLM's tensors as GPT's state_dict (float32): q, k and v joined into c_attn; checked."""
    hf = dict(hf)
    expected = meta_gpt(GPTConfig(**args)).state_dict()
    state, problems = {}, []
    for key, theirs in nanochat_names(args["n_layer"]).items():
        if "{}" in theirs:  # c_attn: q, k and v
            parts = [hf.pop(theirs.format(x), None) for x in "qkv"]
            tensor = torch.cat(parts) if all(t is not None for t in parts) else None
            theirs = theirs.format("q/k/v")
        else:
            tensor = hf.pop(theirs, None)
        if tensor is None:
            problems.append(f"missing {theirs}")
        elif tensor.shape != expected[key].shape:
            problems.append(
                f"{theirs} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected[key].shape)}"
            )
        else:
            state[key] = tensor.to(torch.float32).contiguous()
    _refuse_problems(problems + [f"unexpected {k}" for k in sorted(hf)], folder, "NanoChat")
    return state


def _refuse_problems(problems: list[str], folder: str, kind: str) -> None:
    """A UserError listing the first four problems found mapping a folder's tensors, if there are any."""
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise UserError(
            f"{folder} does not hold {kind} weights matching its config.json: {'; '.join(problems[:4])}{more}"
        )
