"""The OpenAI-compatible HTTP surface: FastAPI routes over a `Scheduler`.

`create_app` takes a loaded `Engine` (tests inject tiny models this way) or
a `loader` that builds one on a background thread, so `/health` can answer
503 while the weights load.  Every failure a client can cause comes back in
the OpenAI error shape with its status, and nothing a request does can stop
the worker: the server goes on serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stagedspec.constraints.processor import LogitControls
from stagedspec.errors import first_line
from stagedspec.request_plan import PlanError, plan_constraints, plan_request
from stagedspec.server.engine import Engine
from stagedspec.server.guard import AccessGuard, AccessPolicy
from stagedspec.server.metrics import Metrics
from stagedspec.server.scheduler import Job, Scheduler
from stagedspec.server.schemas import APIError, GenerationRequest, bad, parse_generation, parse_json
from stagedspec.threads import no_parallel_regions_here

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: far more than the longest prompt a small model's context holds
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ServerState:
    """What the routes share: the scheduler once the engine is loaded, or why loading failed."""

    def __init__(self, api_key: str | None, max_body: int, metrics: Metrics) -> None:
        self.api_key = api_key
        self.max_body = max_body
        self.metrics = metrics
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        self.started = int(time.time())

    def ready(self) -> Scheduler:
        if self.scheduler is None:
            msg = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, msg, type="server_error", code="model_not_ready")
        return self.scheduler


def create_app(engine: Engine | None = None, *, loader: Callable[[], Engine] | None = None,
               api_key: str | None = None, max_batch: int = 8, max_memory: int | None = None,
               max_body: int = DEFAULT_MAX_BODY, log: Callable[[str], None] | None = None,
               on_load_error: Callable[[str], None] | None = None, batch_passes: bool = True,
               host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (),
               allowed_origins: Iterable[str] = ()) -> FastAPI:
    """An app serving `engine`, or the engine `loader()` returns (loaded in the background).

    `on_load_error(message)` is called (on the loader thread) if loading fails: the CLI stops the
    server then, rather than leave a process that can only answer 503.  `host` (the bound address),
    `allowed_hosts` and `allowed_origins` say which `Host` headers and browser origins are answered
    (`server.guard`)."""
    if (engine is None) == (loader is None):
        raise ValueError("pass exactly one of engine or loader")
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    state = ServerState(api_key or None, max_body, Metrics())

    def bring_up(get_engine: Callable[[], Engine]) -> None:
        try:
            pause = float(os.environ.get("STAGEDSPEC_SERVE_ROUND_PAUSE", "0") or 0)  # a test hook, see Scheduler
            sched = Scheduler(get_engine(), max_batch=max_batch, max_memory=max_memory, metrics=state.metrics,
                              round_pause=pause, batch_passes=batch_passes)
        except Exception as e:  # noqa: BLE001 - reported by /health and on stderr
            state.load_error = first_line(e)
            say(f"stagedspec serve: error: {state.load_error}")
            if on_load_error is not None:
                on_load_error(state.load_error)
            return
        say(sched.describe())
        notice = sched.exactness.notice()
        if notice:
            say(notice)
        sched.start()
        state.scheduler = sched

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            bring_up(lambda: engine)
        else:
            threading.Thread(target=bring_up, args=(loader,), name="stagedspec-loader", daemon=True).start()
        # The event loop's own operations (request checks, logit biases) are small: no OpenMP pool of its own,
        # which would put the scheduler's passes on sleeping barriers (`threads.no_parallel_regions_here`).
        no_parallel_regions_here()
        yield
        if state.scheduler is not None:
            state.scheduler.stop()

    app = FastAPI(title="stagedspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stagedspec = state
    app.add_middleware(AccessGuard, policy=AccessPolicy.build(host, allowed_hosts, allowed_origins))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(APIError(500, f"internal error: {first_line(exc)}", type="server_error"))

    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.scheduler is None:
            status = "error" if state.load_error else "loading"
            return JSONResponse({"status": status, "error": state.load_error}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(sched: Scheduler) -> dict[str, Any]:
        return {"id": sched.engine.model_name, "object": "model", "created": state.started, "owned_by": "stagedspec",
                "stagedspec": sched.exactness.card()}

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [model_card(state.ready())]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        check_auth(request)
        sched = state.ready()
        if not sched.engine.serves(model_id):
            raise unknown_model(model_id, sched)
        return JSONResponse(model_card(sched))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        check_auth(request)
        check_content_type(request)
        body = parse_json(await read_body(request, state.max_body))
        req = parse_generation(body, chat)
        sched = state.ready()
        if req.model is None:
            raise bad("'model' is required", "model")
        if not sched.engine.serves(req.model):
            raise unknown_model(req.model, sched)
        prompt_ids = encode_prompt(sched.engine, req)
        spec = sched.engine.speculation_for(req.speculation)
        try:  # the checks the CLI and the library run, in their words (`stagedspec.request_plan`)
            plan = plan_request(prompt_ids, max_new_tokens=default_max_tokens(sched.engine, req, len(prompt_ids)),
                                context=sched.engine.max_context, speculation=spec, temperature=req.temperature,
                                top_k=req.top_k, top_p=req.top_p, seed=req.seed, stop=req.stop)
            processor = plan_constraints(LogitControls(req.logit_bias, req.grammar),
                                         sched.engine.model.config.vocab_size, sched.engine.grammar_compiler)
        except PlanError as e:
            param = "messages" if req.chat and e.param == "prompt" else e.param
            raise bad(str(e), param, e.code) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        job = Job(plan, deliver, processor=processor)
        sched.submit(job)
        reply = Reply(chat, sched.engine.model_name, len(prompt_ids))
        if req.stream:
            return StreamingResponse(stream(reply, req, job, sched, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, reply, job, sched, events)

    return app


def error_response(err: APIError, headers: dict[str, str] | None = None) -> Response:
    """The OpenAI error shape as ASCII JSON: whatever a message quotes (a client's odd field name, an
    exception's text), the body always encodes."""
    return Response(json.dumps(err.body()), status_code=err.status, headers=headers, media_type="application/json")


def check_content_type(request: Request) -> None:
    """415 unless the body is declared `application/json` (parameters such as charset allowed).

    Why: a browser sends a cross-origin `text/plain` or form POST without asking first (no CORS
    preflight); insisting on JSON means any page's request to this server needs a preflight, which
    only origins listed by `--allow-origin` pass."""
    declared = request.headers.get("content-type", "")
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = json.dumps(declared[:100]) if declared else "none"
        raise APIError(415, f"the request body must be sent as Content-Type: application/json (got {shown})",
                       code="unsupported_media_type")


def unknown_model(name: str, sched: Scheduler) -> APIError:
    return APIError(404, f"the model {name!r} does not exist: this server serves {sched.engine.model_name!r}",
                    "model", "model_not_found")


async def read_body(request: Request, cap: int) -> bytes:
    """The body, or 413 past `cap` bytes (what is left is read and dropped, so the client gets the answer)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= cap:
            chunks.append(chunk)
    if size > cap:
        raise APIError(413, f"the request body ({size} bytes) is over this server's cap of {cap} bytes",
                       code="request_too_large")
    return b"".join(chunks)


def encode_prompt(engine: Engine, req: GenerationRequest) -> list[int]:
    tok = engine.tokenizer
    if req.chat:
        try:
            text = tok.apply_chat_template(req.messages)
        except Exception as e:  # noqa: BLE001 - a template's own raise_exception, or a bad role
            raise bad(f"the messages do not fit the model's chat template: {first_line(e)}", "messages") from None
        ids = tok.encode(text)
    elif isinstance(req.prompt, str):
        ids = tok.encode(req.prompt)
    else:
        vocab = engine.model.config.vocab_size
        if not all(0 <= t < vocab for t in req.prompt):
            raise bad(f"'prompt' token ids must be in [0, {vocab})", "prompt")
        ids = list(req.prompt)
    if not ids:
        raise bad("the prompt is empty after tokenisation", "messages" if req.chat else "prompt")
    return ids


def default_max_tokens(engine: Engine, req: GenerationRequest, prompt_len: int) -> int:
    """The request's max_tokens, or the API's default: the rest of the context for a chat request, at most
    `DEFAULT_COMPLETION_TOKENS` for a completion (`plan_request` then checks that it fits)."""
    if req.max_tokens:
        return req.max_tokens
    room = max(0, engine.max_context - prompt_len)
    return room if req.chat else min(DEFAULT_COMPLETION_TOKENS, room)


class Reply:
    """Builds the OpenAI response objects (whole and streamed) for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, info: dict[str, Any]) -> dict[str, int]:
        n = len(info["token_ids"])
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    @staticmethod
    def extension(info: dict[str, Any]) -> dict[str, Any]:
        mal = info["mean_accepted_length"]
        return {"method": info["method"], "mean_accepted_length": mal if math.isfinite(mal) else None,
                "tokens_by_stage": info["tokens_by_stage"], "oracle_passes": info["oracle_passes"],
                "stages": info["stages"], "seconds": info["seconds"], "token_ids": info["token_ids"],
                "speculation_off_steps": info.get("speculation_off_steps", 0),
                "tree_levels": info.get("tree_levels", {}), "tree_caps": info.get("tree_caps", {})}

    def whole(self, text: str, finish_reason: str, info: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(info),
                "stagedspec": self.extension(info)}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              usage_field: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if usage_field:
            out["usage"] = None
        return out

    def usage_chunk(self, info: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage(info)}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def error_from_event(event: tuple) -> APIError:
    _, status, message = event
    return APIError(status, message, type="server_error" if status >= 500 else "invalid_request_error")


