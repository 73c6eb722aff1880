"""Request to job: read and validate the JSON body, render the chat template, tokenize, and
build the ``Job`` the engine runs. Every problem is an ``ApiError`` (a 4xx) here, before any
sequence is taken.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import ffi
from server.api import tools
from server.api.constraints import ToolUse, output_grammar, tool_use
from server.api.errors import ApiError
from server.api.lazy import deferred
from server.api.preflight import (
    CHARS_PER_MESSAGE,
    INLINE_WORK_CHARS,
    model_lease,
    off_loop,
    read_json,
    refuse_unsupported,
    tokenizing,
)
from server.api.prompt import chat_tokens, text_tokens
from server.api.respond import tenant
from server.engine import Engine, Job
from server.models.registry import Lease
from server.state import ModelInfo, ServerState

if TYPE_CHECKING:
    from server.api import schema
else:  # imported once the server is ready (server.api.lazy)
    schema = deferred("server.api.schema")

logger = logging.getLogger("llama_trio.api")

# Defaults where a request says nothing. temperature/top_p follow OpenAI; top_k and min_p cut
# the long tail as llama.cpp's own defaults do.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 40
DEFAULT_MIN_P = 0.05


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the engine."""

    job: Job
    lease: Lease  # its hold on the model, released when its answer ends
    engine: Engine  # the engine it was prepared for
    model: ModelInfo  # the model it was prepared for
    stream: bool
    include_usage: bool
    chat: bool
    # The answer is a response or tool calls (``api/tools.py``) to translate: "generic" (JSON)
    # or "native" (the template's own syntax); None: plain text.
    tools: Literal["generic", "native"] | None = None
    logprobs: bool = False  # the answer reports its tokens' log-probabilities
    echo: tuple[str, ...] = ()  # each prompt's text, to come before its answers (``echo``)

    @property
    def prompt_param(self) -> str:
        """The request field a problem with the prompt is about."""
        return "messages" if self.chat else "prompt"


