"""Anthropic's Messages API (``/v1/messages``) through a real server and the ``anthropic`` SDK:
answers whole and streamed, tool use and results, stop sequences, token counting, the
billing-header block, errors in Anthropic's shape, and a stream's disconnect. Answers are
bounded by schemas or tools where a test needs their shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.support import sse
from tests.support.process import ServerProcess
from tests.support.readme import run_examples
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0}  # the SDK no longer has sampling arguments; the API takes them
ASK = [{"role": "user", "content": "Pick a color."}]
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
LONG = {  # an answer that cannot end before max_tokens
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 3000}},
    "required": ["story"],
    "additionalProperties": False,
}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER_SCHEMA}
ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "overloaded_error"}


def output(schema: dict[str, Any]) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "schema": schema}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The default model with CORS on (API keys: ``tests/test_agent_serving.py``)."""
    from tests.support.process import serving

    with serving(
        ["--parallel", "4", "--ctx-size", "4096", "--threads", "2", "--cors-origin", "http://app.example"]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    beta = {"anthropic-beta": "fine-grained-tool-streaming-2025-05-14"}
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0, default_headers=beta) as client:
        yield client


def check_error(body: Any, kind: str = "invalid_request_error") -> str:
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


# -- answers -------------------------------------------------------------------------------------


def test_create_and_its_shape(sdk: anthropic.Anthropic) -> None:
    m = sdk.messages.create(model="x", max_tokens=40, messages=ASK, output_config=output(COLOR), extra_body=GREEDY)  # type: ignore[arg-type]
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [block.type for block in m.content] == ["text"] and m.stop_reason == "end_turn" and m.stop_sequence is None
    jsonschema.validate(json.loads(m.content[0].text), COLOR)  # type: ignore[union-attr]
    count = sdk.messages.count_tokens(model="x", messages=ASK, output_config=output(COLOR))  # type: ignore[arg-type]
    usage = m.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == count.input_tokens
    assert usage.cache_creation_input_tokens == 0 and 0 < usage.output_tokens <= 40


def test_cut_at_max_tokens(sdk: anthropic.Anthropic) -> None:
    m = sdk.messages.create(model="x", max_tokens=5, messages=ASK, output_config=output(LONG))  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5


def test_stream_events_and_final_message(sdk: anthropic.Anthropic, server: ServerProcess) -> None:
    body = {"model": "x", "max_tokens": 40, "messages": ASK, "output_config": output(COLOR), "stream": True, **GREEDY}
    headers = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
    raw = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=120).content
    events = [event for event in sse.named_events(raw, pings=None) if event[0] != "ping"]
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    deltas = [e for _, e in events[2:-3]]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    text = "".join(d["delta"]["text"] for d in deltas)
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    with sdk.messages.stream(
        model="x", max_tokens=40, messages=ASK, output_config=output(COLOR), extra_body=GREEDY
    ) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text == final.content[0].text  # type: ignore[union-attr]
    whole = sdk.messages.create(model="x", max_tokens=40, messages=ASK, output_config=output(COLOR), extra_body=GREEDY)  # type: ignore[arg-type]
    assert whole.content[0].text == text  # type: ignore[union-attr]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_with_a_tool_call(sdk: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with sdk.messages.stream(
        model="x",
        max_tokens=80,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:  # type: ignore[arg-type, list-item]
        events = list(stream)
        final = stream.get_final_message()
    raw = [
        e for e in events if e.type in {"message_start", "content_block_start", "content_block_stop", "message_stop"}
    ]
    assert [e.type for e in raw] == ["message_start", "content_block_start", "content_block_stop", "message_stop"]
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert fragments and all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    [block] = final.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert json.loads("".join(fragments)) == block.input
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    assert final.stop_reason == "tool_use"


def test_tool_result_round_trip(sdk: anthropic.Anthropic) -> None:
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = sdk.messages.create(
        model="x",
        max_tokens=80,
        messages=[ask],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[list-item]
    )
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use"
    jsonschema.validate(use.input, WEATHER_SCHEMA)

    def turn(is_error: bool) -> list[Any]:
        result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18 degrees"}]}
        if is_error:
            result["is_error"] = True
        return [ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]

    answer = sdk.messages.create(
        model="x",
        max_tokens=12,
        messages=turn(False),
        tools=[WEATHER],
        tool_choice={"type": "none"},  # type: ignore[list-item]
    )
    assert [block.type for block in answer.content] == ["text"] and answer.stop_reason in {"end_turn", "max_tokens"}
    counts = [
        sdk.messages.count_tokens(
            model="x", messages=turn(is_error), tools=[WEATHER], tool_choice={"type": "none"}
        ).input_tokens  # type: ignore[list-item]
        for is_error in (False, True)
    ]
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == counts[0]
    assert counts[1] > counts[0]  # an error result reaches the model as one


