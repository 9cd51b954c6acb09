"""The live dashboard: run discovery, the JSON API, its safety and the CLI (the page in a real Chromium is
test_dashboard_browser.py).

Everything runs for real: the server on a free port (the `dashboard` fixture in conftest.py), HTTP requests over
sockets, run folders written as metrics.py writes them.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from gptforge.dashboard.records import MAX_LINE, read_records
from gptforge.dashboard.runs import RunIndex, find_run_folders


def write_run(
    folder: Path, steps: int, max_iters: int | None = None, eval_every: int = 10, t0: float | None = None, **config
) -> Path:
    """A run folder with `steps` train lines (an eval every eval_every steps) and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time() - steps if t0 is None else t0
    lines = []
    for s in range(steps):
        loss = 1.5 + 2.5 * math.exp(-s / 40)
        lines.append(
            {
                "step": s,
                "kind": "train",
                "loss": loss,
                "lr": 1e-3,
                "grad_norm": 0.9,
                "ms_per_iter": 30.0,
                "tokens_per_s": 24000,
                "mfu": 0.03,
                "eta_s": 1.0,
                "time": t0 + s,
            }
        )
        if s % eval_every == 0:
            lines.append(
                {"step": s, "kind": "eval", "train_loss": loss, "val_loss": loss + 0.1, "lr": 1e-3, "time": t0 + s}
            )
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "config.json").write_text(json.dumps({"max_iters": max_iters or steps * 2, **config}))
    return folder


def request(url: str, path: str, host: str | None = None) -> tuple[int, bytes]:
    """GET `path` exactly as given (no client-side normalisation of '..'), over a real socket."""
    m = re.match(r"http://([^:/]+):(\d+)/", url)
    conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get_json(url: str, path: str):
    status, body = request(url, path)
    assert status == 200, (path, status, body[:200])
    return json.loads(body)  # strict: the server never sends NaN


def test_finds_runs_in_a_folder_of_runs_nested_and_not_too_deep(tmp_path):
    write_run(tmp_path / "a", 3)
    write_run(tmp_path / "sweep" / "lr1e-3", 3)
    write_run(tmp_path / "sweep" / "deep" / "er", 3)  # 3 levels down: found
    write_run(tmp_path / "x" / "y" / "z" / "w", 3)  # 4 levels down: not searched
    write_run(tmp_path / ".hidden" / "run", 3)
    (tmp_path / "notarun").mkdir()
    found = {Path(p).relative_to(tmp_path).as_posix() for p in find_run_folders(str(tmp_path))}
    assert found == {"a", "sweep/lr1e-3", "sweep/deep/er"}
    # a run folder given directly is a run; ids are URL-safe slugs, names are relative paths
    index = RunIndex([str(tmp_path / "a"), str(tmp_path / "sweep")])
    assert [(r.id, r.name) for r in index.runs()] == [
        ("a", "a"),
        ("sweep-deep-er", "sweep/deep/er"),
        ("sweep-lr1e-3", "sweep/lr1e-3"),
    ]


