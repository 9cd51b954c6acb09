"""`gptforge rl`'s settings, each written once (default, doc, allowed values, check): read from config files and
--key=value options like training's (core/config_file.py load_settings). Names follow TRL's GRPOConfig where it has
one (num_generations, max_completion_length, temperature, top_k, beta, epsilon, num_iterations, scale_rewards).
No torch here, so `gptforge rl --help` is instant."""

from __future__ import annotations

from dataclasses import dataclass

from gptforge.chat.synthetic import ALL_KINDS
from gptforge.core.settings import REQUIRED, below_one, not_negative, positive, setting
from gptforge.infer.options import TOOL_CHOICES, TOOLS_HELP

DTYPES = ("auto", "float32", "bfloat16")


def _kinds(value: str) -> str | None:
    unknown = [k for k in value.split(",") if k and k not in ALL_KINDS]
    if unknown or not value.strip(","):
        return f"must be comma-separated synthetic task kinds ({','.join(ALL_KINDS)}); unknown: {unknown or '(none)'}"
    return None


def _at_least_two(value: int) -> str | None:
    return "must be at least 2: the group's mean is the baseline of each answer's reward" if value < 2 else None


def _reward(value: str) -> str | None:
    if value and (":" not in value or not value.rpartition(":")[2].isidentifier()):
        return "must be FILE.py:FUNCTION (a Python file and the name of the function in it)"
    return None


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """Every setting of an RL run: where it starts, what it is rewarded for, how it samples and how it learns."""

    init_from: str = setting(
        REQUIRED,
        "the chat model to improve: a chat run's folder (its ckpt.pt, from --task=sft) or a Hugging Face chat "
        "model's folder (config.json, model.safetensors, a chat template: gptforge export writes one)",
        section="I/O",
    )
    out_dir: str = setting("out-chat-rl", "run folder: ckpt.pt (a chat model), rl_config.json, metrics.jsonl")
    kinds: str = setting("count,spell,system", "synthetic task kinds drawn as prompts (their training split)", _kinds)
    prompts: str = setting(
        "", "a JSONL file of your own prompts, {'messages': [...], 'answer': ...} a line; replaces --kinds"
    )
    reward: str = setting(
        "",
        "FILE.py:FUNCTION called as f(prompt, answer, example) -> float; default: exact "
        "match of the answer (1.0 or 0.0)",
        _reward,
    )
    max_steps: int = setting(
        100, "RL steps: each samples, scores and takes one or more optimizer steps", positive, section="sampling"
    )
    prompts_per_step: int = setting(16, "prompts drawn per step, over all processes", positive)
    num_generations: int = setting(8, "answers sampled per prompt (the group, G)", _at_least_two)
    max_completion_length: int = setting(64, "most tokens an answer may have", positive)
    temperature: float = setting(1.0, "sampling temperature of the answers", not_negative)
    top_k: int = setting(0, "sample among the k likeliest tokens only; 0 = all", not_negative)
    tools: str = setting(
        "calculator", f"{TOOLS_HELP}; its output is fed to the answer and never trained on", choices=TOOL_CHOICES
    )
    scale_rewards: str = setting(
        "none",
        "divide each advantage by its group's reward standard deviation ('group', "
        "GRPO's) or not ('none', Dr. GRPO's and nanochat's)",
        choices=("none", "group"),
    )
    optimizer: str = setting(
        "adamw", "'adamw', or 'muon': the blocks' matrices by Muon at muon_lr, the rest by AdamW",
        choices=("adamw", "muon"), section="learning",
    )  # fmt: skip
    learning_rate: float = setting(1e-4, "AdamW's peak learning rate")
    muon_lr: float = setting(1e-3, "optimizer='muon': the Muon matrices' peak learning rate", not_negative)
    warmup_steps: int = setting(0, "steps of linear learning-rate warm-up", not_negative)
    lr_schedule: str = setting(
        "linear", "after warm-up: constant, or linear down to 0 at max_steps", choices=("constant", "linear")
    )
    adam_beta1: float = setting(0.9, "AdamW's beta1", below_one)
    adam_beta2: float = setting(0.99, "AdamW's beta2", below_one)
    weight_decay: float = setting(0.0, "AdamW's weight decay", not_negative)
    grad_clip: float = setting(1.0, "clip the gradient's norm at this value; 0 = off", not_negative)
    beta: float = setting(0.0, "weight of the KL penalty to the starting model; 0 = none (no copy kept)", not_negative)
    epsilon: float = setting(0.2, "the clipped ratio's range, [1 - epsilon, 1 + epsilon]", below_one)
    num_iterations: int = setting(
        1, "optimizer steps per sampled batch (more than 1: the clipped ratio applies)", positive
    )
    micro_batch_rows: int = setting(
        0, "most answers per forward and backward pass of the update, whole groups; 0 = no limit (groups whose "
        "answers differ more than 2x in length go in separate passes either way)",
        not_negative,
    )  # fmt: skip
    eval_interval: int = setting(
        20,
        "steps between evaluations on held-out problems; 0 = never",
        not_negative,
        section="evaluation and checkpoints",
    )
    eval_examples: int = setting(
        50,
        "held-out problems per kind (or of --eval_prompts, its first N) answered greedily (pass@1) at each "
        "evaluation; 0 = none",
        not_negative,
    )
    eval_prompts: str = setting(
        "",
        "a JSONL file of held-out prompts (the --prompts format) answered greedily and scored with the reward at "
        "each evaluation, in place of the kinds' held-out problems",
    )
    eval_pass_k: int = setting(
        0,
        "of those, how many per kind (or of the file) also get num_generations samples (pass@k); 0 = none",
        not_negative,
    )
    ckpt_interval: int = setting(10, "steps between checkpoints (ckpt.pt; a resume continues from the last)", positive)
    log_interval: int = setting(1, "steps between log lines", positive)
    seed: int = setting(1337, "seed of the prompts drawn and the answers sampled at each step", section="device")
    device: str = setting("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = setting(
        "auto", "autocast dtype of sampling and the update; auto: bfloat16 where it is faster", choices=DTYPES
    )
    backend: str = setting("gloo", "torchrun's process group backend", choices=("gloo", "nccl"))
