"""Import a library without the modules it imports "just in case" and never uses here.

``pydantic_settings.main`` does ``import asyncio`` (about 30 ms: asyncio pulls in ssl,
socket, subprocess...) for ``CliApp.run`` alone, which nothing here calls. Inside
``on_first_use("asyncio")`` that import binds a stand-in: a module object that imports the
real asyncio the first time one of its attributes is read, and hands the attribute over.
The stand-in is in ``sys.modules`` only while the ``with`` block runs, so every later
``import asyncio`` (uvicorn, Celery, a test) gets the real module, loaded as usual.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any


class _OnFirstUse(ModuleType):
    """Stands in for a module that was not imported; the first attribute read imports it."""

    def __getattr__(self, attr: str) -> Any:  # only for what the stand-in itself lacks
        name = self.__name__
        if sys.modules.get(name) is self:  # read inside the ``with`` block
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)


@contextmanager
def on_first_use(*names: str) -> Iterator[None]:
    """While the block runs, ``import NAME`` of a module not yet imported binds a stand-in
    that imports it on first use (see the module's docstring)."""
    stand_ins = {}
    for name in names:
        if name not in sys.modules:
            stand_ins[name] = sys.modules[name] = _OnFirstUse(name)
    try:
        yield
    finally:
        for name, stand_in in stand_ins.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
