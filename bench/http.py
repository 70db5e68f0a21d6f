"""Benchmark of the HTTP API under waiting test calls, in ONE run: its own redis-server, one
Celery worker, ``studio-code serve`` (uvicorn) on loopback with STUDIO_API_TOKEN, a SQLite
run store. No assertions.

GET /healthz/live and GET /api/runs/{id} are timed one after the other (p50 / p99) while
nothing waits, then while ``--calls`` editor test calls from ``--users`` users wait for
their result (their code sleeps; one worker slot, so nearly all of them wait queued), then
with nothing waiting again. Goal: loaded p99 ≤ 2x the idle p99 and ≤ 100 ms.

    python -m bench.http [--calls 200] [--users 20] [--n 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import bench_stack, end_stack, pct
from bench.queue import SETTLE_S

SLEEP = "import time\n\ndef main(state):\n    time.sleep(60)\n    return 1\n"
TRIVIAL = "def main(state):\n    return 1\n"


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def unfinished_tests(db: Path) -> int:
    """Editor test calls stored and not finished (queued or running)."""
    with sqlite3.connect(db, timeout=30) as conn:
        row = conn.execute(
            "SELECT COUNT(*) FROM code_jobs WHERE kind = 'test' AND status IN ('queued', 'running')"
        ).fetchone()
    return int(row[0])


def run_call(c: Any, wait_s: float = 0) -> float:
    """A workflow run through HTTP as the studio makes it: ``POST /api/runs``, then
    ``GET /api/runs/{id}`` again as soon as each answers (with ``wait_s``: the long poll
    ``?wait=``), until the run has finished; its overhead (ms): the wall − the run's
    duration_ms."""
    params = {"wait": wait_s} if wait_s else None
    t0 = time.perf_counter()
    r = c.post("/api/runs", json={"code": TRIVIAL}, timeout=60)
    if r.status_code != 202:
        raise RuntimeError(f"POST /api/runs answered {r.status_code}: {r.text[:300]}")
    job_id = r.json()["job_id"]
    while True:
        body = c.get(f"/api/runs/{job_id}", params=params, timeout=60).json()
        if body["status"] not in ("queued", "running"):
            break
    wall = (time.perf_counter() - t0) * 1000
    if body["status"] != "succeeded":
        raise RuntimeError(f"the run ended {body['status']}: {body.get('error')}")
    return wall - float(body["duration_ms"])


def client_call(client: Any, kind: str) -> float:
    """The same job through the queue without HTTP (CodeClient.submit → wait, as the routes
    submit and wait): its overhead (ms), the wall − the run's duration_ms."""
    t0 = time.perf_counter()
    job_id = client.submit(TRIVIAL, "python", {}, user="bench", kind=kind)
    rec = client.wait(job_id, submitted=True)
    wall = (time.perf_counter() - t0) * 1000
    if rec.status != "succeeded":
        raise RuntimeError(f"the queued {kind} job ended {rec.status}: {rec.error}")
    return wall - float(rec.duration_ms or 0)


