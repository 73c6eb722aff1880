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
from tests.support.process import NO_END_TOKENS, ServerProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

CHAT = [{"role": "user", "content": "Name three colors."}]
# A value for each field the openai SDK can send, one that asks for what the field does.
VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "best_of": 2,
    "echo": True,
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"42": 1},
    "logprobs": True,
    "max_completion_tokens": 4,
    "max_tokens": 4,
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "model": "x",
    "moderation": {"mode": "strict"},
    "n": 2,
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "Red, green, blue."},
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "prompt_cache_options": {"x": 1},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "high",
    "response_format": {"type": "text"},
    "safety_identifier": "u1",
    "seed": 1,
    "service_tier": "auto",
    "stop": ["\n\n"],
    "store": True,
    "stream_options": {"include_usage": True},
    "suffix": "!",
    "temperature": 0.5,
    "tool_choice": "none",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "top_logprobs": 3,
    "top_p": 0.9,
    "user": "u1",
    "verbosity": "low",
    "web_search_options": {},
}
# Where the legacy endpoint's field takes another form.
COMPLETION_VALUES: dict[str, Any] = {"logprobs": 2}
# What this server refuses, with those values; everything else is implemented or ignorable.
REFUSED = {
    "chat": {"audio", "function_call", "functions", "modalities", "moderation", "reasoning_effort",
             "verbosity", "web_search_options"},
    "completion": {"best_of", "suffix"},
}  # fmt: skip


def sdk_fields(params: Any) -> list[str]:
    return sorted(set(params.CompletionCreateParamsBase.__annotations__) - {"messages", "prompt"})


@pytest.mark.parametrize(
    ("kind", "name"),
    [("chat", name) for name in sdk_fields(chat_create_params)]
    + [("completion", name) for name in sdk_fields(completion_create_params)],
)
def test_every_sdk_field_is_implemented_ignorable_or_refused(server: ServerProcess, kind: str, name: str) -> None:
    chat = kind == "chat"
    base: dict[str, Any] = {"messages": CHAT} if chat else {"prompt": "Colors:"}
    base.update(max_tokens=4, temperature=0)
    value = VALUES.get(name) if chat else COMPLETION_VALUES.get(name, VALUES.get(name))
    assert value is not None, f"no test value for the SDK's new field {name!r}: decide what it is"
    if name == "tool_choice":
        base["tools"] = VALUES["tools"]
    if name == "top_logprobs":
        base["logprobs"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = httpx.post(server.url + path, json={**base, name: value}, timeout=60)
    model = ChatCompletionRequest if chat else CompletionRequest
    if name not in REFUSED[kind]:
        assert name in model.model_fields or name in IGNORABLE_FIELDS, name
        assert response.status_code == 200, (name, response.text)
        return
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


# -- logprobs ---------------------------------------------------------------------------------


def test_chat_logprobs_streamed_and_not(server: ServerProcess, model: Any) -> None:
    kwargs: dict[str, Any] = {"model": "x", "messages": CHAT, "max_tokens": 8, "temperature": 0}
    kwargs.update(logprobs=True, top_logprobs=3, logit_bias=NO_END_TOKENS)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content = whole.logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    assert "".join(entry.token for entry in content) == whole.message.content
    for entry in content:
        assert bytes(entry.bytes or []) == entry.token.encode()
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy: the token taken is the likeliest one; the list runs from most likely down.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_legacy_shape(server: ServerProcess) -> None:
    body = {"prompt": "Colors:", "max_tokens": 6, "temperature": 0, "logprobs": 2, "logit_bias": NO_END_TOKENS}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob) and token in top
    # Streamed, the same numbers piece by piece.
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        chunks = sse.parse(response.read(), kind="completion").chunks
    streamed = [
        t
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed == pytest.approx(lp["token_logprobs"])


def test_logprobs_under_a_grammar_describe_what_it_allowed(server: ServerProcess) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["red", "blue"]}}},
    }
    choice = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    first = choice["logprobs"]["content"][0]
    # Only '"' may open the answer: it has all the probability, and nothing else is listed.
    assert first["token"].startswith('"') and first["logprob"] == pytest.approx(0.0, abs=1e-4)
    assert all(alt["logprob"] > -9999 for alt in first["top_logprobs"])
    assert (
        "top_logprobs"
        in httpx.post(
            server.url + "/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2}, timeout=60
        ).json()["error"]["param"]
    )


