"""Supervised fine-tuning on a chat dataset (`gptforge prepare chat`, `gptforge train --task=sft`): the loss is the
mean over the assistant's tokens of the whole step (a float64 reference), the loader really applies the mask (the
gradient does not change when untrained tokens change), a micro-batch without a trained token adds nothing and
no NaN, packed conversations never see each other, the export is a Hugging Face chat model (apply_chat_template ==
our renderer; transformers' greedy generate == ours), SFT starts from a pretraining run's folder, a rotary model
grown to longer rows computes what its angles say, and a chat dataset given to pretraining (and the reverse) is a
clear exit 2 (rows against the model's context, each start: test_hostile_inputs.py's chat rows)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TIKTOKEN_CACHE, need_shared, run_cli, tiny_train_args, train_in_process
from gptforge.chat.conversations import Conversation, Message
from gptforge.chat.pack import fill_rows, write_packed
from gptforge.chat.render import chat_special_ids, render, render_prompt
from gptforge.data.chat_batches import ChatBatches
from gptforge.data.loader import read_meta
from gptforge.infer.engine import generate
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.optim import accumulate_gradients
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from gptforge.tokenizer.specials import role_tokens

ROW = 64


def conversations(path: Path, n: int, seed: int, quiet_every: int = 3) -> None:
    """n short conversations; every `quiet_every`-th has its assistant turn marked train: false."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(10, 99, 2))
        answer = {"role": "assistant", "content": f"{a + b}"}
        if i % quiet_every == 0:
            answer["train"] = False
        lines.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}, answer]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    """The chat dataset `talk` (300 conversations, rows of ROW tokens), prepared once for the module: the tests
    read it and write their runs elsewhere."""
    need_shared(TIKTOKEN_CACHE)
    folder = tmp_path_factory.mktemp("chat_data")
    conversations(folder / "talk.jsonl", 300, 0)
    r = run_cli("prepare", "chat", "talk.jsonl", "--name=talk", f"--block_size={ROW}", cwd=folder)
    assert r.returncode == 0, r.stderr
    return folder / "data"


def batches(folder: Path, accum: int = 2, batch: int = 4) -> ChatBatches:
    return ChatBatches(str(folder), read_meta(str(folder)), "train", batch, 50304, "cpu", 1, micro_per_rank=accum)


def model64() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=ROW, vocab_size=50304, n_layer=1, n_head=2, n_embd=16)).double()


def grads(model: GPT, loader: ChatBatches, accum: int = 2) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, _, _ = accumulate_gradients(model, loader.next_batch(), loader, accum, torch.enable_grad(), scaler)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_step_loss_is_the_mean_over_every_trained_token_of_the_step(chat_data):
    """Against a float64 reference: all micro-batches' per-token losses, only the trained ones, one mean."""
    folder = chat_data / "talk"
    model = model64()
    loss, got = grads(model, batches(folder))
    reference = batches(folder)
    x1, y1, p1, _ = reference.next_batch()
    x2, y2, p2, _ = reference.next_batch()
    model.zero_grad(set_to_none=True)
    per_token = [model(x, y.clamp(min=0), positions=p, reduction="none")[1] for x, y, p in ((x1, y1, p1), (x2, y2, p2))]
    trained = torch.cat([(y1 != -1).flatten(), (y2 != -1).flatten()])
    mean = torch.cat(per_token)[trained].mean()
    mean.backward()
    assert loss == pytest.approx(mean.item(), rel=1e-6)  # the loss itself is taken in float32 (model.forward)
    for name, g in got.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-5, atol=1e-9)


def packed_folder(folder: Path, question: str) -> Path:
    """A chat dataset of 8 rows, each a trained conversation, then one with nothing trained (its answer marked
    train: false) whose user turn is `question`, then padding."""
    gpt2 = GPT2Tokenizer()
    special = chat_special_ids(gpt2)
    meta = read_meta(str(folder))
    rows = []
    for i in range(8):
        taught = [Message("user", f"What is {i} plus 1?"), Message("assistant", f"{i + 1}")]
        quiet = [Message("user", question), Message("assistant", "I will not say.", train=False)]
        rows.append([render(Conversation(m, "t"), gpt2, special) for m in (taught, quiet)])
    assert sum(rows[0][1][1]) == 0, "the second conversation trains nothing"
    target = folder.parent / f"{folder.name}-{abs(hash(question)) % 1000}"
    write_packed(str(target), {"train": fill_rows(rows, ROW + 1, meta["pad_token"])}, meta)
    return target


