"""`gptforge eval lm-eval`: EleutherAI's lm-evaluation-harness on a run's checkpoint (or GPT-2's weights), with
no export first. The options are lm-eval's own (--tasks, --num_fewshot, --limit, --batch_size, --include_path,
--output_path, --log_samples); the model is gptforge's (GPTForgeLM in gptforge.evaluate.harness_model). Prints
lm-eval's table and writes its results JSON. README "Standard evaluations (lm-eval)"."""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

from gptforge.core import console
from gptforge.core.errors import UserError
from gptforge.core.files import atomic_write

INSTALL = "pip install 'gptforge[eval]' (or: pip install lm_eval)"
OFFLINE_ROUTE = (
    "lm-eval reads its tasks' datasets from the Hugging Face hub. Without a network, give --include_path DIR with a "
    "task YAML whose dataset is local (dataset_path: json, dataset_kwargs: {data_files: {validation: FILE}}; README "
    "'Standard evaluations (lm-eval)' has one for HellaSwag), or fill the datasets cache where there is a network and "
    "run with HF_DATASETS_OFFLINE=1"
)


def import_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError as e:
        raise UserError(f"`gptforge eval lm-eval` needs lm-evaluation-harness, not installed: {INSTALL}") from e
    return lm_eval


def check_options(tasks: str, limit: float | None, batch_size: int, num_fewshot: int | None, include_path) -> list:
    names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    if not names:
        raise UserError("--tasks needs at least one task name, e.g. --tasks hellaswag,arc_easy")
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be positive (examples per task, or a fraction below 1), got {limit}")
    if batch_size <= 0:
        raise UserError(f"--batch_size must be a positive integer, got {batch_size}")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num_fewshot must be 0 or more, got {num_fewshot}")
    if include_path is not None and not os.path.isdir(include_path):
        raise UserError(f"--include_path={include_path}: no such folder (it should hold lm-eval task YAML files)")
    return names


def task_manager_for(names: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager for these task names. Indexing lm-eval's own ~14,700 task files takes ~15 s (a 2-core
    Zen 1 EPYC), so when every name is a task in --include_path (not a group or tag: those may list lm-eval's own
    tasks) only that folder is indexed; lm-eval gives --include_path's tasks precedence over its own anyway, so the
    tasks are the same. Otherwise lm-eval's own tasks and --include_path's."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(local.all_subtasks):
            return local
    return TaskManager(include_path=include_path)


def check_tasks(task_manager: Any, names: list[str], include_path: str | None) -> None:
    """Every name must be a task, group or tag lm-eval knows (with --include_path's): else exit 2 with the closest."""
    known = set(task_manager.all_tasks)
    for name in names:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
        where = f" nor in --include_path={include_path}" if include_path else " (--include_path DIR adds yours)"
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"--tasks: {name!r} is not a task lm-eval knows{where}{hint} (`lm_eval ls tasks` lists them)")


def is_offline_error(error: BaseException) -> bool:
    """A failure to reach the Hugging Face hub (no network, offline mode), anywhere in the exception's chain."""
    seen = error
    while seen is not None:
        name, text = type(seen).__name__, str(seen)
        if name in ("ConnectionError", "ConnectTimeout", "LocalEntryNotFoundError", "OfflineModeIsEnabled") or any(
            words in text
            for words in (
                "Couldn't reach",
                "offline mode",
                "Failed to resolve",
                "Name or service not known",
                "Temporary failure in name resolution",
                "Max retries exceeded",
                "Network is unreachable",
            )
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def eval_lm_eval(
    out_dir: str,
    ckpt: str | None,
    init_from: str,
    tasks: str,
    num_fewshot: int | None,
    limit: float | None,
    batch_size: int,
    include_path: str | None,
    output_path: str | None,
    log_samples: bool,
    device: str,
    dtype: str,
    seed: int,
    apply_chat_template: bool,
    fewshot_as_multiturn: bool,
    system_instruction: str | None,
) -> dict[str, Any]:
    """Score the model on lm-eval's tasks; prints lm-eval's table, writes the results to --output_path. With
    apply_chat_template (a chat model), each prompt is a conversation in the model's chat format."""
    names = check_options(tasks, limit, batch_size, num_fewshot, include_path)
    lm_eval = import_lm_eval()
    from gptforge.evaluate.harness_model import GPTForgeLM

    # the model first: a checkpoint that cannot be scored (missing, a character vocabulary, a base model asked for
    # a chat template) is reported before lm-eval's task index is built (~15 s on a 2-core CPU without --include_path)
    lm = GPTForgeLM(ckpt=ckpt, out_dir=out_dir, init_from=init_from, device=device, dtype=dtype, batch_size=batch_size)
    if (apply_chat_template or fewshot_as_multiturn or system_instruction) and not lm.chat:
        raise UserError(
            "--apply_chat_template (and --fewshot_as_multiturn, --system_instruction) need a chat model (a run "
            "trained with --task=sft, or a folder with a chat_template); this one is a base model: leave them out"
        )
    task_manager = task_manager_for(names, include_path)
    check_tasks(task_manager, names, include_path)
    what = ckpt or (os.path.join(out_dir, "ckpt.pt") if init_from == "resume" else init_from)
    console.log(f"lm-eval {lm_eval.__version__}: {', '.join(names)} on {what} ({lm.device}, {lm.dtype})")
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=num_fewshot,
            limit=int(limit) if limit is not None and limit >= 1 else limit,
            task_manager=task_manager,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            apply_chat_template=apply_chat_template,
            fewshot_as_multiturn=fewshot_as_multiturn,
            system_instruction=system_instruction,
        )
    except Exception as e:
        if is_offline_error(e):
            raise UserError(f"--tasks {','.join(names)}: {type(e).__name__}: {str(e)[:300]}. {OFFLINE_ROUTE}") from e
        raise
    report(results, output_path)
    return results


def report(results: dict[str, Any], output_path: str | None) -> None:
    """lm-eval's tables on stdout; the results as JSON to output_path when given."""
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results), flush=True)
    if results.get("groups"):
        print(make_table(results, "groups"), flush=True)
    if output_path:
        with atomic_write(output_path, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2, default=handle_non_serializable, ensure_ascii=False)
        console.log(f"wrote {output_path}")
