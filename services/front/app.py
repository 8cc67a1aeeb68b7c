"""The OpenAI-compatible HTTP API (FastAPI on uvicorn, as vLLM's front is).

    GET  /v1/models            the served model
    POST /v1/completions       prompt (segments split on the separator, or the hypic extension)
    POST /v1/chat/completions  messages (each a segment, the last user message the query)
    GET  /health               200 when a router answers, else 503
    GET  /metrics              Prometheus text (hypic_* request metrics, model_name label)

Both POST endpoints stream as Server-Sent Events with "stream": true, ending with `data: [DONE]`.
Errors are OpenAI-shaped (services/front/errors.py). Every response says how the mesh served it: a
`hypic` object in the body and x-hypic-* headers (services/front/transparency.py).
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator

import structlog
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.front import cache_usage, drift_figures, metrics as m
from services.front.config import FrontConfig
from services.front.errors import ApiError, bad_request
from services.front.generation import Generation
from services.front.params import check_supported, sampling, wants_usage_in_stream
from common.mesh import tracing
from common.mesh.auth import read_secret
from hypic.model_card import model_card
from common.mesh.log import sanitize_request_id
from services.front.routers import RouterPool
from services.front.segments import ChatTemplate, Prompt, chat_prompt, completion_prompt
from services.front.transparency import hypic_headers, hypic_object

log = structlog.get_logger("front")
REQUEST_ID_HEADER = "x-request-id"


async def read_json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    except ValueError:  # an integer of more digits than Python converts (sys.int_info)
        raise bad_request("malformed JSON body: a number too long") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:  # "\ud800" escapes parse into strings no tokenizer (or UTF-8) can take
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request body holds invalid Unicode (a lone surrogate escape)") from None
    return body


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Front:
    """Request handling; one per app, holding the router pool and the in-flight count."""

    def __init__(self, cfg: FrontConfig, template: ChatTemplate):
        self.cfg = cfg
        self.template = template
        self.pool = RouterPool(cfg.routers, cfg.request_timeout_s, cfg.routers_ca,
                               read_secret(cfg.router_api_key), cfg.tls_cert, cfg.tls_key)
        self.eos_ids = template.eos_ids()
        self.in_flight = 0
        self.card = model_card(cfg.model)  # the bundled model's "a toy" line for /v1/models

    # ---- the two generation endpoints ------------------------------------------------------
    async def generate(self, request: Request, endpoint: str) -> Response:
        body = await read_json(request)
        model = body.get("model", self.cfg.model_name)
        if model != self.cfg.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.cfg.model_name!r}", param="model", code="model_not_found")
        check_supported(body, endpoint)
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise bad_request("stream must be a boolean", param="stream")
        include_usage = wants_usage_in_stream(body)
        if endpoint == "chat":
            prompt: Prompt = await run_in_threadpool(chat_prompt, body, self.template)
        else:
            prompt = await run_in_threadpool(completion_prompt, body, self.template,
                                             self.cfg.segment_separator)
        params = sampling(body, endpoint, self.cfg.default_max_tokens)
        if self.in_flight >= self.cfg.max_in_flight:
            raise ApiError(429, f"{self.in_flight} requests in flight; retry later",
                           code="overloaded")
        # the caller's id travels in gRPC metadata and logs: printable ASCII, 64 characters at most
        rid = sanitize_request_id(request.headers.get(REQUEST_ID_HEADER) or "") or uuid.uuid4().hex[:16]
        gen = Generation(self.pool, prompt, params, mode=self.cfg.default_mode,
                         model_name=self.cfg.model_name, eos_ids=self.eos_ids, request_id=rid)
        self._enter()
        waiting = m.WAITING.labels(self.cfg.model_name)
        waiting.inc()
        try:
            await gen.start()  # returns with the first token
        except ApiError as e:
            self._leave()
            if e.code == "context_length_exceeded" and endpoint == "completions":
                e.param = "prompt"
            raise
        except BaseException:
            self._leave()
            raise
        finally:
            waiting.dec()
        shape = ChatShape(self.cfg.model_name, rid) if endpoint == "chat" else \
            CompletionShape(self.cfg.model_name, rid)
        if stream:  # the headers say how it is served as the first Timings does (start read it)
            return StreamingResponse(self._events(gen, shape, include_usage), media_type="text/event-stream",
                                     headers={REQUEST_ID_HEADER: rid, **hypic_headers(gen.served, rid)})
        try:
            async with aclosing(gen.deltas()) as deltas:
                text = "".join([piece async for piece in deltas])
        finally:
            self._leave()
        log.info("done", endpoint=endpoint, request_id=rid, finish_reason=gen.finish_reason,
                 **gen.usage.body()["prompt_tokens_details"], prompt_tokens=gen.usage.prompt_tokens,
                 completion_tokens=gen.usage.completion_tokens)
        return JSONResponse(shape.whole(text, gen),
                            headers={REQUEST_ID_HEADER: rid, **hypic_headers(gen.served, rid)})

    async def _events(self, gen: Generation, shape: "ChatShape | CompletionShape",
                      include_usage: bool) -> AsyncIterator[str]:
        try:
            opening = shape.opening()
            if opening is not None:
                yield sse(opening)
            async with aclosing(gen.deltas()) as deltas:  # a client gone cancels the router call
                async for piece in deltas:
                    yield sse(shape.chunk(piece))
            # The last chunk before [DONE] says how the request was served: the usage chunk
            # when there is one, else the finish_reason chunk.
            served = {"hypic": hypic_object(gen.served, gen.request_id)}
            yield sse({**shape.chunk(None, gen.finish_reason), **({} if include_usage else served)})
            if include_usage:
                yield sse({**shape.usage_chunk(gen), **served})
        except ApiError as e:
            yield sse(e.body())
        finally:
            self._leave()
        yield "data: [DONE]\n\n"

    def _enter(self) -> None:
        self.in_flight += 1
        m.RUNNING.labels(self.cfg.model_name).set(self.in_flight)

    def _leave(self) -> None:
        self.in_flight -= 1
        m.RUNNING.labels(self.cfg.model_name).set(self.in_flight)

    # ---- the others ---------------------------------------------------------------------------
    async def models(self) -> dict:
        info = await self.pool.info()
        card = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "hypic",
                "root": str(self.cfg.model), "parent": None, **self.card}
        if info is not None:
            card["max_model_len"] = info.max_prompt_tokens
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        info = await self.pool.info(timeout=1.0)
        if info is None:
            return JSONResponse({"status": "no router answers", "routers": self.cfg.routers},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": self.cfg.model_name})


# ---- response shapes ----------------------------------------------------------------------------

class CompletionShape:
    object_whole, object_chunk, prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, model: str, rid: str):
        self.model = model
        self.id = self.prefix + rid
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str | None, finish: str | None) -> dict:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def whole(self, text: str, gen: Generation) -> dict:
        return {**self._head(self.object_whole), "choices": [self.choice(text, gen.finish_reason)],
                "usage": gen.usage.body(), "hypic": hypic_object(gen.served, gen.request_id)}

    def opening(self) -> dict | None:
        return None

    def chunk(self, text: str | None, finish: str | None = None) -> dict:
        return {**self._head(self.object_chunk), "choices": [self.choice(text, finish)]}

    def usage_chunk(self, gen: Generation) -> dict:
        return {**self._head(self.object_chunk), "choices": [], "usage": gen.usage.body()}


class ChatShape(CompletionShape):
    object_whole, object_chunk, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def choice(self, text: str | None, finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text or ""},
                "logprobs": None, "finish_reason": finish}

    def opening(self) -> dict | None:
        return {**self._head(self.object_chunk), "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}

    def chunk(self, text: str | None, finish: str | None = None) -> dict:
        delta = {"content": text} if text is not None else {}
        return {**self._head(self.object_chunk), "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


# ---- the app ----------------------------------------------------------------------------------

def create_app(cfg: FrontConfig, template: ChatTemplate) -> FastAPI:
    front = Front(cfg, template)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        front.pool.start()
        yield
        await front.pool.close()

    app = FastAPI(title="Hypic OpenAI-compatible front", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.front = front
    key = cfg.api_key.encode()

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        path = request.url.path
        if key and path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), b"Bearer " + key):
                response: Response = ApiError(401, "missing or wrong API key (Authorization: "
                                                   "Bearer <key>)", code="invalid_api_key").response()
                # No label takes a value from an unauthenticated request (issue 30).
                m.HTTP.labels(m.UNAUTHENTICATED, "401").inc()
                return response
        known = m.endpoint_label(path)
        # one SERVER span per request, continuing the caller's traceparent; the SDK carries it
        # on to the router (no-op while tracing is off)
        with tracing.span(f"{request.method} {known}", tracing.trace.SpanKind.SERVER,
                          tracing.extract(request.headers), **{"http.route": known}) as span:
            response = await call_next(request)
            span.set_attribute("http.response.status_code", response.status_code)
        m.HTTP.labels(known, m.status_label(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request: Request, _e: ClientDisconnect) -> Response:
        # The client hung up, or its body was malformed HTTP (uvicorn has answered 400 and logged
        # "Invalid HTTP request received." once for the connection): a client's doing, no traceback.
        return Response(status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> Response:
        return ApiError(e.status_code, str(e.detail)).response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.generate(request, "completions")

    @app.get("/v1/models")
    async def models() -> dict:
        return await front.models()

    @app.get("/health")
    async def health() -> Response:
        return await front.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        infos = await front.pool.info_each()  # one Info per router per scrape feeds both
        await cache_usage.refresh(front.pool, cfg.model_name, infos)
        drift_figures.refresh(cfg.model_name, infos)
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app

