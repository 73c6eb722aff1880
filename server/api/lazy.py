"""``deferred``: a module imported just after the server's start rather than during it.

The request models (``schema``, built on pydantic), the model list's models and the agent
families' parsers, renderers and streams are about 0.1 s of Python that every start would pay
before ``/health`` answers: more than llama.cpp's load of a small model, which runs beside the
imports. The modules that use them hold a ``Deferred`` in their place: a stand-in whose
attribute reads are the module's own, the first one importing it. Once the server is ready,
``import_deferred`` imports the deferred modules that every client needs in a worker thread
(the server's lifecycle calls it), so that the first request rarely waits for them; the agent
families' (``warm=False``) wait for their first request.

Thread safety is Python's own: ``Deferred`` imports with ``importlib.import_module``, so a read
on the event loop while the worker thread is importing the module waits for that import to end,
as any import does across threads, and never sees a module half run. (The standard library's
``LazyLoader`` runs a module's code at its first attribute read without a lock on Python 3.11,
so it is not used.)

A deferred module built on pydantic ends with ``build_models(globals())``: its models'
validators (``defer_build`` leaves them to their first use) are built by its import, under the
import's lock (in the warm-up thread, or a family's first request), where no request races the
build; the first build also reads every installed package's entry points (pydantic's plugins).

A module that uses one writes, for mypy's sake::

    if TYPE_CHECKING:
        from server.api import schema
    else:
        schema = deferred("server.api.schema")
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

_DEFERRED: dict[str, None] = {}  # every deferred module's name, in the order first deferred


class Deferred:
    """A stand-in for the module ``name``: each attribute read is the module's own."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:  # only for names not on the stand-in itself
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


def deferred(name: str, *, warm: bool = True) -> Deferred:
    """A stand-in for the module ``name``, imported at the first attribute read, or by
    ``import_deferred`` unless ``warm`` is false (what only some clients use: imported just
    after the start, it would share the GIL with the first requests for nothing). A name that
    does not exist raises ``ModuleNotFoundError`` now."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    if warm:
        _DEFERRED[name] = None
    return Deferred(name)


def deferred_names() -> list[str]:
    return list(_DEFERRED)


def import_deferred() -> None:
    """Import every deferred module (a worker thread's work, once the server is ready)."""
    for name in list(_DEFERRED):
        importlib.import_module(name)


def build_models(namespace: dict[str, Any]) -> None:
    """Build the validator of each pydantic model that the module ``namespace`` defines."""
    from pydantic import BaseModel

    for value in list(namespace.values()):
        if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == namespace["__name__"]:
            value.model_rebuild()
