"""SQLite machinery of the run store: the PRAGMAs and the BEGIN of every connection, the
fork gate (no fork while this process is inside an SQLite call), the WAL checkpointer off the
commits' path, and giving space back after retention.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import URL

log = logging.getLogger("studio_code.store")

READ_ONLY = "studio_read_only"  # execution option: a read transaction (plain BEGIN on SQLite)
BUSY_TIMEOUT_MS = 30_000
#: SQLite: a commit checkpoints the WAL itself only past this many pages (64 MiB of 4 KiB
#: pages; SQLite's default is 1000); below it, Checkpointer does it off the commit's path
_AUTOCHECKPOINT_PAGES = 16_384
_CHECKPOINT_AFTER_S = 0.5


def sqlite_file(u: URL) -> Path | None:
    db = u.database
    if not db or db == ":memory:" or db.startswith("file:") or u.query.get("mode") == "memory":
        return None
    return Path(db).expanduser()


def configure(engine: Engine) -> None:
    """WAL + busy_timeout on every connection; SQLAlchemy (not sqlite3) emits BEGIN, IMMEDIATE
    for writes so concurrent writers queue on the lock instead of failing."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, record: Any) -> None:
        dbapi_conn.isolation_level = None  # sqlite3 must not emit its own BEGIN
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            # Only a NEW file takes it (before its first table): retention's deletes then
            # give pages back with PRAGMA incremental_vacuum. An existing file is unchanged,
            # so it is not even asked there: setting it waits for the write lock, and a
            # connection opened while another process holds that lock (a backup, an admin
            # shell) would wait out busy_timeout before its first read (a readiness probe,
            # a pool process's fresh connection).
            if cur.execute("PRAGMA page_count").fetchone()[0] == 0:
                cur.execute("PRAGMA auto_vacuum = INCREMENTAL")
            # In WAL mode, NORMAL syncs at checkpoints, not at every commit: a crash of any
            # process loses nothing and the file stays consistent; only a power cut may undo
            # the last commits (like Redis's appendfsync everysec beside it). It takes the
            # fsync off every queue hop (three writes per job).
            cur.execute("PRAGMA synchronous = NORMAL")
            # The copy of the WAL into the file (and its fsync) is not paid by a commit:
            # measured, a 10 MB state's INSERT took 119 ms with SQLite's default (every such
            # commit passed 1000 pages and checkpointed), 39 ms without. Checkpointer does
            # it from a thread; this bound stays as the safety net if that thread lags.
            cur.execute(f"PRAGMA wal_autocheckpoint = {_AUTOCHECKPOINT_PAGES}")
            # Switching to WAL needs a moment of exclusive access; many processes opening a
            # new file at once can find it locked, so retry briefly (WAL then persists).
            for attempt in range(50):
                try:
                    mode = cur.execute("PRAGMA journal_mode").fetchone()[0]
                    if str(mode).lower() not in ("wal", "memory"):
                        cur.execute("PRAGMA journal_mode = WAL")
                    break
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e) or attempt == 49:
                        raise
                    time.sleep(0.1)
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