def test_api_lists_runs_and_reads_metrics_incrementally(tmp_path, dashboard):
    run = write_run(tmp_path / "runs" / "one", 5, max_iters=100, dataset="tiny")
    url = dashboard(tmp_path / "runs")
    runs = get_json(url, "/api/runs")["runs"]
    assert [(r["id"], r["state"], r["step"], r["max_iters"]) for r in runs] == [("one", "running", 4, 100)]
    assert runs[0]["config"] == {"dataset": "tiny"} and runs[0]["best_val_loss"] == pytest.approx(4.1)

    first = get_json(url, "/api/runs/one/metrics?offset=0")
    assert [r["kind"] for r in first["records"]] == ["train", "eval"] + ["train"] * 4
    assert first["offset"] == first["size"] == (run / "metrics.jsonl").stat().st_size and not first["more"]

    with open(run / "metrics.jsonl", "a") as fh:  # two new lines and half of a third, still being written
        fh.write(json.dumps({"step": 5, "kind": "train", "loss": 2.0}) + "\n")
        fh.write(json.dumps({"step": 6, "kind": "train", "loss": 1.9}) + "\n")
        fh.write('{"step": 7, "kind": "tr')
    q = f"/api/runs/one/metrics?offset={first['offset']}&file={first['file']}"
    second = get_json(url, q)
    assert [r["step"] for r in second["records"]] == [5, 6] and not second["reset"]
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('ain", "loss": 1.8}\n')
    third = get_json(url, f"/api/runs/one/metrics?offset={second['offset']}&file={second['file']}")
    assert third["records"] == [{"step": 7, "kind": "train", "loss": 1.8}]

    # a fresh run in the same folder replaces the file (train renames a new one in): the client starts over
    tmp = run / "metrics.jsonl.tmp"
    tmp.write_text(json.dumps({"step": 0, "kind": "train", "loss": 4.2}) + "\n" + "x" * 500 + "\n")
    os.replace(tmp, run / "metrics.jsonl")
    again = get_json(url, f"/api/runs/one/metrics?offset={third['offset']}&file={third['file']}")
    assert again["reset"] and [r["loss"] for r in again["records"]] == [4.2] and again["skipped"] == 1

    assert get_json(url, "/api/runs/one/config") == {"max_iters": 100, "dataset": "tiny"}
    assert not runs[0]["has_samples"]  # no samples.jsonl; an empty one (older runs wrote it always) is none either
    (run / "samples.jsonl").write_text("")
    assert not get_json(url, "/api/runs")["runs"][0]["has_samples"]
    (run / "samples.jsonl").write_text("".join(json.dumps({"step": s, "text": f"s{s}"}) + "\n" for s in range(30)))
    samples = get_json(url, "/api/runs/one/samples?limit=3")["samples"]
    assert [s["text"] for s in samples] == ["s27", "s28", "s29"]
    assert get_json(url, "/api/runs")["runs"][0]["has_samples"]
    assert request(url, "/api/runs/nope/metrics")[0] == 404


def test_malformed_and_huge_lines_are_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": 1, "kind": "train", "loss": 2.0}, {"step": 2, "kind": "train", "loss": float("nan")}]
    lines = [
        json.dumps(good[0]),
        "not json at all",
        "[1, 2, 3]",
        '{"kind": "train"}',
        '{"step": "x", "kind": "eval"}',
        '{"step": 3, "kind": "train", "loss": ' + "1" * (MAX_LINE + 10) + "}",  # over a megabyte: skipped
        "\x00\xff garbage",
        "",
        json.dumps(good[1]),
    ]
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
    chunk = read_records(str(path))
    assert chunk.records == [good[0], {"step": 2, "kind": "train", "loss": None}]  # NaN -> null (valid JSON)
    assert chunk.skipped == 6 and chunk.offset == path.stat().st_size

    # an oversized line whose end is not written yet is passed over too, and the read goes on after it
    with open(path, "ab") as fh:
        fh.write(b'{"step": 4, "kind": "train", "x": "' + b"y" * (MAX_LINE + 5))
    chunk2 = read_records(str(path), chunk.offset, chunk.file)
    assert chunk2.records == [] and chunk2.skipped == 1 and chunk2.offset == path.stat().st_size
    with open(path, "ab") as fh:
        fh.write(b'"}\n' + json.dumps({"step": 5, "kind": "train"}).encode() + b"\n")
    chunk3 = read_records(str(path), chunk2.offset, chunk2.file)
    assert chunk3.records == [{"step": 5, "kind": "train"}] and chunk3.skipped == 1


def test_a_deleted_run_shows_as_missing_and_the_server_keeps_serving(tmp_path, dashboard):
    write_run(tmp_path / "a", 4)
    doomed = write_run(tmp_path / "b", 4)
    url = dashboard(tmp_path)
    assert {r["id"]: r["state"] for r in get_json(url, "/api/runs")["runs"]} == {"a": "running", "b": "running"}
    shutil.rmtree(doomed)
    assert {r["id"]: r["state"] for r in get_json(url, "/api/runs")["runs"]} == {"a": "running", "b": "missing"}
    status, body = request(url, "/api/runs/b/metrics?offset=0")
    assert status == 404 and json.loads(body)["state"] == "missing"
    assert request(url, "/api/runs/b/config")[0] == 404
    assert get_json(url, "/api/runs/b/samples") == {"samples": []}
    assert len(get_json(url, "/api/runs/a/metrics")["records"]) == 5


