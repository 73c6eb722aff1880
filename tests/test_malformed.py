"""Malformed requests that a review found answered with a 500 or that stalled the event loop,
each against a real server process: every one is a clear 4xx (or a normal answer) now, and the
server logs no traceback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.process import ServerProcess, serving

DEEP_ARGUMENTS = "[" * 1200  # a short string that parses only past the recursion limit (1000)
CALLED = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving(["--parallel", "2", "--ctx-size", "8192", "--threads", "1"]) as proc:
        yield proc


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"not": schema}
    return schema


def assert_no_traceback(server: ServerProcess) -> None:
    assert "Traceback" not in server.log and "internal server error" not in server.log


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CALLED, "max_tokens": 2}),
        ("/v1/chat/completions/input_tokens", {"messages": CALLED}),
        ("/apply-template", {"messages": CALLED}),
        (
            "/v1/responses",
            {
                "input": [
                    {"type": "message", "role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_ARGUMENTS},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ],
                "max_output_tokens": 2,
                "store": False,
            },
        ),
    ],
)
def test_call_arguments_nested_past_the_parser_are_kept_as_text(
    server: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    assert_no_traceback(server)


def test_a_body_nested_past_the_bound_is_a_400_however_it_is_parsed(server: ServerProcess) -> None:
    # Over 32 KiB, a body is parsed in a worker thread, whose fresh stack took 978 levels that
    # the event loop's walks of the schema then could not: a 500 before the depth bound.
    deep = '{"not": ' * 978 + '{"type": "string"}' + "}" * 978  # past what json.dumps here can write
    for padding in ("", "x" * 40_000):
        body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "%s", "json_schema": %s}'
        response = httpx.post(
            server.url + "/v1/chat/completions",
            content=body % (padding, deep),
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_json"
        assert "nested too deeply" in response.json()["error"]["message"]
    assert_no_traceback(server)


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"json_schema": nested(200)}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": nested(200)}}},
         "response_format.json_schema.schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(200)}}], "tool_choice": "required"},
         "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_a_schema_past_its_bounds_is_refused_before_it_is_walked(
    server: ServerProcess, field: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **field}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "levels deep" in error["message"], error
    assert_no_traceback(server)


def test_a_long_chain_of_refs_is_refused_at_its_bound(server: ServerProcess) -> None:
    # Closing the objects of this chain walked all of it again after each $ref: 1,500 took
    # seconds on the event loop. Now the bounds are checked first, and the walk is linear.
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1, 1500)}
    defs["d0"] = {"type": "object", "properties": {}, "$ref": "#/$defs/d1"}
    defs["d1500"] = {"type": "object"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = post(server, "/v1/chat/completions", {**body, "json_schema": {"$defs": defs, "$ref": "#/$defs/d0"}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "json_schema"
    assert_no_traceback(server)


def test_a_responses_item_type_that_is_not_a_string_is_a_400(server: ServerProcess) -> None:
    body = {"input": [{"type": ["message"], "role": "user", "content": "hi"}], "max_output_tokens": 2}
    response = post(server, "/v1/responses", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input[0].type"
    assert_no_traceback(server)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": {"a": 1}, "text": "hi"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "system": [{"type": ["text"], "text": "s"}]},
    ],
)
def test_an_anthropic_block_type_that_is_not_a_string_is_a_400(server: ServerProcess, body: dict[str, Any]) -> None:
    response = post(server, "/v1/messages", {"model": "x", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert_no_traceback(server)


def test_an_input_items_limit_in_other_digits_is_a_400(server: ServerProcess) -> None:
    # "²".isdigit() is true; int("²") raises.
    response = httpx.get(server.url + "/v1/responses/resp_x/input_items", params={"limit": "²"}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "limit"
    assert_no_traceback(server)
