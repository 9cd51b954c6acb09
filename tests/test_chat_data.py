"""Chat data: the conversation readers and their errors, packing (rows, documents, masks, boundaries, the padding
measured on the chit-chat set), prepare_chat's files, and the synthetic tasks (determinism, splits, scorer)."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter

import numpy as np
import pytest

from conftest import run_cli
from gptforge.chat.conversations import Message, read_chitchat, read_conversations, read_file
from gptforge.chat.pack import best_fit, fill_rows, pack_documents, plan_rows, read_chat_meta, read_packed
from gptforge.chat.prepare import pack_split, prepare_chat
from gptforge.chat.render import chat_special_ids, render
from gptforge.chat.synthetic import KINDS, generate, pseudo_words, score, split_of, words_from_text
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.evaluate.chat import chat_task
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from gptforge.tokenizer.specials import gpt2_special_ids

IDS = gpt2_special_ids()
BOS_ID = IDS["<|bos|>"]
GPT2 = {"tokenizer": "gpt2"}


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


def openai(*pairs, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": r, "content": c} for r, c in pairs]}


# --- readers ---------------------------------------------------------------------------------------------------


def test_the_three_formats_read_to_the_same_messages(tmp_path):
    expected = [Message("system", "Be kind."), Message("user", "Hi\n\nthere"), Message("assistant", "Hello!")]
    records = [
        openai(("user", "Hi\n\nthere"), ("assistant", "Hello!"), system="Be kind."),
        {
            "system": "Be kind.",
            "conversations": [{"from": "human", "value": "Hi\n\nthere"}, {"from": "gpt", "value": "Hello!"}],
        },
        {"system": "Be kind.", "instruction": "Hi", "input": "there", "output": "Hello!"},
    ]
    path = write_lines(tmp_path / "mixed.jsonl", ["", *records, "   "])  # blank lines are skipped
    conversations = read_file(path)
    assert [c.messages for c in conversations] == [expected] * 3
    assert [c.where for c in conversations] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    for fmt, record in zip(("openai", "sharegpt", "alpaca"), records, strict=True):
        assert read_file(write_lines(tmp_path / f"{fmt}.jsonl", [record]), fmt=fmt)[0].messages == expected
    array = tmp_path / "alpaca.json"
    array.write_text(json.dumps([records[2], records[2]]))
    assert [c.messages for c in read_file(str(array))] == [expected] * 2
    with gzip.open(tmp_path / "x.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(json.dumps(records[0]) + "\n")
    assert read_file(str(tmp_path / "x.jsonl.gz"))[0].messages == expected
    assert conversations[0].to_openai() == records[0]


def test_train_flags_and_sharegpt_role_names(tmp_path):
    record = openai(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))
    record["messages"][1]["train"] = False
    record["messages"][3]["weight"] = 1
    sharegpt = {"conversations": [{"from": "user", "value": "a"}, {"from": "assistant", "value": "b", "weight": 0}]}
    first, second = read_conversations([write_lines(tmp_path / "t.jsonl", [record, sharegpt])])
    assert [m.train for m in first.messages] == [True, False, True, True]
    assert second.messages == [Message("user", "a"), Message("assistant", "b", train=False)]
    empty_context = openai(("user", "a"), ("assistant", ""), ("user", "b"), ("assistant", "c"))
    empty_context["messages"][1]["train"] = False  # an empty answer is fine when it is not trained on
    assert read_file(write_lines(tmp_path / "e.jsonl", [empty_context]))[0].messages[1].content == ""


GOOD = json.dumps(openai(("user", "Hi"), ("assistant", "Hello")))
BAD_INPUTS = {
    "malformed": ([GOOD, '{"messages": [{"role": "user"'], 2, "not valid JSON"),
    "unknown role": ([GOOD, json.dumps(openai(("user", "a"), ("robot", "b")))], 2, "role 'robot'"),
    "unknown sharegpt role": ([json.dumps({"conversations": [{"from": "bot", "value": "x"}]})], 1, "'bot'"),
    "two users": ([json.dumps(openai(("user", "a"), ("user", "b"), ("assistant", "c")))], 1, "alternate"),
    "assistant first": ([json.dumps(openai(("assistant", "a"), ("user", "b")))], 1, "alternate"),
    "late system": ([json.dumps(openai(("user", "a"), ("system", "b"), ("assistant", "c")))], 1, "second system"),
    "no assistant": ([GOOD, GOOD, json.dumps(openai(("user", "a")))], 3, "no assistant message"),
    "assistant not last": ([json.dumps(openai(("user", "a"), ("assistant", "b"), ("user", "c")))], 1, "last message"),
    "empty user": ([json.dumps(openai(("user", " "), ("assistant", "b")))], 1, "message 1 .user. is empty"),
    "empty answer": ([json.dumps(openai(("user", "a"), ("assistant", "")))], 1, "train.: false"),
    "empty file": ([], 1, "the file is empty"),
    "blank file": (["", "  "], 1, "the file is empty"),
    "plain text": (["First Citizen:", "Before we proceed any further, hear me speak."], 1, "plain text"),
    "pretraining jsonl": ([json.dumps({"text": "Once upon a time"})], 1, "pretraining document"),
    "not an object": (["[1, 2]"], 1, "not valid JSON|expected a JSON object|array"),
    "bad train flag": ([json.dumps({"messages": [{"role": "user", "content": "a", "train": "no"}]})], 1, "true or"),
    "content not text": ([json.dumps({"messages": [{"role": "user", "content": 3}]})], 1, "must be a string"),
    "alpaca without output": ([json.dumps({"instruction": "a", "output": None})], 1, "needs .instruction"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_name_the_file_and_line_and_write_nothing(tmp_path, case):
    lines, line, message = BAD_INPUTS[case]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
    with pytest.raises(UserError, match=message) as err:
        read_conversations([str(path)])
    where = f"{path}:{'item ' if case == 'not an object' else ''}"
    assert str(err.value).startswith(f"{path}:{line}") or str(err.value).startswith(where), str(err.value)
    data = tmp_path / "data"
    with pytest.raises(UserError):
        prepare_chat([str(path)], "chat", GPT2, 64, data_dir=str(data))
    assert not data.exists()


def test_forced_format_and_missing_files(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", [json.loads(GOOD)])
    with pytest.raises(UserError, match='"instruction" and "output"'):
        read_file(path, fmt="alpaca")
    with pytest.raises(UserError, match="unknown chat format 'xml'"):
        read_conversations([path], fmt="xml")
    with pytest.raises(UserError, match="not found"):
        read_file(str(tmp_path / "missing.jsonl"))


@pytest.fixture(scope="module")
def chitchat():
    pytest.importorskip("chitchat_dataset")
    return read_chitchat()


def test_chitchat_reader(chitchat):
    assert len(chitchat) == 4017  # of 7,168: those with two speakers and a non-empty first exchange
    for conversation in chitchat:
        roles = [m.role for m in conversation.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        assert all(m.content.strip() and m.train for m in conversation.messages)
    first = chitchat[0].messages
    assert first[0].content == "Hello\nHow are you doing today?"
    assert first[1].content == "whats up MD\nim doing good\nhow are you doing?"


# --- packing ---------------------------------------------------------------------------------------------------


def random_docs(rng, n, row_len):
    docs = []
    for _ in range(n):
        length = int(rng.integers(2, row_len + 1))
        ids = [BOS_ID, *rng.integers(0, 50000, length - 1).tolist()]
        docs.append((ids, [0, *rng.integers(0, 2, length - 1).tolist()]))
    return docs


def documents_of(packed):
    """Every row's documents, read back through its boundaries, and the padding checked on the way."""
    found = []
    for r in range(len(packed)):
        bounds = packed.row_bounds(r)
        assert bounds[0] == 0 and np.all(np.diff(bounds) > 0)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            found.append((packed.tokens[r, a:b].tolist(), packed.mask[r, a:b].tolist()))
        assert np.all(packed.tokens[r, bounds[-1] :] == BOS_ID) and not packed.mask[r, bounds[-1] :].any()
        segments = np.diff(np.append(bounds, packed.tokens.shape[1]))  # each document's length, then the padding's
        assert packed.doc_ids(r).tolist() == np.repeat(np.arange(len(bounds)), segments).tolist()
    return found


