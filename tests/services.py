"""The real services tests start and stop: a redis-server, Celery workers (``celery -A worker
worker`` or ``studio-code worker``) and the API (``studio-code serve``).

Each is a process of the test's own, on loopback, with its output in a log file; it is
stopped by pid (SIGTERM, then SIGKILL of what is left of its process tree and group), never
by name. Every class is also a context manager that stops it at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"
BIN = Path(sys.executable).parent
HOST = socket.gethostname()


#: the markers of the test being run, set by tests/conftest.py; None outside a pytest run
#: (bench/): what starts a service checks it with ``needs``
CURRENT_MARKS: set[str] | None = None


def needs(marker: str, what: str) -> None:
    """Refuse to start ``what`` in a test not marked ``marker``: ``-m "not <marker>"`` (the
    fast tier, ``make test-fast``) must leave out every test that needs the service."""
    if CURRENT_MARKS is not None and marker not in CURRENT_MARKS:
        raise AssertionError(
            f"this test starts {what} but is not marked {marker!r}: add "
            f"@pytest.mark.{marker} (or pytestmark) so `-m 'not {marker}'` leaves it out"
        )


def require(ok: bool, what: str) -> None:
    """Skip (laptop) or fail (CI=true) when a service the test needs is missing."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing service fails the suite)")
    pytest.skip(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- processes by pid ----------------------------------------------------------------------


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, read from /proc."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += children(p)
    return seen


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL each of ``pids`` still alive (pids this test or bench started)."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def in_processes(
    target: Callable[..., None], args: Sequence[tuple[Any, ...]], timeout_s: float = 240
) -> list[Any]:
    """``target(*a, barrier, out)`` for each ``a`` of ``args``, each in a spawned process of
    its own; ``barrier`` lets them all go at once and each puts one report on ``out``.
    Returns the reports, as they came, once every process ended with status 0 (one still
    running a minute after its report is killed)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(args))
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args]
    for p in procs:
        p.start()
    try:
        reports = [out.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        out.join_thread()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return reports


class StopsOnExit:
    """``with`` it: ``stop()`` at the end, whatever happened."""

    def stop(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class Service(StopsOnExit):
    """A process this test started (its own session, output to a log file, or stdout to a
    pipe with ``capture_stdout``); stopped by pid."""

    #: how long ``stop()`` waits for a clean exit after SIGTERM before SIGKILL
    stop_timeout = 60.0

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        *,
        capture_stdout: bool = False,
        stop_timeout: float | None = None,
    ) -> None:
        self.log = log
        if stop_timeout is not None:
            self.stop_timeout = stop_timeout
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE if capture_stdout else out,
                stderr=out,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def tree(self) -> list[int]:
        return process_tree(self.pid)

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_hard(self) -> list[int]:
        """SIGKILL the main process and every child, by pid (from the process tree)."""
        pids = self.tree()
        kill_pids(pids)
        self.proc.wait(timeout=10)
        return pids

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (a worker's warm shutdown), then SIGKILL of what is left: the processes
        of its tree as it was before the SIGTERM, and its own process group. Returns its
        exit code (None when it could not be reaped)."""
        if not self.alive():
            return self.proc.returncode
        pids = self.tree()
        self.signal(signal.SIGTERM)
        code = self.wait(self.stop_timeout if timeout is None else timeout)
        kill_pids(pids)
        if code is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = self.wait(10)
        return code


def tree_usage(pid: int) -> tuple[int, int, int]:
    """Open fds, RSS (bytes) and threads of ``pid``'s process tree, from /proc."""
    fds = rss = threads = 0
    for p in process_tree(pid):
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
        except OSError:
            pass
    return fds, rss, threads


# --- Redis ----------------------------------------------------------------------------------


