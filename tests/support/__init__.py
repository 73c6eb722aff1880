"""Helpers the tests share: a server process, SSE parsing, raw HTTP, waiting, ports, a browser.

One copy of each; a test module imports what it needs (``from tests.support import sse``).
Nothing here imports a test module.
"""
