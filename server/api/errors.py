"""``ApiError``: an error answered in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, and the mapping from engine errors and pydantic locations to it."""

from __future__ import annotations

import json

from quart import Response

from server.engine import ContextLengthExceeded, EngineError


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return Response(json.dumps(body), status=self.status, headers=self.headers, content_type="application/json")

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
            return cls(400, message, param=param, code=exc.code)
        if exc.status == 400:
            return cls(400, str(exc), param=param, code=exc.code)
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return cls(exc.status, str(exc), type_="server_error", code=exc.code, headers=headers)


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
