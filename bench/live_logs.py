"""Benchmark of live logs, in ONE run: its own redis-server, a Celery worker, the real API
(``studio-code serve``), Docker, a SQLite run store. No assertions.

A node prints its clock (time.time()) every 100 ms; the reader notes when each line arrives:
print -> SSE event (``GET /api/runs/{id}/logs?follow=1``) and print -> ``CodeClient.
follow_logs`` (Redis directly), beside the floor measured in the same run: one XADD seen by
a blocked XREAD on the same Redis (the transport alone). Same host, same clock.

    python -m bench.live_logs [--lines 40]
"""

from __future__ import annotations

import argparse
import threading
import time

from bench.common import bench_stack, end_stack, pct

PRINTER = (
    "import time\n"
    "def main(state):\n"
    "    time.sleep(1)  # the reader is connected by then: only live lines are timed\n"
    "    for _ in range(state['n']):\n"
    "        print(repr(time.time()), flush=True)\n"
    "        time.sleep(0.1)\n"
    "    return 1\n"
)


def _lags(lines: list[tuple[float, str]]) -> list[float]:
    out = []
    for arrived, text in lines:
        for line in text.splitlines():
            try:
                out.append((arrived - float(line)) * 1000)
            except ValueError:
                pass
    return out


def floor(redis_url: str, n: int) -> list[float]:
    import redis

    a, b = redis.Redis.from_url(redis_url), redis.Redis.from_url(redis_url)
    key = "bench:floor"
    out: list[float] = []
    for _ in range(n):
        last = a.xadd(key, {"d": "x"})
        got: list[float] = []

        def read(last: bytes = last, got: list[float] = got) -> None:
            b.xread({key: last}, block=2000)
            got.append(time.time())

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.02)
        t0 = time.time()
        a.xadd(key, {"d": "y"})
        reader.join()
        out.append((got[0] - t0) * 1000)
    a.delete(key)
    a.close()
    b.close()
    return out


def main() -> None:
    import httpx

    p = argparse.ArgumentParser(prog="python -m bench.live_logs")
    p.add_argument("--lines", type=int, default=40)
    args = p.parse_args()
    stack = bench_stack("logs", code_languages="python")
    try:
        client = stack.client
        stack.start_worker(concurrency=2, stop_timeout=30)
        api = stack.start_api()
        http = httpx.Client(base_url=api.base, timeout=60)
        # the API builds its client (store, executor) on the first call: not timed
        http.get("/api/runs/warm-up/logs", headers={"X-Studio-User": "bench"})
        sse: list[tuple[float, str]] = []
        job = client.submit(PRINTER, state={"n": args.lines}, user="bench")
        with http.stream(
            "GET",
            f"/api/runs/{job}/logs",
            params={"follow": 1},
            headers={"X-Studio-User": "bench"},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    sse.append((time.time(), line[5:].strip()))
                if line.startswith("event: end") or line.startswith("event:end"):
                    break
        direct: list[tuple[float, str]] = []
        job = client.submit(PRINTER, state={"n": args.lines}, user="bench")
        for event in client.follow_logs(job):
            if event.event == "log":
                direct.append((time.time(), event.data))
        base_ms = floor(stack.redis_url, args.lines)
        print(f"live logs: {args.lines} printed lines per reader")
        print(f"  {'':44} {'p50 ms':>8} {'p95 ms':>8}")
        for label, ms in [
            ("Redis XADD -> blocked XREAD (floor)", base_ms),
            ("print -> CodeClient.follow_logs", _lags(direct)),
            ("print -> SSE event (GET .../logs?follow=1)", _lags(sse)),
        ]:
            print(f"  {label:44} {pct(ms, 50):8.2f} {pct(ms, 95):8.2f}", flush=True)
        http.close()
    finally:
        end_stack(stack)


if __name__ == "__main__":
    main()
