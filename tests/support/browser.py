"""The chat page in a real browser: Debian's ``chromium``, headless, driven by Selenium through
Debian's ``chromedriver`` (``make test`` installs both when missing). No browser is downloaded.

``open_browser`` starts one Chromium; ``ChatPage`` is the page of one server in it, with the
steps a person takes (type, send, stop, give a key) and what they would read (answers, stats,
errors), plus what a test checks underneath (console errors, every URL requested).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement

from tests.support.needs import needs
from tests.support.waiting import wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Headless as root in a container: no sandbox (it needs user namespaces), /tmp instead of a
# small /dev/shm; no background traffic of the browser's own (updates, sync, metrics).
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
# How long a step the page takes on its own may last before a test gives up (a whole short
# answer on a busy two-core machine included).
STEP_S = 60.0


def open_browser(width: int = 1000, height: int = 800) -> WebDriver:
    """A headless Chromium with its console and network logs kept for ``get_log``."""
    needs("browser", "Chromium")
    for program in (CHROMIUM, CHROMEDRIVER):
        if not pathlib.Path(program).exists():
            raise RuntimeError(
                f"{program} is missing: `make test` installs Debian's chromium and chromium-driver "
                "(apt-get install chromium chromium-driver)"
            )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


_SNAPSHOT = """
const texts = (css) => [...document.querySelectorAll(css)].map((e) => e.textContent);
return {
  answers: texts('.msg.assistant .content'),
  stats: texts('.msg.assistant .stats'),
  errors: texts('#log .error'),
  busy: !document.getElementById('stop').disabled,
};
"""


class ChatPage:
    """The chat page of the server at ``url`` in ``driver``."""

    def __init__(self, driver: WebDriver, url: str) -> None:
        self.driver = driver
        self.url = url

    # -- loading -------------------------------------------------------------------------------

    def load(self, *, key: str | None = None) -> ChatPage:
        """Open the page afresh; with ``key``, as a browser that kept that API key (None: none
        kept). The logs hold this load's entries only."""
        self.driver.get(self.url + "/")
        self.driver.execute_script("localStorage.clear()")
        if key is not None:
            self.driver.execute_script("localStorage.setItem('llama-trio.api-key', arguments[0])", key)
        self.console()
        self.requested_urls()
        self.driver.get(self.url + "/")
        self.wait(lambda: self.driver.execute_script("return document.documentElement.dataset.ready"), "the script")
        return self

    def element(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def wait(self, predicate: Any, what: str, timeout: float = STEP_S) -> float:
        return wait_for(predicate, what, timeout)

    # -- what a person does --------------------------------------------------------------------

    def settings(self, **values: str) -> None:
        """Fill settings fields by id (``system``, ``temperature``, ``max_tokens``, ``extra``)."""
        details = self.element("#settings")
        if not details.get_attribute("open"):
            self.element("#settings summary").click()
        for name, value in values.items():
            field = self.element("#" + name.replace("_", "-"))
            field.clear()
            if value:
                field.send_keys(value)

    def type(self, text: str) -> None:
        """Type into the message box; newlines as Shift+Enter, as a person would."""
        box = self.element("#input")
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if i:
                box.send_keys(Keys.SHIFT, Keys.ENTER)  # Selenium releases Shift after the call
            box.send_keys(line)

    def send(self, text: str) -> None:
        """Type ``text`` and press Enter."""
        self.type(text)
        self.element("#input").send_keys(Keys.ENTER)

    def set_text(self, css: str, text: str) -> None:
        """Put a long text into a field at once (typing it key by key takes seconds)."""
        self.driver.execute_script("document.querySelector(arguments[0]).value = arguments[1]", css, text)

    def click(self, element_id: str) -> None:
        self.element("#" + element_id).click()

    def give_key(self, key: str) -> None:
        field = self.element("#key")
        field.send_keys(key)
        field.send_keys(Keys.ENTER)

    # -- what a person reads -------------------------------------------------------------------

    def texts(self, css: str) -> list[str]:
        """The exact ``textContent`` of every element matching ``css``, in order."""
        return list(
            self.driver.execute_script(
                "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)", css
            )
        )

    def answers(self) -> list[str]:
        return self.texts(".msg.assistant .content")

    def stats(self) -> list[str]:
        return self.texts(".msg.assistant .stats")

    def errors(self) -> list[str]:
        return self.texts("#log .error")

    def busy(self) -> bool:
        """An answer is in progress (Stop is enabled)."""
        return bool(self.driver.execute_script("return !document.getElementById('stop').disabled"))

    def snapshot(self) -> dict[str, Any]:
        """answers, stats, errors and busy, in one round trip (for polling)."""
        return dict(self.driver.execute_script(_SNAPSHOT))

    def wait_answered(self, count: int) -> str:
        """Wait until the ``count``-th answer has its statistics; returns them. An error on the
        page fails at once, with what the page shows."""

        def answered() -> bool:
            now = self.snapshot()
            if now["errors"] and not now["busy"]:
                raise AssertionError(f"the page shows an error instead of answer {count}: {now}")
            return len(now["stats"]) >= count and bool(now["stats"][count - 1]) and not now["busy"]

        self.wait(answered, f"answer {count}")
        return self.stats()[count - 1]

    # -- underneath ----------------------------------------------------------------------------

    def console(self) -> list[dict[str, Any]]:
        """Console entries since the last call (errors are level SEVERE)."""
        return list(self.driver.get_log("browser"))

    def requested_urls(self) -> set[str]:
        """Every URL the page requested since the last call (from the DevTools network log)."""
        urls = set()
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                urls.add(message["params"]["request"]["url"])
        return urls
