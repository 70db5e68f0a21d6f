"""One outage rule (executor.outage): the errors that mean "the run store (or Redis) is down
now" are told from bugs the same way by the store, the worker, the API and the CLI.

Each error of the table is produced for real where this machine can (a SQLite file that
cannot be opened, a PostgreSQL role without the grant, a read-only filesystem), then asked
of the one classifier and of the API's error route (503 for an outage, 500 for a bug)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from executor.errors import StoreUnavailable
from executor.outage import is_outage, is_redis_outage, is_store_outage
from testkit.postgres import pg_exec
from testkit.processes import IN_CI


def _raised(fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the error is what the test looks at
        return e
    raise AssertionError("expected an error")


def _sqlalchemy_operational(tmp_path: Path) -> BaseException:
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{tmp_path}/no/such/folder/x.db")
    try:
        return _raised(lambda: engine.connect().execute(text("SELECT 1")))
    finally:
        engine.dispose()


def _raw_sqlite_operational(tmp_path: Path) -> BaseException:
    path = tmp_path / "ro.db"
    sqlite3.connect(path).close()
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return _raised(lambda: conn.execute("CREATE TABLE t (x)"))  # readonly database
    finally:
        conn.close()


def _permission_error(tmp_path: Path) -> BaseException:
    if os.getuid() != 0:
        folder = tmp_path / "locked"
        folder.mkdir(mode=0o500)
        return _raised(lambda: (folder / "x.db").write_bytes(b""))
    # root passes every permission check: the same errno, as the OS reports it
    return PermissionError(13, "Permission denied", str(tmp_path / "locked" / "x.db"))


def _file_not_found(tmp_path: Path) -> BaseException:
    return _raised(lambda: open(tmp_path / "unmounted" / "studio-code.db"))  # noqa: SIM115


def _sqlite_programming(tmp_path: Path) -> BaseException:
    conn = sqlite3.connect(tmp_path / "closed.db")
    conn.close()
    return _raised(lambda: conn.execute("SELECT 1"))  # a closed connection: our bug


def _sqlalchemy_programming_syntax(tmp_path: Path) -> BaseException:
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{tmp_path}/syntax.db")
    try:
        with engine.connect() as conn:
            return _raised(lambda: conn.execute(text("SELEC 1")))
    finally:
        engine.dispose()


def _integrity(tmp_path: Path) -> BaseException:
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{tmp_path}/integrity.db")
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER PRIMARY KEY)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
            return _raised(lambda: conn.execute(text("INSERT INTO t VALUES (1)")))
    finally:
        engine.dispose()


#: (name, how to make it, outage?) - the table of executor/outage.py's docstring
SQLITE_CASES: list[tuple[str, Callable[[Path], BaseException], bool]] = [
    ("sqlalchemy OperationalError (cannot open the file)", _sqlalchemy_operational, True),
    ("raw sqlite3.OperationalError (readonly database)", _raw_sqlite_operational, True),
    ("PermissionError (data folder not writable)", _permission_error, True),
    ("FileNotFoundError (volume not mounted)", _file_not_found, True),
    ("sqlite3.ProgrammingError (closed connection: a bug)", _sqlite_programming, False),
    ("SQLite syntax error (an OperationalError, but a bug)", _sqlalchemy_programming_syntax, False),
    ("sqlalchemy IntegrityError (bad data)", _integrity, False),
]


@pytest.mark.parametrize(("name", "make", "outage"), SQLITE_CASES, ids=[c[0] for c in SQLITE_CASES])
def test_one_rule_tells_an_outage_from_a_bug(
    name: str, make: Callable[[Path], BaseException], outage: bool, tmp_path: Path
) -> None:
    e = make(tmp_path)
    assert is_store_outage(e) is outage, f"{name}: {type(e).__module__}.{type(e).__name__}: {e}"
    assert is_outage(e) is outage
    assert not is_redis_outage(e) or isinstance(e, OSError)
    # the API's error route answers from the same rule: 503 for an outage, 500 for a bug
    assert _api_status_for(e) == (503 if outage else 500), name


@pytest.mark.postgres
def test_a_revoked_grant_is_an_outage_a_bad_query_is_not(postgres_url: str) -> None:
    """PostgreSQL: a role that lost its grant (42501) waits for the operator's fix, as an
    outage; a query of an unknown column is a bug."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    role, schema = f"outage_{uuid.uuid4().hex[:8]}", f"outage_{uuid.uuid4().hex[:8]}"
    pg_exec(
        postgres_url,
        f'CREATE ROLE "{role}" LOGIN',
        f'CREATE SCHEMA "{schema}"',
        f'CREATE TABLE "{schema}".jobs (id text)',
        f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"',
    )
    try:
        url = make_url(postgres_url).set(username=role, password=None)
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                denied = _raised(lambda: conn.execute(text(f'SELECT * FROM "{schema}".jobs')))
            with engine.connect() as conn:
                bad = _raised(lambda: conn.execute(text("SELECT no_such_column FROM pg_class")))
        finally:
            engine.dispose()
    finally:
        pg_exec(postgres_url, f'DROP SCHEMA "{schema}" CASCADE', f'DROP ROLE "{role}"')
    assert "permission denied" in str(denied)
    assert is_store_outage(denied) and _api_status_for(denied) == 503
    assert not is_store_outage(bad) and _api_status_for(bad) == 500


