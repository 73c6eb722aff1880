"""``/v1/embeddings`` through the ``openai`` SDK against a real server started with
``--embeddings``."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.process import ServerProcess, serving

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def embedding_server() -> Iterator[ServerProcess]:
    args = ["--embeddings", "--parallel", "4", "--ctx-size", "2048", "--batch-size", "256", "--threads", "2"]
    with serving(args) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(embedding_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=embedding_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


TEXTS = ["The cat sat on the mat.", "A dog barked at the mailman.", "The cat sat on the mat.", "Quantum physics."]


def test_vectors_are_unit_length_and_identical_texts_agree(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model="x", input=TEXTS, encoding_format="float")
    vectors = [d.embedding for d in result.data]
    assert [d.index for d in result.data] == [0, 1, 2, 3]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 100
    for v in vectors:
        assert math.sqrt(sum(x * x for x in v)) == pytest.approx(1.0, abs=1e-4)
    assert cosine(vectors[0], vectors[2]) == pytest.approx(1.0, abs=1e-5)
    assert cosine(vectors[0], vectors[1]) < 0.999
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0


def test_a_batch_equals_the_same_inputs_one_by_one(client: openai.OpenAI) -> None:
    batch = [d.embedding for d in client.embeddings.create(model="x", input=TEXTS, encoding_format="float").data]
    for text, vector in zip(TEXTS, batch, strict=True):
        alone = client.embeddings.create(model="x", input=text, encoding_format="float").data[0].embedding
        assert cosine(alone, vector) == pytest.approx(1.0, abs=1e-4)


def test_base64_decodes_to_the_same_floats(embedding_server: ServerProcess, client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="x", input=TEXTS[0], encoding_format="float").data[0].embedding
    raw = httpx.post(
        embedding_server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=60
    ).json()["data"][0]["embedding"]
    data = base64.b64decode(raw)
    decoded = list(struct.unpack(f"<{len(data) // 4}f", data))
    assert decoded == pytest.approx(floats, abs=1e-6)
    # The SDK asks for base64 by default and decodes it itself.
    assert client.embeddings.create(model="x", input=TEXTS[0]).data[0].embedding == pytest.approx(floats, abs=1e-6)


def test_token_id_inputs(embedding_server: ServerProcess, model: Any, client: openai.OpenAI) -> None:
    ids = model.vocab.tokenize(TEXTS[0], add_special=True)
    by_text = client.embeddings.create(model="x", input=TEXTS[0], encoding_format="float").data[0].embedding
    by_ids = client.embeddings.create(model="x", input=ids, encoding_format="float").data[0].embedding
    assert cosine(by_text, by_ids) == pytest.approx(1.0, abs=1e-5)
    two = client.embeddings.create(model="x", input=[ids, ids[:3]], encoding_format="float").data
    assert len(two) == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": "word " * 400}, "input"),
        ({"input": [1, 99_999_999]}, "input"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": ["x"] * 257}, "input"),
        ({"input": "abc\ud800def"}, "input"),
        ({"input": ["ok", "x\udfff"]}, "input[1]"),
        ({"input": "x", "user": "\udc00"}, "user"),
    ],
    ids=["empty", "empty-in-list", "too-long", "unknown-token", "dimensions", "too-many", "surrogate",
         "surrogate-in-list", "surrogate-in-user"],
)  # fmt: skip
def test_bad_inputs_are_400s(embedding_server: ServerProcess, body: dict[str, Any], param: str) -> None:
    # json.dumps writes a lone surrogate as the escape a client's JSON would carry.
    content = json.dumps(body).encode()
    response = httpx.post(
        embedding_server.url + "/v1/embeddings",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_off_unless_asked(server: ServerProcess) -> None:
    response = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert response.status_code == 404
    assert "--embeddings" in response.json()["error"]["message"]


# -- llama-server's own embeddings: /embedding, and /embeddings given "content" ------------------


def test_llama_servers_embeddings_shape_and_normalisations(
    embedding_server: ServerProcess, client: openai.OpenAI
) -> None:
    url = embedding_server.url
    openai_vector = client.embeddings.create(model="x", input=TEXTS[0], encoding_format="float").data[0].embedding
    for path, field in (("/embedding", "content"), ("/embedding", "input"), ("/embeddings", "content")):
        answer = httpx.post(url + path, json={field: TEXTS[0]}, timeout=60)
        assert answer.status_code == 200, answer.text
        (item,) = answer.json()
        assert set(item) == {"index", "embedding"} and item["index"] == 0
        (vector,) = item["embedding"]  # a list holding the pooled vector, as llama-server writes it
        assert vector == pytest.approx(openai_vector, abs=1e-5)  # unit length by default (embd_normalize 2)
    raw = httpx.post(url + "/embedding", json={"content": TEXTS[0], "embd_normalize": -1}, timeout=60).json()
    (plain,) = raw[0]["embedding"]
    length = math.sqrt(sum(v * v for v in plain))
    assert [v / length for v in plain] == pytest.approx(openai_vector, abs=1e-5)
    for norm, size in ((1, lambda v: sum(abs(x) for x in v)), (3, lambda v: sum(abs(x) ** 3 for x in v) ** (1 / 3))):
        body = {"content": TEXTS[0], "embd_normalize": norm}
        (scaled,) = httpx.post(url + "/embedding", json=body, timeout=60).json()[0]["embedding"]
        assert size(scaled) == pytest.approx(1.0, abs=1e-4)
    # a large p: the largest magnitude (no power of a float overflows, none underflows to zero)
    (high,) = httpx.post(url + "/embedding", json={"content": TEXTS[0], "embd_normalize": 1000}, timeout=60).json()[0][
        "embedding"
    ]
    assert max(abs(v) for v in high) == pytest.approx(1.0, abs=0.01)
    body = {"content": TEXTS[0], "embd_normalize": 0}
    (int16,) = httpx.post(url + "/embedding", json=body, timeout=60).json()[0]["embedding"]
    assert max(abs(v) for v in int16) == pytest.approx(32760, abs=0.5)


def test_llama_servers_input_shapes(embedding_server: ServerProcess, model: Any) -> None:
    url = embedding_server.url + "/embedding"
    ids = model.vocab.tokenize(TEXTS[1], add_special=True)

    def vectors(content: Any) -> list[list[float]]:
        answer = httpx.post(url, json={"content": content}, timeout=60)
        assert answer.status_code == 200, answer.text
        return [item["embedding"][0] for item in answer.json()]

    (by_text,) = vectors(TEXTS[1])
    (by_ids,) = vectors(ids)  # token ids: one input
    assert cosine(by_text, by_ids) == pytest.approx(1.0, abs=1e-5)
    several = vectors([TEXTS[0], ids, [ids[0], TEXTS[1][1:]]])  # strings, ids, ids and text mixed
    assert len(several) == 3 and cosine(several[1], by_text) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"content": ""}, "content"),
        ({"content": ["ok", ""]}, "content[1]"),
        ({"content": [1, 99_999_999]}, "content"),
        ({"content": [1.5]}, "content"),
        ({"content": "x", "embd_normalize": -2}, "embd_normalize"),
        ({"content": "x", "embd_normalize": True}, "embd_normalize"),
        ({"content": "x", "embd_normalize": 2**31}, "embd_normalize"),
        ({"content": "x", "embd_normalize": 10**300}, "embd_normalize"),
        ({"content": "x", "encoding_format": "base64"}, "encoding_format"),
        ({"content": ["x"] * 257}, "content"),
    ],
    ids=["nothing", "empty", "empty-in-list", "unknown-token", "float", "bad-norm", "bool-norm", "huge-norm", "huger-norm",
         "base64", "too-many"],
)  # fmt: skip
def test_llama_servers_bad_inputs_are_400s(embedding_server: ServerProcess, body: dict[str, Any], param: str) -> None:
    response = httpx.post(embedding_server.url + "/embedding", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param if "param" in error else param in error["message"], error


@pytest.mark.parametrize(
    ("value", "param", "needle"),
    [
        (["x"] * 257, "input", "at most 256 items"),
        ([], "input", "at least 1 item"),
        ([[1], []], "input[1]", "at least 1 item"),
        ([-1], "input[0]", "greater than or equal to 0"),
        ([[1], [-2]], "input[1][0]", "greater than or equal to 0"),
        ([1, "a"], "input[1]", "valid integer"),
        (5, "input", "a string, strings, token ids or lists of token ids"),
    ],
    ids=["257-inputs", "empty-list", "empty-token-list", "negative-id", "negative-id-in-list", "text-among-ids",
         "a-number"],
)  # fmt: skip
def test_bad_input_shapes_say_what_is_wrong(
    embedding_server: ServerProcess, value: Any, param: str, needle: str
) -> None:
    """Found by review: each of these was "input: Input should be a valid string" (the first
    shape pydantic tried), whatever was wrong."""
    response = httpx.post(embedding_server.url + "/v1/embeddings", json={"input": value}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


@pytest.mark.parametrize(
    ("field", "value"),
    [("dimensions", 10), ("foo", 1), ("pooling", "mean"), ("truncate", True), ("input", "y")],
)
def test_llama_servers_embeddings_refuse_fields_not_their_own(
    embedding_server: ServerProcess, field: str, value: Any
) -> None:
    """Found by review: /embedding and /embeddings (given content) dropped any other field
    (dimensions answered the whole vector), and /embedding given content and input embedded
    input. Both routes refuse them, each in its shape (/embeddings is an OpenAI route)."""
    for path in ("/embedding", "/embeddings"):
        response = httpx.post(embedding_server.url + path, json={"content": "x", field: value}, timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert field in error["message"], error
        if path == "/embedding":  # llama-server's shape
            assert set(error) == {"code", "message", "type"} and error["code"] == 400
        else:
            assert error["param"] == ("input" if field == "input" else field)
        # A field set to null sets nothing.
        assert (
            httpx.post(embedding_server.url + path, json={"content": "x", field: None}, timeout=60).status_code == 200
        )


def test_every_input_token_is_an_output(embedding_server: ServerProcess, model: Any) -> None:
    """Found by review: every decode logged llama.cpp's warning "embeddings required but some
    input tokens were not marked as outputs -> overriding" (the embedder marked only the last
    token). The vectors are what they were (tests/test_ffi.py compares both ways in one process)."""
    url = embedding_server.url + "/embedding"
    ids = model.vocab.tokenize(TEXTS[3], add_special=True)
    by_text, by_ids, again = (
        httpx.post(url, json={"content": content}, timeout=60).json()[0]["embedding"]
        for content in (TEXTS[3], ids, TEXTS[3])
    )
    assert by_text == by_ids == again
    assert "not marked as outputs" not in embedding_server.log
