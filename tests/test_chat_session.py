"""The conversation engine (infer/session.py and its parts): incremental UTF-8 decoding and stop strings, the KV cache
kept across turns (a turn prefills only its own tokens, and the cache then equals a fresh computation), context
overflow without a crash, the sampling rule's penalties and seeds, and every kind of tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from chat_tools import MEMORISED, SYSTEM, base_run, chat_run, one_thread, tiny_model, write_run  # noqa: F401
from conftest import TIKTOKEN_CACHE, need_shared
from gptforge.chat.render import chat_special_ids, render_prompt
from gptforge.core.errors import UserError
from gptforge.infer.chat_model import load_for_inference
from gptforge.infer.engine import generate
from gptforge.infer.sampling import RowSampler, SamplingParams, penalize
from gptforge.infer.session import Session
from gptforge.infer.textstream import TextStream, TokenText
from gptforge.tokenizer.char import CharTokenizer
from gptforge.tokenizer.gpt2 import GPT2Tokenizer

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def chat_lm(tmp_path_factory):
    need_shared(TIKTOKEN_CACHE)
    return load_for_inference(str(chat_run(tmp_path_factory.mktemp("chat"))), None, "resume", "cpu", "float32")


@pytest.fixture(scope="module")
def random_chat_lm(tmp_path_factory):
    """An untrained chat model with a short context: its answers run to the token budget."""
    need_shared(TIKTOKEN_CACHE)
    folder = write_run(tmp_path_factory.mktemp("rchat"), tiny_model(block_size=48, seed=1), {"tokenizer": "gpt2"}, True)
    return load_for_inference(str(folder), None, "resume", "cpu", "float32")


def test_a_character_split_over_tokens_comes_out_whole(tiktoken_cache):
    tok = GPT2Tokenizer()
    text = "naïve 日本語 🙂 ok"
    ids = tok.encode(text)
    stream = TextStream(TokenText(tok).bytes)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(len(tok.decode([i]).encode()) and "\ufffd" in tok.decode([i]) for i in ids)  # split bytes exist


def test_stop_strings_end_the_text_before_them_even_across_tokens():
    tok = CharTokenizer(list("abcdefgh XY"))
    stream = TextStream(TokenText(tok).bytes, stop=["XY", "zzz"])
    shown = [stream.push(i) for i in tok.encode("abc dX")]
    assert "".join(shown) == "abc d" and shown[-1] == ""  # X is held back: it may start "XY"
    assert stream.push(tok.encode("Y")[0]) == "" and stream.stopped and stream.text == "abc d"
    held = TextStream(TokenText(tok).bytes, stop=["XY"])
    assert "".join(held.push(i) for i in tok.encode("aX")) + held.finish() == "aX"  # released when generation ends


def test_a_turn_prefills_only_its_own_tokens_and_the_cache_equals_a_fresh_computation(chat_lm):
    session = Session(chat_lm)
    for question in [*MEMORISED, "hi"]:
        before, unfed = session.prefilled, len(session.ids) - session.rows.length
        assert unfed <= 2  # at most the previous answer's last token and its end token wait
        "".join(session.answer(question, GREEDY, 20))
        assert session.prefilled - before == unfed + len(session._turn(question))
    assert session.prefilled + session.stepped == session.rows.length  # each token fed once, none again
    with torch.no_grad():
        cached = session.rows.feed(torch.tensor([session.ids[session.rows.length :]]))
        fresh = chat_lm.model(torch.tensor([session.ids]))[0][:, -1]
    torch.testing.assert_close(cached, fresh, rtol=0, atol=1e-4)


def test_greedy_answers_are_the_memorised_ones_and_end_with_the_end_token(chat_lm):
    for system in (None, SYSTEM):
        for question, answer in MEMORISED.items():
            session = Session(chat_lm, system)
            assert "".join(session.answer(question, GREEDY, 60)) == answer
            assert session.last.finish_reason == "stop"
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": question}
            ]
            prompt = render_prompt(messages, chat_lm.tokenizer, chat_lm.special_ids)
            assert session.ids[: len(prompt)] == prompt  # the renderer's format, turn by turn


def test_fifty_turns_past_the_context_keep_going_and_keep_the_system_message(random_chat_lm):
    notices = []
    session = Session(random_chat_lm, "Be kind.", notices.append)
    for turn in range(50):
        text = "".join(session.answer(f"message {turn}", SamplingParams(temperature=1.0, seed=turn), 12))
        assert session.last.tokens >= 1 and isinstance(text, str)
        assert session.messages[0] == {"role": "system", "content": "Be kind."}
        assert len(session.ids) <= random_chat_lm.block_size + 1
    assert any("dropped the oldest" in n and "system message is kept" in n for n in notices)
    assert session.messages[-2]["content"] == "message 49"


def test_a_message_longer_than_the_context_is_refused_and_the_conversation_is_unchanged(random_chat_lm):
    session = Session(random_chat_lm)
    "".join(session.answer("hello", GREEDY, 5))
    before = list(session.messages)
    with pytest.raises(UserError, match="too many for this model's context of 48"):
        "".join(session.answer("word " * 60, GREEDY, 5))
    assert session.messages == before
    assert "".join(session.answer("again", GREEDY, 3)) is not None and len(session.messages) == 4


def test_a_base_model_continues_text_exactly_as_generate_does(tmp_path, tiktoken_cache):
    lm = load_for_inference(str(base_run(tmp_path / "base", block_size=64)), None, "resume", "cpu", "float32")
    assert not lm.chat and "completion mode" in lm.describe()
    session = Session(lm)
    text = "".join(session.answer("Once upon a time", GREEDY, 20))
    prompt = lm.encode("Once upon a time")
    with torch.no_grad():
        expected = generate(lm.model, torch.tensor([prompt]), 20, temperature=0.0, stop_token=lm.tokenizer.eot_token)
    new = [t for t in expected[0, len(prompt) :].tolist() if t != lm.tokenizer.eot_token]
    assert text == lm.tokenizer.decode(new)
    for turn in range(8):  # past the context: the oldest tokens go, it keeps going
        "".join(session.answer(f" and then {turn}", GREEDY, 20))
    assert len(session.ids) <= 65 and session.last.tokens >= 1


def test_character_level_and_own_bpe_models_talk_too(tmp_path, tiktoken_cache):
    from gptforge.tokenizer.bpe import BPETokenizer

    chars = CharTokenizer(list(" abcdefghijklmnopqrstuvwxyzé"))
    folder = write_run(tmp_path / "char", tiny_model(vocab_size=chars.vocab_size, block_size=32), chars.spec(), False)
    lm = load_for_inference(str(folder), None, "resume", "cpu", "float32")
    assert "".join(Session(lm).answer("café", GREEDY, 40)) is not None  # past block_size: dropped, no crash
    bpe = BPETokenizer([bytes([b]) for b in range(256)], "bytes")
    model = tiny_model(vocab_size=bpe.vocab_size, block_size=64)
    lm = load_for_inference(str(write_run(tmp_path / "bpe", model, bpe.spec(), True)), None, "resume", "cpu", "auto")
    assert lm.chat and lm.special_ids == chat_special_ids(bpe)
    session = Session(lm, "sys")
    text = "".join(session.answer("héllo 🙂", SamplingParams(temperature=1.0, seed=0), 30))
    assert "\ufffd" not in text or session.last.finish_reason != "stop"  # bytes held until whole characters


def test_seeds_reproduce_answers_and_penalties_change_them(random_chat_lm):
    def answer(**params):
        return "".join(Session(random_chat_lm).answer("hi", SamplingParams(**params), 15))

    assert answer(temperature=1.0, seed=3) == answer(temperature=1.0, seed=3)
    assert answer(temperature=1.0, seed=3) != answer(temperature=1.0, seed=4)
    assert answer(temperature=0) != answer(temperature=0, repetition_penalty=5.0)


def test_penalties_follow_ctrl_and_openai():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    seen = torch.tensor([True, True, False, False])
    counts = torch.tensor([0.0, 0.0, 3.0, 0.0])
    out = penalize(
        logits, seen, counts, SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    )
    assert out.tolist() == [1.0, -4.0, 1.0 - 1.5 - 0.25, 0.5]
    sampler = RowSampler(SamplingParams(temperature=0, repetition_penalty=100.0), 4, "cpu", context=[0])
    assert sampler.choose(logits).token == 2  # token 0 was in the prompt


def test_save_then_load_round_trips_the_conversation(chat_lm, tmp_path):
    session = Session(chat_lm, SYSTEM)
    "".join(session.answer("hi", GREEDY, 40))
    session.save(str(tmp_path / "c.jsonl"))
    saved = json.loads((tmp_path / "c.jsonl").read_text())
    assert saved["messages"][0] == {"role": "system", "content": SYSTEM}
    other = Session(chat_lm)
    other.load(str(tmp_path / "c.jsonl"))
    assert other.messages == session.messages and other.ids == session.ids
    assert "".join(other.answer("what is 2+3?", GREEDY, 10)) == "".join(session.answer("what is 2+3?", GREEDY, 10))
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(UserError, match="ends with a user message"):
        other.load(str(tmp_path / "bad.jsonl"))


def test_an_exported_chat_folder_is_a_chat_model_with_the_same_answers(chat_lm, tmp_path):
    """--init_from a Hugging Face folder (what `gptforge export` writes for an SFT run: a chat_template) talks the
    same as the run itself."""
    from gptforge.weights.export import export_hf

    export_hf(chat_lm.model, str(tmp_path / "hf"), chat_lm.tokenizer.spec(), chat=True)
    folder_lm = load_for_inference("unused", None, str(tmp_path / "hf"), "cpu", "float32")
    assert folder_lm.chat and folder_lm.name == "hf" and folder_lm.stop_ids == chat_lm.stop_ids
    for question, answer in MEMORISED.items():
        assert "".join(Session(folder_lm, SYSTEM).answer(question, GREEDY, 60)) == answer