def test_redis_errors_are_redis_outages_not_store_ones() -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=_closed_port(), socket_connect_timeout=1)
    refused = _raised(client.ping)
    client.close()
    assert is_redis_outage(refused) and is_outage(refused)
    assert not is_store_outage(refused)
    assert _api_status_for(refused) == 503
    assert not is_redis_outage(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert is_redis_outage(redis.ReadOnlyError("You can't write against a read only replica."))


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, never listening: a connect is refused at once
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _api_status_for(e: BaseException) -> int:
    """What the API's routes answer when a call underneath raises ``e`` (a real route of
    the router's ErrorRoute class, served in-process)."""
    pytest.importorskip("fastapi")
    import asyncio

    import httpx
    from fastapi import APIRouter, FastAPI

    from api_client.http.kit import ErrorRoute

    router = APIRouter(route_class=ErrorRoute)

    @router.get("/boom")
    def boom() -> None:
        raise e

    app = FastAPI()
    app.include_router(router)

    async def call() -> int:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return (await client.get("/boom")).status_code

    return asyncio.run(call())


# --- the store raises the one type ----------------------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[tuple[Path, Callable[[bool], None]]]:
    """A tmpfs of the test's own that it can turn read-only and back (root only: as root a
    chmod would not stop a write)."""
    if os.getuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root: a tmpfs could not be mounted")
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "data"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], check=True)

    def set_ro(ro: bool) -> None:
        opt = "remount,ro" if ro else "remount,rw"
        subprocess.run(["mount", "-o", opt, str(where)], check=True)

    try:
        yield where, set_ro
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_the_store_raises_store_unavailable_for_a_read_only_folder(
    read_only_dir: tuple[Path, Callable[[bool], None]],
) -> None:
    from executor.models import CodeJob
    from executor.store import open_store

    where, set_ro = read_only_dir
    url = f"sqlite:///{where}/studio-code.db"
    store = open_store(url)
    job = CodeJob(code="def main(state):\n    return 1\n", language="python")
    assert store.create(job, code_runtime="docker")
    store.close()
    set_ro(True)
    try:
        # an open store: a write says the outage in the one type, naming the store
        store = open_store(url, create=False)
        try:
            with pytest.raises(StoreUnavailable) as caught:
                store.create(CodeJob(code=job.code, language="python"), code_runtime="docker")
            assert str(where) in caught.value.message
            assert caught.value.code == "RUNTIME_UNAVAILABLE"
        finally:
            store.close()
        # opening one that must be created there: the same
        with pytest.raises(StoreUnavailable):
            open_store(f"sqlite:///{where}/sub/new.db")
    finally:
        set_ro(False)
    store = open_store(url)
    try:
        assert store.get(job.job_id) is not None, "nothing lost: back once it is writable"
    finally:
        store.close()


def _job_path_calls_raise_store_unavailable(url: str, down: Callable[[Any], Any]) -> Any:
    """What the job path (worker.job.tasks) relies on, as it catches only StoreUnavailable:
    ``open_store``, ``claim`` and ``finish`` (``finish_with_outcome``) say an outage in
    that type. ``down(store)`` makes the outage and returns the store to call (the same,
    its pooled connections made before; or one opened again). Returns that store and the
    result of a job it claimed before the outage."""
    from executor.models import CodeJob, CodeResult, Status
    from executor.store import open_store

    store = open_store(url)
    code = "def main(state):\n    return 1\n"
    first, second = (CodeJob(code=code, language="python") for _ in range(2))
    for job in (first, second):
        assert store.create(job, code_runtime="docker")
    assert store.claim(first.job_id, "w1") is not None  # the lane's connection is made
    result = CodeResult(
        job_id=first.job_id,
        language="python",
        status=Status.SUCCEEDED,
        output=1,
        runtime="docker",
        code_runtime="docker",
    )
    store = down(store)
    for name, call in (
        ("claim", lambda: store.claim(second.job_id, "w1")),
        ("finish_with_outcome", lambda: store.finish_with_outcome(result, worker="w1")),
        ("finish", lambda: store.finish(result, worker="w1")),
        ("open_store", lambda: open_store(url).close()),
    ):
        e = _raised(call)
        assert isinstance(e, StoreUnavailable), f"{name}: {type(e).__module__}.{e!r}"
        assert e.code == "RUNTIME_UNAVAILABLE", name
    return store, result


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_stopped_postgres_raises_store_unavailable_and_a_result_is_parked_then_written(
    redis_server: Any,
) -> None:
    """PostgreSQL stopped (fast shutdown) under an open store: claim, finish and open
    raise StoreUnavailable, never a driver's error; the job path's store-or-park policy
    then parks the result in Redis (real redis-server), and once PostgreSQL is back the
    main process's flush writes it through the same store (its pool reconnects)."""
    import redis

    from executor.models import Status
    from testkit.postgres import start_pg_cluster
    from worker import parked
    from worker.job import pending
    from worker.upkeep.flusher import flush

    cluster = start_pg_cluster()
    try:

        def stop(store: Any) -> Any:
            cluster.stop()
            return store

        store, result = _job_path_calls_raise_store_unavailable(cluster.url, stop)
        client = redis.Redis.from_url(redis_server.url)
        try:
            stored = pending.store_or_park(store, client, result, "w1", ttl_s=600)
            assert stored == pending.Stored(parked=True), stored
            assert parked.parked(client, result.job_id) == (result, "w1")
            cluster.start()
            assert flush(store, client) == 1
            rec = store.get(result.job_id)
            assert rec is not None and rec.status is Status.SUCCEEDED and rec.output == 1, rec
            assert parked.parked(client, result.job_id) is None
            assert client.scard("studio:pending") == 0
        finally:
            client.close()
            store.close()
    finally:
        cluster.cleanup()


