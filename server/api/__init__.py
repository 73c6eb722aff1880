"""The HTTP API: OpenAI-compatible routes over the engine, as a Quart-Trio app.

- ``app``: ``create_app``, routes, middleware, error handlers;
- ``completions``: the completion endpoints' handler and the non-streamed answer;
- ``streaming``: the SSE body and its fast path (the one module that reaches under Quart and
  Hypercorn, and the only one that imports ``server.net``);
- ``prepare``: request body to ``Job``; ``prompt``: prompt text to tokens (control tokens only
  from the template);
- ``schema``: the wire schema (pydantic); ``sse``: pure SSE framing; ``errors``: ``ApiError``;
- ``trace``: one request's timing and access-log line; ``metrics``: the Prometheus registry;
- ``webui``: the chat page at ``/`` (its files live in ``server/webui/``).
"""