class RedisServer(StopsOnExit):
    """A redis-server of the test's own on a free loopback port; it can be stopped and
    started again, with AOF as deploy/compose.yaml runs it (appendfsync everysec: what it
    acknowledged more than a second ago survives even a SIGKILL)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        needs("redis", "a redis-server")
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
                "--daemonize",
                "no",
                "--logfile",
                str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (Redis flushes and exits) or, with kill, SIGKILL (a crash)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


def start_redis(workdir: Path) -> RedisServer:
    """A started RedisServer in ``workdir``; a missing redis-server skips (fails under CI)."""
    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    server = RedisServer(workdir)
    server.start()
    return server


# --- Celery workers -------------------------------------------------------------------------


class CeleryWorker(Service):
    """``celery -A <app> worker --pool prefork -c N -Q <queues> -n <name>@%h`` (``app``: the
    studio's ``worker`` unless a bench gives its own), or, with ``cli``, ``studio-code
    worker`` with the same options; ``extra_args`` go last.
    Not waited for: see ``wait_ready``."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *,
        name: str | None = None,
        concurrency: int = 2,
        queues: str = "code.test,code.run",
        pool: str = "prefork",
        extra_args: Sequence[str] = (),
        cli: bool = False,
        capture_stdout: bool = False,
        stop_timeout: float | None = None,
        app: str = "worker",
        loglevel: str = "INFO",
    ) -> None:
        needs("redis", "a Celery worker")
        self.name = name or f"w{uuid.uuid4().hex[:6]}"
        #: the node name Celery gives it (``%h`` is this host's name)
        self.node = f"{self.name}@{HOST}"
        options = [
            "--pool",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            queues,
            "-n",
            f"{self.name}@%h",
            "--loglevel",
            loglevel,
            *extra_args,
        ]
        if cli:
            argv = [str(BIN / "studio-code"), "worker", *options]
        else:
            argv = [str(BIN / "celery"), "-A", app, "worker", *options]
        super().__init__(argv, env, log, capture_stdout=capture_stdout, stop_timeout=stop_timeout)

    def wait_ready(self, timeout: float = 60.0, *, app: Any = None) -> CeleryWorker:
        """Until it is ready: it answers ``app``'s ping when a Celery app is given, else its
        log says `` ready.``. A worker that exits or stays unready fails the test (stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if app is not None:
                replies = app.control.ping(destination=[self.node], timeout=0.5)
                if any(self.node in r for r in replies or []):
                    return self
            elif " ready." in self.output():
                return self
            if not self.alive():
                break
            if app is None:
                time.sleep(0.2)
        if not self.alive():
            how = "exited"
        else:
            how = "did not answer ping" if app is not None else "did not say it is ready"
        out = self.output()[-4000:]
        self.stop(10)
        pytest.fail(f"the worker {self.name} {how}:\n{out}")


def start_worker(
    env: dict[str, str],
    log: Path,
    *,
    ready_timeout: float = 60.0,
    **options: Any,
) -> CeleryWorker:
    """A CeleryWorker (``options`` as CeleryWorker takes them) whose log says it is ready."""
    return CeleryWorker(env, log, **options).wait_ready(ready_timeout)


# --- the API --------------------------------------------------------------------------------


def wait_http(url: str, timeout: float = 30.0, proc: Service | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and not proc.alive():
            break
        time.sleep(0.1)
    out = proc.output()[-4000:] if proc else ""
    pytest.fail(f"{url} did not answer:\n{out}")


class ApiServer(Service):
    """``studio-code serve`` on a free loopback port, answering ``/healthz/live``."""

    stop_timeout = 20.0

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *,
        ready_timeout: float = 30.0,
        log_level: str | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [str(BIN / "studio-code"), "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if log_level is not None:  # e.g. "warning": no access log line per request (benches)
            argv += ["--log-level", log_level]
        super().__init__(argv, env, log)
        try:
            wait_http(f"{self.base}/healthz/live", ready_timeout, proc=self)
        except BaseException:
            self.stop()
            raise


# --- what a worker leaves while it works ------------------------------------------------------

LABEL_OWNER = "studio.owner"
#: a sandbox that ran and ended: what awaits its removal (a pre-started one waiting for its
#: job is running; one being created for a cold job is "created", not used yet)
ENDED = ("exited", "dead")


def ended_sandboxes(api: Any, owners: set[str]) -> list[dict]:
    """The sandboxes of ``owners`` (host:pid of a worker's pool processes: their
    studio.owner label) that ended and are not removed yet, on the engine of ``api``."""
    out = []
    for status in ENDED:
        for c in api.containers(all=True, filters={"label": LABEL_OWNER, "status": status}):
            if (c.get("Labels") or {}).get(LABEL_OWNER) in owners:
                out.append(c)
    return out


@dataclass
class Backlog:
    """What ``watch_backlog`` saw."""

    records: dict[str, Any]
    samples: int = 0
    ended_max: int = 0
    worst: list[str] = field(default_factory=list)  # the sandboxes of the worst sample
    #: finished jobs -> the worker tree's (fds, RSS bytes, threads) when first reached
    usage: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def summary(self) -> str:
        first, last = min(self.usage), max(self.usage)
        (f0, r0, t0), (f1, r1, t1) = self.usage[first], self.usage[last]
        return (
            f"ended-awaiting-removal max {self.ended_max} over {self.samples} samples; "
            f"job {first} -> job {last}: fds {f0} -> {f1}, "
            f"RSS {r0 / 2**20:.1f} -> {r1 / 2**20:.1f} MiB, threads {t0} -> {t1}"
        )


def watch_backlog(
    api: Any,
    store: Any,
    job_ids: list[str],
    worker: Service,
    owners: set[str],
    *,
    marks: Sequence[int],
    interval_s: float = 0.5,
    timeout_s: float = 480.0,
) -> Backlog:
    """Until every one of ``job_ids`` is finished (in ``store``), sample every
    ``interval_s``: the ended sandboxes of ``owners`` awaiting removal, and the worker's
    fds/RSS/threads when the count of finished jobs first reaches each of ``marks``."""
    seen = Backlog(records={})
    deadline = time.monotonic() + timeout_s
    while True:
        ended = ended_sandboxes(api, owners)
        seen.samples += 1
        if len(ended) > seen.ended_max:
            seen.ended_max = len(ended)
            seen.worst = [f"{c['Names'][0]} {c['Status']}" for c in ended[:8]]
        seen.records = store.get_many(job_ids)
        done = sum(1 for r in seen.records.values() if r.finished)
        for mark in marks:
            if done >= mark and mark not in seen.usage:
                seen.usage[mark] = tree_usage(worker.pid)
        if done == len(job_ids):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(job_ids) - done} of {len(job_ids)} jobs not finished after "
                f"{timeout_s:g} s\n{worker.tail(40)}"
            )
        time.sleep(interval_s)
