"""``ApiError``: an error a route answers, and the one mapping from engine errors
(``from_engine``) and pydantic locations (``param_from_loc``) to it. Every route and every
stream uses these; a dialect renders an ``ApiError`` in its own shape (OpenAI's
``{"error": {"message", "type", "param", "code"}}`` is ``body``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from quart import Response

from server.engine import ContextLengthExceeded, EngineError

# llama-server's error type for a prompt longer than a sequence's context.
CONTEXT_TYPE = "exceed_context_size_error"


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}
        # Facts beside OpenAI's fields, as llama-server sends them (a context overflow's
        # ``n_prompt_tokens`` and ``n_ctx``).
        self.extra = extra or {}

    def body(self) -> dict[str, dict[str, str | int | None]]:
        """The error in OpenAI's shape (with ``extra`` beside its fields)."""
        error: dict[str, str | int | None] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}

    def response(self) -> Response:
        return Response(
            json.dumps(self.body()), status=self.status, headers=self.headers, content_type="application/json"
        )

    def renamed(self, names: Sequence[tuple[str, str]]) -> ApiError:
        """This error with its ``param`` (and a message that starts with it) in another
        dialect's terms: ``names`` are (pattern, replacement) pairs, regular expressions that
        match a whole leading part of ``param`` (up to a ``.``, a ``[`` or its end); the first
        that matches is applied. As it is when none does."""
        param = self.param
        if param is None:
            return self
        for pattern, own in names:
            match = re.match(f"(?:{pattern})(?=$|[.\\[])", param)
            if match is None:
                continue
            renamed = match.expand(own) + param[match.end() :]
            message = renamed + self.message[len(param) :] if self.message.startswith(param) else self.message
            error = ApiError(self.status, message, type_=self.type, param=renamed, code=self.code, extra=self.extra)
            error.headers = self.headers
            return error
        return self

    @classmethod
    def unavailable(cls, message: str, *, code: str) -> ApiError:
        """A 503 that a client (or a proxy) may retry after a moment."""
        return cls(503, message, type_="server_error", code=code, headers={"Retry-After": "1"})

    @classmethod
    def from_engine(cls, exc: EngineError, *, param: str | None = None) -> ApiError:
        """The answer for a job the engine refused or ended; ``param`` names the request field
        a 400 is about."""
        if isinstance(exc, ContextLengthExceeded) and exc.limit:
            # OpenAI's words, which clients match (litellm's ContextWindowExceededError).
            what = "messages" if param == "messages" else "prompt"
            message = (
                f"This model's maximum context length is {exc.limit} tokens. However, your {what} "
                f"resulted in {exc.tokens} tokens. Please reduce the length of the {what}."
            )
            # llama-server's type and figures beside OpenAI's code and words (clients of either
            # recognise it: OpenAI's SDKs go by the status, llama.cpp's tools by the type).
            extra = {"n_prompt_tokens": exc.tokens, "n_ctx": exc.limit}
            return cls(400, message, type_=CONTEXT_TYPE, param=param, code=exc.code, extra=extra)
        if exc.status == 400:
            return cls(400, str(exc), param=param, code=exc.code)
        if exc.status == 503:
            return cls.unavailable(str(exc), code=exc.code)
        return cls(exc.status, str(exc), type_="server_error", code=exc.code)


# pydantic names the branch of a union it tried ("str", "list[str]", "function-after[...]") in
# an error's location; those are not fields of the request.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location as the request field it names, e.g. ``messages[0].content``."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item.isidentifier() and item not in _UNION_TAGS:
            parts.append(f".{item}" if parts else item)
    return "".join(parts) or None
