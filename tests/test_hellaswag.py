"""HellaSwag, the library: rendering against tiktoken, scoring against a float64 loop, chance level, download,
loading examples. The CLI and training's HellaSwag evals are in test_hellaswag_cli.py."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.evaluate import hellaswag as hs
from gptforge.model.gpt import GPT
from gptforge.tokenizer.gpt2 import GPT2Tokenizer
from hellaswag_tools import tiny_gpt

EXAMPLES = [
    {
        "ctx": "A man is sitting on a roof. he",
        "label": 3,
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a cube.",
            "starts pulling up roofing on a roof.",
        ],
    },
    {
        "ctx": "A lady walks to a barbell. She bends down and grabs the pole. the lady",
        "label": 0,
        "endings": [
            "stands and lifts the weight over her head.",
            "swings.",
            "pulls the barbell forward.",
            "pulls a rope attached to the barbell, which is tied to a very long and winding rope of doom.",
        ],
    },
    {
        "ctx": "Cooking pasta: Bring",
        "label": 2,
        "endings": ["water", "a pot of salted water to the boil.", "the water to a boil", "it."],
    },
]


def test_render_example_is_context_then_space_prefixed_endings(tiktoken_cache):
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    ex = EXAMPLES[1]
    ctx = enc.encode(ex["ctx"])
    ends = [enc.encode(" " + e) for e in ex["endings"]]
    tokens, mask, label = hs.render_example(ex, GPT2Tokenizer())
    L = len(ctx) + max(len(e) for e in ends)
    assert label == 0 and tokens.dtype == mask.dtype == torch.long and tokens.shape == mask.shape == (4, L)
    for i, end in enumerate(ends):
        pad = L - len(ctx) - len(end)
        assert tokens[i].tolist() == ctx + end + [0] * pad
        assert mask[i].tolist() == [0] * len(ctx) + [1] * len(end) + [0] * pad

    # Longer than block_size: each row keeps its last 8 tokens, the mask cropped alike, then pads.
    tokens, mask, _ = hs.render_example(ex, GPT2Tokenizer(), block_size=8)
    assert tokens.shape == (4, 8)
    for i, end in enumerate(ends):
        row, row_mask = (ctx + end)[-8:], ([0] * len(ctx) + [1] * len(end))[-8:]
        assert tokens[i].tolist() == row and mask[i].tolist() == row_mask


def reference_losses(model: GPT, example: dict, block_size: int) -> tuple[list[float], list[float]]:
    """Per ending: summed and mean loss over its tokens, from an unpadded float64 forward and a loop per position."""
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    model64 = copy.deepcopy(model).double()
    sums, means = [], []
    for ending in example["endings"]:
        ctx, end = enc.encode(example["ctx"]), enc.encode(" " + ending)
        row, is_ending = (ctx + end)[-block_size:], ([False] * len(ctx) + [True] * len(end))[-block_size:]
        idx = torch.tensor([row])
        logits, _ = model64(idx, torch.zeros_like(idx))  # (1, T, V) float64
        total, count = 0.0, 0
        for t in range(1, len(row)):
            if is_ending[t]:
                total -= torch.log_softmax(logits[0, t - 1], dim=-1)[row[t]].item()
                count += 1
        sums.append(total)
        means.append(total / count)
    return sums, means


@pytest.mark.parametrize("block_size", [64, 12])  # 12: most rows are cropped from the left, one ending too
def test_scores_match_a_float64_reference(tiktoken_cache, block_size):
    model, tok = tiny_gpt(block_size), GPT2Tokenizer()
    rendered = [hs.render_example(ex, tok, block_size) for ex in EXAMPLES]
    sum_loss, mean_loss = hs.score_rendered(model, rendered, "cpu")  # one padded batch
    assert sum_loss.shape == mean_loss.shape == (3, 4)
    correct = correct_norm = 0
    for n, ex in enumerate(EXAMPLES):
        sums, means = reference_losses(model, ex, block_size)
        torch.testing.assert_close(sum_loss[n].double(), torch.tensor(sums, dtype=torch.float64), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(
            mean_loss[n].double(), torch.tensor(means, dtype=torch.float64), rtol=1e-5, atol=1e-5
        )
        correct += min(range(4), key=sums.__getitem__) == ex["label"]
        correct_norm += min(range(4), key=means.__getitem__) == ex["label"]
    for batch_examples in (1, 2):
        result = hs.evaluate_hellaswag(model, tok, EXAMPLES, "cpu", batch_examples=batch_examples, progress=False)
        assert result == {
            "n": 3,
            "correct": correct,
            "correct_norm": correct_norm,
            "acc": correct / 3,
            "acc_norm": correct_norm / 3,
        }
    assert not model.training


def full_logits_losses(model: GPT, rendered: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The straightforward scoring: every position's logits (R, L, V), then the ending tokens' log-probabilities."""
    from torch.nn import functional as F

    L = max(t.size(1) for t, _, _ in rendered)
    tokens = torch.cat([F.pad(t, (0, L - t.size(1))) for t, _, _ in rendered])  # (R, L)
    scored = torch.cat([F.pad(m, (0, L - m.size(1))) for _, m, _ in rendered])[:, 1:].float()  # (R, L-1)
    logits, _ = model(tokens, torch.zeros_like(tokens))  # (R, L, V)
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (R, L-1)
    sum_loss = -(logp * scored).sum(dim=1)  # (R,)
    return sum_loss.view(-1, 4), (sum_loss / scored.sum(dim=1)).view(-1, 4)


