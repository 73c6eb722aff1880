"""llama.cpp's native routes under generated bodies (hypothesis): every answer is a 2xx in the
native shape or a 4xx in llama-server's error shape, never a 5xx, and the engine is back to idle
afterwards. The value generators are ``test_fuzz``'s."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.process import ServerProcess, serving
from tests.test_fuzz import hostile, numbers, texts

pytestmark = pytest.mark.server

MAX_TOKENS_CEILING = 4
MAX_EXAMPLES = 80  # per route; each may decode a few tokens
NATIVE_FIELDS = [
    "n_predict",
    "stream",
    "n_probs",
    "return_tokens",
    "timings_per_token",
    "response_fields",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "logit_bias",
    "ignore_eos",
    "stop",
    "n",
    "json_schema",
    "grammar",
    "samplers",
    "mirostat",
    "mirostat_tau",
    "typical_p",
    "dry_multiplier",
    "id_slot",
    "cache_prompt",
    "min_keep",
    "repeat_last_n",
    "repeat_penalty",
]
token_ids = st.one_of(st.integers(-5, 60_000), st.integers(-5, 3), st.sampled_from([49151, 49152, 2**31, -(2**31)]))
prompts = st.one_of(
    texts,
    st.lists(st.integers(-3, 3), min_size=1, max_size=3),
    st.lists(token_ids, min_size=1, max_size=8),
    st.lists(st.one_of(token_ids, texts), min_size=1, max_size=5),
    st.lists(st.one_of(texts, st.lists(token_ids, max_size=4)), max_size=3),
    st.fixed_dictionaries({"prompt_string": texts}),
    hostile,
)
plausible: dict[str, st.SearchStrategy[Any]] = {
    "n_predict": st.integers(-2, 8),
    "stream": st.booleans(),
    "n_probs": st.integers(-1, 25),
    "logit_bias": st.one_of(
        st.lists(st.tuples(st.one_of(token_ids, texts), st.one_of(numbers, st.just(False))).map(list), max_size=3),
        st.dictionaries(st.one_of(texts, token_ids.map(str)), st.one_of(numbers, st.just(False)), max_size=3),
    ),
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "response_fields": st.lists(st.sampled_from(["content", "timings/prompt_n", "x/y", "stop_type"]), max_size=3),
    "samplers": st.one_of(st.just("edskypmxt"), st.lists(st.sampled_from(["top_k", "top_p", "temperature"]))),
    "grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= ", "not a grammar"]),
    "json_schema": st.sampled_from([{}, {"type": "integer"}, {"type": "nope"}]),
}


@st.composite
def native_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        body["prompt"] = draw(prompts)
    for name in draw(st.lists(st.sampled_from(NATIVE_FIELDS), unique=True, max_size=5)):
        strategy = plausible.get(name)
        body[name] = draw(strategy if strategy is not None and draw(st.booleans()) else st.one_of(numbers, hostile))
    return body


JSON = {"content-type": "application/json"}


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()  # lone surrogates as \u escapes, as a client may send them


def check(response: httpx.Response, stream: bool) -> None:
    # 501: what this server does not do (infill without FIM tokens, slot files), said as such
    assert response.status_code < 500 or response.status_code == 501, response.text[:500]
    if response.status_code >= 300:
        error = response.json()["error"]
        assert error["code"] == response.status_code and isinstance(error["message"], str) and error["type"]
        return
    if not stream:
        answers = response.json()
        for answer in answers if isinstance(answers, list) else [answers]:
            assert isinstance(answer, dict)
        return
    objects = [json.loads(event[6:]) for event in response.content.split(b"\n\n") if event.startswith(b"data: ")]
    assert objects and ("error" in objects[-1] or objects[-1]["stop"] is True), response.content[-300:]


@pytest.fixture(scope="module")
def native_fuzz_server():
    args = ["--parallel", "4", "--ctx-size", "2048", "--threads", "1", "--max-tokens", str(MAX_TOKENS_CEILING)]
    with serving(args) as proc:
        yield proc


def test_completion_survives_any_body(native_fuzz_server: ServerProcess) -> None:
    with httpx.Client(base_url=native_fuzz_server.url, timeout=60) as client:

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None)
        @given(native_bodies())
        def post(body: dict[str, Any]) -> None:
            stream = body.get("stream") is True
            check(client.post("/completion", content=encode(body), headers=JSON), stream)

        post()
    deadline = time.monotonic() + 30
    while native_fuzz_server.metrics()["llama_trio_active_sequences"] != 0:
        assert time.monotonic() < deadline, "a sequence stayed busy"
        time.sleep(0.05)
    assert httpx.get(native_fuzz_server.url + "/health").status_code == 200


@settings(
    max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(
    st.sampled_from(["/tokenize", "/detokenize", "/infill", "/apply-template", "/slots/0?action=save"]),
    st.dictionaries(
        st.sampled_from(["content", "tokens", "with_pieces", "add_special", "input_prefix", "input_extra", "messages"]),
        hostile,
        max_size=3,
    ),
)
def test_other_routes_survive_any_body(native_fuzz_server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    check(httpx.post(native_fuzz_server.url + path, content=encode(body), headers=JSON, timeout=60), stream=False)