def test_stop_sequences(sdk: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": "x",
        "max_tokens": 12,
        "messages": ASK,
        "output_config": output(LONG),
        "extra_body": GREEDY,
    }
    full = sdk.messages.create(**kwargs).content[0].text  # type: ignore[union-attr]
    stop = full[12:15]  # inside the story, whatever it says (the same run, the same text)
    cut = sdk.messages.create(**kwargs, stop_sequences=["\u2603never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[: full.index(stop)]  # type: ignore[union-attr]


def test_billing_header_block_is_left_out_of_the_prompt(sdk: anthropic.Anthropic) -> None:
    def system(n: int) -> list[dict[str, str]]:
        billing = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{n}; cch={n:05d};"}
        return [billing, {"type": "text", "text": "You are a helpful assistant."}]

    plain = sdk.messages.count_tokens(model="x", messages=ASK, system="You are a helpful assistant.")
    assert sdk.messages.count_tokens(model="x", messages=ASK, system=system(1)).input_tokens == plain.input_tokens  # type: ignore[arg-type]
    sdk.messages.create(model="x", max_tokens=1, messages=ASK, system=system(2))  # type: ignore[arg-type]
    again = sdk.messages.create(model="x", max_tokens=1, messages=ASK, system=system(3))  # type: ignore[arg-type]
    assert (again.usage.cache_read_input_tokens or 0) >= plain.input_tokens - 1  # the prefix was reused


# -- errors, headers, cancellation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 8, "messages": ASK, "frobnicate": 1}, "frobnicate"),
        (
            {"max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "web_search_20250305",
        ),
        ({"max_tokens": 8, "messages": ASK, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 8, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        (
            {"max_tokens": 8, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
            "'nope'",
        ),
        (  # a name with a type that takes none is refused, not dropped
            {
                "max_tokens": 8,
                "messages": ASK,
                "tools": [WEATHER],
                "tool_choice": {"type": "any", "name": "get_weather"},
            },
            "takes no name",
        ),
        ({"max_tokens": 8, "messages": ASK, "stop_sequences": ["x"] * 17}, "stop_sequences"),
        (
            {"max_tokens": 8, "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}]},
            "thinking",
        ),
    ],
)
def test_bad_requests_in_anthropic_shape(sdk: anthropic.Anthropic, body: dict[str, Any], says: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.post("/v1/messages", body={"model": "x", **body}, cast_to=httpx.Response)
    assert caught.value.status_code == 400
    assert says in check_error(caught.value.body)


def test_transport_errors_in_anthropic_shape(server: ServerProcess) -> None:
    bad_json = httpx.post(server.url + "/v1/messages", content=b"{", timeout=30)
    assert bad_json.status_code == 400 and "not valid JSON" in check_error(bad_json.json())
    not_an_object = httpx.post(server.url + "/v1/messages/count_tokens", json=[1], timeout=30)
    assert not_an_object.status_code == 400 and "JSON object" in check_error(not_an_object.json())
    wrong_method = httpx.get(server.url + "/v1/messages", timeout=30)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "OPTIONS, POST"
    check_error(wrong_method.json())
    too_large = httpx.post(server.url + "/v1/messages", content=b"{" + b" " * (4 * 1024 * 1024), timeout=30)
    assert too_large.status_code == 413 and "larger than" in check_error(too_large.json(), "request_too_large")
    for method in ("GET", "POST", "DELETE", "OPTIONS"):  # a path the family lacks: its 404
        unknown = httpx.request(method, server.url + "/v1/messages/batches", json={}, timeout=30)
        assert unknown.status_code == 404 and "no route" in check_error(unknown.json(), "not_found_error")
    # The OpenAI routes keep theirs.
    openai_shape = httpx.post(server.url + "/v1/chat/completions", content=b"{", timeout=30)
    assert openai_shape.status_code == 400 and set(openai_shape.json()["error"]) == {"message", "type", "param", "code"}


def test_cors_preflight_allows_the_sdk_headers(server: ServerProcess) -> None:
    headers = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    response = httpx.options(server.url + "/v1/messages", headers=headers, timeout=30)
    allowed = {h.strip().lower() for h in response.headers["access-control-allow-headers"].split(",")}
    assert {"x-api-key", "anthropic-version", "anthropic-beta", "content-type"} <= allowed


def test_disconnect_mid_stream_frees_the_sequence(server: ServerProcess) -> None:
    before = server.metrics()
    body = {"model": "x", "max_tokens": 1000, "messages": ASK, "output_config": output(LONG), "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as response:
        deltas = 0
        for line in response.iter_lines():
            if line == "event: content_block_delta":
                deltas += 1
                if deltas == 5:
                    break
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the cancelled stream to end", 20)
    after = server.metrics()
    cancelled = "llama_trio_cancellations_total{phase=generate}"
    assert after[cancelled] == before[cancelled] + 1
    assert after["llama_trio_kv_cells_used"] == after["llama_trio_kv_cells_cached"]


def test_readme_examples_run_as_written(server: ServerProcess) -> None:
    curl, sdk_example = run_examples("### Anthropic Messages API", server.url)
    assert json.loads(curl)["type"] == "message"
    assert sdk_example.strip().splitlines()[-1].isdigit()
