"""`gptforge serve`: a model behind OpenAI's HTTP API, with a chat page at `/`.

FastAPI on uvicorn, the stack vLLM, SGLang and most OpenAI-compatible servers use: ASGI serves many slow streaming
clients from one event loop, streams Server-Sent Events as OpenAI's clients read them, and tells a handler when its
client went away. The model runs on the batcher's thread (infer/batcher.py), so every request in flight shares each
model step; the event loop only parses, checks and forwards tokens.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health; GET /tokenizer_info, POST
/tokenize, POST /detokenize (vLLM's, which lm-eval's local-completions uses to tokenize); GET / and /static/* (the
chat page). Bound to loopback by default (and then a Host header that is not loopback is refused: DNS
rebinding); with --api_key every route but /health and the page needs `Authorization: Bearer KEY`."""

import asyncio
import contextlib
import hmac
import json
import signal
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gptforge.chat.template import CHAT_TEMPLATE
from gptforge.core.console import log
from gptforge.core.errors import UserError
from gptforge.infer.batcher import Batcher, Event, Mailbox, Request
from gptforge.infer.chat_model import LoadedModel, decode_with_specials, encode_with_specials, load_for_inference
from gptforge.infer.decode import enable_compile
from gptforge.infer.openai_api import ApiError, Collector, Limits, Parsed, parse_chat, parse_completion
from gptforge.infer.options import ServeArgs
from gptforge.infer.serve_options import bind, check_model_room, check_options, listen
from gptforge.infer.toolcalls import builtin_tools

STATIC = Path(__file__).parent / "static"
PAGES = {
    "/": ("index.html", "text/html"),
    "/static/chat.js": ("chat.js", "text/javascript"),
    "/static/chat.css": ("chat.css", "text/css"),
}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _imports():
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise UserError(
            f"gptforge serve needs FastAPI and uvicorn ({e.name} is missing): pip install 'gptforge[serve]' (or "
            "'gptforge[all]': every extra)"
        ) from None
    return fastapi, uvicorn