def test_run_state_rule(tmp_path, dashboard):
    now = time.time()
    write_run(tmp_path / "finished", 20, max_iters=10)  # an eval at step >= max_iters
    write_run(tmp_path / "running", 5, max_iters=100)
    crashed = write_run(tmp_path / "crashed", 5, max_iters=100)
    stopped = write_run(tmp_path / "stopped", 5, max_iters=100)
    ended = write_run(tmp_path / "ended", 5, max_iters=100)
    with open(ended / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 5, "kind": "end", "time": now}) + "\n")
    for run in (crashed, stopped):
        os.utime(run / "metrics.jsonl", (now - 600, now - 600))
    (stopped / "ckpt.pt").write_bytes(b"")  # written after the last line: an interrupted run that saved itself
    (crashed / "ckpt.pt").write_bytes(b"")
    os.utime(crashed / "ckpt.pt", (now - 900, now - 900))
    url = dashboard(tmp_path)
    states = {r["id"]: r["state"] for r in get_json(url, "/api/runs")["runs"]}
    assert states == {
        "finished": "finished",
        "running": "running",
        "crashed": "crashed",
        "stopped": "stopped",
        "ended": "finished",
    }


def skip_line(step: int, in_a_row: int, t: float, loss: float = float("nan"), grad_norm: float = float("nan")) -> str:
    """A skip record as train writes it (json.dumps allows NaN: the line holds a bare NaN)."""
    return (
        json.dumps(
            {
                "step": step,
                "kind": "skip",
                "loss": loss,
                "grad_norm": grad_norm,
                "in_a_row": in_a_row,
                "max_bad_steps": 10,
                "time": t,
            }
        )
        + "\n"
    )


def test_summary_counts_skipped_steps_and_the_api_lists_them(tmp_path, dashboard, monkeypatch):
    run = write_run(tmp_path / "runs" / "nan", 30, max_iters=100)
    clean = write_run(tmp_path / "runs" / "clean", 5, max_iters=100)
    t = time.time()
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(skip_line(30, 1, t))
        fh.write(skip_line(31, 2, t, loss=3.5, grad_norm=float("inf")))
    text = (run / "metrics.jsonl").read_text()
    assert "NaN" in text and "Infinity" in text  # written as train writes them, not as valid JSON
    # a long history around the skips: the summary skims train lines by their marker, yet counts every skip
    lines = [json.dumps({"step": s, "kind": "train", "loss": 2.0, "time": t}) + "\n" for s in range(32, 3032)]
    lines.insert(1000, skip_line(1031, 1, t))
    (run / "metrics.jsonl").write_text(text + "".join(lines))

    from gptforge.dashboard import runs as runs_module

    parsed = []
    parse = runs_module.parse_line
    monkeypatch.setattr(runs_module, "parse_line", lambda raw: parsed.append(raw) or parse(raw))
    index = RunIndex([str(tmp_path / "runs")])
    nan_run = {r.id: r for r in index.runs()}["nan"]
    nan_run.refresh()
    s = nan_run.summary
    assert s.skipped == 3 and s.last_skip["step"] == 1031 and s.last_skip["loss"] is None
    assert s.last_train["step"] == 3031 and len(parsed) < 100, len(parsed)  # skimmed: not 3,000 parses
    monkeypatch.undo()

    url = dashboard(tmp_path / "runs")
    listed = {r["id"]: r for r in get_json(url, "/api/runs")["runs"]}  # strict JSON: NaN arrives as null
    assert listed["clean"]["skipped"] == 0 and listed["clean"]["last_skip"] is None
    assert listed["nan"]["skipped"] == 3
    assert listed["nan"]["last_skip"] == {
        "step": 1031,
        "loss": None,
        "grad_norm": None,
        "in_a_row": 1,
        "max_bad_steps": 10,
    }
    assert listed["nan"]["step"] == 3031 and listed["nan"]["loss"] == 2.0

    # new lines are read incrementally: one more skip counts once, a fresh file (renamed in) starts from 0
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(skip_line(3032, 1, t, loss=float("-inf"), grad_norm=0.5))
    listed = {r["id"]: r for r in get_json(url, "/api/runs")["runs"]}
    assert listed["nan"]["skipped"] == 4 and listed["nan"]["last_skip"]["grad_norm"] == 0.5
    records = get_json(url, "/api/runs/nan/metrics?offset=0")["records"]
    skips = [r for r in records if r["kind"] == "skip"]
    assert [(r["step"], r["loss"], r["grad_norm"], r["in_a_row"]) for r in skips] == [
        (30, None, None, 1),
        (31, 3.5, None, 2),
        (1031, None, None, 1),
        (3032, None, 0.5, 1),
    ]
    tmp = clean / "metrics.jsonl.tmp"
    tmp.write_text(json.dumps({"step": 0, "kind": "train", "loss": 4.0, "time": t}) + "\n" + skip_line(1, 1, t))
    os.replace(tmp, clean / "metrics.jsonl")
    assert {r["id"]: r["skipped"] for r in get_json(url, "/api/runs")["runs"]} == {"clean": 1, "nan": 4}