def test_call_overhead(
    base: str,
    auth: dict[str, str],
    n: int,
    client: Any = None,
    executor: Any = None,
    *,
    runs: bool = False,
) -> dict[str, list[float]]:
    """n editor test calls one at a time, SETTLE_S apart: ``wall`` (ms) and ``over`` (wall
    − the run's duration_ms). With ``client`` (a CodeClient on the same Redis, store and
    worker), each call is followed by the same job through the queue without HTTP
    (``queue``: submit → wait − duration_ms); with ``executor`` (pre-started sandboxes, in
    this process), by the same node run in-process (``inproc``: its wall); with ``runs``,
    by a workflow run through HTTP (``runs``: ``run_call``, polled back to back; and
    ``runs_wait``: the long poll ``?wait=``) and, with ``client``, the same run through the
    queue (``queue_run``), so every side sees the same noise."""
    import httpx

    from executor.models import CodeJob

    out: dict[str, list[float]] = {
        k: [] for k in ("wall", "over", "queue", "inproc", "bare", "runs", "runs_wait", "queue_run")
    }
    with httpx.Client(base_url=base, headers={**auth, "X-Studio-User": "bench"}) as c:
        while len(out["wall"]) < n:
            time.sleep(SETTLE_S)  # each call on a settled worker (see bench.queue)
            t0 = time.perf_counter()
            r = c.post("/api/code/test", json={"code": TRIVIAL}, timeout=60)
            wall = (time.perf_counter() - t0) * 1000
            body = r.json()
            if r.status_code != 200 or body.get("status") != "succeeded":
                raise RuntimeError(f"test call answered {r.status_code}: {r.text[:300]}")
            out["wall"].append(wall)
            out["over"].append(wall - float(body["duration_ms"]))
            # the HTTP floor beside it: a bare round trip of the same client and server, as
            # settled as the call (what any HTTP API on this stack pays, not the route)
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            c.get("/healthz/live", timeout=60).raise_for_status()
            out["bare"].append((time.perf_counter() - t0) * 1000)
            if client is not None:
                time.sleep(SETTLE_S)
                out["queue"].append(client_call(client, "test"))
            if runs:
                time.sleep(SETTLE_S)
                out["runs"].append(run_call(c))
                time.sleep(SETTLE_S)
                out["runs_wait"].append(run_call(c, wait_s=30))
                if client is not None:
                    time.sleep(SETTLE_S)
                    out["queue_run"].append(client_call(client, "run"))
            if executor is not None:
                time.sleep(SETTLE_S)
                t0 = time.perf_counter()
                res = executor.run(CodeJob(language="python", code=TRIVIAL, state_json="{}"))
                out["inproc"].append((time.perf_counter() - t0) * 1000)
                if res.status != "succeeded":
                    raise RuntimeError(f"the in-process run ended {res.status}: {res.error}")
    return out


def probe(base: str, auth: dict[str, str], run_id: str, n: int) -> tuple[list[float], list[float]]:
    """n timings (ms) of each route, interleaved."""
    import httpx

    live, run = [], []
    with httpx.Client(base_url=base, headers=auth, timeout=30) as c:
        for _ in range(n):
            for path, out, h in (
                ("/healthz/live", live, {}),
                (f"/api/runs/{run_id}", run, {"X-Studio-User": "bench"}),
            ):
                t0 = time.perf_counter()
                r = c.get(path, headers=h)
                out.append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, r.text
            time.sleep(0.005)
    return live, run


class Burst:
    """The waiting test calls, held open from a thread with its own event loop."""

    def __init__(self, base: str, auth: dict[str, str], users: list[str], per_user: int):
        self.codes: list[int] = []
        self.answered = 0  # calls ended so far (counted as they end)
        self._stop = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete,
            args=(self._run(base, auth, users, per_user),),
            daemon=True,
        )
        self._thread.start()

    async def _run(self, base: str, auth: dict[str, str], users: list[str], per_user: int) -> None:
        import httpx

        n = len(users) * per_user
        async with httpx.AsyncClient(
            base_url=base, headers=auth, timeout=300, limits=httpx.Limits(max_connections=n + 10)
        ) as c:
            body = {"code": SLEEP, "timeout_s": 30}
            tasks = [
                asyncio.ensure_future(
                    c.post("/api/code/test", json=body, headers={"X-Studio-User": u})
                )
                for u in users
                for _ in range(per_user)
            ]
            for t in tasks:
                t.add_done_callback(lambda _: setattr(self, "answered", self.answered + 1))
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
            while not stop.done() and not all(t.done() for t in tasks):
                await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                t.cancel()
                try:
                    self.codes.append((await t).status_code)
                except (asyncio.CancelledError, httpx.HTTPError):
                    pass
            stop.cancel()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


