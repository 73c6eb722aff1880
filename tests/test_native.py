"""llama.cpp's own API (llama-server's native routes) through a real server process: shapes,
counts, round trips and effects; never the text a sampled or near-tie greedy answer has."""

from __future__ import annotations

import json
import os
import pathlib
import re
import stat
import threading

import httpx
import pytest

import ffi
from bench.random_model import SHAPES, write_model
from tests.support.process import NO_END_TOKENS, ServerProcess, serving
from tests.support.stalls import health_while
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"
FINAL_KEYS = {
    "index",
    "content",
    "tokens",
    "id_slot",
    "stop",
    "model",
    "tokens_predicted",
    "tokens_evaluated",
    "generation_settings",
    "prompt",
    "has_new_line",
    "truncated",
    "stop_type",
    "stopping_word",
    "tokens_cached",
    "timings",
}
TIMING_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}


def post(server: ServerProcess, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def native_error(response: httpx.Response, status: int, type_: str = "invalid_request_error") -> dict:
    """llama-server's error shape: {"error": {"code", "message", "type"}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert error["code"] == status and error["type"] == type_
    assert isinstance(error["message"], str) and error["message"]
    return error


def stream_objects(server: ServerProcess, path: str, body: dict) -> list[dict]:
    """A native stream's objects; checks its framing (``data:`` events, no ``[DONE]``)."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    objects = []
    for event in raw.split(b"\n\n"):
        if not event or event.startswith(b":"):
            continue
        assert event.startswith(b"data: ") and b"\n" not in event, event
        assert event != b"data: [DONE]"
        objects.append(json.loads(event[6:]))
    return objects


def tokenize(server: ServerProcess, content: str, **options: object) -> list:
    response = post(server, "/tokenize", {"content": content, **options})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


# -- /tokenize, /detokenize ----------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(server: ServerProcess) -> None:
    text = "What is the capital of France? 媽 🤗"
    tokens = tokenize(server, text)
    assert len(tokens) > 5 and all(isinstance(t, int) for t in tokens)
    response = post(server, "/detokenize", {"tokens": tokens})
    assert response.status_code == 200
    assert response.json() == {"content": text}


def test_tokenize_pieces_and_special_tokens(server: ServerProcess) -> None:
    text = "unicode 媽 and emoji 🤗"
    pieces = tokenize(server, text, with_pieces=True)
    assert [p["id"] for p in pieces] == tokenize(server, text)
    joined = b""
    for piece in pieces:
        # A piece that is not whole UTF-8 comes as its bytes.
        joined += piece["piece"].encode() if isinstance(piece["piece"], str) else bytes(piece["piece"])
    assert joined.decode() == text
    # Special-token text is parsed by default, and is plain text with parse_special false.
    assert len(tokenize(server, "<|im_start|>")) == 1
    assert len(tokenize(server, "<|im_start|>", parse_special=False)) > 1
    # Token ids and text in one sequence.
    hello = tokenize(server, "hello")
    assert tokenize(server, [*hello, " world"]) == hello + tokenize(server, " world")


@pytest.mark.parametrize("content", [[{"a": 1}], [None], [[]], ["a", 5.0], [True], ["a", 10**9], [-1]])
@pytest.mark.parametrize("with_pieces", [False, True])
def test_tokenize_refuses_what_is_not_a_token_id_or_text(
    server: ServerProcess, content: list, with_pieces: bool
) -> None:
    """Found by review: other items (a float among them) were a 500, or 5.0 taken as an id."""
    error = native_error(post(server, "/tokenize", {"content": content, "with_pieces": with_pieces}), 400)
    assert "content" in error["message"] or "vocabulary" in error["message"]


@pytest.mark.parametrize("path", ["/completion", "/tokenize", "/infill", "/slots/0"])
def test_transport_errors_in_llama_servers_shape(server: ServerProcess, path: str) -> None:
    """Found by review: a 413 or a 405 on a native route came in OpenAI's shape."""
    too_large = httpx.post(server.url + path, content=b"{" + b" " * (4 * 1024 * 1024), timeout=60)
    assert "larger than" in native_error(too_large, 413)["message"]
    assert too_large.headers["connection"] == "close"
    wrong_method = httpx.get(server.url + path, timeout=60)
    assert f"GET is not allowed on {path}" == native_error(wrong_method, 405)["message"]
    assert wrong_method.headers["allow"] == "OPTIONS, POST"
    assert native_error(httpx.delete(server.url + "/props", timeout=60), 405)
    assert httpx.delete(server.url + "/props", timeout=60).headers["allow"] == "GET, HEAD, OPTIONS, POST"
    assert native_error(httpx.post(server.url + "/slots", json={}, timeout=60), 405)
    # The OpenAI routes keep their own shape, and the native routes still answer.
    openai_shape = httpx.get(server.url + "/v1/chat/completions", timeout=60)
    assert openai_shape.status_code == 405 and set(openai_shape.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/props", timeout=60).status_code == 200
    assert post(server, "/tokenize", {"content": "hi"}).status_code == 200


def test_detokenize_refuses_ids_outside_the_vocabulary(server: ServerProcess) -> None:
    native_error(post(server, "/detokenize", {"tokens": [1, 10**9]}), 400)
    native_error(post(server, "/detokenize", {"tokens": "abc"}), 400)


def test_tokenize_pieces_are_made_off_the_event_loop(server: ServerProcess) -> None:
    """Found by review: /tokenize's pieces and its answer were made on the event loop (1.9
    million ids with their pieces, a 68 MB answer: /health took 5.6 s). Its JSON is written in
    parts too: one ``json.dumps`` call holds the GIL, from a worker thread too, for seconds."""
    ids = [1] * 1_300_000  # 3.9 MB as the test writes it; a 47 MB answer
    response, latencies = health_while(server, "/tokenize", {"content": ids, "with_pieces": True})
    assert response.status_code == 200, response.text[:500]
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    (one,) = tokenize(server, [1], with_pieces=True)
    assert response.json()["tokens"] == [one] * len(ids)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/tokenize", {"content": "hi", "foo": 1}, "foo"),
        ("/tokenize", {"content": "hi", "add_bos": True}, "add_bos"),
        ("/detokenize", {"tokens": [1], "with_pieces": True}, "with_pieces"),
        ("/apply-template", {"messages": [{"role": "user", "content": "hi"}], "foo": 1}, "foo"),
    ],
)
def test_tokenize_routes_refuse_fields_not_their_own(server: ServerProcess, path: str, body: dict, field: str) -> None:
    """Found by review: /tokenize and /detokenize took any other field and dropped it."""
    assert f"'{field}' is not supported" in native_error(post(server, path, body), 400)["message"]
    # A field set to null sets nothing.
    assert post(server, path, {**body, field: None}).status_code == 200


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory: pytest.TempPathFactory, model_path: pathlib.Path):
    """A tiny model on the default model's vocabulary whose tokenizer adds BOS (the default
    model's does not)."""
    target = tmp_path_factory.mktemp("bos") / "bos.gguf"
    write_model(model_path, target, SHAPES["tiny"], seed=5, add_bos=True)
    with serving(["--model", str(target), "--parallel", "1", "--ctx-size", "256", "--threads", "2"]) as proc:
        yield proc


