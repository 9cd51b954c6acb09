"""Benchmarks of talking to a model (issue 28): not a test, a script whose figures go to docs/PERFORMANCE.md.

    python scripts/serve_bench.py speed --out_dir RUN --hf EXPORT_FOLDER [--tokens 256] [--clients 8] [--json F]
    python scripts/serve_bench.py load --out_dir RUN [--requests 200] [--clients 16] [--json F]

speed: single-stream greedy decode through gptforge's engine (a chat Session, the cache kept) and through
transformers' `generate` on the run's `gptforge export` folder (same weights, same greedy tokens, the end-of-text token
ignored so both make exactly --tokens tokens); then `gptforge serve` with one streaming client and with --clients
concurrent streaming clients: time to first token and decode tokens/s (aggregate over the clients).
load: --requests requests from --clients concurrent loopback clients, a share disconnecting mid-stream and a share
malformed (bad JSON, unknown model, max_tokens 10^9, a 10 MB body, a wrong key): every well-formed one must be
answered, every malformed one a 4xx with OpenAI's error JSON; the server's memory before and after.
Timings are only as quiet as the machine: say which machine, and how busy, beside every figure."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # chat_tools: the tests' own helpers
from chat_tools import Server  # noqa: E402

PROMPT = "The history of the world, as far as we know it, begins with"


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    flags = open("/proc/cpuinfo").read()
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "bf16_flags": sorted({f for f in ("amx_bf16", "avx512_bf16") if f" {f}" in flags}),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
    }


def engine_single(out_dir: str, tokens: int, dtype: str, compile: str) -> dict:
    from gptforge.infer.chat_model import load_for_inference
    from gptforge.infer.decode import enable_compile
    from gptforge.infer.sampling import SamplingParams
    from gptforge.infer.session import Session

    lm = load_for_inference(out_dir, None, "resume", "cpu", dtype)
    enable_compile(lm, compile, slots=1)
    lm.stop_ids = frozenset()  # exactly `tokens` tokens, as transformers' min_new_tokens does
    best = None
    for _ in range(2):
        session = Session(lm, notify=lambda m: None)
        start = time.perf_counter()
        stream = session.answer(PROMPT, SamplingParams(temperature=0), tokens)
        next(stream)
        first = time.perf_counter()
        for _ in stream:
            pass
        end = time.perf_counter()
        run = {
            "ttft_s": first - start,
            "decode_tokens_per_s": (session.last.tokens - 1) / (end - first),
            "tokens": session.last.tokens,
        }
        best = run if best is None or run["decode_tokens_per_s"] > best["decode_tokens_per_s"] else best
    return best


def transformers_single(folder: str, tokens: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    ).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    options = {"do_sample": False, "pad_token_id": model.config.eos_token_id or 0}
    best = None
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **options)
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **options)
            total = time.perf_counter() - start
            made = out.shape[1] - ids.shape[1]
            run = {"ttft_s": first, "decode_tokens_per_s": (made - 1) / (total - first), "tokens": made}
            best = run if best is None or run["decode_tokens_per_s"] > best["decode_tokens_per_s"] else best
    return best


def compare_single(out_dir: str, hf: str | None, tokens: int, dtype: str, rounds: int, compile: str) -> dict:
    """The engine and transformers alternating (the machine's load changes by the second): each one's best round,
    and the median of the rounds' ratios."""
    runs: dict[str, list[dict]] = {"engine": [], "transformers": []}
    for _ in range(rounds):
        runs["engine"].append(engine_single(out_dir, tokens, dtype, compile))
        if hf:
            runs["transformers"].append(transformers_single(hf, tokens, dtype))
    out = {k: max(v, key=lambda r: r["decode_tokens_per_s"]) for k, v in runs.items() if v}
    if hf:
        ratios = [e["decode_tokens_per_s"] / t["decode_tokens_per_s"] for e, t in zip(*runs.values(), strict=True)]
        out["engine_vs_transformers_median"] = statistics.median(ratios)
        out["engine_vs_transformers_rounds"] = ratios
    return out


def stream_one(url: str, model: str, tokens: int, prompt: str, barrier=None, key: str | None = None) -> dict:
    """One streaming completion read with plain requests (a light client: the server is measured, not the
    client's parsing); times of the first and last token, tokens from the usage chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if barrier:
        barrier.wait()
    start = time.perf_counter()
    first = last = None
    usage = None
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if b'"usage": {' in line:  # parsed: only the usage chunk (8 clients share 2 cores with the server)
                usage = json.loads(line[6:])["usage"]
            elif b'"text": ""' not in line:
                first = first or time.perf_counter()
                last = time.perf_counter()
    return {"start": start, "first": first, "last": last, "tokens": usage["completion_tokens"]}


def serve_streams(out_dir: str, tokens: int, clients: int, dtype: str, compile: str, rounds: int) -> dict:
    """One streaming client, then `clients` at once, alternating `rounds` times on one server: the best round of
    each, and the median of the rounds' ratios (a short stream's timing swings with the machine)."""
    server = Server(
        f"--out_dir={out_dir}",
        f"--dtype={dtype}",
        f"--compile={compile}",
        "--name=bench",
        env={"OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    try:
        stream_one(server.url, "bench", 8, PROMPT)  # warm-up
        singles, manys = [], []
        for _ in range(max(1, rounds)):
            one = stream_one(server.url, "bench", tokens, PROMPT)
            singles.append(
                {
                    "ttft_s": one["first"] - one["start"],
                    "decode_tokens_per_s": (one["tokens"] - 1) / (one["last"] - one["first"]),
                }
            )
            manys.append(concurrent_streams(server.url, tokens, clients))
        ratios = [m["aggregate_tokens_per_s"] / s["decode_tokens_per_s"] for s, m in zip(singles, manys, strict=True)]
        many = max(manys, key=lambda m: m["aggregate_tokens_per_s"])
        many.update(health=server.health(), vs_single_stream_median=statistics.median(ratios), rounds=ratios)
        return {"single": max(singles, key=lambda s: s["decode_tokens_per_s"]), "concurrent": many}
    finally:
        server.stop()


def concurrent_streams(url: str, tokens: int, clients: int) -> dict:
    barrier, results = threading.Barrier(clients), [None] * clients

    def run(i):
        results[i] = stream_one(url, "bench", tokens, f"{PROMPT} {chr(97 + i % 26)}", barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    begin, end = min(r["start"] for r in results), max(r["last"] for r in results)
    ttfts = [r["first"] - r["start"] for r in results]
    return {
        "clients": clients,
        "aggregate_tokens_per_s": sum(r["tokens"] for r in results) / (end - begin),
        "wall_s": end - begin,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
    }


MALFORMED = {  # what is sent, and the status it must get
    "bad JSON": (b'{"model": "bench", "prompt": ', {}, 400),
    "unknown model": (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), {}, 404),
    "max_tokens 10^9": (json.dumps({"model": "bench", "prompt": "x", "max_tokens": 10**9}).encode(), {}, 400),
    "10 MB body": (json.dumps({"model": "bench", "prompt": "x" * 10_000_000}).encode(), {}, 413),
    "wrong key": (json.dumps({"model": "bench", "prompt": "x"}).encode(), {"Authorization": "Bearer wrong"}, 401),
}
KEY = "bench-key"


def one_request(url: str, kind: str, rng: random.Random) -> tuple[str, bool, str]:
    """(kind, as it should be, what happened) of one request of the load test."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if kind in MALFORMED:
        body, headers, status = MALFORMED[kind]
        try:
            r = requests.post(f"{url}/v1/completions", data=body, headers={**auth, **headers}, timeout=120)
        except requests.ConnectionError as e:  # a server may close on an oversized body before reading it
            return kind, False, f"connection error {e}"
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        good = r.status_code == status and {"message", "type", "param", "code"} <= set(error)
        return kind, good, f"{r.status_code} {error.get('code')}"
    tokens, stream = rng.randint(8, 96), rng.random() < 0.5 or kind == "disconnect"
    body = {
        "model": "bench",
        "prompt": "Once upon a time " * rng.randint(1, 8),
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
        "n": rng.choice([1, 1, 2]),
        "temperature": rng.choice([0, 0.8]),
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "disconnect":
        body.update(max_tokens=200, n=1)
        with requests.post(f"{url}/v1/completions", json=body, headers=auth, stream=True, timeout=120) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith(b"data: ")
                if chunks >= 3:
                    break  # leaving mid-stream: the connection closes here
        return kind, r.status_code == 200, "left after 3 chunks"
    r = requests.post(f"{url}/v1/completions", json=body, headers=auth, stream=stream, timeout=300)
    if not stream:
        answer = r.json()
        return kind, r.status_code == 200 and answer["usage"]["completion_tokens"] == tokens * body["n"], "ok"
    texts = [line for line in r.iter_lines() if line.startswith(b"data: ")]  # a token without text sends no chunk
    usage = json.loads(texts[-2][6:]).get("usage") if len(texts) > 1 else None
    made = (usage or {}).get("completion_tokens")
    return kind, r.status_code == 200 and texts[-1] == b"data: [DONE]" and made == tokens * body["n"], f"{made} tokens"


def load_test(out_dir: str, count: int, clients: int, dtype: str, passes: int = 2) -> dict:
    """count requests from `clients` threads: 60% well-formed (streamed or not, n 1-2), 15% leaving mid-stream, 25%
    malformed; a warm-up pass first, then `passes` measured passes (memory must not keep growing)."""
    import concurrent.futures

    server = Server(
        f"--out_dir={out_dir}",
        f"--dtype={dtype}",
        "--name=bench",
        f"--api_key={KEY}",
        "--compile=auto",  # serve's default
        env={"OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    rng = random.Random(0)
    kinds = ["good"] * 60 + ["disconnect"] * 15 + [k for k in MALFORMED for _ in range(5)]
    memory, passes = {"idle_kb": rss_kb(server.proc.pid)}, []
    try:
        for name, n in (("warm-up", clients * 3), *((f"pass {i + 1}", count) for i in range(passes))):
            plan = [rng.choice(kinds) for _ in range(n)]
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                done = list(pool.map(lambda k: one_request(server.url, k, random.Random(rng.random())), plan))
            wall = time.perf_counter() - start
            deadline = time.monotonic() + 30
            while (server.health()["rows"] or server.health()["waiting"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            bad = [d for d in done if not d[1]]
            passes.append(
                {
                    "pass": name,
                    "requests": n,
                    "wall_s": wall,
                    "failed": bad[:10],
                    "failures": len(bad),
                    "by_kind": {k: plan.count(k) for k in sorted(set(plan))},
                    "health": server.health(),
                }
            )
            memory[f"after_{name.replace(' ', '_').replace('-', '_')}_kb"] = rss_kb(server.proc.pid)
        alive = server.proc.poll() is None
    finally:
        code = server.stop()
    return {"passes": passes, "memory": memory, "server_alive_at_end": alive, "exit_code": code}


def rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["speed", "load"])
    p.add_argument("--out_dir", required=True)
    p.add_argument("--hf", help="the run's `gptforge export` folder (speed)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--passes", type=int, default=2, help="load: measured passes of --requests each (memory must level)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", default="on", help="the engine's and the server's --compile (on, off, auto)")
    p.add_argument("--rounds", type=int, default=3, help="engine and transformers alternate this many times")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = {"machine": machine(), "model": args.out_dir, "dtype": args.dtype, "compile": args.compile}
    if args.what == "speed":
        result.update(compare_single(args.out_dir, args.hf, args.tokens, args.dtype, args.rounds, args.compile))
        result["serve"] = serve_streams(
            args.out_dir, args.tokens, args.clients or 8, args.dtype, args.compile, args.rounds
        )
    else:
        result["load"] = load_test(args.out_dir, args.requests, args.clients or 16, args.dtype, args.passes)
    result["machine"]["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    random.seed(0)
    main()
