"""Chat templates: the model's own Jinja template, rendered in jinja2's sandbox.

A template that jinja2 cannot compile or render falls back to llama.cpp's built-in template
matcher (``llama_chat_apply_template``). Message content is data: it is passed to the template
as strings and never compiled, so Jinja syntax inside a message comes out as text.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from ffi._lib import ffi, lib
from ffi.errors import TemplateError

if TYPE_CHECKING:
    import jinja2

# jinja2 (~20 ms to import) is imported by the first template that needs it, not by ``import
# ffi``: the server's start begins loading the model before it imports the rest.

logger = logging.getLogger("llama_trio.ffi.chat")

# Used when a model has no template of its own.
DEFAULT_TEMPLATE = "chatml"


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """Renders a list of ``{"role", "content"}`` messages into a prompt string."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or DEFAULT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._jinja: jinja2.Template | None = None
        self.compile_error: str | None = None  # jinja2's, where the source does not compile
        if source and ("{%" in source or "{{" in source):
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._jinja = env.from_string(source)
            except jinja2.TemplateError as exc:
                self.compile_error = str(exc)
                logger.warning("chat template does not compile in jinja2 (%s); using llama.cpp's", exc)

    def check(self) -> None:
        """Raise ``TemplateError`` when no conversation can be rendered: the source neither
        compiles in jinja2 nor is a template llama.cpp knows by its text or name."""
        if self._jinja is not None:
            return
        try:
            apply_builtin_template(self.source, [{"role": "user", "content": "x"}], True)
        except TemplateError:
            why = f" ({self.compile_error})" if self.compile_error else ""
            raise TemplateError(
                f"the chat template neither compiles in jinja2{why} nor is one llama.cpp knows"
            ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, for a template that renders them);
        raises ``TemplateError`` when it cannot be made."""
        if self._jinja is not None:
            import jinja2.exceptions

            try:
                return self._jinja.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    tools=list(tools) if tools else None,
                )
            except TemplateError:
                raise
            except jinja2.exceptions.SecurityError as exc:
                raise TemplateError(f"chat template tried an unsafe operation: {exc}") from None
            except Exception as exc:
                logger.warning("chat template failed to render (%s); using llama.cpp's", exc)
        return apply_builtin_template(self.source, messages, add_generation_prompt)

    @functools.cached_property
    def named_roles(self) -> frozenset[str]:
        """The roles (of system, user and assistant) whose messages' ``name`` this template
        puts in the prompt: a probe name rendered in a short conversation for each."""
        probe = "llamatrioNameProbe"
        conversations = {
            "system": [{"role": "system", "content": "s", "name": probe}, {"role": "user", "content": "u"}],
            "user": [{"role": "user", "content": "u", "name": probe}],
            "assistant": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "name": probe}],
        }
        named = set()
        for role, messages in conversations.items():
            try:
                if probe in self.render(messages, add_generation_prompt=False):
                    named.add(role)
            except TemplateError:
                pass  # a template that refuses the probe is not known to render names
        return frozenset(named)


def apply_builtin_template(template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    """llama.cpp's own renderer, which recognises well-known templates by their text or name."""
    keep: list[Any] = []
    chat = ffi.new("llama_chat_message[]", len(messages))
    total = 0
    for i, message in enumerate(messages):
        role = ffi.new("char[]", message["role"].encode())
        content = ffi.new("char[]", message["content"].encode())
        keep += (role, content)
        chat[i].role = role
        chat[i].content = content
        total += len(message["content"]) + len(message["role"])
    tmpl = template.encode()
    size = 2 * total + 256
    while True:
        buf = ffi.new("char[]", size)
        n = lib.llama_chat_apply_template(tmpl, chat, len(messages), add_generation_prompt, buf, size)
        if n < 0:
            raise TemplateError("llama.cpp does not know this chat template")
        if n <= size:
            return ffi.unpack(buf, n).decode("utf-8", "replace")
        size = n
