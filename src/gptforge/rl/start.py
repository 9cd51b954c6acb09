"""Where an RL run starts, decided and checked before anything is written: a chat run's checkpoint (--init_from), or
the run's own last checkpoint in --out_dir (it continues from there: auto-resume), its tokenizer, the prompts and
the reward. Its checkpoints are the chat model's checkpoint with the weights moved on plus what a resume needs
(the optimizer and the step): `gptforge chat / serve / eval chat / export` read them as they read the SFT run's.

A resume needs no random state: each step's prompts and samples are drawn from generators seeded by (seed, step,
rank), so a run resumed at step N draws what the uninterrupted run drew there."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from gptforge.chat.render import chat_special_ids, render_prompt
from gptforge.chat.tools import EXAMPLE_FUNCTIONS
from gptforge.core.cpu import half_pays
from gptforge.core.distributed import DistEnv
from gptforge.core.errors import UserError
from gptforge.core.files import CKPT
from gptforge.core.shape import MODEL_ARGS
from gptforge.infer.chat_model import ANSWER_END, is_chat_model
from gptforge.infer.toolcalls import CallWatcher, builtin_tools, scored_tokens
from gptforge.model.gpt import GPT
from gptforge.model.optim import MuonSettings, configure_optimizer
from gptforge.rl.options import RLConfig
from gptforge.rl.rewards import Prompt, PromptSource, Reward, check_answers_given, load_reward, score
from gptforge.weights.checkpoint import FORMAT_VERSION, save_checkpoint
from gptforge.weights.load import load_checkpoint_model, load_model

RL_CONFIG = "rl_config.json"  # the run's settings, beside its checkpoint (config.json stays the chat run's)
NOT_SAVED = (
    "model",
    "optimizer",
    "scaler",
    "rng",
    "rng_per_rank",
    "data_state",
    "rl",
)  # replaced or not a chat model's


@dataclass
class Start:
    """What a run works with: the model (float32 weights, on the device), its optimizer, the starting model for
    the KL penalty (beta > 0), the tokenizer and its chat ids, the step to start at, the checkpoint's other keys."""

    model: GPT
    optimizer: torch.optim.Optimizer
    reference: GPT | None
    tokenizer: Any
    special_ids: dict[str, int]
    step: int
    base: dict[str, Any]
    source: PromptSource
    reward: Reward
    tools: frozenset[str] = frozenset()  # the built-in tools the engine runs while the model answers

    @property
    def end(self) -> int:
        return self.special_ids[ANSWER_END]

    @functools.cached_property
    def vocab(self) -> int:
        """Answers draw ids below it: the tokenizer's and its chat tokens', never the embedding's padding rows."""
        return max(self.tokenizer.vocab_size, *(i + 1 for i in self.special_ids.values()))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return render_prompt(prompt.messages, self.tokenizer, self.special_ids, tools=prompt.tools)

    def watcher(self) -> CallWatcher:
        """A row's tool-call watcher, as `eval chat`'s: the built-in tools on, the synthetic functions run here."""
        runners = {name: run for name, (_, run) in EXAMPLE_FUNCTIONS.items()}
        decode, encode = self.tokenizer.decode, self.tokenizer.encode
        return CallWatcher(self.special_ids, decode, encode, self.tools, runners=runners)

    def answer_text(self, tokens: list[int]) -> str:
        """What the reward reads of an answer: its text after the last tool output (eval chat's rule)."""
        return self.tokenizer.decode(scored_tokens(tokens, self.special_ids))