def test_pack_documents_keeps_every_document_whole_and_bos_aligned():
    rng = np.random.default_rng(0)
    row_len = 65
    docs = random_docs(rng, 300, row_len)
    packed = pack_documents(docs, row_len, BOS_ID)
    assert packed.tokens.shape == packed.mask.shape == (len(packed), row_len) and packed.mask.dtype == np.uint8
    found = documents_of(packed)
    assert sorted(found) == sorted(docs)  # each document once, intact, with its own mask
    assert all(ids[0] == BOS_ID for ids, _ in found)
    assert packed.padding == packed.tokens.size - sum(len(d[0]) for d in docs)
    assert packed.waste < 0.05, packed.waste
    assert best_fit([3, 4, 2], 6) == [[1, 2], [0]]  # longest first, each into the row it fills most tightly


def test_plan_rows_places_every_exchange_once():
    rng = np.random.default_rng(1)
    layouts = [(int(rng.integers(1, 6)), rng.integers(3, 40, int(rng.integers(1, 12))).tolist()) for _ in range(400)]
    layouts.append((3, [70, 5]))  # an exchange too long for a row: skipped, the rest kept
    row_len = 64
    plan = plan_rows(layouts, row_len)
    seen = {d: [] for d in range(len(layouts))}
    for row in plan.rows:
        assert sum(layouts[d][0] + sum(layouts[d][1][a:b]) for d, a, b in row) <= row_len
        for d, a, b in row:
            assert a < b
            seen[d].extend(range(a, b))
    for d, (header, lengths) in enumerate(layouts):
        placeable = [i for i, n in enumerate(lengths) if header + n <= row_len]
        assert sorted(seen[d]) == placeable, d
    assert plan.dropped_exchanges == sum(len(x[1]) for x in layouts) - sum(len(s) for s in seen.values())
    cut = plan_rows(layouts, row_len, split_long=False)
    assert all(a == 0 for row in cut.rows for _, a, _ in row) and cut.pieces == 0


