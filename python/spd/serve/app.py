"""The FastAPI application: OpenAI's chat and text completion endpoints (streaming over
server-sent events and not), the model list and a health check, on one EngineWorker."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spd.serve import schemas
from spd.serve.errors import APIError, error_body
from spd.serve.jobs import Job, make_job
from spd.serve.schemas import ChatCompletionRequest, CompletionRequest
from spd.serve.worker import DoneEvent, EngineWorker, ErrorEvent, QueueFull, TokenEvent


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for the first problem, and the parameter it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), (loc[0] if loc else None)


def create_app(worker: EngineWorker, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    """The application serving `model_name` from `worker` (whose run() owns the backend)."""
    app = FastAPI(title="spd", docs_url=None, redoc_url=None)
    target = worker.backend.target
    started = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return JSONResponse(error_body(400, msg, param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):  # a bug still answers in OpenAI's shape
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"),
                            status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code)

    @app.get("/health")
    async def health():
        ok = worker.fatal_error is None
        body = {"status": "ok" if ok else "failed", "busy": worker.busy,
                "slots": worker.slots, "slots_in_use": worker.slots_in_use,
                "queued": worker.queued, "max_queue": worker.max_queue,
                "backend": worker.backend.describe(), **worker.counts}
        if not ok:
            body["error"] = worker.fatal_error
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return schemas.model_list(model_name, started)

    def _check_model(req) -> None:
        if req.model != model_name:
            raise APIError(404, f"the model '{req.model}' does not exist: this server serves "
                           f"'{model_name}'", "model", "model_not_found")

    async def _start(req, prefix: str) -> Job:
        """Validate, queue, and attach the job's events to this request's event loop."""
        _check_model(req)
        job = make_job(req, target, default_max_tokens, prefix)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.events = events
        job.emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        if worker.fatal_error is not None:
            raise APIError(503, f"the engine failed: {worker.fatal_error}")
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}; retry later", None,
                           "queue_full") from None
        return job

    async def _next_event(job: Job, request: Request):
        """The job's next event; a client that disconnects meanwhile stops the decode (and
        the job, if it was still waiting in the queue)."""
        get = asyncio.ensure_future(job.events.get())
        try:
            while True:
                # every quarter second, also while tokens keep coming
                now = time.monotonic()
                if now - job.checked_at >= 0.25:
                    job.checked_at = now
                    if await request.is_disconnected():  # nobody to answer: free the engine
                        job.cancel.set()
                        raise APIError(499, "the client closed the connection")
                finished, _ = await asyncio.wait({get}, timeout=0.25)
                if finished:
                    return get.result()
        finally:
            get.cancel()  # a no-op once it has its event

    async def _finish(job: Job, request: Request):
        """(text, result) of a job, once it is done."""
        parts = []
        try:
            while True:
                ev = await _next_event(job, request)
                if isinstance(ev, TokenEvent):
                    parts.append(ev.text)
                elif isinstance(ev, DoneEvent):
                    return "".join(parts) + ev.tail, ev.result
                else:
                    raise APIError(ev.status, ev.message)
        finally:
            job.cancel.set()

    async def _complete(req, request: Request, prefix: str, respond, chunk, obj: str):
        job = await _start(req, prefix)
        n_prompt = len(job.prompt_ids)
        if not req.stream:
            text, result = await _finish(job, request)
            return respond(job.id, model_name, text, result, n_prompt)
        # The first event decides the status: an error before any token is a real 4xx / 5xx.
        first = await _next_event(job, request)
        if isinstance(first, ErrorEvent):
            raise APIError(first.status, first.message)
        created = int(time.time())
        _piece = (lambda text: {"content": text}) if prefix == "chatcmpl" else (lambda text: text)

        async def body():
            try:
                if prefix == "chatcmpl":
                    yield _sse(chunk(job.id, model_name, created, {"role": "assistant",
                                                                   "content": ""}))
                ev = first
                while True:
                    if isinstance(ev, TokenEvent):
                        if ev.text:
                            yield _sse(chunk(job.id, model_name, created, _piece(ev.text)))
                    elif isinstance(ev, DoneEvent):
                        last = _piece(ev.tail) if ev.tail or prefix == "cmpl" else {}
                        yield _sse(chunk(job.id, model_name, created, last,
                                         ev.result.finish_reason))
                        if req.include_usage:
                            yield _sse(schemas.usage_chunk(job.id, model_name, created, obj,
                                                           n_prompt, ev.result))
                        break
                    else:  # headers are sent: the error goes in the stream
                        yield _sse(error_body(ev.status, ev.message))
                        break
                    ev = await job.events.get()
                yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()  # also when the client left mid-stream: stop the decode

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await _complete(req, request, "chatcmpl", schemas.chat_response, schemas.chat_chunk,
                               "chat.completion.chunk")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _complete(req, request, "cmpl", schemas.completion_response,
                               schemas.completion_chunk, "text_completion")

    return app
