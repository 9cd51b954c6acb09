"""The package's layering (docs/ARCHITECTURE.md), checked by walking every module's imports with ast."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "gptforge"

# The modules bottom up: each may import only modules listed before it (errors, the leaf, is open to all), so
# imports flow one way and there are no cycles. docs/ARCHITECTURE.md "Imports flow one way" names the groups.
GROUPS = [
    ("errors", "console", "files", "allocator"),  # standard library only: the dashboard may use them
    ("aliases", "config", "resume", "memory", "tokenizer", "layers", "model"),  # settings, vocabularies, the network
    ("device", "distributed", "muon", "optim", "metrics"),  # where and how it runs, what it reports
    ("data", "data.sources", "data.loader", "data.prepare", "data.shards"),  # datasets in, batches out
    ("pretrained", "checkpoint"),  # weights in and out of files
    ("checkpointer", "sample", "evaluate.loss", "evaluate.hellaswag", "export", "bench"),  # what uses a model
    ("evaluate.harness_model", "evaluate.harness"),  # lm-evaluation-harness on a model
    ("train_setup", "train"),  # the training run (bench never imports it: they share optim.accumulate_gradients)
    ("time_to_loss",),  # bench --target_loss: whole training runs to a loss
    ("cli_args", "cli"),  # the command line; nothing imports it
]
ORDER = [name for group in GROUPS for name in group]
DASHBOARD_MAY_USE = {"errors", "files", "config"}  # standard library only: the dashboard starts at once
EXTRA = {"train_setup": {"dashboard"}, "cli": {"dashboard"}}  # train's dashboard=True; `gptforge dashboard`


def package_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if name == "gptforge" or name.startswith("gptforge."):
                found.add(name.removeprefix("gptforge").lstrip("."))
    return found


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__") or ""


def test_imports_flow_one_way():
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        imports = package_imports(path) - {""}
        if "cli" in imports and name not in ("cli", "__main__"):
            problems.append(f"{name} imports cli")
        if path.name == "__init__.py" and name != "data" or name == "__main__":
            continue
        if name.startswith("dashboard"):
            outside = {m for m in imports if not m.startswith("dashboard")}
            assert outside <= DASHBOARD_MAY_USE, f"{name} imports {sorted(outside - DASHBOARD_MAY_USE)}"
            continue
        assert name in ORDER, f"{name} is not placed in the layering: add it to ORDER and ARCHITECTURE.md"
        imports = {"dashboard" if m.startswith("dashboard") else m for m in imports}
        allowed = set(ORDER[: ORDER.index(name)]) | EXTRA.get(name, set())
        bad = imports - allowed - {"errors"}
        if bad:
            problems.append(f"{name} imports {sorted(bad)}")
    assert not problems, problems


def test_dashboard_never_imports_torch():
    for path in sorted((SRC / "dashboard").rglob("*.py")) if (SRC / "dashboard").exists() else []:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("torch", "numpy") for n in names), path


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "model.py"
    bad.write_text("from gptforge.train import train\nimport gptforge.errors\n")
    assert package_imports(bad) == {"train", "errors"}