def test_fill_rows_refuses_an_overflowing_row():
    with pytest.raises(AssertionError, match="overflow"):
        fill_rows([[([BOS_ID] * 5, [0] * 5), ([BOS_ID] * 4, [0] * 4)]], 8, BOS_ID)


@pytest.mark.parametrize("block_size", [256, 512])
def test_padding_waste_on_the_chitchat_set(chitchat, block_size):
    tok = GPT2Tokenizer()
    packed, counts = pack_split(chitchat, tok, chat_special_ids(tok), block_size + 1, False, True, 0, np.uint16)
    print(f"chit-chat, block_size {block_size}: {counts}")
    assert packed.waste < 0.05 and counts["waste"] == round(packed.waste, 6)
    assert counts["trained_tokens"] == int(packed.mask.sum()) and counts["dropped"] < 30
    docs = documents_of(packed)
    assert all(ids[0] == BOS_ID and ids[-1] == IDS["<|assistant_end|>"] for ids, _ in docs)


# --- prepare_chat ----------------------------------------------------------------------------------------------


def test_prepare_chat_writes_rows_that_read_back(tmp_path):
    records = [
        openai(("user", f"question {i}"), ("assistant", f"answer {i} " * (1 + i % 7)), system="S") for i in range(60)
    ]
    path = write_lines(tmp_path / "c.jsonl", records)
    meta = prepare_chat([path], "c", GPT2, 32, data_dir=str(tmp_path / "data"), val_fraction=0.2)
    folder = tmp_path / "data" / "c"
    assert read_chat_meta(str(folder)) == meta and meta["format"] == "chat" and meta["row_tokens"] == 33
    assert meta["tokenizer"] == "gpt2" and meta["dtype"] == "uint16" and meta["special_ids"] == IDS
    tok = GPT2Tokenizer()
    rendered = {tuple(render(c, tok, IDS)[0]): render(c, tok, IDS)[1] for c in read_file(path)}
    seen = {}
    for split in ("train", "val"):
        packed = read_packed(str(folder), split)
        assert packed.tokens.shape[1] == 33 and len(packed) == meta["counts"][split]["rows"]
        seen[split] = {tuple(ids) for ids, mask in documents_of(packed) if rendered[tuple(ids)] == mask}
        assert len(seen[split]) == meta["counts"][split]["documents"]
    assert seen["train"].isdisjoint(seen["val"]) and len(seen["train"] | seen["val"]) == len(rendered)
    assert sorted(os.listdir(folder)) == sorted(
        ["meta.json", *(f"{s}_{a}.npy" for s in ("train", "val") for a in ("tokens", "mask", "bounds", "offsets"))]
    )