def sampling_params(
    req: schema.CommonFields, n_vocab: int, *, temperature: float | None = None, seed: int | None = None
) -> ffi.SamplingParams:
    """``req``'s sampling; ``temperature`` and ``seed`` stand in where it sets none (``--temp``,
    ``--seed``)."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        token = int(key)
        if token >= n_vocab:
            raise ApiError(
                400, f"logit_bias token {token} is not in the vocabulary", param="logit_bias", code="invalid_value"
            )
        bias[token] = value
    return ffi.SamplingParams(
        temperature=(DEFAULT_TEMPERATURE if temperature is None else temperature)
        if req.temperature is None
        else req.temperature,
        # A top_k beyond the vocabulary filters nothing; clamped, it also fits llama.cpp's int32.
        top_k=DEFAULT_TOP_K if req.top_k is None else min(req.top_k, n_vocab),
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=DEFAULT_MIN_P if req.min_p is None else req.min_p,
        seed=seed if req.seed is None else req.seed,
        repeat_penalty=1.0 if req.repeat_penalty is None else req.repeat_penalty,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=bias,
    )


def cache_scope(salt: str | None) -> str:
    """The prefix-cache scope of the current request: its API key's tenant (when keys are
    configured) and its ``cache_salt``. Requests share cached prefixes only within a scope."""
    return f"{tenant()}:{salt or ''}"


async def prepare(state: ServerState, *, chat: bool) -> Prepared:
    """The current OpenAI chat (``chat``) or completion request, read from the body, as a job
    for ``state``'s engine (``prepare_request``).

    *Cancellation*: as ``prepare_request``.
    """
    req: schema.ChatCompletionRequest | schema.CompletionRequest
    if chat:
        req = await read_json(schema.ChatCompletionRequest)
    else:
        req = await read_json(schema.CompletionRequest)
    return await prepare_request(state, req)


async def prepare_request(state: ServerState, req: schema.ChatCompletionRequest | schema.CompletionRequest) -> Prepared:
    """``req`` as a job for ``state``'s engine: the one request path. Every dialect parses its
    body into one of these two (the internal request: prompt, sampling, constraints, tools,
    scope) and comes here; the preflight checks, prompt building, sampling and constraints are
    done once, here.

    *Cancellation*: safe at any point; a render or tokenization running in a worker thread
    (it holds the vocabulary) is waited for, never abandoned.
    """
    refuse_unsupported(req)
    lease = await model_lease(state, req.model)
    try:
        prepared = await _prepare(state, req, lease)
    except BaseException:
        lease.release()
        raise
    lease.release_with(prepared)  # at the latest; the answer releases it when it ends
    return prepared


async def _prepare(
    state: ServerState, req: schema.ChatCompletionRequest | schema.CompletionRequest, lease: Lease
) -> Prepared:
    chat = isinstance(req, schema.ChatCompletionRequest)
    engine, info, parallel = lease.engine, lease.info, lease.spec.settings.parallel
    param = "messages" if chat else "prompt"
    prompt, all_tokens = await _tokens(req, engine, info)
    if not all(all_tokens):
        raise ApiError(400, "the prompt is empty", param=param, code="invalid_value")
    n = req.n or 1
    if n * len(all_tokens) > parallel:
        what = f"n is {n}" if len(all_tokens) == 1 else f"{len(all_tokens)} prompts x n {n}"
        message = f"{what}; this server decodes at most {parallel} sequences at once (--parallel)"
        raise ApiError(400, message, param="n" if len(all_tokens) == 1 else "prompt", code="invalid_value")
    slot = _pinned_slot(req, len(all_tokens), parallel)
    max_tokens, ceiling = prompt.max_tokens, state.settings.max_tokens
    if ceiling is not None:
        max_tokens = min(max_tokens or ceiling, ceiling)
    logprobs = _logprobs_wanted(req)
    scope = cache_scope(req.cache_salt)
    job = Job(
        all_tokens[0],
        sampling_params(req, engine.vocab.n_tokens, temperature=state.settings.temp, seed=state.settings.seed),
        more_prompts=tuple(all_tokens[1:]),
        max_tokens=max_tokens,
        stop=req.stop_list(),
        cache_scope=scope,
        grammar=await output_grammar(lease.runtime, req, prompt.use, scope),
        logprobs=logprobs,
        n=n,
        streamed=req.stream,
        slot=slot,
    )
    error = engine.admission_error(job)
    if error is not None:
        raise ApiError.from_engine(error, param=param)
    use = prompt.use
    scheme: Literal["generic", "native"] | None = None
    if use is not None and use.constrained:
        scheme = "native" if use.native else "generic"
    return Prepared(
        job,
        lease,
        engine,
        info,
        req.stream,
        bool(req.stream_options and req.stream_options.include_usage),
        chat,
        tools=scheme,
        logprobs=logprobs is not None,
        echo=prompt.echo,
    )


async def prompt_tokens(state: ServerState, req: schema.ChatCompletionRequest) -> int:
    """How many tokens ``req``'s prompt is, built as ``prepare_request`` builds it (tools and
    all), without generating anything: what the count-tokens routes answer.

    *Cancellation*: as ``prepare_request``.
    """
    refuse_unsupported(req)
    lease = await model_lease(state, req.model)
    try:
        _, all_tokens = await _tokens(req, lease.engine, lease.info)
    finally:
        lease.release()
    return sum(len(tokens) for tokens in all_tokens)


async def _tokens(
    req: schema.ChatCompletionRequest | schema.CompletionRequest, engine: Engine, info: ModelInfo
) -> tuple[_Prompt, list[list[int]]]:
    """The request's prompt, and its tokens (rendered and tokenized off the loop when large)."""
    prompt = _prompt(req, engine, info)
    with tokenizing("messages" if isinstance(req, schema.ChatCompletionRequest) else "prompt"):
        return prompt, await off_loop(prompt.work, prompt.render)


@dataclass(frozen=True)
class _Prompt:
    """How a request's prompts become tokens, before it is done."""

    render: Callable[[], list[list[int]]]  # each prompt's tokens
    work: int  # characters of text (``preflight.off_loop``)
    max_tokens: int | None  # as the request asked
    use: ToolUse | None = None
    echo: tuple[str, ...] = ()  # each prompt's text, when the answers are to start with it


