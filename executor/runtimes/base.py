"""What every runtime does: start one sandbox for one job, feed it, bound it, end it."""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from executor.languages.base import NO_FACTS, ImageFacts, Language
from executor.models import CodeJob, CodeResult, Limits, RawRun
from executor.settings import NOBODY, Settings

if TYPE_CHECKING:
    from executor.runtimes.docker.posture import EnginePosture

#: polled while a sandbox runs; True means "the job was cancelled: kill it now"
CancelCheck = Callable[[], bool]
#: called with a runtime's pool_stats() (worker metrics)
PoolObserver = Callable[[dict[str, Any]], None]
#: runs one job to its result (an Executor's ``run``): how a runtime proves its sandbox
ProbeRun = Callable[[CodeJob], CodeResult]
POLL_S = 0.05


class CancelledBeforeStart(Exception):
    """Raised by a runtime's ``run`` when ``should_cancel`` said yes before any sandbox was
    made for the job (while it waited for a pre-started one, or before a cold create):
    nothing was started, nothing is left to kill."""

    def __init__(self, message: str = "Cancelled before its sandbox started.") -> None:
        super().__init__(message)


def owner_id() -> str:
    """Who started a sandbox: host and pid, so a restarted worker can reap what it left."""
    return f"{_hostname()}:{os.getpid()}"


def _hostname() -> str:
    """socket.gethostname() without the socket module (a one-shot subprocess run needs no
    other part of it): on Linux both are uname(2)'s nodename."""
    return os.uname().nodename


#: Set by a caller (the worker) around a run: a runtime hands it to its logs buffer, which
#: passes each kept piece on as it comes (live logs). Same cap as the stored logs, since
#: only what the buffer keeps is passed on. It must be quick and never raise.
LOG_TAP: ContextVar[Callable[[bytes], None] | None] = ContextVar("studio_log_tap", default=None)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs. A zombie is dead: a pool process whose worker was
    killed becomes one until init reaps it, which can take a while."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): existence is all we know
    return state not in (b"Z", b"X")


def owner_dead(owner: str, host: str | None = None) -> bool:
    """True when ``owner`` (host:pid, see owner_id) is a process of THIS host that is gone;
    another host's owner is never judged dead from here."""
    owner_host, _, pid = owner.rpartition(":")
    return owner_host == (host or _hostname()) and pid.isdigit() and not pid_alive(int(pid))


class BoundedBuffer:
    """Keeps the first ``limit`` bytes of a stream and counts the rest, so a print flood
    costs the host no memory. ``tap`` (optional) gets each kept piece as it is written."""

    def __init__(self, limit: int, tap: Callable[[bytes], None] | None = None) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.kept = 0
        self.total = 0
        self.tap = tap

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - self.kept
        if room > 0:
            piece = data[:room]
            self.chunks.append(piece)
            self.kept += len(piece)
            if self.tap is not None and piece:
                try:
                    self.tap(piece)
                except Exception:  # noqa: BLE001, S110 - live logs never break a run
                    pass

    @property
    def truncated(self) -> bool:
        return self.total > self.kept

    def getvalue(self) -> bytes:
        return b"".join(self.chunks)


@dataclass(frozen=True)
class MetaSection:
    """What meta (GET /api/meta/runtime, ``executor/meta.py``) shows of one runtime beyond
    what every runtime answers (``Runtime.meta_section``), each at its place in meta. The
    defaults are a runtime that shows none of them (and no runtime at all)."""

    #: added to meta's ``warnings``, after ``Runtime.warnings``
    warnings: tuple[str, ...] = ()
    #: ``sandbox_user.note`` under a server that runs as root: whose uid the sandboxes get
    root_note: str = f"The server runs as root, so sandboxes run as nobody ({NOBODY}:{NOBODY})."
    #: ``seccomp``: the profile the sandboxes get
    seccomp: dict[str, Any] | None = None
    #: ``subprocess_isolation``: what holds runs apart from each other and from the server
    isolation: dict[str, Any] | None = None
    #: ``pool.preimport_memory``: what a pre-started sandbox holds, per offered language
    preimport_memory: dict[str, Any] | None = None
    #: ``engine.sandbox``: what the kernel says from inside one sandbox (asked fresh only)
    sandbox: dict[str, Any] | None = None


