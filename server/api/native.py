"""llama.cpp's own routes (llama-server's native API), so that its clients work unchanged:
``/completion`` (and ``/completions`` without ``/v1``, which there is the native format too),
``/infill``, ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/props``, ``/slots``.

The completion routes parse their body into the internal request (``native_schema``) and go the
one request path (``prepare.prepare_request``, ``collect``, ``streaming``): the same engine,
tenant scope, cancellation and drain as the OpenAI routes. Errors are answered in
llama-server's shape (``{"error": {"code", "message", "type"}}``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response, request
from werkzeug.exceptions import MethodNotAllowed

from server.api import native_render, native_schema
from server.api.collect import collect
from server.api.errors import ApiError
from server.api.lazy import deferred
from server.api.middleware import as_api_error
from server.api.native_embed import native_embeddings
from server.api.native_infill import INFILL_FIELDS, Fim, extra_chunks, infill_tokens
from server.api.native_prompt import native_prompts, parse_work
from server.api.native_slots import slot_action, slots_list
from server.api.native_stream import NativeStream, StreamContext
from server.api.native_tokens import DETOKENIZE_FIELDS, TOKENIZE_FIELDS, detokenize_answer, tokenize_answer
from server.api.preflight import (
    leased,
    model_name,
    off_loop,
    read_json,
    read_object,
    tokenizing,
)
from server.api.prepare import Prepared, chat_text, prepare_request, prompt_tokens
from server.api.respond import current_state, json_response
from server.api.streaming import streamed_response
from server.api.trace import Trace
from server.models.registry import Lease
from server.state import ServerState

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ffi import Vocab
    from server.api import schema
else:  # imported once the server is ready (server.api.lazy)
    schema = deferred("server.api.schema")

native = Blueprint("native", __name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",  # a busy slot: try again later
    501: "not_supported_error",
    503: "unavailable_error",
}


class NativeApiError(ApiError):
    """An ``ApiError`` answered in llama-server's shape."""

    def body(self) -> dict[str, Any]:
        return error_body(self)


def error_body(error: ApiError) -> dict[str, Any]:
    """``error`` as llama-server writes it; a context overflow is its own type, with
    ``n_prompt_tokens`` and ``n_ctx``."""
    type_ = _TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    if error.code == "context_length_exceeded":
        type_ = "exceed_context_size_error"
    return {"error": {"code": error.status, "message": error.message, "type": type_, **error.extra}}


@native.errorhandler(Exception)
async def native_error(exc: Exception) -> Response:
    """Whatever a route here raised (an ``ApiError``, its own or from the shared checks; an HTTP
    error such as 413 or 405; a bug's 500), in llama-server's shape, with the same status and
    headers as elsewhere."""
    error = as_api_error(exc, current_state().settings.max_body)
    response = json_response(error_body(error), error.status)
    response.headers.update(error.headers)
    return response


def _bad(exc: native_schema.NativeError) -> NativeApiError:
    return NativeApiError(400, str(exc), param=exc.param, code="invalid_value")


@native.post("/completion")
@native.post("/completions")
async def completion() -> Response:
    return await _complete(current_state(), infill=False)


@native.post("/infill")
async def infill() -> Response:
    return await _complete(current_state(), infill=True)


