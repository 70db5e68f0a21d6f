"""A run's concurrency keys (``tenant``, ``workflow``: worker.fair): what a submit may name,
checked at the submit and again where the run store's row is read back, so a message sent
again from the row goes to the lane of keys the submit would have taken. Never a metrics
label, never logged."""

from __future__ import annotations

import re
from typing import Any

from executor.errors import CodeInvalid

#: a key's longest (the run store's ``code_jobs.tenant``/``workflow`` columns hold as much)
KEY_MAX = 64
_KEY_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{KEY_MAX - 1}}}")


def check_key(field: str, value: str | None) -> str:
    """A submit's ``tenant`` or ``workflow`` ("" when not given); raises CodeInvalid with
    what a key may be."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not _KEY_RE.fullmatch(value):
        shown = repr(value) if isinstance(value, str) and len(value) <= 80 else "the one given"
        raise CodeInvalid(
            f"{field} {shown} is not a key: give 1 to {KEY_MAX} characters, letters, digits, "
            f"'.', '_', ':' or '-', starting with a letter or digit (or leave {field} out)."
        )
    return value


def stored_key(value: Any) -> str:
    """A key as the run store's row holds it: "" for NULL (a row of a release before, or a
    run that named none) and for anything that is not a key (the run then waits on the lane
    of its other keys: its keys only steer admission, never what it runs)."""
    return value if isinstance(value, str) and _KEY_RE.fullmatch(value) else ""


__all__ = ["KEY_MAX", "check_key", "stored_key"]
