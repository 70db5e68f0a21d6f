"""What may leave a sandbox as a result, and how the host reads it.

The result channel is written by code we do not trust (a Python node can write to the
runner's file descriptor; any runner can be made to write odd JSON), so the host reads it with
bounded size and depth and checks what it got, before anything else (the run store, pydantic,
the HTTP response, the CLI) sees it. Whatever the sandbox wrote, ``parse_reply`` either returns
a reply every later step can serialise, or raises ``OutputInvalid`` with a sentence: never a
RecursionError, a UnicodeError or a digit-limit ValueError that would end the job as an
infrastructure failure.

A value every later step can serialise: nested at most ``OUTPUT_MAX_DEPTH`` containers deep
(pydantic refuses to serialise past ~255 levels, and the API wraps the output in a few more),
no string (key or value) with a lone surrogate (UTF-8 cannot encode one, so neither database,
nor the JSON response, could hold it), only finite numbers, integers within Python's
int->str digit limit. NUL characters are valid JSON and are kept (stored escaped).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

#: containers (objects, arrays) a node's output may nest; the runners check the same number
OUTPUT_MAX_DEPTH = 100
#: characters of an error message a run keeps (a node can throw a 10 MB message)
MESSAGE_MAX_CHARS = 64 * 1024

# A JSON text can only produce a lone surrogate through a \uD800-\uDFFF escape (strict UTF-8
# decoding refuses encoded surrogates), so texts without one skip the walk for strings.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE_STR = re.compile(r"\\u[dD][89a-fA-F]")


def may_hold_lone_surrogate(json_text: str) -> bool:
    """False when JSON text (ASCII or not) cannot decode to a lone surrogate: it has no
    \\uD800-\\uDFFF escape and no surrogate character."""
    return bool(_SURROGATE_ESCAPE_STR.search(json_text) or _LONE_SURROGATE.search(json_text))


class OutputInvalid(ValueError):
    """Raised when the result channel holds something that cannot be a node's result."""


def _refuse_constant(name: str) -> Any:
    raise OutputInvalid(
        f"main returned {name}, which is not JSON: return finite numbers (or null) instead."
    )


def parse_reply(data: bytes, *, max_bytes: int) -> dict[str, Any]:
    """The runner's reply ``{"ok": ..., ...}`` out of the result channel's bytes, checked.

    Raises OutputInvalid (with the sentence to show) for bytes over ``max_bytes``, text that
    is not UTF-8 or not JSON, NaN/Infinity, an integer too long for Python, nesting deeper
    than OUTPUT_MAX_DEPTH (the parser's own recursion limit included), a lone surrogate, or
    a reply that is not an object with a boolean ``ok``.
    """
    if len(data) > max_bytes:
        raise OutputInvalid(
            f"The result is {len(data)} bytes, more than the limit of {max_bytes}: return "
            "less, or keep large data elsewhere."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OutputInvalid(
            f"The result channel held bytes that are not UTF-8 (at byte {e.start}): did the "
            "code write to the runner's file descriptors? Return the output from main."
        ) from None
    try:
        reply = json.loads(text, parse_constant=_refuse_constant)
    except OutputInvalid:
        raise
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:
        if "integer string conversion" in str(e):
            raise OutputInvalid(
                "main returned an integer with more digits than Python converts "
                f"({sys.get_int_max_str_digits()}): return it as a string."
            ) from None
        raise OutputInvalid(
            "The sandbox's result channel held something that is not the runner's JSON (did "
            "the code write to the runner's file descriptors?)."
        ) from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise OutputInvalid(
            "The sandbox's result channel held JSON that is not the runner's reply (did the "
            "code write to the runner's file descriptors?)."
        )
    # An error's message is the user's own text: the executor makes it safe (safe_text);
    # only the output must be refused.
    check_value(reply.get("output"), strings=_SURROGATE_ESCAPE.search(data) is not None)
    return reply


def _too_deep() -> OutputInvalid:
    return OutputInvalid(
        f"main returned a value nested deeper than {OUTPUT_MAX_DEPTH} levels of objects and "
        "arrays: flatten it."
    )


def check_value(value: Any, *, max_depth: int = OUTPUT_MAX_DEPTH, strings: bool = True) -> None:
    """Raises OutputInvalid when ``value`` nests deeper than ``max_depth`` containers or
    (when ``strings``) holds a string (key or value) with a lone surrogate.

    One level at a time, so no depth can make it recurse and a cycle ends at the limit; each
    level is a comprehension (on a 13 MB output: ~0.2-0.4 s, about json.dumps's time; a
    per-item stack walk took twice that)."""
    level: list[Any] = [value]
    depth = 0
    while True:
        if strings:
            for item in level:
                if type(item) is str and _LONE_SURROGATE.search(item):
                    raise _lone_surrogate(item)
        containers = [x for x in level if type(x) in _CONTAINERS]
        if not containers:
            return
        depth += 1
        if depth > max_depth:
            raise _too_deep()
        level = []
        extend = level.extend
        for c in containers:
            if type(c) is dict:
                if strings:
                    extend(c)  # the keys
                extend(c.values())
            else:
                extend(c)


# exact types: what json.loads builds (a subclass in a hand-made CodeResult is caught by the
# store's own json.dumps, whose recursion is bounded)
_CONTAINERS = frozenset({dict, list, tuple})


def _lone_surrogate(s: str) -> OutputInvalid:
    m = _LONE_SURROGATE.search(s)
    at = m.start() if m else 0
    return OutputInvalid(
        f"main returned a string with a lone surrogate (\\u{ord(s[at]):04x} at character "
        f"{at}), which is not valid Unicode and cannot be stored: return well-formed text "
        "(in TypeScript, String.prototype.toWellFormed() fixes it)."
    )


def safe_text(s: str, max_chars: int | None = None) -> str:
    """``s`` that every store, JSON encoder and terminal accepts: lone surrogates become
    U+FFFD; cut to ``max_chars`` with a note. (NUL is left to the store: PostgreSQL's
    SafeText replaces it, SQLite keeps it.)"""
    if _LONE_SURROGATE.search(s):
        s = _LONE_SURROGATE.sub("\ufffd", s)
    if max_chars is not None and len(s) > max_chars:
        s = s[:max_chars] + f"\n[cut: {len(s) - max_chars} more characters]"
    return s


def safe_value(value: Any) -> Any:
    """A copy of a stored JSON value that can be rendered: lone surrogates become U+FFFD.
    For rows written before outputs were checked; recursion-free."""
    if isinstance(value, str):
        return safe_text(value)
    if not isinstance(value, dict | list):
        return value
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]
    while stack:
        item, parent, slot = stack.pop()
        if isinstance(item, dict):
            copy_d: dict[str, Any] = {}
            parent[slot] = copy_d
            for k, v in item.items():
                key = safe_text(k) if isinstance(k, str) else k
                copy_d[key] = None
                stack.append((v, copy_d, key))
        elif isinstance(item, list):
            copy_l: list[Any] = [None] * len(item)
            parent[slot] = copy_l
            for i, v in enumerate(item):
                stack.append((v, copy_l, i))
        elif isinstance(item, str):
            parent[slot] = safe_text(item)
        else:
            parent[slot] = item
    return root[0]