def test_prepare_chat_refuses_a_char_tokenizer_and_unknown_recipes(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [json.loads(GOOD)] * 3)
    with pytest.raises(UserError, match="GPT-2 BPE"):
        prepare_chat([path], "c", {"tokenizer": "char", "itos": list("abc")}, 32, data_dir=str(tmp_path / "d"))
    with pytest.raises(UserError, match="unknown chat recipe"):
        prepare_chat([path], "c", GPT2, 32, data_dir=str(tmp_path / "d"), recipes=["wiki"])
    with pytest.raises(UserError, match="too few"):
        prepare_chat(
            [write_lines(tmp_path / "one.jsonl", [json.loads(GOOD)])], "c", GPT2, 32, data_dir=str(tmp_path / "d")
        )
    with pytest.raises(UserError, match="not a chat dataset"):
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "meta.json").write_text('{"vocab_size": 65, "tokenizer": "char"}')
        read_chat_meta(str(tmp_path / "plain"))
    assert not (tmp_path / "d").exists()


# --- synthetic tasks -------------------------------------------------------------------------------------------


def test_synthetic_tasks_are_deterministic_and_split_by_problem():
    words = pseudo_words(300)
    train = generate(400, seed=3, words=words)
    assert [e.key for e in train] == [e.key for e in generate(400, seed=3, words=words)]
    assert [e.messages for e in train] == [e.messages for e in generate(400, seed=3, words=words)]
    assert [e.key for e in train] != [e.key for e in generate(400, seed=4, words=words)]
    held_out = generate(400, seed=3, split="held_out", words=words)
    assert {e.kind for e in train} == {e.kind for e in held_out} == set(KINDS)
    assert {e.key for e in train}.isdisjoint(e.key for e in held_out)
    assert all(split_of(e.key) == "train" for e in train) and all(split_of(e.key) == "held_out" for e in held_out)
    for example in held_out:  # a recall conversation's filler problems are of its own split too
        if example.kind == "recall":
            for user in example.messages[2:-2:2]:
                assert not any(user.content == t.messages[0].content for t in train if t.kind != "recall")


