"""The Redis scripts' source: every Lua script is a ``.lua`` file beside the module that runs
it (worker/fair.lua beside worker/fair.py; the project keeps its other data files the same
way: executor/languages/ts_runner.js, executor/runtimes/docker/seccomp.json), read here once
per process through importlib.resources, so it is found in a wheel as in the source tree. The
module registers it with redis-py's ``register_script`` as before (EVALSHA, loaded on a
NoScriptError). No script is glued together from Python strings.

Light: importing this loads no Redis client (worker.protocol's rule)."""

from __future__ import annotations

import functools
from importlib import resources

#: (package, file name) of every script read in this process (tests/test_lua_scripts.py
#: checks that each .lua file of the packages is one of them)
LOADED: set[tuple[str, str]] = set()


@functools.cache
def source(package: str | None, name: str) -> str:
    """The text of the script ``name`` (``fair.lua``) in ``package`` (the calling module's
    ``__package__``: the folder it lives in)."""
    assert package, "a module of a package runs a script: give its __package__"
    text = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    LOADED.add((package, name))
    return text
