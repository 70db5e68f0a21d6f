"""Benchmark of run history, in ONE run: a run store of 100,000 synthetic runs (SQLite file,
and PostgreSQL when STUDIO_TEST_POSTGRES_URL or the local test server answers), the real
API (``studio-code serve``) on it, and httpx. No assertions.

Rows: ``GET /api/runs`` pages (admin: everyone's; a user's own; a rare status; a page deep
in the history through the cursor), p50/p95, beside two floors measured interleaved in the
same run: ``GET /healthz/live`` (the HTTP floor: uvicorn + FastAPI, no store) and the same
page read with the raw driver (the SQL floor: sqlite3 / psycopg, no API).

    python -m bench.history [--rows 100000] [--n 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import interleave, pct

if TYPE_CHECKING:
    from testkit.api import ApiServer

ROOT = Path(__file__).resolve().parent.parent


def fill(url: str, rows: int) -> None:
    from sqlalchemy import insert

    from executor.store import SqlRunStore, open_store
    from executor.store.schema import jobs

    store = open_store(url)
    assert isinstance(store, SqlRunStore)
    start = datetime.now(UTC) - timedelta(days=20)
    batch = []
    with store.engine.begin() as conn:
        for i in range(rows):
            at = start + timedelta(seconds=i * 15)
            batch.append(
                {
                    "job_id": uuid.uuid4().hex,
                    "status": "failed" if i % 500 == 0 else "succeeded",
                    "kind": "run",
                    "user": f"user{i % 100}",
                    "language": "python",
                    "code": "def main(state):\n    return state\n" * 10,
                    "state_json": "{}",
                    "code_runtime": "docker",
                    "runtime": "docker",
                    "output": "{}",
                    "logs": "",
                    "logs_truncated": False,
                    "warnings": "[]",
                    "trace": "[]",
                    "duration_ms": 9.0,
                    "queued_at": at,
                    "started_at": at,
                    "finished_at": at,
                    "worker": "w",
                    "attempts": 1,
                }
            )
            if len(batch) == 10_000:
                conn.execute(insert(jobs), batch)
                batch = []
        if batch:
            conn.execute(insert(jobs), batch)
    store.close()


def raw_page(url: str) -> Any:
    """The same first page with the raw driver: the SQL floor."""
    sql = (
        'SELECT job_id, status, kind, "user", language, code_runtime, runtime, error, '
        "duration_ms, queued_at, started_at, finished_at, worker, attempts FROM code_jobs "
        "ORDER BY queued_at DESC, job_id DESC LIMIT 51"
    )
    if url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(url.removeprefix("sqlite:///"), check_same_thread=False)
        return lambda: conn.execute(sql).fetchall()
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    options = u.query.get("options")
    conn2 = psycopg.connect(
        u.set(drivername="postgresql", query={}).render_as_string(hide_password=False),
        **({"options": options} if options else {}),
    )
    return lambda: conn2.execute(sql).fetchall()


def start_api(url: str, tmp: Path, redis_url: str = "redis://127.0.0.1:1/0") -> ApiServer:
    """``studio-code serve`` on the store at ``url`` (a testkit Stack's API, answering
    /healthz/live); the history needs no Redis (the default points nowhere)."""
    from testkit.stack import Stack

    return Stack(tmp, redis_url=redis_url, database_url=url, quiet=True).start_api()


def bench_store(name: str, url: str, rows: int, n: int, tmp: Path) -> None:
    import httpx

    t0 = time.perf_counter()
    fill(url, rows)
    print(f"  {name}: {rows} runs written in {time.perf_counter() - t0:.1f} s", flush=True)
    api = start_api(url, tmp)
    try:
        http = httpx.Client(base_url=api.base, timeout=30)
        admin = {"X-Studio-User": "admin", "X-Studio-Admin": "1"}
        user = {"X-Studio-User": "user7"}
        deep = http.get("/api/runs", params={"limit": 200}, headers=admin).json()
        for _ in range(250):  # 50,000 rows down
            deep = http.get(
                "/api/runs", params={"limit": 200, "cursor": deep["next_cursor"]}, headers=admin
            ).json()
        deep_cursor = deep["next_cursor"]
        floor_sql = raw_page(url)
        cases = [
            ("GET /healthz/live (HTTP floor)", lambda: http.get("/healthz/live")),
            ("raw SQL first page (SQL floor)", floor_sql),
            ("GET /api/runs admin, 50", lambda: http.get("/api/runs", headers=admin)),
            ("GET /api/runs own runs, 50", lambda: http.get("/api/runs", headers=user)),
            (
                "GET /api/runs status=failed",
                lambda: http.get("/api/runs", params={"status": "failed"}, headers=admin),
            ),
            (
                "GET /api/runs page at 50,000",
                lambda: http.get("/api/runs", params={"cursor": deep_cursor}, headers=admin),
            ),
        ]
        times = interleave(n, [fn for _, fn in cases], warmup=5)
        floor = pct(times[0], 50)
        print(f"  {'':38} {'p50 ms':>8} {'p95 ms':>8} {'p50/HTTP floor':>15}")
        for (label, _), t in zip(cases, times, strict=True):
            print(
                f"  {name + ' ' + label:38} {pct(t, 50):8.2f} {pct(t, 95):8.2f} "
                f"{pct(t, 50) / floor:15.2f}",
                flush=True,
            )
        http.close()
    finally:
        api.stop()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.history")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args()
    print(f"run history: {args.rows} runs, {args.n} interleaved rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="studio-bench-history-") as d:
        tmp = Path(d)
        bench_store("sqlite", f"sqlite:///{tmp / 'runs.db'}", args.rows, args.n, tmp)
        from testkit.postgres import POSTGRES_URL, pg_schema, pg_unreachable

        why = pg_unreachable(POSTGRES_URL)
        if why is not None:  # no PostgreSQL here: SQLite rows only
            print(f"  postgresql: skipped ({why})")
            return
        with pg_schema(POSTGRES_URL, "bench") as url:
            bench_store("postgresql", url, args.rows, args.n, tmp)


if __name__ == "__main__":
    main()