def test_untrained_tokens_do_not_reach_the_gradient(chat_data):
    """A user's tokens are never targets: in a row holding a trained conversation and one that trains nothing,
    replacing that one's user turn by random text leaves the step's gradient bit for bit the same (nanochat's
    dropped loss mask would not). Control: with every target scored, the same change moves the gradient."""
    words = " ".join(np.random.default_rng(3).choice(["zebra", "quartz", "plum", "fjord", "oboe"], 12))
    folders = [packed_folder(chat_data / "talk", q) for q in ("Please stay quiet now.", words)]
    (_, a), (_, b) = (grads(model64(), batches(f)) for f in folders)
    for name, g in a.items():
        assert torch.equal(g, b[name]), name
    model, unmasked = model64(), []
    for folder in folders:
        loader = batches(folder, accum=1)
        x, _, positions, _ = loader.next_batch()
        rows = np.sort(loader._rows(0, 4))
        y = torch.from_numpy(np.asarray(loader.packed.tokens[rows], dtype=np.int64))[:, 1:]  # every target
        model.zero_grad(set_to_none=True)
        model(x, y, positions=positions)[1].backward()
        unmasked.append(model.transformer.wte.weight.grad.clone())
    assert not torch.equal(*unmasked)


def test_sft_loss_all_trains_every_token_inside_each_conversation(chat_data):
    """sft_loss='all' (the comparison without the mask): the targets are every token that continues its own
    conversation (user turns and role tokens too), never a conversation's first token after another one, never
    padding; counted by hand from the row's documents. The default trains a strict subset of them."""
    folder = chat_data / "talk"
    meta = read_meta(str(folder))
    every = ChatBatches(str(folder), meta, "train", 4, 50304, "cpu", 1, train_on="all")
    masked = ChatBatches(str(folder), meta, "train", 4, 50304, "cpu", 1)
    (_, y, _, w), (_, y_masked, _, _) = every.next_batch(), masked.next_batch()
    rows = np.sort(every._rows(0, 4))
    tokens = np.asarray(every.packed.tokens[rows], dtype=np.int64)
    expected = np.full((4, ROW), -1)
    for i, row in enumerate(rows):
        bounds = every.packed.row_bounds(row)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            expected[i, start : end - 1] = tokens[i, start + 1 : end]  # input at t predicts t + 1, same document
    assert torch.equal(y, torch.from_numpy(expected))
    assert w == pytest.approx(1 / (expected != -1).sum())
    assert ((y_masked != -1) <= (y != -1)).all() and (y_masked != -1).sum() < (y != -1).sum()
    assert torch.equal(y[y_masked != -1], y_masked[y_masked != -1])


def test_a_micro_batch_without_a_trained_token_adds_nothing_and_no_nan():
    model = model64()
    x = torch.randint(0, 50257, (2, 16))
    y = torch.full((2, 16), -1)
    positions = torch.arange(16).expand(2, 16)
    loss = model(x, y, positions=positions, reduction="sum")[1] * 0.5
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(loss)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_packed_conversations_never_see_each_other(chat_data):
    """In a real packed row, changing one conversation's tokens leaves every other one's logits unchanged."""
    loader = batches(chat_data / "talk", accum=1, batch=1)
    x, _, positions, _ = loader.next_batch()
    model = model64().eval()
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    assert len(starts) >= 3, "a row of several conversations"
    first_end = starts[1]
    other = x.clone()
    other[0, first_end:] = torch.randint(0, 50257, (x.size(1) - first_end,))
    with torch.no_grad():
        a = model(x, torch.zeros_like(x), positions=positions)[0]
        b = model(other, torch.zeros_like(x), positions=positions)[0]
    assert torch.equal(a[0, :first_end], b[0, :first_end])
    assert not torch.equal(a[0, first_end:], b[0, first_end:])


