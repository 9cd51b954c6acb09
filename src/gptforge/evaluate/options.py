"""The options of `gptforge eval hellaswag | loss | lm-eval | chat`, each written once (default, type, allowed values,
help text); the command line is built from them (cli/parsers.py) and each evaluation takes them as its parameters.
No torch here, so `gptforge eval ... --help` stays instant."""

from __future__ import annotations

from dataclasses import dataclass

from gptforge.chat.synthetic import ALL_KINDS
from gptforge.core.settings import REQUIRED, setting
from gptforge.infer.options import TOOL_CHOICES, TOOLS_HELP
from gptforge.weights.options import checkpoint_file, device_setting, dtype_setting, model_source, run_folder


@dataclass(frozen=True, kw_only=True)
class HellaswagArgs:
    out_dir: str = run_folder("run folder holding ckpt.pt (a GPT-2 BPE run)")
    ckpt: str | None = checkpoint_file("score")
    init_from: str = model_source()
    hellaswag_path: str | None = setting(
        None,
        "local hellaswag_val.jsonl (default: download it once into $GPTFORGE_CACHE_DIR/hellaswag, "
        "~/.cache/gptforge/hellaswag)",
    )
    limit: int | None = setting(None, "score only the first N examples (default: all 10,042)")
    batch_size: int = setting(4, "examples per forward pass (4 sequences each)")
    device: str = device_setting()
    dtype: str = dtype_setting()


@dataclass(frozen=True, kw_only=True)
class EvalLossArgs:
    out_dir: str = run_folder()
    ckpt: str | None = checkpoint_file("measure")
    init_from: str = model_source()
    dataset: str | None = setting(None, "dataset folder name under --data_dir (default: the run's)")
    data_dir: str | None = setting(None, "folder holding dataset folders (default: the run's, or data)")
    split: str = setting("val", "which split(s) to measure", choices=("val", "train", "both"))
    eval_iters: int | None = setting(None, "batches per split (default: the run's, or 200)")
    batch_size: int | None = setting(None, "sequences per batch (default: the run's, or 8)")
    block_size: int | None = setting(None, "tokens per sequence (default: the run's; at most the model's block_size)")
    seed: int = setting(1337, "seed of the batch positions")
    device: str = device_setting()
    dtype: str = dtype_setting()


@dataclass(frozen=True, kw_only=True)
class LmEvalArgs:
    out_dir: str = run_folder("run folder holding ckpt.pt (a BPE run: GPT-2's or an own tokenizer's)")
    ckpt: str | None = checkpoint_file("score")
    init_from: str = model_source()
    tasks: str = setting(REQUIRED, "comma-separated lm-eval task, group or tag names")
    num_fewshot: int | None = setting(None, "examples in each prompt (default: each task's)")
    limit: float | None = setting(None, "only the first N examples of each task (a number below 1: that fraction)")
    batch_size: int = setting(1, "sequences per forward pass")
    include_path: str | None = setting(None, "a folder of your own task YAML files", metavar="DIR")
    output_path: str | None = setting(None, "write lm-eval's results as JSON to FILE", metavar="FILE")
    log_samples: bool = setting(False, "also put every example's requests and responses (log-likelihoods) in the JSON")
    # for chat models (lm-eval's own names)
    apply_chat_template: bool = setting(
        False, "a chat model: give it each prompt as a conversation in its chat format (lm-eval's option)"
    )
    fewshot_as_multiturn: bool = setting(
        False, "with --apply_chat_template: the few-shot examples as earlier turns of the conversation"
    )
    system_instruction: str | None = setting(None, "a system message before each prompt", metavar="TEXT")
    seed: int = setting(1337, "seed of lm-eval's few-shot sampling and of any sampling in generation")
    device: str = device_setting()
    dtype: str = dtype_setting()


@dataclass(frozen=True, kw_only=True)
class EvalChatArgs:
    out_dir: str = run_folder("run folder holding ckpt.pt (an SFT run)")
    ckpt: str | None = checkpoint_file("score")
    init_from: str = model_source()
    kinds: str = setting("add3,recall", "comma-separated task kinds: " + ",".join(ALL_KINDS))
    examples: int = setting(200, "problems per kind")
    max_new_tokens: int = setting(
        128, "most tokens the model writes in one answer, its tool calls included (tool outputs are not counted)"
    )
    seed: int = setting(1337, "seed choosing the problems")
    device: str = device_setting()
    dtype: str = dtype_setting()
    tools: str = setting("calculator", TOOLS_HELP, choices=TOOL_CHOICES)