class Runtime(ABC):
    """A way to run one job: ``docker`` or ``subprocess``.

    Callers ask a runtime what it can do (``isolated``, ``warnings``, ``prepare``, ``reap``,
    ``health_problem``...) and never branch on its ``name``, which is only a label (trace
    rows, results, metrics): a new runtime touches its own package and ``make_runtime``.
    """

    #: the label of results, trace rows and metrics (STUDIO_CODE_RUNTIME's value)
    name: str
    #: True when code runs in a sandbox (no network, no host files); meta shows it
    isolated: bool = True
    #: what an operator must know about this runtime (meta, start-up log); [] when nothing
    warnings: tuple[str, ...] = ()
    #: added to every result this runtime produces (e.g. "runs on host")
    run_warnings: tuple[str, ...] = ()
    #: an audit event written on the first call after each start (None: none)
    audit_event: str | None = None
    #: the service it needs, checked by health probes under this key (None: none)
    service: str | None = None
    #: True when its pre-started sandboxes (STUDIO_CODE_PREWARM > 0) are measured for what
    #: their pre-imports hold (a worker's heartbeat announces the figures: worker/preimport.py)
    preimport_measured: bool = False
    #: True when a run the infrastructure killed (``InfrastructureLost``) can run again
    #: elsewhere without harm (no network, no host files, nothing kept): the worker hands
    #: it back. False: it ends RUNTIME_UNAVAILABLE naming the cause.
    rerun_safe: bool = False

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def prepare(  # noqa: B027 - optional hook
        self, languages: list[Language], limits: Limits, observe: PoolObserver | None = None
    ) -> None:
        """Get ready to run ``languages`` under ``limits`` (the settings' own) at once:
        connect, and fill a pool of pre-started sandboxes where the runtime keeps one;
        ``observe`` is then called with ``pool_stats()`` when they change and every few
        seconds (metrics). Never raises: the first job reports a problem as its result."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what ``prepare`` took (idle pre-started sandboxes, threads); waits for
        sandboxes being removed in the background. Safe to call twice."""

    def reap(self) -> list[str]:
        """Remove this runtime's leftovers that no live process owns (its owner on this host
        is gone) or that are past their deadline; returns what was removed (job ids, or
        ``pool:<name>`` for a never-used pre-started sandbox)."""
        return []

    def health_problem(self) -> str | None:
        """Why the runtime's service is unreachable now (a cheap check), or None."""
        return None

    def image(self, language: Language) -> str | None:
        """The image ``language`` runs from in this runtime, or None (no images)."""
        return None

    @classmethod
    def image_facts(cls, settings: Settings, language: Language) -> ImageFacts:
        """What ``language``'s image has (its modules, its packages), as this runtime reads
        it under ``settings``, each read on its first ask; ``NO_FACTS`` for a runtime
        without images. The languages get it as data (``Language.check``, ``packages``).
        A class method: a caller without a runtime of its own (``studio-code validate``)
        asks the class, and makes no runtime."""
        return NO_FACTS

    def engine_posture(self, *, fresh: bool = False) -> EnginePosture | None:
        """The engine under this runtime's sandboxes and its known escapes (cached; ``fresh``
        asks again), or None when the runtime has no engine or it does not answer."""
        return None

    def meta_section(
        self, posture: EnginePosture | None, *, fresh: bool, probe: ProbeRun
    ) -> MetaSection:
        """What meta shows of this runtime (``MetaSection``). ``posture``: its
        ``engine_posture(fresh=fresh)``, already asked; ``fresh`` (``studio-code meta``):
        it may prove its sandbox by running one job through ``probe``."""
        return MetaSection()

    def pool_stats(self) -> dict[str, Any] | None:
        """Pre-started sandboxes of this process (size, hits, misses, idle age per
        language), or None when this runtime keeps no pool."""
        return None

    def on_path(self) -> AbstractContextManager[None]:
        """A job is on its caller's path for the duration of the block (a worker: from its
        claim to its done notice): the runtime defers its own background work (starting
        replacements, removing used sandboxes) until the block ends, so that work never
        competes with the job for this process or the machine's CPUs."""
        return nullcontext()

    @abstractmethod
    def run(
        self,
        job: CodeJob,
        language: Language,
        limits: Limits,
        *,
        should_cancel: CancelCheck | None = None,
    ) -> RawRun:
        """Run ``job`` in a new sandbox and always clean it up. Raises RuntimeUnavailable
        when the sandbox cannot start; what the code did is in the RawRun."""

    @abstractmethod
    def kill(self, job_id: str) -> bool:
        """Kill the sandbox of ``job_id`` if this process (or, for docker, any) can see it.
        Already gone counts as success; returns True when something was killed."""

    @abstractmethod
    def unavailable_reason(self, language: Language) -> str | None:
        """Why this runtime cannot run ``language`` at all (a cheap check), or None."""


class IdlePoolStats:
    """What a pool of things started ahead (Docker sandboxes: ``pool.SandboxPool``,
    subprocess runners: ``prestarted.RunnerPool``) shows, and how it tells its observer
    (``PoolObserver``: the worker's metrics). The pool holds ``size``, ``max_idle_s``,
    ``_cond``, ``_idle`` (per language, each item with a ``created`` monotonic time),
    ``_starting``, ``hits``, ``misses``, ``observe`` and ``_stop``."""

    size: int
    max_idle_s: float
    observe: PoolObserver | None
    _cond: Any
    _idle: dict[str, Any]
    _starting: Any
    hits: Any
    misses: Any
    _stop: bool

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Block until every language has its idle sandboxes or runners (tests and
        benchmarks); False at ``timeout_s``, or at once when the pool is stopping."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not all(len(q) >= self.size for q in self._idle.values()):
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._cond:
            return {
                "size": self.size,
                "max_idle_s": self.max_idle_s,
                "languages": {
                    name: {
                        "idle": len(q),
                        "starting": self._starting[name],
                        "hits": self.hits[name],
                        "misses": self.misses[name],
                        "oldest_idle_s": round(max((now - p.created for p in q), default=0.0), 3),
                    }
                    for name, q in self._idle.items()
                },
            }

    def _notify(self) -> None:
        if self.observe is None:
            return
        try:
            self.observe(self.stats())
        except Exception as e:  # noqa: BLE001 - a metric is never worth a sandbox or a runner
            logging.getLogger("studio_code").warning("pool observer failed: %s", e)
