"""``lazy_module``: a module executed at its first use rather than at the server's start.

An API family that only some clients speak (Anthropic's Messages, OpenAI's Responses) keeps its
request models, renderers and stream dialect in modules of their own; building their pydantic
models and dataclasses is about 12 ms of Python that every start would pay before ``/health``
answers. The family's routes are registered at start as always, and these modules are made by
the standard library's ``importlib.util.LazyLoader``: the module object exists at once (so
``from server.api import anthropic_parse`` elsewhere gets the same object) and its code runs at
the first attribute read, which is the family's first request, on the event loop's thread.

The first read must not race another thread's: Python 3.11's lazy module takes no lock. Route
handlers run on the one event-loop thread, so they never race; nothing reads these modules from
a worker thread before a route has.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """The module ``name``: the one already imported, else one whose code runs at its first
    attribute read. A name that does not exist raises ``ModuleNotFoundError`` now."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