def build_app(
    lm: LoadedModel,
    limits: Limits,
    api_key: str | None = None,
    max_batch: int = 16,
    loopback: bool = True,
    thread: bool = True,
    tools: str = "calculator",
):
    """The ASGI app. Its batcher stops when the app shuts down (uvicorn's lifespan); it runs in a thread of its own
    from now on, or with thread=False wherever app.state.batcher.run() is called. tools: the built-in tools run."""
    fastapi, _ = _imports()
    batcher = Batcher(lm, max_batch, thread, builtin_tools(tools))
    mailbox = Mailbox()
    batcher.after_step = mailbox.flush

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    app = fastapi.FastAPI(title="gptforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher, app.state.lm, app.state.mailbox = batcher, lm, mailbox
    guard = Guard(loopback, api_key)
    add_error_handlers(app)
    add_api_routes(fastapi, app, lm, batcher, guard, limits)
    add_tokenizer_routes(fastapi, app, lm, guard, limits)
    add_page_routes(fastapi, app, guard)
    return app


class Guard:
    """Who may ask: loopback host names only when bound to loopback (DNS rebinding), the key when there is one."""

    def __init__(self, loopback: bool, api_key: str | None):
        self.loopback, self.api_key = loopback, api_key

    def __call__(self, request, auth: bool = True) -> None:
        host = request.headers.get("host") or ""
        host = host[: host.find("]") + 1] if host.startswith("[") else host.rsplit(":", 1)[0]  # no port
        if self.loopback and host not in LOOPBACK_HOSTS:
            raise ApiError(
                403, "this server is bound to loopback and answers only loopback host names", None, "forbidden_host"
            )
        if auth and self.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise ApiError(
                    401,
                    "Incorrect API key provided: send the server's --api_key as 'Authorization: Bearer KEY'",
                    None,
                    "invalid_api_key",
                )


def add_error_handlers(app) -> None:
    """Every error is OpenAI's JSON: ours, a UserError (e.g. text a character vocabulary cannot encode), and
    Starlette's own (an unknown route, a wrong method)."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(UserError)
    async def user_error(request, e: UserError):
        return JSONResponse(ApiError(400, str(e), None, "invalid_value").body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(ApiError(e.status_code, str(e.detail), None, code).body(), status_code=e.status_code)


def add_api_routes(fastapi, app, lm: LoadedModel, batcher: Batcher, guard: Guard, limits: Limits) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": lm.name, **batcher.snapshot()}

    @app.get("/v1/models")
    async def models(request: fastapi.Request):
        guard(request)
        card = {
            "id": lm.name,
            "object": "model",
            "created": 0,
            "owned_by": "gptforge",
            "max_model_len": lm.block_size,
            "chat": lm.chat,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        guard(request)
        parsed = parse_chat(await read_json(request, limits.max_body), lm, limits)
        return await generate(request, parsed, lm, batcher)

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        guard(request)
        parsed = parse_completion(await read_json(request, limits.max_body), lm, limits)
        return await generate(request, parsed, lm, batcher)


async def generate(request, parsed: Parsed, lm: LoadedModel, batcher: Batcher):
    """Hand the request to the batcher; stream its events as SSE, or collect them into one response."""
    from fastapi.responses import Response, StreamingResponse

    if parsed.rows > batcher.max_batch:
        raise ApiError(
            400,
            f"this request needs {parsed.rows} rows (n x prompts); the server batches at most {batcher.max_batch}",
            "n",
            "invalid_value",
        )
    queue, mailbox = asyncio.Queue(), request.app.state.mailbox
    mailbox.loop = asyncio.get_running_loop()
    job = Request(
        parsed.prompts,
        parsed.params,
        parsed.max_tokens,
        lambda event: mailbox.post(queue, event),
        parsed.n,
        parsed.stop,
        prompt_logprobs=parsed.echo and parsed.params.logprobs is not None,
        ignore_eos=parsed.ignore_eos,
        plan=parsed.plan,
    )
    try:
        batcher.submit(job)
    except RuntimeError:
        raise ApiError(503, "the server is shutting down", None, "shutting_down", "server_error") from None
    collector = Collector(parsed, lm)
    if parsed.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(sse(job, queue, collector, batcher), media_type="text/event-stream", headers=headers)
    if not await collect(request, job, queue, collector, batcher):
        return Response(status_code=499)  # the client is gone: nobody reads this
    if collector.error:
        raise ApiError(500, collector.error, None, "model_error", "server_error")
    return collector.response()


async def collect(request, job: Request, queue: asyncio.Queue, collector: Collector, batcher: Batcher) -> bool:
    """Gather the events until the request is done; False (and the request cancelled) if the client left."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while not collector.done:
            get = asyncio.ensure_future(queue.get())
            finished, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in finished:
                get.cancel()
                batcher.cancel(job)
                return False
            collector.add(get.result())
        return True
    finally:
        gone.cancel()


async def sse(job: Request, queue: asyncio.Queue, collector: Collector, batcher: Batcher) -> AsyncIterator[str]:
    """The stream: OpenAI's chunks as Server-Sent Events, then [DONE]. A client that leaves cancels this generator
    (Starlette does), which cancels the request: its rows are free at the next step."""
    try:
        for chunk in collector.first_chunks():
            yield f"data: {json.dumps(chunk)}\n\n"
        while not collector.done:
            events: list[Event] = [await queue.get()]
            while not queue.empty():  # what piled up while the client read: sent in one write
                events.append(queue.get_nowait())
            out = []
            for event in events:
                collector.add(event)
                if event.kind == "error":
                    out.append(f"data: {json.dumps(ApiError(500, event.text, None, 'model_error').body())}\n\n")
                    break
                out += [f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n" for chunk in collector.chunks(event)]
            yield "".join(out)
            if collector.error:
                break
        if collector.parsed.include_usage and not collector.error:
            yield f"data: {json.dumps(collector.usage_chunk())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not collector.done:
            batcher.cancel(job)


async def disconnected(request) -> None:
    """Returns when the client has gone (its body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_json(request, limit: int) -> Any:
    """The body as JSON, refused unread when it declares more than `limit` bytes, and cut off when it sends more."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(
            413, f"the request body is {declared} bytes; this server takes at most {limit}", None, "request_too_large"
        )
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(
                413, f"the request body is over {limit} bytes, this server's limit", None, "request_too_large"
            )
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None


def add_tokenizer_routes(fastapi, app, lm: LoadedModel, guard, limits: Limits) -> None:
    """vLLM's tokenizer routes: lm-eval's local-completions tokenizes through them (tokenizer_backend 'remote'),
    so any gptforge tokenizer works without a Hugging Face copy."""
    specials = lm.specials()
    names = {i: name for name, i in specials.items()}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: fastapi.Request):
        guard(request)
        eot = names.get(lm.tokenizer.eot_token) if lm.tokenizer.eot_token is not None else None
        return {
            "tokenizer_class": lm.tokenizer.kind,
            "eos_token": eot,
            "bos_token": None,
            "pad_token": None,
            "model_max_length": lm.block_size,
            "chat_template": CHAT_TEMPLATE if lm.chat else None,
        }

    @app.post("/tokenize")
    async def tokenize(request: fastapi.Request):
        guard(request)
        body = await read_json(request, limits.max_body)
        if isinstance(body, dict) and isinstance(body.get("messages"), list) and lm.chat:
            from gptforge.infer.openai_api import _message

            tokens = lm.chat_prompt([_message(m, i) for i, m in enumerate(body["messages"])])
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
            tokens = encode_with_specials(lm.tokenizer, body["prompt"], specials)
        else:
            raise ApiError(400, "give 'prompt' (a string) or, for a chat model, 'messages'", "prompt", "invalid_value")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": lm.block_size}

    @app.post("/detokenize")
    async def detokenize(request: fastapi.Request):
        guard(request)
        body = await read_json(request, limits.max_body)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "'tokens' must be a list of token ids", "tokens", "invalid_value")
        return {"prompt": decode_with_specials(lm.tokenizer, tokens, specials)}


