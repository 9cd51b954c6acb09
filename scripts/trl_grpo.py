"""TRL's GRPOTrainer on the problems `gptforge rl` trains on: the other side of a speed / quality comparison. Not a
test and not part of gptforge: a script run in a separate environment that has TRL (gptforge itself never needs it).

It starts from a chat run exported to a Hugging Face folder (`gptforge export --out_dir=RUN --to=FOLDER`: a
NanoChat folder for models with the modern switches), draws each step's prompts from gptforge's own generator
(rl/rewards.py PromptSource: step s gets exactly the problems `gptforge rl` draws at step s for the same
--kinds and --seed), rewards an answer 1.0 when its text, whitespace at the ends aside, is the problem's answer
(else 0.0) and takes one optimizer step per step on freshly sampled answers. The settings carry `gptforge rl`'s
names and defaults (but --kinds: count,sub,mul) where TRL has the same thing; --out gets one JSON line per step
(its wall seconds, the reward, pass@1, pass@G and everything TRL logged) and a last line with TRL's summary.

    python3 -m venv /work/trlvenv && /work/trlvenv/bin/pip install torch==2.13.0 && /work/trlvenv/bin/pip install trl
    /work/trlvenv/bin/pip install --no-deps -e . && /work/trlvenv/bin/pip install tiktoken tqdm numpy rustbpe
    gptforge export --out_dir=out-chat-sft --to=hf-chat           # in gptforge's own environment
    /work/trlvenv/bin/python scripts/trl_grpo.py --hf_folder=hf-chat --kinds=count,sub,mul --max_steps=100 \\
        --prompts_per_step=16 --num_generations=8 --max_completion_length=64 --out=trl_grpo.jsonl

How the settings map to TRL, and what cannot be matched exactly, is in `trl_settings` and `NOT_MATCHED` below
(printed at the start of each run)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from gptforge.chat.synthetic import ALL_KINDS
from gptforge.rl.rewards import PromptSource

ANSWER_END = "<|assistant_end|>"  # a gptforge chat model ends its answer with it (infer/chat_model.py ANSWER_END)

NOT_MATCHED = """\
not matched exactly (TRL vs gptforge rl):
  sampling   TRL samples the whole step (prompts_per_step x num_generations rows, left-padded) in one
             model.generate call with the global torch RNG; gptforge samples group by group (the prompt prefilled
             once) with a generator seeded per (seed, step, prompt): same distribution, different draws.
  vocab      gptforge never samples ids at or past the tokenizer's vocabulary (an embedding's padding rows); TRL
             samples from every logit (the same where config.vocab_size equals the tokenizer's, as here).
  length     gptforge cuts max_completion_length to the room left in block_size; TRL does not.
  logprobs   TRL's log-probabilities are of logits / temperature, gptforge's of the raw logits: the same gradient
             at temperature 1 only.
  batching   TRL shuffles the step's answers before cutting them into micro-batches of micro_batch_rows;
             gptforge's micro-batches stay inside one group. The loss and the gradient are the same sums.
  warm-up    TRL's linear warm-up gives step s s / warmup_steps of the rate, gptforge's (s + 1) / warmup_steps.
  decay      AdamW's weight decay: TRL spares biases and norm weights, gptforge every tensor of fewer than two
             dimensions (the default 0 makes this moot).
  bf16       --bf16: TRL's mixed precision (accelerate's autocast); gptforge's --dtype=bfloat16 autocasts
             sampling and the update.
  end token  both stop an answer at <|assistant_end|>, count it among the answer's tokens and score the text
             before it; truncated answers are kept in both (mask_truncated_completions=False)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf_folder", required=True, help="the exported chat model (gptforge export --to=FOLDER)")
    p.add_argument("--kinds", default="count,sub,mul", help="comma-separated synthetic task kinds drawn as prompts")
    p.add_argument("--max_steps", type=int, default=100, help="RL steps, one optimizer step each")
    p.add_argument("--prompts_per_step", type=int, default=16, help="prompts drawn per step")
    p.add_argument("--num_generations", type=int, default=8, help="answers sampled per prompt (the group, G)")
    p.add_argument("--max_completion_length", type=int, default=64, help="most tokens an answer may have")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest tokens only; 0 = all")
    p.add_argument("--learning_rate", type=float, default=1e-4, help="AdamW's peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument(
        "--lr_schedule",
        default="linear",
        choices=("constant", "linear"),
        help="after warm-up: constant, or linear down to 0 at max_steps",
    )
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.99)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient's norm at this value; 0 = off")
    p.add_argument("--beta", type=float, default=0.0, help="weight of the KL penalty to the starting model")
    p.add_argument("--epsilon", type=float, default=0.2, help="the clipped ratio's range, [1 - eps, 1 + eps]")
    p.add_argument(
        "--scale_rewards",
        default="none",
        choices=("none", "group"),
        help="divide each advantage by its group's reward standard deviation, or not",
    )
    p.add_argument(
        "--micro_batch_rows",
        type=int,
        default=0,
        help="answers per forward and backward pass of the update; 0 = one group (num_generations)",
    )
    p.add_argument("--seed", type=int, default=1337, help="seed of the prompts drawn (and of TRL's sampling)")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16 mixed precision (default: float32)")
    p.add_argument("--out", default="trl_grpo.jsonl", help="JSONL file: one line per step, then TRL's summary")
    args = p.parse_args(argv)
    unknown = [k for k in args.kinds.split(",") if k and k not in ALL_KINDS]
    if unknown or not args.kinds.strip(","):
        p.error(f"--kinds: comma-separated kinds of {','.join(ALL_KINDS)}; unknown: {unknown or '(none)'}")
    if args.num_generations < 2:
        p.error("--num_generations must be at least 2")
    if args.temperature <= 0:
        p.error("--temperature must be > 0: TRL always samples and divides the logits by it")
    rows = args.micro_batch_rows or args.num_generations
    if (args.prompts_per_step * args.num_generations) % rows:
        p.error(f"--micro_batch_rows={rows} must divide prompts_per_step x num_generations")
    return args


