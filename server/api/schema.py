"""The wire schema: pydantic models of requests, responses and errors. No engine imports.

Requests are validated strictly (no "1" for 1, no NaN or infinity). A request field, at the
top level or in a nested object (a message, a part, a tool, an option), is either implemented
(a field below), on its object's ignorable list (``IGNORABLE_FIELDS`` at the top level: it
cannot change the answer), null (not set), or refused with a 400 ``unsupported_parameter``
naming it with its path (``unsupported``): never accepted and dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.api.input_shapes import texts_or_tokens
from server.api.lazy import build_models

MAX_STOP_STRINGS = 16
MAX_MESSAGES = 2048  # as OpenAI
MAX_CACHE_SALT = 256
MAX_GRAMMAR_CHARS = 256 * 1024  # a GBNF grammar, or a JSON schema as JSON text
MAX_LOGIT_BIAS = 300
MAX_TOOLS = 128  # as OpenAI
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each answer also needs a sequence)
MAX_TOKEN_ID_DIGITS = 10  # token ids are int32


# Request fields (top level) that do not change the answer, accepted and not used: bookkeeping
# for the caller or for OpenAI's own storage, caching hints and speed hints (``prediction``,
# a predicted output, is one).
IGNORABLE_FIELDS = frozenset(
    {"metadata", "store", "service_tier", "safety_identifier", "prediction",
     "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"}
)  # fmt: skip


class _Request(BaseModel):
    """A request object: its known fields validated strictly, others kept (``model_extra``)
    so that ``unsupported`` can name them."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, defer_build=True)
    # Unknown fields of this object accepted and not used: they cannot change the answer.
    _ignorable: ClassVar[frozenset[str]] = frozenset()

    def unsupported_at(self, path: str) -> str | None:
        """The path of the first field, here or in an object below, set to something this
        server does not do (``messages[0].foo``), or None. A field set to null is not set.
        Objects with values to check override ``refused_value``."""
        for name, value in (self.model_extra or {}).items():
            if value is not None and name not in self._ignorable:
                return _join(path, name)
        refused = self.refused_value()
        if refused is not None:
            return _join(path, refused)
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            values = enumerate(value) if isinstance(value, list) else ((None, value),)
            for i, item in values:
                if isinstance(item, _Request):
                    where = _join(path, field.alias or name) + ("" if i is None else f"[{i}]")
                    found = item.unsupported_at(where)
                    if found is not None:
                        return found
        return None

    def refused_value(self) -> str | None:
        """The first known field of this object set to a value this server does not do."""
        return None


class Known(BaseModel):
    """A nested object of a request whose every field is known: another field is a 400,
    unless it is null (it sets nothing; an SDK's response objects, sent back as input, carry
    such fields)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, defer_build=True)

    @model_validator(mode="before")
    @classmethod
    def _unset_nulls(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if v is not None or k in cls.model_fields}
        return value


class StrictRequest(BaseModel):
    """A request body with no fields but its own (an unknown one is a 400)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, defer_build=True)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class ContentPart(_Request):
    """A part of a message's content: text (an assistant's refusal is text too); other types
    are refused by ``Message.text`` naming the part's ``type``."""

    type: str
    text: str | None = None
    refusal: str | None = None
    _ignorable = frozenset({"prompt_cache_breakpoint"})  # a caching hint, as prompt_cache_* above

    def unsupported_at(self, path: str) -> str | None:
        return super().unsupported_at(path) if self.type in ("text", "refusal") else None


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCall(_Request):
    name: FunctionName
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    # The participant's name: a tool's names its function; others are rendered where the chat
    # template renders names, and refused where it does not (``prepare``).
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # tool
    refusal: str | None = None  # assistant: what it said in refusing, rendered as its content

    def refused_value(self) -> str | None:
        if self.refusal is not None and self.role != "assistant":
            return "refusal"
        if isinstance(self.content, list) and self.role != "assistant":
            for i, part in enumerate(self.content):
                if part.type == "refusal":
                    return f"content[{i}].type"
        return None

    def text(self) -> str:
        """The content as one string, an assistant's refusal included; raises ``PartError``
        naming a part we cannot take."""
        texts = []
        if isinstance(self.content, str):
            texts.append(self.content)
        for i, part in enumerate(self.content if isinstance(self.content, list) else ()):
            text = part.text if part.type == "text" else part.refusal if part.type == "refusal" else None
            if part.type not in ("text", "refusal"):
                raise PartError(i, f"content part type {part.type!r} is not supported; only 'text' parts are")
            if text is None:
                raise PartError(i, f"a {part.type} part needs a string {part.type!r}")
            texts.append(text)
        if self.refusal:
            texts = [*(t for t in texts if t), self.refusal]
        return "\n".join(texts)  # as llama-server and vLLM join parts


