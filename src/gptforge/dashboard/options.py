"""`gptforge dashboard`'s options, each written once (default, type, help text); the command line is built from them
(cli/parsers.py) and server.serve takes them as its parameters."""

from __future__ import annotations

from dataclasses import dataclass

from gptforge.core.config import FIELDS
from gptforge.core.settings import setting


@dataclass(frozen=True, kw_only=True)
class DashboardArgs:
    folders: list[str] = setting(["."], "run folders or folders of runs", positional=True, metavar="FOLDER")
    host: str = setting("127.0.0.1", "address to listen on; 0.0.0.0 lets other machines read your runs")
    port: int = setting(FIELDS["dashboard_port"].default, "port to listen on; 0 picks a free one")