def begin(cfg: RLConfig, env: DistEnv) -> Start:
    """The run's model, optimizer and inputs, every input checked; nothing is written here."""
    if cfg.prompts_per_step % env.world_size:
        raise UserError(
            f"--prompts_per_step={cfg.prompts_per_step} does not divide over {env.world_size} processes; make it a "
            f"multiple of {env.world_size}"
        )
    reward = load_reward(cfg.reward)
    source = PromptSource(cfg.kinds, cfg.prompts, cfg.seed, cfg.eval_prompts)
    if source.records is not None:
        check_answers_given(reward, source.records, cfg.prompts)
    if source.held_out is not None:
        check_answers_given(reward, source.held_out, cfg.eval_prompts)
    resumed = os.path.isfile(os.path.join(cfg.out_dir, CKPT))
    model, tokenizer, ckpt = load_start(cfg, env)
    if resumed and "rl" not in ckpt:
        raise UserError(
            f"--out_dir={cfg.out_dir} holds another run's {CKPT} (not an RL run's); choose another --out_dir"
        )
    if not is_chat_model(tokenizer, ckpt, cfg.init_from):
        raise UserError(
            f"--init_from={cfg.init_from} is a base model: RL improves a chat model; fine-tune it on conversations "
            "first (gptforge train --task=sft, docs/RECIPES.md)"
        )
    muon = None
    if cfg.optimizer == "muon":  # Newton-Schulz in bf16 where its products are faster (core/cpu.py measures)
        fast = env.device_type == "cuda" or (env.device_type == "cpu" and half_pays("bfloat16"))
        muon = MuonSettings(cfg.muon_lr, 0.95, 0, "bfloat16" if fast else "float32")
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    optimizer = configure_optimizer(model, cfg.weight_decay, cfg.learning_rate, betas, env.device_type, muon)
    step = 0
    if resumed:
        optimizer.load_state_dict(ckpt["optimizer"])
        step = int(ckpt["rl"]["step"])
        env.say(f"resuming the RL run in {cfg.out_dir} at step {step} (of {cfg.max_steps})")
    reference = _reference(cfg, env, resumed, model)
    base = {k: v for k, v in ckpt.items() if k not in NOT_SAVED}
    ids = chat_special_ids(tokenizer)
    start = Start(model, optimizer, reference, tokenizer, ids, step, base, source, reward, builtin_tools(cfg.tools))
    check_prompts_fit(start, cfg)
    first = (source.records or source.step(0, 1))[0]
    score(reward, first, "")  # a reward that fails on every answer fails here, before anything is written
    return start


def load_start(cfg: RLConfig, env: DistEnv) -> tuple[GPT, Any, dict[str, Any]]:
    """(model, tokenizer, checkpoint) of the run's own last checkpoint, or of --init_from: a chat run's ckpt.pt, or
    a Hugging Face chat folder (config.json + model.safetensors, a chat_template; its checkpoint made here)."""
    own = os.path.join(cfg.out_dir, CKPT)
    if os.path.isfile(own):
        return load_checkpoint_model(own, env.device)
    if os.path.isfile(os.path.join(cfg.init_from, CKPT)):
        return load_checkpoint_model(os.path.join(cfg.init_from, CKPT), env.device)
    if os.path.isfile(os.path.join(cfg.init_from, "config.json")):
        model, tokenizer, _ = load_model("", None, cfg.init_from, env.device)
        chat = is_chat_model(tokenizer, None, cfg.init_from)
        ckpt = {"model_args": {k: getattr(model.config, k) for k in MODEL_ARGS}, "tokenizer": tokenizer.spec()}
        return model, tokenizer, {**ckpt, "config": {"task": "sft" if chat else "pretrain"}, "iter_num": 0}
    raise UserError(
        f"--init_from={cfg.init_from}: neither a run's {CKPT} nor a Hugging Face model folder there; give a chat "
        "run's folder (gptforge train --task=sft) or an exported chat model's"
    )


def _reference(cfg: RLConfig, env: DistEnv, resumed: bool, model: GPT) -> GPT | None:
    """The starting model the KL penalty holds the policy near (beta > 0): a frozen copy of --init_from's weights."""
    if cfg.beta <= 0:
        return None
    reference = copy.deepcopy(model)
    if resumed:  # the starting weights again, not the resumed run's
        reference.load_state_dict(load_start(dataclasses.replace(cfg, out_dir=os.devnull), env)[0].state_dict())
    return reference.requires_grad_(False).eval()


def check_prompts_fit(start: Start, cfg: RLConfig) -> None:
    """Every file prompt (or a first step's synthetic ones) leaves room for an answer in the context."""
    first = start.source.records or start.source.step(0, cfg.prompts_per_step)
    files = [(cfg.prompts, first), (cfg.eval_prompts, start.source.held_out)]
    block = start.model.config.block_size
    for path, prompts in files:
        for p in prompts or []:
            n = len(start.prompt_ids(p))
            if n >= block:
                where = f"{path}:{p.example.get('line')}" if path else f"a {p.kind} prompt"
                raise UserError(
                    f"{where}: its {n} tokens leave no room for an answer in the model's {block}; shorten it"
                )


def save(cfg: RLConfig, start: Start, step: int) -> None:
    """ckpt.pt: the chat checkpoint's keys, the weights after `step` steps, the optimizer, and the RL state."""
    state = {
        **start.base,
        "model": start.model.state_dict(),
        "optimizer": start.optimizer.state_dict(),
        "rl": {"step": step, "config": dataclasses.asdict(cfg)},
        "format_version": FORMAT_VERSION,
    }
    save_checkpoint(os.path.join(cfg.out_dir, CKPT), state)
