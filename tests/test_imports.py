"""The package's layering (docs/ARCHITECTURE.md), checked by walking every module's imports with ast."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "gptforge"

# Tiers, bottom up: a module may import the tiers below its own (errors, a leaf, is open to all).
LEAVES = {"model", "tokenizer", "data.loader", "data.sources", "optim", "distributed", "metrics", "errors", "config"}
STORAGE = {"checkpoint", "pretrained", "data.prepare", "data.shards"}
USES = {"sample", "evaluate.loss", "evaluate.hellaswag"}
ALLOWED = {
    **{m: set() for m in LEAVES},
    **{m: LEAVES for m in STORAGE},
    **{m: LEAVES | STORAGE for m in USES},
    "train": LEAVES | STORAGE | USES | {"dashboard"},  # dashboard=True serves the run beside it
    "bench": LEAVES | STORAGE | USES,  # beside train, never importing it
}


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
        imports = package_imports(path) - {"", "errors"}
        if "cli" in imports and name not in ("cli", "__main__"):
            problems.append(f"{name} imports cli")
        if path.name == "__init__.py" or name in ("__main__", "cli"):
            continue
        if name.startswith("dashboard"):
            assert not imports - {m for m in imports if m.startswith("dashboard")}, name
            continue
        allowed = ALLOWED.get(name)
        assert name in ALLOWED, f"{name} is not placed in the layering: add it to ALLOWED and ARCHITECTURE.md"
        bad = imports - allowed - {name}
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
