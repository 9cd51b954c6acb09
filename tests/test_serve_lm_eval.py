"""Evaluation through the API: lm-eval's own `local-completions` pointed at `gptforge serve` scores a log-likelihood
task (HellaSwag, through /v1/completions with echo + logprobs, tokenized by the server's /tokenize) and a generation
task as `gptforge eval lm-eval` does on the same run, example for example; `local-chat-completions` with
--apply_chat_template equals `gptforge eval lm-eval --apply_chat_template` on a chat model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_tools import MEMORISED, ONE_THREAD, Server, base_run, chat_run
from conftest import HELLASWAG_VAL, SHAKESPEARE, TIKTOKEN_CACHE, need_shared, run_cli
from test_lm_eval import COMPLETION_YAML, GENERATION_YAML, lm_evals_own

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
LIMIT = 6
CHAT_YAML = """task: memorised_chat
dataset_path: json
dataset_kwargs:
  data_files:
    test: @CHAT@
output_type: generate_until
test_split: test
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["@@@"]
  max_gen_toks: 40
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    hellaswag, shakespeare = need_shared(HELLASWAG_VAL), need_shared(SHAKESPEARE)
    need_shared(TIKTOKEN_CACHE)
    root = tmp_path_factory.mktemp("api_eval")
    (root / "tasks").mkdir()
    text = shakespeare.read_text(encoding="utf-8")
    (root / "docs.jsonl").write_text(
        "".join(json.dumps({"text": text[i : i + 1400]}) + "\n" for i in range(0, 9000, 1500))
    )
    (root / "chat.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in MEMORISED.items())
    )
    fill = {"@HELLASWAG@": str(hellaswag), "@DOCS@": str(root / "docs.jsonl"), "@CHAT@": str(root / "chat.jsonl")}
    for name, body in (
        ("hellaswag_completion", COMPLETION_YAML),
        ("shakespeare_continue", GENERATION_YAML),
        ("memorised_chat", CHAT_YAML),
    ):
        for key, value in fill.items():
            body = body.replace(key, value)
        (root / "tasks" / f"{name}.yaml").write_text(body)
    base_run(root / "base", block_size=256)
    chat_run(root / "chat")
    return root


def ours(work: Path, run: str, tasks: str, *more: str) -> dict:
    out = work / f"ours-{run}.json"
    r = run_cli(
        "eval",
        "lm-eval",
        f"--out_dir={work / run}",
        f"--tasks={tasks}",
        f"--include_path={work / 'tasks'}",
        f"--limit={LIMIT}",
        "--device=cpu",
        "--dtype=float32",
        "--log_samples",
        f"--output_path={out}",
        *more,
        cwd=work,
        env=ONE_THREAD,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {task: {row["doc_id"]: row for row in rows} for task, rows in json.loads(out.read_text())["samples"].items()}


def test_local_completions_through_serve_equal_gptforge_eval_lm_eval(work):
    tasks = "hellaswag_completion,shakespeare_continue"
    server = Server(f"--out_dir={work / 'base'}", "--name=base")
    try:
        args = f"base_url={server.url}/v1/completions,model=base,num_concurrent=2,max_length=256,max_retries=1"
        api = lm_evals_own(work, "local-completions", args, tasks, LIMIT, env=ONE_THREAD)
    finally:
        server.stop()
    assert "tokenizer_info" not in "".join(server.log)  # (no errors logged)
    mine = ours(work, "base", tasks)
    for doc, row in mine["hellaswag_completion"].items():  # every choice: the log-likelihood and the greedy flag
        theirs = api["hellaswag_completion"][doc]
        for (ll, greedy), (ll2, greedy2) in zip(row["filtered_resps"], theirs["filtered_resps"], strict=True):
            assert float(ll) == pytest.approx(float(ll2), abs=2e-4) and str(greedy) == str(greedy2)
        assert row["acc"] == theirs["acc"] and row["acc_norm"] == theirs["acc_norm"]
    for doc, row in mine["shakespeare_continue"].items():
        assert row["filtered_resps"] == api["shakespeare_continue"][doc]["filtered_resps"]


def test_local_chat_completions_with_the_chat_template_equal_gptforge_eval_lm_eval(work):
    server = Server(f"--out_dir={work / 'chat'}", "--name=chat")
    try:
        args = f"base_url={server.url}/v1/chat/completions,model=chat,num_concurrent=1"
        api = lm_evals_own(
            work, "local-chat-completions", args, "memorised_chat", LIMIT, env=ONE_THREAD, apply_chat_template=True
        )
    finally:
        server.stop()
    mine = ours(work, "chat", "memorised_chat", "--apply_chat_template")["memorised_chat"]
    assert {d: r["filtered_resps"] for d, r in mine.items()} == {
        d: r["filtered_resps"] for d, r in api["memorised_chat"].items()
    }
    assert all(r["exact_match"] == 1.0 for r in mine.values()), mine  # the memorised answers, in the chat format
    r = run_cli(
        "eval",
        "lm-eval",
        f"--out_dir={work / 'base'}",
        "--tasks=memorised_chat",
        "--apply_chat_template",
        f"--include_path={work / 'tasks'}",
        cwd=work,
        env=ONE_THREAD,
    )
    assert r.returncode == 2 and "--apply_chat_template" in r.stderr and "Traceback" not in r.stderr