def test_synthetic_answers_are_right():
    for example in generate(800, seed=0, words=words_from_text("the cat sat on the mat " * 3 + "apple banana " * 3)):
        kind, key, answer = example.kind, example.key, example.answer
        assert example.messages[-1] == Message("assistant", answer) and example.prompt == example.messages[:-1]
        if kind in ("add3", "add", "sub", "mul"):
            a, op, b = key.split(":")[1].partition(next(c for c in "+-*" if c in key.split(":")[1]))
            assert int(answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert kind != "add3" or (99 < int(a) < 1000 and 99 < int(b) < 1000)
            assert kind != "sub" or int(answer) >= 0
        elif kind == "spell":
            assert answer.replace("-", "") == key.split(":")[1]
        elif kind == "count":
            _, word, letter = key.split(":")
            assert answer == str(word.count(letter))
        elif kind == "recall":
            assert f": {answer}." in example.messages[0].content and len(example.messages) >= 8
        elif kind == "system":
            assert example.messages[0].role == "system"
            rule = example.messages[0].content
            assert (
                answer == answer.upper()
                if "uppercase" in rule
                else answer == answer.lower()
                if "lower" in rule
                else answer.startswith("[")
            )


def test_score_is_exact_match_but_for_outer_whitespace():
    example = generate(1, seed=0, kinds=["add3"])[0]
    assert score(example, example.answer) and score(example, f"  {example.answer}\n")
    assert not score(example, example.answer + "0") and not score(example, f"The answer is {example.answer}")
    upper = next(e for e in generate(30, seed=0, kinds=["system"]) if "uppercase" in e.messages[0].content)
    assert not score(upper, upper.answer.lower()) or upper.answer == upper.answer.lower()
    with pytest.raises(UserError, match="unknown synthetic task kinds"):
        generate(1, kinds=["poetry"])


def test_synthetic_kinds_choose_the_tasks_and_their_shares(tmp_path, tiktoken_cache):
    """--synthetic_kinds through the CLI: the kinds in turn, a kind named twice twice as often; the dataset holds
    exactly those conversations. An unknown kind is refused (exit 2) and nothing is written."""
    args = ["prepare", "chat", "--name=s", "--include=synthetic", "--synthetic_examples=30", "--block_size=512"]
    r = run_cli(*args, "--synthetic_kinds=add3,add3,recall", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    expected = generate(30, 1337, "train", kinds=["add3", "add3", "recall"])
    assert Counter(e.kind for e in expected) == {"add3": 20, "recall": 10}
    tok = GPT2Tokenizer()
    rendered = {tuple(render(e.conversation(), tok, IDS)[0]) for e in expected}
    folder = str(tmp_path / "data" / "s")
    assert {tuple(ids) for split in ("train", "val") for ids, _ in documents_of(read_packed(folder, split))} == rendered
    meta = json.loads((tmp_path / "data" / "s" / "meta.json").read_text())
    assert meta["synthetic_kinds"] == ["add3", "recall"]
    asked = chat_task(6, DistEnv(), meta).keywords["examples"]
    assert [e.kind for e in asked] == ["add3", "recall"] * 3  # SFT's evaluation asks the dataset's kinds
    r = run_cli(*args[:2], "--name=t", *args[3:], "--synthetic_kinds=add3,nope", cwd=tmp_path)
    assert r.returncode == 2 and "unknown synthetic task kinds ['nope']" in r.stderr
    assert not (tmp_path / "data" / "t").exists()


def test_doc_notes_hold_their_answer_and_come_only_when_named():
    """`doc`: a note of 40-60 lowercase words, one of them in capitals, and a question whose one-word answer is that
    word or the note's last word; held out by problem as the others; not in the default mix."""
    words = pseudo_words(300)
    docs = generate(200, seed=5, kinds=["doc"], words=words)
    assert "doc" not in {e.kind for e in generate(50, seed=5, words=words)}
    for example in docs:
        (user,) = example.prompt
        note, question = user.content.split("\n\n")[1:]
        said = note.replace(",", " ").replace(";", " ").replace(".", " ").split()
        assert 40 <= len(said) <= 60 and len([w for w in said if w.isupper()]) == 1
        expected = next(w for w in said if w.isupper()) if "capitals" in question else said[-1]
        assert example.answer == expected and split_of(example.key) == "train"
    assert {"capitals" in e.prompt[0].content for e in docs} == {True, False}
    held_out = generate(50, seed=5, split="held_out", kinds=["doc"], words=words)
    assert {e.key for e in held_out}.isdisjoint(e.key for e in docs)


def test_a_kind_too_long_for_the_rows_is_named_when_left_out(tmp_path, tiktoken_cache, capsys):
    """Every convert conversation (a function schema in the system turn) is longer than 65 tokens: prepare says
    which source lost them, by name, and meta.json keeps the count; the short kind fits and is not named."""
    meta = prepare_chat(
        [], "s", GPT2, 64, data_dir=str(tmp_path / "data"), recipes=["synthetic"], synthetic_examples=40,
        synthetic_kinds=["convert", "add"],
    )  # fmt: skip
    assert meta["counts"]["train"]["left_out_sources"] == {"synthetic:convert": [20, 20]}
    assert "warning: synthetic:convert: 20 of 20 conversations left out" in capsys.readouterr().err
