"""What each subcommand does: one thin function per subcommand (cli/args.py's COMMANDS names them) that imports the
stage doing the work only when the command runs, so `gptforge --help` stays instant, and hands it the parsed
options: the options object itself, or its fields as the stage's parameters (which have no defaults of their own:
each default is written once, in the options class). tests/test_cli_dispatch.py holds every stage's parameters equal
to its options' fields."""

from __future__ import annotations

from gptforge.dashboard.options import DashboardArgs
from gptforge.data.options import PrepareArgs
from gptforge.evaluate.options import EvalChatArgs, EvalLossArgs, HellaswagArgs, LmEvalArgs
from gptforge.infer.options import ChatArgs, SampleArgs, ServeArgs
from gptforge.tokenizer.options import DecodeArgs, EncodeArgs, TokenizerStatsArgs, TokenizerTrainArgs
from gptforge.weights.options import ExportArgs


def prepare(options: PrepareArgs) -> None:
    from gptforge.data.command import prepare_command

    prepare_command(**vars(options))


def tokenizer_train(options: TokenizerTrainArgs) -> None:
    from gptforge.tokenizer.command import train_command

    train_command(**vars(options))


def tokenizer_stats(options: TokenizerStatsArgs) -> None:
    from gptforge.tokenizer.command import stats_command

    stats_command(**vars(options))


def tokenizer_encode(options: EncodeArgs) -> None:
    from gptforge.tokenizer.command import encode_command

    encode_command(**vars(options))


def tokenizer_decode(options: DecodeArgs) -> None:
    from gptforge.tokenizer.command import decode_command

    decode_command(**vars(options))


def sample(options: SampleArgs) -> None:
    from gptforge.infer.sample import sample

    sample(options)


def chat(options: ChatArgs) -> None:
    from gptforge.infer.chat_cli import chat

    chat(options)


def serve(options: ServeArgs) -> None:
    from gptforge.infer.serve import serve

    serve(options)


def export(options: ExportArgs) -> None:
    from gptforge.weights.export import export_run

    export_run(**vars(options))


def dashboard(options: DashboardArgs) -> None:
    from gptforge.dashboard.server import serve

    serve(**vars(options))


def eval_hellaswag(options: HellaswagArgs) -> None:
    from gptforge.evaluate.hellaswag import eval_hellaswag

    eval_hellaswag(**vars(options))


def eval_loss(options: EvalLossArgs) -> None:
    from gptforge.evaluate.loss import eval_loss

    eval_loss(**vars(options))


def eval_lm_eval(options: LmEvalArgs) -> None:
    from gptforge.evaluate.harness import eval_lm_eval

    eval_lm_eval(**vars(options))


def eval_chat(options: EvalChatArgs) -> None:
    from gptforge.evaluate.chat import eval_chat

    eval_chat(**vars(options))
