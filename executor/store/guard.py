"""A run store says its outages plainly: a driver error that means "the store cannot be
reached or written now" (connection refused, a read-only file, a pool timeout; the table in
``executor.outage``) becomes ``StoreUnavailable`` (RUNTIME_UNAVAILABLE) naming the store by
its URL without the password, never a raw ``sqlalchemy.exc.OperationalError``.

``raise_store_outages`` is applied to the store class itself (``SqlRunStore``), so every
caller (the worker, the API, the CLI) gets the same type for the same outage, and catches
that type. Errors of the data or the query pass through unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from executor.errors import StoreUnavailable
from executor.outage import is_store_outage

T = TypeVar("T", bound=type)


def _reason(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    return first if len(first) <= 200 else first[:197] + "..."


def outage(where: str, e: BaseException) -> StoreUnavailable:
    """The StoreUnavailable that says ``where`` (a URL without password) failed and why."""
    return StoreUnavailable(
        f"The run store at {where} is not reachable ({_reason(e)}): check that it is up and "
        "writable, and that STUDIO_DATABASE_URL (or STUDIO_DATA_DIR) points at it."
    )


def _translating(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except StoreUnavailable:
            raise
        except Exception as e:
            if is_store_outage(e):
                raise outage(_where(self), e) from e
            raise

    return call


def _where(store: Any) -> str:
    try:
        return str(store.describe())
    except Exception:  # noqa: BLE001 - __init__ failed before the URL was set
        return "<the run store>"


def raise_store_outages(cls: T) -> T:
    """Class decorator: every public method and property of ``cls`` (and ``__init__``)
    raises StoreUnavailable for an outage. ``describe()`` must not touch the database."""
    for name, attr in list(vars(cls).items()):
        if name == "describe" or (name.startswith("_") and name != "__init__"):
            continue
        if isinstance(attr, property) and attr.fget is not None:
            setattr(cls, name, property(_translating(attr.fget), attr.fset, attr.fdel))
        elif callable(attr) and not isinstance(attr, staticmethod | classmethod | type):
            setattr(cls, name, _translating(attr))
    return cls