def print_calls(calls: dict[str, list[float]]) -> None:
    """The rows of ``test_call_overhead``'s samples (with the client, the executor and runs)."""
    print(
        f"| POST /api/code/test, trivial node, one at a time, {SETTLE_S} s apart "
        f"(n={len(calls['wall'])}): whole "
        f"call | {pct(calls['wall'], 50):.1f} / {pct(calls['wall'], 99):.1f} ms | | | |"
    )
    print(
        f"| … its overhead: the call − the run's duration_ms (queue, HTTP, auth, "
        f"limits) | {pct(calls['over'], 50):.1f} ms / p95 {pct(calls['over'], 95):.1f} ms | | | "
        "≤ 10 ms p50 |"
    )
    print(
        f"| … the same job through the queue without HTTP (CodeClient.submit → wait, "
        f"code.test, the same worker; interleaved): its overhead | "
        f"{pct(calls['queue'], 50):.1f} ms / p95 {pct(calls['queue'], 95):.1f} ms | | "
        f"HTTP − queue: {pct(calls['over'], 50) - pct(calls['queue'], 50):+.1f} ms p50 | "
        "≤ +3 ms |"
    )
    print(
        f"| … a bare HTTP round trip beside each call (GET /healthz/live, the same client "
        f"and server, {SETTLE_S} s apart; interleaved) | {pct(calls['bare'], 50):.1f} ms / "
        f"p95 {pct(calls['bare'], 95):.1f} ms | | HTTP − queue − bare round trip: "
        f"{pct(calls['over'], 50) - pct(calls['queue'], 50) - pct(calls['bare'], 50):+.1f} ms "
        "p50 (what the route adds) | |"
    )
    print(
        f"| … the same node run in-process on a pre-started sandbox (Executor.run; "
        f"interleaved): whole run | {pct(calls['inproc'], 50):.1f} / "
        f"{pct(calls['inproc'], 99):.1f} ms | | HTTP call / in-process: "
        f"{pct(calls['wall'], 50) / pct(calls['inproc'], 50):.2f}x p50 | |"
    )
    for name, http, queue in (
        ("POST /api/code/test", calls["over"], calls["queue"]),
        (
            "POST /api/runs + GET /api/runs/{id} until finished (back to back) vs "
            "CodeClient.submit(kind=run) → wait",
            calls["runs"],
            calls["queue_run"],
        ),
        (
            "POST /api/runs + GET /api/runs/{id}?wait=30 (long poll) vs "
            "CodeClient.submit(kind=run) → wait",
            calls["runs_wait"],
            calls["queue_run"],
        ),
    ):
        print(
            f"| HTTP test call vs client p50: {name}, overhead over the run's duration_ms "
            f"(interleaved, n={len(http)}) | {pct(http, 50):.1f} ms / p95 {pct(http, 95):.1f} "
            f"ms | client {pct(queue, 50):.1f} ms / p95 {pct(queue, 95):.1f} ms | "
            f"HTTP − client: {pct(http, 50) - pct(queue, 50):+.1f} ms p50 | ≤ +3 ms |"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--n", type=int, default=300)
    p.add_argument(
        "--calls-only",
        action="store_true",
        help="only the call overheads beside the client's (no probes, no waiting burst)",
    )
    args = p.parse_args()

    import httpx
    import redis as redis_lib

    from executor.service import Executor

    token = secrets.token_hex(24)
    auth = {"Authorization": f"Bearer {token}"}
    per_user = max(1, args.calls // args.users)
    stack = bench_stack(
        "http",
        code_languages="python",
        api_token=token,
        code_test_per_minute=10000,
        code_test_in_flight=per_user,
        code_concurrency=1,
        queue_test_slots=1,
    )
    db = stack.workdir / "runs.db"
    burst = None
    executor = None
    try:
        stack.start_worker(concurrency=1, stop_timeout=30)
        api = stack.start_api(ready_timeout=60)
        base = api.base
        deadline = time.monotonic() + 60
        while True:  # the worker's first heartbeat: until then the API refuses (503)
            r = httpx.post(
                f"{base}/api/runs",
                json={"code": TRIVIAL},
                timeout=30,
                headers={**auth, "X-Studio-User": "bench"},
            )
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if r.status_code != 202:
            raise RuntimeError(f"POST /api/runs answered {r.status_code}: {r.text[:300]}")
        run_id = r.json()["job_id"]
        # the same job through the queue from this process (no HTTP), and the same node
        # run in this process on a pre-started sandbox: interleaved with the HTTP calls
        settings = stack.settings
        queue_client = stack.client
        executor = Executor(settings)
        executor.prepare()
        test_call_overhead(base, auth, 5, queue_client, executor, runs=True)  # warm-up
        calls = test_call_overhead(base, auth, min(args.n, 60), queue_client, executor, runs=True)
        if args.calls_only:
            print(f"# bench.http --calls-only: {os.cpu_count()} CPUs")
            print("| route | idle p50 / p99 | loaded p50 / p99 | p99 loaded / idle | goal |")
            print("|---|---|---|---|---|")
            print_calls(calls)
            return

        api_pid = api.pid
        c0, t0 = cpu_s(api_pid), time.monotonic()
        idle_live, idle_run = probe(base, auth, run_id, args.n)
        idle_cpu = (cpu_s(api_pid) - c0) / (time.monotonic() - t0)
        users = [f"bench-{i}" for i in range(args.users)]
        rc = redis_lib.Redis.from_url(stack.redis_url)
        t0 = time.monotonic()
        burst = Burst(base, auth, users, per_user)
        waiting = 0
        while time.monotonic() - t0 < 180:  # every call admitted, submitted and waiting
            # a slot is taken before the submit: waiting means its job is stored too
            slots = sum(int(rc.zcard(f"studio:inflight:test:{u}")) for u in users)
            waiting = min(slots, unfinished_tests(db))
            if waiting >= len(users) * per_user:
                break
            time.sleep(0.2)
        ramp_s = time.monotonic() - t0
        c0, t1 = cpu_s(api_pid), time.monotonic()
        load_live, load_run = probe(base, auth, run_id, args.n)
        load_cpu = (cpu_s(api_pid) - c0) / (time.monotonic() - t1)
        still = sum(int(rc.zcard(f"studio:inflight:test:{u}")) for u in users)
        with sqlite3.connect(db, timeout=30) as conn:
            ids = [
                row[0] for row in conn.execute("SELECT job_id FROM code_jobs WHERE kind = 'test'")
            ]
        admin = {**auth, "X-Studio-User": "admin", "X-Studio-Admin": "1"}
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda job_id: httpx.post(
                        f"{base}/api/runs/{job_id}/cancel", timeout=60, headers=admin
                    ),
                    ids,
                )
            )
        deadline = time.monotonic() + 60  # the runs end, then every waiting call answers
        while burst.answered < len(users) * per_user and time.monotonic() < deadline:
            time.sleep(0.1)
        burst.stop()
        after_live, after_run = probe(base, auth, run_id, args.n)

        idle_l, idle_r = idle_live + after_live, idle_run + after_run
        print(
            f"# bench.http: {waiting} test calls from {args.users} users waiting "
            f"({still} still waiting after the loaded probes; admitted in {ramp_s:.1f} s); "
            f"n={args.n} per route per phase, sequential; {os.cpu_count()} CPUs"
        )
        print("| route | idle p50 / p99 | loaded p50 / p99 | p99 loaded / idle | goal |")
        print("|---|---|---|---|---|")
        for name, idle, load in (
            ("GET /healthz/live", idle_l, load_live),
            ("GET /api/runs/{id}", idle_r, load_run),
        ):
            print(
                f"| {name} | {pct(idle, 50):.1f} / {pct(idle, 99):.1f} ms | "
                f"{pct(load, 50):.1f} / {pct(load, 99):.1f} ms | "
                f"{pct(load, 99) / pct(idle, 99):.2f}x | ≤ 2x and ≤ 100 ms |"
            )
        print(
            f"| API process CPU while probed | {idle_cpu:.0%} of a core | {load_cpu:.0%} "
            "of a core | | |"
        )
        print_calls(calls)
        answered = sorted(set(burst.codes))
        print(
            f"\nthe waiting calls answered {answered} once their runs were cancelled "
            f"({len(burst.codes)} of {len(users) * per_user})"
        )
    finally:
        if executor is not None:
            executor.close()
        if burst is not None:
            burst.stop()
        end_stack(stack)


if __name__ == "__main__":
    main()