TRAVERSALS = [
    "/../etc/passwd",
    "/static/../../pyproject.toml",
    "/static/..%2f..%2fpyproject.toml",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/static/%2e%2e/%2e%2e/pyproject.toml",
    "/%252e%252e/pyproject.toml",
    "/api/runs/..%2f..%2fetc/config",
    "/api/runs/../../../etc/config",
    "/etc/passwd",
    "//etc/passwd",
    "/static/..\\..\\pyproject.toml",
    "/static/server.py",
    "/static/../server.py",
    "/api/runs/%2Fetc%2Fpasswd/metrics",
    "http://example.com/../x",
    "/api/runs/run/../../../../etc/passwd",
    "/api/runs/run/metrics.jsonl",
    "/static/%00app.js",
]


def test_path_traversal_is_refused(tmp_path, dashboard):
    write_run(tmp_path / "run", 3)
    url = dashboard(tmp_path)
    for path in TRAVERSALS:
        status, body = request(url, path)
        assert status in (403, 404), (path, status)
        assert b"root:" not in body and b"[project]" not in body and b"import" not in body, path
    assert request(url, "/static/../../pyproject.toml")[0] == 403
    assert request(url, "/api/runs/run/metrics")[0] == 200  # the same server still answers real requests


def test_binds_localhost_by_default_and_checks_the_host_header(tmp_path, dashboard):
    write_run(tmp_path / "run", 3)
    url = dashboard(tmp_path)
    assert url.startswith("http://127.0.0.1:")
    assert request(url, "/api/runs", host="localhost:1234")[0] == 200
    assert request(url, "/api/runs", host="attacker.example:80")[0] == 403  # DNS rebinding
    status, body = request(url, "/")
    assert status == 200 and b"/static/plotly.min.js" in body
    status, body = request(url, "/static/plotly.min.js")
    assert status == 200 and b"plotly.js" in body[:200] and len(body) > 1_000_000


def test_server_starts_fast_without_torch_or_numpy(tmp_path):
    write_run(tmp_path / "run", 3)
    code = (
        "import time, sys, urllib.request\n"
        "t0 = time.perf_counter()\n"
        "from gptforge.dashboard.server import start_dashboard\n"
        f"server, url = start_dashboard([{str(tmp_path)!r}], port=0)\n"
        "runs = urllib.request.urlopen(url + 'api/runs', timeout=5).read()\n"
        "print(time.perf_counter() - t0)\n"
        "assert b'\"run\"' in runs, runs\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'\n"
        "assert 'plotly' not in sys.modules, 'plotly is found, never imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 3.0, r.stdout  # typically ~0.05 s: a behaviour check, not a benchmark


def test_cli_serves_and_prints_the_url(tmp_path):
    write_run(tmp_path / "run", 3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptforge", "dashboard", str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "no URL printed"
        line = proc.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert m and "1 run(s)" in line, line
        assert [r["id"] for r in get_json(m.group(1), "/api/runs")["runs"]] == ["run"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    assert proc.returncode == 0


def test_cli_user_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-m", "gptforge", "dashboard", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert r.returncode == 2 and "no such folder" in r.stderr and "Traceback" not in r.stderr
    # plotly not installed: sys.modules[name] = None is how Python marks a module as absent
    code = (
        "import sys; sys.modules['plotly'] = None\nfrom gptforge.cli.main import main\n"
        f"main(['dashboard', {str(tmp_path)!r}, '--port', '0'])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 2 and "pip install 'gptforge[dashboard]'" in r.stderr and "Traceback" not in r.stderr
