"""The package's layering (docs/ARCHITECTURE.md), checked by walking every module's imports with ast."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "gptforge"

# The modules bottom up: each may import only modules listed before it (errors, the leaf, is open to all), so
# imports flow one way and there are no cycles. docs/ARCHITECTURE.md "Imports flow one way" names the groups.
GROUPS = [
    ("core.errors", "core.console", "core.files", "core.allocator", "core.quick_exit"),  # standard library only
    (
        "core.settings",
        "core.shape",
        "core.aliases",
        "core.config_file",
        "core.config",
    ),  # settings, the model's shape: no torch
    ("core.memory", "core.cpu", "core.device", "core.distributed", "core.vml"),  # what it needs, where and how it runs
    # the speed paths behind plain tensor functions
    (
        "kernels.reference",
        "kernels.checks",
        "kernels.native",
        "kernels.masks",
        "kernels.norms",
        "kernels.rotary",
        "kernels.dropout",
        "kernels.linear",
        "kernels.activations",
        "kernels.attention",
        "kernels.head_loss",
    ),
    # the network and its optimizers
    ("model.cache", "model.modules", "model.gpt", "model.vocab", "model.eager_optim", "model.muon", "model.optim"),
    (
        "tokenizer.specials",
        "tokenizer.hf_format",
        "tokenizer.char",
        "tokenizer.gpt2",
        "tokenizer.bpe",
        "tokenizer.spec",
    ),
    (
        "chat.calculator",
        "chat.tools",
        "chat.conversations",
        "chat.render",
        "chat.synthetic",
        "chat.template",
        "chat.pack",
        "chat.prepare",
    ),  # chat data
    # documents in (and tokenizers trained on them)
    ("data", "data.options", "data.sources", "tokenizer.train", "tokenizer.options", "tokenizer.command"),
    ("data.chat_batches", "data.loader", "data.prepare", "data.shards", "data.command"),  # datasets in, batches out
    # weights in and out of files
    (
        "weights.options",
        "weights.checkpoint",
        "weights.pretrained",
        "weights.gguf_vocab",
        "weights.gguf_file",
        "weights.load",
        "weights.export",
    ),
    ("infer.options", "infer.engine", "infer.decode", "infer.sample"),  # using a model
    (
        "infer.textstream",
        "infer.toolcalls",
        "infer.sampling",
        "infer.chat_model",
        "infer.session",
        "infer.chat_cli",
    ),  # talking to it
    (
        "infer.api_error",
        "infer.function_calling",
        "infer.batcher",
        "infer.openai_api",
        "infer.serve_options",
        "infer.serve",
    ),  # serving it
    ("evaluate.options", "evaluate.loss", "evaluate.chat", "evaluate.hellaswag", "evaluate.harness_model"),
    ("evaluate.harness",),
    ("train.metrics", "train.resume", "train.runstate", "train.checkpointer", "train.parallel"),
    ("train.start", "train.resolve", "train.setup", "train.loop"),
    ("rl.options", "rl.rewards", "rl.rollout", "rl.objective", "rl.start", "rl.evaluate", "rl.loop"),  # RL on rewards
    ("bench.options", "bench.profile", "bench.speed", "bench.time_to_loss"),  # measurements of steps and whole runs
    # every stage in one command
    ("pipeline.options", "pipeline.kinds", "pipeline.stages", "pipeline.recipe", "pipeline.report", "pipeline.run"),
    ("cli.parsers", "cli.handlers", "cli.args", "cli.main"),  # the CLI: options -> parsers, and who does the work
]
STAGES = [
    "core",
    "kernels",
    "model",
    "tokenizer",
    "chat",
    "data",
    "weights",
    "infer",
    "evaluate",
    "train",
    "rl",
    "bench",
    "pipeline",
    "cli",
]
ORDER = [name for group in GROUPS for name in group]
# the dashboard imports no torch: it starts at once
DASHBOARD_MAY_USE = {
    "core.errors",
    "core.files",
    "core.config",
    "core.config_file",
    "core.aliases",
    "core.settings",
    "core.shape",
}
# train's dashboard=True; `gptforge dashboard`'s options and server
EXTRA = {"train.metrics": {"dashboard"}, "cli.handlers": {"dashboard"}, "cli.args": {"dashboard"}}


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
        if any(m.split(".")[0] == "cli" for m in imports) and not name.startswith("cli") and name != "__main__":
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
        bad = imports - allowed - {"core.errors"} - {s for s in STAGES if s in allowed_stages(allowed)}
        if bad:
            problems.append(f"{name} imports {sorted(bad)}")
    assert not problems, problems


def allowed_stages(allowed: set[str]) -> set[str]:
    """A stage's package itself (its __init__, a docstring) may be imported once any of its modules may."""
    return {m.split(".")[0] for m in allowed}


def test_every_stage_package_says_what_it_owns_and_imports():
    """Each stage's docstring says what it owns and ends with `Imports: A, B.`, the stages its modules import: the
    real imports (any, lazy ones too) and the line must agree, so the docstring cannot drift from the code."""
    problems = []
    for stage in [*STAGES, "dashboard"]:
        init = SRC / stage / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init} needs a docstring: what the stage owns and what it imports"
        line = doc.splitlines()[-1]
        assert line.startswith("Imports: ") and line.endswith("."), f"{init}: end the docstring with 'Imports: ...'"
        said = set() if line == "Imports: nothing of gptforge." else set(line[len("Imports: ") : -1].split(", "))
        used = {m.split(".")[0] for path in (SRC / stage).rglob("*.py") for m in package_imports(path)} - {"", stage}
        if said != used:
            problems.append(f"{stage}: says {sorted(said)}, imports {sorted(used)}")
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
    bad.write_text("from gptforge.train.loop import train\nimport gptforge.core.errors\n")
    assert package_imports(bad) == {"train.loop", "core.errors"}
