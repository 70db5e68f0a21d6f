"""What a pre-started sandbox holds in memory once its pre-imports are done, measured by the
host from the sandbox's cgroup (issue 34: "memory used by pre-imports is counted against the
sandbox's own limit and shown in meta"). Never claimed by the code in the sandbox.

The pre-imports run in the sandbox's own interpreter, so their memory is charged to the
sandbox's own cgroup and counts against its limit (STUDIO_CODE_MEMORY): the job gets the
limit minus what was imported for it. This module shows how much that is.

- **When**: the first sandbox a pool process pre-starts for a language (and again after its
  image changes) is watched on a thread of its own, off every job's path. Its runner is done
  importing when it blocks reading its stdin: the host sees that as the sandbox's CPU time
  (cgroup ``cpuacct.usage`` / ``cpu.stat``) not growing for ``QUIET_S``. A sandbox taken by
  a job before then, or meanwhile, is not measured (the next one is); one still idle that
  could not be read (a loaded host) is measured again, ``ATTEMPTS`` times at most.
- **What**: the cgroup's anonymous memory (v1 ``memory.stat`` ``total_rss``, v2 ``anon``):
  what the interpreter and its imports hold privately. The file cache of the modules read is
  left out: pages of the image's files are shared between sandboxes and charged to whichever
  read them first, so that part says more about the order sandboxes started than about the
  pre-import.
- **Without**: when a pre-import is set, one more sandbox of the same shape is started once
  without it, measured alike and removed (by the pool, like any used sandbox): the figure
  the pre-import adds to is measured side by side, never assumed. Without a pre-import
  setting, the idle figure is that figure.

Shown in meta (``pool.preimport_memory``) by the process that keeps the pool (a worker's
pool process: ``pool.this_process``); a process without a pool (the API, ``studio-code meta``)
shows null figures with a sentence saying so.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from executor.languages import get_language
from executor.runtimes.constants import PREIMPORT_NOT_YET
from executor.runtimes.docker import usage

if TYPE_CHECKING:
    from executor.models import Limits
    from executor.settings import Settings


class Sandbox(Protocol):
    """A pre-started sandbox as this module sees it (the pool's ``Pooled``, a sandbox.py
    handle: its usage meter rides on it)."""

    @property
    def cid(self) -> str: ...

    @property
    def meter(self) -> usage.Meter | None: ...

    @property
    def language(self) -> str: ...

    @property
    def image_id(self) -> str: ...


S = TypeVar("S", bound=Sandbox)


class MeasuredPool(Protocol[S]):
    """What this module asks of a pool (``executor.runtimes.docker.pool.SandboxPool``). The
    pool calls this module (after a fill, for meta), so it is named by what it does here:
    naming its class, even for the type checker only, would make an import circle
    (tests/test_imports.py)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def api(self) -> Any:
        """The engine's low-level client (``docker.APIClient``) of this process."""

    def preimports(self, language: str) -> bool:
        """Does a pre-started sandbox of ``language`` import anything while it waits?"""

    def closing(self) -> bool:
        """Is the pool stopping (it starts nothing more)?"""

    def is_idle(self, sandbox: S) -> bool:
        """Is ``sandbox`` still waiting in the pool (not taken by a job, not retired)?"""

    def start_aside(self, language: str) -> S:
        """One more sandbox of ``language``'s pooled shape, started WITHOUT its pre-import
        and never put in the pool (no job can take it); ``release`` removes it."""

    def release(self, sandbox: S) -> None:
        """Remove ``sandbox`` (the pool's remover, like any used sandbox)."""


log = logging.getLogger("studio_code")

#: ``source`` of a language not measured (yet, or at all)
NOT_YET = PREIMPORT_NOT_YET
NOT_YET = (
    "not measured yet: measured by the process that keeps pre-started sandboxes (a worker's "
    "pool process, STUDIO_CODE_PREWARM > 0) once its first one is idle"
)
UNREADABLE = (
    "not measured: this process cannot read the sandboxes' cgroups (usage off, or a worker "
    "in a container without the host's view)"
)

#: CPU time unchanged this long: the runner is blocked on its stdin (done importing)
QUIET_S = 0.5
POLL_S = 0.1
#: the longest the measurement waits for a sandbox to go quiet (a loaded host, heavy imports)
SETTLE_TIMEOUT_S = 120.0
#: how far below its bare twin's a pre-importing sandbox's reading may fall and still be a
#: figure (two interpreters' anonymous memory differs by a few pages; importing a module
#: never frees any)
BELOW_TWIN_SLACK_BYTES = 512 * 1024
#: measurements of one idle sandbox that could not be read, before waiting for the next one
ATTEMPTS = 5
RETRY_S = 1.0

