"""Saves the chat page after one finished exchange, as the README shows it (docs/webui.png).

    .venv/bin/python -m tests.webui_screenshot [PATH]

Starts the default model on a free port and Chromium headless (as the browser tests do);
the answer comes from the real model, so the picture changes from run to run.
"""

from __future__ import annotations

import pathlib
import sys

from tests.support.browser import ChatPage, open_browser
from tests.support.process import ROOT, ServerProcess

QUESTION = "How do I reverse a list in Python? Show a short example."


def main(path: pathlib.Path) -> None:
    with ServerProcess(["--parallel", "1", "--ctx-size", "2048"]) as server:
        server.wait_ready()
        driver = open_browser(width=900, height=860)
        try:
            page = ChatPage(driver, server.url).load()
            page.wait(lambda: page.element("#model").text.endswith(".gguf"), "the model's name")
            page.settings(system="You are a concise assistant.", temperature="0", max_tokens="200")
            page.element("#settings summary").click()  # closes them again: the conversation is the picture
            page.send(QUESTION)
            page.wait_answered(1)
            driver.save_screenshot(str(path))
        finally:
            driver.quit()
        server.stop()
    print(f"saved {path}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "webui.png")
