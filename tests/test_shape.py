"""Every model-shape key is written once (core/shape.py): a switch added there in a temporary copy of the package
reaches the config, --help, the network's config, a checkpoint's model_args, an old checkpoint's defaults and
resume's frozen keys with no other edit; parameter_count equals the network's own count."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gptforge.core.shape import SHAPE_KEYS, SWITCHES, parameter_count
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
    shape.write_text(text.replace(anchor, '\n    dummy_switch: bool = _switch(False, "a test switch")' + anchor, 1))
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