def test_tokenize_adds_bos_as_llama_server_does(bos_server: ServerProcess) -> None:
    """Found by review: with ids and text mixed, add_special worked backwards (false added BOS,
    true did not) and an empty list gave BOS. As llama-server's tokenize_mixed: false never
    adds it; true adds it when the first item is text."""
    server = bos_server
    hello = tokenize(server, "hello")
    (bos,) = (t for t in tokenize(server, "hello", add_special=True) if t not in hello)
    for add_special in (False, True):
        assert tokenize(server, [905, "hello"], add_special=add_special) == [905, *hello]
        assert tokenize(server, [], add_special=add_special) == []
        assert tokenize(server, ["hello", 905], add_special=add_special) == [bos] * add_special + [*hello, 905]
    # parse_special holds for text among ids too.
    assert tokenize(server, [905, "<|im_start|>"]) == [905, *tokenize(server, "<|im_start|>")]
    assert tokenize(server, [905, "<|im_start|>"], parse_special=False) == [
        905,
        *tokenize(server, "<|im_start|>", parse_special=False),
    ]


# -- /completion ----------------------------------------------------------------------------------


def test_completion_shape_and_counts(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 5, "ignore_eos": True, "return_tokens": True, "temperature": 0}
    response = post(server, "/completion", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer) == FINAL_KEYS
    assert answer["stop"] is True and answer["stop_type"] == "limit" and answer["stopping_word"] == ""
    assert answer["tokens_predicted"] == 5 and len(answer["tokens"]) == 5
    n_prompt = len(tokenize(server, PROMPT, add_special=True))
    assert answer["tokens_evaluated"] == n_prompt
    timings = answer["timings"]
    assert set(timings) == TIMING_KEYS
    assert timings["predicted_n"] == 5 and timings["prompt_n"] + timings["cache_n"] == n_prompt
    assert timings["prompt_ms"] >= 0 and timings["predicted_ms"] >= 0
    assert post(server, "/detokenize", {"tokens": answer["tokens"]}).json()["content"] == answer["content"]
    assert answer["generation_settings"]["n_predict"] == 5 and answer["generation_settings"]["temperature"] == 0
    assert answer["prompt"] == PROMPT
    assert answer["has_new_line"] == ("\n" in answer["content"])
    # Without return_tokens, no tokens; a prompt again is taken from the cache.
    long = {**body, "prompt": PROMPT + " a city that " * 10, "return_tokens": False}
    post(server, "/completion", long)
    again = post(server, "/completion", long).json()
    assert again["tokens"] == [] and again["timings"]["cache_n"] > 0
    assert again["timings"]["prompt_n"] + again["timings"]["cache_n"] == again["tokens_evaluated"]


def test_every_generated_token_id_is_returned_when_its_text_is_not_out_yet(server: ServerProcess) -> None:
    """Found by review: a step whose token completed no character (a CJK character's first
    bytes) made no piece, and its id was lost from ``tokens`` (16 of 30), streamed or not."""
    body = {
        "prompt": "Capital:",
        "n_predict": 30,
        "return_tokens": True,
        "grammar": 'root ::= "東京は日本の首都です。"+',
    }
    answer = post(server, "/completion", body).json()
    assert answer["tokens_predicted"] == 30 and len(answer["tokens"]) == 30, answer
    streamed = [token for event in stream_objects(server, "/completion", body) for token in event.get("tokens", [])]
    assert len(streamed) == 30


def test_cache_prompt_false_computes_the_prompt_whole(server: ServerProcess) -> None:
    """Found by review: cache_prompt was taken as changing nothing, but a reused prefix leaves
    the prompt's last tokens to a smaller batch, whose sums round otherwise: greedy answers
    differed. With cache_prompt false the prompt is computed whole every time, as llama-server
    does, and the same request gives the same greedy answer."""
    prompt = "A long note about rivers. " + "Rivers carry water to the sea, and people live by them. " * 8
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "cache_prompt": False}
    first, second = (post(server, "/completion", body).json() for _ in range(2))
    assert first["timings"]["cache_n"] == 0 == second["timings"]["cache_n"]
    assert second["timings"]["prompt_n"] == second["tokens_evaluated"]
    assert second["content"] == first["content"]
    reused = [post(server, "/completion", {**body, "cache_prompt": True}).json() for _ in range(2)]  # the default
    assert reused[1]["timings"]["cache_n"] > 0, reused
    native_error(post(server, "/completion", {**body, "cache_prompt": "no"}), 400)


def test_unprefixed_completions_is_the_native_format(server: ServerProcess) -> None:
    answer = post(server, "/completions", {"prompt": PROMPT, "n_predict": 2}).json()
    assert {"content", "stop", "timings"} <= set(answer) and "choices" not in answer
    # /v1/completions stays OpenAI's.
    assert "choices" in post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()


def test_stream_objects_and_final(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 6, "ignore_eos": True, "temperature": 0}
    objects = stream_objects(server, "/completion", body)
    *partials, final = objects
    assert final["stop"] is True and set(final) == FINAL_KEYS
    assert final["content"] == "" and final["tokens"] == [] and final["stop_type"] == "limit"
    assert final["tokens_predicted"] == 6 and final["timings"]["predicted_n"] == 6
    tokens = [t for p in partials for t in p["tokens"]]
    assert len(tokens) == 6
    assert all(p["stop"] is False and p["tokens"] for p in partials)
    assert [p["tokens_predicted"] for p in partials] == sorted(p["tokens_predicted"] for p in partials)
    content = "".join(p["content"] for p in partials)
    assert post(server, "/detokenize", {"tokens": tokens}).json()["content"] == content
    # The same greedy request, whole, on the same machine: the same text.
    assert post(server, "/completion", body).json()["content"] == content


def test_timings_per_token_and_probabilities(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 3, "ignore_eos": True, "n_probs": 4, "timings_per_token": True}
    *partials, final = stream_objects(server, "/completion", body)
    assert "completion_probabilities" not in final
    for partial in partials:
        assert set(partial["timings"]) == TIMING_KEYS
        (entry,) = partial["completion_probabilities"]
        assert entry["id"] == partial["tokens"][0] and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 4
    whole = post(server, "/completion", {**body, "timings_per_token": False}).json()
    probs = whole["completion_probabilities"]
    assert len(probs) == 3
    for entry in probs:
        assert {"id", "token", "bytes", "logprob", "top_logprobs"} == set(entry)
        assert bytes(entry["bytes"]).decode("utf-8", "ignore") == entry["token"]
        assert all(alt["logprob"] <= 0 for alt in entry["top_logprobs"])


