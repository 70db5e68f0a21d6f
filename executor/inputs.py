"""What a call is given, checked by one rule at every door: the state, the timeout and the
limits a node asks for (its memory and CPU share, between their floors and the server's caps).

The CLI (``studio-code run`` / ``submit``), ``CodeClient`` (and through it the HTTP routes)
and the executor's own last check (``Executor.check_job``) all call these functions, so a
state that one entry point accepts is never refused by another. Standard library only: the
CLI checks its arguments before it loads anything else.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from executor.errors import CodeInvalid
from executor.floors import MIN_CPUS, MIN_MEMORY_BYTES
from executor.sizes import parse_size, size_text

_JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def state_json(value: Any, *, max_bytes: int, source: str = "The state") -> str:
    """The state as JSON text for the sandbox.

    ``value`` is JSON text (``str`` or UTF-8 ``bytes``, checked and passed on untouched), a
    JSON-serialisable value (serialised), or None (``{}``). Raises CodeInvalid, with a
    sentence that starts with ``source`` (``--state``, ``The state``), when it is not JSON,
    holds NaN or Infinity (JSON has neither; HTTP refuses them), is not a JSON object at the
    top (the node's ``main`` gets an object, as the HTTP body requires), or is larger than
    ``max_bytes`` (STUDIO_CODE_STATE_MAX_BYTES) in UTF-8.
    """
    if value is None:
        return "{}"
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CodeInvalid(f"{source} is not UTF-8 text: {e}. Pass JSON.") from e
    if isinstance(value, str):
        text = value
        try:
            parsed = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
        except ValueError as e:
            raise CodeInvalid(f"{source} is not valid JSON: {e}. Pass a JSON object.") from e
    else:
        parsed = value
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CodeInvalid(
                f"{source} cannot be sent as JSON: {e}. Pass only JSON values (objects, "
                "arrays, strings, numbers, true/false/null)."
            ) from e
    if not isinstance(parsed, dict):
        kind = _JSON_KINDS.get(type(parsed), type(parsed).__name__)
        raise CodeInvalid(
            f"{source} is {kind}, not a JSON object: pass an object such as "
            '{"items": [1, 2]} (the node\'s main gets it as its state).'
        )
    check_state_size(text, max_bytes=max_bytes, source=source)
    return text


def check_state_size(text: str, *, max_bytes: int, source: str = "The state") -> None:
    """Raises CodeInvalid when the state JSON is larger than STUDIO_CODE_STATE_MAX_BYTES or
    holds a lone surrogate (not valid Unicode, so it could never reach the sandbox)."""
    if text.isascii():  # one flag of the str, no pass over it: a byte per character
        size = len(text)
    else:
        size = _utf8_size(text, source)
    if size > max_bytes:
        raise CodeInvalid(
            f"{source} is {size} bytes, more than STUDIO_CODE_STATE_MAX_BYTES={max_bytes}: "
            "pass less data to the node."
        )


def _utf8_size(text: str, source: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise CodeInvalid(
            f"{source} holds a lone surrogate, which is not valid Unicode: send the state as "
            "well-formed UTF-8 JSON."
        ) from None


def timeout_s(value: float | str | None, *, max_seconds: float, source: str = "timeout_s") -> float:
    """A node's timeout in seconds: ``None`` gives STUDIO_CODE_MAX_SECONDS; otherwise a
    finite number above 0 (text such as ``"2.5"`` is read), capped by ``max_seconds`` (a
    request can lower the limit, never raise it). Raises CodeInvalid otherwise."""
    if value is None:
        return float(max_seconds)
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = float(value.strip())
        except ValueError:
            seconds = None
    if seconds is None or not math.isfinite(seconds) or not seconds > 0:
        raise CodeInvalid(
            f"{source}={value!r} is not a timeout: give a number of seconds above 0 (at most "
            f"STUDIO_CODE_MAX_SECONDS={max_seconds:g} is used), or none for that cap."
        )
    return capped_timeout_s(seconds, max_seconds=max_seconds)


def capped_timeout_s(seconds: float | None, *, max_seconds: float) -> float:
    """The timeout a run gets: ``seconds`` capped by STUDIO_CODE_MAX_SECONDS (``max_seconds``);
    none, or a value not above 0 (never accepted by ``timeout_s``, but a job built by hand
    may hold one), gives the cap. The one cap: ``timeout_s``, ``Executor.limits`` and the
    HTTP test call's wait all use it."""
    if seconds is None or not seconds > 0:
        return float(max_seconds)
    return min(float(seconds), float(max_seconds))


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is too large for a JSON number")
    return number


def memory_bytes(memory: str | int | None) -> int | None:
    """A node's memory request in bytes: a size such as 512m, or a number of bytes (its
    range is ``check_memory``'s)."""
    if memory is None or isinstance(memory, int):
        return memory
    try:
        return parse_size(memory)
    except ValueError:
        raise CodeInvalid(
            f"memory={memory!r} is not a size: give one such as 512m (a number with b, k, m or g)."
        ) from None


def check_memory(value: int | None, *, max_bytes: int, source: str = "memory") -> None:
    """A node's memory in bytes (``memory_bytes``'s answer): None (STUDIO_CODE_MEMORY) or
    from MIN_MEMORY_BYTES (the least a Python or Deno runner starts in) to ``max_bytes``
    (STUDIO_CODE_MAX_MEMORY). Raises CodeInvalid giving the range otherwise."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_MEMORY_BYTES:
        shown = size_text(value) if isinstance(value, int) and value > 0 else repr(value)
        raise CodeInvalid(
            f"{source}={shown} is less memory than a sandbox can start in: give from "
            f"{size_text(MIN_MEMORY_BYTES)} (the least Python and Deno start in) to the cap "
            f"STUDIO_CODE_MAX_MEMORY={size_text(max_bytes)}, or none for STUDIO_CODE_MEMORY."
        )
    if value > max_bytes:
        raise CodeInvalid(
            f"{source}={size_text(value)} is more memory than the cap "
            f"STUDIO_CODE_MAX_MEMORY={size_text(max_bytes)}: give from "
            f"{size_text(MIN_MEMORY_BYTES)} to that, or ask an admin to raise the cap."
        )


def cpus_range(max_cpus: float | None = None) -> str:
    """The sentence giving the CPU shares a node may ask for (``max_cpus``: the cap in force,
    when the caller knows it)."""
    cap = "STUDIO_CODE_MAX_CPUS" + ("" if max_cpus is None else f"={max_cpus:g}")
    return (
        f"give from {MIN_CPUS:g} (1 ms of CPU in every 100 ms, the smallest quota the kernel "
        f"enforces) to the cap {cap}, or none for STUDIO_CODE_CPUS"
    )


def check_cpus(value: float | None, *, max_cpus: float | None, source: str = "cpus") -> None:
    """A node's CPU share: None (STUDIO_CODE_CPUS) or a finite number from MIN_CPUS to
    ``max_cpus`` (STUDIO_CODE_MAX_CPUS; None: not known here, the floor only). Raises
    CodeInvalid giving the range otherwise: below the floor the engine either refuses the
    sandbox or (a share that rounds to 0 NanoCpus) gives it no CPU limit at all."""
    if value is None:
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if (
        not number
        or not math.isfinite(value)
        or value < MIN_CPUS
        or (max_cpus is not None and value > max_cpus)
    ):
        shown = f"{value:g}" if number else repr(value)
        raise CodeInvalid(
            f"{source}={shown} is not a CPU share a node may ask for: {cpus_range(max_cpus)}."
        )
