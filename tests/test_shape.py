"""Every model-shape key is written once (core/shape.py): a switch added there in a temporary copy of the package
reaches the config, --help, the network's config, a checkpoint's model_args, an old checkpoint's defaults and
resume's frozen keys with no other edit; parameter_count equals the network's own count. Every shape key's other
values, alone and in pairs, on edge shapes (odd head sizes, heads of 1 and 2 channels, a width the heads do not
divide) are either refused by a shape rule (a UserError naming it, each alternative it offers building) or build a
model that trains and decodes; a switch added without the rule it needs fails here."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from gptforge.core.config import CHOICES, load_config
from gptforge.core.errors import UserError
from gptforge.core.shape import SHAPE_KEYS, SWITCHES, ModelShape, parameter_count, saved_model_args, shape_problem
from gptforge.model.cache import KVCache
from gptforge.model.gpt import GPT, GPTConfig

SRC = Path(__file__).resolve().parent.parent / "src" / "gptforge"

PROBE = r"""
import dataclasses, json, sys
from gptforge.core.config import TrainConfig, help_text, load_config
from gptforge.core.shape import MODEL_ARGS, SHAPE_KEYS, SWITCHES, model_args, saved_model_args
from gptforge.model.gpt import GPTConfig
from gptforge.train.resume import load_run_config
from gptforge.core.errors import UserError

cfg = load_config(["--dummy_switch=True", "--n_layer=2"])
old = {k: v for k, v in model_args(TrainConfig(), 65).items() if k != "dummy_switch"}  # a checkpoint from before
run = sys.argv[1]
with open(f"{run}/config.json", "w") as fh:
    json.dump(dataclasses.asdict(TrainConfig(out_dir=run, dummy_switch=False)), fh)
open(f"{run}/ckpt.pt", "wb").close()
try:
    load_run_config([f"--out_dir={run}", "--init_from=resume", "--dummy_switch=True"])
    refused = ""
except UserError as e:
    refused = str(e)
