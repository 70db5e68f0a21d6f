"""PostgreSQL: the shared database of tests and benches (a schema of one's own in it), a
cluster of one's own (initdb + pg_ctl) that can be stopped, and run stores made by
older releases."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from glob import glob
from pathlib import Path
from typing import Any, Self

from testkit.processes import ROOT, free_port, needs, require
from testkit.reaper import disown, own

#: the shared PostgreSQL of tests and benchmarks (a test that stops one starts its own)
POSTGRES_URL = os.environ.get(
    "STUDIO_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def pg_admin(url: str = POSTGRES_URL) -> str:
    """``url`` as psycopg (libpq) takes it: the SQLAlchemy driver name dropped."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def pg_unreachable(url: str = POSTGRES_URL) -> str | None:
    """None when PostgreSQL answers at ``url``, else a sentence saying why not."""
    try:
        import psycopg

        with psycopg.connect(pg_admin(url), connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as e:  # noqa: BLE001 - any failure means "no PostgreSQL here"
        return f"PostgreSQL not reachable at {url}: {e}"
    return None


def pg_exec(url: str, *statements: str) -> None:
    """Run ``statements`` on ``url``'s database, each committed at once (DDL, roles)."""
    needs("postgres", "PostgreSQL statements")
    import psycopg

    with psycopg.connect(pg_admin(url), autocommit=True, connect_timeout=10) as conn:
        for statement in statements:
            conn.execute(statement)


@contextmanager
def pg_schema(url: str = POSTGRES_URL, prefix: str = "test") -> Iterator[str]:
    """A fresh schema of its own on ``url``'s database, dropped at the end: yields ``url``
    with that schema as its search_path (libpq options), so its tables are its own."""
    from sqlalchemy.engine import make_url

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    pg_exec(url, f'CREATE SCHEMA "{name}"')
    try:
        yield (
            make_url(url)
            .update_query_dict({"options": f"-csearch_path={name}"})
            .render_as_string(hide_password=False)
        )
    finally:
        pg_exec(url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def pg_bin(name: str) -> str | None:
    found = sorted(glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class PgCluster:
    """initdb + pg_ctl in a temp dir on a free loopback port, run as ``postgres`` when this
    process is root (initdb refuses root)."""

    def __init__(self) -> None:
        needs("postgres", "a PostgreSQL cluster")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="studio-pg-"))
        self.data = self.dir / "data"
        self.user: list[str] = []
        self.postmaster: int | None = None  # its pid while it runs
        if os.getuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self.user = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, timeout: float = 60) -> None:
        proc = subprocess.run([*self.user, *argv], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {proc.stdout}{proc.stderr}")

    def init(self) -> None:
        initdb = pg_bin("initdb")
        assert initdb
        self._run(
            initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"
        )

    def start(self) -> None:
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} "
            "-c fsync=off -c max_connections=200"
        )
        self._run(
            pg_bin("pg_ctl") or "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            opts,
            "-l",
            str(self.dir / "pg.log"),
            "-w",
            "start",
        )
        # pg_ctl's postmaster is no child of this process: the reaper stops it by its pid
        # (SIGINT: PostgreSQL's fast shutdown, what ``stop`` asks) and removes the cluster's
        # folder if this process ends first
        self.postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        own(self.postmaster, signal.SIGINT, remove=self.dir)

    def stop(self) -> None:
        """A fast shutdown: connected clients are cut off, as in an outage."""
        self._run(pg_bin("pg_ctl") or "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        if self.postmaster is not None:
            disown(self.postmaster)
            self.postmaster = None

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def cleanup(self) -> None:
        if self.running():
            try:
                self.stop()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def start_pg_cluster() -> PgCluster:
    """A started PgCluster (``with`` it: removed at the end); missing server binaries, or
    runuser as root, skip (fail under CI)."""
    require(
        pg_bin("initdb") is not None and pg_bin("pg_ctl") is not None,
        "PostgreSQL server binaries (initdb, pg_ctl) are not installed",
    )
    require(
        os.getuid() != 0 or shutil.which("runuser") is not None,
        "runuser is needed to run initdb as postgres",
    )
    cluster = PgCluster()
    try:
        cluster.init()
        cluster.start()
    except BaseException:
        cluster.cleanup()
        raise
    return cluster


#: the release just before migrations (main's HEAD then): today's schema, no version table
#: what each release before migrations made of a run store (tests/data/store_schemas)
CAPTURES = sorted((ROOT / "tests" / "data" / "store_schemas").glob("*.json"))
TODAY = next(p for p in CAPTURES if p.name.endswith("7b92b13.json"))


def made_by_an_older_release(url: str, capture: dict[str, Any]) -> None:
    """The store ``capture`` describes: its release's DDL, then the rows its calls wrote."""
    from sqlalchemy import create_engine

    from executor.store.schema import UtcDateTime, metadata
    from executor.store.sql import normalize_url

    engine = create_engine(normalize_url(url))
    dialect = engine.dialect.name
    try:
        with engine.begin() as conn:
            for statement in capture["ddl"][dialect]:
                conn.exec_driver_sql(statement)
            for name, rows in capture["rows"].items():
                table = metadata.tables[name]
                values = [
                    {
                        k: datetime.fromisoformat(v)
                        if v is not None and isinstance(table.c[k].type, UtcDateTime)
                        else v
                        for k, v in row.items()
                        if k != "id"  # the audit's: the database numbers them, as it did
                    }
                    for row in rows
                ]
                if values:
                    conn.execute(table.insert(), values)
    finally:
        engine.dispose()
