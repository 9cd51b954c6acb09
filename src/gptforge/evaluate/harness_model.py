"""gptforge's model for EleutherAI's lm-evaluation-harness (lm-eval), registered with it as 'gptforge'.

lm-eval turns a task into requests of three kinds: the log-likelihood of a continuation after a context, the
rolling log-likelihood of a whole text, and generation until a stop string. GPTForgeLM answers them with a
gptforge model the way lm-eval's Hugging Face model (HFLM) answers them for a causal LM: the same split of
context and continuation into tokens (lm-eval's own TemplateLM does it), the same left truncation to the
model's context, the same rolling windows (lm-eval's utilities), log-softmax in float32. A run and its
`gptforge export` folder under `--model hf` therefore score alike (tests/test_lm_eval.py).

Importing this module needs lm-eval installed (`pip install 'gptforge[eval]'`); `gptforge eval lm-eval`
checks that first (gptforge.evaluate.harness). After `import gptforge.evaluate.harness_model`, lm-eval's
Python API also takes `model="gptforge", model_args="ckpt=PATH"`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from gptforge.chat.render import chat_special_ids, encode, render_prompt
from gptforge.chat.template import CHAT_TEMPLATE
from gptforge.core.device import autocast_context, device_type, inference_dtype, resolve_device
from gptforge.core.errors import UserError
from gptforge.infer.chat_model import decode_with_specials, encode_with_specials, is_chat_model, special_tokens
from gptforge.infer.engine import generate_stream
from gptforge.weights.load import load_model


def check_text_tokenizer(tokenizer: Any) -> None:
    """lm-eval's tasks are arbitrary text: a byte-level BPE (GPT-2's, or an own one: its <|bos|> is the
    end-of-text token lm-eval puts before a rolling text) encodes any text, a run's character vocabulary only the
    characters of its training file (Tiny Shakespeare's 65 have no digits, no '%', no accents)."""
    if getattr(tokenizer, "kind", None) == "char":
        chars = "".join(getattr(tokenizer, "itos", []) or [])
        raise UserError(
            f"lm-eval's tasks are text in any characters, and this run's tokenizer is {tokenizer.kind!r}: a "
            f"character vocabulary of {len(chars)} symbols from its training text ({chars[:40]!r}...), which cannot "
            "encode the rest (digits, most punctuation, other scripts) and whose model never saw words as tokens. "
            "Score a run trained with a BPE (`gptforge prepare shakespeare`, --tokenizer NAME, or --init_from=gpt2)"
        )


@register_model("gptforge")
class GPTForgeLM(TemplateLM):
    """A gptforge checkpoint (or GPT-2's weights) as an lm-eval model; model_args are ckpt, out_dir, init_from,
    device, dtype, batch_size, max_gen_toks."""

    def __init__(
        self,
        ckpt: str | None = None,
        out_dir: str = "out",
        init_from: str = "resume",
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        max_gen_toks: int = 256,
        **unused: Any,
    ) -> None:
        super().__init__()
        self._device = resolve_device(device or "auto")
        model, tokenizer, checkpoint = load_model(out_dir, ckpt, init_from, self._device)
        check_text_tokenizer(tokenizer)
        self.model, self.tok = model, tokenizer
        # a chat model (issue 28): its chat template renders lm-eval's conversations; its answers end at its end token
        self.chat = is_chat_model(tokenizer, checkpoint, init_from)
        self.special_ids = chat_special_ids(tokenizer) if self.chat else {}
        self.specials = special_tokens(tokenizer, self.special_ids) if self.chat else {}
        ends = ("<|assistant_end|>", "<|user_start|>")
        self.stop_ids = {tokenizer.eot_token, *(self.special_ids[name] for name in ends if self.chat)}
        kind = device_type(self._device)
        self.dtype = inference_dtype(dtype, kind, model.config.n_embd)
        self.ctx = autocast_context(kind, self.dtype)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size or 1)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_token

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    @property
    def device(self) -> str:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if self.chat:  # the chat template's text names its special tokens: they become their ids again
            return encode_with_specials(self.tok, string, self.specials)
        return self.tok.encode(string)

    @property
    def tokenizer_name(self) -> str:
        return "gptforge-chat" if self.chat else "gptforge"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return CHAT_TEMPLATE if self.chat else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's conversation in the chat format (chat/render.py's), as text whose special tokens tok_encode
        reads back; without add_generation_prompt a last assistant message stays open, to be continued."""
        if not self.chat:
            raise UserError("--apply_chat_template: this model is not a chat model (no SFT run, no chat_template)")
        if add_generation_prompt:
            ids = render_prompt(chat_history, self.tok, self.special_ids)
        else:
            ids = encode(chat_history, self.tok).render(self.special_ids)[0]
            ids = ids[:-1] if chat_history and chat_history[-1]["role"] == "assistant" else ids
        return decode_with_specials(self.tok, ids, self.specials)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    @torch.no_grad()
    def log_probs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each row's log-softmax over the tokenizer's vocabulary at every position, (len(row), V) in float32;
        one forward pass over the rows padded on the right (causal attention: the padding changes nothing before
        it). A vocabulary padded to 50,304 rows is cut to GPT-2's 50,257 first, as `gptforge export` cuts it:
        the padding rows are no tokens, and their probability would otherwise come off every real token's."""
        width = max(map(len, rows))
        idx = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            idx[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        with self.ctx:
            logits = self.model.logits(self.model.hidden_states(idx.to(self._device)))
        logp = F.log_softmax(logits[..., : self.tok.vocab_size].float(), dim=-1)
        return [logp[i, : len(row)] for i, row in enumerate(rows)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives the continuation) for
        each (strings, context tokens, continuation tokens); longest first, so a batch holds similar lengths."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="log-likelihoods", disable=disable_tqdm)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            rows, conts = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                rows.append((context + continuation)[-(self.max_length + 1) :][:-1])  # HFLM's left truncation
                conts.append(continuation)
            for i, row, cont, logp in zip(chunk, rows, conts, self.log_probs(rows), strict=True):
                picked = logp[len(row) - len(cont) :]  # the positions that predict the continuation
                target = torch.tensor(cont, device=picked.device)
                greedy = bool((picked.argmax(-1) == target).all())
                results[i] = (float(picked.gather(1, target[:, None]).sum()), greedy)
            bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood: lm-eval's disjoint windows of max_length tokens, EOT before the first."""
        totals = []
        for (text,) in tqdm([r.args for r in requests], desc="rolling log-likelihoods", disable=disable_tqdm):
            windows = [
                ((), *lm_utils.make_disjoint_window(w))
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            totals.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample / temperature) text after each context, cut at the first stop
        string of `until` (and at GPT-2's <|endoftext|>), at most max_gen_toks tokens."""
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc="generating", disable=disable_tqdm):
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            tokens = self.tok_encode(context)[-self.max_length :] or [self.eot_token_id]
            idx = torch.tensor([tokens], dtype=torch.long, device=self._device)
            new: list[int] = []
            with self.ctx:
                for token in generate_stream(self.model, idx, max_new, temperature=temperature):
                    if int(token) in self.stop_ids:
                        break
                    new.append(int(token))
                    if any(stop in self.tok_decode(new) for stop in until):
                        break
            text = self.tok_decode(new)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out
