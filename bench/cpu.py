"""The host CPU one job costs, split into the project's processes and the Docker engine's, so
the part we own is visible as the engine's part moves. No assertions.

Per runtime (docker: pre-started sandboxes, STUDIO_CODE_PREWARM=1; subprocess): its own
redis-server, one Celery worker (prefork, one slot), ``studio-code serve``; ``--n`` editor
test calls (POST /api/code/test, a trivial node) one after the other. The CPU of each
process (utime + stime from /proc/<pid>/stat) is read before and after, the rate of an
idle window of the same length (heartbeats, upkeep) subtracted, and divided by ``--n``:

* ours: the API's process tree, the worker's main process, its pool process (its own
  CPU; what its reaped children used, the subprocess runtime's runners, is the job's
  interpreter and has its own row);
* redis-server (the queue, neither ours nor the engine's);
* the engine: dockerd and containerd (long-lived, children included), and each
  ``containerd-shim*`` (one per container, short-lived: sampled every ``SAMPLE_S`` while
  it lives, the last sample kept, so a shim's last few ms are missed); a shim's reaped
  children (runc, and the sandbox's own processes) are a row of their own. The engine is
  the machine's, shared with anything else using it meanwhile; its processes are only
  read, never signalled.

Beside them, measured in the same run, the floors of the stack the specification names
(what any project on it pays per job, not ours to cut): an EMPTY Celery task on the same
Redis and app (``bench.celery_floor``: its worker's main and pool process), a bare
``GET /healthz/live`` through the same API (uvicorn, FastAPI and the app's middleware), and
(docker) the Docker SDK's five calls of a pre-started sandbox's life (create, attach, start,
rename, remove) made in this process, timed with ``time.process_time``. The API's row is
its CPU over the test calls alone (no other request meanwhile).

    python -m bench.cpu [--n 40] [--runtime docker --runtime subprocess]
"""

from __future__ import annotations

import argparse
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.common import bench_stack, end_stack
from bench.http import TRIVIAL, test_call_overhead
from bench.queue import FLOOR_QUEUE, SETTLE_S, floor_sample
from testkit.api import ApiServer
from testkit.processes import children, process_tree
from testkit.worker import CeleryWorker

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.02
ENGINE = ("dockerd", "containerd")
SHIM = "containerd-shim"  # containerd-shim-runc-v2 (comm is cut at 15 characters)
#: the part of the project's own CPU per job the issue aims at
GOAL_MS = 10.0
#: the longest idle window whose rate is subtracted
IDLE_MAX_S = 60.0


