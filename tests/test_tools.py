"""Tool calls: the pure answer parser, then the whole path through a real server with the
``openai`` SDK (the default model's template knows no tools: the generic scheme).

What the model chooses differs between CPUs where two tokens nearly tie, so an answer is either
bounded by construction or checked for what holds whatever was chosen. The tools' parameters
are bounded (a city of at most 30 characters, a unit from a list, integers in a range), so an
answer of one call (``parallel_tool_calls`` false, or a named tool) fits ``ONE_CALL_TOKENS``
and ends with ``tool_calls``. An answer that may go on (text, or several calls) may be cut by
``max_tokens``: then its last call's arguments need only be the beginning of a JSON object.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

import ffi
from server.api import tool_grammar, tools
from tests.support.jsonprefix import parse_prefix
from tests.support.process import NO_END_TOKENS, ServerProcess
from tests.support.waiting import wait_for

# -- the answer parser, without a model ---------------------------------------------------------


def events_of(pieces: list[str]) -> tuple[str, list[tuple[str, str]], int]:
    parser = tools.AnswerParser()
    content, names, arguments = [], [], []
    for piece in pieces:
        for event in parser.feed(piece):
            if isinstance(event, tools.Content):
                content.append(event.text)
            elif isinstance(event, tools.CallStart):
                assert event.index == len(names)
                names.append(event.name)
                arguments.append("")
            else:
                arguments[event.index] += event.fragment
    return "".join(content), list(zip(names, arguments, strict=True)), parser.calls


CALLS = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris \\"}{[", "n": [1, {"x": 2}]}}, {"name": "add", "arguments": {}}]}'
RESPONSE = '{"response": "caf\\u00e9 \\ud83d\\ude00 \\"quoted\\"\\n\\\\ done"}'


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_answer_parser_reads_calls_in_any_pieces(size: int) -> None:
    pieces = [CALLS[i : i + size] for i in range(0, len(CALLS), size)]
    content, calls, count = events_of(pieces)
    assert content == "" and count == 2
    assert calls == [("get_weather", '{"city": "Paris \\"}{[", "n": [1, {"x": 2}]}'), ("add", "{}")]
    assert json.loads(calls[0][1]) == {"city": 'Paris "}{[', "n": [1, {"x": 2}]}


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_answer_parser_decodes_the_response_in_any_pieces(size: int) -> None:
    pieces = [RESPONSE[i : i + size] for i in range(0, len(RESPONSE), size)]
    content, calls, _ = events_of(pieces)
    assert content == json.loads(RESPONSE)["response"] and calls == []


def test_answer_parser_on_an_answer_cut_short() -> None:
    content, calls, count = events_of([CALLS[: CALLS.index("Paris") + 3]])
    assert content == ""
    assert calls == [("get_weather", '{"city": "Par')] and count == 0
    assert events_of(['{"response": "half \\u00'])[0] == "half "


def test_output_schema_follows_tool_choice() -> None:
    specs = [tool_grammar.ToolSpec("a", "", {"type": "object"}), tool_grammar.ToolSpec("b", "", {"type": "object"})]
    either = tool_grammar.output_schema(specs, calls_only=False, parallel=True)
    calls_answer = either["anyOf"][1]
    assert "maxItems" not in calls_answer["properties"]["tool_calls"]
    one = tool_grammar.output_schema(specs[:1], calls_only=True, parallel=False)
    assert one["properties"]["tool_calls"]["maxItems"] == 1
    jsonschema.validate({"tool_calls": [{"name": "a", "arguments": {}}]}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "hi"}, one)


# A tool's parameters as Pydantic writes a nested model: references into its own $defs.
UNITS = {
    "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}, "Place": {"$ref": "#/$defs/City"}, "City": {"type": "string", "maxLength": 12}},
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}, "echo": {"const": {"$ref": "#/x"}}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}  # fmt: skip
# One that refers to its whole self: a tree of names.
TREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["name"],
}


def test_a_tools_references_mean_its_own_parts_in_the_answer() -> None:
    specs = [
        tool_grammar.ToolSpec("plain", "", {"type": "object"}),
        tool_grammar.ToolSpec("units", "", UNITS),
        tool_grammar.ToolSpec("tree", "", TREE),
    ]
    answer = tool_grammar.output_schema(specs, calls_only=True, parallel=True)

    def call(name: str, arguments: Any) -> dict[str, Any]:
        return {"tool_calls": [{"name": name, "arguments": arguments}]}

    jsonschema.validate(call("units", {"city": "Paris", "unit": "c", "echo": {"$ref": "#/x"}}), answer)
    for bad in (
        {"city": "Paris", "unit": "k"},
        {"city": "P" * 13, "unit": "c"},
        {"city": "Paris", "unit": "c", "echo": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call("units", bad), answer)
    jsonschema.validate(call("tree", {"name": "a", "children": [{"name": "b", "children": []}]}), answer)
    with pytest.raises(jsonschema.ValidationError):  # a child is a tree, not the answer
        jsonschema.validate(call("tree", {"name": "a", "children": [call("plain", {})]}), answer)
    jsonschema.validate(call("plain", {"x": 1}), answer)
    # the native grammar's call schema is one document too
    native = tool_grammar.native_grammar(specs, calls_only=True, parallel=False)
    assert '"#/$defs/llama_trio_tool_1/$defs/Unit"' in native


# -- through the server ---------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Each tool's longest arguments: every string character at its longest (a \uXXXX escape, as
# json.dumps writes "é"), the longest unit, the longest integers.
LONGEST_ARGUMENTS = {"get_weather": {"city": "é" * 30, "unit": "fahrenheit"}, "add": {"a": -1000, "b": -1000}}
# The longest call's JSON text (in the answer's own spacing), and the longest answer of one
# call; every token is at least one byte.
CALL_BYTES = max(len(json.dumps({"name": name, "arguments": args})) for name, args in LONGEST_ARGUMENTS.items())
ONE_CALL_TOKENS = len(json.dumps({"tool_calls": []})) + CALL_BYTES


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        yield client


def test_the_longest_arguments_follow_the_parameters() -> None:
    for name, arguments in LONGEST_ARGUMENTS.items():
        jsonschema.validate(arguments, SCHEMAS[name])
    assert json.dumps(LONGEST_ARGUMENTS["get_weather"]).count("\\u00e9") == 30


def check_calls(choice: Any, allowed: set[str]) -> list[Any]:
    """The calls of an answer (a choice), checked: each names an allowed tool, with arguments
    that follow its parameters; but in an answer cut by max_tokens, the last call's arguments
    need only be the beginning of a JSON object (where the cut falls depends on what was
    sampled)."""
    calls = choice.message.tool_calls or []
    for i, call in enumerate(calls):
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        if choice.finish_reason == "length" and i == len(calls) - 1:
            assert isinstance(parse_prefix(call.function.arguments or "{"), dict), call.function.arguments
        else:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if calls:
        assert choice.finish_reason in {"tool_calls", "length"}
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["auto", "required", "named", "none"])
def test_each_tool_choice(sdk: openai.OpenAI, choice: str, stream: bool) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "add"}} if choice == "named" else choice
    kwargs: dict[str, Any] = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
    # One call at most: calls only (required, named) fit ONE_CALL_TOKENS. Text (auto, none) may
    # run to max_tokens; without a tool (none) it does (the end tokens are banned).
    kwargs.update(temperature=0, parallel_tool_calls=False)
    kwargs["max_tokens"] = ONE_CALL_TOKENS if choice in {"required", "named"} else 60
    if choice == "none":
        kwargs["logit_bias"] = NO_END_TOKENS
    if stream and choice in {"required", "named"}:
        with sdk.chat.completions.stream(**kwargs) as events:  # the SDK's own reassembly
            choice_ = events.get_final_completion().choices[0]
    elif stream:  # (the SDK's helper refuses an answer cut by max_tokens, which text may be)
        choice_ = reassembled(sdk.chat.completions.create(**kwargs, stream=True))
    else:
        choice_ = sdk.chat.completions.create(**kwargs).choices[0]
    if choice == "none":
        assert not choice_.message.tool_calls and choice_.message.content
        assert choice_.finish_reason == "length"
        return
    allowed = {"add"} if choice == "named" else {"get_weather", "add"}
    calls = check_calls(choice_, allowed)
    if choice in {"required", "named"}:
        assert len(calls) == 1 and choice_.finish_reason == "tool_calls"
    elif not calls:  # auto, answered in text: cut by max_tokens, the text is long; finished, any
        assert choice_.finish_reason in {"stop", "length"}
        assert choice_.message.content or choice_.finish_reason == "stop"
    else:  # auto, one call
        assert len(calls) == 1


def reassembled(chunks: Any) -> Any:
    """A streamed answer put together by hand: its content, calls and finish reason."""
    content, calls, finish = [], {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    tool_calls = [
        openai.types.chat.ChatCompletionMessageToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]}
        )
        for c in calls.values()
    ]
    message = openai.types.chat.ChatCompletionMessage(
        role="assistant", content="".join(content) or None, tool_calls=tool_calls or None
    )
    return openai.types.chat.chat_completion.Choice(index=0, message=message, finish_reason=finish)


def test_streamed_deltas_reassemble_into_the_whole_message(sdk: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    kwargs.update(temperature=0, max_tokens=ONE_CALL_TOKENS, parallel_tool_calls=False)
    whole = sdk.chat.completions.create(**kwargs).choices[0]
    with sdk.chat.completions.stream(**kwargs) as events:
        streamed = events.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
    ]
    # And in OpenAI's exact delta shape: the first delta of a call has its id, type and name.
    raw = sdk.chat.completions.create(**kwargs, stream=True)
    deltas = [c.choices[0].delta.tool_calls for c in raw if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0][0]
    assert first.id and first.type == "function" and first.function.name and first.function.arguments == ""
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])


def test_parallel_calls_only_when_allowed(sdk: openai.OpenAI, model: ffi.Model) -> None:
    """With the tokens that close the list of calls banned, the answer can only go on: with
    parallel calls allowed it runs to max_tokens, a second call begun well before (the first
    call and the second's name fit in them, whatever the city); without, the grammar closes
    the list after one call all the same."""
    ask = [{"role": "user", "content": "Call get_weather for Paris and then for Rome, in one answer."}]
    weather = {**WEATHER, "function": {**WEATHER["function"], "parameters": SHORT_CITY}}
    longest_call = json.dumps({"name": "get_weather", "arguments": {"city": "é" * 8, "unit": "fahrenheit"}})
    second_named = ', {"name": "get_weather", "arguments": '
    max_tokens = len('{"tool_calls": [') + len(longest_call) + len(second_named)
    kwargs: dict[str, Any] = {"model": "m", "messages": ask, "tools": [weather], "tool_choice": "required"}
    kwargs.update(temperature=0, max_tokens=max_tokens)
    kwargs["logit_bias"] = {str(t): -100 for t in closing_tokens(model.vocab)}
    answer = sdk.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "length"
    assert len(check_calls(answer, {"get_weather"})) >= 2
    single = sdk.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert len(check_calls(single, {"get_weather"})) == 1
    assert single.finish_reason == "tool_calls"


SHORT_CITY = {
    **WEATHER["function"]["parameters"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
}


def closing_tokens(vocab: ffi.Vocab) -> list[int]:
    """Tokens that would close the list of calls right after the first one ("}]" and kin), so
    that the model goes on to a second call where the grammar lets it."""
    closing = [t for t in range(vocab.n_tokens) if vocab.piece(t).lstrip(b"}").startswith(b"]")]
    assert len(closing) <= 300
    return closing


def test_round_trip_with_the_tool_result(sdk: openai.OpenAI) -> None:
    messages: list[Any] = list(ASK)
    first = sdk.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=ONE_CALL_TOKENS,
    ).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]  # type: ignore[index]
    arguments = json.loads(call.function.arguments)
    result = {"city": arguments.get("city", "?"), "temperature": 18, "unit": arguments.get("unit", "celsius")}
    messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    final = sdk.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=40,
        logit_bias=NO_END_TOKENS,
    ).choices[0]
    assert final.message.content and not final.message.tool_calls


def test_a_call_is_written_in_forced_runs(server: ServerProcess) -> None:
    # `{"tool_calls": [{"name": "add", "arguments": {"a": ` is forced: no step of its own.
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    before = server.metrics()
    answer = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 60}, timeout=120).json()
    after = server.metrics()
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    steps = after["llama_trio_decode_steps_total"] - before["llama_trio_decode_steps_total"]
    forced = after["llama_trio_forced_tokens_total"] - before["llama_trio_forced_tokens_total"]
    assert forced >= 10 and steps <= answer["usage"]["completion_tokens"] - forced


def test_cancelling_mid_call_frees_everything(server: ServerProcess) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "stream": True, "max_tokens": 60}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if '"arguments":"{' in line.replace(" ", ""):
                break  # the call has started: leave
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the sequence to be freed", 20)
    m = server.metrics()
    assert m["llama_trio_kv_cells_used"] == m["llama_trio_kv_cells_cached"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_whose_parameters_refer_to_their_own_parts(sdk: openai.OpenAI, stream: bool) -> None:
    # Refused before ("Pointer '/$defs/Unit' does not exist"): the references were read in the
    # answer's schema.
    units = {"type": "function", "function": {"name": "weather", "parameters": UNITS}}
    kwargs: dict[str, Any] = {
        "model": "x",
        "messages": ASK,
        "tools": [units],
        "tool_choice": "required",
        "max_tokens": 200,
        "parallel_tool_calls": False,  # one call: its end is the answer's end
    }
    if stream:
        chunks = list(sdk.chat.completions.create(**kwargs, stream=True))
        arguments = "".join(
            call.function.arguments or "" for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()
        )
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        choice = sdk.chat.completions.create(**kwargs).choices[0]
        assert choice.message.tool_calls
        arguments, finish = choice.message.tool_calls[0].function.arguments, choice.finish_reason
    assert finish == "tool_calls", arguments
    jsonschema.validate(json.loads(arguments), UNITS)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {"type": "bogus"}}}]},
            "tools[1].function.parameters",
        ),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
        ({"messages": [*ASK, {"role": "tool", "content": "18 degrees"}]}, "messages[1].tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        # arguments are an object: a scalar's came out as broken JSON
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]},
         "tools[1].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "i", "parameters": {"type": ["object", "null"]}}}]},
         "tools[0].function.parameters"),
    ],
    ids=["unknown-choice", "choice-without-tools", "duplicate-name", "bad-parameters", "two-constraints",
         "tool-without-id", "bad-name", "scalar-parameters", "nullable-parameters"],
)  # fmt: skip
def test_malformed_tool_requests_are_400s(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
