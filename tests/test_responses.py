"""OpenAI's Responses API (``/v1/responses``) through a real server, the ``openai`` SDK and the
OpenAI Agents SDK: answers whole and streamed, tools, structured output, the store
(``previous_response_id``, retrieve, delete, input items), token counting, bad input, and a
stream's disconnect. Answers are bounded by schemas or tools where a test needs their shape."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support import sse
from tests.support.process import ServerProcess, serving
from tests.support.readme import run_examples
from tests.support.waiting import wait_for

COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
UNSUP = "unsupported_parameter"
# An answer that cannot end before max_output_tokens: the grammar wants a long story.
LONG = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 3000}},
    "required": ["story"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]

pytestmark = pytest.mark.server


def fmt(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        yield client


# -- answers -------------------------------------------------------------------------------------


def test_create_and_its_shape(sdk: openai.OpenAI) -> None:
    r = sdk.responses.create(model="x", input="Pick a color.", text=fmt(COLOR), temperature=0)  # type: ignore[arg-type]
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.model == "SmolLM2-135M-Instruct.Q4_1.gguf" and r.incomplete_details is None and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [part.type for part in message.content] == ["output_text"]
    jsonschema.validate(json.loads(r.output_text), COLOR)
    usage = r.usage
    assert usage is not None and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The same prompt counted without generating.
    count = sdk.responses.input_tokens.count(model="x", input="Pick a color.", text=fmt(COLOR))  # type: ignore[arg-type]
    assert count.input_tokens == usage.input_tokens


def test_cut_at_max_output_tokens_is_incomplete(sdk: openai.OpenAI) -> None:
    r = sdk.responses.create(model="x", input="Tell a story.", text=fmt(LONG), max_output_tokens=6)  # type: ignore[arg-type]
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 6 and r.output[0].status == "incomplete"


def test_stream_events_and_final_response(sdk: openai.OpenAI, server: ServerProcess) -> None:
    body = {"input": "Pick a color.", "text": fmt(COLOR), "temperature": 0, "stream": True}
    raw = httpx.post(server.url + "/v1/responses", json=body, timeout=120).content
    events = sse.named_events(raw)
    names = [name for name, _ in events]
    assert names[:4] == STREAM_ORDER and names[-4:] == [*STREAM_END, "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    deltas = [e for name, e in events if name == "response.output_text.delta"]
    item_id = events[2][1]["item"]["id"]
    assert all((d["item_id"], d["output_index"], d["content_index"]) == (item_id, 0, 0) for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert events[-4][1]["text"] == text and events[-1][1]["response"]["output"][0]["content"][0]["text"] == text
    # The SDK's stream helper accumulates the same final response, equal to the whole answer.
    with sdk.responses.stream(model="x", input="Pick a color.", text=fmt(COLOR), temperature=0) as stream:  # type: ignore[arg-type]
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert seen[-1] == "response.completed" and final.status == "completed"
    assert final.output_text == text
    whole = sdk.responses.create(model="x", input="Pick a color.", text=fmt(COLOR), temperature=0)  # type: ignore[arg-type]
    assert whole.output_text == text


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int


def test_text_format_json_schema_parsed(sdk: openai.OpenAI) -> None:
    parsed = sdk.responses.parse(model="x", input="Describe a person.", text_format=Person, max_output_tokens=60)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)


def check_call(item: Any) -> dict[str, Any]:
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    return arguments


def test_function_call_round_trip(sdk: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call at most: with parallel calls the sampled model may go on calling until the
    # sequence is full, and the answer is then (rightly) incomplete.
    r = sdk.responses.create(
        model="x",
        input=ask,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        store=False,
    )
    assert r.status == "completed" and len(r.output) == 1
    call = r.output[0]
    arguments = check_call(call)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({**arguments, "temp": 18})}
    history = [*ask, call.model_dump(exclude_none=True), result]
    answer = sdk.responses.create(
        model="x",
        input=history,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=12,
        store=False,  # type: ignore[arg-type]
    )
    assert [item.type for item in answer.output] == ["message"]
    # The call and its result reached the prompt.
    count = sdk.responses.input_tokens.count(model="x", input=history, tools=[WEATHER], tool_choice="none")  # type: ignore[arg-type]
    without = sdk.responses.input_tokens.count(model="x", input=history[:-1], tools=[WEATHER], tool_choice="none")  # type: ignore[arg-type]
    assert answer.usage is not None and answer.usage.input_tokens == count.input_tokens > without.input_tokens


def test_streamed_function_call(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(
        model="x",
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},  # type: ignore[list-item]
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    names = [e.type for e in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(names[3:-3]) == {"response.function_call_arguments.delta"}
    done = events[-3]
    assert done.arguments == "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert check_call(call) == json.loads(done.arguments)


# -- the store -------------------------------------------------------------------------------------


def test_previous_response_id_continues_a_stored_conversation(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(model="x", input="My name is Ada.", instructions="Be brief.", max_output_tokens=8)
    second = sdk.responses.create(
        model="x", input="What is my name?", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    # The model saw the first turn (its instructions not carried over, as with OpenAI's).
    said = first.output[0].content[0].text  # type: ignore[union-attr]
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "What is my name?"},
    ]
    count = sdk.responses.input_tokens.count(model="x", input=conversation)  # type: ignore[arg-type]
    assert second.usage is not None and second.usage.input_tokens == count.input_tokens
    counted = sdk.responses.input_tokens.count(model="x", input="What is my name?", previous_response_id=first.id)
    assert counted.input_tokens == count.input_tokens
    items = sdk.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]  # type: ignore[union-attr]
    assert items.data[1].content[0].text == said  # type: ignore[union-attr]
    page = sdk.responses.input_items.list(second.id, limit=1)  # newest first by default
    assert [i.id for i in page.data] == [items.data[2].id] and page.has_more


def test_retrieve_and_delete(sdk: openai.OpenAI) -> None:
    created = sdk.responses.create(model="x", input="Pick a color.", text=fmt(COLOR))  # type: ignore[arg-type]
    got = sdk.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    # A list in the query as the SDK writes it (include[]=...): it was taken and dropped.
    for asked in (
        lambda: sdk.responses.retrieve(created.id, include=["message.output_text.logprobs"]),
        lambda: sdk.responses.input_items.list(created.id, include=["message.output_text.logprobs"]),
    ):
        with pytest.raises(openai.BadRequestError, match="include"):
            asked()
    url = f"{sdk.base_url}responses/{created.id}"
    for query in ("include%5B0%5D=message.output_text.logprobs", "stream%5B%5D=true"):
        refused = httpx.get(f"{url}?{query}", timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_parameter"
    sdk.responses.delete(created.id)
    for gone in (
        lambda: sdk.responses.retrieve(created.id),
        lambda: sdk.responses.delete(created.id),
        lambda: sdk.responses.input_items.list(created.id),
        lambda: sdk.responses.create(model="x", input="Again?", previous_response_id=created.id),
    ):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_an_item_id_already_in_the_conversation_is_a_400(sdk: openai.OpenAI, server: ServerProcess) -> None:
    # input_items pages by id: two items with one id would page without end.
    first = sdk.responses.create(model="x", input="Pick a color.", text=fmt(COLOR))  # type: ignore[arg-type]
    echoed = first.output[0].model_dump(exclude_none=True)  # a client sending the output back
    for body in (
        {"previous_response_id": first.id, "input": [echoed, {"role": "user", "content": "And?"}]},
        {"input": [{"role": "user", "content": "a", "id": "msg_1"}, {"role": "user", "content": "b", "id": "msg_1"}]},
    ):
        response = httpx.post(server.url + "/v1/responses", json={**body, "max_output_tokens": 4}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_value" and error["param"] in ("input[0].id", "input[1].id"), error


def test_a_response_deleted_while_it_streams_is_not_stored(sdk: openai.OpenAI, server: ServerProcess) -> None:
    body = {"input": "Tell a story.", "text": fmt(LONG), "max_output_tokens": 48, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as response:
        lines = response.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.output_text.delta":
                    break
        id_ = events[0]["response"]["id"]
        deleted = httpx.delete(f"{server.url}/v1/responses/{id_}", timeout=30)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        ends = [json.loads(line[6:])["type"] for line in lines if line.startswith("data: ")]
    assert ends[-1] in ("response.completed", "response.incomplete"), ends[-3:]
    with pytest.raises(openai.NotFoundError):  # the delete stuck: the end kept nothing
        sdk.responses.retrieve(id_)


def test_store_false_stores_nothing(sdk: openai.OpenAI) -> None:
    r = sdk.responses.create(model="x", input="Pick a color.", text=fmt(COLOR), store=False)  # type: ignore[arg-type]
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(r.id)


@pytest.mark.server
def test_a_response_too_large_for_the_store_says_it_was_not_stored() -> None:
    """A response larger than the tenant's whole store bound is not kept; its object says
    ``store: false`` (it said true), whole and at a stream's end, and a retrieve is a 404."""
    with serving(["--threads", "1", "--responses-max-mb", "0.002"]) as proc:  # about 2 KB
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0) as client:
            ask = "Describe the sea. " * 120  # over 2 KB of input, kept with the response
            whole = client.responses.create(model="x", input=ask, max_output_tokens=4)
            assert whole.store is False
            with client.responses.stream(model="x", input=ask, max_output_tokens=4) as stream:
                ends = [e for e in stream if e.type in ("response.completed", "response.incomplete")]
            assert len(ends) == 1 and ends[0].response.store is False
            for id_ in (whole.id, ends[0].response.id):
                with pytest.raises(openai.NotFoundError):
                    client.responses.retrieve(id_)
            small = client.responses.create(model="x", input="Hi.", max_output_tokens=2)
            assert small.store is True and client.responses.retrieve(small.id).id == small.id


