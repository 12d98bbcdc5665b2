"""The HTTP routes of `qspec serve` (FastAPI): OpenAI's /v1/chat/completions, /v1/completions and
/v1/models, plus /health and /metrics.

Every error a client can cause is answered as OpenAI does, {"error": {"message", "type",
"param", "code"}}, never with a traceback. Generation runs on the scheduler's worker thread; the
routes only validate, queue, and relay (as JSON or as server-sent events).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from .metrics import Metrics
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("qspec.server")

MAX_BODY_BYTES = 1 << 20
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
STATS = ("cached_prompt_tokens", "prefill_s", "decode_s", "tokens_per_s", "drafted", "accepted",
         "acceptance_rate", "tokens_per_step", "draft_s", "verify_s", "steps", "lookup_rows", "lookup_accepted",
         "lookup_steps")


@dataclass
class Settings:
    model_id: str
    ctx: int                          # prompt + new tokens must fit in this
    api_key: str | None = None
    max_queue: int = 16
    parallel: int = 1                 # generations run (and batched) at once
    max_body: int = MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    draft_kwargs: dict = field(default_factory=dict)  # draft_max, draft_min, draft_p_min, tree caps


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)

    def body(self) -> dict:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


class Guard:
    """ASGI middleware: the API key (every path but /health) and the requests counter."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if self.expected and scope["path"] != "/health" and not hmac.compare_digest(given, self.expected):
                await ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key").response()(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(path if path in ENDPOINTS else "other", str(status[0])).inc()


async def read_json(request: Request, limit: int) -> dict:
    size = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
    if size.isdigit() and int(size) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return obj


def parse(model: type[BaseModel], obj: dict):
    try:
        req = model.model_validate(obj)
        req.check_extras()
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return req


async def watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (its generation stops at the next token)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def create_app(engine, settings: Settings) -> FastAPI:
    metrics = Metrics()
    scheduler = Scheduler(engine, settings.draft_kwargs, settings.max_queue, metrics, settings.parallel)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, settings.shutdown_timeout)

    app = FastAPI(title="qspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=settings.api_key, metrics=metrics)
    app.state.scheduler = scheduler

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return ApiError(500, "internal server error", type="server_error").response()

    def model_card() -> dict:
        return {"id": settings.model_id, "object": "model", "created": 0, "owned_by": "qspec"}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != settings.model_id:
            raise unknown_model(model_id)
        return model_card()

    def unknown_model(name: str) -> ApiError:
        return ApiError(404, f"The model '{name}' does not exist; this server serves '{settings.model_id}'",
                        param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request, settings.max_body))
        return await complete(request, req, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request, settings.max_body))
        return await complete(request, req, chat=False)

    def prompt_ids(req, chat: bool) -> list[int]:
        try:
            if chat:
                return engine.encode_messages([m.as_template_message() for m in req.messages])
            return engine.encode_prompt(req.prompt, chat=False)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt") from None

    async def complete(request: Request, req, chat: bool):
        if req.model is not None and req.model != settings.model_id:
            raise unknown_model(req.model)
        ids = await asyncio.to_thread(prompt_ids, req, chat)  # a long prompt takes a while to tokenize
        ctx, cap = settings.ctx, req.new_tokens_cap
        if len(ids) >= ctx or cap is not None and len(ids) + cap > ctx:
            asked = f"{len(ids)} in the prompt" + (f" + {cap} for the completion" if cap is not None else "")
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens; the request needs "
                           f"more ({asked})", param="messages" if chat else "prompt", code="context_length_exceeded")
        job = Job(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], ids=ids,
                  max_new=cap if cap is not None else ctx - len(ids),
                  sampling=dict(temperature=req.temperature, top_p=req.top_p, seed=req.seed),
                  stops=req.stop, loop=asyncio.get_running_loop(), logprobs=req.top_wanted,
                  echo=engine.tokenizer.decode(ids) if not chat and req.echo else None)
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(503, str(e), type="server_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        reply = Reply(job, chat, settings.model_id)
        watcher = asyncio.create_task(watch_disconnect(request, job))
        if req.stream:
            return StreamingResponse(reply.events(req.include_usage, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await reply.whole()
        finally:
            watcher.cancel()

    return app


class Reply:
    """A job's results in OpenAI's shapes: one JSON body, or chunks as server-sent events."""

    def __init__(self, job: Job, chat: bool, model_id: str):
        self.job, self.chat, self.model_id = job, chat, model_id
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.job.id, "object": obj, "created": self.created, "model": self.model_id,
                "system_fingerprint": None}

    def _choice(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if text is None:  # a chunk: only what is new
            delta = {"role": "assistant", "content": ""} if first else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def _delta(self, text: str) -> dict:
        if self.chat:
            return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return self._choice(text, None)

    def logprobs(self, lps: list[dict]) -> dict:
        """Scheduler._logprobs in OpenAI's shape: chat's `content` list (token, logprob, bytes,
        top_logprobs), or the completions' parallel lists with text offsets."""
        if self.chat:
            def entry(t: str, v: float) -> dict:
                return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
            return {"content": [{**entry(d["token"], d["logprob"]), "top_logprobs": [entry(t, v) for t, v in d["top"]]}
                             for d in lps], "refusal": None}
        offsets, at = [], 0
        for d in lps:
            offsets.append(at)
            at += d["chars"]
        return {"tokens": [d["token"] for d in lps], "token_logprobs": [d["logprob"] for d in lps],
                "top_logprobs": [None if d["top"] is None else dict(d["top"]) for d in lps], "text_offset": offsets}

    @staticmethod
    def usage(done: dict) -> dict:
        return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
                "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": int(done["stats"].get("cached_prompt_tokens", 0))}}

    @staticmethod
    def extension(done: dict) -> dict:
        """The speculative decoding stats of the response (the "qspec" field)."""
        s = done["stats"]
        out = {k: s[k] for k in STATS if k in s}
        out["queue_s"] = done["queue_s"]
        return out

    async def whole(self) -> dict:
        text = []
        while True:
            kind, value = await self.job.events.get()
            if kind == "delta":
                text.append(value)
            elif kind == "error":
                raise ApiError(500, "internal server error", type="server_error")
            else:
                if value is None:  # cancelled before it ran: nobody is waiting for this answer
                    raise ApiError(499, "the request was cancelled")
                obj = "chat.completion" if self.chat else "text_completion"
                choice = self._choice("".join(text), value["finish_reason"])
                if "logprobs" in value:
                    choice["logprobs"] = self.logprobs(value["logprobs"])
                return {**self._base(obj), "choices": [choice], "usage": self.usage(value),
                        "qspec": self.extension(value)}

    async def events(self, include_usage: bool, watcher: asyncio.Task):
        obj = "chat.completion.chunk" if self.chat else "text_completion"

        def sse(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            if self.chat:
                yield sse({**self._base(obj), "choices": [self._choice(None, None, first=True)]})
            while True:
                kind, value = await self.job.events.get()
                if kind == "delta":
                    yield sse({**self._base(obj), "choices": [self._delta(value)]})
                    continue
                if kind == "error":
                    yield sse({"error": ApiError(500, "internal server error", type="server_error").body()})
                elif value is not None:
                    yield sse({**self._base(obj), "choices": [self._choice(None, value["finish_reason"])],
                               "qspec": self.extension(value)})
                    if include_usage:
                        yield sse({**self._base(obj), "choices": [], "usage": self.usage(value)})
                yield "data: [DONE]\n\n"
                return
        finally:  # the client went away (or the stream ended): stop generating for it
            self.job.cancel()
            watcher.cancel()