def add_page_routes(fastapi, app, guard) -> None:
    async def page(request: fastapi.Request):
        guard(request, auth=False)
        name, kind = PAGES[request.url.path]
        headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
        return fastapi.Response((STATIC / name).read_bytes(), media_type=kind, headers=headers)

    for path in PAGES:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return fastapi.Response(status_code=204)  # no icon: said without a 404 in the browser's console


def serve(args: ServeArgs) -> None:
    """`gptforge serve`: check the options, take the port, load the model, serve until Ctrl-C (which drains: requests
    in flight finish, new ones are refused)."""
    check_options(args)
    _, uvicorn = _imports()
    sock = bind(args.host, args.port)  # before the model: a port in use costs a second, not a load and a compile
    with contextlib.closing(sock):
        lm = load_for_inference(args.out_dir, args.ckpt, args.init_from, args.device, args.dtype, args.name)
        check_model_room(lm, args.max_batch, args.max_tokens)
        enable_compile(lm, args.compile, slots=args.max_batch, batch_sizes=(1, 2) if args.max_batch > 1 else (1,))
        loopback = args.host in LOOPBACK_HOSTS
        if not loopback and not args.api_key:
            log(f"warning: --host={args.host} lets other machines use this model, and no --api_key is set")
        body = int(args.max_body_mb * (1 << 20))
        limits = Limits(max_body=body, max_messages=args.max_messages, max_tokens=args.max_tokens)
        app = build_app(lm, limits, args.api_key, args.max_batch, loopback, thread=False, tools=args.tools)
        listen(sock, args.host, args.port)
        run_server(uvicorn, app, sock, args.host, lm)


def run_server(uvicorn, app, sock: socket.socket, host: str, lm: LoadedModel) -> None:
    """uvicorn on `sock` in a thread of its own, the model's batcher in this one, until Ctrl-C has drained them."""
    url_host = f"[{host}]" if ":" in host else host
    log(f"{lm.describe()}")
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=60, access_log=False)
    server = uvicorn.Server(config)
    web = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="gptforge-http", daemon=True)
    previous = {sig: signal.signal(sig, lambda *_: stop(server)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        web.start()
        log(f"serving on http://{url_host}:{sock.getsockname()[1]} (chat page at /, OpenAI API at /v1); Ctrl-C stops")
        app.state.batcher.run(alive=web.is_alive)  # the model in the main thread; HTTP in `web`
        web.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log(f"stopped after {app.state.batcher.stats['requests']} request(s)")


def stop(server) -> None:
    """Ctrl-C or SIGTERM: stop taking requests and drain (uvicorn's graceful shutdown, then the batcher closes with
    the app); a second Ctrl-C: at once."""
    if server.should_exit:
        server.force_exit = True
    server.should_exit = True