def step_prompts(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """Each step's rows (prompt messages, answer, key): gptforge rl's PromptSource.step(s, prompts_per_step)."""
    source = PromptSource(args.kinds, "", args.seed)
    steps = []
    for s in range(args.max_steps):
        steps.append([
            {"prompt": p.messages, "answer": str(p.example["answer"]), "key": str(p.example.get("key", ""))}
            for p in source.step(s, args.prompts_per_step)
        ])  # fmt: skip
    return steps


def trl_settings(args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    """GRPOConfig's keyword arguments for gptforge rl's settings (the comments say why where it is not a rename)."""
    rows = args.micro_batch_rows or args.num_generations
    accumulation = args.prompts_per_step * args.num_generations // rows
    schedule = {"linear": "linear", "constant": "constant_with_warmup" if args.warmup_steps else "constant"}
    return dict(
        output_dir=output_dir,
        max_steps=args.max_steps,
        # per_device_train_batch_size counts answers (rows), not prompts. One generation batch of
        # prompts_per_step x num_generations answers per optimizer step: steps_per_generation micro-batches of
        # micro_batch_rows, all accumulated into that one step (num_iterations=1: every step samples fresh)
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=args.num_generations,
        num_iterations=1,
        shuffle_dataset=False,  # the dataset holds the steps' prompts in order: step s reads rows s*P .. s*P+P-1
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_k=args.top_k,  # 0 = off, as gptforge's
        top_p=1.0,
        min_p=None,
        repetition_penalty=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type=schedule[args.lr_schedule],
        warmup_steps=args.warmup_steps,
        optim="adamw_torch",  # torch's AdamW, unfused: gptforge's on CPU
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_epsilon=1e-8,
        weight_decay=args.weight_decay,
        max_grad_norm=args.grad_clip,  # 0 = no clipping in both
        beta=args.beta,
        use_bias_correction_kl=False,  # gptforge's KL term is k3 alone, not multiplied by the ratio
        epsilon=args.epsilon,
        epsilon_high=None,  # symmetric clipping
        scale_rewards=args.scale_rewards,
        # "dapo": the sum over the batch's answer tokens divided by the batch's answer tokens (over every
        # micro-batch), gptforge's normalisation; "bnpo" divides per micro-batch, "grpo" per answer, "dr_grpo" by
        # rows x max_completion_length
        loss_type="dapo",
        importance_sampling_level="token",
        mask_truncated_completions=False,
        top_entropy_quantile=1.0,
        use_cpu=True,
        bf16=args.bf16,  # TRL's configs default to bf16=True: set it either way
        fp16=False,
        activation_checkpointing=False,  # TRL's configs default to True; gptforge keeps activations
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=1,
        logging_first_step=True,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        log_completions=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.hf_folder)
    model = AutoModelForCausalLM.from_pretrained(args.hf_folder, dtype=torch.float32)
    end = tokenizer.convert_tokens_to_ids(ANSWER_END)
    if end is None or end == tokenizer.unk_token_id:
        sys.exit(f"{args.hf_folder}: its tokenizer has no {ANSWER_END}: not a gptforge chat model's export")
    # The export's tokenizer names <|bos|> its eos token (the documents' separator) and its generation_config
    # <|assistant_end|>: TRL stops at and masks after every one of those, gptforge at <|assistant_end|> only. An
    # answer ends at <|assistant_end|> alone; <|bos|> pads (after the end, masked out).
    pad = tokenizer.pad_token if tokenizer.pad_token is not None else tokenizer.bos_token
    tokenizer.eos_token, tokenizer.pad_token = ANSWER_END, pad
    model.generation_config.eos_token_id = end
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    steps = step_prompts(args)
    dataset = Dataset.from_list([row for rows in steps for row in rows])
    G = args.num_generations
    seen: dict[int, list[float]] = {}

    def exact_match(prompts, completions, completion_ids, answer, key, trainer_state, **kwargs) -> list[float]:
        """1.0 when the answer's text (its tokens before <|assistant_end|>, special tokens written out as
        gptforge's decode writes them) stripped is the problem's answer, else 0.0."""
        step = trainer_state.global_step
        expected = [row["key"] for row in steps[step] for _ in range(G)] if step < len(steps) else None
        if list(key) != expected:
            raise RuntimeError(f"step {step}: TRL's prompts are not gptforge rl's of that step: {list(key)[:G]}...")
        rewards = []
        for ids, want in zip(completion_ids, answer, strict=True):
            ids = list(ids)[:-1] if ids and ids[-1] == end else list(ids)
            text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            rewards.append(1.0 if text.strip() == str(want).strip() else 0.0)
        seen[step] = rewards
        return rewards

    class StepRecords(TrainerCallback):
        """Each optimizer step's wall seconds (on_step_begin to on_step_end: sampling, scoring, the update) and,
        when TRL logs it right after, one JSON line with TRL's record."""

        def __init__(self, out):
            self.out, self.t0, self.begin, self.pending = out, 0.0, None, None

        def on_train_begin(self, a, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            self.pending = {"step_s": now - self.t0, "elapsed_s": now - self.begin}

        def on_log(self, a, state, control, logs=None, **kw):
            logs = dict(logs or {})
            if self.pending is None:  # the end of training: TRL's summary (train_runtime, ...)
                self.write({"kind": "end", "steps": state.global_step, **logs})
                return
            step = state.global_step - 1  # 0-based, as gptforge rl's records: the step's prompts are step(step)
            rewards = seen.pop(step, [])
            groups = [rewards[i : i + G] for i in range(0, len(rewards), G)]
            record = {
                "step": step,
                "kind": "rl",
                **self.pending,
                "reward": sum(rewards) / max(1, len(rewards)),
                "pass_at_1": sum(r > 0 for r in rewards) / max(1, len(rewards)),
                f"pass_at_{G}": sum(any(r > 0 for r in g) for g in groups) / max(1, len(groups)),
                "answer_tokens": logs.get("completions/mean_length"),
                "lr": logs.get("learning_rate"),
                "trl": logs,
            }
            self.pending = None
            self.write(record)
            print(
                f"step {step:4d} | {record['step_s']:7.2f} s | reward {record['reward']:.3f} | pass@{G} "
                f"{record[f'pass_at_{G}']:.3f} | answer tokens {record['answer_tokens'] or 0:.1f} | loss "
                f"{logs.get('loss', math.nan):.4f} | grad norm {logs.get('grad_norm', math.nan):.3f}",
                flush=True,
            )

        def write(self, record):
            record["time"] = round(time.time(), 3)
            self.out.write(json.dumps(record, allow_nan=True) + "\n")
            self.out.flush()

    output_dir = tempfile.mkdtemp(prefix="trl_grpo_")  # TRL wants one; nothing is saved there
    settings = trl_settings(args, output_dir)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {type(model).__name__} {params:.2f}M "
        f"parameters from {args.hf_folder}; answers end at {ANSWER_END} ({end}), pad {tokenizer.pad_token} "
        f"({tokenizer.pad_token_id})\nGRPOConfig: "
        + ", ".join(f"{k}={v}" for k, v in settings.items() if k != "output_dir")
        + f"\n{NOT_MATCHED}",
        flush=True,
    )
    try:
        with open(args.out, "w", encoding="utf-8") as out:
            trainer = GRPOTrainer(
                model=model,
                processing_class=tokenizer,
                reward_funcs=[exact_match],
                args=GRPOConfig(**settings),
                train_dataset=dataset,
                callbacks=[StepRecords(out)],
            )
            trainer.remove_callback(PrinterCallback)
            if trainer.eos_token_ids != [end]:
                sys.exit(f"TRL would end answers at {trainer.eos_token_ids}, not at {ANSWER_END} ({end}) alone")
            trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