def _prompt(req: schema.ChatCompletionRequest | schema.CompletionRequest, engine: Engine, info: ModelInfo) -> _Prompt:
    vocab = engine.vocab
    if isinstance(req, schema.ChatCompletionRequest):
        chat = _chat(req, info)

        def render_chat() -> list[list[int]]:
            tokens = chat_tokens(
                info.template,
                vocab,
                chat.messages,
                chat.template_tools,
                add_generation_prompt=chat.generation_prompt,
                continue_final=chat.continues,
            )
            return [tokens]

        return _Prompt(render_chat, chat.work, req.max_completion_tokens or req.max_tokens, chat.use)
    if _format_description(req) is not None:  # a raw prompt has no system message to hold it
        param = "response_format.json_schema.description"
        raise ApiError(400, "a format's description needs a chat request", param=param, code="unsupported_parameter")
    prompts = _completion_prompts(req, vocab.n_tokens)

    def render() -> list[list[int]]:
        return [text_tokens(vocab, p) if isinstance(p, str) else list(p) for p in prompts]

    echo: tuple[str, ...] = ()
    if req.echo:
        echo = tuple(p if isinstance(p, str) else vocab.detokenize(p) for p in prompts)
    return _Prompt(render, sum(len(p) for p in prompts), req.max_tokens, echo=echo)


@dataclass(frozen=True)
class _Chat:
    """A chat request's conversation as the template gets it."""

    messages: list[dict[str, Any]]
    use: ToolUse | None
    template_tools: list[dict[str, Any]] | None
    continues: bool  # the last (assistant) message is continued, not closed
    generation_prompt: bool
    work: int  # for ``preflight.off_loop``


def _format_description(req: schema.ChatCompletionRequest | schema.CompletionRequest) -> str | None:
    form = req.response_format
    if form is None or form.type != "json_schema" or form.json_schema is None:
        return None
    return form.json_schema.description or None


def _with_format_note(req: schema.ChatCompletionRequest, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the response format's ``description`` (what the answer is for, which
    OpenAI shows the model) joined to the system message, or as one of its own."""
    description = _format_description(req)
    if description is None:
        return messages
    assert req.response_format is not None and req.response_format.json_schema is not None
    name = req.response_format.json_schema.name
    return tools.with_system_note(messages, f"Answer in the JSON format{f' {name!r}' if name else ''}: {description}")


def _chat(req: schema.ChatCompletionRequest, info: ModelInfo) -> _Chat:
    use = tool_use(req, native=tools.knows_tools(info.template.source))
    messages = _with_format_note(req, _chat_messages(req, use, info.template.named_roles))
    continues = continues_final(req, messages, constrained=use is not None and use.constrained)
    work = sum(len(m["content"]) for m in messages) + CHARS_PER_MESSAGE * len(messages)
    template_tools = use.template_tools if use is not None else None
    if template_tools:  # the template writes the tools' schemas out too (megabytes, at worst)
        work += INLINE_WORK_CHARS + 1
    return _Chat(messages, use, template_tools, continues, req.add_generation_prompt is not False, work)


async def chat_text(state: ServerState, req: schema.ChatCompletionRequest) -> str:
    """The prompt text ``req`` renders to (llama-server's ``/apply-template``): the same
    conversation, tools and prefill as its answer would get, before tokenizing.

    *Cancellation*: a render running in a worker thread is waited for, never abandoned.
    """
    refuse_unsupported(req)
    lease = await model_lease(state, req.model)
    try:
        chat = _chat(req, lease.info)
        render = functools.partial(lease.info.template.render, tools=chat.template_tools)

        def run() -> str:
            if chat.continues:
                return render(chat.messages[:-1], add_generation_prompt=True) + chat.messages[-1]["content"]
            return render(chat.messages, add_generation_prompt=chat.generation_prompt)

        with tokenizing("messages"):
            return await off_loop(chat.work, run)
    finally:
        lease.release()


def continues_final(req: schema.ChatCompletionRequest, messages: list[dict[str, Any]], *, constrained: bool) -> bool:
    """Whether the answer continues the conversation's last message (an assistant's: prefill)
    rather than starting a new one. Asked for (``continue_final_message``) where it cannot be
    done, it is a 400; otherwise a final assistant message with tool calls, or one under a
    grammar (tools in use), is closed and a new turn opened, as before prefill existed."""
    last = req.messages[-1]
    wanted = req.continue_final_message
    if wanted and req.add_generation_prompt:
        message = "add_generation_prompt and continue_final_message cannot both be true"
        raise ApiError(400, message, param="add_generation_prompt", code="invalid_value")
    if wanted and last.role != "assistant":
        message = "continue_final_message needs the conversation to end with an assistant message"
        raise ApiError(400, message, param="continue_final_message", code="invalid_value")
    if last.role != "assistant" or wanted is False:
        return False
    if len(req.messages) >= 2 and req.messages[-2].role == "assistant":  # as llama-server
        message = "the conversation ends with two assistant messages; only the last one can be continued"
        raise ApiError(400, message, param=f"messages[{len(req.messages) - 1}]", code="invalid_value")
    possible = not (last.tool_calls or constrained or not messages or messages[-1]["role"] != "assistant")
    if wanted and not possible:
        message = "an assistant message with tool calls, or with tools in use, cannot be continued"
        raise ApiError(400, message, param=f"messages[{len(req.messages) - 1}]", code="invalid_value")
    return possible


def _completion_prompts(req: schema.CompletionRequest, n_vocab: int) -> list[str | list[int]]:
    """The prompts of a completion request, each a string or token ids (checked)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        prompts: list[str | list[int]] = [list(prompt)]
    else:
        prompts = list(prompt)
    for i, p in enumerate(prompts):
        if isinstance(p, list):
            for j, token in enumerate(p):
                # Checked here too (not only by the schema): a dialect may build the request.
                if not 0 <= token < n_vocab:
                    where = f"prompt[{j}]" if len(prompts) == 1 and isinstance(prompt[0], int) else f"prompt[{i}][{j}]"
                    message = f"token {token} is not in the vocabulary ({n_vocab} tokens)"
                    raise ApiError(400, message, param=where, code="invalid_value")
    return prompts


