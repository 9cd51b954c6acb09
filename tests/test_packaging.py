"""pyproject.toml's extras: `gptforge[all]` holds every requirement of every other extra but `test`, so the one
install that runs every command (`gptforge dashboard`, `serve`, `export`, ...) cannot fall behind a new extra; and
those commands, their extra missing, say which to install (or all), exit 2, before loading anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomllib's original
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
RUNTIME = {"hf", "data", "wandb", "tensorboard", "eval", "chat", "dashboard", "serve", "gguf"}


def extras() -> dict[str, set[str]]:
    table = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    return {name: {"".join(r.split()) for r in reqs} for name, reqs in table.items()}  # "a >= 1" as "a>=1"


def test_all_holds_every_requirement_of_every_other_runtime_extra():
    found = extras()
    others = {name: reqs for name, reqs in found.items() if name not in ("all", "test")}
    assert RUNTIME <= set(others), f"extras missing from pyproject.toml: {sorted(RUNTIME - set(others))}"
    missing = {name: sorted(reqs - found["all"]) for name, reqs in others.items() if reqs - found["all"]}
    assert not missing, f"add these to the 'all' extra: {missing}"
    stray = found["all"] - set().union(*others.values())
    assert not stray, f"'all' holds requirements no other extra has (a stale pin?): {sorted(stray)}"


NEEDS = [  # (command, a module its extra installs, made absent; that extra)
    (["dashboard", "."], "plotly", "dashboard"),
    (["serve", "--out_dir=no-run", "--port=0"], "fastapi", "serve"),
    (["export", "--out_dir=no-run", "--to=hf"], "safetensors", "hf"),
    (["export", "--out_dir=no-run", "--to=m.gguf"], "gguf", "gguf"),
]


@pytest.mark.parametrize("argv,module,extra", NEEDS, ids=[n[0][0] for n in NEEDS])
def test_a_command_without_its_extra_names_it_and_all(tmp_path, argv, module, extra):
    # sys.modules[name] = None is how Python marks a module as absent
    code = f"import sys; sys.modules[{module!r}] = None\nfrom gptforge.cli.main import main\nmain({argv!r})"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"pip install 'gptforge[{extra}]' (or 'gptforge[all]': every extra)" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
