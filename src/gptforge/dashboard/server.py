"""The dashboard's web server: the page, its static files, plotly.js, and a read-only JSON API over run folders.
Standard library only, never torch or numpy, so it starts at once. Routes, fields and safety rules:
docs/ARCHITECTURE.md, "The dashboard"; usage: README, "Dashboard".
"""

from __future__ import annotations

import gzip
import importlib.util
import ipaddress
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from gptforge.core.errors import UserError
from gptforge.core.files import METRICS, SAMPLES
from gptforge.dashboard.records import read_records, read_samples
from gptforge.dashboard.runs import RunIndex

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC = {  # URL path -> (file name in static/, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/data.js": ("data.js", "text/javascript; charset=utf-8"),
    "/static/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/static/rl.js": ("rl.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
PLOTLY_URL = "/static/plotly.min.js"
INSTALL_HINT = "pip install 'gptforge[dashboard]' (or 'gptforge[all]': every extra)"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def find_plotly_js() -> Path:
    """plotly.min.js inside the installed `plotly` package, found without importing plotly (which is slow)."""
    try:
        spec = importlib.util.find_spec("plotly")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    raise UserError(f"the dashboard draws its charts with plotly.js from the plotly package: {INSTALL_HINT}")


class DashboardServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that knows the runs it shows and the static files it may send."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, folders: Sequence[str | os.PathLike], host: str, port: int, plotly_js: Path):
        self.index = RunIndex([os.fspath(f) for f in folders])
        self.plotly_js = plotly_js
        self._cache: dict[tuple[str, bool], tuple[float, bytes]] = {}
        self._cache_lock = threading.Lock()
        self.loopback_only = _is_loopback(host)
        super().__init__((host, port), DashboardHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"

    def static_bytes(self, path: Path, gzipped: bool) -> bytes:
        """A static file's bytes (gzipped on request), cached in memory until the file changes."""
        mtime = path.stat().st_mtime
        key = (str(path), gzipped)
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit and hit[0] == mtime:
            return hit[1]
        data = path.read_bytes()
        if gzipped:
            data = gzip.compress(data, compresslevel=6, mtime=0)
        with self._cache_lock:
            self._cache[key] = (mtime, data)
        return data

    def stop(self) -> None:
        """Stop serving and close the socket (for a server from start_dashboard)."""
        self.shutdown()
        self.server_close()


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DashboardHandler(BaseHTTPRequestHandler):
    server: DashboardServer
    server_version = "gptforge-dashboard"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a poll every 2 s per tab would flood the terminal

    def do_HEAD(self) -> None:
        self.do_GET(head=True)

    def do_GET(self, head: bool = False) -> None:
        self.head = head
        try:
            self.route()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away mid-answer
        except Exception as e:  # a bug must not kill the server; say so and keep serving
            print(f"gptforge dashboard: error serving {self.path!r}: {e!r}", file=sys.stderr)
            try:
                self.send_json({"error": "internal error"}, HTTPStatus.INTERNAL_SERVER_ERROR)
            except OSError:
                pass

    def route(self) -> None:
        if not self.host_allowed():
            return self.send_json({"error": "unexpected Host header"}, HTTPStatus.FORBIDDEN)
        raw = self.path
        if "://" in raw or not raw.startswith("/"):
            return self.send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)
        parts = urlsplit(raw)
        path = unquote(unquote(parts.path))  # twice: %252e%252e is refused too
        if ".." in path or "\\" in path or "\0" in path or "//" in path:
            return self.send_json({"error": "forbidden"}, HTTPStatus.FORBIDDEN)
        query = parse_qs(parts.query)
        if path in STATIC:
            name, ctype = STATIC[path]
            return self.send_file(STATIC_DIR / name, ctype, cache="no-cache")
        if path == PLOTLY_URL:
            return self.send_file(self.server.plotly_js, "text/javascript; charset=utf-8", cache="max-age=86400")
        if path == "/api/runs":
            now = time.time()
            runs = [run.describe(now) for run in self.server.index.runs()]
            return self.send_json({"runs": runs, "roots": self.server.index.roots, "now": now})
        bits = path.split("/")
        if len(bits) == 5 and bits[:3] == ["", "api", "runs"]:
            run = self.server.index.get(bits[3])
            if run is None:
                return self.send_json({"error": f"no run {bits[3]!r}"}, HTTPStatus.NOT_FOUND)
            return self.run_api(run, bits[4], query)
        return self.send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)

    def run_api(self, run, what: str, query: dict[str, list[str]]) -> None:
        if what == "metrics":
            offset = _int(query.get("offset", ["0"])[0], 0)
            file = query.get("file", [None])[0] or None
            mark = query.get("mark", [None])[0]  # absent (a page from before marks, or offset 0): not checked
            try:
                chunk = read_records(run.file(METRICS), offset, file, mark=mark)
            except OSError:
                return self.send_json({"error": "missing", "state": "missing"}, HTTPStatus.NOT_FOUND)
            return self.send_json(
                {
                    "records": chunk.records,
                    "offset": chunk.offset,
                    "file": chunk.file,
                    "mark": chunk.mark,
                    "size": chunk.size,
                    "more": chunk.more,
                    "skipped": chunk.skipped,
                    "reset": chunk.reset,
                }
            )
        if what == "config":
            cfg = run.config()
            if cfg is None:
                return self.send_json({"error": "no readable config.json"}, HTTPStatus.NOT_FOUND)
            return self.send_json(cfg)
        if what == "samples":
            limit = min(max(_int(query.get("limit", ["20"])[0], 20), 1), 200)
            return self.send_json({"samples": read_samples(run.file(SAMPLES), limit)})
        return self.send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)

    def host_allowed(self) -> bool:
        if not self.server.loopback_only:
            return True
        host = (self.headers.get("Host") or "").strip().lower()
        if host.startswith("["):
            name = host[1 : host.find("]")] if "]" in host else host
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return name in LOOPBACK_NAMES or _is_loopback(name)

    def accepts_gzip(self) -> bool:
        return "gzip" in (self.headers.get("Accept-Encoding") or "")

    def send_file(self, path: Path, ctype: str, cache: str) -> None:
        gz = self.accepts_gzip()
        try:
            body = self.server.static_bytes(path, gz)
        except OSError:
            return self.send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)
        self.send_body(
            body, ctype, HTTPStatus.OK, {"Cache-Control": cache, **({"Content-Encoding": "gzip"} if gz else {})}
        )

    def send_json(self, obj: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        headers = {"Cache-Control": "no-store"}
        if len(body) > 16384 and self.accepts_gzip():
            body = gzip.compress(body, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        self.send_body(body, "application/json", status, headers)

    def send_body(self, body: bytes, ctype: str, status: HTTPStatus, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Vary", "Accept-Encoding")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if not self.head:
            self.wfile.write(body)


def _int(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def make_server(folders: Sequence[str | os.PathLike], host: str = "127.0.0.1", port: int = 0) -> DashboardServer:
    """A bound, not yet serving DashboardServer. UserError when plotly is missing or the port is taken."""
    plotly_js = find_plotly_js()
    if not 0 <= port <= 65535:
        raise UserError(
            f"cannot listen on {host}:{port}: a port number is 0-65535; choose another with --port "
            "(--port 0 picks a free one)"
        )
    try:
        return DashboardServer(folders, host, port, plotly_js)
    except OSError as e:
        raise UserError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); choose another with --port "
            "(--port 0 picks a free one) or --host"
        ) from None


def start_dashboard(
    folders: Sequence[str | os.PathLike], host: str = "127.0.0.1", port: int = 0
) -> tuple[DashboardServer, str]:
    """Serve the dashboard for `folders` from a background (daemon) thread; returns (server, url).

    For `gptforge train` to show its own run beside it. Port 0 (the default) is any free port.
    Folders that do not exist yet are watched until they do. Stop with `server.stop()`.
    """
    server = make_server(folders, host, port)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="gptforge-dashboard", daemon=True
    )
    thread.start()
    return server, server.url


def serve(folders: Sequence[str], host: str, port: int) -> None:
    """`gptforge dashboard`: check the folders, print the URL, serve until Ctrl-C."""
    for folder in folders:
        if os.path.exists(folder) and not os.path.isdir(folder):
            parent = os.path.dirname(folder) or "."
            raise UserError(f"{folder} is a file, not a folder: give its run folder ({parent}) or a folder of runs")
        if not os.path.isdir(folder):
            raise UserError(f"{folder}: no such folder; give run folders or folders of runs (default: .)")
    server = make_server(folders, host, port)
    count = len(server.index.runs())
    where = ", ".join(server.index.roots)
    print(f"gptforge dashboard: {count} run(s) under {where}; open {server.url}", flush=True)
    if not server.loopback_only:
        print(
            "gptforge dashboard: listening beyond this machine: anyone who reaches it can read these runs",
            file=sys.stderr,
            flush=True,
        )
    # SIGINT stops it even when started with SIGINT ignored (a background job of a non-interactive shell, nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
