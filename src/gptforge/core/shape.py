"""The model's settings, each written once, here. TrainConfig has them as keys (it derives from ModelShape), GPTConfig
builds the network from them (it derives from it too), a checkpoint's `model_args` records the `frozen` ones with
the vocabulary (a resumed model keeps them), and a `switch` is one of the modern recipe's: its default is its off
value, and with every switch off the model is nanoGPT's (GPT-2's, with gelu='tanh'). A key a checkpoint may lack
(written before the key existed) says what such a model had (`was`; nanoGPT's own where that differs). No torch
here: the config and the dashboard read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gptforge.core.errors import UserError
from gptforge.core.settings import below_one, not_negative, positive, setting

GELUS = ("erf", "tanh")  # the MLP's GELU: exact (nanoGPT's nn.GELU()) or the tanh approximation (GPT-2's gelu_new)
# A setting's shape rule: the model's shape (every shape key) -> what stops GPT from building it ("key=value ..."),
# or None. Only shapes that pass every rule reach GPT, so a rule is where a key's limits are said, once.
Rule = Callable[[Mapping[str, Any]], "str | None"]


def _shape(default: Any, doc: str, check: Any = None, **meta: Any) -> Any:
    """A setting the weights fix: a resumed run cannot change it, and a checkpoint records it."""
    return setting(default, doc, check, frozen=True, **meta)


def _switch(default: Any, doc: str, check: Any = None, *, rule: Rule | None, **meta: Any) -> Any:
    """A modern-recipe setting: its default (its off value) gives nanoGPT's model; checkpoints without it had it off.
    `rule` is required, so that a new switch says which shapes it cannot build (None: none; test_shape tries each
    switch on the edge shapes either way)."""
    return _shape(default, doc, check, switch=True, was=default, rule=rule, **meta)


def _positive_float(value: float) -> str | None:
    return "must be positive (the rotary wavelength base, e.g. 10000)" if value <= 0 else None


def _heads_divide(s: Mapping[str, Any]) -> str | None:
    C, H = s["n_embd"], s["n_head"]
    if H > 0 and C % H:
        return f"n_embd={C} must be divisible by n_head={H} (each head gets n_embd / n_head channels)"
    return None


def _rotary_pairs(s: Mapping[str, Any]) -> str | None:
    C, H = s["n_embd"], s["n_head"]
    if s["rotary"] and H > 0 and C % H == 0 and (C // H) % 2:  # the rotation turns channel i with i + hs / 2
        return (
            f"rotary={s['rotary']} turns each head's channels in pairs, so it needs an even head size, and n_embd / "
            f"n_head = {C} / {H} = {C // H} is odd"
        )
    return None


@dataclass(frozen=True)
class ModelShape:
    n_layer: int = _shape(12, "transformer blocks (GPT-2 124M: 12)", positive, section="model")
    n_head: int = _shape(12, "attention heads; must divide n_embd", positive, rule=_heads_divide)
    n_embd: int = _shape(768, "embedding width", positive)
    block_size: int = _shape(1024, "context length in tokens (GPT-2: 1024)", positive)
    bias: bool = _shape(False, "biases in Linear and LayerNorm layers (GPT-2 has them; without is a bit better/faster)")
    gelu: str = _shape(
        "erf",
        "the MLP's GELU: 'erf' (exact: nanoGPT's, faster on CPUs) or 'tanh' (GPT-2's approximation, Hugging Face's "
        "gelu_new: GPT-2 weights load with it); checkpoints without it: older gptforge's 'tanh', nanoGPT's 'erf'",
        was="tanh",
        nanogpt="erf",
        choices=GELUS,
    )
    dropout: float = setting(
        0.0, "dropout probability; 0 for pretraining, 0.1+ for fine-tuning small data (may change on resume)", below_one
    )
    rotary: bool = _switch(
        False,
        "rotary position embeddings (RoFormer; nanochat, modded-nanogpt) instead of learned ones; needs an even head "
        "size (n_embd / n_head)",
        section="the modern recipe's model switches (all off: GPT-2's model)",
        rule=_rotary_pairs,
    )
    rope_base: float = _switch(
        10000.0, "rotary=True: the wavelength base of the rotary angles", _positive_float, rule=None
    )
    rmsnorm: bool = _switch(
        False, "parameter-free RMSNorm instead of LayerNorm, also after the embedding (nanochat)", rule=None
    )
    qk_norm: bool = _switch(
        False, "RMS-normalise queries and keys per head, after rotary (nanochat, modded-nanogpt)", rule=None
    )
    relu2: bool = _switch(False, "ReLU(x)^2 in the MLP instead of GELU (Primer; nanochat, modded-nanogpt)", rule=None)
    untie_head: bool = _switch(False, "an output head of its own instead of the input embedding's transpose", rule=None)
    zero_init: bool = _switch(
        False, "attention's and the MLP's output projections start at zero (modded-nanogpt)", rule=None
    )
    logit_softcap: float = _switch(
        0.0, "> 0: logits = cap * tanh(logits / cap) (Gemma 2; nanochat uses 15)", not_negative, rule=None
    )


_FIELDS = dataclasses.fields(ModelShape)
SHAPE_KEYS = tuple(f.name for f in _FIELDS if f.metadata.get("frozen"))  # fixed by the weights
SWITCHES = {f.name: f.default for f in _FIELDS if f.metadata.get("switch")}  # each switch's off value
MODEL_ARGS = (*SHAPE_KEYS, "vocab_size")  # a checkpoint's model_args: the shape and the vocabulary
WAS = {f.name: f.metadata["was"] for f in _FIELDS if "was" in f.metadata}  # a key an older gptforge checkpoint lacks
NANOGPT_WAS = {**WAS, **{f.name: f.metadata["nanogpt"] for f in _FIELDS if "nanogpt" in f.metadata}}  # nanoGPT's


def model_args(settings: Any, vocab_size: int) -> dict[str, Any]:
    """The model_args of a new model: its shape from `settings` (a TrainConfig), its vocabulary from the data."""
    return {**{k: getattr(settings, k) for k in SHAPE_KEYS}, "vocab_size": vocab_size}


def saved_model_args(saved: dict[str, Any], nanogpt: bool = False) -> dict[str, Any]:
    """A checkpoint's model_args completed: a key the checkpoint predates takes what its model had (a switch off;
    gelu 'tanh' in an older gptforge checkpoint, 'erf' in nanoGPT's: `nanogpt`). An unknown gelu is a UserError."""
    was = NANOGPT_WAS if nanogpt else WAS
    args = {k: saved[k] if k in saved or k not in was else was[k] for k in MODEL_ARGS}
    if args["gelu"] not in GELUS:
        raise UserError(
            f"model_args gelu={args['gelu']!r} is not one of {', '.join(GELUS)}: not a model gptforge builds"
        )
    broken = _broken(args)
    if broken:  # written by other software, or edited: no setting of ours changes a saved shape
        raise UserError(f"model_args {broken[1]}: not a model gptforge builds")
    return args


