"""Pre-started subprocess runners: the interpreter is already running when a job arrives,
and is still used for ONE job only (the subprocess runtime's side of STUDIO_CODE_PREWARM).

Each process keeps STUDIO_CODE_PREWARM runners per offered language, started exactly as a
cold run starts (``SubprocessRuntime._start``: its uid lease under a root server, its
cgroup, its workdir, its namespaces under a non-root one, the memory, file and process
rlimits), blocked reading stdin: both runners read ALL of stdin (the code, then the state)
before they run anything, and nothing of a job is in a runner until it is handed out.

* **Hand-out** (``take``): a job whose runner key (language, argv, memory, processes)
  equals the pooled one takes the oldest. A runner that exited, or wrote anything, while
  waiting is thrown away, never handed out. At hand-out RLIMIT_CPU is set on the runner
  (prlimit(2)) to the CPU it used while waiting plus the job's own limit: it waited with
  the job's limit as its soft limit and an open hard one (a non-root server may lower a
  hard limit, never raise it). The node's time limit counts from the hand-out.
* **Replace**: a replacement starts off the job's path (``on_path``): when the outermost
  path of the thread that took the runner ends (a worker: after its done notice; a direct
  ``run``: after its result), never beside the job. Idle runners older than
  STUDIO_CODE_PREWARM_MAX_IDLE_S, or dead, are ended and replaced.
* **Close**: idle runners are killed and their uid leases, cgroups and workdirs released.
  A runner whose server died reads EOF on stdin and exits; its lease is then dirty and
  scrubbed by its next holder, as after a run cut short.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import select
import subprocess
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from executor.errors import RuntimeUnavailable
from executor.languages.base import Language
from executor.models import Limits
from executor.runtimes.base import (
    CancelCheck,
    CancelledBeforeStart,
    IdlePoolStats,
    PoolObserver,
)
from executor.runtimes.subprocess import namespaces
from executor.runtimes.subprocess.cgroups import RunCgroup
from executor.runtimes.subprocess.uids import UidLease

log = logging.getLogger("studio_code")

TICK_S = 2.0  # idle-bound and liveness checks
#: how long a job waits for a runner already starting before it starts a cold one
WAIT_FOR_STARTING_S = 3.0
#: how often a job waiting for a starting runner asks whether it was cancelled
CANCEL_POLL_S = 0.1
BACKOFF_S = (1.0, 2.0, 5.0, 15.0, 30.0)
#: how long a hand-out waits for a runner in namespaces to be forked (it is, within ms)
RUNNER_PID_WAIT_S = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Runner:
    """One started runner: a cold run's or a pre-started one's, with what it holds."""

    child: subprocess.Popen[bytes]
    lease: UidLease | None
    group: RunCgroup | None
    workdir: str
    key: tuple[Any, ...]
    in_namespaces: bool
    #: started ahead of its job (its RLIMIT_CPU is set at hand-out)
    prestarted: bool = False
    #: monotonic, when it started (its idle age)
    created: float = field(default_factory=time.monotonic)

    def runner_pid(self) -> int | None:
        """The interpreter's pid (in namespaces, the relay's grandchild)."""
        return namespaces.runner_pid(self.child.pid) if self.in_namespaces else self.child.pid

    def fresh(self) -> bool:
        """Still running and silent: a runner writes nothing before its job, and one that
        died closes its pipes, so anything readable means: do not use."""
        if self.child.poll() is not None:
            return False
        pipes = [p for p in (self.child.stdout, self.child.stderr) if p is not None]
        try:
            ready, _, _ = select.select(pipes, [], [], 0)
        except (OSError, ValueError):
            return False
        return not ready

    def hand_out(self, cpu_s: int) -> bool:
        """Set the runner's RLIMIT_CPU to the CPU it used while waiting + ``cpu_s`` (the
        same limit as a cold run's, counted from now); False when it cannot be (gone)."""
        pid = self.runner_pid()
        deadline = time.monotonic() + RUNNER_PID_WAIT_S
        while pid is None and time.monotonic() < deadline and self.child.poll() is None:
            time.sleep(0.001)
            pid = self.runner_pid()
        if pid is None:
            return False
        ids = (self.lease.uid, self.lease.gid) if self.lease is not None else None
        try:
            soft = cpu_s + -(-cpu_ticks(pid) // CLK_TCK)  # ceil(used s) + the job's limit
            set_cpu_limit(pid, (soft, soft + 1), ids)
        except (OSError, ValueError) as e:
            log.warning("pre-started runner %d could not be handed out (%s); not used", pid, e)
            return False
        return True


#: setresuid, setresgid by machine: the raw syscalls change the calling thread's ids only
_SETRES = {"x86_64": (117, 119), "aarch64": (147, 149)}
try:
    _syscall: Any = ctypes.CDLL(None, use_errno=True).syscall
except (OSError, AttributeError):
    _syscall = None


def set_cpu_limit(pid: int, limit: tuple[int, int], ids: tuple[int, int] | None) -> None:
    """prlimit(2) RLIMIT_CPU of ``pid``. A root server without CAP_SYS_RESOURCE (a
    container's root) may set the limits of its own uid's processes only, so for a run of
    uid and gid ``ids`` a throwaway thread takes them as its real and effective ids
    (keeping 0 as its saved ones) for the one call: the server's other threads keep root."""
    try:
        resource.prlimit(pid, resource.RLIMIT_CPU, limit)
        return
    except PermissionError:
        nrs = _SETRES.get(os.uname().machine)
        if ids is None or os.getuid() != 0 or nrs is None or _syscall is None:
            raise
    failed: list[BaseException] = []

    def as_run() -> None:
        setresuid, setresgid = nrs
        uid, gid = ids
        try:
            if _syscall(setresgid, gid, gid, 0) != 0 or _syscall(setresuid, uid, uid, 0) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"taking the run's uid in a thread: {os.strerror(e)}")
            resource.prlimit(pid, resource.RLIMIT_CPU, limit)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            failed.append(e)
        finally:  # the thread ends now anyway; back to root for its last steps
            _syscall(setresuid, 0, 0, 0)
            _syscall(setresgid, 0, 0, 0)

    t = threading.Thread(target=as_run, name="studio-prlimit")
    t.start()
    t.join()
    if failed:
        raise failed[0]


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of ``pid`` so far, in clock ticks (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


class RunnerPool(IdlePoolStats):
    """The pre-started runners of one process (one per ``SubprocessRuntime``)."""

    def __init__(
        self,
        start: Callable[[Language, Limits], Runner],
        discard: Callable[[Runner], None],
        key: Callable[[Language, Limits], tuple[Any, ...]],
        languages: list[Language],
        limits: Limits,
        size: int,
        max_idle_s: float,
        observe: PoolObserver | None = None,
    ) -> None:
        self._start, self._discard, self._key = start, discard, key
        self.languages = {lang.name: lang for lang in languages}
        self.limits = limits
        self.size = size
        self.max_idle_s = max_idle_s
        self.observe = observe
        self._idle: dict[str, deque[Runner]] = {name: deque() for name in self.languages}
        self._starting: Counter[str] = Counter()
        #: runners handed out to jobs whose path has not ended: not replaced yet
        self._owed: Counter[str] = Counter()
        self._retire: deque[Runner] = deque()
        #: replacement starts reserved when a path ended (counted in _starting already)
        self._reserved: deque[str] = deque()
        self._waiting: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._retry_at: dict[str, float] = {}
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self._path = threading.local()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # --- life ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="studio-runners", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop refilling; kill every idle runner and release what it holds."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._cond:
            for q in self._idle.values():
                self._retire.extend(q)
                q.clear()
        self._drain_retired()
        self._notify()  # the final counts (as the docker pool's close)

    @contextmanager
    def on_path(self) -> Iterator[None]:
        """While a job is on its caller's path, the runner it took is not replaced: the
        replacement starts when this thread's outermost path ends."""
        outer = getattr(self._path, "held", None) is not None
        if not outer:
            self._path.held = []
        try:
            yield
        finally:
            if not outer:
                with self._cond:
                    for name in self._path.held:
                        self._owed[name] -= 1
                        if not self._stop:  # a job coming next waits for it, not cold
                            self._starting[name] += 1
                            self._reserved.append(name)
                    self._path.held = None
                    self._cond.notify_all()

    # --- hand-out -------------------------------------------------------------------------

    def take(
        self,
        language: Language,
        limits: Limits,
        cpu_s: int,
        should_cancel: CancelCheck | None = None,
    ) -> Runner | None:
        """A fresh runner for a job under ``limits``, its RLIMIT_CPU set, or None (a miss:
        start a cold one). With none idle but one starting, it waits for that one (at most
        WAIT_FOR_STARTING_S), asking ``should_cancel`` every CANCEL_POLL_S: a cancelled job
        raises CancelledBeforeStart. Call within ``on_path``."""
        name = language.name
        key = self._key(language, limits)
        deadline = time.monotonic() + WAIT_FOR_STARTING_S
        with self._cond:
            try:
                q = self._idle.get(name)
                if q is None:
                    self.misses[name] += 1
                    return None
                while not q and self._starting[name] > self._waiting[name] and not self._stop:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if should_cancel is not None:
                        self._cond.release()  # it may read Redis or the store
                        try:
                            cancelled = should_cancel()
                        finally:
                            self._cond.acquire()
                        if cancelled:
                            raise CancelledBeforeStart()
                    self._waiting[name] += 1
                    try:
                        self._cond.wait(min(left, CANCEL_POLL_S))
                    finally:
                        self._waiting[name] -= 1
                while q and not self._stop:
                    r = q[0]
                    if r.key != key:  # other limits: this job goes cold
                        break
                    q.popleft()
                    if not r.fresh() or not r.hand_out(cpu_s):
                        log.warning("a pre-started %s runner died while waiting; replaced", name)
                        self._retire.append(r)
                        continue
                    self.hits[name] += 1
                    self._owed[name] += 1
                    held = getattr(self._path, "held", None)
                    assert held is not None, "take() outside on_path()"
                    held.append(name)
                    return r
                self.misses[name] += 1
                return None
            finally:
                self._cond.notify_all()

    # --- the pool's thread ------------------------------------------------------------------

    def _wanted(self) -> str | None:
        now = time.monotonic()
        for name, q in self._idle.items():
            have = len(q) + self._starting[name] + self._owed[name]
            if have < self.size and self._retry_at.get(name, 0.0) <= now:
                return name
        return None

    def _loop(self) -> None:
        checked = time.monotonic()
        while True:
            with self._cond:
                while (
                    not self._stop
                    and not self._retire
                    and not self._reserved
                    and self._wanted() is None
                    and time.monotonic() - checked < TICK_S
                ):
                    self._cond.wait(TICK_S)
                if self._stop:
                    return
                if self._reserved:
                    name: str | None = self._reserved.popleft()
                elif (name := self._wanted()) is not None:
                    self._starting[name] += 1
            self._drain_retired()
            if time.monotonic() - checked >= TICK_S:
                self._expire()
                checked = time.monotonic()
                self._notify()
            if name is not None:
                self._fill(name)

    def _fill(self, name: str) -> None:
        runner = None
        try:
            runner = self._start(self.languages[name], self.limits)
        except RuntimeUnavailable as e:
            n = self._failures[name]
            self._failures[name] += 1
            self._retry_at[name] = time.monotonic() + BACKOFF_S[min(n, len(BACKOFF_S) - 1)]
            log.warning("could not pre-start a %s runner: %s", name, e.message)
        finally:
            with self._cond:
                self._starting[name] -= 1
                if runner is not None:
                    self._failures[name] = 0
                    (self._retire if self._stop else self._idle[name]).append(runner)
                self._cond.notify_all()
        self._notify()

    def _expire(self) -> None:
        """Idle runners past the idle bound, or dead, go (and are replaced)."""
        now = time.monotonic()
        with self._cond:
            for q in self._idle.values():
                keep = [r for r in q if now - r.created < self.max_idle_s and r.fresh()]
                self._retire.extend(r for r in q if r not in keep)
                q.clear()
                q.extend(keep)
            self._cond.notify_all()

    def _drain_retired(self) -> None:
        while True:
            with self._cond:
                if not self._retire:
                    return
                r = self._retire.popleft()
            try:
                self._discard(r)
            except Exception as e:  # noqa: BLE001 - one runner's end never stops the pool
                log.warning("could not end an unused runner (pid %d): %s", r.child.pid, e)