@torch.no_grad()
def test_logits_at_ending_positions_only_give_the_full_logits_answers(tiktoken_cache, hellaswag_path):
    """score_rendered applies lm_head to the positions that predict ending tokens alone; on real examples
    (padded batches, some rows cropped to block_size 48) the answers are those of all positions' logits."""
    model, tok = tiny_gpt(block_size=48, vocab_size=50304), GPT2Tokenizer()
    examples = hs.load_examples(str(hellaswag_path), limit=40)
    rendered = [hs.render_example(ex, tok, block_size=48) for ex in examples]
    lm_head_rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: lm_head_rows.append(args[0].shape[0]))
    new, ref = [], []  # per batch of 4 examples: (sum_loss, mean_loss), each (4, 4)
    for start in range(0, len(rendered), 4):
        batch = rendered[start : start + 4]
        lm_head_rows.clear()
        new.append(hs.score_rendered(model, batch, "cpu"))
        assert lm_head_rows == [sum(int(m[:, 1:].sum()) for _, m, _ in batch)]  # the ending positions, no more
        ref.append(full_logits_losses(model, batch))
    hook.remove()
    new_sum, new_mean = (torch.cat(x) for x in zip(*new, strict=True))  # (40, 4) each
    ref_sum, ref_mean = (torch.cat(x) for x in zip(*ref, strict=True))
    # Equal bit for bit here; another BLAS may round (M, C) x (C, V) and (R*L, C) x (C, V) apart. Summed losses
    # reach ~370, where a float32 step is 3e-5: within 1e-5 relative for them, absolute for the means (~11).
    torch.testing.assert_close(new_sum, ref_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_mean, ref_mean, rtol=0, atol=1e-5)
    assert torch.equal(new_sum.argmin(1), ref_sum.argmin(1)) and torch.equal(new_mean.argmin(1), ref_mean.argmin(1))
    # Under bf16 autocast, through a wrapper shaped like DDP's (the GPT as .module; calling it would raise):
    # equal here too. bf16 keeps 8 bits, so another machine's kernels may round the two apart by ~1e-3.
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with bf16:
        ref = full_logits_losses(model, rendered[:4])
    got = hs.score_rendered(torch.nn.ModuleDict({"module": model}), rendered[:4], "cpu", bf16)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    assert all(torch.equal(g.argmin(1), r.argmin(1)) for g, r in zip(got, ref, strict=True))
    # evaluate_hellaswag batches by length instead: still the same answers.
    labels = torch.tensor([ex["label"] for ex in examples])
    result = hs.evaluate_hellaswag(model, tok, examples, "cpu", progress=False)
    assert (result["n"], result["correct"], result["correct_norm"]) == (
        40,
        int((ref_sum.argmin(1) == labels).sum()),
        int((ref_mean.argmin(1) == labels).sum()),
    )


def test_random_model_is_at_chance_on_200_real_examples(tiktoken_cache, hellaswag_path):
    assert len(hs.load_examples(str(hellaswag_path))) == 10042
    examples = hs.load_examples(str(hellaswag_path), limit=200)
    result = hs.evaluate_hellaswag(
        tiny_gpt(block_size=128, vocab_size=50304), GPT2Tokenizer(), examples, "cpu", progress=False
    )
    print(result)
    assert result["n"] == 200 and result["correct"] + 0.0 == result["acc"] * 200
    assert 0.15 <= result["acc"] <= 0.35 and 0.15 <= result["acc_norm"] <= 0.35  # chance is 0.25


def test_download_is_atomic_cached_and_names_the_option_offline(tmp_path, monkeypatch):
    source = tmp_path / "source.jsonl"
    source.write_text(
        "".join(f'{{"ctx": "c{i}", "endings": ["a", "b", "c", "d"], "label": {i % 4}}}\n' for i in range(5))
    )
    cache = tmp_path / "cache"
    path = hs.hellaswag_file(None, url=source.as_uri(), cache_dir=str(cache))
    assert Path(path) == cache / "hellaswag_val.jsonl" and Path(path).read_bytes() == source.read_bytes()
    assert os.listdir(cache) == ["hellaswag_val.jsonl"]  # no temporary file left behind
    assert [ex["label"] for ex in hs.load_examples(path, limit=3)] == [0, 1, 2]
    # Cached: no second download (this URL would fail).
    assert hs.hellaswag_file(None, url="http://127.0.0.1:9/hellaswag_val.jsonl", cache_dir=str(cache)) == path

    offline = tmp_path / "offline"
    with pytest.raises(UserError, match="--hellaswag_path=PATH"):
        hs.hellaswag_file(None, url="http://127.0.0.1:9/hellaswag_val.jsonl", cache_dir=str(offline))
    assert os.listdir(offline) == []

    monkeypatch.setenv("GPTFORGE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert hs.default_cache_dir() == str(tmp_path / "elsewhere" / "hellaswag")


def test_load_examples_names_the_file_and_line_of_a_bad_example(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 1}\n{"ctx": "y", "endings": ["a"]}\n')
    with pytest.raises(UserError, match=r"bad.jsonl, line 2: not a HellaSwag example"):
        hs.load_examples(str(bad))
    assert len(hs.load_examples(str(bad), limit=1)) == 1
