"""One vocabulary for "a service is down": which errors mean the run store or Redis cannot
be reached or written NOW (wait, pause, answer 503), and which are bugs or bad data (fail,
500). The worker's gate, the API's error routes, the CLI and the store itself ask these two
functions and nothing else, so they cannot disagree.

The run store raises ``StoreUnavailable`` for its own outages (``executor.store.sql``
applies ``raise_store_outages`` to every public method), so most callers only catch that
type; ``is_store_outage`` is for code that holds a raw error (the gate's SQLite write
probe, a store opened before the translation).

===========================================  =========  ==========================================
error                                        outage?    why
===========================================  =========  ==========================================
``StoreUnavailable``                         yes        already said by the store
``sqlalchemy.exc.OperationalError``          yes        refused/dropped connection, locked or
                                                        read-only database, no such file
raw ``sqlite3.OperationalError``             yes        the same, from a raw connection (but
                                                        SQLite's syntax errors and "no such
                                                        column" are OperationalErrors too:
                                                        those are bugs, told by the message)
``sqlalchemy.exc.InterfaceError``,           yes        the connection went away
``DisconnectionError``, pool ``TimeoutError``
a ``DBAPIError`` whose connection was         yes        PostgreSQL restarted under a pool
invalidated
``ProgrammingError`` for a missing            yes        a revoked grant (42501) or a database
privilege or a read-only database                        made read-only (25006): an operator's
                                                        fix, the data is fine
``PermissionError``, ``FileNotFoundError``,   yes        a data folder not writable, a volume not
any other ``OSError``                                    mounted, a full disk
``IntegrityError``, ``DataError``, other      no         the data or the query is wrong: waiting
``ProgrammingError``                                     would not cure it
===========================================  =========  ==========================================

Nothing heavy is imported at module level (the CLI imports this).
"""

from __future__ import annotations

from executor.errors import StoreUnavailable

#: what SQLite says (always as an OperationalError) when the FILE is the problem; its other
#: OperationalErrors ("near ...: syntax error", "no such column") are the query's
_SQLITE_OUTAGE_WORDS = (
    "locked",
    "busy",
    "unable to open",
    "readonly",
    "read-only",
    "disk i/o",
    "disk is full",
    "not a database",
    "no such file",
    "cannot open",
    "interrupted",
)

#: PostgreSQL SQLSTATEs that mean "an operator must fix the database", not "the query is bad"
_PG_OUTAGE_STATES = frozenset({"42501", "25006", "57P01", "57P02", "57P03", "53300"})


def _mro(e: BaseException) -> tuple[set[str], set[str]]:
    mro = type(e).__mro__
    return {c.__name__ for c in mro}, {c.__module__.split(".")[0] for c in mro}


def is_store_outage(e: BaseException) -> bool:
    """True when ``e`` means the run store cannot be reached or written now (see the table
    in the module docstring); False for an error of the data or the code."""
    if isinstance(e, StoreUnavailable):
        return True
    names, modules = _mro(e)
    if "sqlalchemy" in modules:
        from sqlalchemy import exc

        if isinstance(e, exc.IntegrityError | exc.DataError):
            return False
        if isinstance(e, exc.ProgrammingError):
            return _is_operator_fix(getattr(e, "orig", None))
        if isinstance(e, exc.DBAPIError) and e.connection_invalidated:
            return True
        if (
            isinstance(e, exc.OperationalError)
            and e.orig is not None
            and "sqlite3" in _mro(e.orig)[1]
        ):
            return _is_sqlite_file_problem(e.orig)
        if isinstance(
            e,
            exc.OperationalError | exc.InterfaceError | exc.DisconnectionError | exc.TimeoutError,
        ):
            return True
        orig = getattr(e, "orig", None)
        return orig is not None and orig is not e and is_store_outage(orig)
    if "sqlite3" in modules and "OperationalError" in names:
        return _is_sqlite_file_problem(e)
    if modules & {"sqlite3", "psycopg", "psycopg2"}:
        if names & {"OperationalError", "InterfaceError"}:
            return True
        if "ProgrammingError" in names:
            return _is_operator_fix(e)
        return False
    return isinstance(e, OSError)


def _is_sqlite_file_problem(orig: object) -> bool:
    text = str(orig).lower()
    return any(word in text for word in _SQLITE_OUTAGE_WORDS)


def _is_operator_fix(orig: object) -> bool:
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if state in _PG_OUTAGE_STATES:
        return True
    text = str(orig).lower()
    return "readonly database" in text or "read-only" in text


def is_redis_outage(e: BaseException) -> bool:
    """True when ``e`` means Redis (the broker) cannot be reached or answered in time: a
    refused, reset or silent connection, a timeout, a failover in progress (READONLY,
    LOADING, MASTERDOWN), kombu's or Celery's wrapper of one of these."""
    names, modules = _mro(e)
    if not modules & {"redis", "kombu", "celery", "amqp", "builtins", "socket", "ssl"}:
        return False
    if modules & {"redis"}:
        return bool(
            names
            & {
                "ConnectionError",
                "TimeoutError",
                "BusyLoadingError",
                "ReadOnlyError",
                "MasterNotFoundError",
                "SlaveNotFoundError",
                "TryAgainError",
                "ClusterDownError",
            }
        ) or "MASTERDOWN" in str(e)
    if modules & {"kombu", "celery", "amqp"}:
        return bool(names & {"OperationalError", "ConnectionError", "TimeoutError"})
    return isinstance(e, ConnectionError | TimeoutError)


def is_outage(e: BaseException) -> bool:
    """Either service is down: the API's 503 rather than 500."""
    return is_store_outage(e) or is_redis_outage(e)