print(json.dumps({
    "config": cfg.dummy_switch,
    "in_help": "--dummy_switch=False" in help_text(),
    "gpt_config": GPTConfig(**model_args(cfg, 65)).dummy_switch,
    "model_args": "dummy_switch" in MODEL_ARGS,
    "switch_off_value": SWITCHES.get("dummy_switch", "missing"),
    "frozen": "dummy_switch" in SHAPE_KEYS,
    "old_checkpoint": saved_model_args(old)["dummy_switch"],
    "resume_refuses": refused,
}))
"""


def test_a_switch_written_once_reaches_every_dependant(tmp_path):
    pkg = tmp_path / "src" / "gptforge"
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shape = pkg / "core" / "shape.py"
    text = shape.read_text()
    anchor = "\n\n_FIELDS = dataclasses.fields(ModelShape)"
    assert anchor in text, "core/shape.py changed: update this test's anchor"
    dummy = '\n    dummy_switch: bool = _switch(False, "a test switch", rule=None)'
    shape.write_text(text.replace(anchor, dummy + anchor, 1))
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    out = subprocess.run([sys.executable, "-c", PROBE, str(run)], env=env, capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout)
    assert seen["config"] is True and seen["in_help"] and seen["gpt_config"] is True
    assert seen["model_args"] and seen["frozen"] and seen["switch_off_value"] is False
    assert seen["old_checkpoint"] is False  # a checkpoint written before the switch existed had it off
    assert "--dummy_switch=True" in seen["resume_refuses"] and "keeps its shape" in seen["resume_refuses"]


def test_the_shape_keys_are_the_networks_settings():
    assert set(SHAPE_KEYS) | {"dropout", "vocab_size"} == {f for f in GPTConfig.__dataclass_fields__}
    assert set(SWITCHES) < set(SHAPE_KEYS)
    switches = [f for f in dataclasses.fields(ModelShape) if f.metadata.get("switch")]
    assert all("rule" in f.metadata for f in switches), "each switch says its shape rule (None: it has none)"


# --- shape rules: every shape key's other values on edge shapes -------------------------------------------------
DIMS = ("n_layer", "n_head", "n_embd", "block_size")  # the sizes; every other shape key is a choice
T = 4  # block_size and the batch's length
EDGES = [(30, 2), (6, 2), (4, 4), (1, 1), (2, 1), (4, 2), (6, 3), (33, 4), (16, 2)]
# (n_embd, n_head): head sizes 15, 3 and 1 (odd), 1 and 2 (the smallest), n_embd not divisible, and a plain one


def other_values(key: str) -> list:
    """The values of a shape key other than its default (its off value): a switch on, the other GELU."""
    default = getattr(ModelShape(), key)
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, str):
        return [v for v in CHOICES[key] if v != default]
    if isinstance(default, float):
        return [default / 20 if default else 15.0]  # rope_base 500, logit_softcap 15
    raise AssertionError(f"shape key {key!r} ({type(default).__name__}): tell this test the values it takes")


CHANGES = [(k, v) for k in SHAPE_KEYS if k not in DIMS for v in other_values(k)]
COMBOS = [{}, *({k: v} for k, v in CHANGES), dict(CHANGES)]
COMBOS += [dict(pair) for pair in itertools.combinations(CHANGES, 2) if pair[0][0] != pair[1][0]]


def trains_and_decodes(args: dict) -> None:
    """Forward and backward on a tiny batch in float32 (a plain one) and under bf16 autocast with dropout and fast
    dropout (packed rows: positions and the document mask), as CPU training runs; then decoding the batch's last
    token with a KV cache after the others equals the whole forward. A warning fails too: a silent broadcast that
    resizes a tensor is a wrong model, not a working one."""
    x = torch.randint(0, 11, (2, T))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dropout, bf16, positions in ((0.0, False, None), (0.1, True, torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]))):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**args, vocab_size=11, dropout=dropout)).train()
            model.use_fast_dropout(bf16)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(x, x, positions=positions, need_logits=False)
            loss.backward()
            assert torch.isfinite(loss), loss
        with torch.no_grad():
            whole, _ = model.eval()(x)
            cache = KVCache(args["n_layer"], T)
            model(x[:, :-1], cache=cache)
            step, _ = model(x[:, -1:], cache=cache)
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-5)


def failure(args: dict) -> str | None:
    try:
        trains_and_decodes(args)
    except Exception as e:  # anything: an assert, a shape mismatch, a warning made an error
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


@pytest.mark.parametrize("n_embd,n_head", EDGES, ids=[f"{c}-{h}" for c, h in EDGES])
def test_every_shape_setting_on_edge_shapes_is_refused_by_its_rule_or_trains_and_decodes(n_embd, n_head):
    """Each combination: no rule breaks and the model trains and decodes, or a rule refuses it (load_config's
    UserError says what and offers alternatives, each of which trains and decodes) and it indeed would not."""
    problems = []
    for combo in COMBOS:
        args = {**{k: getattr(ModelShape(), k) for k in SHAPE_KEYS}, "n_layer": 2, "block_size": T, **combo}
        args.update(n_embd=n_embd, n_head=n_head)
        found, failed = shape_problem(args), failure(args)
        if found is None:
            problems += [f"{combo}: no rule refuses it, and it fails: {failed}"] if failed else []
            continue
        what, fixes = found
        problems += [] if failed else [f"{combo}: refused ({what}), but it trains and decodes"]
        with pytest.raises(UserError) as refused:
            load_config([f"--{k}={v}" for k, v in args.items()])
        offered = [" ".join(f"--{k}={v}" for k, v in fix.items()) for fix in fixes]
        assert str(refused.value).startswith(f"--{what}; use ") and all(o in str(refused.value) for o in offered)
        assert fixes, f"{combo}: refused with nothing offered"
        problems += [
            f"{combo} + {fix}: offered, but {failure({**args, **fix})}" for fix in fixes if failure({**args, **fix})
        ]
    assert not problems, "\n".join(problems)


def test_rotary_on_an_odd_head_size_names_the_switch_the_shape_and_what_builds():
    with pytest.raises(UserError) as e:
        load_config(["--rotary=True", "--n_embd=30", "--n_head=2"])
    assert str(e.value) == (
        "--rotary=True turns each head's channels in pairs, so it needs an even head size, and n_embd / n_head = "
        "30 / 2 = 15 is odd; use --n_embd=28, --n_embd=32, --n_head=3 or --rotary=False"
    )
    saved = {k: getattr(ModelShape(), k) for k in SHAPE_KEYS} | dict(rotary=True, n_embd=30, n_head=2, vocab_size=9)
    with pytest.raises(UserError, match=r"^model_args rotary=True .* = 15 is odd: not a model gptforge builds$"):
        saved_model_args(saved)  # a checkpoint's or a Hugging Face folder's: no option of ours changes it


@pytest.mark.parametrize(
    "bias,rotary,rmsnorm,untie_head", list(itertools.product([False, True], repeat=4)), ids=lambda v: str(int(v))
)
def test_parameter_count_equals_the_networks(bias, rotary, rmsnorm, untie_head):
    args = dict(n_layer=3, n_head=2, n_embd=16, block_size=24, vocab_size=37, bias=bias, rotary=rotary)
    args.update(rmsnorm=rmsnorm, untie_head=untie_head, qk_norm=True, relu2=True)
    model = GPT(GPTConfig(**args))
    full = {**GPTConfig().__dict__, **args}
    total, matrices = parameter_count(full)
    assert total == sum(p.numel() for p in model.parameters())
    assert matrices == sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".h." in n)