def test_the_job_paths_store_calls_raise_store_unavailable_in_a_read_only_folder(
    read_only_dir: tuple[Path, Callable[[bool], None]],
) -> None:
    """SQLite: the store's folder turned read-only (a volume mounted ro, a full disk; a
    mount with the file open cannot turn ro, so the store is opened again after it):
    claim, finish and open raise StoreUnavailable."""
    from executor.store import open_store

    where, set_ro = read_only_dir
    url = f"sqlite:///{where}/studio-code.db"

    def read_only(store: Any) -> Any:
        store.close()
        set_ro(True)
        return open_store(url, create=False)

    try:
        store, _ = _job_path_calls_raise_store_unavailable(url, read_only)
        store.close()
    finally:
        set_ro(False)


# --- the worker pauses and the API answers 503, alike ---------------------------------------


@pytest.mark.redis
@pytest.mark.timeout(240)
def test_a_read_only_store_folder_pauses_the_worker_and_the_api_answers_503(
    read_only_dir: tuple[Path, Callable[[bool], None]], redis_server: Any, tmp_path: Path
) -> None:
    """The run store's folder is read-only when a worker and the API start (a volume
    mounted ro, a full disk): the worker starts and pauses naming the store (it neither
    fails jobs nor exits), the API answers 503 RUNTIME_UNAVAILABLE; once the folder is
    writable again, the worker serves by itself and a job succeeds."""
    import time

    import httpx
    import redis

    from executor.store import open_store
    from testkit.api import ApiServer
    from testkit.processes import wait_for
    from testkit.stack import env_for
    from testkit.worker import start_worker
    from tests.snippets import USER
    from worker.registry import WorkerRegistry

    where, set_ro = read_only_dir
    url = f"sqlite:///{where}/studio-code.db"
    open_store(url).close()  # the store exists; then its folder turns read-only
    env = env_for(redis_server.url, url, STUDIO_QUEUE_PROBE_INTERVAL_S="1")
    h = {USER: "ann"}
    code = "def main(state):\n    return state.get('n', 0) * 2\n"
    set_ro(True)
    worker = api = None
    try:
        worker = start_worker(env, tmp_path / "worker.log", concurrency=1)
        api = ApiServer(env, tmp_path / "api.log")

        registry = WorkerRegistry(redis.Redis.from_url(redis_server.url))

        def paused() -> list[str]:
            # what the worker announces (the API reads the same heartbeats)
            run = registry.live()["code.run"]
            assert [w.nodename for w in run] == [worker.node], run
            return [str(w.reason) for w in run if not w.serving]

        wait_for(lambda: registry.live()["code.run"], 30, "the worker's heartbeat")
        reasons = wait_for(paused, 30, "the worker announced paused")
        assert "run store" in reasons[0] and str(where) in reasons[0], reasons
        r = httpx.post(f"{api.base}/api/runs", json={"code": code}, headers=h, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "RUNTIME_UNAVAILABLE", r.text
        time.sleep(2)
        assert worker.alive(), worker.tail()
        set_ro(False)
        wait_for(lambda: not paused(), 30, "the worker serving again")
        assert "Traceback" not in worker.output(), worker.tail()
        r = httpx.post(
            f"{api.base}/api/runs", json={"code": code, "state": {"n": 4}}, headers=h, timeout=30
        )
        assert r.status_code == 202, r.text
        job = r.json()["job_id"]

        def ended() -> dict[str, Any] | None:
            got = httpx.get(f"{api.base}/api/runs/{job}", headers=h, timeout=10).json()
            return got if got["status"] not in ("queued", "running") else None

        done = wait_for(ended, 60, "the job after the outage")
        assert done["status"] == "succeeded" and done["output"] == 8, done
    finally:
        set_ro(False)
        if api is not None:
            api.stop()
        if worker is not None:
            worker.stop(30)
