"""RL with the engine's tools on (rl/rollout.py Calls): a call the model writes while its answers are sampled is run
and its output fed to that row; what the row holds then equals the renderer's tokens of the same conversation, and
its weights equal the renderer's loss mask (the tool's output never trained on). The reward reads the text after
the last output, as `eval chat` scores it; a whole run counts the calls and the policy's tokens by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from chat_tools import memorise, tiny_model, write_run
from gptforge.chat.render import chat_special_ids, render, render_prompt
from gptforge.core.config_file import load_settings
from gptforge.infer.toolcalls import CallWatcher, scored_tokens
from gptforge.rl.objective import groups_logprobs, policy_loss
from gptforge.rl.options import RLConfig
from gptforge.rl.rollout import sample_groups
from gptforge.tokenizer.spec import from_spec
from gptforge.tokenizer.specials import role_tokens

QUESTION = "what is 12*34?"
CALL = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}


def conversation(output: str) -> list[dict]:
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c0", "content": output},
        {"role": "assistant", "content": "It is that."},
    ]


@pytest.fixture(scope="module")
def learned():
    """A model that memorised the call and, on purpose, a wrong output after it (the engine's must replace it);
    its tokenizer, special ids, end token and the question's rendered prompt."""
    tok = from_spec({"tokenizer": "gpt2"})
    ids = chat_special_ids(tok)
    model = memorise(tiny_model(block_size=128), [render(conversation("999"), tok, ids)], steps=200)
    prompt = render_prompt(conversation("408")[:1], tok, ids)
    return SimpleNamespace(model=model, tok=tok, ids=ids, end=ids[role_tokens("assistant")[1]], prompt=prompt)


def watcher(tok, tools=frozenset({"calculator"})):
    return lambda: CallWatcher(chat_special_ids(tok), tok.decode, tok.encode, tools)


def test_scored_tokens_keep_the_text_after_the_last_tool_output():
    tok = from_spec({"tokenizer": "gpt2"})
    ids = chat_special_ids(tok)
    full, _ = render(conversation("408"), tok, ids)
    prompt = render_prompt(conversation("408")[:1], tok, ids)
    answer = full[len(prompt) : full.index(ids[role_tokens("assistant")[1]], len(prompt))]
    assert tok.decode(scored_tokens(answer, ids)) == "It is that."
    assert scored_tokens(tok.encode("no call here"), ids) == tok.encode("no call here")


def test_a_sampled_call_is_run_and_the_row_equals_the_rendered_conversation(learned):
    """Greedy rows of two groups: the call, the calculator's 408 (not the memorised 999), the text, the end; the
    weights are the renderer's SFT mask: 0 on the tool's output, 1 on what the model wrote."""
    model, tok, ids, end, prompt = learned.model, learned.tok, learned.ids, learned.end, learned.prompt
    full, mask = render(conversation("408"), tok, ids)
    expected = full[len(prompt) : full.index(end, len(prompt)) + 1]
    groups = sample_groups(
        model, [prompt, prompt], 2, 60, end, [torch.Generator().manual_seed(s) for s in (1, 2)], 0.0,
        watch=watcher(tok),
    )  # fmt: skip
    for group in groups:
        assert group.calls == [1, 1] and bool(group.ended.all())
        for row in range(2):
            assert group.tokens[row].tolist() == expected
            assert group.weights[row].tolist() == [float(m) for m in mask[len(prompt) : len(prompt) + len(expected)]]
            assert tok.decode(scored_tokens(group.answer(row), ids)) == "It is that."
    assert 0.0 in groups[0].weights[0].tolist()  # the output is there, unweighted


def test_the_tools_output_gets_no_gradient(learned):
    model, tok, end, prompt = learned.model, learned.tok, learned.end, learned.prompt
    (group,) = sample_groups(model, [prompt], 2, 60, end, [torch.Generator().manual_seed(0)], 1.0, watch=watcher(tok))
    logp = groups_logprobs(model, [prompt], [group.tokens])[0].detach().requires_grad_()
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), group.weights, 10.0, 0.2, None, 0.0)
    loss.backward()
    assert (logp.grad[group.weights == 0] == 0).all() and (logp.grad[group.weights == 1] != 0).any()


def test_tools_none_feeds_the_error_text(learned):
    model, tok, ids, end, prompt = learned.model, learned.tok, learned.ids, learned.end, learned.prompt
    (group,) = sample_groups(
        model, [prompt], 2, 80, end, [torch.Generator().manual_seed(0)], 0.0, watch=watcher(tok, frozenset())
    )
    start = group.tokens[0].tolist().index(ids["<|tool_output_start|>"])
    output = group.tokens[0].tolist()[start + 1 : group.tokens[0].tolist().index(ids["<|tool_output_end|>"])]
    assert tok.decode(output) == "error: there is no tool named 'calculator'"


def test_a_run_rewards_the_text_after_the_call_and_counts_the_policys_tokens(learned, tmp_path):
    """One greedy step: every answer calls, is right, and writes the renderer's masked tokens (a hand count)."""
    from gptforge.rl.loop import rl

    tok = learned.tok
    run = write_run(tmp_path / "sft", learned.model, tok.spec(), chat=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": conversation("")[:1], "answer": "It is that."}) + "\n")
    settings = {"init_from": run, "out_dir": tmp_path / "out", "prompts": prompts, "max_steps": 1, "temperature": 0}
    settings.update(prompts_per_step=1, num_generations=2, max_completion_length=60, device="cpu", dtype="float32")
    rl(load_settings(RLConfig, [f"--{k}={v}" for k, v in settings.items()], "rl"))
    record = next(json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").open() if '"kind": "rl"' in x)
    full, mask = render(conversation("408"), tok, learned.ids)
    assert (record["reward"], record["tool_calls"]) == (1.0, 1.0)
    assert record["answer_tokens"] == sum(mask)