def test_an_answer_the_store_cannot_keep_is_given_unstored(tmp_path: pathlib.Path) -> None:
    """The store's file is locked past its busy timeout (another process's long write, as a hot
    restart's two may hold): the answer was a 500 and a stream ended without its final event.
    Now both come whole, with ``store: false``, and the store serves again once it can."""
    db = tmp_path / "responses.db"
    with serving(["--threads", "1", "--responses-db", str(db)]) as proc:
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            kept = client.responses.create(model="x", input="Hi.", max_output_tokens=2)
            other = sqlite3.connect(db, isolation_level=None)
            try:
                other.execute("BEGIN EXCLUSIVE")
                results: dict[str, Any] = {}

                def whole() -> None:
                    results["whole"] = client.responses.create(model="x", input="Hi.", max_output_tokens=2)

                def streamed() -> None:
                    with client.responses.stream(model="x", input="Hi.", max_output_tokens=2) as stream:
                        events = list(stream)
                        results["streamed"] = [e.type for e in events], getattr(events[-1], "response", None)

                threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(60)
            finally:
                other.close()
            assert results["whole"].store is False
            types, final = results["streamed"]
            assert types[-1] in ("response.completed", "response.incomplete"), types
            assert final is not None and final.store is False
            assert client.responses.retrieve(kept.id).id == kept.id
            again = client.responses.create(model="x", input="Hi.", max_output_tokens=2)
            assert again.store is True
    assert "responses store: database is locked" in proc.log and "Traceback" not in proc.log


