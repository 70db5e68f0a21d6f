"""Import a library without the modules it imports "just in case" and never uses here.

``pydantic_settings.main`` does ``import asyncio`` (about 30 ms: asyncio pulls in ssl,
socket, subprocess...) for ``CliApp.run`` alone, which nothing here calls; pydantic's plugin
loader does ``from importlib.metadata import entry_points`` (about 20 ms: email, zipfile,
csv...) and calls it only when plugins are not turned off (PYDANTIC_DISABLE_PLUGINS); its
env-file source does ``from dotenv import dotenv_values`` and calls it only for an env_file.
Inside ``on_first_use(...)`` such an import binds a stand-in: a module object that imports
the real module the first time one of its attributes is read, and hands the attribute over;
the ``functions`` it is given are small functions that import the real module when called.
The stand-in is in ``sys.modules`` only while the ``with`` block runs, so every later
``import`` of the module (uvicorn, Celery, a test) gets the real one, loaded as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any


class _OnFirstUse(ModuleType):
    """Stands in for a module that was not imported; the first attribute read imports it."""

    def __getattr__(self, attr: str) -> Any:  # only for what the stand-in itself lacks
        return getattr(_real(self.__name__), attr)


def _real(name: str) -> ModuleType:
    module = sys.modules.get(name)
    if isinstance(module, _OnFirstUse):  # used inside the ``with`` block
        del sys.modules[name]
    return importlib.import_module(name)


def _deferred(name: str, function: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(_real(name), function)(*args, **kwargs)

    call.__name__ = call.__qualname__ = function
    return call


@contextmanager
def on_first_use(
    name: str, *, functions: tuple[str, ...] = (), names_of: str | None = None
) -> Iterator[None]:
    """While the block runs, importing the module ``name`` (not imported yet) binds a
    stand-in that imports it on first use; ``from name import f`` of one of ``functions``
    binds a function that imports it when called (see the module's docstring).
    ``names_of``: a small submodule of the package ``name`` (such as its version module),
    imported for real; its public names and ``__version__`` are the stand-in's own, so
    reading them imports nothing more."""
    if name in sys.modules:
        yield
        return
    stand_in = _OnFirstUse(name)
    spec = importlib.util.find_spec(name)  # finds the module, does not run it
    if spec is not None and spec.submodule_search_locations is not None:
        # a package: ``from name import f`` reads __path__ before f
        stand_in.__path__ = list(spec.submodule_search_locations)
    for function in functions:
        setattr(stand_in, function, _deferred(name, function))
    sys.modules[name] = stand_in
    parent, _, child = name.rpartition(".")
    if parent:  # `import a.b` then reads b off a; the real import replaces it
        setattr(importlib.import_module(parent), child, stand_in)
    if names_of is not None:  # found through the stand-in's __path__; the package's own
        # later import finds it in sys.modules, as it would have imported it
        sub = importlib.import_module(f"{name}.{names_of}")
        for attr, value in vars(sub).items():
            # its own names, not a `from __future__ import` feature or an imported module
            own = not isinstance(value, ModuleType) and type(value).__module__ != "__future__"
            if own and (not attr.startswith("_") or attr == "__version__"):
                setattr(stand_in, attr, value)
    try:
        yield
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