#: by pool, then language: the figures shown, and the image id they were measured on
_figures: weakref.WeakKeyDictionary[MeasuredPool[Any], dict[str, dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)
#: (id of the pool, language) being measured now
_measuring: set[tuple[int, str]] = set()
_lock = threading.Lock()


def after_fill(pool: MeasuredPool[S], p: S) -> None:
    """``p`` was just pre-started and put in the pool: measure it, on a thread, unless this
    language is measured already on this image (or being measured)."""
    key = (id(pool), p.language)
    with _lock:
        got = _figures.get(pool, {}).get(p.language)
        if key in _measuring or (got is not None and got["image_id"] == p.image_id):
            return
        _measuring.add(key)
    threading.Thread(
        target=_measure, args=(pool, p), name="studio-preimport-memory", daemon=True
    ).start()


def modules(settings: Settings, language: str) -> list[str]:
    """What a pre-started sandbox of ``language`` imports while it waits
    (``Language.preimport_modules``)."""
    return get_language(language).preimport_modules(settings)


def measured(pool: MeasuredPool[Any]) -> dict[str, dict[str, Any]]:
    """Per language ``pool`` measured (or found it cannot): its figures and their source.
    A language not measured yet is left out. What the pool hands its observer (a worker's
    pool process passes it on to its main process's heartbeat: worker/preimport.py)."""
    with _lock:
        return {
            name: {
                "idle_memory_bytes": got["idle"],
                "without_preimport_bytes": got["without"],
                "memory_limit_bytes": got["limit"],
                "source": got["source"],
            }
            for name, got in _figures.get(pool, {}).items()
        }


def shown(
    settings: Settings, languages: list[str], pool: MeasuredPool[Any] | None
) -> dict[str, dict[str, Any]]:
    """Meta's ``pool.preimport_memory``: per language, what a pre-started sandbox of
    ``pool`` (this process's; None: it keeps none) holds."""
    mine = measured(pool) if pool is not None else {}
    return {
        name: {
            "modules": modules(settings, name),
            **mine.get(
                name,
                {
                    "idle_memory_bytes": None,
                    "without_preimport_bytes": None,
                    "memory_limit_bytes": None,
                    "source": NOT_YET,
                },
            ),
        }
        for name in languages
    }


def wait_quiet(
    api: Any,
    meter: usage.Meter,
    timeout_s: float = SETTLE_TIMEOUT_S,
    stop: Callable[[], bool] = lambda: False,
) -> bool:
    """Until the sandbox's CPU time stops growing for QUIET_S (its runner blocks on stdin);
    False at ``timeout_s``, when its cgroup cannot be read (it ended) or once ``stop``
    says so (its pool is closing)."""
    deadline = time.monotonic() + timeout_s
    last: int | None = None
    since = time.monotonic()
    while time.monotonic() < deadline and not stop():
        got = meter._read(api)
        if got is None or got[1] is None:
            return False
        if got[1] != last:
            last, since = got[1], time.monotonic()
        elif got[1] > 0 and time.monotonic() - since >= QUIET_S:
            # quiet after it ran (a sandbox whose process has not started yet on a loaded
            # engine shows no CPU at all: that is not quiet, and it would read 0 bytes)
            return True
        time.sleep(POLL_S)
    return False


def _idle_reading(pool: MeasuredPool[S], p: S) -> tuple[int, str] | None:
    """``p``'s anonymous memory once it is quiet, and the source; None when it could not
    be read while ``p`` was idle (taken by a job, ended, or no view of its cgroup)."""
    meter = p.meter
    if meter is None or not wait_quiet(pool.api, meter, stop=pool.closing):
        return None
    figure = meter.resident()
    if not figure or not pool.is_idle(p):  # nothing resident yet is not a figure
        return None
    return figure, str(meter.source())


def _measure(pool: MeasuredPool[S], p: S) -> None:
    try:
        if p.meter is None:
            _record(pool, p, None, None, UNREADABLE)
            return
        for attempt in range(1, ATTEMPTS + 1):
            if _measure_once(pool, p):
                return
            if not pool.is_idle(p) or pool.closing():
                return  # taken or ended first: the next sandbox started is measured
            # still idle, not read this time (a loaded host: not quiet in time, nothing
            # resident yet, its bare twin not read): no other sandbox may be started for a
            # long while (none is taken), so this one is measured again
            log.debug("pre-import memory of %s not read (attempt %d)", p.language, attempt)
            time.sleep(RETRY_S)
    except Exception as e:  # noqa: BLE001 - a figure never fails the pool
        log.debug("pre-import memory of %s not measured: %s", p.language, e)
    finally:
        with _lock:
            _measuring.discard((id(pool), p.language))


def _measure_once(pool: MeasuredPool[S], p: S) -> bool:
    """One measurement of idle ``p`` (and of a bare twin when it pre-imports); whether its
    figures were recorded."""
    got = _idle_reading(pool, p)
    if got is None:
        return False
    idle, source = got
    without: int | None = idle
    if pool.preimports(p.language):
        if pool.closing():
            return False  # a closing pool starts nothing more (its drain may be over)
        bare = pool.start_aside(p.language)
        try:  # never in the pool's idle queue: no job can take it
            base = _bare_reading(pool, bare)
        finally:
            pool.release(bare)
        if base is None:
            return False
        # read again now that its twin went quiet too: a runner a loaded host left
        # unscheduled past QUIET_S looked quiet mid-import (a CI run: 3.0 MB held with
        # pydantic pre-imported against 4.6 MB bare, a negative figure in meta). An idle
        # runner's memory does not shrink, so the later reading is the fuller one; still
        # below its twin's, it was not done importing: not a figure, measured again.
        again = p.meter.resident() if p.meter is not None and pool.is_idle(p) else None
        idle = max(idle, again or 0)
        if idle + BELOW_TWIN_SLACK_BYTES < base:
            return False
        without = base
    _record(pool, p, idle, without, f"host, {source} memory.stat anonymous memory")
    return True


def _bare_reading(pool: MeasuredPool[S], bare: S) -> int | None:
    meter = bare.meter
    if meter is None or not wait_quiet(pool.api, meter, stop=pool.closing):
        return None
    return meter.resident() or None  # nothing resident yet is not a figure


def _record(
    pool: MeasuredPool[S], p: S, idle: int | None, without: int | None, source: str
) -> None:
    limit = pool.limits.memory_bytes
    with _lock:
        _figures.setdefault(pool, {})[p.language] = {
            "image_id": p.image_id,
            "idle": idle,
            "without": without,
            "limit": limit,
            "source": source,
        }
    log.info(
        "pre-started %s sandbox idle memory: %s bytes (without pre-import: %s; limit %s)",
        p.language,
        idle,
        without,
        limit,
    )