def test_stop_word_under_a_grammar(server: ServerProcess) -> None:
    # The grammar fixes the text, so where the stop string falls is known.
    body = {"prompt": "Say it:", "grammar": 'root ::= "hello world, again"', "stop": ["world"], "n_predict": 20}
    answer = post(server, "/completion", body).json()
    assert answer["content"] == "hello "
    assert answer["stop_type"] == "word" and answer["stopping_word"] == "world"
    (last,) = stream_objects(server, "/completion", body)[-1:]
    assert last["stop_type"] == "word" and last["stopping_word"] == "world"


def test_gbnf_with_quantified_groups_under_quantifiers(server: ServerProcess) -> None:
    # GBNF llama.cpp takes, once a 400 quoting Lark the client never wrote. The text is the
    # grammar's, or where the limit cuts an unbounded one short, the start of one.
    for grammar, whole, cut in (
        ('root ::= ("a"+)* "b"', r"a*b", r"a*"),
        ('root ::= ("x"?)+ "." [0-9]{1,2}+', r"x*\.[0-9]+", r"x*(\.[0-9]*)?"),
        ('root ::= (("a"|"b"){2}){2} "."', r"[ab]{4}\.", None),
        ('root ::= ("ab"{2}){3}', r"(abab){3}", None),
    ):
        response = post(server, "/completion", {"prompt": "Hi", "n_predict": 24, "grammar": grammar})
        assert response.status_code == 200, response.text
        answer = response.json()
        if cut is not None and answer["stop_type"] == "limit":
            assert re.fullmatch(cut, answer["content"]), (grammar, answer["content"])
        else:
            assert answer["stop_type"] == "eos", (grammar, answer)
            assert re.fullmatch(whole, answer["content"]), (grammar, answer["content"])


def test_response_fields(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict", "nope"]}
    answer = post(server, "/completion", body).json()
    assert set(answer) == {"content", "generation_settings/n_predict"}
    assert answer["generation_settings/n_predict"] == 2


def test_prompt_forms(server: ServerProcess) -> None:
    tokens = tokenize(server, PROMPT, add_special=True)
    body = {"n_predict": 4, "temperature": 0}
    from_text = post(server, "/completion", {**body, "prompt": PROMPT}).json()["content"]
    assert post(server, "/completion", {**body, "prompt": tokens}).json()["content"] == from_text
    both = post(server, "/completion", {**body, "prompt": [tokens, PROMPT]}).json()
    assert isinstance(both, list) and [a["index"] for a in both] == [0, 1]
    assert [a["content"] for a in both] == [from_text, from_text]
    wrapped = post(server, "/completion", {**body, "prompt": {"prompt_string": PROMPT}}).json()
    assert wrapped["content"] == from_text
    native_error(post(server, "/completion", {**body, "prompt": {"prompt_string": "x", "multimodal_data": "AAA"}}), 400)
    native_error(post(server, "/completion", {"n_predict": 1}), 400)
    for bad in ([1, -3, 5], [[1, -3]], [1, True, "x"], [10**9], ["x", -1]):  # ids outside the vocabulary
        native_error(post(server, "/completion", {**body, "prompt": bad}), 400)
    assert httpx.get(server.url + "/health").status_code == 200  # still up


def test_logit_bias_forms(server: ServerProcess) -> None:
    # Banning the greedy first token (by id, by text, or with false) changes the first token.
    body = {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True}
    (first,) = post(server, "/completion", body).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": [first]}).json()["content"]
    for bias in ([[first, False]], {str(first): -100}, [[text, -100]]):
        (other,) = post(server, "/completion", {**body, "logit_bias": bias}).json()["tokens"]
        assert other != first, bias


@pytest.mark.parametrize("form", ["array", "object"])
def test_logit_bias_text_is_tokenized_off_the_event_loop(server: ServerProcess, form: str) -> None:
    """Found by review: 300 logit_bias texts of 13 KB (3.9 MB) were tokenized on the event
    loop, /health waiting about 3 s: the estimate of the parse's work counted the prompt only."""
    texts = [f"{i} " + "word " * 2600 for i in range(300)]
    bias = [[text, 0.0] for text in texts] if form == "array" else dict.fromkeys(texts, 0.0)
    body = {"prompt": "hi", "n_predict": 1, "logit_bias": bias}
    response, latencies = health_while(server, "/completion", body)
    assert response.status_code == 200, response.text
    assert max(latencies) < 1.0, sorted(latencies)[-5:]


@pytest.mark.parametrize("samplers", [5, 0, -1, 1.5, True, [{"a": 1}], [[]]])
def test_samplers_of_another_type_are_a_400(server: ServerProcess, samplers: object) -> None:
    error = native_error(post(server, "/completion", {"prompt": "hi", "n_predict": 1, "samplers": samplers}), 400)
    assert "samplers" in error["message"]


@pytest.mark.parametrize(("temperature", "used"), [(5.0, 5.0), (1e30, 1e30), (1e300, 3.4028234663852886e38), (-1, 0)])
def test_temperature_above_two_is_taken(server: ServerProcess, temperature: float, used: float) -> None:
    """Found by review: a temperature above 2 was brought down to 2 without a word; llama-server
    takes any from 0 up (a float: 1e300 is its largest). The answer says the one it sampled with."""
    body = {"prompt": PROMPT, "n_predict": 4, "ignore_eos": True, "temperature": temperature, "top_k": 0}
    for answer in (post(server, "/completion", body).json(), stream_objects(server, "/completion", body)[-1]):
        assert answer["tokens_predicted"] == 4
        assert answer["generation_settings"]["temperature"] == used


def test_logit_bias_id_of_many_digits_is_outside_the_vocabulary(server: ServerProcess) -> None:
    """Found by review: int() of 5000 digits raised (a 500); it is skipped as any unknown id."""
    for bias in ({"9" * 5000: 1}, {" -" + "9" * 5000: 1}, [["9" * 5000, 1]]):
        assert post(server, "/completion", {"prompt": "hi", "n_predict": 2, "logit_bias": bias}).status_code == 200


def test_logit_bias_ids_and_texts_as_llama_server_reads_them(server: ServerProcess) -> None:
    """Found by review: an array's digit string was read as a token id, and an object's key
    " 15" as text; llama-server reads the first as text, the second (strtol) as id 15."""
    (seven,) = tokenize(server, "7", parse_special=False)
    digits = str(seven)  # another token's id: its text's tokens are not that token
    digit_tokens = tokenize(server, digits, parse_special=False)
    assert seven not in digit_tokens
    body = {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True}

    def pick(bias: object) -> int:
        answer = post(server, "/completion", {**body, "logit_bias": bias})
        assert answer.status_code == 200, answer.text
        (token,) = answer.json()["tokens"]
        return token

    # An array's string is text, digits or not: its tokens get the bias (+100 wins the pick).
    assert pick([[digits, 100]]) in digit_tokens
    # An object's key is an id when strtol reads all of it as a number (white space and a sign
    # first), and text otherwise.
    for key in (digits, f" {digits}", f"+{digits}", f"\t\n 0{digits}"):
        assert pick({key: 100}) == seven, key
    assert pick({f"{digits} ": 100}) in tokenize(server, f"{digits} ", parse_special=False)
    # A token named twice gets both biases (llama.cpp's sampler adds each entry): 500 + 500 beats
    # another's 900, which the last entry alone (500) would not.
    (other,) = tokenize(server, "9", parse_special=False)
    assert pick([[seven, 500], [seven, 500], [other, 900]]) == seven
    assert pick([[seven, 500], [other, 900]]) == other


def test_refused_and_neutral_fields(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 1}
    for field, value in [("mirostat", 2), ("typical_p", 0.5), ("id_slot", 9), ("post_sampling_probs", True)]:
        error = native_error(post(server, "/completion", {**body, field: value}), 400)
        assert field in error["message"]
    native_error(post(server, "/completion", {**body, "mirostat_tau": 3.0, "mirostat": 1}), 400)
    native_error(post(server, "/completion", {**body, "made_up": 1}), 400)
    # At the values that switch them off, llama-server's other samplers change nothing.
    neutral = {"mirostat": 0, "mirostat_tau": 5.0, "typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0}
    neutral |= {"cache_prompt": False, "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p"]}
    neutral["samplers"] += ["min_p", "xtc", "temperature"]
    assert post(server, "/completion", {**body, **neutral}).status_code == 200


def test_context_overflow_in_llama_servers_shape(server: ServerProcess) -> None:
    error = native_error(post(server, "/completion", {"prompt": "hello " * 3000}), 400, "exceed_context_size_error")
    assert error["n_ctx"] == 1024 and error["n_prompt_tokens"] > 1024
    # The OpenAI routes: OpenAI's code and words, llama-server's type and figures.
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 3000}]})
    error = chat.json()["error"]
    assert chat.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 1024 and error["n_prompt_tokens"] > 1024


