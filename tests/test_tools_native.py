"""Tool calls on a template that knows tools (Hermes/Qwen style): the default model with its
chat template rewritten in the GGUF file itself (the ``gguf`` package), and the same template
given with ``--chat-template-file``. The model answers in the template's own syntax, each
call's JSON constrained by its tool's parameters, and the server turns it into ``tool_calls``.

As in ``test_tools``: an answer of one call is bounded (``ONE_CALL_TOKENS``) and ends with
``tool_calls``; one that may go on is checked for what holds wherever ``max_tokens`` cuts it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server.api.tools import NATIVE_CLOSE, NATIVE_OPEN
from server.model_files import default_model_path
from tests.support.process import NO_END_TOKENS, ServerProcess
from tests.test_tools import ASK, CALL_BYTES, SCHEMAS, TOOLS, UNITS, check_calls, reassembled

pytestmark = pytest.mark.server

# The longest answer of one call in the template's syntax; every token is at least one byte.
ONE_CALL_TOKENS = len(NATIVE_OPEN) + CALL_BYTES + len(NATIVE_CLOSE)

TEMPLATE = pathlib.Path(__file__).parent / "data" / "hermes_tools.jinja"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The default GGUF with its tokenizer.chat_template replaced by the tool-aware one."""
    out = tmp_path_factory.mktemp("gguf") / "smollm2-tools.gguf"
    command = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file", str(TEMPLATE)]
    subprocess.run([*command, str(default_model_path()), str(out)], check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module", params=["rewritten-gguf", "template-file"])
def sdk(request: pytest.FixtureRequest, tool_model: pathlib.Path) -> Iterator[openai.OpenAI]:
    if request.param == "rewritten-gguf":
        args = ["--model", str(tool_model)]
    else:
        args = ["--chat-template-file", str(TEMPLATE)]
    with ServerProcess([*args, "--parallel", "2", "--ctx-size", "4096", "--threads", "2"]) as proc:
        proc.wait_ready()
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0) as client:
            yield client
        assert proc.stop() == 0
    assert "Traceback" not in proc.log, proc.log[-5000:]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_native_calls_are_parsed_from_the_models_own_syntax(sdk: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    kwargs.update(temperature=0, max_tokens=ONE_CALL_TOKENS, parallel_tool_calls=False)
    if stream:
        choice = reassembled(sdk.chat.completions.create(**kwargs, stream=True))
    else:
        choice = sdk.chat.completions.create(**kwargs).choices[0]
    calls = check_calls(choice, {"get_weather", "add"})
    assert len(calls) == 1 and choice.finish_reason == "tool_calls"


def test_native_calls_are_written_in_forced_runs(sdk: openai.OpenAI) -> None:
    # `<tool_call>\n{"name": "add", "arguments": {"a": ` is forced: no step of its own.
    base = str(sdk.base_url).removesuffix("/").removesuffix("/v1")
    tool_choice: Any = {"type": "function", "function": {"name": "add"}}
    before = counters(base)
    completion = sdk.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=80
    )
    steps, forced = (after - first for after, first in zip(counters(base), before, strict=True))
    assert completion.choices[0].finish_reason == "tool_calls" and completion.usage is not None
    assert forced >= 10 and steps <= completion.usage.completion_tokens - forced


def counters(base: str) -> tuple[float, float]:
    """(decode steps, forced tokens) from the server's /metrics."""
    values = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return float(values["llama_trio_decode_steps_total"]), float(values["llama_trio_forced_tokens_total"])


def test_native_named_choice_and_round_trip(sdk: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    first = sdk.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=ONE_CALL_TOKENS
    ).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = check_calls(first, {"add"})
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS["add"])
    messages: list[Any] = [*ASK, first.message.model_dump(exclude_none=True)]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
    final = sdk.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=30,
        logit_bias=NO_END_TOKENS,
    ).choices[0]
    assert final.message.content and not final.message.tool_calls


def test_native_auto_answers_in_text_or_calls(sdk: openai.OpenAI) -> None:
    choice = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60).choices[0]
    calls = check_calls(choice, {"get_weather", "add"})
    if not calls:  # text: cut by max_tokens, it is long; finished, any (but never a call's markup)
        assert choice.finish_reason in {"stop", "length"}
        assert choice.message.content or choice.finish_reason == "stop"
        assert "<tool_call>" not in (choice.message.content or "")


def test_native_calls_of_a_tool_that_refers_to_its_own_parts(sdk: openai.OpenAI) -> None:
    units = {"type": "function", "function": {"name": "weather", "parameters": UNITS}}
    choice = sdk.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[units],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), UNITS)