# -- n choices ----------------------------------------------------------------------------------


def test_n_choices_share_the_prompt_and_differ_by_seed(server: ServerProcess) -> None:
    kwargs: dict[str, Any] = {"model": "x", "messages": CHAT, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    kwargs["logit_bias"] = NO_END_TOKENS
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        one = client.chat.completions.create(**kwargs)
        three = client.chat.completions.create(**kwargs, n=3)
        again = client.chat.completions.create(**kwargs, n=3)
        chunks = list(
            client.chat.completions.create(**kwargs, n=3, stream=True, stream_options={"include_usage": True})
        )
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert texts == [c.message.content for c in again.choices]  # seeds make each choice reproducible
    assert texts[0] == one.choices[0].message.content  # choice 0 has the job's own seed
    assert len(set(texts)) >= 2
    assert three.usage is not None and one.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * 16
    streamed = {i: "" for i in range(3)}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(3)] == texts
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 48


def test_n_choices_for_completions_and_greedy_ones_agree(server: ServerProcess) -> None:
    body = {"prompt": "Colors:", "max_tokens": 8, "temperature": 0, "n": 2}
    choices = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    single = httpx.post(server.url + "/v1/completions", json={**body, "n": 1}, timeout=60).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] == choices[1]["text"] == single[0]["text"]


def test_cancelling_n_choices_frees_every_sequence(server: ServerProcess) -> None:
    body = {"messages": CHAT, "max_tokens": 300, "n": 3, "stream": True, "logit_bias": NO_END_TOKENS}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for seen, _ in enumerate(response.iter_lines()):
            if seen > 12:
                break
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "every choice's sequence to be freed", 20)
    m = server.metrics()
    assert m["llama_trio_kv_cells_used"] == m["llama_trio_kv_cells_cached"]


# -- prompt forms -------------------------------------------------------------------------------


def test_completion_prompt_forms(server: ServerProcess, model: Any) -> None:
    vocab = model.vocab
    prompts = ["Colors:", "Numbers: 1, 2,"]
    ids = [vocab.tokenize(p, add_special=True, parse_special=True) for p in prompts]
    base = {"max_tokens": 6, "temperature": 0, "logit_bias": NO_END_TOKENS}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        singles = [client.completions.create(model="x", prompt=p, **base) for p in prompts]  # type: ignore[arg-type]
        as_strings = client.completions.create(model="x", prompt=prompts, **base)  # type: ignore[arg-type]
        as_ids = client.completions.create(model="x", prompt=ids[0], **base)  # type: ignore[arg-type]
        as_id_lists = client.completions.create(model="x", prompt=ids, n=2, **base)  # type: ignore[arg-type]
        echoed = client.completions.create(model="x", prompt=prompts[0], echo=True, **base)  # type: ignore[arg-type]
    texts = [s.choices[0].text for s in singles]
    assert [c.index for c in as_strings.choices] == [0, 1] and [c.text for c in as_strings.choices] == texts
    assert as_strings.usage is not None and singles[0].usage is not None and singles[1].usage is not None
    assert as_strings.usage.prompt_tokens == singles[0].usage.prompt_tokens + singles[1].usage.prompt_tokens
    assert as_ids.choices[0].text == texts[0]
    # n per prompt: index = prompt's place * n + choice.
    assert [c.text for c in as_id_lists.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert echoed.choices[0].text == prompts[0] + texts[0]
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={"prompt": prompts, "stream": True, **base}, timeout=60
    ) as response:
        chunks = sse.parse(response.read(), kind="completion").chunks
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert [streamed[0], streamed[1]] == texts


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([], "prompt"), ([[]], "prompt"), ([1, 99_999_999], "prompt[1]"), ([[1], [2, 99_999_999]], "prompt[1][1]"),
     (["a"] * 5, "prompt")],
    ids=["empty-list", "empty-ids", "id-out-of-vocabulary", "nested-id-out-of-vocabulary", "more-than-parallel"],
)  # fmt: skip
def test_bad_prompt_forms_are_400s(server: ServerProcess, prompt: Any, param: str) -> None:
    response = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_echo_with_logprobs_is_refused(server: ServerProcess) -> None:
    body = {"prompt": "Colors:", "max_tokens": 2, "echo": True, "logprobs": 1}
    error = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", "echo")
