"""OpenAI parity: every request field the ``openai`` SDK can send is implemented, on the written
list of ignorable fields, or refused with a 400 ``unsupported_parameter``; OpenAI's context
error wording; ``system_fingerprint``; routes without ``/v1``."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from server.api.schema import IGNORABLE_FIELDS, ChatCompletionRequest, CompletionRequest
from tests.support import sse
from tests.support.process import ServerProcess

CHAT = [{"role": "user", "content": "Name three colors."}]
# A value for each SDK field that asks for what the field does (refused ones must say so).
VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logprobs": True,
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "moderation": {"mode": "strict"},
    "n": 2,
    "prediction": {"type": "content", "content": "Red, green, blue."},
    "prompt_cache_key": "k",
    "prompt_cache_options": {"x": 1},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "high",
    "safety_identifier": "u1",
    "service_tier": "auto",
    "store": True,
    "top_logprobs": 3,
    "verbosity": "low",
    "web_search_options": {},
    "best_of": 2,
    "echo": True,
    "suffix": "!",
}
# Fields implemented here with the values OpenAI documents (the SDK walk sends these as they are).
IMPLEMENTED_VALUES: dict[str, Any] = {
    "frequency_penalty": 0.5,
    "logit_bias": {"42": 1},
    "max_completion_tokens": 4,
    "max_tokens": 4,
    "model": "x",
    "parallel_tool_calls": True,
    "presence_penalty": 0.5,
    "response_format": {"type": "text"},
    "seed": 1,
    "stop": ["\n\n"],
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "tool_choice": "none",
    "top_p": 0.9,
    "user": "u1",
    "tools": [{"type": "function", "function": {"name": "f"}}],
}
# Where the legacy endpoint's field takes another form.
COMPLETION_VALUES: dict[str, Any] = {"logprobs": 2}


def sdk_fields(params: Any) -> list[str]:
    return sorted(set(params.CompletionCreateParamsBase.__annotations__) - {"messages", "prompt"})


@pytest.mark.parametrize(
    ("path", "name", "implemented"),
    [("/v1/chat/completions", name, ChatCompletionRequest) for name in sdk_fields(chat_create_params)]
    + [("/v1/completions", name, CompletionRequest) for name in sdk_fields(completion_create_params)],
)
def test_every_sdk_field_is_implemented_ignorable_or_refused(
    server: ServerProcess, path: str, name: str, implemented: type
) -> None:
    base: dict[str, Any] = {"messages": CHAT} if "chat" in path else {"prompt": "Colors:"}
    base.update(max_tokens=4, temperature=0)
    value = (COMPLETION_VALUES.get(name) if "chat" not in path else None) or VALUES.get(
        name, IMPLEMENTED_VALUES.get(name)
    )
    assert value is not None, f"no test value for the SDK's new field {name!r}: decide what it is"
    if name == "tool_choice":
        base["tools"] = [{"type": "function", "function": {"name": "f"}}]
    response = httpx.post(server.url + path, json={**base, name: value}, timeout=60)
    if name in IGNORABLE_FIELDS or (name in implemented.model_fields and name not in VALUES):
        assert response.status_code == 200, (name, response.text)
        return
    # Not implemented with this value: refused, naming the field.
    assert response.status_code == 400, (name, response.text)
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", name), error


def test_unknown_fields_are_refused_and_ignorable_ones_accepted(server: ServerProcess) -> None:
    for body, status in (({"mirostat": 2}, 400), ({"typical_p": 0.5}, 400), ({"store": False, "metadata": {}}, 200)):
        response = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body})
        assert response.status_code == status, response.text
        if status == 400:
            assert response.json()["error"]["code"] == "unsupported_parameter"
            assert response.json()["error"]["param"] == next(iter(body))


def test_context_length_error_uses_openais_words(server: ServerProcess) -> None:
    long = "word " * 3000
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    error = chat.json()["error"]
    assert chat.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 1024 tokens. However, your messages")
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": long})
    assert "However, your prompt resulted in" in completion.json()["error"]["message"]
    # litellm tells this error apart by that phrase.
    assert "maximum context length" in completion.json()["error"]["message"]


def test_system_fingerprint_on_every_response_and_chunk(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        whole = client.chat.completions.create(model="x", messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
        fingerprint = whole.system_fingerprint
        assert fingerprint and fingerprint.startswith("fp_")
        chunks = list(client.chat.completions.create(model="x", messages=CHAT, max_tokens=4, stream=True))  # type: ignore[arg-type]
        assert chunks and all(c.system_fingerprint == fingerprint for c in chunks)
        assert client.completions.create(model="x", prompt="Colors:", max_tokens=4).system_fingerprint == fingerprint


def test_routes_answer_without_v1(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.url, api_key="x", max_retries=0) as client:
        assert client.models.list().data
        assert client.chat.completions.create(model="x", messages=CHAT, max_tokens=4).choices  # type: ignore[arg-type]
        assert client.completions.create(model="x", prompt="Colors:", max_tokens=4).choices
    with httpx.stream(
        "POST", server.url + "/chat/completions", json={"messages": CHAT, "max_tokens": 4, "stream": True}
    ) as response:
        assert sse.parse(response.read(), kind="chat").finish_reasons