def stat(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU ms of ``pid``; (0, 0) when it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return 0.0, 0.0
    ms = 1000 / TICK
    return (int(f[11]) + int(f[12])) * ms, (int(f[13]) + int(f[14])) * ms


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pids_named(names: Iterable[str], prefix: str | None = None) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            c = comm(int(d))
            if c in names or (prefix and c.startswith(prefix)):
                out.append(int(d))
    return out


class Shims(threading.Thread):
    """Every containerd shim's CPU, read every SAMPLE_S while it lives; ``total()`` is what
    the shims used since ``start`` (own, children's), those alive at start counted from
    their value then."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = {pid: stat(pid) for pid in pids_named((), SHIM)}
        self.last: dict[int, tuple[float, float]] = dict(self.base)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(SAMPLE_S):
            for pid in pids_named((), SHIM):
                s = stat(pid)
                if s != (0.0, 0.0):
                    self.last[pid] = s

    def total(self) -> tuple[float, float]:
        own = sum(v[0] - self.base.get(p, (0.0, 0.0))[0] for p, v in self.last.items())
        kids = sum(v[1] - self.base.get(p, (0.0, 0.0))[1] for p, v in self.last.items())
        return own, kids


def snapshot(
    api: ApiServer, worker: CeleryWorker, redis_pid: int, floor: CeleryWorker
) -> dict[str, float]:
    """CPU ms per group, now (the shims aside)."""
    pool = children(worker.pid)
    engine = pids_named(ENGINE)
    return {
        "api": sum(sum(stat(p)) for p in process_tree(api.pid)),
        "worker main": stat(worker.pid)[0],
        "pool process": sum(stat(p)[0] for p in pool),
        "runner": sum(stat(p)[1] + sum(sum(stat(c)) for c in children(p)) for p in pool),
        "redis-server": sum(stat(redis_pid)),
        "dockerd, containerd": sum(sum(stat(p)) for p in engine),
        "floor worker": sum(sum(stat(p)) for p in process_tree(floor.pid)),
    }


def window(
    api: ApiServer, worker: CeleryWorker, redis_pid: int, floor: CeleryWorker, work: object
) -> tuple[dict[str, float], float]:
    """CPU ms per group (shims included) over ``work()`` (or a sleep of ``work`` s)."""
    shims = Shims()
    shims.start()
    a, t0 = snapshot(api, worker, redis_pid, floor), time.monotonic()
    if callable(work):
        work()
    else:
        time.sleep(float(work))  # type: ignore[arg-type]
    b, took = snapshot(api, worker, redis_pid, floor), time.monotonic() - t0
    shims.halt.set()
    shims.join()
    out = {k: b[k] - a[k] for k in a}
    out["shims"], out["shims' children (runc, the sandbox)"] = shims.total()
    return out, took


def calls(base: str, auth: dict[str, str], n: int, path: str) -> None:
    """``n`` requests one at a time, SETTLE_S apart (as bench.queue settles its jobs): editor
    test calls of a trivial node (``/api/code/test``, each must succeed), or bare GETs."""
    import httpx

    with httpx.Client(base_url=base, headers={**auth, "X-Studio-User": "bench"}) as c:
        for _ in range(n):
            time.sleep(SETTLE_S)
            if path == "/api/code/test":
                r = c.post(path, json={"code": TRIVIAL}, timeout=60)
                if r.status_code != 200 or r.json().get("status") != "succeeded":
                    raise RuntimeError(f"test call answered {r.status_code}: {r.text[:300]}")
            else:
                c.get(path, timeout=60).raise_for_status()


def sdk_floor(image: str, n: int) -> float:
    """CPU ms of the Docker SDK's calls in one pre-started sandbox's life (create, attach,
    start, rename, remove) through this process's client (runtimes/docker/client.py, as the
    pool's), SETTLE_S apart as the jobs; the container waits on its stdin as a runner."""
    import uuid

    from executor.runtimes.docker.client import shared_api

    api = shared_api()
    host_config = api.create_host_config(network_mode="none")
    spent = 0.0
    for _ in range(n):
        time.sleep(SETTLE_S)
        c0 = time.process_time()
        cid = api.create_container(
            image,
            command=["python3", "-c", "import sys; sys.stdin.read()"],
            stdin_open=True,
            host_config=host_config,
            name=f"studio-bench-cpu-{uuid.uuid4().hex[:12]}",
            labels={"studio.bench": "cpu"},
        )["Id"]
        try:
            sock = api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stream": 1})
            api.start(cid)
            api.rename(cid, f"studio-bench-cpu-{uuid.uuid4().hex[:12]}")
            sock._sock.close()
            sock.close()
        finally:
            api.remove_container(cid, force=True)
        spent += time.process_time() - c0
    return spent * 1000 / n


#: commands one connection sends within this long of each other (MONITOR's timestamps) are
#: counted as one round trip: a pipeline's or a transaction's arrive together, while a new
#: round trip waits for the answer of the one before (tens of µs at least on loopback)
TRIP_GAP_S = 50e-6


def _port_pids() -> dict[int, int]:
    """Local TCP port -> the pid holding that socket (loopback connections to Redis)."""
    inode_pid: dict[str, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{d}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inode_pid[link[8:-1]] = int(d)
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inode_pid:
                out[int(f[1].rsplit(":", 1)[1], 16)] = inode_pid[f[9]]
    return out


def redis_per_job(
    redis_url: str, groups: dict[str, list[int]], n: int, work: Callable[[], None]
) -> dict[str, tuple[float, float]]:
    """(commands, round trips) per job each group of processes (name -> pids) sends to
    Redis over ``work()`` (``n`` jobs), read with MONITOR (a script's own commands are not
    counted; its EVALSHA is): the busy window's less an idle window's as long."""
    import redis as redis_lib

    def watch(seconds: float | None) -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        done = threading.Event()
        client = redis_lib.Redis.from_url(redis_url)

        def listen() -> None:
            with client.monitor() as m:
                started.set()
                for cmd in m.listen():
                    seen.append(cmd)
                    if done.is_set():
                        return

        started = threading.Event()
        t = threading.Thread(target=listen, daemon=True)
        t.start()
        started.wait(10)
        time.sleep(0.2)
        t0 = time.time()
        if seconds is None:
            work()
        else:
            time.sleep(seconds)
        t1 = time.time()
        done.set()
        client.ping()  # one more line for the listener to see the stop
        t.join(10)
        client.close()
        return [c for c in seen if t0 <= float(c["time"]) <= t1]

    t0 = time.monotonic()
    busy = watch(None)
    idle = watch(time.monotonic() - t0)
    pid_group = {p: name for name, pids in groups.items() for p in pids}
    ports = _port_pids()
    out = {}
    counted = []
    for lines in (busy, idle):
        cmds: dict[str, int] = dict.fromkeys(groups, 0)
        trips: dict[str, int] = dict.fromkeys(groups, 0)
        last: dict[int, float] = {}
        for c in lines:
            try:
                port = int(str(c["client_port"]))
            except (KeyError, ValueError):
                continue  # a script's own command
            name = pid_group.get(ports.get(port, -1))
            if name is None:
                continue
            at = float(c["time"])
            cmds[name] += 1
            if at - last.get(port, -1.0) > TRIP_GAP_S:
                trips[name] += 1
            last[port] = at
        counted.append((cmds, trips))
    (bc, bt), (ic, it) = counted
    for name in groups:
        out[name] = ((bc[name] - ic[name]) / n, (bt[name] - it[name]) / n)
    return out


def measure(runtime: str, n: int) -> dict[str, float]:
    """CPU ms per job per group, idle rate subtracted, and the floors (``floor: ...``)."""
    token = secrets.token_hex(24)
    auth = {"Authorization": f"Bearer {token}"}
    stack = bench_stack(
        "cpu",
        code_runtime=runtime,
        code_languages="python",
        api_token=token,
        code_test_per_minute=10000,
        code_concurrency=1,
        queue_test_slots=1,
    )
    client = stack.client
    try:
        worker = stack.start_worker(concurrency=1)
        floor = stack.start_worker(
            concurrency=1, app="bench.celery_floor", queues=FLOOR_QUEUE, stop_timeout=30
        )
        api = stack.start_api(ready_timeout=60)
        assert stack.redis is not None and stack.redis.proc is not None
        redis_pid = stack.redis.proc.pid
        deadline = time.monotonic() + 60
        while True:  # until the worker's first heartbeat the API refuses (503)
            try:
                test_call_overhead(api.base, auth, 3)  # warm-up too
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for _ in range(3):
            floor_sample(client)  # warm-up
        time.sleep(2)  # settled: the pool refilled

        def jobs() -> None:
            calls(api.base, auth, n, "/api/code/test")
            time.sleep(1.5)  # the last job's upkeep (its sandbox removed, a new one started)

        def floors() -> None:
            calls(api.base, auth, n, "/healthz/live")
            for _ in range(n):
                time.sleep(SETTLE_S)
                floor_sample(client)

        busy, took = window(api, worker, redis_pid, floor, jobs)
        low, low_s = window(api, worker, redis_pid, floor, floors)
        # The idle rate (heartbeats, upkeep: a few ms a second) is read in 10 ms ticks: over
        # a window as long as the others, or its error, scaled up, outweighs a bare GET.
        idle, idle_s = window(api, worker, redis_pid, floor, min(max(took, low_s), IDLE_MAX_S))
        per = {k: (busy[k] - idle[k] * took / idle_s) / n for k in busy}
        per["floor: bare GET"] = (low["api"] - idle["api"] * low_s / idle_s) / n
        per["floor: empty Celery task"] = (
            low["floor worker"] - idle["floor worker"] * low_s / idle_s
        ) / n
        if runtime == "docker":
            per["floor: SDK calls"] = sdk_floor(client.settings.code_image, n)
        groups = {
            "api": process_tree(api.pid),
            "worker main": [worker.pid],
            "pool process": children(worker.pid),
        }
        for name, (cmds, trips) in redis_per_job(stack.redis_url, groups, n, jobs).items():
            per[f"redis commands: {name}"], per[f"redis trips: {name}"] = cmds, trips
        return per
    finally:
        end_stack(stack)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cpu")
    p.add_argument("--n", type=int, default=40, help="test calls per runtime")
    p.add_argument("--runtime", action="append", choices=["docker", "subprocess"])
    args = p.parse_args()
    print(
        f"# bench.cpu: host CPU per job (ms), {args.n} editor test calls one at a time "
        "through the API and the queue, 1 worker slot, idle rate subtracted; beside them, "
        f"the floors of the stack, measured in the same run; {os.cpu_count()} CPUs"
    )
    print("| runtime | process | CPU ms per job | goal |")
    print("|---|---|---|---|")
    for runtime in args.runtime or ["docker", "subprocess"]:
        per = measure(runtime, args.n)
        ours = per["api"] + per["worker main"] + per["pool process"]
        engine = per["dockerd, containerd"] + per["shims"]
        for name in ("api", "worker main", "pool process"):
            print(f"| {runtime} | ours: {name} | {per[name]:.1f} | |")
        print(f"| {runtime} | **ours, in all** | **{ours:.1f}** | ≤ {GOAL_MS:g} ms |")
        floors = [
            (
                "an EMPTY Celery task on the same Redis and app, its worker's main + pool process",
                per["floor: empty Celery task"],
            ),
            (
                "a bare GET /healthz/live through the same API (uvicorn, FastAPI, the app's "
                "middleware)",
                per["floor: bare GET"],
            ),
        ]
        if runtime == "docker":
            floors.append(
                (
                    "the Docker SDK's 5 calls of a pre-started sandbox's life (create, attach, "
                    "start, rename, remove), in-process",
                    per["floor: SDK calls"],
                )
            )
        for name, value in floors:
            print(f"| {runtime} | floor: {name} | {value:.1f} | |")
        floor = sum(v for _, v in floors)
        print(
            f"| {runtime} | **ours above the stack's floors** ({ours:.1f} − {floor:.1f}) | "
            f"**{ours - floor:.1f}** | |"
        )
        print(
            f"| {runtime} | **our CPU per job vs the stack's floor** ({ours:.1f} / "
            f"{floor:.1f}) | **{ours / floor:.2f}x** | ≤ 1.3x |"
        )
        for name in ("api", "worker main", "pool process"):
            print(
                f"| {runtime} | Redis per job, ours: {name} (MONITOR, idle window's "
                f"subtracted): commands / ≈ round trips | "
                f"{per[f'redis commands: {name}']:.1f} / {per[f'redis trips: {name}']:.1f} | |"
            )
        print(f"| {runtime} | redis-server | {per['redis-server']:.1f} | |")
        if runtime == "subprocess":
            print(f"| {runtime} | the job's runner interpreter | {per['runner']:.1f} | |")
        if runtime == "subprocess":  # no container: what the engine used is anyone else's
            print(f"| {runtime} | engine: none used (others' use meanwhile: {engine:.1f}) | 0 | |")
            continue
        for name in ("dockerd, containerd", "shims", "shims' children (runc, the sandbox)"):
            print(f"| {runtime} | engine: {name} | {per[name]:.1f} | |")
        print(
            f"| {runtime} | **the engine's, in all** (shims' children aside) | **{engine:.1f}** | |"
        )


if __name__ == "__main__":
    main()