class PartError(ValueError):
    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class JsonSchemaFormat(_Request):
    # OpenAI requires a name; llama-server and vLLM do not, and it changes no answer.
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    description: str | None = None
    # "schema" would shadow a pydantic method: the field is read under its wire name.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema
    # With type json_object, as llama-server takes it: the schema the object follows.
    object_schema: dict[str, Any] | None = Field(default=None, alias="schema")

    def refused_value(self) -> str | None:
        if self.json_schema is not None and self.type != "json_schema":
            return "json_schema"
        if self.object_schema is not None and self.type != "json_object":
            return "schema"
        return None


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's usage in every chunk: not done
    include_obfuscation: bool = False  # OpenAI's padding of chunks: not done

    def refused_value(self) -> str | None:
        if self.continuous_usage_stats:
            return "continuous_usage_stats"
        return "include_obfuscation" if self.include_obfuscation else None


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class CommonFields(_Request):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Probability | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)] | None
    ) = None
    n: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # ignorable: who the caller's user is
    # Prefix-cache scope (as vLLM): requests reuse each other's cached prompt prefixes only
    # with the same salt (and the same API key, when keys are configured).
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # Structured outputs: OpenAI's response_format, and llama-server's json_schema and grammar
    # (GBNF), so that its clients work unchanged.
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None
    grammar: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    # llama-server's: run in this sequence (reusing what it holds, e.g. a restored slot); -1: any.
    id_slot: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise PydanticCustomError(
                "too_many_stop_strings",
                "at most {limit} stop strings are allowed, got {count}",
                {"limit": MAX_STOP_STRINGS, "count": len(value)},
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            # ASCII digits only ("²" is a digit to str.isdigit, not to int), and few of them.
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    _ignorable = IGNORABLE_FIELDS

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None: an unknown
        field that is not ignorable, here or in a nested object (its path), or a value of a
        known one that is not implemented."""
        return self.unsupported_at("")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class FunctionDef(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: no arguments
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(CommonFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    modalities: list[str] | None = None
    # llama-server's and vLLM's: a conversation that ends with an assistant message continues
    # that message (prefill) unless continue_final_message is false; add_generation_prompt
    # false renders no assistant turn at the end.
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None."""
        if self.tools and self.tool_choice != "none":
            # A tool-using answer's text is not what is generated: no logprobs of it; and one
            # choice.
            if self.logprobs:
                return "logprobs"
            if self.n is not None and self.n > 1:
                return "n"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities"
        return super().unsupported()


PromptInput = texts_or_tokens(MAX_PROMPTS)  # one answer each


class CompletionRequest(CommonFields):
    # A string, strings (one answer each), token ids, or lists of token ids (one answer each).
    prompt: PromptInput  # type: ignore[valid-type]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None."""
        if self.echo and self.logprobs is not None:
            return "echo"  # the prompt's own logprobs are not computed
        if self.best_of is not None and self.best_of > 1:
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()


MAX_EMBEDDING_INPUTS = 256
EmbeddingInput = texts_or_tokens(MAX_EMBEDDING_INPUTS)  # one embedding each


class EmbeddingRequest(_Request):
    # A string, strings, token ids, or lists of token ids: one embedding each.
    input: EmbeddingInput  # type: ignore[valid-type]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # ignorable

    _ignorable = IGNORABLE_FIELDS

    def unsupported(self) -> str | None:
        """The first field this server does not do: any unknown one not ignorable, or
        ``dimensions`` (the model's size is the only one)."""
        return self.unsupported_at("") or ("dimensions" if self.dimensions is not None else None)


# -- responses -----------------------------------------------------------------------------


class Out(BaseModel):
    """A response object. Every model's validator is built at the end (``build_models``)."""

    model_config = ConfigDict(defer_build=True)


class PromptTokensDetails(Out):
    cached_tokens: int


class UsageInfo(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCallOut(Out):
    name: str
    arguments: str


class ToolCallOut(Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Out):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionChoice(Out):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class Completion(Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: UsageInfo


build_models(globals())
