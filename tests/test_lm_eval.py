"""`gptforge eval lm-eval`: lm-evaluation-harness on a run, against lm-eval's own Hugging Face model on the run's
`gptforge export` folder (the same per-example log-likelihoods, rolling log-likelihoods and generations), against
`gptforge eval hellaswag` on the same rendering, registered for lm-eval's Python API, and its exit-2 errors.

The tasks are local YAMLs over ../shared/data (lm-eval's offline route): HellaSwag as lm-eval's own task
preprocesses it (its process_docs), HellaSwag rendered as build-nanogpt does, a perplexity task and a generation
task over Tiny Shakespeare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HELLASWAG_VAL, SHAKESPEARE, TIKTOKEN_CACHE, need_shared, run_cli, tiny_train_args, train_in_process
from test_modern import ALL_ON

LIMIT = 12


def hellaswag_yaml(task: str, text: str, choices: str, more: str = "") -> str:
    """A multiple-choice task over the local hellaswag_val.jsonl (acc and acc_norm, as lm-eval's own task)."""
    metrics = "".join(f"  - {{metric: {m}, aggregation: mean, higher_is_better: true}}\n" for m in ("acc", "acc_norm"))
    return (
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: @HELLASWAG@\n"
        f"output_type: multiple_choice\nvalidation_split: validation\n{more}"
        f'doc_to_text: "{text}"\ndoc_to_target: "{{{{label}}}}"\ndoc_to_choice: "{choices}"\nmetric_list:\n{metrics}'
    )


# lm-eval's own hellaswag task, over the local file: its process_docs (query, choices)
HELLASWAG_YAML = hellaswag_yaml(
    "hellaswag_local", "{{query}}", "choices", "process_docs: !function utils.process_docs\n"
)
# build-nanogpt's rendering (gptforge eval hellaswag): the raw ctx, each ending after a space, no preprocessing
COMPLETION_YAML = hellaswag_yaml("hellaswag_completion", "{{ctx}}", "endings")
PERPLEXITY_YAML = """task: shakespeare_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: @DOCS@
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GENERATION_YAML = """task: shakespeare_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: @DOCS@
output_type: generate_until
test_split: test
doc_to_text: "{{text[:120]}}"
doc_to_target: "{{text[120:160]}}"
generation_kwargs:
  until: ["Exeunt"]
  max_gen_toks: 20
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Task YAMLs, a GPT-2 BPE Tiny Shakespeare dataset, and two short runs (GPT-2-shaped and the modern recipe)
    with block_size 256 (HellaSwag's rows fit: no truncation), each exported to a Hugging Face folder. Prepared,
    trained and exported in this process: these tests are about lm-eval, not those commands."""
    from gptforge.data.prepare import prepare
    from gptforge.weights.export import export_run

    hellaswag, shakespeare = need_shared(HELLASWAG_VAL), need_shared(SHAKESPEARE)
    need_shared(TIKTOKEN_CACHE)
    root = tmp_path_factory.mktemp("lm_eval")
    tasks = root / "tasks"
    tasks.mkdir()
    text = shakespeare.read_text(encoding="utf-8")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as fh:
        for start in range(0, 6 * 1500, 1500):
            fh.write(json.dumps({"text": text[start : start + 1400]}) + "\n")
    fill = {"@HELLASWAG@": str(hellaswag), "@DOCS@": str(root / "docs.jsonl")}
    for name, body in (
        ("hellaswag_local.yaml", HELLASWAG_YAML),
        ("hellaswag_completion.yaml", COMPLETION_YAML),
        ("shakespeare_perplexity.yaml", PERPLEXITY_YAML),
        ("shakespeare_continue.yaml", GENERATION_YAML),
    ):
        for key, value in fill.items():
            body = body.replace(key, value)
        (tasks / name).write_text(body)
    (tasks / "utils.py").write_text("from lm_eval.tasks.hellaswag.utils import process_docs  # lm-eval's own\n")
    prepare("shakespeare", data_dir=str(root / "data"), input_path=str(shakespeare))
    shape = dict(dataset="shakespeare", block_size=256, batch_size=4, max_iters=10, eval_interval=10, eval_iters=2)
    for run, switches in (("gpt2", {}), ("modern", {**ALL_ON, "zero_init": False, "optimizer": "muon"})):
        train_in_process(*tiny_train_args(root / "data", root / run, **shape, **switches))
        export_run(str(root / run), None, str(root / (run + "-hf")), "f16", force=False)
    return root


# the tasks each run is scored on by both tools, in one process per tool and run
TASKS = {"gpt2": "hellaswag_local,shakespeare_perplexity,shakespeare_continue", "modern": "hellaswag_local"}


@pytest.fixture(scope="module")
def evaluated(work):
    """evaluated(run): (gptforge eval lm-eval's results, lm-eval's own model's samples by task and doc_id) on
    TASKS[run], each tool run once per run and kept for the tests that compare them."""
    done = {}

    def get(run: str) -> tuple[dict, dict]:
        if run not in done:
            done[run] = ours(work, run, TASKS[run]), theirs(work, run, TASKS[run])
        return done[run]

    return get


def ours(work: Path, run: str, tasks: str, *more: str) -> dict:
    out = work / f"ours-{run}-{tasks.replace(',', '-')}.json"
    r = run_cli(
        "eval", "lm-eval", f"--out_dir={work / run}", f"--tasks={tasks}", f"--include_path={work / 'tasks'}",
        f"--limit={LIMIT}", "--batch_size=3", "--device=cpu", "--dtype=float32", "--log_samples",
        f"--output_path={out}", *more, cwd=work,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for task in tasks.split(","):
        assert f"|{task}" in r.stdout.replace(" ", ""), r.stdout  # lm-eval's table
    return json.loads(out.read_text())


def theirs(work: Path, run: str, tasks: str) -> dict:
    """lm-eval's own Hugging Face model (`--model hf`) on the run's export folder; its samples by task, by doc_id."""
    args = f"pretrained={work / (run + '-hf')},dtype=float32"
    return lm_evals_own(work, "hf", args, tasks, LIMIT, device="cpu", batch_size=4)


# What lm-eval's command line runs (simple_evaluate), with a task manager that indexes the tasks' folder alone: its
# own ~14,700 task files take seconds to index in every process, and none of them is evaluated here.
LM_EVALS_OWN = """
import json, sys
import lm_eval, lm_eval.evaluator
from lm_eval.tasks import TaskManager
lm_eval.evaluator.add_env_info = lambda results: None  # torch's collect_env (`pip list`, ~2 s), never compared here
a = json.loads(sys.argv[1])
manager = TaskManager(include_path=a.pop("include_path"), include_defaults=False)
r = lm_eval.simple_evaluate(task_manager=manager, log_samples=True, **a)
samples = {task: {row["doc_id"]: row for row in rows} for task, rows in r["samples"].items()}
print(json.dumps(samples, default=str))
"""


def lm_evals_own(work: Path, model: str, model_args: str, tasks: str, limit: int, env=None, **more) -> dict:
    """lm-eval's own evaluation of `model` (its Python API, as its command line calls it, in a process of its own)
    on the tasks in work/tasks: its samples by task, by doc_id (a row as its --log_samples files hold it)."""
    a = dict(model=model, model_args=model_args, tasks=tasks.split(","), limit=limit, **more)
    r = subprocess.run(
        [sys.executable, "-c", LM_EVALS_OWN, json.dumps({**a, "include_path": str(work / "tasks")})],
        capture_output=True, text=True, cwd=work, timeout=900, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.splitlines()[-1])
    return {task: {int(doc): row for doc, row in rows.items()} for task, rows in found.items()}


def by_doc(results: dict, task: str) -> dict:
    return {row["doc_id"]: row for row in results["samples"][task]}


@pytest.mark.parametrize("run", ["gpt2", "modern"])
def test_log_likelihoods_equal_lm_evals_hf_model_on_the_export(evaluated, run):
    """HellaSwag as lm-eval's task renders it: every choice's log-likelihood and greedy flag, and acc/acc_norm."""
    task = "hellaswag_local"
    results, samples = evaluated(run)
    mine, hf = by_doc(results, task), samples[task]
    assert sorted(mine) == sorted(hf) == list(range(LIMIT))
    for doc_id, row in mine.items():
        a, b = row["resps"], hf[doc_id]["resps"]
        assert len(a) == len(b) == 4
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip([x[0] for x in a], [x[0] for x in b], strict=True):
            assert float(ll_a) == pytest.approx(float(ll_b), abs=2e-4), (doc_id, ll_a, ll_b)
            assert str(greedy_a) == str(greedy_b)
        assert (row["acc"], row["acc_norm"]) == (hf[doc_id]["acc"], hf[doc_id]["acc_norm"]), doc_id


def test_rolling_log_likelihoods_and_generations_equal_lm_evals_hf_model(evaluated):
    """The two other kinds of request: a text's perplexity over several block_size windows, greedy generation."""
    results, samples = evaluated("gpt2")
    for task in ("shakespeare_perplexity", "shakespeare_continue"):
        mine, hf = by_doc(results, task), samples[task]
        assert sorted(mine) == sorted(hf) and len(mine) == 6
        for doc_id, row in mine.items():
            a, b = row["resps"][0][0], hf[doc_id]["resps"][0][0]
            if task == "shakespeare_perplexity":
                assert float(a) == pytest.approx(float(b), abs=1e-3), (doc_id, a, b)  # a sum over ~400 tokens
                assert float(a) < 0
            else:
                assert a == b and a, (doc_id, a, b)


def test_lm_evals_acc_equals_gptforge_hellaswag_on_the_same_rendering(work):
    """build-nanogpt's rendering through lm-eval: acc (summed log-likelihood) is `gptforge eval hellaswag`'s acc,
    example for example. The acc_norms differ by definition: gptforge's divides by the ending's tokens, lm-eval's
    by its characters; each recomputed from lm-eval's per-choice log-likelihoods gives each tool's figure."""
    from gptforge.tokenizer.gpt2 import GPT2Tokenizer

    n, task = 60, "hellaswag_completion"
    results = ours(work, "gpt2", task, f"--limit={n}")
    r = run_cli(
        "eval", "hellaswag", f"--out_dir={work / 'gpt2'}", f"--limit={n}", f"--hellaswag_path={HELLASWAG_VAL}",
        "--device=cpu", "--dtype=float32", cwd=work,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    counts = [int(x.split("/")[0].strip("(")) for x in r.stdout.split() if "/" in x]  # acc, acc_norm counts
    rows = by_doc(results, task)
    tok = GPT2Tokenizer()
    acc = acc_tokens = acc_chars = 0
    for row in rows.values():
        lls = [float(x[0][0]) for x in row["resps"]]
        endings, label = row["doc"]["endings"], int(row["doc"]["label"])
        per_token = [ll / len(tok.encode(" " + e)) for ll, e in zip(lls, endings, strict=True)]
        per_char = [ll / len(e) for ll, e in zip(lls, endings, strict=True)]  # the choice's characters, no space
        acc += max(range(4), key=lambda i: lls[i]) == label
        acc_tokens += max(range(4), key=lambda i: per_token[i]) == label
        acc_chars += max(range(4), key=lambda i: per_char[i]) == label
    lm_eval_acc = results["results"][task]
    assert acc == round(lm_eval_acc["acc,none"] * n) == counts[0]
    assert acc_tokens == counts[1]  # gptforge's acc_norm
    assert acc_chars == round(lm_eval_acc["acc_norm,none"] * n)  # lm-eval's acc_norm


def test_lm_evals_python_api_takes_model_gptforge(work):
    code = (
        "import json, lm_eval; from lm_eval.tasks import TaskManager; import gptforge.evaluate.harness_model;"
        f"r = lm_eval.simple_evaluate(model='gptforge', model_args='ckpt={work / 'gpt2' / 'ckpt.pt'},device=cpu',"
        f" tasks=['hellaswag_local'], limit=4,"
        f" task_manager=TaskManager(include_path='{work / 'tasks'}', include_defaults=False));"
        "print(json.dumps(r['results']['hellaswag_local']['acc,none']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=work, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 0.0 <= float(r.stdout.strip().splitlines()[-1]) <= 1.0


def test_tasks_all_in_include_path_index_that_folder_alone(work, tmp_path):
    """Tasks all in --include_path: lm-eval's own ~14,700 task files are not indexed (the evaluations above take
    this route and equal lm-eval's own model). A group there, which may list lm-eval's tasks, takes both folders."""
    from gptforge.evaluate.harness import task_manager_for

    local = task_manager_for(["hellaswag_local", "shakespeare_perplexity"], str(work / "tasks"))
    assert {"hellaswag_local", "shakespeare_perplexity"} <= set(local.all_tasks)
    assert "arc_easy" not in local.all_tasks
    folder = tmp_path / "tasks"
    folder.mkdir()
    for name in ("hellaswag_local.yaml", "utils.py"):
        (folder / name).write_text((work / "tasks" / name).read_text())
    (folder / "mixed.yaml").write_text("group: mixed\ntask:\n  - hellaswag_local\n  - arc_easy\n")
    both = task_manager_for(["hellaswag_local", "mixed"], str(folder))
    assert {"hellaswag_local", "mixed", "arc_easy"} <= set(both.all_tasks)


def test_clear_errors(work, char_data, tmp_path):
    base = ("eval", "lm-eval", f"--out_dir={work / 'gpt2'}", "--device=cpu")
    r = run_cli(*base, "--tasks=hellaswag_lokal", f"--include_path={work / 'tasks'}", cwd=tmp_path)
    assert r.returncode == 2 and "'hellaswag_lokal' is not a task" in r.stderr, r.stderr
    assert "did you mean hellaswag_local" in r.stderr and "Traceback" not in r.stderr
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = run_cli(*base, "--tasks=hellaswag", "--limit=2", cwd=tmp_path, env=offline)
    assert r.returncode == 2 and "--include_path" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    shim = tmp_path / "no_lm_eval"
    shim.mkdir()
    (shim / "lm_eval.py").write_text("raise ImportError('No module named lm_eval')\n")
    path = os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])
    r = run_cli(*base, "--tasks=hellaswag", cwd=tmp_path, env={"PYTHONPATH": path})
    assert r.returncode == 2 and "pip install 'gptforge[eval]'" in r.stderr, r.stderr
    train_in_process(*tiny_train_args(char_data, tmp_path / "char", max_iters=2))  # a run to score
    # a checkpoint that cannot be scored is named before the tasks are looked up (here a misspelt one as well)
    r = run_cli("eval", "lm-eval", f"--out_dir={tmp_path / 'char'}", "--tasks=hellaswag_lokal", cwd=tmp_path)
    assert r.returncode == 2 and "character vocabulary" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli(*base, "--tasks=hellaswag_lokal", "--apply_chat_template", cwd=tmp_path)  # GPT-2's shape: a base model
    assert r.returncode == 2 and "--apply_chat_template" in r.stderr and "is a base model" in r.stderr, r.stderr
    for option, message in (("--limit=0", "--limit must be positive"), ("--batch_size=0", "--batch_size must")):
        r = run_cli(*base, "--tasks=hellaswag", option, cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr, r.stderr
