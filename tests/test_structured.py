"""Structured outputs through a real server: every answer follows its JSON Schema or grammar,
streamed or not, greedy or sampled; constrained and free streams share a batch; errors are
400s naming the field.

What a sample is differs between CPUs (llama.cpp's kernels round differently on each), so every
schema here bounds its answers: strings have a ``maxLength``, integers and numbers a range
(numbers a ``multipleOf`` too: a number's digits are unbounded otherwise), arrays a
``maxItems``, objects no free properties. Each valid answer then fits ``MAX_TOKENS``, so a
constrained answer ends with ``stop`` by construction, whatever is sampled. Where the answer
cannot be bounded (``json_object``), the test asserts what holds for any sample: a finished
answer parses, one cut short is the beginning of a JSON object.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Annotated, Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from server.engine import grammar_limits as limits
from tests.support import sse
from tests.support.grammars import any_of_chain, gbnf_chain, optional_properties, properties_chain, ref_chain
from tests.support.jsonprefix import parse_prefix
from tests.support.process import NO_END_TOKENS, ServerProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]
SCHEMA_PARAM = "response_format.json_schema.schema"
# Room for the longest valid answer of any schema below, every token being at least one byte: the
# longest is Person's, 285 bytes with each string character at its longest (6 bytes, a \uXXXX
# escape); optional-fields' is 253.
MAX_TOKENS = 300

SMALL_INTEGER = {"type": "integer", "minimum": -1000, "maximum": 1000}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested-objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array-bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 2, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"kind": {"const": "person"}, "ok": {"type": "boolean"}},
        "required": ["kind", "ok"],
        "additionalProperties": False,
    },
    "number-bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "string-pattern-length": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "nick": {"type": "string", "minLength": 2, "maxLength": 6},
        },
        "required": ["code", "nick"],
        "additionalProperties": False,
    },
    "defs-ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": SMALL_INTEGER, "y": SMALL_INTEGER},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "any-of": {
        "type": "object",
        "properties": {"value": {"anyOf": [SMALL_INTEGER, {"type": "string", "maxLength": 10}, {"type": "null"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "no-additional-properties": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "optional-fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "email": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name"],
        "additionalProperties": False,
    },
    "unicode-and-escapes": {
        "type": "object",
        "properties": {
            "quote": {"type": "string", "maxLength": 20},
            "city": {"enum": ["Zürich", "東京", 'say "hi"\\n']},
        },
        "required": ["quote", "city"],
        "additionalProperties": False,
    },
    "top-level-array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
}


def chat(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chat(server: ServerProcess, body: dict[str, Any]) -> sse.Stream:
    payload = {"messages": ASK, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=300) as response:
        assert response.status_code == 200
        return sse.parse(response.read(), kind="chat")


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_answer_follows_its_schema(server: ServerProcess, name: str) -> None:
    schema = SCHEMAS[name]
    body = {"response_format": response_format(schema), "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = chat(server, body)["choices"][0]
    assert whole["finish_reason"] == "stop"
    jsonschema.validate(json.loads(whole["message"]["content"]), schema)
    streamed = stream_chat(server, body)
    assert streamed.finish_reasons == ["stop"]
    assert streamed.text == whole["message"]["content"]
    for seed in (1, 2):
        # A sample may run to max_tokens (a number's digits are unbounded): then it is cut.
        sampled = chat(server, {**body, "temperature": 1.0, "seed": seed, "max_tokens": 80})["choices"][0]
        assert sampled["finish_reason"] in {"stop", "length"}
        if sampled["finish_reason"] == "stop":
            jsonschema.validate(json.loads(sampled["message"]["content"]), schema)


def test_json_object_completion_and_llama_server_fields(server: ServerProcess) -> None:
    # Any object is allowed, so the answer may run to max_tokens: finished, it parses; cut short,
    # it is the beginning of an object. The same seed gives the same answer on one machine.
    body = {"response_format": {"type": "json_object"}, "max_tokens": 100, "temperature": 0.8, "seed": 3}
    answer = chat(server, body)["choices"][0]
    content = answer["message"]["content"]
    assert answer["finish_reason"] in {"stop", "length"}
    assert isinstance(json.loads(content) if answer["finish_reason"] == "stop" else parse_prefix(content), dict)
    assert chat(server, body)["choices"][0]["message"]["content"] == content
    # llama-server's own fields, on the legacy endpoint.
    schema = SCHEMAS["enum"]
    completion = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Favourite color:", "json_schema": schema, "max_tokens": 20, "temperature": 0},
        timeout=60,
    ).json()["choices"][0]
    jsonschema.validate(json.loads(completion["text"]), schema)
    answer = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Is the sky blue? Answer:", "grammar": 'root ::= " yes" | " no"', "max_tokens": 10},
        timeout=60,
    ).json()["choices"][0]
    assert answer["text"] in {" yes", " no"} and answer["finish_reason"] == "stop"
    body = {"response_format": {"type": "text"}, "max_tokens": 4, "temperature": 0, "logit_bias": NO_END_TOKENS}
    text = chat(server, body)
    assert text["choices"][0]["message"]["content"] and text["choices"][0]["finish_reason"] == "length"


def test_gbnf_tokens_by_id_by_text_and_negated(server: ServerProcess) -> None:
    # llama.cpp's token syntax: <[id]>, <text> (one token of the vocabulary, control tokens too)
    # and !<...> (any token but it); it was refused.
    (sky,) = httpx.post(server.url + "/tokenize", json={"content": " sky"}, timeout=30).json()["tokens"]
    grammar = f'root ::= <[{sky}]> " is" !<[{sky}]>{{2}} <|im_end|>'
    body = {"prompt": "The", "grammar": grammar, "max_tokens": 10, "logprobs": 1}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens = answer["logprobs"]["tokens"]
    # The end token after two more: "stop" well before max_tokens, whatever was sampled.
    assert answer["text"].startswith(" sky is") and answer["finish_reason"] == "stop", answer
    assert tokens[0] == " sky" and " sky" not in tokens[1:] and len(tokens) <= 6, tokens
    refused = httpx.post(server.url + "/v1/completions", json={**body, "grammar": "root ::= <sky is>"}, timeout=60)
    assert refused.status_code == 400 and "not one token" in refused.json()["error"]["message"]


def test_json_object_with_llama_servers_schema_follows_it(server: ServerProcess) -> None:
    # llama-server's form: the object's own schema beside type json_object (before: ignored).
    schema = {"type": "object", "properties": {"answer": {"const": "42"}}, "required": ["answer"]}
    body = {"response_format": {"type": "json_object", "schema": schema}, "max_tokens": 40}
    jsonschema.validate(json.loads(chat(server, body)["choices"][0]["message"]["content"]), schema)
    jsonschema.validate(json.loads(stream_chat(server, body).text), schema)
    # Any schema, as llama-server takes it, not only an object's.
    answer = chat(server, {"response_format": {"type": "json_object", "schema": {"const": "42"}}})["choices"][0]
    assert answer["message"]["content"] == '"42"'


@pytest.mark.parametrize(
    ("schema", "param"),
    [(123, "response_format.schema"), ({"type": 123}, "response_format.schema"), ([], "response_format.schema")],
    ids=["number", "bad-type", "list"],
)
def test_json_object_with_an_invalid_schema_is_a_400(server: ServerProcess, schema: Any, param: str) -> None:
    body = {"messages": ASK, "response_format": {"type": "json_object", "schema": schema}}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")


def test_a_formats_description_reaches_the_prompt(server: ServerProcess) -> None:
    # OpenAI shows the model what the format is for; it was parsed and dropped here.
    described = response_format({"type": "object", "properties": {"color": {"type": "string"}}})
    described["json_schema"]["description"] = "the color of the sky at noon on a clear day"
    plain = response_format(described["json_schema"]["schema"])

    def count(path: str, body: dict[str, Any]) -> int:
        response = httpx.post(server.url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return int(response.json()["input_tokens"])

    # A system message of the client's in both (this model's template adds one of its own when
    # there is none), to which the description is joined.
    ask = [{"role": "system", "content": "Be brief."}, *ASK]
    chat_path = "/v1/chat/completions/input_tokens"
    with_note = count(chat_path, {"messages": ask, "response_format": described})
    assert with_note > count(chat_path, {"messages": ask, "response_format": plain}) + 8
    # The same through the Responses API's text.format.
    format_ = described["json_schema"]
    text = {
        "format": {
            "type": "json_schema",
            "name": "answer",
            "schema": format_["schema"],
            "description": format_["description"],
        }
    }
    no_text = {"format": {"type": "json_schema", "name": "answer", "schema": format_["schema"]}}
    responses = "/v1/responses/input_tokens"
    assert count(responses, {"input": ask, "text": text}) > count(responses, {"input": ask, "text": no_text}) + 8
    answer = chat(server, {"response_format": described, "max_tokens": 8})
    assert answer["choices"][0]["message"]["content"].startswith("{")
    # A completion's prompt is raw text, with no system message to hold it: refused, not dropped.
    refused = httpx.post(
        server.url + "/v1/completions", json={"prompt": "Sky:", "response_format": described}, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.json_schema.description"


def test_max_tokens_first_ends_with_length_and_a_prefix(server: ServerProcess) -> None:
    # The shortest valid answer is 52 bytes, and no token that fits in one is longer than 5
    # bytes ("start"; digits are single tokens): 5 tokens cannot finish it, whatever they are.
    body = {"response_format": response_format(SCHEMAS["defs-ref"]), "max_tokens": 5, "temperature": 0}
    choice = chat(server, body)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("{")
    assert isinstance(parse_prefix(choice["message"]["content"]), dict)
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])


class Person(pydantic.BaseModel):
    """Bounded as the schemas above are: every valid answer fits MAX_TOKENS."""

    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=150)
    hobbies: list[Annotated[str, pydantic.Field(max_length=12)]] = pydantic.Field(max_length=2)


def test_openai_sdk_parse_returns_the_pydantic_object(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        completion = client.chat.completions.parse(
            model="smollm2", messages=ASK, response_format=Person, max_tokens=MAX_TOKENS, temperature=0
        )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)
    assert completion.choices[0].finish_reason == "stop"


def test_constrained_and_free_streams_in_one_batch(server: ServerProcess) -> None:
    free = {"max_tokens": 40, "temperature": 0}
    alone = chat(server, free)["choices"][0]["message"]["content"]
    results: dict[str, Any] = {}

    def run(name: str, body: dict[str, Any]) -> None:
        results[name] = chat(server, body)["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=run, args=("free", free))]
    for name in ("nested-objects", "enum", "number-bounds"):
        body = {"response_format": response_format(SCHEMAS[name]), "max_tokens": MAX_TOKENS, "temperature": 0}
        threads.append(threading.Thread(target=run, args=(name, body)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results["free"] == alone
    for name in ("nested-objects", "enum", "number-bounds"):
        jsonschema.validate(json.loads(results[name]), SCHEMAS[name])


def test_cancelled_constrained_streams_leak_nothing(server: ServerProcess) -> None:
    body = {
        "messages": ASK,
        "stream": True,
        "max_tokens": 200,
        "response_format": response_format({"type": "array", "items": {"type": "integer"}}),
        "logit_bias": {"0": -100, "2": -100},
    }
    for _ in range(3):  # left after a few pieces
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the sequences to be freed", 20)
    m = server.metrics()
    assert m["llama_trio_kv_cells_used"] == m["llama_trio_kv_cells_cached"]
    # Many short constrained requests: the process does not grow.
    small = {"messages": ASK, "max_tokens": 2, "response_format": response_format(SCHEMAS["enum"])}

    def burst(n: int) -> None:
        with httpx.Client(timeout=60) as client:
            for _ in range(n):
                assert client.post(server.url + "/v1/chat/completions", json=small).status_code == 200

    burst(60)
    before = rss(server.proc.pid)
    threads = [threading.Thread(target=burst, args=(110,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert server.metrics()["llama_trio_requests_total{endpoint=/v1/chat/completions,status=200}"] >= 500
    assert rss(server.proc.pid) - before < 32 * 1024 * 1024


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"json_schema": {"type": "bogus"}}, "json_schema", "bogus"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "if": {}}},
                }
            },
            "response_format.json_schema.schema",
            "if",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ({"grammar": "root ::= missing"}, "grammar", "missing"),
        ({"grammar": "root ::= (("}, "grammar", ""),
        ({"json_schema": {"enum": ["x" * 100] * 3000}}, "json_schema", "larger than"),
        ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar", "one output constraint"),
    ],
    ids=[
        "invalid-type",
        "unsupported-keyword",
        "no-schema",
        "unknown-rule",
        "broken-gbnf",
        "too-large",
        "two-constraints",
    ],
)
def test_bad_grammars_are_400s_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, needle: str
) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value"
    assert needle in error["message"]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


# -- forced runs (fast-forward) and schemas that leave additionalProperties out ------------------

# Nearly all forced: only the first token, the boolean and the closing brace are chosen.
CONST = SCHEMAS["const"]
FORCED_TEXT = '{"kind": "person", "ok": '


def counters(server: ServerProcess) -> tuple[float, float]:
    m = server.metrics()
    return m["llama_trio_decode_steps_total"], m["llama_trio_forced_tokens_total"]


def test_undeclared_properties_are_never_generated(server: ServerProcess) -> None:
    # As instructor's JSON_SCHEMA mode and `llm --schema` send it: no additionalProperties.
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    }
    body = {"response_format": response_format(schema), "max_tokens": 200, "temperature": 0}
    steps, forced = counters(server)
    whole = chat(server, body)
    steps, forced = counters(server)[0] - steps, counters(server)[1] - forced
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert set(json.loads(choice["message"]["content"])) == {"name", "age"}
    # The forced runs (keys, quotes, colons) took no steps of their own.
    assert forced > 0 and steps < whole["usage"]["completion_tokens"]
    streamed = stream_chat(server, body)
    assert streamed.finish_reasons == ["stop"] and streamed.text == choice["message"]["content"]
    # By construction, whatever is sampled: two bounded values, then the object must close.
    sampled = chat(server, {**body, "temperature": 1.0, "seed": 5})["choices"][0]
    assert sampled["finish_reason"] == "stop"
    assert set(json.loads(sampled["message"]["content"])) == {"name", "age"}


def test_a_stop_string_inside_a_forced_run_ends_the_answer_there(server: ServerProcess) -> None:
    body = {"response_format": response_format(CONST), "max_tokens": 50, "temperature": 0, "stop": ["person"]}
    whole = chat(server, body)["choices"][0]
    assert (whole["message"]["content"], whole["finish_reason"]) == ('{"kind": "', "stop")
    streamed = stream_chat(server, body)
    assert (streamed.text, streamed.finish_reasons) == ('{"kind": "', ["stop"])


@pytest.mark.parametrize("limit", [2, 3, 5])
def test_max_tokens_inside_a_forced_run_gives_length_with_that_many_tokens(server: ServerProcess, limit: int) -> None:
    body = {"response_format": response_format(CONST), "max_tokens": limit, "temperature": 0}
    whole = chat(server, body)
    content = whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == limit
    assert FORCED_TEXT.startswith(content) and content
    streamed = stream_chat(server, {**body, "stream_options": {"include_usage": True}})
    assert streamed.finish_reasons == ["length"] and streamed.text == content
    assert streamed.chunks[-1]["usage"]["completion_tokens"] == limit


def test_logprobs_cover_forced_tokens_streamed_and_not(server: ServerProcess) -> None:
    body = {"response_format": response_format(CONST), "max_tokens": 50, "temperature": 0}
    body.update(logprobs=True, top_logprobs=2)
    whole = chat(server, body)
    choice = whole["choices"][0]
    entries = choice["logprobs"]["content"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"].startswith(FORCED_TEXT)
    assert len(entries) == whole["usage"]["completion_tokens"]
    assert "".join(entry["token"] for entry in entries) == choice["message"]["content"]
    assert all(-9999 < entry["logprob"] <= 0 for entry in entries)
    streamed = stream_chat(server, body)
    tokens = [(e["token"], e["logprob"]) for c in streamed.chunks if c["choices"] for e in chunk_logprobs(c)]
    assert tokens == [(entry["token"], entry["logprob"]) for entry in entries]


def chunk_logprobs(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    logprobs = chunk["choices"][0].get("logprobs")
    return (logprobs or {}).get("content") or []


# -- bounds: what once crashed the server is a 400, what is just within them works -----------------

TOOL = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object", "properties": {}}}}


def _tools(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"tools": [TOOL, {"type": "function", "function": {"name": "deep", "parameters": parameters}}]}


# The issue's sizes, each of which took the whole process down in llguidance's compiler.
CRASHED = {
    "gbnf-4000-rules": ({"grammar": gbnf_chain(4002)}, "grammar", "rules"),
    "ref-3000": ({"response_format": response_format(ref_chain(3000))}, SCHEMA_PARAM, "levels deep"),
    "properties-1000": ({"response_format": response_format(properties_chain(1000))}, SCHEMA_PARAM, "levels deep"),
    "anyOf-2000": ({"response_format": response_format(any_of_chain(2000))}, SCHEMA_PARAM, "levels deep"),
    "json_schema-ref-3000": ({"json_schema": ref_chain(3000)}, "json_schema", "levels deep"),
    "tools-anyOf-2000": (_tools(any_of_chain(2000)), "tools[1].function.parameters", "levels deep"),
    "tools-properties-1000": (_tools(properties_chain(1000)), "tools[1].function.parameters", "levels deep"),
    # With an $id, the chain's references resolve inside the tools' answer schema too.
    "tools-$id-ref-3000": (_tools({"$id": "urn:deep", **ref_chain(3000)}), "tools[1].function.parameters", "deep"),
    "optional-8000": ({"response_format": response_format(optional_properties(8000))}, SCHEMA_PARAM, "properties"),
}


@pytest.mark.parametrize("name", list(CRASHED))
def test_what_crashed_the_server_is_a_400_naming_the_field(server: ServerProcess, name: str) -> None:
    body, param, needle = CRASHED[name]
    assert len(json.dumps(body)) < 256 * 1024
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "invalid_value")
    assert needle in error["message"] and "more than" in error["message"], error
    # The server is still there, and answers the next request.
    assert chat(server, {"max_tokens": 2})["choices"][0]["finish_reason"] == "length"


def test_grammars_just_within_the_bounds_work_and_just_past_are_refused(server: ServerProcess) -> None:
    depth = limits.MAX_SCHEMA_DEPTH
    within: list[dict[str, Any]] = [
        {"response_format": response_format(ref_chain(depth - 2))},
        {"response_format": response_format(properties_chain(depth // 2 - 1))},
        {"response_format": response_format(any_of_chain(depth // 2 - 1))},
    ]
    for body in within:
        answer = chat(server, {**body, "max_tokens": 6, "temperature": 0})["choices"][0]
        assert answer["finish_reason"] in {"stop", "length", "tool_calls"}
    rules = chat(server, {"grammar": gbnf_chain(limits.MAX_GRAMMAR_RULES), "max_tokens": 6})["choices"][0]
    assert (rules["message"]["content"], rules["finish_reason"]) == ("x", "stop")
    past = [
        ({"response_format": response_format(ref_chain(depth - 1))}, SCHEMA_PARAM),
        ({"response_format": response_format(properties_chain(depth // 2))}, SCHEMA_PARAM),
        ({"grammar": gbnf_chain(limits.MAX_GRAMMAR_RULES + 1)}, "grammar"),
        (_tools({"$id": "urn:past", **properties_chain(depth // 2 - 3)}), "tools"),  # 2 past, with the 5
        (_tools({"$id": "urn:past", **properties_chain(depth // 2)}), "tools[1].function.parameters"),
    ]
    for body, param in past:
        response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=120)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