def test_cancelled_stream_frees_its_sequence(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the sequence freed", 30)
    assert all(not s["is_processing"] for s in httpx.get(server.url + "/slots").json())


def test_llamacpp_metric_names(server: ServerProcess) -> None:
    before = server.metrics()
    answer = post(server, "/completion", {"prompt": PROMPT + " (metrics)", "n_predict": 3, "ignore_eos": True}).json()
    response = httpx.get(server.url + "/metrics")
    assert int(response.headers["Process-Start-Time-Unix"]) > 0
    # Written as llama-server writes them (some clients compare names case-sensitively).
    names = {name for name, _ in response.headers.raw}
    assert {b"Process-Start-Time-Unix", b"Content-Type", b"Content-Length"} <= names, names
    for name, kind in [("prompt_tokens_total", "counter"), ("requests_processing", "gauge")]:
        assert f"# TYPE llamacpp:{name} {kind}\n" in response.text and f"# HELP llamacpp:{name} " in response.text
    after = server.metrics()
    grown = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    assert grown >= answer["timings"]["predicted_n"] == 3  # other tests' requests may finish meanwhile
    assert after["llamacpp:prompt_tokens_total"] == after["llama_trio_tokens_total{kind=prompt}"]
    assert after["llamacpp:n_decode_total"] == after["llama_trio_decode_steps_total"]
    assert after["llamacpp:n_tokens_max_total"] >= answer["tokens_evaluated"] + 3


# -- /apply-template and assistant prefill --------------------------------------------------------


def test_apply_template_and_prefill(server: ServerProcess) -> None:
    user = [{"role": "user", "content": "Hi"}]
    opened = post(server, "/apply-template", {"messages": user}).json()["prompt"]
    assert opened.endswith("<|im_start|>assistant\n")
    closed = post(server, "/apply-template", {"messages": user, "add_generation_prompt": False}).json()["prompt"]
    assert opened.startswith(closed) and not closed.endswith("assistant\n")
    prefill = [*user, {"role": "assistant", "content": "Hello, I am"}]
    continued = post(server, "/apply-template", {"messages": prefill}).json()["prompt"]
    assert continued == opened + "Hello, I am"
    fresh = post(server, "/apply-template", {"messages": prefill, "continue_final_message": False}).json()["prompt"]
    assert fresh.endswith("Hello, I am<|im_end|>\n<|im_start|>assistant\n")


def test_chat_prefill_continues_the_message(server: ServerProcess) -> None:
    prefill = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    text = post(server, "/apply-template", {"messages": prefill}).json()["prompt"]
    n_prompt = len(tokenize(server, text, add_special=True))
    body = {"messages": prefill, "max_tokens": 2}
    continued = post(server, "/v1/chat/completions", body).json()
    assert continued["usage"]["prompt_tokens"] == n_prompt
    counted = post(server, "/v1/chat/completions/input_tokens", {"messages": prefill}).json()
    assert counted == {"input_tokens": n_prompt}
    fresh = post(server, "/v1/chat/completions", {**body, "continue_final_message": False}).json()
    assert fresh["usage"]["prompt_tokens"] > n_prompt  # the turn closed and a new one opened
    two = [*prefill, {"role": "assistant", "content": "three"}]
    assert post(server, "/v1/chat/completions", {"messages": two}).status_code == 400
    both = {**body, "continue_final_message": True, "add_generation_prompt": True}
    assert post(server, "/v1/chat/completions", both).status_code == 400
    alone = {"messages": prefill[:1], "continue_final_message": True}
    assert post(server, "/v1/chat/completions", alone).status_code == 400


def test_llama_server_response_formats_on_the_openai_route(server: ServerProcess) -> None:
    ask = {"messages": [{"role": "user", "content": "Pick a color."}], "max_tokens": 12}
    colors = {"enum": ["red", "green", "blue"]}
    for form in (
        {"type": "json_object", "schema": colors},  # llama-server's: an object type with a schema
        {"type": "json_schema", "json_schema": {"schema": colors}},  # no name: llama-server and vLLM take it
    ):
        answer = post(server, "/v1/chat/completions", {**ask, "response_format": form}).json()
        assert json.loads(answer["choices"][0]["message"]["content"]) in colors["enum"]
    misplaced = post(server, "/v1/chat/completions", {**ask, "response_format": {"type": "text", "schema": colors}})
    assert misplaced.status_code == 400 and misplaced.json()["error"]["param"] == "response_format.schema"


# -- /props, /slots, /infill ----------------------------------------------------------------------


def test_props(server: ServerProcess) -> None:
    props = httpx.get(server.url + "/props").json()
    assert props["total_slots"] == 4 and props["model_path"].endswith(".gguf")
    assert props["default_generation_settings"]["n_ctx"] == 1024
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert "<|im_start|>" in props["chat_template"]
    assert props["endpoint_slots"] is True and props["endpoint_props"] is False
    native_error(httpx.post(server.url + "/props", json={}), 501, "not_supported_error")


def test_slots_follow_a_running_job(server: ServerProcess) -> None:
    slots = httpx.get(server.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["n_ctx"] == 1024 and not s["is_processing"] for s in slots)
    assert all("prompt" not in s and "params" not in s for s in slots)  # counts only
    done = threading.Event()
    answers: list[httpx.Response] = []

    def run() -> None:
        try:
            answers.append(post(server, "/completion", {"prompt": PROMPT, "n_predict": 40, "ignore_eos": True}, 600))
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    try:
        wait_for(
            lambda: done.is_set() or any(s["is_processing"] for s in httpx.get(server.url + "/slots").json()),
            "a busy slot",
            120,
        )
        assert not done.is_set()
    finally:
        worker.join(600)
    assert answers and answers[0].status_code == 200
    assert not any(s["is_processing"] for s in httpx.get(server.url + "/slots").json())


def test_id_slot_pins_the_sequence(server: ServerProcess) -> None:
    body = {"prompt": PROMPT + " (pinned)", "n_predict": 2, "ignore_eos": True, "id_slot": 2}
    answer = post(server, "/completion", body).json()
    assert answer["id_slot"] == 2
    # The sequence holds this prompt and what was generated after it (the last token may not be in KV).
    cached = httpx.get(server.url + "/slots").json()[2]["n_cached_tokens"]
    assert answer["tokens_evaluated"] <= cached <= answer["tokens_evaluated"] + 2
    # With n = 2 the prompt runs in the named slot, its copy in another.
    both = post(server, "/completion", {**body, "n": 2, "id_slot": 3}).json()
    assert [a["id_slot"] for a in both] == [3, -1] and all(a["tokens_predicted"] == 2 for a in both)
    assert httpx.get(server.url + "/slots").json()[3]["n_cached_tokens"] >= answer["tokens_evaluated"]
    assert post(server, "/completion", {**body, "prompt": [PROMPT, PROMPT]}).status_code == 400  # two prompts
    chat = {"messages": [{"role": "user", "content": "Hi, slot one"}], "max_tokens": 1, "id_slot": 1}
    usage = post(server, "/v1/chat/completions", chat).json()["usage"]
    cached = httpx.get(server.url + "/slots").json()[1]["n_cached_tokens"]
    assert usage["prompt_tokens"] <= cached <= usage["total_tokens"]


def test_a_job_waiting_for_its_busy_slot_holds_up_no_one(server: ServerProcess) -> None:
    """Found by review: a job pinned (id_slot) to a busy sequence stopped the whole queue behind
    it, though other sequences were free: one client could stall everyone's new requests."""
    long = {"prompt": PROMPT, "n_predict": 800, "ignore_eos": True, "stream": True, "id_slot": 0}
    pinned: list[httpx.Response] = []
    with httpx.stream("POST", server.url + "/completion", json=long, timeout=120) as running:
        lines = running.iter_lines()  # kept: a line iterator collected would close the stream
        assert next(line for line in lines if line.startswith("data: "))
        waiter = threading.Thread(
            target=lambda: pinned.append(post(server, "/completion", {**long, "n_predict": 2, "stream": False}))
        )
        waiter.start()
        wait_for(lambda: server.metrics()["llama_trio_queue_depth"] == 1, "the pinned job to be queued", 60)
        # Behind the pinned job, a job for any sequence is answered while slot 0 is still busy.
        other = post(server, "/completion", {"prompt": PROMPT, "n_predict": 2, "ignore_eos": True})
        assert other.status_code == 200 and other.json()["id_slot"] != 0
        assert not pinned and httpx.get(server.url + "/slots").json()[0]["is_processing"]
    waiter.join(120)  # the stream closed: its slot is freed, and the pinned job runs there
    assert pinned and pinned[0].status_code == 200 and pinned[0].json()["id_slot"] == 0
    assert server.metrics()["llama_trio_active_sequences"] == 0


def test_infill_needs_fim_tokens(server: ServerProcess) -> None:
    # SmolLM2 has no fill-in-the-middle tokens: llama-server answers the same way.
    body = {"input_prefix": "def f():\n", "input_suffix": "\n", "prompt": "    return"}
    error = native_error(post(server, "/infill", body), 501, "not_supported_error")
    assert "FIM" in error["message"]


def write_fim_model(model: ffi.Model, model_path: pathlib.Path, target: pathlib.Path) -> None:
    """A tiny model on the default model's vocabulary, with three of its tokens as FIM's
    prefix, suffix and middle tokens (<filename>, <gh_stars>, <issue_start>)."""
    vocab = model.vocab
    pre, suf, mid = (
        vocab.tokenize(t, add_special=False, parse_special=True)[0]
        for t in ("<filename>", "<gh_stars>", "<issue_start>")
    )
    write_model(model_path, target, SHAPES["tiny"], seed=4, fim=(pre, suf, mid))


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory, model_path: pathlib.Path, model: ffi.Model):
    target = tmp_path_factory.mktemp("fim") / "fim.gguf"
    write_fim_model(model, model_path, target)
    with serving(["--model", str(target), "--parallel", "1", "--ctx-size", "2048", "--batch-size", "256"]) as proc:
        yield proc


