"""`gptforge pipeline` as a user runs it, on a scaled-down chat recipe (every kind of stage, seconds each): the whole
pipeline, its report against `gptforge eval chat`'s own output, the same command again (all skipped), a changed
middle stage (it and the later stages run, nothing before), kill -9 in every stage then the same command (equal to
the uninterrupted pipeline bit for bit), and bad recipes (exit 2 naming file, line and key; nothing run)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chat_tools import ONE_THREAD
from conftest import ROOT, SHAKESPEARE, need_shared, run_cli

TRAIN = """gradient_accumulation_steps = 1
max_iters = 200
lr_decay_iters = 200
eval_interval = 50
eval_iters = 2
log_interval = 25
"""  # both training stages: 200 steps, a checkpoint every 50 (room for the kill -9 test)
RECIPE = (
    """
[pipeline]
out_dir = "out"

[text]
files = ["corpus.txt"]

[tokenizer]
text = "text"
vocab_size = 320
max_digits = 1

[pretrain_data]
kind = "prepare_text"
text = "text"
tokenizer = "tokenizer"

[chat_data]
kind = "prepare_chat"
tokenizer = "tokenizer"
include = "synthetic"
synthetic_examples = 300
synthetic_kinds = "add3,count"
block_size = 64

[pretrain]
kind = "train"
dataset = "pretrain_data"
n_layer = 1
n_head = 2
n_embd = 32
block_size = 64
batch_size = 4
"""
    + TRAIN
    + """device = "cpu"
dtype = "float32"
compile = false

[sft]
kind = "train"
dataset = "chat_data"
init_from = "pretrain"
task = "sft"
block_size = 64
batch_size = 4
"""
    + TRAIN
    + """chat_eval_examples = 0
device = "cpu"
dtype = "float32"
compile = false

[eval_sft]
kind = "eval_chat"
model = "sft"
kinds = "add3,count"
examples = 4
tools = "none"
dtype = "float32"

[rl]
init_from = "sft"
kinds = "add3,count"
max_steps = 24
prompts_per_step = 2
num_generations = 2
max_completion_length = 6
ckpt_interval = 6
eval_interval = 12
eval_examples = 2
learning_rate = 1e-2
dtype = "float32"

[eval_rl]
kind = "eval_chat"
model = "rl"
kinds = "add3,count"
examples = 4
tools = "none"
dtype = "float32"

[export]
model = "rl"