async def _complete(state: ServerState, *, infill: bool) -> Response:
    """A native completion, whole (JSON; a list for several prompts or ``n``) or streamed.

    *Cancellation*: as ``collect`` and ``streaming``: leaving releases the job.
    """
    trace = Trace(state, request.path)
    try:
        prepared, context = await _prepare(state, infill=infill, started=trace.start)
    except ApiError as exc:
        trace.status, trace.ending = exc.status, exc.code or "error"
        trace.log()
        raise
    if prepared.stream:
        stream = NativeStream(prepared, context, error_body)
        return streamed_response(prepared, stream, trace, state.settings.ping_interval)
    choices = await collect(prepared, trace)
    timing = native_render.Timing(
        None if trace.first is None else trace.first - trace.start,
        None if trace.last is None else trace.last - trace.start,
    )
    vocab = prepared.engine.vocab
    answers = []
    for index, choice in enumerate(choices):
        probs = native_render.probabilities(choice.logprobs, vocab.token_bytes)
        final = native_render.Final(
            index=index,
            content=choice.text,
            tokens=choice.tokens,
            finish=choice.finish,
            usage=choice.usage,
            generated=vocab.detokenize(choice.tokens) if context.options.stop else choice.text,
            prompt=context.prompts[index // prepared.job.n],
            probabilities=probs if context.options.n_probs else None,
            id_slot=native_render.NO_SLOT if prepared.job.slot is None or index else prepared.job.slot,
        )
        answers.append(
            native_render.final_object(
                final,
                model=context.model,
                settings=context.settings,
                options=context.options,
                timing=timing,
                stream=False,
            )
        )
    return json_response(answers[0] if len(answers) == 1 else answers)


async def _prepare(state: ServerState, *, infill: bool, started: float) -> tuple[Prepared, StreamContext]:
    body = await read_object()
    async with leased(state, model_name(body.get("model"))) as lease:
        vocab, info = lease.engine.vocab, lease.info
        defaults = native_schema.Defaults(temperature=state.settings.temp, seed=state.settings.seed)

        def parse() -> tuple[list[list[int]], schema.CompletionRequest, native_schema.NativeOptions]:
            if infill:
                prompts = [_infill_prompt(lease, body)]
            else:
                prompts = native_prompts(body.get("prompt"), vocab)
            # /infill's own fields are in its prompt now; the rest is read as /completion's.
            rest = {k: v for k, v in body.items() if k not in INFILL_FIELDS} if infill else body
            return (prompts, *native_schema.completion_request(rest, prompts, vocab, defaults))

        try:
            with tokenizing("prompt"):
                prompts, req, options = await off_loop(parse_work(body, infill=infill), parse)
        except native_schema.NativeError as exc:
            raise _bad(exc) from None
        # The one request path takes its own lease on the same model (this one ends here).
        prepared = await prepare_request(state, req.model_copy(update={"model": lease.spec.id}))
    texts = await off_loop(sum(map(len, prompts)), lambda: [vocab.detokenize(p, special=True) for p in prompts])
    job = prepared.job
    sampling = job.sampling
    settings = native_render.Settings(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        seed=options.seed,
        repeat_penalty=sampling.repeat_penalty,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        n_predict=-1 if job.max_tokens is None else job.max_tokens,
        stop=options.stop,
        n_probs=options.n_probs,
        stream=prepared.stream,
        timings_per_token=options.timings_per_token,
        ignore_eos=options.ignore_eos,
    )
    return prepared, StreamContext(info.id, settings, options, texts, started)


def _infill_prompt(lease: Lease, body: dict[str, Any]) -> list[int]:
    engine, batch_size = lease.engine, lease.spec.settings.batch_size
    vocab = engine.vocab
    missing = [name for name, token in zip(("prefix", "suffix", "middle"), vocab.fim, strict=True) if token is None]
    if missing:
        message = f"infill is not supported by this model: it has no FIM {', '.join(missing)} token"
        raise NativeApiError(501, message, code="not_supported")
    texts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(name, "" if name == "prompt" else None)
        if not isinstance(value, str):
            required = " (required)" if value is None else ""
            raise native_schema.NativeError(f'"{name}" must be a string{required}', name)
        texts[name] = value
    prefix, suffix, middle = vocab.fim
    assert prefix is not None and suffix is not None and middle is not None
    fim = Fim(prefix, suffix, middle, vocab.fim_rep, vocab.fim_sep, vocab.bos if vocab.add_bos else None)
    n_predict = body.get("n_predict")
    room = engine.n_ctx_seq - batch_size - 2 * (n_predict if isinstance(n_predict, int) else 0)
    return infill_tokens(
        fim,
        lambda text: vocab.tokenize(text, add_special=False, parse_special=False),
        prefix=texts["input_prefix"],
        suffix=texts["input_suffix"],
        prompt=texts["prompt"],
        extra=extra_chunks(body.get("input_extra")),
        n_batch=batch_size,
        room=room,
    )


@native.post("/embedding")
async def embedding() -> Response:
    """llama-server's embeddings (``native_embed``)."""
    return await native_embeddings(current_state(), await read_object(), NativeApiError)


@native.post("/tokenize")
async def tokenize() -> Response:
    return await _vocabulary_route(TOKENIZE_FIELDS, tokenize_answer)


@native.post("/detokenize")
async def detokenize() -> Response:
    return await _vocabulary_route(DETOKENIZE_FIELDS, detokenize_answer)


async def _vocabulary_route(
    fields: frozenset[str], answer: Callable[[Vocab, dict[str, Any]], Awaitable[Response]]
) -> Response:
    """A route that answers from the model's vocabulary alone: its body checked for fields not
    its own, the model leased, ``answer`` made."""
    body = await read_object()
    try:
        native_schema.refuse_unknown(body, fields)
        async with leased(current_state(), model_name(body.get("model"))) as lease:
            return await answer(lease.engine.vocab, body)
    except native_schema.NativeError as exc:
        raise _bad(exc) from None


@native.post("/apply-template")
async def apply_template() -> Response:
    req = await read_json(schema.ChatCompletionRequest)
    return json_response({"prompt": await chat_text(current_state(), req)})


@native.post("/chat/completions/input_tokens")
@native.post("/v1/chat/completions/input_tokens")
async def input_tokens() -> Response:
    req = await read_json(schema.ChatCompletionRequest)
    return json_response({"input_tokens": await prompt_tokens(current_state(), req)})


@native.get("/props")
async def props() -> Response:
    state = current_state()
    async with leased(state, model_name(request.args.get("model"))) as lease:
        return _props(state, lease)


def _props(state: ServerState, lease: Lease) -> Response:
    engine, info, s = lease.engine, lease.info, state.settings
    vocab = engine.vocab
    defaults = native_render.Settings(
        temperature=native_schema.NATIVE_TEMPERATURE if s.temp is None else s.temp,
        top_k=native_schema.NATIVE_TOP_K,
        top_p=native_schema.NATIVE_TOP_P,
        min_p=native_schema.NATIVE_MIN_P,
        seed=native_schema.LLAMA_DEFAULT_SEED if s.seed is None else s.seed,
        repeat_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        n_predict=-1 if s.max_tokens is None else s.max_tokens,
        stop=(),
        n_probs=0,
        stream=False,
        timings_per_token=False,
    )
    return json_response(
        {
            "default_generation_settings": {
                "params": native_render.generation_settings(defaults),
                "n_ctx": engine.n_ctx_seq,
            },
            "total_slots": lease.spec.settings.parallel,
            "model_alias": info.id,
            "model_path": lease.spec.path,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": not s.no_slots,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "ui": not s.no_webui,
            "chat_template": info.template.source,
            "bos_token": vocab.text(vocab.bos) if vocab.bos >= 0 else "",
            "eos_token": vocab.text(vocab.eos) if vocab.eos >= 0 else "",
            "build_info": info.fingerprint,
            "is_sleeping": False,
        }
    )


@native.post("/props")
async def change_props() -> Response:
    raise NativeApiError(501, "this server changes no properties at run time", code="not_supported")


@native.get("/slots")
async def slots() -> Response:
    state = current_state()
    async with leased(state, model_name(request.args.get("model"))) as lease:
        return slots_list(state, lease, fail_on_no_slot=bool(request.args.get("fail_on_no_slot")))


@native.post("/slots/<id_slot>")
async def slot(id_slot: str) -> Response:
    body = await read_object() if (await request.get_data()) else {}
    state = current_state()
    async with leased(state, model_name(request.args.get("model"))) as lease:
        return await slot_action(state, lease, id_slot, request.args.get("action", ""), body)


# Each path's methods; another is a 405 in llama-server's shape (routing's own would be the app's).
_METHODS = {
    **{
        path: ("POST",)
        for path in (
            "/completion",
            "/completions",
            "/infill",
            "/tokenize",
            "/detokenize",
            "/embedding",
            "/apply-template",
            "/chat/completions/input_tokens",
            "/v1/chat/completions/input_tokens",
            "/slots/<id_slot>",
        )
    },
    "/props": ("GET", "POST"),
    "/slots": ("GET",),
}


async def wrong_method(**_: str) -> Response:
    rule = request.url_rule
    allowed = _METHODS[rule.rule if rule is not None else ""]
    # As routing's own 405 says it: OPTIONS always, HEAD wherever GET is.
    raise MethodNotAllowed(valid_methods=["OPTIONS", *allowed, *(["HEAD"] if "GET" in allowed else [])])


for _path, _allowed in _METHODS.items():
    native.add_url_rule(
        _path,
        f"wrong_method{_path}",
        wrong_method,
        methods=[m for m in ("GET", "POST", "PUT", "PATCH", "DELETE") if m not in _allowed],
        provide_automatic_options=False,
    )