def test_infill_on_a_model_with_fim_tokens(fim_server: ServerProcess) -> None:
    """Found by review: /infill's own fields reached /completion's check of its fields, so on a
    model with FIM tokens every request was a 400 ('input_prefix' is not supported)."""
    server = fim_server
    body = {
        "input_prefix": "def f():\n",
        "input_suffix": "\n",
        "prompt": "    return",
        "n_predict": 3,
        "ignore_eos": True,
    }
    extra = {"input_extra": [{"filename": "util.py", "text": "X = 1\n"}]}
    whole = post(server, "/infill", {**body, **extra}).json()
    assert whole["tokens_predicted"] == 3 and isinstance(whole["content"], str)
    # The prompt is the FIM layout of the given texts: the extra file, then prefix and prompt,
    # suffix, and the middle token where the answer goes.
    prompt = whole["prompt"]
    marks = ["X = 1", "<filename>def f():\n    return", "<gh_stars>\n", "<issue_start>"]
    assert [prompt.find(m) for m in marks] == sorted(prompt.find(m) for m in marks) and prompt.find(marks[0]) >= 0
    assert prompt.endswith("<issue_start>") and all(m in prompt for m in marks)
    for request in (body, {**body, "stream": True}):
        answer = post(server, "/infill", request)
        assert answer.status_code == 200, answer.text
    native_error(post(server, "/infill", {**body, "input_prefix": 5}), 400)
    native_error(post(server, "/infill", {**body, "mirostat": 2}), 400)  # still /completion's check
    assert server.metrics()["llama_trio_active_sequences"] == 0


