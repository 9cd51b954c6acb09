"""Generation's context window against nanoGPT's sample.py loop: 'slide' (the default) gives its tokens exactly,
with and without the KV cache, in generate() and through `gptforge sample`; 'half' equals its own uncached run."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli, tiny_train_args
from gptforge.infer.engine import generate
from gptforge.infer.options import WINDOWS
from gptforge.model.gpt import GPT, GPTConfig

BLOCK = 16


def tiny(seed: int = 0, scale: float = 1.0) -> GPT:
    """A random model with block_size 16; `scale` > 1 sharpens its logits, so its text depends on its context."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=37, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model.eval()


@torch.no_grad()
def nanogpt_loop(
    model: GPT,
    idx: torch.Tensor,
    new: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """nanoGPT's sample.py, written out: crop to the last block_size tokens, run them, take the last position."""
    for _ in range(new):
        logits, _ = model(idx[:, -model.config.block_size :])
        logits = logits[:, -1, :]  # (B, V)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator)  # (B, 1)
        idx = torch.cat((idx, nxt), dim=1)
    return idx


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_slide_greedy_equals_the_nanogpt_loop(use_cache, batch):
    model = tiny(scale=3.0)
    idx = torch.randint(0, 37, (batch, 5), generator=torch.Generator().manual_seed(batch))
    out = generate(model, idx, 60, temperature=0, use_cache=use_cache, window="slide")
    assert out.shape == (batch, 65)  # 65 > block_size 16: the window slid 49 times
    assert torch.equal(out, nanogpt_loop(model, idx, 60))
    assert torch.equal(generate(model, idx, 60, temperature=0, use_cache=use_cache), out)  # 'slide' is the default


@pytest.mark.parametrize("use_cache", [True, False])
def test_slide_sampling_equals_the_nanogpt_loop_with_the_same_draws(use_cache):
    model = tiny(scale=2.0)
    idx = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(7))
    for temperature, top_k in [(1.0, None), (0.8, 10)]:
        ours = generate(
            model, idx, 60, temperature, top_k, generator=torch.Generator().manual_seed(11), use_cache=use_cache
        )
        ref = nanogpt_loop(model, idx, 60, temperature, top_k, generator=torch.Generator().manual_seed(11))
        assert torch.equal(ours, ref), (temperature, top_k)


def test_slide_crops_a_prompt_longer_than_block_size():
    model = tiny(scale=3.0)
    idx = torch.randint(0, 37, (2, 20), generator=torch.Generator().manual_seed(1))
    for use_cache in (True, False):
        assert torch.equal(generate(model, idx, 12, temperature=0, use_cache=use_cache), nanogpt_loop(model, idx, 12))


def forward_lengths(model: GPT, window: str, use_cache: bool = True) -> list[int]:
    """The number of tokens fed to each forward pass of 60 greedy tokens from a 5-token prompt."""
    lengths: list[int] = []
    handle = model.register_forward_pre_hook(lambda _module, args: lengths.append(args[0].size(1)))
    try:
        generate(model, torch.zeros(1, 5, dtype=torch.long), 60, temperature=0, use_cache=use_cache, window=window)
    finally:
        handle.remove()
    return lengths


def test_slide_uses_the_cache_while_the_sequence_fits_then_runs_the_window():
    model = tiny()
    # prefill 5 tokens, one token at a time up to 16, then the last 16 tokens from scratch at each step
    assert forward_lengths(model, "slide") == [5] + [1] * 11 + [BLOCK] * 48
    assert forward_lengths(model, "slide", use_cache=False) == list(range(5, BLOCK)) + [BLOCK] * 49
    half = forward_lengths(model, "half")
    # 'half' restarts from the last 8 tokens and goes on with the cache: a pass of 8 every 8 tokens
    assert half[:12] == [5] + [1] * 11 and set(half[12:]) == {1, BLOCK // 2} and half.count(BLOCK // 2) == 6


@pytest.mark.parametrize("prompt_len", [3, 5, 16, 20])
def test_half_equals_its_uncached_run_and_differs_from_slide(prompt_len):
    model = tiny(scale=3.0)
    idx = torch.randint(0, 37, (3, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    half = [generate(model, idx, 60, temperature=0, use_cache=c, window="half") for c in (True, False)]
    assert torch.equal(half[0], half[1])
    seeded = [
        generate(model, idx, 60, 1.0, 10, generator=torch.Generator().manual_seed(5), use_cache=c, window="half")
        for c in (True, False)
    ]
    assert torch.equal(seeded[0], seeded[1])
    slide = generate(model, idx, 60, 1.0, 10, generator=torch.Generator().manual_seed(5))
    fits = max(BLOCK, prompt_len) + 1  # the tokens predicted from one and the same context
    assert torch.equal(seeded[0][:, :fits], slide[:, :fits])
    assert not torch.equal(seeded[0], slide)  # then a shorter context: other tokens from the same draws


def test_unknown_window_is_refused_and_the_cli_offers_the_models_windows():
    from gptforge.cli.args import build_parser

    with pytest.raises(ValueError, match="window"):
        generate(tiny(), torch.zeros(1, 2, dtype=torch.long), 3, window="full")
    args = build_parser().parse_args(["sample"])
    assert args.window == WINDOWS[0] == "slide"
    sample_parser = build_parser()._subparsers._group_actions[0].choices["sample"]
    window = next(a for a in sample_parser._actions if a.dest == "window")
    assert tuple(window.choices) == WINDOWS


def test_sample_cli_greedy_text_equals_the_nanogpt_loop(char_data, tmp_path):
    """`gptforge sample` on a trained checkpoint whose 16-token window fills: greedy text as nanoGPT's loop
    gives it (default window), and 'half' as generate(window='half') gives it."""
    from gptforge.weights.load import load_checkpoint_model

    run = tmp_path / "run"
    r = run_cli(
        "train",
        *tiny_train_args(char_data, run, block_size=BLOCK, max_iters=150, lr_decay_iters=150, eval_interval=150),
    )
    assert r.returncode == 0, r.stderr
    model, tok, _ = load_checkpoint_model(str(run / "ckpt.pt"), "cpu")
    idx = torch.tensor([tok.encode("First")], dtype=torch.long)  # (1, 5)
    expected = {
        "slide": tok.decode(nanogpt_loop(model, idx, 60)[0].tolist()),
        "half": tok.decode(generate(model, idx, 60, temperature=0, window="half", use_cache=False)[0].tolist()),
    }
    assert expected["slide"] != expected["half"]  # the model is trained enough for its context to matter
    options = ["sample", f"--out_dir={run}", "--start=First", "--num_samples=1", "--max_new_tokens=60"]
    for window, extra in [("slide", []), ("half", ["--window=half"])]:
        r = run_cli(*options, "--temperature=0", "--device=cpu", *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout == expected[window] + "\n---------------\n", window
        assert f"{window} window" in r.stderr
