"""`gptforge chat` and `gptforge serve`'s parsers (kept apart from args.py, which holds most other subcommands')."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from gptforge.cli.common_args import add_device, add_model_source
from gptforge.core.config import CHOICES
from gptforge.infer.options import COMPILE_CHOICES, COMPILE_HELP, ChatArgs

CHAT_DESCRIPTION = """Talk to a model in the terminal: a chat model (fine-tuned on conversations) answers each
message, remembering the conversation (kept in the model's KV cache: a turn costs only its own tokens; when it
outgrows the context the oldest exchanges are dropped, and you are told). A base model continues your text
instead (completion mode; it says so at the start). Ctrl-C stops an answer, Ctrl-D or /quit leaves. Commands:
/system TEXT, /temperature X, /top_p X, /clear, /save FILE, /load FILE, /help, /quit."""

SERVE_DESCRIPTION = """Serve a model over OpenAI's HTTP API (POST /v1/chat/completions and /v1/completions,
streamed or not; GET /v1/models, /health) with a chat page at http://HOST:PORT/. Concurrent requests share each
model step (continuous batching). Needs pip install 'gptforge[serve]'. Ctrl-C finishes the requests in flight,
then exits."""


def add_chat(sub: argparse._SubParsersAction, formatter: Callable[[str], argparse.HelpFormatter]) -> None:
    p = sub.add_parser(
        "chat", help="talk to a model in the terminal", formatter_class=formatter, description=CHAT_DESCRIPTION
    )
    p.set_defaults(handler="gptforge.infer.chat_cli:chat", options="gptforge.infer.options:ChatArgs")
    for f in dataclasses.fields(ChatArgs):
        doc = f.metadata["doc"]
        if f.name == "prompt":
            p.add_argument("-p", "--prompt", default=None, metavar="TEXT", help=doc)
        elif f.name == "stop":
            p.add_argument("--stop", action="append", default=None, metavar="TEXT", help=doc)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            metavar = {"ckpt": "PATH", "system": "TEXT"}.get(f.name)
            choices = {"dtype": CHOICES["dtype"], "compile": COMPILE_CHOICES}.get(f.name)
            p.add_argument(f"--{f.name}", type=kind, default=f.default, choices=choices, help=doc, metavar=metavar)


def add_serve(sub: argparse._SubParsersAction, formatter: Callable[[str], argparse.HelpFormatter]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over OpenAI's API, with a chat page",
        formatter_class=formatter,
        description=SERVE_DESCRIPTION,
    )
    p.set_defaults(handler="gptforge.infer.serve:serve")
    add_model_source(p, "serve", "run folder holding ckpt.pt")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 lets other machines in (set --api_key then)"
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    p.add_argument(
        "--api_key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (the OpenAI clients' api_key) on every API call",
    )
    p.add_argument("--name", default=None, help="the model's id in the API (default: the run folder's name)")
    p.add_argument("--max_batch", type=int, default=16, help="rows (requests x n) in one model step; more wait")
    p.add_argument(
        "--max_tokens",
        type=int,
        default=0,
        help="the most tokens a request may ask for (default 0: the model's context)",
    )
    p.add_argument("--max_body_mb", type=float, default=1.0, help="the largest request body, in MiB")
    p.add_argument("--max_messages", type=int, default=256, help="the most messages in one chat request")
    p.add_argument("--compile", default="auto", choices=COMPILE_CHOICES, help=COMPILE_HELP)
    add_device(p)


def add_chat_template_options(t: argparse.ArgumentParser) -> None:
    """`gptforge eval lm-eval`'s options for chat models (lm-eval's own names)."""
    t.add_argument(
        "--apply_chat_template",
        action="store_true",
        help="a chat model: give it each prompt as a conversation in its chat format (lm-eval's option)",
    )
    t.add_argument(
        "--fewshot_as_multiturn",
        action="store_true",
        help="with --apply_chat_template: the few-shot examples as earlier turns of the conversation",
    )
    t.add_argument("--system_instruction", default=None, metavar="TEXT", help="a system message before each prompt")
