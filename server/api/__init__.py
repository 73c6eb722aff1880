"""The HTTP API as a Quart-Trio app: every API family's routes over the one request path.

- ``app``: ``create_app`` composes ``middleware`` (keys, CORS, limits, error handlers), one
  blueprint per API family (``openai``; ``native`` for llama.cpp's own routes, with
  ``native_schema``, ``native_render``, ``native_stream``, ``native_infill``, ``native_slots``;
  ``ops`` for ``/health`` and ``/metrics``) and ``webui``;
- ``preflight``: the checks every route makes first; ``prepare``: the internal request to a
  ``Job`` (the one request path); ``prompt``: prompt text to tokens (control tokens only from
  the template); ``constraints`` and ``tools``: what the output must follow;
- ``collect``: a whole answer; ``streaming``: the one SSE body loop, over a ``StreamDialect``
  (``openai_stream`` for OpenAI's chunks);
- ``schema``: the wire schema (pydantic); ``sse``: pure SSE framing; ``errors``: ``ApiError``
  and the one engine-error mapping; ``respond``: the app's state and JSON answers;
- ``trace``: one request's timing and access-log line; ``webui``: the chat page at ``/``.

The api reaches the transport only through ``server.net.transport``.
"""