def test_a_streamed_response_is_stored_before_its_end_is_read(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(model="x", input="Pick a color.", text=fmt(COLOR)) as stream:  # type: ignore[arg-type]
        for event in stream:
            if event.type == "response.completed":
                # The end is read: the response is there already, while the body still ends.
                assert sdk.responses.retrieve(event.response.id).output_text == event.response.output_text
        final = stream.get_final_response()
    assert final.status == "completed"


# -- the OpenAI Agents SDK -------------------------------------------------------------------------


def test_agents_sdk_runner_calls_a_function_tool(server: ServerProcess) -> None:
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider

    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Tokyo"]) -> str:  # a bounded answer
        """Get the current weather in a city."""
        cities.append(city)
        return f"18 degrees in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather with the tool.",
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=100),
        tool_use_behavior="stop_on_first_tool",
    )

    async def run() -> Any:  # the Agents SDK runs on asyncio
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            provider = OpenAIProvider(openai_client=client, use_responses=True)
            config = RunConfig(model_provider=provider, tracing_disabled=True)
            return await Runner.run(agent, "What is the weather in Paris?", run_config=config)

    result = asyncio.run(run())
    assert len(cities) == 1 and cities[0] in {"Paris", "Rome", "Tokyo"}
    assert result.final_output == f"18 degrees in {cities[0]}"


