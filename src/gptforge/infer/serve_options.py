"""`gptforge serve`'s options checked before anything loads, and its listening socket: every mistake a UserError
naming its flag (exit 2), said in a second rather than after the model has loaded and its decode step compiled."""

from __future__ import annotations

import errno
import math
import re
import socket

from gptforge.core.device import available_memory
from gptforge.core.errors import UserError
from gptforge.infer.chat_model import LoadedModel
from gptforge.infer.options import ServeArgs


def check_options(args: ServeArgs) -> None:
    """Every option that can be judged without the model, each mistake said naming its flag."""
    host, port, api_key, name = args.host, args.port, args.api_key, args.name
    if not host.strip():  # "" would listen on every interface
        raise UserError(
            "--host is empty: give the address to listen on, 127.0.0.1 (this machine only, the default) "
            "or 0.0.0.0 (every interface; set --api_key then)"
        )
    if not 0 <= port <= 65535:
        raise UserError(f"--port={port}: a port number is 0-65535; choose another (--port 0 picks a free one)")
    if api_key is not None and not re.fullmatch(r"[!-~]+", api_key):  # an HTTP header carries it: visible ASCII
        what = "is empty (an unset variable?)" if not api_key else "holds a space or a character outside ASCII"
        raise UserError(
            f"--api_key {what}: clients send it as 'Authorization: Bearer KEY'; give a key of visible "
            "ASCII characters, or leave --api_key out to serve without one"
        )
    if name is not None and (not name.strip() or name != name.strip() or not name.isprintable()):
        raise UserError(
            f"--name={name!r}: clients send the model's id as 'model'; give one without spaces at its "
            "ends or control characters, or leave --name out (the run folder's name)"
        )
    if args.max_batch < 1:
        raise UserError(
            f"--max_batch={args.max_batch}: give the most rows (requests x n) one model step runs, 1 or more"
        )
    if args.max_messages < 1:
        raise UserError(
            f"--max_messages={args.max_messages}: give the most messages a chat request may hold, 1 or more"
        )
    if args.max_tokens < 0:
        raise UserError(
            f"--max_tokens={args.max_tokens}: give the most tokens a request may ask for, or 0 (the context)"
        )
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb >= 0.001):
        raise UserError(
            f"--max_body_mb={args.max_body_mb}: give the largest request body in MiB, at least 0.001 (1 KiB)"
        )


def check_model_room(lm: LoadedModel, max_batch: int, max_tokens: int) -> None:
    """What the options ask of this model, said before the compile: --max_tokens within its context, and
    --max_batch rows of KV cache in the memory there is (allocated at the first step: an out-of-memory crash)."""
    if max_tokens > lm.block_size:
        raise UserError(
            f"--max_tokens={max_tokens} is more than the model's context ({lm.block_size} tokens), which ends every "
            f"answer: give at most {lm.block_size}, or 0 (the whole context)"
        )
    row = lm.cache_row_bytes
    available, where = available_memory(lm.device)
    if available is not None and row * max_batch > available:
        fits = int(available // row)
        raise UserError(
            f"--max_batch={max_batch}: its KV cache needs {row * max_batch / 1e9:,.2f} GB ({row / 1e6:,.2f} MB a "
            f"row), but {where} has {available / 1e9:,.2f} GB available; "
            + (f"give --max_batch={fits} or less" if fits else "free memory or choose another --device")
        )


def bind(host: str, port: int) -> socket.socket:
    """The socket, bound, not yet listening (a connection meanwhile is refused, not left waiting for the load)."""
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        raise cannot_listen(e, host, port) from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise cannot_listen(e, host, port) from None
    sock.set_inheritable(True)
    return sock


def listen(sock: socket.socket, host: str, port: int) -> None:
    try:  # another program may have bound the same port (SO_REUSEADDR) and listened first
        sock.listen(128)
    except OSError as e:
        raise cannot_listen(e, host, port) from None


def cannot_listen(e: OSError, host: str, port: int) -> UserError:
    reason = e.strerror or str(e)
    if isinstance(e, socket.gaierror) or e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return UserError(
            f"--host={host}: not an address of this machine ({reason}); give 127.0.0.1 (this machine only) or "
            "0.0.0.0 (every interface)"
        )
    low = ", or one from 1024 up (lower ones need root)" if e.errno == errno.EACCES else ""
    return UserError(
        f"--port={port}: cannot listen on {host}:{port} ({reason}); choose another --port{low} (--port 0 picks a "
        "free one)"
    )