def check_shape(settings: Any) -> None:
    """Every shape rule on `settings` (a TrainConfig), before anything is built or written: a UserError naming the
    setting, the shape and the nearest settings that build (shape_problem)."""
    found = shape_problem({k: getattr(settings, k) for k in SHAPE_KEYS})
    if found:
        what, fixes = found
        ways = [" ".join(f"--{k}={v}" for k, v in fix.items()) for fix in fixes]
        either = f"{', '.join(ways[:-1])} or {ways[-1]}" if len(ways) > 1 else "".join(ways)
        raise UserError(f"--{what}; use {either}" if ways else f"--{what}")


def shape_problem(shape: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]] | None:
    """The first rule `shape` (every shape key) breaks, as (what is wrong, the nearest settings that pass every
    rule: n_embd below and above for these heads, the n_head nearest these heads for this width, and the breaking
    switch off); None when GPT builds it. The alternatives are searched, not written per rule, so each one offered
    builds, whichever rules a new switch brings."""
    broken = _broken(shape)
    if broken is None:
        return None
    key, what = broken
    C, H = shape["n_embd"], shape["n_head"]

    def builds(**change: Any) -> bool:
        return _broken({**shape, **change}) is None

    if H <= 0:  # check_fields' to refuse
        return what, []
    k = C // H  # a few widths and head counts each side, never a scan: n_embd and n_head may be huge
    below = next((H * j for j in (k, k - 1, k - 2) if 0 < H * j < C and builds(n_embd=H * j)), None)
    above = next((H * j for j in (k + 1, k + 2) if builds(n_embd=H * j)), None)
    heads = [h for h in range(max(1, H - 64), H + 65) if h != H and builds(n_head=h)]
    fixes: list[dict[str, Any]] = [{"n_embd": c} for c in (below, above) if c is not None]
    if heads:
        fixes.append({"n_head": min(heads, key=lambda h: (abs(h - H), -h))})  # a tie: more heads
    if key in SWITCHES and builds(**{key: SWITCHES[key]}):
        fixes.append({key: SWITCHES[key]})
    return what, fixes


def _broken(shape: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the key whose rule `shape` breaks, what is wrong), the first in field order; None when every rule holds."""
    for f in _FIELDS:
        rule = f.metadata.get("rule")
        what = rule(shape) if rule else None
        if what:
            return f.name, what
    return None


def parameter_count(args: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, those in the blocks' 2-D matrices) of the model `args` describe, counted from the shape as
    GPT builds it: embeddings, position table (not with rotary), per block the norms, q/k/v, projections and MLP,
    the final norm, and the head when it is not tied to the embedding."""
    L, C, V, T = args["n_layer"], args["n_embd"], args["vocab_size"], args["block_size"]
    norm = 0 if args["rmsnorm"] else (2 * C if args["bias"] else C)  # LayerNorm: weight (+ bias); RMSNorm: none
    matrices = 12 * C * C  # c_attn 3C^2, attention c_proj C^2, c_fc 4C^2, MLP c_proj 4C^2
    biases = (3 * C + C + 4 * C + C) if args["bias"] else 0
    block = 2 * norm + matrices + biases
    total = V * C + (0 if args["rotary"] else T * C) + L * block + norm + (V * C if args["untie_head"] else 0)
    return total, L * matrices


def model_vocab_size(meta: dict) -> int:
    """The embedding rows a new model gets for a dataset's vocabulary: a BPE's (GPT-2's 50257, an own one's) padded
    to a multiple of 64 (50304), which matmul kernels prefer (the extra rows never occur in data; the export cuts
    them); a char vocabulary as it is (nanoGPT's shape)."""
    vocab = meta["vocab_size"]
    return -(-vocab // 64) * 64 if meta["tokenizer"] in ("gpt2", "bpe") else vocab
