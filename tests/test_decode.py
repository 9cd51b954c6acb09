"""The compiled one-token decode step (`chat` / `serve` --compile): its logits equal a full eager recomputation of
every row's sequence (float32), fed one row at a time as a chat does and several rows of different lengths in one
step as the server does; without a compiler, 'auto' falls back to eager and 'on' is a clear error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.infer import decode
from gptforge.infer.batcher import SlotCache
from gptforge.infer.engine import Rows
from gptforge.model.gpt import GPT, GPTConfig

needs_compiler = pytest.mark.skipif(decode.compiler_missing("cpu") is not None, reason="no C++ compiler")
NANOCHAT = dict(rotary=True, rmsnorm=True, qk_norm=True, relu2=True, untie_head=True, logit_softcap=15.0)


def model_of(kind: str) -> GPT:
    torch.manual_seed(0)
    switches = NANOCHAT if kind == "nanochat" else {}  # 'gpt2': learned positions, LayerNorm, GELU, tied head
    return GPT(GPTConfig(block_size=48, vocab_size=61, n_layer=2, n_head=2, n_embd=32, bias=True, **switches)).eval()


def full_logits(model: GPT, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model.hidden_states(seq)).float()  # (B, T, V): every position's next-token logits


@needs_compiler
@pytest.mark.parametrize("kind", ["nanochat", "gpt2"])
def test_a_chat_fed_one_token_at_a_time_equals_recomputing_everything(kind):
    model = model_of(kind)
    seq = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(1))
    full = full_logits(model, seq)
    rows = Rows(model, step=decode.DecodeStep(model))
    with torch.no_grad():
        got = {9: rows.feed(seq[:, :10])}  # the prompt: eager
        got.update({t: rows.feed(seq[:, t : t + 1]) for t in range(10, 25)})  # compiled steps
        got[31] = rows.feed(seq[:, 25:32])  # a next turn of several tokens: eager, against the cached 25
        got.update({t: rows.feed(seq[:, t : t + 1]) for t in range(32, 40)})
    assert rows.length == 40
    for t, logits in got.items():
        torch.testing.assert_close(logits, full[:, t], rtol=0, atol=2e-5)


@needs_compiler
@pytest.mark.parametrize("kind", ["nanochat", "gpt2"])
def test_rows_of_different_lengths_in_one_step_each_get_their_own_logits(kind):
    """The server's layout: each prompt prefilled into its own slot, then every row stepped together, each at its
    own length, batch sizes changing from step to step (a graph for 1, one for 2 and up)."""
    model = model_of(kind)
    gen = torch.Generator().manual_seed(2)
    lengths = [7, 19, 12, 3]
    seqs = [torch.randint(0, 61, (1, n + 8), generator=gen) for n in lengths]
    cache, step = SlotCache(model.config.n_layer, 5, model.config.block_size), decode.DecodeStep(model)
    with torch.no_grad():
        for slot, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            cache.prefill(slot)
            model.hidden_states(seq[:, :n], cache=cache)
        held = list(lengths)  # tokens each row holds; rows 0..m-1 take a step, the others wait
        for m in (4, 3, 2, 1, 4, 2, 1):
            tokens = torch.stack([seqs[r][0, held[r]] for r in range(m)])[:, None]
            logits = step(tokens, torch.tensor(held[:m]), cache.k, cache.v)
            for r in range(m):
                expected = full_logits(model, seqs[r][:, : held[r] + 1])[0, -1]
                torch.testing.assert_close(logits[r], expected, rtol=0, atol=2e-5)
                held[r] += 1


def fake_lm() -> SimpleNamespace:
    return SimpleNamespace(device="cpu", decode=None, model=model_of("nanochat"))


def test_without_a_compiler_auto_stays_eager_and_on_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(decode, "compiler_missing", lambda device: "no C++ compiler (g++) found")
    lm = fake_lm()
    decode.enable_compile(lm, "auto", slots=1)
    assert lm.decode is None and "decode: eager (no C++ compiler (g++) found)" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"--compile on: no C\+\+ compiler \(g\+\+\) found; use --compile=off"):
        decode.enable_compile(lm, "on", slots=1)
    decode.enable_compile(lm, "off", slots=1)
    assert lm.decode is None