async def stream(reply: Reply, req: GenerationRequest, job: Job, sched: Scheduler,
                 events: asyncio.Queue) -> AsyncIterator[str]:
    """`data: {chunk}` lines, one per text piece, then the finish chunk, the usage chunk and `[DONE]`.

    A client that disconnects cancels this generator (Starlette does, while it
    awaits the next event); `finally` then cancels the job, so the worker
    drops it at its next step boundary.
    """
    done = False
    try:
        if reply.chat:
            yield sse(reply.chunk(None, role=True, usage_field=req.include_usage))
        while True:
            event = await events.get()
            if event[0] == "text":
                yield sse(reply.chunk(event[1], usage_field=req.include_usage))
            elif event[0] == "done":
                _, finish_reason, info = event
                last = reply.chunk(None if reply.chat else "", finish_reason, usage_field=req.include_usage)
                last["stagedspec"] = reply.extension(info)
                yield sse(last)
                if req.include_usage:
                    yield sse(reply.usage_chunk(info))
                break
            else:
                yield sse(error_from_event(event).body())
                break
        done = True
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            job.cancel()
            sched.wake()


async def collect(request: Request, reply: Reply, job: Job, sched: Scheduler,
                  events: asyncio.Queue) -> Response:
    """Wait for the whole completion; a client that goes away meanwhile cancels it.

    The body has been read, so the only message left on the connection is
    `http.disconnect`: a task waits for it alongside the scheduler's events.
    """
    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    parts: list[str] = []
    done = False
    gone = asyncio.ensure_future(client_gone())
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return Response(status_code=499)  # nobody reads it: the client is gone
            event = getter.result()
            if event[0] == "text":
                parts.append(event[1])
            elif event[0] == "done":
                done = True
                return JSONResponse(reply.whole("".join(parts), event[1], event[2]))
            else:
                done = True
                raise error_from_event(event)
    finally:
        gone.cancel()
        if not done:
            job.cancel()
            sched.wake()