def test_sft_from_a_pretraining_run_exports_a_hugging_face_chat_model(chat_data, bpe_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    pretrain = tiny_train_args(bpe_data, tmp_path / "pre", dataset="bpe", block_size=ROW, max_iters=4, eval_interval=4)
    train_in_process(*pretrain)  # the pretraining run that SFT, through the CLI, starts from
    sft = tiny_train_args(chat_data, tmp_path / "sft", dataset="talk", block_size=ROW, max_iters=6, eval_interval=6)
    r = run_cli("train", *sft, "--task=sft", f"--init_from={tmp_path / 'pre'}", "--chat_eval_examples=0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "weights from" in r.stdout and "the optimizer starts fresh" in r.stdout
    r = run_cli("export", f"--out_dir={tmp_path / 'sft'}", f"--to={tmp_path / 'hf'}", cwd=tmp_path)
    assert r.returncode == 0 and "a chat model" in r.stdout, r.stderr
    hf = tmp_path / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    gpt2 = GPT2Tokenizer()
    special = chat_special_ids(gpt2)
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 30?"}]
    ours = render_prompt([Message(**m) for m in convo], gpt2, special)
    theirs = tok.apply_chat_template(convo, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert theirs["input_ids"] == ours
    full = [*convo, {"role": "assistant", "content": "42"}]
    ids, mask = render(Conversation([Message(**m) for m in full], "t"), gpt2, special)
    out = tok.apply_chat_template(full, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"] == ids and out["assistant_masks"] == mask
    generation = json.loads((hf / "generation_config.json").read_text())
    assert generation["eos_token_id"] == special[role_tokens("assistant")[1]]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    from gptforge.weights.load import load_model

    model, _, _ = load_model(str(tmp_path / "sft"), None, "resume", "cpu")
    prompt = torch.tensor([ours])
    end = special[role_tokens("assistant")[1]]
    with torch.no_grad():
        theirs_out = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0]
    ours_out = generate(model, prompt, 12, temperature=0, stop_token=end)[0]
    assert torch.equal(theirs_out, ours_out[: theirs_out.size(0)])  # both stop at the assistant's end token


def test_a_chat_dataset_given_to_pretraining_and_the_reverse_are_refused(chat_data, char_data, tmp_path):
    r = run_cli("train", *tiny_train_args(chat_data, tmp_path / "a", dataset="talk", block_size=ROW), cwd=tmp_path)
    assert r.returncode == 2 and "is a chat dataset" in r.stderr and "--task=sft" in r.stderr
    r = run_cli("train", *tiny_train_args(char_data, tmp_path / "b"), "--task=sft", cwd=tmp_path)
    assert r.returncode == 2 and "--task=sft trains on a chat dataset" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("train", *tiny_train_args(chat_data, tmp_path / "c", dataset="talk", block_size=32), "--task=sft")
    assert r.returncode == 2 and f"holds rows of {ROW} tokens" in r.stderr
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c"))


def test_a_rotary_model_grown_past_its_block_size_computes_what_its_angles_say():
    """SFT on rows longer than a rotary model's block_size grows its context (train/start.fit_start): the grown
    model's logits, read from its longer cos / sin table, equal the original model's with the angles of the same
    positions computed directly, and within the old context its own. A learned position table only shrinks."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=16, rotary=True, qk_norm=True)
    model = GPT(config).double().eval()
    grown = GPT(config).double().eval()
    grown.load_state_dict(model.state_dict())
    grown.crop_block_size(48)
    x = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        ours = grown.logits(grown.hidden_states(x))  # positions 0 .. 39 from the grown table
        reference = model.logits(model.hidden_states(x, positions=torch.arange(40)))  # angles computed for them
        short = model.logits(model.hidden_states(x[:, :16]))
    assert grown.config.block_size == 48 and grown.rope_cos.shape == (48, 4)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[:, :16], short, rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError, match="a learned position table only shrinks"):
        GPT(GPTConfig(block_size=16, vocab_size=97, n_layer=1, n_head=2, n_embd=16)).crop_block_size(48)


def test_an_sft_run_resumed_halfway_equals_the_uninterrupted_run(chat_data, tmp_path):
    common = dict(dataset="talk", block_size=ROW, max_iters=8, lr_decay_iters=8, eval_interval=4, batch_size=4)
    whole = tiny_train_args(chat_data, tmp_path / "whole", **common, gradient_accumulation_steps=2)
    assert run_cli("train", *whole, "--task=sft", "--chat_eval_examples=0", cwd=tmp_path).returncode == 0
    split = tiny_train_args(chat_data, tmp_path / "split", **{**common, "max_iters": 4}, gradient_accumulation_steps=2)
    assert run_cli("train", *split, "--task=sft", "--chat_eval_examples=0", cwd=tmp_path).returncode == 0
    r = run_cli("train", f"--out_dir={tmp_path / 'split'}", "--init_from=resume", "--max_iters=8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    a = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_loss_on_a_chat_dataset_is_the_mean_over_its_trained_tokens(chat_data, tmp_path):
    """`gptforge eval loss` on an SFT run's chat dataset: the summed loss of the trained targets of the batches it
    draws, over their count (a float64 reference over the same batches), printed to 4 places."""
    sft = tiny_train_args(chat_data, tmp_path / "sft", dataset="talk", block_size=ROW, max_iters=2, eval_interval=2)
    train_in_process(*sft, "--task=sft", "--chat_eval_examples=0")  # the run to evaluate
    r = run_cli("eval", "loss", f"--out_dir={tmp_path / 'sft'}", "--eval_iters=3", "--batch_size=4", "--dtype=float32")
    assert r.returncode == 0, r.stderr
    printed = float(r.stdout.split("val loss ")[1].split()[0])
    assert "on the trained tokens" in r.stdout
    from gptforge.weights.load import load_model

    model, _, _ = load_model(str(tmp_path / "sft"), None, "resume", "cpu")
    model = model.double().eval()
    loader = ChatBatches(str(chat_data / "talk"), read_meta(str(chat_data / "talk")), "val", 4, 50304, "cpu", 1337)
    total = count = 0.0
    with torch.no_grad():
        for _ in range(3):
            x, y, positions, _ = loader.next_batch()
            total += model(x, y, positions=positions, reduction="sum")[1].item()
            count += int((y != -1).sum())
    assert count > 0 and printed == pytest.approx(total / count, abs=6e-5)


def test_a_batch_warm_up_on_a_chat_dataset_is_refused(chat_data, tmp_path):
    """Its rows' losses are weighted over the whole step's trained tokens: cutting rows would misweight them."""
    args = tiny_train_args(chat_data, tmp_path / "out", dataset="talk", block_size=ROW)
    r = run_cli("train", *args, "--task=sft", "--batch_warmup_iters=2", "--batch_warmup_size=2", cwd=tmp_path)
    assert r.returncode == 2 and "--batch_warmup_iters=2: a chat dataset" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
