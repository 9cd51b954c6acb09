"""`gptforge chat`: a conversation with a model in the terminal, streamed as it is generated; `-p TEXT` answers one
message and exits (stdout holds the answer only, so it can be piped or compared). Ctrl-C stops the answer being
written, never the program; Ctrl-D or /quit leaves. Notices (the model, dropped turns) go to stderr."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator

from gptforge.core.errors import UserError
from gptforge.core.settings import check_fields
from gptforge.infer.chat_model import LoadedModel, load_for_inference
from gptforge.infer.decode import enable_compile
from gptforge.infer.options import ChatArgs, _temperature, _top_p
from gptforge.infer.sampling import SamplingParams
from gptforge.infer.session import Session
from gptforge.infer.toolcalls import ToolCall, builtin_tools

HELP = """commands:
  /system TEXT      set the system message (the conversation starts again); /system alone shows it
  /temperature X    sampling temperature (0 = greedy); /top_p X   nucleus sampling (1 = off)
  /clear            a new conversation (the system message stays)
  /save FILE        write the conversation as a line of OpenAI-format JSONL (what `prepare chat` reads)
  /load FILE        continue the last conversation of a JSONL file
  /help             this; /quit (or Ctrl-D) leaves. Ctrl-C stops an answer."""


def chat(args: ChatArgs, out=None, err=None) -> None:
    out, err = out or sys.stdout, err or sys.stderr
    check_fields(args)
    lm = load_for_inference(args.out_dir, args.ckpt, args.init_from, args.device, args.dtype)
    enable_compile(lm, args.compile, slots=1)
    if args.system and not lm.chat:
        raise UserError(f"--system: {lm.name} is a base model (not chat-tuned), which has no system message")

    def notify(message: str) -> None:
        print(f"[{message}]", file=err, flush=True)

    session = Session(lm, args.system, notify, builtin_tools(args.tools))
    if args.prompt is not None:
        if not lm.chat:
            notify(lm.describe())
        shown = shown_calls(err)  # stdout holds the answer only
        for piece in session.answer(args.prompt, params(args, 0), args.max_new_tokens, args.stop, on_tool=shown):
            out.write(piece)
            out.flush()
        out.write("\n")
        return
    notify(lm.describe())
    notify("type a message; /help lists the commands, Ctrl-C stops an answer, Ctrl-D or /quit leaves")
    Repl(session, args, out, err, notify).run()


def shown_calls(out) -> Callable[[ToolCall], None]:
    """Show a tool call and its output on `out`, dimmed on a terminal, between brackets everywhere."""
    dim, plain = ("\x1b[2m", "\x1b[0m") if getattr(out, "isatty", lambda: False)() else ("", "")

    def show(call: ToolCall) -> None:
        name = call.name or "?"
        out.write(f"{dim}[{name} {call.arguments} -> {call.output}]{plain}")
        out.flush()

    return show


def params(args: ChatArgs, turn: int) -> SamplingParams:
    """Turn k draws from seed + k: the same conversation with the same seed gives the same answers."""
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed + turn,
    )


@contextlib.contextmanager
def interrupt_flag() -> Iterator[Callable[[], bool]]:
    """While inside, Ctrl-C sets a flag (read between two tokens) instead of raising."""
    hit = []
    previous = signal.signal(signal.SIGINT, lambda *_: hit.append(1))
    try:
        yield lambda: bool(hit)
    finally:
        signal.signal(signal.SIGINT, previous)


class Repl:
    def __init__(self, session: Session, args: ChatArgs, out, err, notify: Callable[[str], None]):
        self.session, self.args, self.out, self.err, self.notify = session, args, out, err, notify
        self.lm: LoadedModel = session.lm
        self.turn = 0

    def run(self) -> None:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  line editing and history for input()
        # Ctrl-C at the prompt raises KeyboardInterrupt even when SIGINT came ignored (a job started in the
        # background by a shell without job control inherits it so; Python then installs no handler of its own)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.loop()
        finally:
            signal.signal(signal.SIGINT, previous)

    def loop(self) -> None:
        while (line := self.prompt()) is not None:
            try:
                if line.startswith("/"):
                    if self.command(line) == "quit":
                        return
                elif line.strip():
                    self.reply(line)
            except UserError as e:
                self.notify(f"error: {e}")
            except KeyboardInterrupt:  # a Ctrl-C seen late: pressed at the prompt, raised once a line was read
                self.hint()

    def prompt(self) -> str | None:
        """The next line typed; None at Ctrl-D. Ctrl-C here prints a hint and asks again. (A Ctrl-C that lands
        after the prompt shows but before readline waits for a key is only raised after the next key, CPython's
        readline: `run` catches it there too.)"""
        while True:
            try:
                return input("you> ")
            except EOFError:
                print(file=self.out)
                return None
            except KeyboardInterrupt:
                self.hint()

    def hint(self) -> None:
        with interrupt_flag():  # more Ctrl-C while the hint prints count as the same one
            print(file=self.out)
            self.notify("Ctrl-C stops an answer; /quit or Ctrl-D leaves")

    def reply(self, text: str) -> None:
        self.out.write("model> ")
        self.out.flush()
        with interrupt_flag() as stopped:
            for piece in self.session.answer(
                text, params(self.args, self.turn), self.args.max_new_tokens, self.args.stop, stopped,
                shown_calls(self.out),
            ):  # fmt: skip
                self.out.write(piece)
                self.out.flush()
        self.turn += 1
        self.out.write("\n")
        self.out.flush()
        reason = self.session.last.finish_reason if self.session.last else None
        if reason == "interrupted":
            self.notify("stopped; the answer so far is kept in the conversation")
        elif reason == "length" and self.session.last.tokens >= self.args.max_new_tokens:
            self.notify(f"the answer reached --max_new_tokens={self.args.max_new_tokens}")

    def command(self, line: str) -> str | None:
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return "quit"
        if name == "/help":
            print(HELP, file=self.err)
        elif name == "/system":
            if not arg:
                self.notify(f"system message: {self.session.system!r}")
            elif not self.lm.chat:
                raise UserError("a base model (completion mode) has no system message")
            else:
                self.session.set_system(arg)
                self.notify("system message set; the conversation continues with it")
        elif name in ("/temperature", "/top_p"):
            self.setting(name[1:], arg)
        elif name == "/clear":
            self.session.clear(self.session.system)
            self.notify("new conversation")
        elif name in ("/save", "/load"):
            if not arg:
                raise UserError(f"{name} needs a file name: {name} FILE")
            if name == "/save":
                self.session.save(arg)
                self.notify(f"saved {len(self.session.messages)} messages to {arg}")
            else:
                count = self.session.load(arg)
                more = f" (the last of {count})" if count > 1 else ""
                self.notify(f"loaded {len(self.session.messages)} messages from {arg}{more}")
        else:
            raise UserError(f"unknown command {name}; /help lists them")
        return None

    def setting(self, key: str, arg: str) -> None:
        if not arg:
            self.notify(f"{key} = {getattr(self.args, key)}")
            return
        try:
            value = float(arg)
        except ValueError:
            raise UserError(f"/{key} {arg}: give a number") from None
        problem = {"temperature": _temperature, "top_p": _top_p}[key](value)
        if problem:
            raise UserError(f"/{key} {arg}: {problem}")
        setattr(self.args, key, value)
        self.notify(f"{key} = {value}")
