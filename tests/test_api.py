"""The OpenAI-compatible API through a real server process and real clients."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.support import sse
from tests.support.process import NO_END_TOKENS, ServerProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

CHAT = [{"role": "user", "content": "Name three colors."}]


def client(server: ServerProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def sdk(server: ServerProcess):
    with client(server) as c:
        yield c


# -- the openai SDK ----------------------------------------------------------------------------


def test_sdk_chat_non_streamed(sdk: openai.OpenAI) -> None:
    # The end tokens banned: whatever the model picks, the answer runs to max_tokens.
    result = sdk.chat.completions.create(
        model="anything", messages=CHAT, max_tokens=12, temperature=0, logit_bias=NO_END_TOKENS
    )
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    assert result.model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_sdk_chat_streamed_with_usage(sdk: openai.OpenAI) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model="gpt-4o",
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in {"stop", "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens <= 16
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    non_streamed = sdk.chat.completions.create(model="x", messages=CHAT, max_tokens=16, temperature=0)
    assert text == non_streamed.choices[0].message.content


def test_sdk_completion_streamed(sdk: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "x", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    kwargs["logit_bias"] = NO_END_TOKENS
    chunks = list(sdk.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = sdk.completions.create(**kwargs, logprobs=2)
    assert whole.choices[0].text == text
    assert whole.object == "text_completion"
    # The model works: " Paris" is its first token with a probability over one half (about
    # 0.78), so the greedy choice on any CPU, where rounding moves it by far less.
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.tokens[0] == " Paris" and logprobs.token_logprobs[0] > math.log(0.5)


def _access_lines(server: ServerProcess, path: str) -> list[str]:
    return [line for line in server.log.splitlines() if "llama_trio.access" in line and f"POST {path} " in line]


@pytest.mark.parametrize("stream", [True, False])
def test_the_access_line_counts_every_choice(sdk: openai.OpenAI, server: ServerProcess, stream: bool) -> None:
    before = len(_access_lines(server, "/v1/chat/completions"))
    kwargs: dict[str, Any] = {"model": "x", "messages": CHAT, "max_tokens": 9, "n": 3, "temperature": 1.0}
    if stream:
        chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = sdk.chat.completions.create(**kwargs).usage
    assert usage is not None and usage.completion_tokens > 3  # three choices, at least two tokens each
    wait_for(lambda: len(_access_lines(server, "/v1/chat/completions")) > before, "the access line", 10)
    line = _access_lines(server, "/v1/chat/completions")[before]
    assert f" prompt={usage.prompt_tokens} completion={usage.completion_tokens} " in line, line


def test_sdk_models_list(sdk: openai.OpenAI) -> None:
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    # The retrieve call (it was a 404 "no route"); one model answers any name, as requests do.
    card = sdk.models.retrieve("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert card.id == "SmolLM2-135M-Instruct.Q4_1.gguf" and card.object == "model"


def test_stop_sequences_and_seed(sdk: openai.OpenAI) -> None:
    c = sdk
    kwargs: dict[str, Any] = {"model": "x", "prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0}
    kwargs["logit_bias"] = NO_END_TOKENS
    full = c.completions.create(**kwargs).choices[0].text
    # A stop string taken from the answer itself (whatever this CPU's greedy answer is): two
    # characters from its middle; the answer is cut where they first occur.
    middle = len(full) // 2
    stop = full[middle : middle + 2]
    assert len(stop) == 2, full
    cut = c.completions.create(**kwargs, stop=[stop, "zz"])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a = c.completions.create(model="x", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    b = c.completions.create(model="x", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    assert a.choices[0].text == b.choices[0].text


def test_content_as_text_parts(sdk: openai.OpenAI) -> None:
    # Parts are joined with a newline, as llama-server and vLLM join them.
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book?"}]
    a = sdk.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        max_tokens=8,
        temperature=0,
    )
    joined = [{"role": "user", "content": "What is\nthe best book?"}]
    b = sdk.chat.completions.create(model="x", messages=joined, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage is not None and b.usage is not None and a.usage.prompt_tokens == b.usage.prompt_tokens


# -- the wire format ---------------------------------------------------------------------------


def test_raw_sse_stream(server: ServerProcess) -> None:
    body = {"messages": CHAT, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        raw = response.read()
    stream = sse.parse(raw, comments=False)
    assert stream.events[-1] == b"data: [DONE]"
    payloads = stream.chunks
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert len({(p["id"], p["created"], p["model"]) for p in payloads}) == 1
    finishes = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and finishes[0]["choices"][0]["delta"] == {}
    assert payloads[-1]["choices"] == []
    assert set(payloads[-1]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    assert payloads[-2] is finishes[0]
    assert all("usage" in p and p["usage"] is None for p in payloads[:-1])  # OpenAI's null before the last


def test_raw_sse_without_usage_and_completion_shape(server: ServerProcess) -> None:
    # Sampled (temperature 1): the end tokens are banned, or a draw of one would end it early.
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "logit_bias": NO_END_TOKENS}
    raw = httpx.post(server.url + "/v1/completions", json=body, timeout=120).content
    stream = sse.parse(raw, comments=False)
    assert stream.events[-1] == b"data: [DONE]"
    payloads = stream.chunks
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


# -- cancellation through the HTTP layer ---------------------------------------------------------


def test_disconnect_mid_stream_stops_decoding(server: ServerProcess) -> None:
    before = server.metrics()
    body = {"messages": CHAT, "max_tokens": 1000, "stream": True, "temperature": 0.7, "logit_bias": NO_END_TOKENS}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                got += 1
                if got == 5:
                    break
    # the connection is closed here
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the cancelled stream to end", 20)
    after = server.metrics()
    assert (
        after["llama_trio_cancellations_total{phase=generate}"]
        == before["llama_trio_cancellations_total{phase=generate}"] + 1
    )
    generated = after["llama_trio_tokens_total{kind=generated}"] - before["llama_trio_tokens_total{kind=generated}"]
    assert generated < 60, "decoding went on after the client left"
    time.sleep(0.3)
    assert (
        server.metrics()["llama_trio_tokens_total{kind=generated}"] == after["llama_trio_tokens_total{kind=generated}"]
    )
    assert after["llama_trio_kv_cells_used"] == after["llama_trio_kv_cells_cached"]


def test_disconnect_while_queued_never_decodes() -> None:
    with ServerProcess(["--parallel", "1", "--ctx-size", "2048"]) as server:
        server.wait_ready()
        long_body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 150, "temperature": 0, "logit_bias": NO_END_TOKENS}
        result: dict[str, object] = {}

        def run_long() -> None:
            result["response"] = httpx.post(server.url + "/v1/completions", json=long_body, timeout=120).json()

        runner = threading.Thread(target=run_long)
        runner.start()
        wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 1, "the long request to start", 20)
        queued = {"prompt": "A completely different prompt", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=queued, timeout=120) as response:
            assert response.status_code == 200
            wait_for(lambda: server.metrics()["llama_trio_queue_depth"] == 1, "the stream to be queued", 20)
        runner.join(120)  # the request's own timeout: 150 tokens on a busy machine
        assert not runner.is_alive()
        wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the engine to be idle", 20)
        m = server.metrics()
        assert m["llama_trio_cancellations_total{phase=queued}"] == 1
        usage = result["response"]["usage"]  # type: ignore[index]
        assert m["llama_trio_tokens_total{kind=prompt}"] == usage["prompt_tokens"]
        assert m["llama_trio_tokens_total{kind=generated}"] == usage["completion_tokens"]
        assert server.stop() == 0


# -- errors --------------------------------------------------------------------------------------


def post(server: ServerProcess, path: str, body: object, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    # A context overflow also says by how much, as llama-server does.
    extra = {"n_prompt_tokens", "n_ctx"} if code == "context_length_exceeded" else set()
    assert set(error) == {"message", "type", "param", "code"} | extra
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": CHAT, "temperature": "hot"}, "temperature"),
        ({"messages": CHAT, "temperature": 3}, "temperature"),
        ({"messages": CHAT, "max_tokens": -1}, "max_tokens"),
        ({"messages": CHAT, "max_tokens": "10"}, "max_tokens"),
        ({"messages": CHAT, "top_p": 1.5}, "top_p"),
        ({"messages": CHAT, "n": 5}, "n"),  # above --parallel 4
        ({"messages": CHAT, "stop": ["a"] * 17}, "stop"),
        ({"messages": CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": CHAT, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"messages": CHAT, "stream": "yes"}, "stream"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_bad_chat_requests(server: ServerProcess, body: dict, param: str) -> None:
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


def test_invalid_json(server: ServerProcess) -> None:
    assert_error(post(server, "/v1/chat/completions", b"{not json"), 400, code="invalid_json")
    assert_error(post(server, "/v1/completions", b"[1, 2]"), 400, code="invalid_json")
    assert_error(post(server, "/v1/completions", b"[" * 100_000), 400, code="invalid_json")
    assert_error(post(server, "/v1/completions", b'{"prompt": NaN}'), 400, param="prompt")


def test_context_length_exceeded(server: ServerProcess) -> None:
    prompt = "hello " * 5000  # a sequence here holds 1024 tokens
    error = assert_error(post(server, "/v1/completions", {"prompt": prompt}), 400, code="context_length_exceeded")
    assert error["param"] == "prompt"
    assert error["n_ctx"] == 1024 and error["n_prompt_tokens"] > 1024
    streamed = post(server, "/v1/completions", {"prompt": prompt, "stream": True})
    assert_error(streamed, 400, code="context_length_exceeded")


def test_max_tokens_beyond_context_ends_with_length(server: ServerProcess) -> None:
    prompt = "word " * 1000
    body = {"prompt": prompt, "max_tokens": 5000, "temperature": 0, "logit_bias": NO_END_TOKENS}
    response = post(server, "/v1/completions", body, timeout=300)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 1024 + 1


def test_body_too_large(server: ServerProcess) -> None:
    big = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    assert_error(post(server, "/v1/completions", big), 413)


def test_wrong_method_and_unknown_path(server: ServerProcess) -> None:
    assert_error(httpx.get(server.url + "/v1/chat/completions"), 405)
    assert_error(httpx.delete(server.url + "/v1/models"), 405)
    assert_error(httpx.get(server.url + "/v2/nothing"), 404)


def test_queue_full_is_503_with_retry_after() -> None:
    with ServerProcess(["--parallel", "1", "--max-queue", "1", "--ctx-size", "1024"]) as server:
        server.wait_ready()
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 200, "stream": True, "logit_bias": NO_END_TOKENS}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120):
            wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 1, "the first stream to start", 20)
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120):
                wait_for(lambda: server.metrics()["llama_trio_queue_depth"] == 1, "the second stream to be queued", 20)
                response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert_error(response, 503, code="overloaded")
                assert response.headers["retry-after"] == "1"
        assert server.stop() == 0


def test_api_key() -> None:
    with ServerProcess(["--api-key", "sekrit", "--api-key", "other", "--ctx-size", "1024"]) as server:
        server.wait_ready()
        assert httpx.get(server.url + "/health").status_code == 200  # stays open
        assert_error(httpx.get(server.url + "/v1/models"), 401, code="invalid_api_key")
        assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"X-Api-Key": "other"}).status_code == 200
        with client(server, "wrong") as wrong, pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        with client(server, "sekrit") as right:
            result = right.chat.completions.create(model="x", messages=CHAT, max_tokens=4)
        assert result.choices[0].message.content is not None
        assert server.stop() == 0


def test_no_api_key_means_open(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer whatever"}).status_code == 200


def test_health_and_metrics(server: ServerProcess) -> None:
    response = httpx.get(server.url + "/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"
    metrics = server.metrics()
    assert metrics["llama_trio_draining"] == 0
    assert any(k.startswith("llama_trio_requests_total{endpoint=/v1/chat/completions,status=200}") for k in metrics)
    assert "llama_trio_time_to_first_token_seconds_count" in metrics
    assert "llama_trio_time_per_output_token_seconds_count" in metrics


def test_cors_off_by_default(server: ServerProcess) -> None:
    response = httpx.get(server.url + "/v1/models", headers={"Origin": "http://example.test"})
    assert "access-control-allow-origin" not in response.headers


def test_engine_unharmed_by_garbage(server: ServerProcess) -> None:
    good = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    before = post(server, "/v1/completions", good).json()["choices"][0]["text"]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GARBAGE / HTTP/9.9\r\n\r\n")
        sock.recv(1024)
    assert post(server, "/v1/completions", good).json()["choices"][0]["text"] == before


def test_cors_origin_allowed() -> None:
    with ServerProcess(["--cors-origin", "http://app.test", "--api-key", "k", "--ctx-size", "1024"]) as server:
        server.wait_ready()
        preflight = httpx.options(
            server.url + "/v1/chat/completions",
            headers={"Origin": "http://app.test", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.test"
        assert "Authorization" in preflight.headers["access-control-allow-headers"]
        ok = httpx.get(server.url + "/v1/models", headers={"Origin": "http://app.test", "X-Api-Key": "k"})
        assert ok.headers["access-control-allow-origin"] == "http://app.test"
        other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.test", "X-Api-Key": "k"})
        assert "access-control-allow-origin" not in other.headers
        # An allowed origin may send what changes something, from a browser too.
        body = {"prompt": "Hi", "max_tokens": 1}
        browser = {"Origin": "http://app.test", "Sec-Fetch-Site": "cross-site", "X-Api-Key": "k"}
        assert httpx.post(server.url + "/v1/completions", json=body, headers=browser, timeout=60).status_code == 200
        assert server.stop() == 0


def test_other_sites_cannot_send_what_changes_something(server: ServerProcess) -> None:
    """Found by review: a page of any website could POST here with a text/plain body (no CORS
    preflight) and, without an API key, unload models, queue work or save slots; CORS only kept
    it from reading the answer. Now a browser's request from another site is a 403."""
    body = '{"prompt": "Hi", "max_tokens": 1}'
    url = server.url + "/v1/completions"
    for headers in (
        {"Origin": "http://evil.test", "Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://localhost:5173", "Sec-Fetch-Site": "same-site"},  # another port: another origin
        {"Origin": "http://evil.test"},  # a browser without Fetch Metadata: its Origin is not this Host
        {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
    ):
        refused = httpx.post(url, content=body, headers={**headers, "Content-Type": "text/plain"}, timeout=60)
        assert refused.status_code == 403, (headers, refused.text)
        assert refused.json()["error"]["code"] == "cross_origin_refused"
    unload = httpx.post(
        server.url + "/models/unload", content='{"model": "x"}', headers={"Origin": "http://evil.test"}, timeout=60
    )
    assert unload.status_code == 403
    assert server.metrics()["llama_trio_requests_total{endpoint=/models/unload,status=403}"] == 1
    # The page's own origin, a browser's direct navigation and clients that are no browser.
    host = f"127.0.0.1:{server.port}"
    for headers in (
        {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"},
        {"Origin": f"http://{host}"},
        {"Sec-Fetch-Site": "none"},
        {},
    ):
        ok = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=60)
        assert ok.status_code == 200, (headers, ok.text)
    # Reading is not refused (the answer stays unreadable to the page without CORS).
    assert httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.test"}).status_code == 200
