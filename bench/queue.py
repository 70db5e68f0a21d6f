"""Benchmark of the queue, in ONE run: its own redis-server and Celery worker (prefork,
``--slots`` run slots), the real client, Docker, a SQLite run store. No assertions.

* queue overhead: submit -> result back in the caller (``wait``), minus the executor's own
  ``duration_ms`` (sandbox create -> run -> remove), one job at a time; beside it its
  floor: an empty Celery task on the same Redis and app (``bench.celery_floor``), send ->
  done notice seen, which no queue built on Celery and Redis can go under;
* cancel latency: ``cancel()`` -> the container is gone (polled by label every ~2 ms);
* throughput of trivial nodes at N slots vs N threads running the raw Docker SDK floor
  (create -> attach -> start -> stdin -> read -> wait -> remove, same image, same
  ``sandbox_policy`` flags), interleaved rounds so both see the same machine noise.

    python -m bench.queue [--slots 4] [--n 60] [--cancels 20] [--jobs 80] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import bench_stack, end_stack, pct, raw_container

TRIVIAL = "def main(state):\n    return 1\n"
SPIN = "def main(state):\n    while True:\n        pass\n"
LABEL_JOB = "studio.job_id"


# --- what it measures ------------------------------------------------------------------------


# Another process on the same Docker engine may remove our sandboxes (e.g. a test session's
# clean-up): such a sample is counted as disturbed and measured again, never kept.
DISTURBED: Counter[str] = Counter()


def state_of(size: int) -> dict[str, str]:
    """A state object of about ``size`` bytes of JSON."""
    return {"pad": "s" * max(0, size - 11)}


#: the pause before each overhead sample: the worker is settled (its pools full, no
#: replacement starting, no removal running), so the row measures the queue and not the
#: upkeep of the job before (which a pool process does after each job)
SETTLE_S = 0.5


#: the queue the floor's empty task goes to (``bench.celery_floor``'s worker reads only it)
FLOOR_QUEUE = "bench.floor"


def floor_sample(client: Any) -> float:
    """One round trip of the floor: send the empty task, wait for its done notice (BLPOP,
    as ``wait`` blocks on the real one); ms."""
    from bench.celery_floor import TASK

    key = f"bench:floor:{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    client.app.send_task(TASK, args=(key,), queue=FLOOR_QUEUE, ignore_result=True)
    if client.redis.blpop([key], 10) is None:
        raise RuntimeError("the floor worker did not answer in 10 s")
    took = (time.perf_counter() - t0) * 1000
    client.redis.delete(key)
    return took


class StateFloor:
    """The floor a state's size adds to any queue that keeps it durably: serialise it
    (``json.dumps``, as ``submit`` does with a Python value), write it in one SQLite
    transaction (WAL, synchronous=NORMAL, as the run store) and read it back through
    another connection (as the worker's claim does). Raw ``sqlite3``, no store code; one
    file beside the store."""

    def __init__(self, path: Path) -> None:
        import sqlite3

        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("CREATE TABLE s (id TEXT PRIMARY KEY, state TEXT NOT NULL)")
        # read through a connection of its own, as the worker (another process) reads it
        self.reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def sample(self, state: Any) -> float:
        import json

        key = uuid.uuid4().hex
        t0 = time.perf_counter()
        text = json.dumps(state, ensure_ascii=False, allow_nan=False)
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("INSERT INTO s VALUES (?, ?)", (key, text))
        self.db.execute("COMMIT")
        self.reader.execute("SELECT state FROM s WHERE id = ?", (key,)).fetchone()
        took = (time.perf_counter() - t0) * 1000
        self.db.execute("DELETE FROM s")
        # as the store's own checkpoint thread: the WAL file is reused, not truncated (a
        # truncated one is grown again by the next write, which the store does not pay)
        self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        return took


def overhead(
    client: Any,
    n: int,
    state: Any = None,
    *,
    floor: bool = False,
    state_floor: StateFloor | None = None,
) -> dict[str, list[float]]:
    """The queue's overhead, one job at a time; with ``floor``, each sample is followed by
    one of the floor (an empty Celery task and its notice), and with ``state_floor`` by one
    of the state's own floor, so both sides see the same noise."""
    out: dict[str, list[float]] = {
        "overhead": [],
        "stored": [],
        "submit": [],
        "pickup": [],
        "run": [],
        "floor": [],
        "state_floor": [],
    }
    while len(out["overhead"]) < n:
        time.sleep(SETTLE_S)
        t0 = time.time()
        p0 = time.perf_counter()
        job_id = client.submit(TRIVIAL, "python", {} if state is None else state)
        p1 = time.perf_counter()
        rec = client.wait(job_id, 60, submitted=True)
        wall = (time.perf_counter() - p0) * 1000
        if rec.status != "succeeded":
            DISTURBED["overhead"] += 1
            continue
        out["overhead"].append(wall - (rec.duration_ms or 0))
        out["stored"].append((rec.finished_at.timestamp() - t0) * 1000 - (rec.duration_ms or 0))
        out["submit"].append((p1 - p0) * 1000)
        out["pickup"].append((rec.started_at.timestamp() - t0) * 1000 - out["submit"][-1])
        out["run"].append(rec.duration_ms or 0)
        if floor:
            time.sleep(SETTLE_S / 5)
            out["floor"].append(floor_sample(client))
        if state_floor is not None:
            time.sleep(SETTLE_S / 5)
            out["state_floor"].append(state_floor.sample(state))
    return out


def e2e_interleaved(clients: list[Any], n: int) -> list[list[float]]:
    """submit→result in the caller, one job at a time, alternating between ``clients`` (each
    with its own worker), so both see the same machine noise; ms per client."""
    out: list[list[float]] = [[] for _ in clients]
    while min(len(x) for x in out) < n:
        for i, client in enumerate(clients):
            t0 = time.perf_counter()
            rec = client.wait(client.submit(TRIVIAL, "python", {}), 60, submitted=True)
            if rec.status != "succeeded":
                DISTURBED["e2e"] += 1
                continue
            out[i].append((time.perf_counter() - t0) * 1000)
    return out


def cancel_latency(client: Any, api: Any, n: int) -> tuple[list[float], list[float]]:
    gone: list[float] = []
    ended: list[float] = []
    while len(gone) < n:
        job_id = client.submit(SPIN, "python", {})
        flt = {"name": f"^/studio-code-{job_id}$"}  # cold or pre-started: its job's name
        deadline = time.monotonic() + 30
        while not api.containers(filters={**flt, "status": "running"}):
            if time.monotonic() > deadline:
                raise RuntimeError("the spinning job never started")
            time.sleep(0.01)
        time.sleep(0.2)  # let it spin
        t0 = time.perf_counter()
        client.cancel(job_id)
        while api.containers(all=True, filters=flt):
            time.sleep(0.002)
        t_gone = time.perf_counter() - t0
        rec = client.wait(job_id, 30)
        t_ended = time.perf_counter() - t0
        if rec.status != "cancelled":
            DISTURBED["cancel"] += 1
            continue
        gone.append(t_gone)
        ended.append(t_ended)
    return gone, ended


def queue_throughput(client: Any, jobs: int) -> float:
    t0 = time.perf_counter()
    ids = [client.submit(TRIVIAL, "python", {}) for _ in range(jobs)]
    # One at a time on the worker's done notices: polling the store for all of them would
    # take CPU from the machine under test.
    recs = [client.wait(job_id, 120) for job_id in ids]
    took = time.perf_counter() - t0
    DISTURBED["throughput"] += sum(r.status != "succeeded" for r in recs)
    return jobs / took


def in_threads(threads: int, jobs: int, one: Callable[[], object]) -> float:
    """Run ``one`` ``jobs`` times over ``threads`` threads; returns jobs per second."""
    left = [jobs]
    lock = threading.Lock()

    def loop() -> None:
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            one()

    t0 = time.perf_counter()
    pool = [threading.Thread(target=loop) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return jobs / (time.perf_counter() - t0)


def raw_throughput(settings: Any, api: Any, threads: int, jobs: int) -> float:
    """``threads`` threads of the raw SDK floor, ``jobs`` containers in all."""
    from executor.languages import get_language
    from executor.models import CodeJob
    from executor.runtimes.base import owner_id
    from executor.runtimes.docker.policy import sandbox_policy
    from executor.service import Executor

    lang = get_language("python")
    limits = Executor(settings).limits(10)

    def one() -> None:
        job = CodeJob(code=TRIVIAL)
        raw_container(
            api, sandbox_policy(settings, lang, job, limits, owner_id()), lang.stdin_payload(job)
        )

    return in_threads(threads, jobs, one)


def executor_throughput(settings: Any, threads: int, jobs: int) -> float:
    """``threads`` threads calling Executor.run in this process: the same executor the
    worker runs, without the queue (tells the queue's share from the executor's)."""
    from executor.models import CodeJob
    from executor.service import Executor

    ex = Executor(settings)

    def one() -> None:
        r = ex.run(CodeJob(code=TRIVIAL, timeout_s=20))
        if r.status != "succeeded":
            DISTURBED["throughput"] += 1

    return in_threads(threads, jobs, one)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.queue")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--n", type=int, default=60, help="jobs for the overhead, one at a time")
    p.add_argument("--cancels", type=int, default=20)
    p.add_argument("--jobs", type=int, default=80, help="jobs per throughput round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--big", type=int, default=10, help="jobs with a 10 MB state, one at a time")
    p.add_argument(
        "--database-url",
        default="",
        help="run store URL (default: a new SQLite file in a temporary folder)",
    )
    args = p.parse_args()

    import docker

    # the worker, and the same worker with no pre-started sandboxes on its own Redis and
    # store; every slot reads code.run, so N slots are compared with N raw floors
    slots = {"code_concurrency": args.slots, "queue_test_slots": 0}
    stack = stack_cold = None
    try:
        stack = bench_stack("queue", database_url=args.database_url or None, **slots)
        stack_cold = bench_stack("queue-cold", code_prewarm=0, **slots)
        tmp, db = stack.workdir, stack.database_url
        settings, client, client_cold = stack.settings, stack.client, stack_cold.client
        stack.start_worker(concurrency=args.slots, stop_timeout=30)
        stack_cold.start_worker(concurrency=args.slots, stop_timeout=30)
        # The floor: an empty task on the same Redis, through its own 1-process worker.
        stack.start_worker(
            concurrency=1, app="bench.celery_floor", queues=FLOOR_QUEUE, stop_timeout=30
        )
        api = docker.from_env(timeout=60).api
        for c in (client, client_cold):
            for _ in range(5):  # warm-up: every pool process, the engine, the store
                c.wait(c.submit(TRIVIAL, "python", {}), 60)
        raw_throughput(settings, api, args.slots, 2 * args.slots)

        for _ in range(3):
            floor_sample(client)  # warm-up
        ov = overhead(client, args.n, floor=True)
        # the same with a state of 1 KB and of 10 MB (the queue must not grow with it)
        ov_1k = overhead(client, args.n, state_of(1024))
        ov_10m = overhead(
            client,
            args.big,
            state_of(10 * 1024 * 1024),
            floor=True,
            state_floor=StateFloor(tmp / "state-floor.db"),
        )
        e2e_pool, e2e_cold = e2e_interleaved([client, client_cold], args.n)
        gone, ended = cancel_latency(client, api, args.cancels)
        queue_rates, raw_rates, ex_rates, cold_rates = [], [], [], []
        for _ in range(args.rounds):
            raw_rates.append(raw_throughput(settings, api, args.slots, args.jobs))
            queue_rates.append(queue_throughput(client, args.jobs))
            cold_rates.append(queue_throughput(client_cold, args.jobs))
            ex_rates.append(executor_throughput(settings, args.slots, args.jobs))

        def ms(xs: list[float], q: float) -> str:
            return f"{pct(xs, q):.1f} ms"

        cpus = os.cpu_count()
        print(
            f"# bench.queue: 1 worker, {args.slots} slots all on code.run "
            "(STUDIO_QUEUE_TEST_SLOTS=0), prefork; "
            f"{'SQLite' if db.startswith('sqlite') else 'PostgreSQL'} store; redis-server "
            f"(AOF everysec); {cpus} CPUs"
        )
        print("| what | p50 | p95 / p99 | goal |")
        print("|---|---|---|---|")
        print(
            f"| queue overhead: submit→result in the caller − executor duration_ms "
            f"(n={args.n}, one at a time, {SETTLE_S} s apart) | {ms(ov['overhead'], 50)} | "
            f"p95 {ms(ov['overhead'], 95)} | ≤ 5 ms |"
        )
        for label, o in (("1 KB", ov_1k), ("10 MB", ov_10m)):
            print(
                f"| … the same with a {label} state (n={len(o['overhead'])}) | "
                f"{ms(o['overhead'], 50)} | p95 {ms(o['overhead'], 95)} | "
                f"{'≤ 5 ms' if label == '1 KB' else '≤ 50 ms'} |"
            )
            print(
                f"| … … of which submit() (state check, store row + send) | "
                f"{ms(o['submit'], 50)} | p95 {ms(o['submit'], 95)} | |"
            )
            if o["state_floor"]:
                both = [f + s for f, s in zip(o["floor"], o["state_floor"], strict=True)]
                print(
                    f"| … … its floor, interleaved: the empty Celery task + json.dumps of the "
                    f"state + one SQLite INSERT and SELECT of it (raw sqlite3) | "
                    f"{ms(both, 50)} | p95 {ms(both, 95)} | |"
                )
        print(
            f"| … the floor, interleaved with the first row: an EMPTY Celery task on the same "
            f"Redis (same app and options, 1 prefork process), send → its done notice seen by "
            f"the caller (n={len(ov['floor'])}) | {ms(ov['floor'], 50)} | "
            f"p95 {ms(ov['floor'], 95)} | |"
        )
        print(
            f"| queue overhead to the STORED result: submit→finished_at − duration_ms | "
            f"{ms(ov['stored'], 50)} | p95 {ms(ov['stored'], 95)} | ≤ 5 ms |"
        )
        print(
            f"| … of which submit() (store row + send) | {ms(ov['submit'], 50)} | "
            f"p95 {ms(ov['submit'], 95)} | |"
        )
        print(
            f"| … of which submit() returned → claimed (started_at) | {ms(ov['pickup'], 50)} "
            f"| p95 {ms(ov['pickup'], 95)} | |"
        )
        print(
            f"| executor duration_ms of the same jobs (not overhead) | {ms(ov['run'], 50)} | "
            f"p95 {ms(ov['run'], 95)} | |"
        )
        print(
            f"| queue path e2e, trivial node, submit→result in the caller, pool on (n="
            f"{args.n}, interleaved with the next row) | {ms(e2e_pool, 50)} | "
            f"p95 {ms(e2e_pool, 95)} | |"
        )
        print(
            f"| … the same worker with STUDIO_CODE_PREWARM=0 (cold sandboxes) | "
            f"{ms(e2e_cold, 50)} | p95 {ms(e2e_cold, 95)} | |"
        )
        print(
            f"| cancel latency: cancel() → container gone (n={args.cancels}) | "
            f"{pct(gone, 50) * 1000:.0f} ms | p99 {pct(gone, 99) * 1000:.0f} ms | ≤ 500 ms |"
        )
        print(
            f"| cancel() → job `cancelled` seen by wait() | {pct(ended, 50) * 1000:.0f} ms | "
            f"p99 {pct(ended, 99) * 1000:.0f} ms | |"
        )
        print()
        print(
            f"| throughput, trivial nodes, {args.jobs} per round | queue, {args.slots} slots, "
            f"pool (jobs/s) | queue, {args.slots} slots, no pool | raw SDK floor, {args.slots} "
            f"threads | queue (pool) / raw | executor, {args.slots} threads, no queue | "
            "queue / executor |"
        )
        print("|---|---|---|---|---|---|---|")
        rows = zip(queue_rates, cold_rates, raw_rates, ex_rates, strict=True)
        for i, (q, c, r, e) in enumerate(rows, 1):
            print(
                f"| round {i} | {q:.2f} | {c:.2f} | {r:.2f} | {q / r:.2f}x | {e:.2f} | "
                f"{q / e:.2f}x |"
            )
        n = len(queue_rates)
        q_all, r_all, e_all = sum(queue_rates) / n, sum(raw_rates) / n, sum(ex_rates) / n
        c_all = sum(cold_rates) / n
        print(
            f"| mean | {q_all:.2f} | {c_all:.2f} | {r_all:.2f} | {q_all / r_all:.2f}x (goal ≥ "
            f"0.85x) | {e_all:.2f} | {q_all / e_all:.2f}x |"
        )
        if sum(DISTURBED.values()):
            print(
                f"\nsamples disturbed by another process removing our sandboxes (dropped "
                f"and measured again; throughput jobs that failed so): {dict(DISTURBED)}"
            )
    finally:
        end_stack(stack)
        end_stack(stack_cold)


if __name__ == "__main__":
    main()