def test_infill_texts_are_tokenized_off_the_event_loop(fim_server: ServerProcess) -> None:
    """Found by review: /infill's input_suffix and input_extra (3.9 MB of either) were tokenized
    on the event loop, /health waiting seconds: the estimate counted the prefix and prompt only."""
    body = {"input_prefix": "def f():\n", "prompt": "    return", "n_predict": 1}
    big = [
        {"input_suffix": "word " * 780_000},
        {"input_suffix": "\n", "input_extra": [{"filename": "f.py", "text": "word " * 2600}] * 300},
        {"input_suffix": "\n", "input_extra": [{"text": "w"}] * 20_000},  # many small files
    ]
    for fields in big:
        response, latencies = health_while(fim_server, "/infill", {**body, **fields})
        assert response.status_code == 200, response.text
        assert max(latencies) < 1.0, (list(fields), sorted(latencies)[-5:])


def test_slot_actions_without_a_folder(server: ServerProcess) -> None:
    native_error(post(server, "/slots/0?action=save", {"filename": "a.bin"}), 501, "not_supported_error")


@pytest.fixture(scope="module")
def slot_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def configured(slot_folder: pathlib.Path):
    folder = slot_folder
    args = ["--parallel", "1", "--ctx-size", "512", "--threads", "2", "--no-slots", "--seed", "7", "--temp", "0"]
    args += ["--chat-template", "llama3", "--cors-origin", "localhost"]
    with serving([*args, "--slot-save-path", str(folder)]) as proc:
        yield proc


def test_server_defaults_and_no_slots(configured: ServerProcess) -> None:
    params = httpx.get(configured.url + "/props").json()["default_generation_settings"]["params"]
    assert params["seed"] == 7 and params["temperature"] == 0
    answer = post(configured, "/completion", {"prompt": PROMPT, "n_predict": 1}).json()
    assert answer["generation_settings"]["seed"] == 7
    native_error(httpx.get(configured.url + "/slots"), 501, "not_supported_error")


def test_builtin_template_by_name(configured: ServerProcess) -> None:
    prompt = post(configured, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}).json()["prompt"]
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "Hi<|eot_id|>" in prompt


def test_cors_localhost_keyword(configured: ServerProcess) -> None:
    for origin, allowed in [("http://localhost:5173", True), ("http://[::1]", True), ("http://evil.test", False)]:
        response = httpx.options(configured.url + "/completion", headers={"Origin": origin})
        assert response.headers.get("Access-Control-Allow-Origin") == (origin if allowed else None)


@pytest.mark.parametrize("filename", ["../escape.bin", "/tmp/abs.bin", ".hidden", "a/b.bin", "", 7])
def test_slot_file_names_stay_in_the_folder(configured: ServerProcess, filename: object) -> None:
    native_error(post(configured, "/slots/0?action=save", {"filename": filename}), 400)


def test_slot_actions_are_checked(configured: ServerProcess) -> None:
    native_error(post(configured, "/slots/5?action=save", {"filename": "a.bin"}), 400)
    native_error(post(configured, "/slots/0?action=explode", {"filename": "a.bin"}), 400)
    native_error(post(configured, "/slots/0?action=restore", {"filename": "missing.bin"}), 404, "not_found_error")


@pytest.mark.parametrize("id_slot", ["9" * 5000, "0" * 5000 + "1", "1" + "0" * 20, "-1", "x"])
def test_slot_ids_of_any_length_are_checked(configured: ServerProcess, id_slot: str) -> None:
    """Found by review: an id of more than 4300 digits was a 500 (int() refuses it)."""
    for action in ("erase", "save"):
        error = native_error(post(configured, f"/slots/{id_slot}?action={action}", {"filename": "a.bin"}), 400)
        assert error["message"].startswith("invalid slot id")


