"""Benchmark of opening the run store (what every worker, health check and API start pays),
on a SQLite file and PostgreSQL (when STUDIO_TEST_POSTGRES_URL or the local test server
answers). No assertions.

Rows: a store already at the schema's HEAD, opened and closed (the floor beside it: the same
engine's connect and ``SELECT 1``); the first open of an empty store (the revisions run);
the first open of a store made by the release before migrations (baseline + stamp). Then the
job path's three writes (create, claim, finish) through the store's DBAPI lane
(``executor.store.fast``), beside the same calls through SQLAlchemy (the lane switched off),
one job each in turn.

    python -m bench.store_open [--n 50] [--writes 300]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from bench.common import interleave, pct, row, timed

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
        from testkit.postgres import TODAY, made_by_an_older_release
    except ImportError:  # the code before migrations: no such store to upgrade
        return
    capture = json.loads(TODAY.read_text())
    before: list[float] = []
    for _ in range(max(3, n // 10)):
        old = fresh()
        made_by_an_older_release(old, capture)
        before.append(timed(lambda: SqlRunStore(old).close()))  # noqa: B023 - called at once
    print(row(f"{name}: first open of a store made before migrations", before, None, goal=None))


def _job_path(name: str, url: str, n: int) -> None:
    """create / claim / finish of one job, through the lane and through SQLAlchemy in turn."""
    from executor.models import CodeJob, CodeResult, Status
    from executor.store import SqlRunStore

    store = SqlRunStore(url)
    lane = store._lane
    if lane is None:
        store.close()
        print(f"| {name}: no DBAPI lane on this database | | | |")
        return
    took: dict[tuple[str, bool], list[float]] = {}

    def one(use_lane: bool) -> None:
        store._lane = lane if use_lane else None
        job = CodeJob(code="def main(state):\n    return 1\n", state_json='{"a": 1}')
        result = CodeResult(
            job_id=job.job_id,
            language="python",
            status=Status.SUCCEEDED,
            output={"n": 1},
            logs="one line\n",
            runtime="docker",
            code_runtime="docker",
        )
        for write, call in (
            ("create", lambda: store.create(job, code_runtime="docker")),
            ("claim", lambda: store.claim(job.job_id, "bench:1")),
            ("finish", lambda: store.finish_with_outcome(result, worker="bench:1")),
        ):
            took.setdefault((write, use_lane), []).append(timed(call))

    try:
        for _ in range(5):  # warm-up: both sides' statements compiled, the pool filled
            one(True)
            one(False)
        took.clear()
        for _ in range(n):
            one(True)
            one(False)
    finally:
        store._lane = lane
        store.close()
    for write in ("create", "claim", "finish"):
        lane_ms, sa_ms = took[(write, True)], took[(write, False)]
        a50, b50 = pct(lane_ms, 50), pct(sa_ms, 50)
        print(
            f"| {name}: {write} | {a50:.3f} / {pct(lane_ms, 95):.3f} | "
            f"{b50:.3f} / {pct(sa_ms, 95):.3f} | {a50 / b50:.2f}x, {a50 - b50:+.3f} ms |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--writes", type=int, default=300, help="jobs per side, job path")
    args = parser.parse_args()
    print("| case | p50 / p95 ms | floor p50 / p95 ms (connect + SELECT 1) | vs floor |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        _section("SQLite", lambda: f"sqlite:///{tmp}/{uuid.uuid4().hex}.db", args.n)
    from testkit.postgres import POSTGRES_URL, pg_schema, pg_unreachable

    if pg_unreachable(POSTGRES_URL) is None:  # else SQLite rows only
        with ExitStack() as schemas:  # a fresh schema per open, all dropped at the end
            _section(
                "PostgreSQL",
                lambda: schemas.enter_context(pg_schema(POSTGRES_URL, "bench_open")),
                args.n,
            )
    print()
    print("| job path write | lane p50 / p95 ms | SQLAlchemy p50 / p95 ms | lane vs SQLAlchemy |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        _job_path("SQLite", f"sqlite:///{tmp}/path.db", args.writes)
    if pg_unreachable(POSTGRES_URL) is None:
        with pg_schema(POSTGRES_URL, "bench_path") as url:
            _job_path("PostgreSQL", url, args.writes)


if __name__ == "__main__":
    main()
