"""A run store whose outages are said plainly: a driver error (connection refused, a
read-only file, a pool timeout) becomes ``StoreUnavailable`` (RUNTIME_UNAVAILABLE) naming
the store by its URL without the password, never a raw ``sqlalchemy.exc.OperationalError``.

What the API side (``api_client``) holds. A proxy, not a subclass: every method of the
wrapped store (and any added later) passes through, each call's errors translated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

from executor.errors import StoreUnavailable
from executor.store.base import RunStore


def is_store_outage(e: BaseException) -> bool:
    """True for an error that means "the store cannot be reached or written", not a bug:
    a refused or dropped connection, a locked, missing or read-only database file."""
    from sqlalchemy import exc

    if isinstance(e, exc.IntegrityError | exc.DataError):
        return False
    if isinstance(e, exc.DBAPIError | exc.DisconnectionError | exc.TimeoutError):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    modules = {c.__module__.split(".")[0] for c in type(e).__mro__}
    if names & {"OperationalError", "InterfaceError"} and modules & {"sqlite3", "psycopg"}:
        return True
    return isinstance(e, OSError)


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


class GuardedStore:
    """Wraps a RunStore; see the module docstring."""

    def __init__(self, store: RunStore) -> None:
        self._store = store
        self._where = store.describe()

    @property
    def store_id(self) -> str:
        try:
            return self._store.store_id
        except Exception as e:
            if is_store_outage(e):
                raise outage(self._where, e) from e
            raise

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr
        where = self._where

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except StoreUnavailable:
                raise
            except Exception as e:
                if is_store_outage(e):
                    raise outage(where, e) from e
                raise

        return call

    def __enter__(self) -> GuardedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self._store.close()

    def __repr__(self) -> str:
        return f"GuardedStore({self._store!r})"


def open_guarded(
    url: str, *, create: bool = True, opener: Callable[..., RunStore] | None = None
) -> RunStore:
    """``open_store(url)`` behind a GuardedStore; an outage while opening raises
    StoreUnavailable too."""
    from executor.store import open_store
    from executor.store.sql import describe_url

    try:
        store = (opener or open_store)(url, create=create)
    except StoreUnavailable:
        raise
    except Exception as e:
        if is_store_outage(e):
            raise outage(describe_url(url), e) from e
        raise
    return guard(store)


def guard(store: RunStore) -> RunStore:
    """``store`` behind a GuardedStore (typed as the RunStore it stands for)."""
    if isinstance(store, GuardedStore):
        return cast(RunStore, store)
    return cast(RunStore, GuardedStore(store))
