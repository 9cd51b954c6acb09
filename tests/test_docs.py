"""The docs match the code: README's config table lists every key with its real default and meaning."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from gptforge.core.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def test_readme_config_table_matches_trainconfig():
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \| (.+?) \|$", (ROOT / "README.md").read_text(), re.M)
    table = {key: (default, doc) for key, default, doc in rows}
    default = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        assert f.name in table, f"README's config table lacks {f.name}"
        assert table[f.name][0] == repr(getattr(default, f.name)), f.name
        assert table[f.name][1] == f.metadata["doc"].replace("|", "\\|"), f.name
    assert set(table) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_readme_names_the_two_commands_and_the_makefile_has_them():
    readme, makefile = (ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()
    assert "make demo" in readme and "make test" in readme
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci/run").read_text()
