"""The chat page at ``/`` in real headless Chromium against real servers and the real model.

One browser for the module. The page of the default server (``server`` fixture) streams,
stops, and shows model output as text; a server with an API key and tiny limits (``strict``)
gives the page its 401, 400 and 503. The page's pure parts (SSE parser, code fences) are
checked in the same browser; its headers and ``--no-webui`` through the app in process.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.keys import Keys

from server.api.app import create_app
from server.api.webui import CONTENT_SECURITY_POLICY
from server.settings import Settings
from tests.support.browser import ChatPage, open_browser
from tests.support.process import NO_END_TOKENS, ServerProcess, serving
from tests.support.waiting import wait_for

KEY = "webui-test-key"
STRICT_CTX = 512  # one sequence of 512 cells: a long message is a 400
NO_END = json.dumps({"logit_bias": NO_END_TOKENS})  # answers run to max tokens
STOPPED = re.compile(r"^TTFT \d+ ms · \d+\.\d tokens/s · (\d+) tokens · stopped$")  # no usage chunk came
STATS = re.compile(r"^TTFT \d+ ms · \d+\.\d tokens/s · (\d+) tokens · (\d+)/(\d+) prompt tokens cached(?: · (.+))?$")
# An answer a grammar forces whole arrives in one or two pieces (fast-forward), so no rate.
FORCED_STATS = re.compile(r"^TTFT \d+ ms · (?:\d+\.\d tokens/s · )?(\d+) tokens · (\d+)/(\d+) prompt tokens cached$")
# What the model is made to write (a grammar allows only this text): markup that would run
# script if it were ever parsed as HTML, in the text and inside a fenced code block.
HOSTILE_TEXT = '<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>'
HOSTILE_CODE = "<script>window.pwned=3</script><img src=x onerror=window.pwned=4>"
HOSTILE_ANSWER = f"{HOSTILE_TEXT}\n```html\n{HOSTILE_CODE}\n```"


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    browser = open_browser()
    yield browser
    browser.quit()


@pytest.fixture
def page(driver: WebDriver, server: ServerProcess) -> ChatPage:
    return ChatPage(driver, server.url).load()


@pytest.fixture(scope="module")
def strict() -> Iterator[ServerProcess]:
    args = ["--api-key", KEY, "--parallel", "1", "--max-queue", "1", "--ctx-size", str(STRICT_CTX), "--threads", "2"]
    with serving(args) as proc:
        yield proc


def severe(page: ChatPage) -> list[str]:
    return [entry["message"] for entry in page.console() if entry["level"] == "SEVERE"]


def metric(server: ServerProcess, name: str, headers: dict[str, str] | None = None) -> float:
    samples = server.metrics(headers)
    return sum(value for key, value in samples.items() if key == name or key.startswith(name + "{"))


# -- loading ---------------------------------------------------------------------------------


@pytest.mark.browser
def test_page_loads_clean_with_nothing_from_another_host(page: ChatPage, server: ServerProcess) -> None:
    model_id = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    page.wait(lambda: page.element("#model").text == model_id, "the model's name")
    assert [(e["level"], e["message"]) for e in page.console() if e["level"] in {"SEVERE", "WARNING"}] == []
    urls = page.requested_urls()
    own = {server.url + path for path in ("/", "/webui/chat.js", "/webui/chat.css", "/v1/models")}
    assert own <= urls  # the log is read (this cannot pass on an empty one)
    assert [url for url in urls if not url.startswith((server.url + "/", "data:"))] == []
    # The policy holds in the browser: no other origin, no string as HTML.
    other_host = "const i = document.createElement('img'); i.src = 'http://192.0.2.1/x.png'; document.body.append(i); return i.complete"
    page.driver.execute_script(other_host)
    page.wait(
        lambda: page.driver.execute_script("return document.querySelector('body > img').complete"), "the image", 10
    )
    refused = [m for m in severe(page) if "'http://192.0.2.1/x.png'" in m and "Content Security Policy" in m]
    assert refused, "the browser did not refuse the image"
    trusted = (
        "try { document.createElement('div').innerHTML = '<b>x</b>'; return 'assigned' } catch (e) { return e.name }"
    )
    assert page.driver.execute_script(trusted) == "TypeError"
    for path in ("/", "/webui/chat.js", "/webui/chat.css", "/webui/stream.js", "/webui/render.js"):
        response = httpx.get(server.url + path)
        assert response.status_code == 200
        assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["X-Content-Type-Options"] == "nosniff"


# -- answering -------------------------------------------------------------------------------


@pytest.mark.browser
def test_answer_streams_in_with_its_stats(page: ChatPage, server: ServerProcess) -> None:
    page.settings(temperature="0", max_tokens="48", extra=NO_END, system="You are a friendly assistant.")
    page.send("Tell me about llamas.\nAnd about alpacas.")
    assert page.texts(".msg.user .content") == ["Tell me about llamas.\nAnd about alpacas."]  # Shift+Enter
    seen: list[str] = []

    def growing() -> bool:
        now = page.snapshot()
        if now["answers"] and now["answers"][0] and (not seen or now["answers"][0] != seen[-1]):
            seen.append(now["answers"][0])
        return not now["busy"]

    page.wait(growing, "the answer")
    final = page.answers()[0]
    assert len(seen) >= 3, seen  # it grew over several reads
    assert all(final.startswith(text) for text in seen)
    match = STATS.match(page.stats()[0])
    assert match, page.stats()
    assert match.group(1) == "48" and match.group(4) == "reached max tokens"

    page.settings(max_tokens="8", extra="")
    page.send("Thank you.")
    match = STATS.match(page.wait_answered(2))
    assert match, page.stats()
    assert int(match.group(2)) > 0  # the first turn's prefix came from the cache

    page.click("regenerate")
    match = STATS.match(page.wait_answered(2))
    assert match and int(match.group(2)) > 0, page.stats()
    assert len(page.answers()) == 2 and len(page.texts(".msg.user")) == 2
    page.click("clear")
    assert page.texts("#log > *") == []
    assert severe(page) == []


@pytest.mark.browser
def test_stop_frees_the_sequence_within_a_second(page: ChatPage, server: ServerProcess) -> None:
    page.settings(max_tokens="900", extra=NO_END)
    cancelled = metric(server, "llama_trio_cancellations_total")
    page.send("Write a long story about a lighthouse keeper.")
    page.wait(lambda: len("".join(page.answers())) > 40, "the answer to begin")
    assert metric(server, "llama_trio_active_sequences") == 1
    clicked = time.monotonic()
    page.click("stop")
    wait_for(
        lambda: (
            metric(server, "llama_trio_cancellations_total") == cancelled + 1
            and metric(server, "llama_trio_active_sequences") == 0
        ),
        "the cancellation in /metrics",
        timeout=1.0 - (time.monotonic() - clicked),  # a second from the click, the click included
    )
    match = STOPPED.match(page.stats()[0])
    assert match, page.stats()
    assert int(match.group(1)) < 900
    stopped_text = page.answers()[0]

    page.settings(max_tokens="8")  # the end tokens still banned: an answer of 8 tokens
    page.send("Now just say hello.")
    match = STATS.match(page.wait_answered(2))
    assert match and match.group(1) == "8" and match.group(4) == "reached max tokens", page.stats()
    assert page.answers()[1]
    assert page.answers()[0] == stopped_text  # nothing arrived after the stop
    assert page.errors() == [] and severe(page) == []


@pytest.mark.browser
def test_model_output_is_text_and_runs_nothing(page: ChatPage, server: ServerProcess) -> None:
    # The grammar makes the real model write exactly HOSTILE_ANSWER, streamed through the page's
    # own rendering (in few pieces: the grammar forces it); the user's message carries markup too.
    extra = json.dumps({"grammar": "root ::= " + json.dumps(HOSTILE_ANSWER)})
    page.settings(temperature="0", max_tokens="120", extra=extra)
    page.send('Repeat: <img src=x onerror="window.pwned=5"><script>window.pwned=6</script>')
    stats = page.wait_answered(1)
    assert FORCED_STATS.match(stats), stats
    assert page.texts(".msg.user .content") == [
        'Repeat: <img src=x onerror="window.pwned=5"><script>window.pwned=6</script>'
    ]
    assert page.texts(".msg.assistant .content .text") == [HOSTILE_TEXT]
    assert page.texts(".msg.assistant .content pre code") == [HOSTILE_CODE]
    assert page.texts(".msg.assistant .content pre") == [HOSTILE_CODE]  # nothing but the code in it
    assert page.element(".msg.assistant pre").get_attribute("data-lang") == "html"
    assert HOSTILE_TEXT in page.element(".msg.assistant .content").text  # visible, literally
    elements = "return document.querySelectorAll('#log img, #log script, #log iframe, #log [onerror]').length"
    assert page.driver.execute_script(elements) == 0
    assert page.driver.execute_script("return window.pwned") is None
    assert severe(page) == []  # not even a refused inline handler


@pytest.mark.browser
def test_a_phone_sized_window_and_the_keyboard(page: ChatPage, server: ServerProcess) -> None:
    page.driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 360, "height": 740, "deviceScaleFactor": 2, "mobile": True}
    )
    try:
        page.settings(max_tokens="900", extra=NO_END)
        page.element("#settings summary").click()
        page.send("Spell this: " + "llama" * 40)  # one long word
        page.wait(lambda: len("".join(page.answers())) > 20, "the answer to begin")
        page.element("#input").send_keys(Keys.ESCAPE)  # Escape stops
        page.wait(lambda: not page.busy(), "the stop")
        assert STOPPED.match(page.stats()[0]), page.stats()
        layout = page.driver.execute_script(
            "const r = (id) => document.getElementById(id).getBoundingClientRect();"
            "const log = document.getElementById('log');"
            "return {scroll: document.documentElement.scrollWidth, width: window.innerWidth,"
            " log_scroll: log.scrollWidth, log_width: log.clientWidth,"
            " height: window.innerHeight, send: r('send'), stop: r('stop'), input: r('input')}"
        )
        assert layout["width"] == 360 and layout["scroll"] <= layout["width"], layout  # no sideways scrolling
        assert layout["log_scroll"] <= layout["log_width"], layout
        for control in ("send", "stop", "input"):
            box = layout[control]
            assert 0 <= box["left"] and box["right"] <= 360 and box["bottom"] <= layout["height"], (control, layout)
    finally:
        page.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.server
def test_a_401_asks_for_the_key_then_works(driver: WebDriver, strict: ServerProcess) -> None:
    page = ChatPage(driver, strict.url).load()
    page.wait(lambda: page.element("#key-form").is_displayed(), "the key form")  # /v1/models was refused
    assert page.element("#key-reason").text == (
        "The server asks for an API key: missing API key (Authorization: Bearer <key>)"
    )
    page.settings(temperature="0", max_tokens="8")
    page.send("Hello!")
    page.wait(page.errors, "the 401 message")
    assert page.errors() == [
        "The server needs an API key (401 invalid_api_key): missing API key (Authorization: Bearer <key>)"
    ]
    page.give_key("not-the-key")  # retried, refused again
    page.wait(lambda: page.element("#key-form").is_displayed() and page.errors(), "the second 401")
    assert page.element("#key-reason").text == "The server asks for an API key: invalid API key"
    page.give_key(KEY)  # retried, answered
    assert STATS.match(page.wait_answered(1)), page.stats()
    assert page.errors() == [] and len(page.answers()) == 1
    assert not page.element("#key-form").is_displayed()
    assert driver.execute_script("return localStorage.getItem('llama-trio.api-key')") == KEY
    page.wait(lambda: page.element("#model").text.endswith(".gguf"), "the model's name")

    driver.refresh()  # the key is kept
    page.wait(lambda: page.element("#model").text.endswith(".gguf"), "the model's name after a reload")
    assert not page.element("#key-form").is_displayed()


@pytest.mark.browser
@pytest.mark.server
def test_a_400_and_a_503_show_the_servers_message(driver: WebDriver, strict: ServerProcess) -> None:
    page = ChatPage(driver, strict.url).load(key=KEY)
    page.settings(temperature="0", max_tokens="8", extra="{nope")  # the page's own check first
    page.send("Hello")
    page.wait(page.errors, "the page's refusal")
    assert page.errors() == ["Not sent: the extra request fields are not valid JSON."]
    page.settings(extra="")
    page.click("clear")

    page.set_text("#input", "llama " * (STRICT_CTX + 100))
    page.click("send")
    page.wait(page.errors, "the 400 message")
    assert re.fullmatch(
        r"The server refused the request \(400 context_length_exceeded\): This model's maximum context length "
        rf"is {STRICT_CTX} tokens\. However, your messages resulted in \d+ tokens\. Please reduce the length "
        r"of the messages\.",
        page.errors()[0],
    ), page.errors()
    assert page.answers() == []
    page.click("clear")

    # Fill the one sequence and the one queue place, then ask from the page.
    auth = {"Authorization": f"Bearer {KEY}"}
    hog = {"messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": 400}
    with httpx.Client(base_url=strict.url, headers=auth, timeout=60) as client, contextlib.ExitStack() as stack:
        running = stack.enter_context(
            client.stream("POST", "/v1/chat/completions", json=hog | {"logit_bias": NO_END_TOKENS})
        )
        lines = running.iter_lines()  # held: a dropped iterator would close the response
        next(lines)
        queued = stack.enter_context(client.stream("POST", "/v1/chat/completions", json=hog))
        assert queued.status_code == 200
        wait_for(lambda: metric(strict, "llama_trio_queue_depth", auth) == 1, "the queued request", 30)
        page.send("Hello?")
        page.wait(page.errors, "the 503 message")
        assert page.errors() == [
            "The server is busy (503 overloaded): the request queue is full; retry later (retry after 1 s)"
        ]
    gone = ("llama_trio_active_sequences", "llama_trio_queue_depth")
    wait_for(lambda: not any(metric(strict, name, auth) for name in gone), "the hogs to go", 30)
    page.click("regenerate")  # and now it is served
    assert STATS.match(page.wait_answered(1)), page.stats()
    assert page.errors() == []


@pytest.mark.browser
@pytest.mark.server
def test_a_lost_server_is_said_so(driver: WebDriver) -> None:
    with ServerProcess(["--parallel", "1", "--ctx-size", "1024", "--threads", "1"]) as proc:
        proc.wait_ready()
        page = ChatPage(driver, proc.url).load()
        page.settings(max_tokens="900", extra=NO_END)
        page.send("Write a long story.")
        page.wait(lambda: len("".join(page.answers())) > 20, "the answer to begin")
        proc.proc.kill()
        proc.proc.wait()
        page.wait(page.errors, "the lost connection")
        assert page.errors()[0].startswith("Connection lost: "), page.errors()
        assert page.answers() and page.element(".msg.assistant").get_attribute("class") == "msg assistant failed"
        page.send("Are you there?")
        page.wait(lambda: len(page.errors()) == 2, "the unreachable server")
        assert page.errors()[1].startswith("Cannot reach the server ("), page.errors()


# -- the page's pure parts, in the same browser ----------------------------------------------

PURE = """
const done = arguments[arguments.length - 1];
Promise.all([import('/webui/stream.js'), import('/webui/render.js')]).then(([stream, render]) => {
  const wire = arguments[0];
  const whole = new stream.SSEParser().feed(wire);
  const cut = [];  // the same events wherever the text is cut, in two places
  for (let i = 0; i <= wire.length; i++) {
    for (let j = i; j <= wire.length; j++) {
      const parser = new stream.SSEParser();
      const events = [wire.slice(0, i), wire.slice(i, j), wire.slice(j)].flatMap((part) => parser.feed(part));
      if (JSON.stringify(events) !== JSON.stringify(whole)) cut.push([i, j, events]);
    }
  }
  const fences = arguments[1].map((text) => render.splitFences(text));
  done({ whole, cut: cut.slice(0, 3), fences });
}).catch((err) => done({ error: String(err) }));
"""


@pytest.mark.browser
def test_sse_parser_and_code_fences(page: ChatPage) -> None:
    wire = ': ping\r\n\r\ndata: {"a": 1}\r\n\r\ndata: x\ndata:y\n\nevent: e\rdata: z\r\r: c\nid: 1\n\ndata: [DONE]\n\n'
    texts = ["a\n```py\nx = '<b>'\n```\nb", "streaming ```\n```js\nlet x", "no fence"]
    result = page.driver.execute_async_script(PURE, wire, texts)
    assert result.get("error") is None, result
    assert result["whole"] == ['{"a": 1}', "x\ny", "z", "[DONE]"]
    assert result["cut"] == []
    assert result["fences"] == [
        [
            {"kind": "text", "text": "a", "lang": ""},
            {"kind": "code", "text": "x = '<b>'", "lang": "py"},
            {"kind": "text", "text": "b", "lang": ""},
        ],
        [{"kind": "text", "text": "streaming ```", "lang": ""}, {"kind": "code", "text": "let x", "lang": "js"}],
        [{"kind": "text", "text": "no fence", "lang": ""}],
    ]


# -- the routes, in process (no model is loaded: a path that names none will do) -------------

NO_MODEL = "never-loaded.gguf"


async def test_no_webui_leaves_only_the_api() -> None:
    client = create_app(Settings(no_webui=True, model=(NO_MODEL,))).test_client()
    for path in ("/", "/webui/chat.js"):
        response = await client.get(path)
        assert response.status_code == 404
        assert (await response.get_json())["error"]["code"] == "not_found"
    assert (await client.get("/v1/models")).status_code == 200


async def test_the_page_needs_no_key_and_the_api_still_does() -> None:
    client = create_app(Settings(api_key=(KEY,), model=(NO_MODEL,))).test_client()
    page = await client.get("/")
    assert page.status_code == 200
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    script = await client.get("/webui/chat.js")
    assert script.status_code == 200 and script.headers["Content-Type"] == "text/javascript; charset=utf-8"
    assert (await client.get("/v1/models")).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert (await client.get("/v1/models", headers=auth)).status_code == 200
    assert (await client.get("/webui/index.html", headers=auth)).status_code == 404  # only at /
    assert (await client.get("/webui/nothing.js", headers=auth)).status_code == 404
