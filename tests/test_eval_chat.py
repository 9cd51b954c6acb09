"""`gptforge eval chat`: a chat model's exact match on held-out synthetic problems, through the real CLI. The model
memorises the answers of the very problems the command draws (two right, one wrong, per kind), so the expected
scores are known exactly: 2/3 per kind, and every answer ends with the end token."""

from __future__ import annotations

import pytest

from chat_tools import base_run, memorise, one_thread, tiny_model, write_run  # noqa: F401  (one_thread: a fixture)
from conftest import run_cli
from gptforge.chat.render import chat_special_ids, render, render_prompt
from gptforge.chat.synthetic import generate
from gptforge.tokenizer.spec import from_spec

KINDS = ["add3", "recall"]
SEED = 7


@pytest.fixture(scope="module")
def memorised_run(tmp_path_factory):
    """A chat model that answers the 3 held-out problems per kind the command draws (seed SEED): the first two of
    each kind with the right answer, the third with a wrong one."""
    tok = from_spec({"tokenizer": "gpt2"})
    special = chat_special_ids(tok)
    rows = []
    problems = generate(3 * len(KINDS), SEED, "held_out", kinds=KINDS)  # what eval chat draws, in its order
    for i, problem in enumerate(problems):
        answer = problem.answer if i < 2 * len(KINDS) else problem.answer + "0"
        messages = [{"role": m.role, "content": m.content} for m in problem.prompt]
        rows.append(render([*messages, {"role": "assistant", "content": answer}], tok, special))
    model = memorise(tiny_model(block_size=256, seed=1), rows, steps=400)
    return write_run(tmp_path_factory.mktemp("memorised"), model, tok.spec(), chat=True)


def test_eval_chat_scores_exact_matches(memorised_run, tiktoken_cache):
    r = run_cli(
        "eval", "chat", f"--out_dir={memorised_run}", f"--kinds={','.join(KINDS)}", "--examples=3", f"--seed={SEED}",
        "--device=cpu",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "add3     exact match 0.667 (3 held-out problems), tool calls 0.000"
    assert lines[1] == "recall   exact match 0.667 (3 held-out problems), tool calls 0.000"
    assert lines[2] == "all      exact match 0.667; answers ending with the end token 1.000"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kinds=add3,nope"], "--kinds 'add3,nope': unknown kind(s) ['nope']"),
        (["--examples=0"], "--examples 0: give a positive number"),
        (["--max_new_tokens=-1"], "--max_new_tokens -1: give a positive number"),
    ],
)
def test_bad_options_exit_2(memorised_run, args, message):
    r = run_cli("eval", "chat", f"--out_dir={memorised_run}", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_a_base_model_is_refused(tmp_path, tiktoken_cache):
    r = run_cli("eval", "chat", f"--out_dir={base_run(tmp_path / 'base')}", "--device=cpu")
    assert r.returncode == 2 and "is a base model: eval chat needs a chat model" in r.stderr


@pytest.mark.parametrize("trained", [True, False], ids=["memorised", "random"])
def test_batched_answers_equal_one_prompt_at_a_time(trained):
    """eval chat answers all its problems through the serving engine's continuous batching: each answer (its scored
    tokens, whether it ended, its calls) equals the one-row engine's on the same prompt, with the calculator and the
    synthetic functions run and without tools, with answers that end, that run to max_new_tokens and that reach the
    context's end."""
    from eval_reference import one_row_answer
    from gptforge.chat.tools import EXAMPLE_FUNCTIONS
    from gptforge.evaluate.chat import greedy_answers
    from gptforge.infer.chat_model import in_memory
    from gptforge.infer.toolcalls import CallWatcher
    from gptforge.tokenizer.specials import role_tokens

    tok = from_spec({"tokenizer": "gpt2"})
    special = chat_special_ids(tok)
    problems = generate(12, 5, "held_out", kinds=["mul", "convert", "spell", "count"], tools="calculator")
    rows = [render(p.conversation(), tok, special) for p in problems[:6]]
    model = tiny_model(block_size=192, seed=3)
    model = memorise(model, rows, steps=300) if trained else model
    lm = in_memory(model, tok, "cpu", "float32", "m", chat=True)
    prompts = [render_prompt(p.prompt, tok, special, tools=p.tools) for p in problems]
    runners = {name: run for name, (_, run) in EXAMPLE_FUNCTIONS.items()}
    end = special[role_tokens("assistant")[1]]
    # a random model's answers never end: the convert prompts' (88 tokens) reach the context's end, the others 128
    for tools, limit in ((frozenset({"calculator"}), 128), (None, 128), (frozenset({"calculator"}), 9)):
        batched = greedy_answers(lm, prompts, limit, tools)
        for prompt, got in zip(prompts, batched, strict=True):
            watcher = None if tools is None else CallWatcher(special, tok.decode, tok.encode, tools, runners=runners)
            room = min(limit, lm.block_size - len(prompt))
            assert got == one_row_answer(model, prompt, room, lm.stop_ids, end, lm.vocab, watcher)
        if trained and limit == 128:
            assert sum(ended for _, ended, _ in batched) >= 6 and sum(calls for *_, calls in batched) >= 3 * bool(tools)
