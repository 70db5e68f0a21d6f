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
  a job before then, or meanwhile, is not measured (the next one is).
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
from typing import TYPE_CHECKING, Any

from executor.runtimes.docker import usage

if TYPE_CHECKING:
    from executor.settings import Settings

#: executor.runtimes.docker.pool's SandboxPool and Pooled: the pool calls this module (after
#: a fill, for meta), so naming its types here, even for the type checker only, would make
#: an import circle (tests/test_imports.py)
SandboxPool = Any
Pooled = Any

log = logging.getLogger("studio_code")

#: CPU time unchanged this long: the runner is blocked on its stdin (done importing)
QUIET_S = 0.5
POLL_S = 0.1
#: the longest the measurement waits for a sandbox to go quiet (a loaded host, heavy imports)
SETTLE_TIMEOUT_S = 120.0

#: by pool, then language: the figures shown, and the image id they were measured on
_figures: weakref.WeakKeyDictionary[Any, dict[str, dict[str, Any]]] = weakref.WeakKeyDictionary()
#: (id of the pool, language) being measured now
_measuring: set[tuple[int, str]] = set()
_lock = threading.Lock()


def after_fill(pool: SandboxPool, p: Pooled) -> None:
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


def shown(
    settings: Settings, languages: list[str], pool: SandboxPool | None
) -> dict[str, dict[str, Any]]:
    """Meta's ``pool.preimport_memory``: per language, what a pre-started sandbox of
    ``pool`` (this process's; None: it keeps none) holds."""
    modules = settings.code_preimport.split(",") if settings.code_preimport else []
    out: dict[str, dict[str, Any]] = {}
    with _lock:
        mine = _figures.get(pool, {}) if pool is not None else {}
        for name in languages:
            got = mine.get(name)
            out[name] = {
                # what the sandbox imports while it waits (Python only: TypeScript has none)
                "modules": modules if name == "python" else [],
                "idle_memory_bytes": got["idle"] if got else None,
                "without_preimport_bytes": got["without"] if got else None,
                "memory_limit_bytes": got["limit"] if got else None,
                "source": got["source"]
                if got
                else (
                    "not measured yet: measured by the process that keeps pre-started "
                    "sandboxes (a worker's pool process, STUDIO_CODE_PREWARM > 0) once its "
                    "first one is idle"
                ),
            }
    return out


def wait_quiet(api: Any, meter: usage.Meter, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Until the sandbox's CPU time stops growing for QUIET_S (its runner blocks on stdin);
    False at ``timeout_s`` or when its cgroup cannot be read (it ended)."""
    deadline = time.monotonic() + timeout_s
    last: int | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
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


def _idle_reading(pool: SandboxPool, p: Pooled) -> tuple[int, str] | None:
    """``p``'s anonymous memory once it is quiet, and the source; None when it could not
    be read while ``p`` was idle (taken by a job, ended, or no view of its cgroup)."""
    api = pool.runtime.api
    meter = usage.of(p.cid)
    if meter is None or not wait_quiet(api, meter):
        return None
    figure = meter.resident()
    with pool._cond:
        idle = any(q is p for q in pool._idle[p.language])
    if not figure or not idle:  # nothing resident yet is not a figure
        return None
    return figure, str(meter.source())


def _measure(pool: SandboxPool, p: Pooled) -> None:
    language = pool.languages[p.language]
    try:
        if usage.of(p.cid) is None:
            _record(
                p,
                None,
                None,
                pool,
                "not measured: this process cannot read the sandboxes' "
                "cgroups (usage off, or a worker in a container without the host's view)",
            )
            return
        got = _idle_reading(pool, p)
        if got is None:
            return  # taken or ended first: the next sandbox started is measured
        idle, source = got
        without: int | None = idle
        if language.preimport(pool.settings):
            if pool._stop:
                return  # a closing pool starts nothing more (its drain may be over)
            bare = pool._create(language, preimport=False)
            try:  # never in the pool's idle queue: no job can take it
                base = _bare_reading(pool, bare)
            finally:
                with pool._cond:
                    pool._retire.append(bare)
                    pool._cond.notify_all()
            if base is None:
                return
            without = base
        _record(p, idle, without, pool, f"host, {source} memory.stat anonymous memory")
    except Exception as e:  # noqa: BLE001 - a figure never fails the pool
        log.debug("pre-import memory of %s not measured: %s", p.language, e)
    finally:
        with _lock:
            _measuring.discard((id(pool), p.language))


def _bare_reading(pool: SandboxPool, bare: Pooled) -> int | None:
    meter = usage.of(bare.cid)
    if meter is None or not wait_quiet(pool.runtime.api, meter):
        return None
    return meter.resident() or None  # nothing resident yet is not a figure


def _record(
    p: Pooled, idle: int | None, without: int | None, pool: SandboxPool, source: str
) -> None:
    with _lock:
        _figures.setdefault(pool, {})[p.language] = {
            "image_id": p.image_id,
            "idle": idle,
            "without": without,
            "limit": pool.limits.memory_bytes,
            "source": source,
        }
    log.info(
        "pre-started %s sandbox idle memory: %s bytes (without pre-import: %s; limit %s)",
        p.language,
        idle,
        without,
        pool.limits.memory_bytes,
    )
