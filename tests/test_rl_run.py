"""`gptforge rl` as a user runs it: a run killed with -9 and run again equals the uninterrupted run bit for bit, two
torchrun processes equal one, its records, and bad inputs (exit 2, a message naming the flag or file, nothing
written). A tiny memorised chat model (chat_tools.py) on prompts and a reward of its own, so answers differ in
reward from the first step."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chat_tools import MEMORISED, ONE_THREAD, SYSTEM, base_run, chat_run
from conftest import run_cli

REWARD = """
def length(prompt, answer, example):
    return (len(answer) % 3) / 2.0

def boom(prompt, answer, example):
    if answer:
        raise ValueError("cannot score " + answer[:5])
    return 0.0

def nan(prompt, answer, example):
    return float("nan") if answer else 0.0

def always_raises(prompt, answer, example):
    raise KeyError("expected")
"""
PROMPTS = [
    {"messages": [{"role": "user", "content": "hi"}], "answer": "Hello!"},
    {"messages": [{"role": "user", "content": "what is 2+3?"}], "answer": "5"},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}], "answer": "Hi"},
    {"messages": [{"role": "user", "content": "tell me a story"}], "answer": "The end."},
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rl")
    chat_run(root / "sft")
    base_run(root / "base")
    (root / "reward.py").write_text(REWARD)
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


def args(root: Path, out: Path, **overrides) -> list[str]:
    settings = {
        "init_from": root / "sft",
        "out_dir": out,
        "prompts": root / "prompts.jsonl",
        "reward": f"{root / 'reward.py'}:length",
        "max_steps": 6,
        "prompts_per_step": 2,
        "num_generations": 4,
        "max_completion_length": 10,
        "ckpt_interval": 2,
        "learning_rate": 1e-2,
        "dtype": "float32",
        "device": "cpu",
        **overrides,
    }
    return ["rl", *(f"--{k}={v}" for k, v in settings.items())]


def states(out: Path) -> dict:
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    return {"model": ckpt["model"], "optimizer": ckpt["optimizer"]["state"], "step": ckpt["rl"]["step"]}


def records(out: Path) -> list[dict]:
    moving = {"time", "step_s", "eta_s", "sampled_tokens_per_s"}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in moving} for r in lines]


def same(a: dict, b: dict) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_killed_with_minus_9_and_run_again_equals_the_uninterrupted_run(inputs, tmp_path):
    whole = tmp_path / "whole"
    r = run_cli(*args(inputs, whole), env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert "step 5: reward" in r.stdout and "step 6: done (max_steps reached)" in r.stdout
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "gptforge", *map(str, args(inputs, killed))]
    rng = random.Random(0)
    for seen in ("step 1: reward", "step 4: reward"):  # then a random moment: sampling or the update of a step
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})
        for line in proc.stdout:
            if line.startswith(seen):
                time.sleep(rng.uniform(0.0, 0.3))
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    r = run_cli(*args(inputs, killed), env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert "resuming the RL run" in r.stdout
    assert same(states(whole), states(killed))
    assert records(whole) == records(killed)  # metrics.jsonl: each step once, as the uninterrupted run wrote it
    r = run_cli(*args(inputs, killed), env=ONE_THREAD)  # finished: says so, changes nothing
    assert r.returncode == 0 and "step 6: done" in r.stdout and same(states(whole), states(killed))


def test_two_processes_equal_one(inputs, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    settings = {"max_steps": 2, "ckpt_interval": 2}
    assert run_cli(*args(inputs, one, **settings), env=ONE_THREAD).returncode == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptforge"]
    r = subprocess.run(
        [*cmd, *map(str, args(inputs, two, **settings))], capture_output=True, text=True, timeout=240,
        env={**os.environ, **ONE_THREAD},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = states(one), states(two)
    for name in a["model"]:
        assert torch.allclose(a["model"][name], b["model"][name], rtol=1e-5, atol=1e-6), name
    one_records, two_records = records(one), records(two)
    assert [r["kind"] for r in one_records] == [r["kind"] for r in two_records]  # one log, rank 0's
    assert [r.get("reward") for r in one_records] == [r.get("reward") for r in two_records]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"init_from": "{root}/base"}, "--init_from={root}/base is a base model: RL improves a chat model"),
        ({"init_from": "{root}/none"}, "--init_from={root}/none: neither a run's ckpt.pt nor a Hugging Face model"),
        ({"reward": "{root}/missing.py:length"}, "--reward={root}/missing.py:length: no such file"),
        ({"reward": "{root}/reward.py:lenght"}, "has no function 'lenght' (it has: always_raises, boom, length, nan)"),
        ({"reward": "{root}/reward.py:always_raises"}, "the reward raised KeyError: 'expected'\n  scoring the answer"),
        ({"reward": "{root}/reward.py"}, "--reward must be FILE.py:FUNCTION"),
        ({"reward": ""}, "prompts.jsonl:1: no 'answer' to compare with"),
        ({"num_generations": 1}, "--num_generations must be at least 2"),
        ({"prompts_per_step": 0}, "--prompts_per_step must be a positive integer"),
        ({"max_step": 3}, "unknown key 'max_step'; did you mean max_steps"),
        ({"prompts": "{root}/nothing.jsonl"}, "--prompts={root}/nothing.jsonl: no such file"),
        ({"eval_prompts": "{root}/nothing.jsonl"}, "--eval_prompts={root}/nothing.jsonl: no such file"),
    ],
)
def test_bad_inputs_exit_2_naming_the_flag_and_write_nothing(inputs, tmp_path, capsys, overrides, message):
    from gptforge.cli.main import main

    if overrides.get("reward") == "":
        (tmp_path / "bare.jsonl").write_text(json.dumps({"messages": PROMPTS[0]["messages"]}) + "\n")
        overrides = {**overrides, "prompts": tmp_path / "bare.jsonl"}
        message = f"{tmp_path}/bare.jsonl:1: no 'answer' to compare with"
    out = tmp_path / "out"
    given = {k: str(v).format(root=inputs) for k, v in overrides.items()}
    with pytest.raises(SystemExit) as done:
        main(args(inputs, out, **given))
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert message.format(root=inputs) in err, err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("reward, said", [("boom", "the reward raised ValueError: cannot score"), ("nan", "nan, not")])
def test_a_reward_failing_on_an_answer_stops_the_run_with_the_example(inputs, tmp_path, reward, said):
    r = run_cli(*args(inputs, tmp_path / "out", reward=f"{inputs / 'reward.py'}:{reward}"), env=ONE_THREAD)
    assert r.returncode == 2 and said in r.stderr and "scoring the answer" in r.stderr and "Traceback" not in r.stderr


def test_eval_prompts_are_answered_greedily_and_scored_by_the_reward(inputs, tmp_path):
    """A held-out prompts file: the memorised model's greedy answers, scored by exact match: 3 of these 4 (a hand
    count) before the first update; pass@G from sampled answers beside it."""
    from gptforge.cli.main import main

    held_out = [
        {"messages": [{"role": "user", "content": "hi"}], "answer": MEMORISED["hi"]},
        {"messages": [{"role": "user", "content": "what is 2+3?"}], "answer": MEMORISED["what is 2+3?"]},
        {"messages": [{"role": "user", "content": "tell me a story"}], "answer": "not the story it knows"},
        {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
            "answer": MEMORISED["hi"],
        },
    ]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(p) + "\n" for p in held_out))
    out = tmp_path / "out"
    settings = {"reward": "", "eval_prompts": tmp_path / "held_out.jsonl", "max_steps": 1, "eval_interval": 1}
    with pytest.raises(SystemExit) as done:
        main(args(inputs, out, **settings, eval_pass_k=2, max_completion_length=40))
    assert done.value.code == 0
    first = next(r for r in records(out) if r["kind"] == "rl_eval")
    assert first["step"] == 0 and first["pass_at_1"] == 0.75 and first["ended"] == 1.0
    assert 0.0 <= first["sampled_pass_at_1"] <= first["pass_at_4"] <= 1.0


def test_a_hugging_face_chat_folder_is_a_start_and_the_result_is_a_chat_run(inputs, tmp_path):
    """An exported chat model (gptforge export: config.json, model.safetensors, the chat template) starts an RL run;
    its checkpoint is a chat model that eval chat reads; an exported base model is refused."""
    from gptforge.cli.main import main
    from gptforge.evaluate.chat import eval_chat
    from gptforge.weights.export import export_run

    export_run(str(inputs / "sft"), None, str(tmp_path / "hf-chat"), "f16", False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(args(inputs, out, init_from=tmp_path / "hf-chat", max_steps=1))
    assert done.value.code == 0 and (out / "ckpt.pt").is_file()
    result = eval_chat(str(out), None, "resume", "count", 2, 8, 0, "cpu", "float32", "none")
    assert result["n"] == 2
    export_run(str(inputs / "base"), None, str(tmp_path / "hf-base"), "f16", False)
    with pytest.raises(SystemExit) as done:
        main(args(inputs, tmp_path / "out2", init_from=tmp_path / "hf-base"))
    assert done.value.code == 2 and not (tmp_path / "out2").exists()


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_the_same_command_continues(inputs, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "gptforge", *map(str, args(inputs, out, max_steps=40, ckpt_interval=100))]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})
    for line in proc.stdout:
        if line.startswith("step 2: reward"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 0 and "stopped at step" in rest and "run the same command to continue" in rest
    stopped = states(out)["step"]
    assert 3 <= stopped < 40  # the step in progress finished, then the checkpoint (not due by ckpt_interval)
    r = run_cli(*args(inputs, out, max_steps=stopped + 1), env=ONE_THREAD)
    assert r.returncode == 0 and f"resuming the RL run in {out} at step {stopped}" in r.stdout
