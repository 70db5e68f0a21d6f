"""Benchmark of opening the run store (what every worker, health check and API start pays),
on a SQLite file and PostgreSQL (when STUDIO_TEST_POSTGRES_URL or the local test server
answers). No assertions.

Rows: a store already at the schema's HEAD, opened and closed (the floor beside it: the same
engine's connect and ``SELECT 1``); the first open of an empty store (the revisions run);
the first open of a store made by the release before migrations (baseline + stamp).

    python -m bench.store_open [--n 50]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from bench.common import interleave, row, timed

ROOT = Path(__file__).resolve().parent.parent


def _section(name: str, fresh: Callable[[], str], n: int) -> None:
    from sqlalchemy import text

    from executor.store import SqlRunStore

    url = fresh()
    SqlRunStore(url).close()
    floor_store = SqlRunStore(url)

    def floor() -> None:
        with floor_store.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        floor_store.engine.dispose()

    opened, floors = interleave(n, [lambda: SqlRunStore(url).close(), floor])
    floor_store.close()
    print(row(f"{name}: open a store at HEAD", opened, floors, goal=None))
    empty = [timed(lambda: SqlRunStore(fresh()).close()) for _ in range(max(3, n // 10))]
    print(row(f"{name}: first open of an empty store", empty, None, goal=None))
    try:
        from tests.services import TODAY, made_by_an_older_release
    except ImportError:  # the code before migrations: no such store to upgrade
        return
    capture = json.loads(TODAY.read_text())
    before: list[float] = []
    for _ in range(max(3, n // 10)):
        old = fresh()
        made_by_an_older_release(old, capture)
        before.append(timed(lambda: SqlRunStore(old).close()))  # noqa: B023 - called at once
    print(row(f"{name}: first open of a store made before migrations", before, None, goal=None))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50)
    args = parser.parse_args()
    print("| case | p50 / p95 ms | floor p50 / p95 ms (connect + SELECT 1) | vs floor |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        _section("SQLite", lambda: f"sqlite:///{tmp}/{uuid.uuid4().hex}.db", args.n)
    from tests.services import POSTGRES_URL, pg_schema, pg_unreachable

    if pg_unreachable(POSTGRES_URL) is None:  # else SQLite rows only
        with ExitStack() as schemas:  # a fresh schema per open, all dropped at the end
            _section(
                "PostgreSQL",
                lambda: schemas.enter_context(pg_schema(POSTGRES_URL, "bench_open")),
                args.n,
            )


if __name__ == "__main__":
    main()