[samples]
kind = "chat"
model = "rl"
prompts = ["Compute 12 + 30.", "Hello!"]
max_new_tokens = 8
tools = "none"
dtype = "float32"
"""
)
STAGES = [
    *("text", "tokenizer", "pretrain_data", "chat_data", "pretrain", "sft"),
    *("eval_sft", "rl", "eval_rl", "export", "samples"),
]


def recipe_in(folder: Path, shakespeare: Path, text: str = RECIPE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(shakespeare.read_text(encoding="utf-8")[:120_000], encoding="utf-8")
    (folder / "recipe.toml").write_text(text, encoding="utf-8")
    return folder / "recipe.toml"


def pipeline(recipe: Path, *more: str):
    return run_cli("pipeline", str(recipe), *more, cwd=recipe.parent, env=ONE_THREAD, timeout=600)


def ran(stdout: str) -> list[str]:
    return re.findall(r"^\[\d+/\d+\] (\S+): (?:starting|resuming)", stdout, re.M)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    recipe = recipe_in(tmp_path_factory.mktemp("pipeline"), need_shared(SHAKESPEARE))
    r = pipeline(recipe)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert ran(r.stdout) == STAGES
    return recipe


def model_state(folder: Path) -> dict:
    return torch.load(folder / "ckpt.pt", weights_only=True)["model"]


def test_the_report_holds_what_each_stages_own_command_gives(whole):
    out = whole.parent / "out"
    report = (out / "report.md").read_text()
    for stage in STAGES:
        assert f"| {stage} |" in report
    own = run_cli("eval", "chat", "--out_dir", str(out / "rl"), "--kinds", "add3,count", "--examples", "4",
                  "--tools", "none", "--dtype", "float32", env=ONE_THREAD)  # fmt: skip
    assert own.returncode == 0, own.stderr
    table = json.loads((out / "eval_rl" / "eval.json").read_text())
    for kind in ("add3", "count"):
        said = re.search(rf"^{kind}\s+exact match ([0-9.]+)", own.stdout, re.M).group(1)
        assert table["kinds"][kind]["exact"] == float(said)
        assert re.search(rf"^\| {kind} \| [0-9.]+ ± [0-9.]+ \| {said} ± ", report, re.M), report
    own = run_cli("chat", "--out_dir", str(out / "rl"), "-p", "Hello!", "--max_new_tokens", "8", "--tools", "none",
                  "--dtype", "float32", env=ONE_THREAD)  # fmt: skip
    samples = json.loads((out / "samples" / "samples.json").read_text())
    assert [s["prompt"] for s in samples] == ["Compute 12 + 30.", "Hello!"]
    assert own.returncode == 0 and samples[1]["answer"] == own.stdout.strip()
    assert "## Sample conversations" in report and "asked: Hello!" in report
    final = json.loads((out / "pipeline.json").read_text())["stages"]
    assert all(final[s]["done"] for s in STAGES)
    assert (out / "export" / "hf" / "config.json").is_file()


def test_the_same_command_again_skips_every_stage(whole):
    r = pipeline(whole)
    assert r.returncode == 0, r.stderr
    assert ran(r.stdout) == [] and r.stdout.count("), skipped") == len(STAGES)


def test_a_changed_middle_stage_runs_it_and_the_later_stages_only(whole, tmp_path):
    shutil.copytree(whole.parent, tmp_path / "copy")
    recipe = tmp_path / "copy" / "recipe.toml"
    pretrain = model_state(tmp_path / "copy" / "out" / "pretrain")
    r = pipeline(recipe, "--sft.max_iters=150", "--sft.lr_decay_iters=150")
    assert r.returncode == 0, r.stderr
    assert ran(r.stdout) == ["sft", "eval_sft", "rl", "eval_rl", "export", "samples"]
    after = model_state(tmp_path / "copy" / "out" / "pretrain")
    assert all(torch.equal(pretrain[k], after[k]) for k in pretrain)
    assert "step 150: done" in (tmp_path / "copy" / "out" / "logs" / "sft.log").read_text()


def test_an_edited_file_changes_its_stage_and_the_later_ones_only(tmp_path, monkeypatch):
    """Fingerprints (in-process): editing the RL stage's reward file or the text's file re-runs from that stage."""
    from gptforge.pipeline.recipe import read_recipe
    from gptforge.pipeline.run import fingerprints

    monkeypatch.chdir(tmp_path)
    Path("corpus.txt").write_text("To be, or not to be.\n" * 50)
    Path("reward.py").write_text("def one(prompt, answer, example):\n    return 1.0\n")
    text = RECIPE.replace("learning_rate = 1e-2\n", 'learning_rate = 1e-2\nreward = "reward.py:one"\n', 1)
    Path("recipe.toml").write_text(text)
    before = fingerprints(read_recipe("recipe.toml"))
    Path("reward.py").write_text("def one(prompt, answer, example):\n    return 0.5\n")
    after = fingerprints(read_recipe("recipe.toml"))
    assert [s for s in STAGES if before[s] != after[s]] == ["rl", "eval_rl", "export", "samples"]
    Path("corpus.txt").write_text("To be, or not to be?\n" * 50)
    assert all(before[s] != v for s, v in fingerprints(read_recipe("recipe.toml")).items())


def started(out: Path, stage: str) -> bool:
    """The stage is under way: a training stage once it has written a checkpoint, the others once begun."""
    if stage in ("pretrain", "sft", "rl"):
        return (out / stage / "ckpt.pt").is_file()
    state = out / "pipeline.json"
    try:
        return stage in json.loads(state.read_text())["stages"]
    except (OSError, ValueError):
        return False


def test_kill_9_in_every_stage_then_the_same_command_equals_the_uninterrupted_pipeline(whole, tmp_path):
    recipe = recipe_in(tmp_path, Path(whole.parent / "corpus.txt"))
    out = tmp_path / "out"
    rng = random.Random(0)
    env = {**os.environ, **ONE_THREAD}
    for stage in STAGES[1:]:  # the text stage takes milliseconds: it is killed, if at all, with the tokenizer
        proc = subprocess.Popen([sys.executable, "-m", "gptforge", "pipeline", str(recipe)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not started(out, stage):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.05))  # the training stages: just after a checkpoint, mid-run
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(0.5)  # the stage's own process follows its parent
    alive = subprocess.run(["pgrep", "-f", f"gptforge.*{tmp_path}"], capture_output=True, text=True).stdout
    assert alive.strip() == "", "a stage outlived its pipeline"
    r = pipeline(recipe)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = {run: (out / "logs" / f"{run}.log").read_text() for run in ("pretrain", "sft", "rl")}
    assert "resume=auto: resuming" in logs["pretrain"] and "resume=auto: resuming" in logs["sft"], logs
    assert "resuming the RL run" in logs["rl"]
    for run in ("pretrain", "sft", "rl"):
        a, b = model_state(whole.parent / "out" / run), model_state(out / run)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), run
    for ev in ("eval_sft", "eval_rl"):
        said = [(folder / "out" / ev / "eval.json").read_text() for folder in (whole.parent, tmp_path)]
        assert said[0] == said[1], ev


DATA = (
    "[t]\nkind = 'text'\n\n[tok]\nkind = 'tokenizer'\ntext = 't'\nvocab_size = 300\n\n"
    "[d]\nkind = 'prepare_text'\ntext = 't'\ntokenizer = 'tok'\n\n"
)  # 13 lines: a text, a tokenizer and a dataset for a train stage to read
BAD = [
    ("[sft]\nkind = 'trian'\n", "recipe.toml:1: stage [sft] has kind 'trian'"),
    ("[tok]\nkind = 'tokenizer'\ntext = 'words'\nvocab_size = 300\n", "recipe.toml:3: [tok] text = 'words' must name"),
    ("[text]\nsources = ['chitchat']\n\n[tokenizer]\ntext = 'text'\nvocab_sise = 300\n", "recipe.toml:6: [tokenizer]"),
    ("[text]\nsources = ['chitchat']\n\n[tokenizer]\ntext = 'text'\nvocab_size = 'big'\n", "recipe.toml:6: [tok"),
    ("[a]\nkind = 'train'\n", "recipe.toml:1: [a] needs dataset = the name of an earlier stage of kind prepare_text"),
    (DATA + "[a]\nkind = 'train'\ndataset = 'd'\nmax_iter = 5\n", "recipe.toml:17: [a] max_iter: unknown config key"),
    (
        DATA + "[a]\nkind = 'train'\ndataset = 'd'\n\n[b]\nkind = 'train'\ndataset = 'd'\nout_dir = 'a'\n",
        "recipe.toml:18: [b] and [a] would both write 'a'",
    ),
    ("[r]\nkind = 'rl'\ninit_from = 'nothing'\n", "recipe.toml:3: [r] init_from = 'nothing' must name an earlier"),
    (DATA + "[a]\nkind = 'train'\ndataset = 'd'\nresume = 'never'\n", "recipe.toml:17: [a] resume: the pipeline"),
]


@pytest.mark.parametrize("text,said", BAD, ids=[m.split(": ", 1)[1][:30] for _, m in BAD])
def test_a_bad_recipe_is_named_with_its_line_and_nothing_runs(tmp_path, text, said):
    from gptforge.core.errors import UserError
    from gptforge.pipeline.recipe import read_recipe

    (tmp_path / "recipe.toml").write_text(text)
    with pytest.raises(UserError) as e:
        read_recipe(str(tmp_path / "recipe.toml"))
    assert said in str(e.value)
    if "vocab_sise" in text:
        assert "did you mean vocab_size" in str(e.value)
    if "max_iter =" in text:
        assert "max_iters" in str(e.value)


def test_a_bad_recipe_exits_2_and_writes_nothing(tmp_path):
    (tmp_path / "recipe.toml").write_text("[pipeline]\nout_dir = 'out'\n\n[text]\nsources = ['shakspeare']\n")
    r = run_cli("pipeline", str(tmp_path / "recipe.toml"), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "recipe.toml:5: [text]" in r.stderr and "shakespeare" in r.stderr
    assert not (tmp_path / "out").exists()
    r = run_cli("pipeline", "chat-cpu", "--sft.max_iter=3", cwd=tmp_path)
    assert r.returncode == 2 and "max_iters" in r.stderr and not (tmp_path / "chat-cpu").exists()


def test_dry_run_shows_each_stage_and_its_command_and_runs_nothing(tmp_path, capsys):
    from gptforge.pipeline.options import parse_pipeline_args
    from gptforge.pipeline.run import run_pipeline

    run_pipeline(parse_pipeline_args(["chat-cpu", f"--out_dir={tmp_path / 'p'}", "--dry_run"]))
    out = capsys.readouterr().out
    assert "11 stages" in out and not (tmp_path / "p").exists()
    assert "gptforge train " in out and "--dataset=chat_data" in out and "--init_from=pretrain" in out
    assert "gptforge rl " in out and "--init_from=sft" in out and "gptforge eval chat --out_dir rl" in out


def test_the_dashboard_on_the_pipeline_folder_draws_every_stages_curves(whole, dashboard):
    """`gptforge dashboard FOLDER` on a pipeline folder: its training stages' loss, its RL stage's reward and held-out
    pass@1, each from the run's own metrics.jsonl, in real Chromium."""
    from test_dashboard_browser import need_browser, page_at
    from test_dashboard_rl_browser import TRACES, page_traces

    need_browser()
    out = whole.parent / "out"
    url = dashboard(out)
    with page_at(url + "#runs=pretrain,sft,rl&smooth=0") as page:
        ready = f"() => ['pretrain', 'sft'].every(r => Object.keys(({TRACES})('chart-loss', r)).length > 0)"
        page.wait_for_function(ready, timeout=20_000)
        page.wait_for_function(f"() => Object.keys(({TRACES})('chart-rl-reward', 'rl')).length > 0", timeout=20_000)
        for run in ("pretrain", "sft"):
            losses = [json.loads(x) for x in (out / run / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in losses if r["kind"] == "train"]
            drawn = page_traces(page, "chart-loss", run)
            assert drawn[f"{run} train"]["y"] == pytest.approx([r["loss"] for r in train]), run
        rl = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
        rewards = [r["reward"] for r in rl if r["kind"] == "rl"]
        assert page_traces(page, "chart-rl-reward", "rl")["rl reward"]["y"] == pytest.approx(rewards)
        assert page.locator(".card[data-id='rl'] .badge").inner_text() == "finished"
        page.screenshot(path=str(out / "dashboard.png"), full_page=True)


def test_an_eval_hellaswag_stage_keeps_the_line_its_command_printed(tmp_path):
    from gptforge.pipeline.recipe import read_recipe
    from gptforge.pipeline.stages import command, finish

    recipe = read_recipe("chat-gpu", out_dir=str(tmp_path))
    stage = recipe.stage("hellaswag")
    assert command(stage, {s.name: s for s in recipe.stages})[:4] == ["eval", "hellaswag", "--out_dir", "pretrain"]
    log = tmp_path / "h.log"
    log.write_text("loading\nhellaswag: 10042 examples, acc 0.2950 (2962/10042), acc_norm 0.3013 (3026/10042)\n")
    finish(stage, str(tmp_path), str(log))
    said = json.loads((tmp_path / "hellaswag" / "eval.json").read_text())["hellaswag"]
    assert said == {"n": 10042, "acc": 0.295, "acc_norm": 0.3013}


@pytest.mark.parametrize("stage,config", [("pretrain", "chat_pretrain_cpu.py"), ("sft", "chat_sft_cpu.py")])
def test_chat_cpu_trains_as_the_recipes_config_files_do(stage, config):
    """The built-in chat-cpu recipe's training stages are docs/RECIPES.md's config files, key for key (the folders
    aside): a recipe that drifted from the measured configs would not give their figures."""
    from gptforge.core.config import load_config
    from gptforge.pipeline.recipe import read_recipe
    from gptforge.pipeline.stages import command

    recipe = read_recipe("chat-cpu")
    argv = command(recipe.stage(stage), {s.name: s for s in recipe.stages})[1:]
    ours = dataclasses.asdict(load_config([a for a in argv if not a.startswith("--init_from")]))
    theirs = dataclasses.asdict(load_config([str(ROOT / "config" / config), "--init_from=scratch"]))
    folders = {"out_dir", "dataset", "init_from", "resume"}
    assert {k: v for k, v in ours.items() if k not in folders} == {k: v for k, v in theirs.items() if k not in folders}


def test_chat_cpu_runs_rl_as_its_config_file_does():
    from gptforge.core.config_file import load_settings
    from gptforge.pipeline.recipe import read_recipe
    from gptforge.pipeline.stages import command
    from gptforge.rl.options import RLConfig

    recipe = read_recipe("chat-cpu")
    ours = load_settings(RLConfig, command(recipe.stage("rl"), {s.name: s for s in recipe.stages})[1:], "rl")
    theirs = load_settings(RLConfig, [str(ROOT / "config" / "chat_rl_calculator_cpu.py")], "rl")
    folders = {"out_dir", "init_from"}
    mine = {k: v for k, v in dataclasses.asdict(ours).items() if k not in folders}
    assert mine == {k: v for k, v in dataclasses.asdict(theirs).items() if k not in folders}
