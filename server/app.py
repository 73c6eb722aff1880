"""``create_app``: the OpenAI-compatible HTTP API as a Quart-Trio app. No globals.

Routes validate with the pydantic schema, render the chat template, tokenize, and hand a
``Job`` to the engine. A stream holds its sequence inside ``async with engine.submit(job)``;
Quart-Trio cancels the handler when the client disconnects, which leaves that block and
releases the sequence.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

import ffi
from server import schema, sse
from server.config import Settings, settings_from_env
from server.connection import current_connection
from server.engine import EngineError, Job, Piece, ShuttingDown, Usage
from server.metrics import CONTENT_TYPE
from server.state import ServerState

logger = logging.getLogger("llama_trio.access")

# Prompts longer than this many characters are rendered and tokenized in a worker thread.
INLINE_TOKENIZE_CHARS = 16_384

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Defaults where a request says nothing. temperature/top_p follow OpenAI; top_k and min_p cut
# the long tail as llama.cpp's own defaults do.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 40
DEFAULT_MIN_P = 0.05
# Names of unknown request fields logged once each; at most this many, this long, are kept.
MAX_WARNED_FIELDS = 64
MAX_FIELD_NAME = 64


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return Response(json.dumps(body), status=self.status, headers=self.headers, content_type="application/json")

    @classmethod
    def from_engine(cls, exc: EngineError) -> ApiError:
        if exc.status == 400:
            return cls(400, str(exc), param="messages", code=exc.code)
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return cls(exc.status, str(exc), type_="server_error", code=exc.code, headers=headers)


# pydantic names the branch of a union it tried ("str", "list[str]", "function-after[...]") in
# an error's location; those are not fields of the request.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item.isidentifier() and item not in _UNION_TAGS:
            parts.append(f".{item}" if parts else item)
    return "".join(parts) or None


@dataclass
class _Prepared:
    job: Job
    stream: bool
    include_usage: bool
    chat: bool


def create_app(settings: Settings | None = None, *, state: ServerState | None = None) -> QuartTrio:
    """The app. With ``state``, the caller (``server.lifecycle``) runs the engine; without, the
    app loads the model and runs the engine in its own lifespan (the hypercorn CLI launch)."""
    owns_engine = state is None
    if state is None:
        state = ServerState(settings or settings_from_env())
    settings = state.settings
    app = QuartTrio(__name__)
    app.config.update(
        RESPONSE_TIMEOUT=None,  # streams have no hidden time limit
        BODY_TIMEOUT=settings.read_timeout,
        MAX_CONTENT_LENGTH=settings.max_body,
    )
    app.extensions["llama_trio"] = state
    api_keys = settings.api_keys()
    cors = set(settings.cors_origin)

    if owns_engine:

        @app.before_serving
        async def start_engine() -> None:
            await app.nursery.start(state.run_engine)

        @app.after_serving
        async def stop_engine() -> None:
            # Hypercorn has closed its connections by now (see docs/lifecycle.md).
            state.draining = True
            state.stop_engine()

    @app.before_request
    async def limit_head() -> Response | None:
        # h11 bounds only a head that arrives in pieces; one that comes in a single read is
        # parsed whole, so the limit is checked here too.
        scope = request.scope
        size = len(scope.get("raw_path", b"")) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > settings.max_header_size:
            message = f"request headers are larger than {settings.max_header_size} bytes"
            return ApiError(431, message, code="request_header_too_large", headers={"Connection": "close"}).response()
        return None

    @app.before_request
    async def authenticate() -> Response | None:
        if not api_keys or request.path == "/health" or request.method == "OPTIONS":
            return None
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
        given_bytes = given.encode()
        ok = False
        for key in api_keys:  # constant time per key; every key is checked
            ok |= hmac.compare_digest(given_bytes, key.encode())
        if not ok:
            message = "invalid API key" if given else "missing API key (Authorization: Bearer <key>)"
            return ApiError(401, message, type_="authentication_error", code="invalid_api_key").response()
        return None

    @app.after_request
    async def finish(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if cors and origin and ("*" in cors or origin in cors):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in cors else origin
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type, X-Api-Key"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Vary"] = "Origin"
        rule = request.url_rule.rule if request.url_rule else "unmatched"
        state.metrics.requests.labels(rule, str(response.status_code)).inc()
        return response

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return exc.response()

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        codes = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}
        message = {
            404: f"no route for {request.path}",
            405: f"{request.method} is not allowed on {request.path}",
            413: f"request body is larger than {settings.max_body} bytes",
        }.get(status, exc.description or exc.name)
        type_ = "invalid_request_error" if status < 500 else "server_error"
        # The body was not read (whole): the connection cannot carry another request.
        headers = {"Connection": "close"} if status in {408, 413} else None
        return ApiError(status, message, type_=type_, code=codes.get(status), headers=headers).response()

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal server error", type_="server_error", code="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            status, code = "draining", 503
        elif state.load_failed is not None:
            status, code = "model_load_failed", 503
        elif state.engine is None:
            status, code = "loading", 503
        else:
            status, code = "ok", 200
        return Response(json.dumps({"status": status}), status=code, content_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        card = schema.ModelCard(id=state.model_id, created=state.created)
        return _json(schema.ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _complete(state, chat=True)

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _complete(state, chat=False)

    return app


def _json(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status=status, content_type="application/json")


async def _read_json(model: type[pydantic.BaseModel]) -> Any:
    raw = await request.get_data(as_text=False)
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _param_from_loc(tuple(first["loc"]))
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None


def _sampling(req: schema._Sampling, n_vocab: int) -> ffi.SamplingParams:
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        token = int(key)
        if token >= n_vocab:
            raise ApiError(400, f"logit_bias token {token} is not in the vocabulary", param="logit_bias")
        bias[token] = value
    return ffi.SamplingParams(
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        # A top_k beyond the vocabulary filters nothing; clamped, it also fits llama.cpp's int32.
        top_k=DEFAULT_TOP_K if req.top_k is None else min(req.top_k, n_vocab),
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=DEFAULT_MIN_P if req.min_p is None else req.min_p,
        seed=None if req.seed is None else req.seed & 0xFFFFFFFF,
        repeat_penalty=1.0 if req.repeat_penalty is None else req.repeat_penalty,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=bias,
    )


def _warn_extra(state: ServerState, req: pydantic.BaseModel) -> None:
    # Clients choose these names: remember a bounded number of them, each cut short, and log
    # them quoted (a name may hold newlines).
    room = MAX_WARNED_FIELDS - len(state.warned_fields)
    if room <= 0:
        return
    extra = {name[:MAX_FIELD_NAME] for name in req.model_extra or {}} - state.warned_fields
    if extra:
        names = sorted(extra)[:room]
        state.warned_fields.update(names)
        logging.getLogger(__name__).info("ignoring request fields we do not use: %s", ", ".join(map(repr, names)))


async def _prepare(state: ServerState, *, chat: bool) -> _Prepared:
    req: schema.ChatCompletionRequest | schema.CompletionRequest
    if chat:
        req = await _read_json(schema.ChatCompletionRequest)
    else:
        req = await _read_json(schema.CompletionRequest)
    _warn_extra(state, req)
    engine = state.engine
    if state.draining:
        raise ApiError.from_engine(ShuttingDown("server is shutting down"))
    if engine is None or state.template is None:
        raise ApiError(
            503, "the model is still loading", type_="server_error", code="model_loading", headers={"Retry-After": "1"}
        )
    vocab = engine.vocab
    if isinstance(req, schema.ChatCompletionRequest):
        messages = []
        for i, message in enumerate(req.messages):
            try:
                text = message.text()
            except schema.PartError as exc:
                raise ApiError(400, str(exc), param=f"messages[{i}].content[{exc.index}].type") from None
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": text})
        template = state.template
        size = sum(len(m["content"]) for m in messages)

        def render() -> list[int]:
            prompt = template.render(messages, add_generation_prompt=True)
            return _tokenize(vocab, prompt)

        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        prompt_text = req.prompt
        size = len(prompt_text)

        def render() -> list[int]:
            return _tokenize(vocab, prompt_text)

        max_tokens = req.max_tokens
    try:
        tokens = await trio.to_thread.run_sync(render) if size > INLINE_TOKENIZE_CHARS else render()
    except ffi.TemplateError as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    except ffi.TokenizeError as exc:
        raise ApiError(400, str(exc), param="prompt" if not chat else "messages") from None
    except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate is not text
        problem = "the text contains a lone UTF-16 surrogate (invalid Unicode)"
        raise ApiError(400, problem, param="prompt" if not chat else "messages", code="invalid_value") from None
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="prompt")
    ceiling = state.settings.max_tokens
    if ceiling is not None:
        max_tokens = min(max_tokens or ceiling, ceiling)
    job = Job(tokens, _sampling(req, vocab.n_tokens), max_tokens=max_tokens, stop=req.stop_list())
    error = engine.admission_error(job)
    if error is not None:
        raise (
            ApiError.from_engine(error)
            if error.status != 400
            else ApiError(400, str(error), param="messages" if chat else "prompt", code=error.code)
        )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return _Prepared(job, req.stream, include_usage, chat)


def _tokenize(vocab: ffi.Vocab, prompt: str) -> list[int]:
    tokens = vocab.tokenize(prompt, add_special=True, parse_special=True)
    if len(tokens) > 1 and tokens[0] == tokens[1] == vocab.bos:
        del tokens[0]  # the template already wrote BOS
    return tokens


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class _Trace:
    """Timing and outcome of one request, for the access log line and the metrics."""

    def __init__(self, state: ServerState, path: str) -> None:
        self.state = state
        self.path = path
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.usage: Usage | None = None
        self.ending = "cancelled"
        self.status = 200
        self.written = 0.0  # trio time of the last write to a stream's body

    def piece(self, piece: Piece) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.state.metrics.ttft.observe(now - self.start)
        self.last = now
        if piece.finish_reason:
            self.usage = piece.usage
            self.ending = piece.finish_reason

    def log(self) -> None:
        usage = self.usage
        ttft = f"{(self.first - self.start) * 1000:.0f}ms" if self.first else "-"
        rate = "-"
        if usage and self.first and self.last and usage.completion_tokens > 1 and self.last > self.first:
            per_token = (self.last - self.first) / (usage.completion_tokens - 1)
            self.state.metrics.token_latency.observe(per_token)
            rate = f"{1 / per_token:.1f}"
        logger.info(
            "POST %s %d prompt=%s completion=%s cached=%s ttft=%s tok/s=%s end=%s total=%.0fms",
            self.path,
            self.status,
            usage.prompt_tokens if usage else "-",
            usage.completion_tokens if usage else "-",
            usage.cached_tokens if usage else "-",
            ttft,
            rate,
            self.ending,
            (time.monotonic() - self.start) * 1000,
        )


async def _complete(state: ServerState, *, chat: bool) -> Response:
    trace = _Trace(state, request.path)
    try:
        prepared = await _prepare(state, chat=chat)
    except ApiError as exc:
        trace.status, trace.ending = exc.status, exc.code or "error"
        trace.log()
        raise
    id_ = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    engine = state.engine
    assert engine is not None
    if prepared.stream:
        framer = sse.ChunkFramer(chat=chat, id_=id_, created=created, model=state.model_id)
        body = _stream_body(engine, prepared, framer, trace, state.settings.ping_interval)
        return Response(body, content_type="text/event-stream", headers=SSE_HEADERS)
    texts: list[str] = []
    try:
        async with engine.submit(prepared.job) as stream:
            async for piece in stream:
                trace.piece(piece)
                texts.append(piece.text)
    except EngineError as exc:
        trace.status, trace.ending = exc.status, exc.code
        trace.log()
        raise ApiError.from_engine(exc) from None
    except BaseException:
        trace.log()  # cancelled: the client went away
        raise
    trace.log()
    usage = trace.usage
    assert usage is not None
    text = "".join(texts)
    payload: dict[str, Any]
    if chat:
        payload = schema.ChatCompletion(
            id=id_,
            created=created,
            model=state.model_id,
            choices=[schema.ChatChoice(message=schema.AssistantMessage(content=text), finish_reason=trace.ending)],
            usage=schema.UsageInfo.model_validate(_usage(usage)),
        ).model_dump()
    else:
        payload = schema.Completion(
            id=id_,
            created=created,
            model=state.model_id,
            choices=[schema.CompletionChoice(text=text, finish_reason=trace.ending)],
            usage=schema.UsageInfo.model_validate(_usage(usage)),
        ).model_dump()
    return _json(payload)


async def _stream_body(
    engine: Any, prepared: _Prepared, framer: sse.ChunkFramer, trace: _Trace, ping_interval: float
) -> AsyncIterator[bytes]:
    """The SSE body. Leaving it for any reason (done, error, the client gone) releases the
    job; it always ends with ``[DONE]`` when it ends by itself. After ``ping_interval`` seconds
    without a write (queued, a long prompt) a comment line goes out, which keeps proxies and
    clients from timing the stream out.

    Text pieces are written by the engine task straight to the socket while that is possible
    (``_direct_sink``); this generator wakes for the rest: the end, errors, pings, and pieces
    the socket could not take at once (a slow reader), which then pause the sequence as usual.
    """
    try:
        if prepared.chat:
            yield framer.role()
        try:
            async with engine.submit(prepared.job) as stream:
                sink = _direct_sink(framer, trace)
                pieces = stream.__aiter__()
                trace.written = trio.current_time()
                while True:
                    if sink is not None:
                        stream.deliver_directly(sink)  # everything taken so far is written
                    with trio.move_on_at(trace.written + ping_interval) as waited:
                        try:
                            piece = await pieces.__anext__()
                        except StopAsyncIteration:
                            break
                    if waited.cancelled_caught:
                        if trio.current_time() >= trace.written + ping_interval:  # silent that long
                            trace.written = trio.current_time()
                            yield sse.PING
                        continue
                    trace.piece(piece)
                    if piece.text:
                        yield framer.text(piece.text)
                        trace.written = trio.current_time()
                    if piece.finish_reason:
                        yield framer.finish(piece.finish_reason)
                        if prepared.include_usage and piece.usage is not None:
                            yield framer.usage(_usage(piece.usage))
        except EngineError as exc:
            trace.ending = exc.code
            type_ = "server_error" if exc.status >= 500 else "invalid_request_error"
            yield sse.error_event(str(exc), type_, exc.code)
        yield sse.DONE
    finally:
        trace.log()


def _direct_sink(framer: sse.ChunkFramer, trace: _Trace) -> Callable[[Piece], bool] | None:
    """What the engine task calls with each text piece of a stream, in place of waking the
    stream's task: frame it and write it to the socket without waiting (True), or refuse
    (False: the socket would block or is gone, or it is the last piece, which the stream's task
    sends with the finish and usage events). None where the response cannot be written
    directly (not on our own connection, not a chunked HTTP/1.1 body).

    Per token this skips a task switch, Quart's and Hypercorn's body path and h11's framing;
    on 2 cores every microsecond the main thread spends between two decode steps delays the
    next one.
    """
    connection = current_connection.get()
    write = connection.body_writer() if connection is not None else None
    if write is None:
        return None

    def sink(piece: Piece) -> bool:
        if piece.finish_reason is not None or not write(framer.text(piece.text)):
            return False
        trace.piece(piece)
        trace.written = trio.current_time()
        return True

    return sink