class ForkGate:
    """No fork while this process is inside an SQLite call. SQLite keeps its file locks in
    per-process memory: a child forked while the parent held a write transaction or ran a
    checkpoint inherits that lock as "held by another connection of this process", and every
    connection it opens then waits out busy_timeout and fails ("database is locked"), for
    the child's whole life (seen: Celery's prefork pool started beside the main process's
    first writes). So every store call holds the gate, and ``os.fork`` (registered below:
    Celery's pool, ``subprocess`` with a ``preexec_fn``) waits until no call is inside it and
    lets none start until the fork is done. A thread that forks from inside a call of its
    own does not wait for itself."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._busy = 0
        self._forking = False
        self._mine = threading.local()

    @contextmanager
    def held(self) -> Iterator[None]:
        depth = getattr(self._mine, "depth", 0)
        with self._cond:
            while self._forking and depth == 0:
                self._cond.wait()
            self._busy += 1
        self._mine.depth = depth + 1
        try:
            yield
        finally:
            self._mine.depth = depth
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def before_fork(self) -> None:
        own = getattr(self._mine, "depth", 0)
        self._cond.acquire()
        self._forking = True
        deadline = time.monotonic() + _FORK_WAIT_S
        while self._busy > own and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        # forks with the lock held: no call starts or ends until after_in_parent

    def after_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def after_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]  # the parent's calls are not the child's


def no_fork_inside() -> AbstractContextManager[None]:
    """Hold it around SQLite work done outside the store (a raw ``sqlite3`` connection): this
    process does not fork while it runs (``ForkGate``)."""
    return FORK_GATE.held()


#: a fork waits at most this long for the calls in flight (a call is one transaction, bounded
#: by busy_timeout; past this, the fork goes ahead as it did before the gate)
_FORK_WAIT_S = 60.0
FORK_GATE = ForkGate()
os.register_at_fork(
    before=FORK_GATE.before_fork,
    after_in_parent=FORK_GATE.after_in_parent,
    after_in_child=FORK_GATE.after_in_child,
)


class Checkpointer:
    """SQLite: copies the WAL into the database file (``PRAGMA wal_checkpoint(PASSIVE)``)
    from a thread of this process, ``_CHECKPOINT_AFTER_S`` after it wrote, instead
    of in the commit that made the WAL long (see ``_AUTOCHECKPOINT_PAGES``). PASSIVE
    never waits for readers or writers; what it cannot copy now, the next pass does (any
    process's: a checkpoint copies every process's commits). The last connection to close
    the file checkpoints too (SQLite's own rule). A forked child starts its own thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pid: int | None = None
        self._due = threading.Event()
        self._stop = False

    def wrote(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._due = threading.Event()
            threading.Thread(target=self._loop, name="studio-sqlite-wal", daemon=True).start()
        self._due.set()

    def close(self) -> None:
        self._stop = True
        self._due.set()

    def _loop(self) -> None:
        pid, due = os.getpid(), self._due
        while True:
            due.wait()
            if self._stop or self._pid != pid:
                return
            time.sleep(_CHECKPOINT_AFTER_S)  # commits that come meanwhile: one pass
            due.clear()
            try:
                with FORK_GATE.held():
                    raw = self.engine.raw_connection()
                    try:
                        cur = raw.cursor()
                        busy, frames, copied = cur.execute(
                            "PRAGMA wal_checkpoint(PASSIVE)"
                        ).fetchone()
                        if busy == 0 and frames > 0 and copied == frames:
                            _restart_wal(cur)
                        cur.close()
                    finally:
                        raw.close()
            except Exception as e:  # noqa: BLE001 - the next pass (or a commit) does it
                log.debug("SQLite WAL checkpoint skipped: %s", e)


def _restart_wal(cur: Any) -> None:
    """After a checkpoint that copied the whole WAL, the next write starts the WAL over and,
    with synchronous=NORMAL, syncs its new header first (fdatasync): measured, ~0.5-1 ms on
    the first write after each checkpoint, which at a few jobs a second is nearly every
    job's create or claim. One write here takes that turn instead, off the jobs' path: page
    1 written with what it holds (``user_version`` set to its own value: nothing visible
    changes; an UPDATE to the same value writes no page). A job's write that comes first
    pays it as before, and this one then appends a frame."""
    cur.execute("BEGIN IMMEDIATE")
    try:
        (version,) = cur.execute("PRAGMA user_version").fetchone()
        cur.execute(f"PRAGMA user_version = {int(version)}")
        cur.execute("COMMIT")
    except BaseException:
        cur.execute("ROLLBACK")
        raise


def give_space_back(engine: Engine) -> None:
    """Free pages go back to the file system (a store created by this release has
    auto_vacuum=INCREMENTAL; an older file keeps them for reuse) and the WAL is checkpointed
    and truncated. Both run outside a transaction; a busy reader only makes the checkpoint
    partial, never an error."""
    with FORK_GATE.held():
        raw = engine.raw_connection()
        try:
            cur = raw.cursor()
            # executescript steps the pragma to its end; execute() frees one page only.
            # The pages freed are those this bounded pass deleted, so this stays short.
            cur.executescript("PRAGMA incremental_vacuum;")
            # (busy, frames, checkpointed): busy when another checkpoint runs at that moment
            # (a process's Checkpointer): it is short, so try again a few times.
            for _ in range(20):
                busy = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()[0][0]
                if not busy:
                    break
                time.sleep(0.1)
            cur.close()
        except sqlite3.OperationalError as e:
            log.warning("SQLite space not given back this time: %s", e)
        finally:
            raw.close()
