"""The real services tests start and stop: a redis-server, Celery workers (``celery -A worker
worker`` or ``studio-code worker``) and the API (``studio-code serve``).

Each is a process of the test's own, on loopback, with its output in a log file; it is
stopped by pid (SIGTERM, then SIGKILL of what is left of its process tree and group), never
by name. Every class is also a context manager that stops it at the end.

Also what the tests and bench/ share around them: ``wait_for`` (the one polling helper), the
environment the API and the workers get (``studio_env``, ``env_for``, ``QueueEnv``), a TCP
``Relay`` a test can cut, a ``SecondEngine`` (dockerd), a ``PgCluster`` and run stores made
by older releases. The Code nodes and header names tests send are in tests/snippets.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from glob import glob
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


class SentinelSet(StopsOnExit):
    """A Redis Sentinel deployment of the test's own, all on free loopback ports with its
    own folders in ``workdir``: a primary, a replica and three sentinels (quorum 2, a
    primary unanswered for 1 s is down). Every node announces 127.0.0.1, so what the
    sentinels hand out is reachable here. ``url`` is the STUDIO_REDIS_URL of it (with
    ``master`` as STUDIO_REDIS_SENTINEL_MASTER)."""

    master = "studio"

    def __init__(self, workdir: Path, *, password: str = "", sentinel_password: str = ""):
        self.workdir = workdir
        self.password = password
        self.sentinel_password = sentinel_password
        self.ports = {"a": free_port(), "b": free_port()}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return self.sentinel_url()

    def sentinel_url(self, count: int = 3, db: int = 0) -> str:
        """The STUDIO_REDIS_URL of the first ``count`` sentinels, the master's password in
        the first part only (as an operator writes it), database ``db``."""
        auth = f":{self.password}@" if self.password else ""
        first, *rest = self.sentinel_ports[:count]
        parts = [f"sentinel://{auth}127.0.0.1:{first}/{db}"]
        return ";".join(parts + [f"sentinel://127.0.0.1:{p}" for p in rest])

    def primary_url(self, db: int = 0) -> str:
        """A plain redis:// URL of the primary (node ``a`` until a failover)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.ports['a']}/{db}"

    def _auth(self) -> list[str]:
        if not self.password:
            return []
        return ["--requirepass", self.password, "--masterauth", self.password]

    def start_node(self, name: str, replica_of: int | None = None) -> None:
        folder = self.workdir / f"redis-{name}"
        folder.mkdir(exist_ok=True)
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(self.ports[name]),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "no",
            "--replica-announce-ip",
            "127.0.0.1",
            "--logfile",
            str(folder / "redis.log"),
            *self._auth(),
        ]
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.procs[name] = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_redis(self.ports[name], self.password)

    def start(self) -> SentinelSet:
        self.start_node("a")
        self.start_node("b", replica_of=self.ports["a"])
        for i, port in enumerate(self.sentinel_ports):
            folder = self.workdir / f"sentinel-{i}"
            folder.mkdir(exist_ok=True)
            conf = [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {folder}",
                f"logfile {folder / 'sentinel.log'}",
                "sentinel announce-ip 127.0.0.1",
                "sentinel resolve-hostnames no",
                f"sentinel monitor {self.master} 127.0.0.1 {self.ports['a']} 2",
                f"sentinel down-after-milliseconds {self.master} 1000",
                f"sentinel failover-timeout {self.master} 10000",
                f"sentinel parallel-syncs {self.master} 1",
            ]
            if self.password:
                conf.append(f"sentinel auth-pass {self.master} {self.password}")
            if self.sentinel_password:
                conf.append(f"requirepass {self.sentinel_password}")
                conf.append(f"sentinel sentinel-pass {self.sentinel_password}")
            (folder / "sentinel.conf").write_text("\n".join(conf) + "\n")
            self.procs[f"s{i}"] = subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    str(folder / "sentinel.conf"),
                    "--sentinel",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            _wait_redis(port, self.sentinel_password)
        self.wait_master(self.ports["a"])
        self.wait_synced("b")
        return self

    def wait_synced(self, name: str, timeout_s: float = 30.0) -> None:
        """Until replica ``name`` has its primary's data and follows it."""
        import redis

        c = redis.Redis(port=self.ports[name], password=self.password or None, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                info = c.info("replication")
                if info.get("master_link_status") == "up" and not info.get(
                    "master_sync_in_progress"
                ):
                    return
                time.sleep(0.1)
        finally:
            c.close()
        raise RuntimeError(f"the replica {name} did not sync with its primary")

    def master_port(self) -> int | None:
        """The primary's port as the first sentinel that answers sees it."""
        import redis

        for port in self.sentinel_ports:
            try:
                c = redis.Redis(
                    port=port, password=self.sentinel_password or None, socket_timeout=1
                )
                host, p = c.sentinel_get_master_addr_by_name(self.master)
                c.close()
                return int(p)
            except Exception:  # noqa: BLE001 - try the next sentinel
                continue
        return None

    def wait_master(self, port: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.master_port() == port:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the sentinels did not name 127.0.0.1:{port} the primary")

    def kill_primary(self) -> str:
        """SIGKILL the current primary (a crash); returns its name."""
        port = self.master_port()
        name = next(n for n, p in self.ports.items() if p == port)
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)
        return name

    def other(self, name: str) -> str:
        return "b" if name == "a" else "a"

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()


def _wait_redis(port: int, password: str = "", timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    hello = (f"AUTH {password}\r\nPING\r\n" if password else "PING\r\n").encode()
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(hello)
                if b"+PONG" in s.recv(64):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis on port {port} did not start")


def start_sentinels(workdir: Path, **options: str) -> SentinelSet:
    """A started SentinelSet; a missing redis-server skips (fails under CI)."""
    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    return SentinelSet(workdir, **options).start()


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


# --- Docker ---------------------------------------------------------------------------------


def sandbox_events(docker_client: Any, job_id: str, since: int, until: int) -> list[dict]:
    """Every Docker event between ``since`` and ``until`` (Unix seconds) of a container
    made for ``job_id`` (its label) or renamed to it (a pre-started one taken by the job)."""
    events: list[dict] = []
    for filters in (
        {"type": "container", "label": [f"studio.job_id={job_id}"]},
        {"type": "container", "container": [f"studio-code-{job_id}"]},
    ):
        events += docker_client.api.events(since=since, until=until, decode=True, filters=filters)
    return events


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


# --- the Docker socket guard ------------------------------------------------------------------

#: the engine's socket as this process found it, before any test pointed DOCKER_HOST at a guard
REAL_DOCKER_HOST = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


class SockGuardProcess(Service):
    """``studio-code sockguard`` on a unix socket in ``workdir``, passing on to the real
    engine; ``host`` is the DOCKER_HOST that goes through it. With ``trace`` every call it
    passes is logged (``--log-requests``) beside its refusals: what a test asked of the
    engine."""

    stop_timeout = 10.0

    def __init__(
        self, workdir: Path, env: dict[str, str] | None = None, *, trace: bool = True
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.path = workdir / "guard.sock"
        self.host = f"unix://{self.path}"
        upstream = REAL_DOCKER_HOST.removeprefix("unix://")
        argv = [str(BIN / "studio-code"), "sockguard", "--listen", str(self.path)]
        argv += ["--upstream", upstream] + (["--log-requests"] if trace else [])
        base = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
        super().__init__(argv, {**base, **(env or {})}, workdir / "guard.log")
        deadline = time.monotonic() + 30
        while not self.path.exists():
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the socket guard did not start: {self.tail()}")
            time.sleep(0.05)

    def refusals(self) -> list[str]:
        return [line for line in self.output().splitlines() if "sockguard refused" in line]


# --- waiting ---------------------------------------------------------------------------------


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """The first true value ``predicate`` returns, asked every ``interval_s``; after
    ``timeout_s`` (a hang guard, never a timing assertion) the test fails naming ``what`` it
    waited for and what it saw last (``describe()``, else the last value)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    seen = describe() if describe is not None else last
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {seen!r})")


# --- the environment of the API and the workers -------------------------------------------


def studio_env(redis_url: str, database_url: str, image: str, **extra: Any) -> dict[str, str]:
    """The STUDIO_* environment an operator would give the API and the workers."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STUDIO_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env.update(
        {
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_CODE_RUNTIME": "docker",
            "STUDIO_CODE_IMAGE": image,
            "STUDIO_CODE_LANGUAGES": "python",
            "STUDIO_REDIS_URL": redis_url,
            "STUDIO_DATABASE_URL": database_url,
            "STUDIO_CODE_MAX_SECONDS": "15",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def containers_of(docker_client: Any, job_id: str) -> list[Any]:
    # by name: a pre-started sandbox gets its job's name when taken (its labels are fixed)
    # ignore_removed: a sandbox removed between the list and its inspect is gone, not an error
    return docker_client.containers.list(
        all=True, filters={"name": f"^/studio-code-{job_id}$"}, ignore_removed=True
    )


FAST = {
    "STUDIO_QUEUE_HEARTBEAT_INTERVAL_S": "0.5",
    "STUDIO_QUEUE_REAP_INTERVAL_S": "1",
    "STUDIO_CODE_RUNTIME": "subprocess",
    "STUDIO_CODE_LANGUAGES": "python",
}


def env_for(redis_url: str, database_url: str, **extra: Any) -> dict[str, str]:
    return studio_env(redis_url, database_url, "studio-code:1", **{**FAST, **extra})


def client_for(make_settings: Any, redis_url: str, database_url: str, **overrides: Any) -> Any:
    from api_client import CodeClient

    base = {
        "code_runtime": "subprocess",
        "code_languages": "python",
        "queue_heartbeat_interval_s": 0.5,
    }
    settings = make_settings(
        redis_url=redis_url, database_url=database_url, **{**base, **overrides}
    )
    return CodeClient(settings)


class QueueEnv:
    """A redis-server, a run store, a client and the workers of one test."""

    def __init__(
        self,
        redis_url: str,
        database_url: str,
        tmp: Path,
        make_settings: Callable[..., Any],
        **overrides: Any,
    ) -> None:
        from api_client import CodeClient

        self.tmp = tmp
        self.redis_url = redis_url
        self.database_url = database_url
        self.overrides = {"code_concurrency": 2, **overrides}
        self.settings = make_settings(
            redis_url=redis_url, database_url=database_url, **self.overrides
        )
        self.client = CodeClient(self.settings)
        self.workers: list[CeleryWorker] = []

    def env(self, **extra: Any) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STUDIO_")}
        env.update(
            {
                "STUDIO_ENABLE_CODE_NODES": "1",
                "STUDIO_REDIS_URL": self.redis_url,
                "STUDIO_DATABASE_URL": self.database_url,
                "STUDIO_DATA_DIR": str(self.tmp),
                "STUDIO_CODE_IMAGE": self.settings.code_image,
            }
        )
        for key, value in {**self.overrides, **extra}.items():
            env[f"STUDIO_{key.upper()}"] = str(value)
        return env

    def start_worker(
        self,
        name: str,
        concurrency: int = 2,
        *,
        cli: bool = False,
        ready_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
        **extra_env: Any,
    ) -> CeleryWorker:
        worker = CeleryWorker(
            self.env(**extra_env),
            self.tmp / f"{name}.log",
            name=name,
            concurrency=concurrency,
            extra_args=extra_args,
            cli=cli,
            capture_stdout=cli,
            stop_timeout=25,
        )
        self.workers.append(worker)
        worker.wait_ready(ready_timeout_s, app=self.client.app)
        return worker

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.client.close()

    # helpers

    def done_count(self, job_id: str) -> int:
        from worker.protocol import done_key

        return int(self.client.redis.llen(done_key(job_id)))

    def wait_all(self, job_ids: list[str], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            recs = self.client.store.get_many(job_ids)
            if all(r.finished for r in recs.values()) and len(recs) == len(job_ids):
                return recs
            if time.monotonic() > deadline:
                open_ = [j for j in job_ids if j not in recs or not recs[j].finished]
                tails = "\n".join(w.tail(30) for w in self.workers)
                raise AssertionError(f"{len(open_)} jobs not finished: {open_[:5]}\n{tails}")
            time.sleep(0.1)


# --- the HTTP API ------------------------------------------------------------------------


def fuzz_for_server_errors(base: str, headers: dict[str, str]) -> None:
    """schemathesis on every operation of the served OpenAPI: no answer is a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=headers)
    ran: dict[str, int] = {}

    def fuzz(operation: Any) -> None:
        strategy = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
            GenerationMode.NEGATIVE
        )

        @given(case=strategy)
        @settings(
            max_examples=25,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            response = case.call(base_url=base, headers=headers, timeout=60)
            ran[operation.label] = ran.get(operation.label, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])

        check()

    for result in schema.get_all_operations():
        fuzz(result.ok())
    assert len(ran) == 9, ran  # with GET /api/runs and /logs (api_client.http.routes.runs)
    # GET /api/meta/runtime takes no input: one example is all there is
    assert all(n >= 5 for op, n in ran.items() if op != "GET /api/meta/runtime"), ran


# --- networks and engines of the test's own ------------------------------------------------


class Relay:
    """A loopback TCP relay to 127.0.0.1:<port>; ``cut()`` closes it and every connection
    through it: the store behind it is unreachable until ``restore()``."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = free_port()
        self._socks: list[socket.socket] = []
        self._server: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(16)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                a, _ = server.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        if self._server is not None:
            try:  # wakes the accept() blocked in the relay's thread (close alone does not)
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
            self._server = None
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._socks.clear()


class SecondEngine:
    """A dockerd of this test's own, stopped by its pid (and started again with the same
    dirs: a restart). Its containerd is its own too: dockerd starts one under its
    exec-root (there is no system containerd socket for it to use, see ``own_containerd``)."""

    def __init__(self) -> None:
        # a short path: a unix socket path has at most 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="sc-engine2-", dir="/tmp"))
        self.sock = self.root / "docker.sock"
        self.host = f"unix://{self.sock}"
        self.pidfile = self.root / "docker.pid"
        (self.root / "daemon.json").write_text("{}")  # not the machine's /etc/docker one
        self.log = self.root / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        needs("docker", "a second dockerd")
        dockerd = shutil.which("dockerd")
        require(dockerd is not None, "dockerd is not installed")
        assert dockerd is not None
        with open(self.log, "ab") as log:  # a restart appends
            self.proc = subprocess.Popen(
                [
                    dockerd,
                    "--config-file",
                    str(self.root / "daemon.json"),
                    "--data-root",
                    str(self.root / "data"),
                    "--exec-root",
                    str(self.root / "exec"),
                    "--host",
                    self.host,
                    "--pidfile",
                    str(self.pidfile),
                    "--bridge=none",
                    "--iptables=false",
                    "--ip6tables=false",
                    "--containerd-namespace",
                    "studio-engine2",
                    "--containerd-plugins-namespace",
                    "studio-engine2-plugins",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.docker("version", check=False).returncode == 0:
                require(self.own_containerd(), "the second dockerd uses another containerd")
                return
            time.sleep(0.3)
        require(False, f"the second dockerd did not start:\n{self.log.read_text()[-3000:]}")

    def docker(self, *args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["docker", "-H", self.host, *args],
            capture_output=True,
            text=True,
            timeout=kw.pop("timeout", 120),
            **kw,
        )
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def load(self, *images: str) -> None:
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        load = subprocess.run(
            ["docker", "-H", self.host, "load", "-q"],
            stdin=save.stdout,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert save.stdout is not None
        save.stdout.close()
        assert save.wait(60) == 0 and load.returncode == 0, load.stderr

    def own_containerd(self) -> bool:
        """Its containerd is the one it started under its own exec-root."""
        return (self.root / "exec" / "containerd" / "containerd.sock").exists()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the daemon's pid: it stops its containers and its containerd."""
        if self.running():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def remove(self) -> None:
        mounted = [
            line.split()[1]
            for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(self.root))
        ]
        if mounted:  # never rm -rf through a live mount
            pytest.fail(f"the second engine left mounts: {mounted}")
        shutil.rmtree(self.root, ignore_errors=True)


# --- PostgreSQL ----------------------------------------------------------------------------

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

    def stop(self) -> None:
        """A fast shutdown: connected clients are cut off, as in an outage."""
        self._run(pg_bin("pg_ctl") or "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def cleanup(self) -> None:
        if self.running():
            try:
                self.stop()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


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


# --- a worker's metrics server ------------------------------------------------------------


def health(port: int) -> tuple[int, dict[str, Any]]:
    """A worker's ``/healthz`` on ``port``: its status code and JSON body."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