# -- bad input and cancellation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"input": "hi", "frobnicate": 1}, 400, "frobnicate", "unsupported_parameter"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input[0].content[0].type",
            "unsupported_parameter",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type", "unsupported_parameter"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning.effort", "unsupported_parameter"),
        ({"input": "hi", "background": True}, 400, "background", "unsupported_parameter"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include", "unsupported_parameter"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
        ({"input": "hi", "temperature": "1"}, 400, "temperature", "invalid_value"),
        ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role", "invalid_value"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": COLOR}}},
            400,
            "text.format.name",
            "invalid_value",
        ),
        # a schema's fields with a type that takes none are refused, not dropped
        ({"input": "hi", "text": {"format": {"type": "text", "schema": COLOR}}}, 400, "text.format.schema", UNSUP),
        (
            {"input": "hi", "text": {"format": {"type": "json_object", "name": "c", "schema": COLOR}}},
            400,
            "text.format.name",
            UNSUP,
        ),
        ({"input": "hi", "text": {"format": {"type": "text", "strict": True}}}, 400, "text.format.strict", UNSUP),
        (
            {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            400,
            "tool_choice.name",
            "invalid_value",
        ),
        (
            {"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "object", "if": {}}}]},
            400,
            "tools[0].parameters",
            "invalid_value",
        ),
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "not_found"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id", "invalid_value"),
    ],
)
def test_bad_requests(server: ServerProcess, body: dict[str, Any], status: int, param: str, code: str) -> None:
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error


def test_a_json_object_format_with_a_schema_follows_it(server: ServerProcess) -> None:
    # As chat's response_format takes it (after llama-server): the schema the object follows.
    body = {
        "input": "Pick a color.",
        "max_output_tokens": 40,
        "text": {"format": {"type": "json_object", "schema": COLOR}},
    }
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["status"] == "completed", answer
    jsonschema.validate(json.loads(answer["output"][0]["content"][0]["text"]), COLOR)


def test_disconnect_mid_stream_frees_the_sequence(server: ServerProcess) -> None:
    before = server.metrics()
    body = {"input": "Tell a story.", "text": fmt(LONG), "max_output_tokens": 1000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as response:
        deltas = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                deltas += 1
                if deltas == 5:
                    break
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the cancelled stream to end", 20)
    after = server.metrics()
    cancelled = "llama_trio_cancellations_total{phase=generate}"
    assert after[cancelled] == before[cancelled] + 1
    assert after["llama_trio_kv_cells_used"] == after["llama_trio_kv_cells_cached"]


def test_readme_examples_run_as_written(server: ServerProcess) -> None:
    curl, sdk_example, agent = run_examples("### Responses API", server.url)
    assert json.loads(curl)["object"] == "response"
    assert sdk_example.strip() and agent.strip().startswith("18 degrees in ")