def test_slot_save_erase_restore(configured: ServerProcess) -> None:
    prompt = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who"
    body = {"prompt": prompt, "n_predict": 2, "ignore_eos": True}
    first = post(configured, "/completion", body).json()
    n_prompt = first["tokens_evaluated"]
    saved = post(configured, "/slots/0?action=save", {"filename": "story.bin"}).json()
    assert saved["n_saved"] >= n_prompt and saved["n_written"] > 0 and saved["timings"]["save_ms"] >= 0
    erased = post(configured, "/slots/0?action=erase", {}).json()
    assert erased == {"id_slot": 0, "n_erased": saved["n_saved"]}
    assert post(configured, "/completion", body).json()["timings"]["cache_n"] == 0  # gone: computed again
    post(configured, "/slots/0?action=erase", {})
    restored = post(configured, "/slots/0?action=restore", {"filename": "story.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    # The restored cells serve the prompt again, as the first request's did.
    again = post(configured, "/completion", body).json()
    assert again["timings"]["cache_n"] >= n_prompt - 1


def test_slot_actions_take_the_cache_salt(configured: ServerProcess) -> None:
    """Found by review: a sequence filled with a cache_salt could not be saved or erased by its
    owner even with the same salt: the slot actions always took the scope without one."""
    post(configured, "/completion", {"prompt": "Hello there, salted", "n_predict": 1, "cache_salt": "s1"})
    salted = {"filename": "salted.bin", "cache_salt": "s1"}
    error = native_error(post(configured, "/slots/0?action=save", {"filename": "salted.bin"}), 409)
    assert "another client's cache" in error["message"]  # the unsalted scope is another's
    native_error(post(configured, "/slots/0?action=save", {**salted, "cache_salt": "s2"}), 409)
    saved = post(configured, "/slots/0?action=save", salted)
    assert saved.status_code == 200, saved.text
    native_error(post(configured, "/slots/0?action=erase", {}), 409)
    assert post(configured, "/slots/0?action=erase", {"cache_salt": "s1"}).json()["n_erased"] > 0
    # The file is the salted scope's: restored with that salt only.
    native_error(post(configured, "/slots/0?action=restore", {"filename": "salted.bin"}), 404, "not_found_error")
    restored = post(configured, "/slots/0?action=restore", salted)
    assert restored.status_code == 200 and restored.json()["n_restored"] == saved.json()["n_saved"]
    assert post(configured, "/slots/0?action=erase", {"cache_salt": "s1"}).status_code == 200
    for bad in ("", 5, "x" * 257):
        error = native_error(post(configured, "/slots/0?action=erase", {"cache_salt": bad}), 400)
        assert "cache_salt" in error["message"]


def own_folder(slot_folder: pathlib.Path, filename: str) -> pathlib.Path:
    """The folder of the (one) client that saved ``filename``."""
    (path,) = slot_folder.glob(f"*/{filename}")
    return path.parent


def test_a_slot_saved_with_one_model_is_not_restored_into_another_of_its_shape(
    tiny_model_path: pathlib.Path, model_path: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Found by review: two models of one shape and type had one fingerprint, so a slot saved
    with one was restored into the other (200) and changed its answers."""
    other = tmp_path / "other.gguf"
    write_model(model_path, other, SHAPES["tiny"], seed=1)
    (tmp_path / "slots").mkdir()
    args = ["--parallel", "1", "--ctx-size", "512", "--slot-save-path", str(tmp_path / "slots")]
    with serving([*args, "--model", f"a={tiny_model_path}", "--model", f"b={other}"]) as server:
        assert post(server, "/completion", {"model": "a", "prompt": PROMPT, "n_predict": 2}).status_code == 200
        saved = post(server, "/slots/0?action=save&model=a", {"filename": "s.bin"})
        assert saved.status_code == 200, saved.text
        error = native_error(post(server, "/slots/0?action=restore&model=b", {"filename": "s.bin"}), 400)
        assert "another model" in error["message"]
        assert post(server, "/slots/0?action=restore&model=a", {"filename": "s.bin"}).status_code == 200


def test_slot_files_are_checked(configured: ServerProcess, slot_folder: pathlib.Path) -> None:
    post(configured, "/completion", {"prompt": "Hello there", "n_predict": 1})
    assert post(configured, "/slots/0?action=save", {"filename": "good.bin"}).status_code == 200
    own = own_folder(slot_folder, "good.bin")
    good = (own / "good.bin").read_bytes()
    (own / "bad.bin").write_bytes(b"not a slot" + good[10:])
    native_error(post(configured, "/slots/0?action=restore", {"filename": "bad.bin"}), 400)
    (own / "cut.bin").write_bytes(good[:20])
    native_error(post(configured, "/slots/0?action=restore", {"filename": "cut.bin"}), 400)
    (own / "other.bin").write_bytes(good.replace(b"fp_", b"fx_", 1))  # another model's
    native_error(post(configured, "/slots/0?action=restore", {"filename": "other.bin"}), 400)
    (own / "link.bin").symlink_to(own / "good.bin")
    native_error(post(configured, "/slots/0?action=restore", {"filename": "link.bin"}), 400)
    # At the folder's top (where earlier versions saved), only a slot file of the caller's is
    # anything: the rest is not there for it.
    (slot_folder / "good.bin").write_bytes(good)
    (slot_folder / "top-bad.bin").write_bytes(b"not a slot" + good[10:])
    (slot_folder / "top-link.bin").symlink_to(own / "good.bin")
    (slot_folder / "top-dir.bin").mkdir()
    for name in ("top-bad.bin", "top-link.bin", "top-dir.bin"):
        native_error(post(configured, "/slots/0?action=restore", {"filename": name}), 404, "not_found_error")
    assert post(configured, "/slots/0?action=restore", {"filename": "good.bin"}).status_code == 200
    (own / "good.bin").unlink()
    assert post(configured, "/slots/0?action=restore", {"filename": "good.bin"}).status_code == 200  # the top's
    assert not [p for p in slot_folder.rglob(".*")]  # no temporary file left


@pytest.mark.parametrize("length", [238, 255])
def test_slot_file_names_of_any_accepted_length(configured: ServerProcess, length: int) -> None:
    """Found by review: a name of 238 to 255 characters was a 500 (its temporary name too long)."""
    post(configured, "/completion", {"prompt": "Hello there", "n_predict": 1})
    filename = "L" * length
    saved = post(configured, "/slots/0?action=save", {"filename": filename})
    assert saved.status_code == 200, saved.text
    restored = post(configured, "/slots/0?action=restore", {"filename": filename})
    assert restored.status_code == 200 and restored.json()["n_read"] == saved.json()["n_written"]


def test_slot_entries_that_are_not_files(configured: ServerProcess, slot_folder: pathlib.Path) -> None:
    """Found by review: a directory was a 500, and a FIFO held its request (and a worker thread)
    for ever. Both are refused at once, and neither is replaced by a save."""
    post(configured, "/completion", {"prompt": "Hello there", "n_predict": 1})
    assert post(configured, "/slots/0?action=save", {"filename": "first.bin"}).status_code == 200
    own = own_folder(slot_folder, "first.bin")
    (own / "dir.bin").mkdir()
    os.mkfifo(own / "fifo.bin")
    for name in ("dir.bin", "fifo.bin"):
        error = native_error(post(configured, "/slots/0?action=restore", {"filename": name}, timeout=60), 400)
        assert "regular file" in error["message"]
        error = native_error(post(configured, "/slots/0?action=save", {"filename": name}, timeout=60), 409)
        assert "regular file" in error["message"]
    assert (own / "dir.bin").is_dir() and stat.S_ISFIFO((own / "fifo.bin").lstat().st_mode)
    assert not [p for p in slot_folder.rglob(".*")]  # no temporary file left


def test_busy_slot_is_a_409(configured: ServerProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", configured.url + "/completion", json=body, timeout=120) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        error = native_error(post(configured, "/slots/0?action=save", {"filename": "busy.bin"}), 409)
        assert "running" in error["message"]
    wait_for(lambda: configured.metrics()["llama_trio_active_sequences"] == 0, "the sequence freed", 60)


def test_slots_stay_within_a_tenant(tmp_path: pathlib.Path) -> None:
    args = ["--parallel", "1", "--ctx-size", "512", "--threads", "2", "--api-key", "alice", "--api-key", "bob"]
    with serving([*args, "--slot-save-path", str(tmp_path)]) as server:

        def as_(key: str, path: str, body: dict) -> httpx.Response:
            return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)

        as_("alice", "/completion", {"prompt": "Alice's secret plan is to", "n_predict": 1})
        # Bob can neither save nor erase what Alice's request left in the sequence.
        native_error(as_("bob", "/slots/0?action=save", {"filename": "x.bin"}), 409)
        native_error(as_("bob", "/slots/0?action=erase", {}), 409)
        assert as_("alice", "/slots/0?action=save", {"filename": "alice.bin"}).status_code == 200
        # Nor restore Alice's file (file names are each tenant's own: test_slot_file_names_are_each_tenants_own).
        native_error(as_("bob", "/slots/0?action=restore", {"filename": "alice.bin"}), 404, "not_found_error")
        assert as_("alice", "/slots/0?action=restore", {"filename": "alice.bin"}).status_code == 200
        anonymous = httpx.post(server.url + "/slots/0?action=erase", json={})
        native_error(anonymous, 401, "authentication_error")  # before the route, in its shape too


def as_tenant(server: ServerProcess, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def cached_in(server: ServerProcess, key: str, id_slot: int) -> int:
    slots = httpx.get(server.url + "/slots", headers={"Authorization": f"Bearer {key}"}, timeout=60).json()
    return int(slots[id_slot]["n_cached_tokens"])


TENANTS = ["--threads", "2", "--api-key", "alice", "--api-key", "bob"]


def test_a_restore_over_another_tenants_cache_is_refused(tmp_path: pathlib.Path) -> None:
    """Found by review: Bob could not erase the sequence Alice's request left, but he could
    restore a file of his own over it, which dropped her cells all the same."""
    with serving(["--parallel", "2", "--ctx-size", "1024", *TENANTS, "--slot-save-path", str(tmp_path)]) as server:
        alice = {"prompt": "Alice's secret plan is to", "n_predict": 1, "id_slot": 1}
        assert as_tenant(server, "alice", "/completion", alice).status_code == 200
        bob = {"prompt": "Bob's plan is to", "n_predict": 1, "id_slot": 0}
        assert as_tenant(server, "bob", "/completion", bob).status_code == 200
        assert as_tenant(server, "bob", "/slots/0?action=save", {"filename": "bob.bin"}).status_code == 200
        held = cached_in(server, "alice", 1)
        assert held > 0
        for action, body in (("erase", {}), ("restore", {"filename": "bob.bin"})):
            error = native_error(as_tenant(server, "bob", f"/slots/1?action={action}", body), 409)
            assert "another client's cache" in error["message"], action
        assert cached_in(server, "alice", 1) == held  # her cells are still there, and serve her
        assert as_tenant(server, "alice", "/completion", alice).json()["timings"]["cache_n"] > 0
        # Over his own cache, or an empty sequence, Bob restores.
        assert as_tenant(server, "bob", "/slots/0?action=restore", {"filename": "bob.bin"}).status_code == 200
        assert as_tenant(server, "alice", "/slots/1?action=erase", {}).status_code == 200
        assert as_tenant(server, "bob", "/slots/1?action=restore", {"filename": "bob.bin"}).status_code == 200


def test_slot_file_names_are_each_tenants_own(tmp_path: pathlib.Path) -> None:
    """Found by review: Bob's restore of Alice's file was a 404, but his save to its name a 409
    ("belongs to another client"), which told him the file was there. Each tenant's names are
    its own now: his save is a fresh file of his, hers stays as it was."""
    with serving(["--parallel", "1", "--ctx-size", "1024", *TENANTS, "--slot-save-path", str(tmp_path)]) as server:
        as_tenant(server, "alice", "/completion", {"prompt": "Alice's secret plan is to", "n_predict": 1})
        mine = as_tenant(server, "alice", "/slots/0?action=save", {"filename": "a1"}).json()
        as_tenant(server, "alice", "/slots/0?action=erase", {})
        bob = {"prompt": "Bob's plan, which is longer than hers, is to", "n_predict": 1}
        as_tenant(server, "bob", "/completion", bob)
        fresh = as_tenant(server, "bob", "/slots/0?action=save", {"filename": "b1"})
        theirs = as_tenant(server, "bob", "/slots/0?action=save", {"filename": "a1"})
        assert theirs.status_code == fresh.status_code == 200, theirs.text
        assert set(theirs.json()) == set(fresh.json()) and theirs.json()["n_saved"] != mine["n_saved"]
        restored = as_tenant(server, "bob", "/slots/0?action=restore", {"filename": "a1"}).json()
        assert restored["n_restored"] == theirs.json()["n_saved"]  # his own
        as_tenant(server, "bob", "/slots/0?action=erase", {})
        restored = as_tenant(server, "alice", "/slots/0?action=restore", {"filename": "a1"}).json()
        assert restored["n_restored"] == mine["n_saved"]  # hers, untouched
        # On disk: each tenant's files in a folder of its own.
        files = sorted(tmp_path.rglob("a1"))
        assert len(files) == 2 and files[0].parent != files[1].parent
        assert all(f.parent.parent == tmp_path for f in files)
        # A file an earlier version saved at the folder's top is still its owner's, and only hers.
        (hers,) = [f for f in files if not (f.parent / "b1").exists()]
        (tmp_path / "old.bin").write_bytes(hers.read_bytes())
        restored = as_tenant(server, "alice", "/slots/0?action=restore", {"filename": "old.bin"}).json()
        assert restored["n_restored"] == mine["n_saved"]
        native_error(
            as_tenant(server, "bob", "/slots/0?action=restore", {"filename": "old.bin"}), 404, "not_found_error"
        )
        as_tenant(server, "alice", "/slots/0?action=erase", {})
        as_tenant(server, "bob", "/completion", bob)
        assert as_tenant(server, "bob", "/slots/0?action=save", {"filename": "old.bin"}).status_code == 200
        assert (tmp_path / "old.bin").read_bytes() == hers.read_bytes()


def test_native_routes_name_their_model(model_path: pathlib.Path, tiny_model_path: pathlib.Path) -> None:
    """With several models, a body's ``model`` (or ``?model=`` on GET) picks the one a native
    route uses, loaded on demand as on the OpenAI routes; an unknown one is a 404 in llama-server's
    shape, and a non-string one a 400."""
    args = ["--parallel", "2", "--ctx-size", "1024", "--threads", "2", "--cache-ram", "0"]
    with serving([*args, "--model", f"smol={model_path}", "--model", f"tiny={tiny_model_path}"]) as server:
        answer = post(server, "/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 4, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "tiny" and answer.json()["tokens_predicted"] == 4
        props = httpx.get(server.url + "/props", params={"model": "tiny"}, timeout=60).json()
        assert props["model_alias"] == "tiny" and props["model_path"].endswith("tiny.gguf")
        assert httpx.get(server.url + "/props", params={"model": "smol"}, timeout=60).json()["model_alias"] == "smol"
        # Same tokenizer, so the same tokens; each route answered by the model it named.
        assert tokenize(server, PROMPT, model="tiny") == tokenize(server, PROMPT, model="smol")
        native_error(post(server, "/completion", {"model": "nope", "prompt": PROMPT}), 404, "not_found_error")
        native_error(post(server, "/tokenize", {"model": 7, "content": PROMPT}), 400)
        slots = httpx.get(server.url + "/slots", params={"model": "tiny"}, timeout=60).json()
        assert [slot["id"] for slot in slots] == [0, 1]
        assert server.metrics()["llama_trio_active_sequences"] == 0


def test_openai_answers_carry_llama_servers_timings(server: ServerProcess) -> None:
    """Whole OpenAI answers also carry llama-server's ``timings`` (its tools and web UI read
    them), consistent with their ``usage``."""
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5, "temperature": 0}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5})):
        answer = post(server, path, {**body, "logit_bias": NO_END_TOKENS}).json()
        timings, usage = answer["timings"], answer["usage"]
        assert set(timings) == TIMING_KEYS
        assert timings["predicted_n"] == usage["completion_tokens"] == 5
        assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
        assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0
