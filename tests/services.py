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
        auth = f":{self.password}@" if self.password else ""
        first, *rest = self.sentinel_ports
        return ";".join(
            [f"sentinel://{auth}127.0.0.1:{first}/0"] + [f"sentinel://127.0.0.1:{p}" for p in rest]
        )

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