def _pinned_slot(req: schema.CommonFields, n_prompts: int, parallel: int) -> int | None:
    """The sequence ``id_slot`` names for the prompt (its first choice), or None (-1, or none)."""
    if req.id_slot is None or req.id_slot == -1:
        return None
    if req.id_slot >= parallel:
        message = f"id_slot {req.id_slot}: this server has slots 0 to {parallel - 1} (--parallel)"
        raise ApiError(400, message, param="id_slot", code="invalid_value")
    if n_prompts > 1:
        message = "id_slot names the slot of one prompt: not with several prompts"
        raise ApiError(400, message, param="id_slot", code="invalid_value")
    return req.id_slot


def _logprobs_wanted(req: schema.ChatCompletionRequest | schema.CompletionRequest) -> int | None:
    """How many alternatives to report with each token's log-probability; None: no logprobs."""
    if isinstance(req, schema.CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return (req.top_logprobs or 0) if req.logprobs else None


def _chat_messages(
    req: schema.ChatCompletionRequest, use: ToolUse | None, named_roles: frozenset[str]
) -> list[dict[str, str]]:
    """The request's messages as role/content pairs for the template (with a ``name`` where
    the template renders names for that role: ``named_roles``; refused where it does not); a
    history with tool calls and results is rewritten for templates that know no tools
    (``tools.conversation``)."""
    messages: list[dict[str, Any]] = []
    with_tools = use is not None
    for i, message in enumerate(req.messages):
        try:
            text = message.text()
        except schema.PartError as exc:
            raise ApiError(400, str(exc), param=f"messages[{i}].content[{exc.index}].type") from None
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": text}
        if message.name is not None and message.role != "tool":
            if role not in named_roles:
                problem = f"this model's chat template does not render the name of a {role} message"
                raise ApiError(400, problem, param=f"messages[{i}].name", code="unsupported_parameter")
            entry["name"] = message.name
        if message.role == "tool":
            if message.tool_call_id is None:
                message_ = "a tool message needs the tool_call_id of the call it answers"
                raise ApiError(400, message_, param=f"messages[{i}].tool_call_id", code="invalid_value")
            entry.update(tool_call_id=message.tool_call_id, name=message.name)
            with_tools = True
        if message.tool_calls:
            if message.role != "assistant":
                message_ = "only assistant messages carry tool_calls"
                raise ApiError(400, message_, param=f"messages[{i}].tool_calls", code="invalid_value")
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
            ]
            entry["tool_calls"] = calls
            with_tools = True
        messages.append(entry)
    if not with_tools:
        return messages
    if use is not None and use.native:
        return tools.native_messages(messages)
    return tools.conversation(messages, use.instruction if use is not None else None)
