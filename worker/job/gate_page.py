"""The gate, as a pool process sees it: one page of shared memory the main process made
before the pool forked (see worker.upkeep.gate_watch, which opens and closes the gate).

A pool process reads whether the gate is closed (``closed_in_child``) and reports a failure
it met (``report``): the main process then probes at once instead of at its next interval.
A pool process that meets a closed gate or a failing store hands the message back
(``Reject(requeue=True)``) before claiming, so the job is neither consumed nor counted as an
attempt.
"""

from __future__ import annotations

import logging
import mmap
import struct
import time

log = logging.getLogger("studio_code.worker")

#: the longest a reported failure that no probe answered holds a pool process's claims
PENDING_MAX_S = 5.0
RUN_STORE = "run_store"
RUNTIME = "runtime"
KINDS = (RUN_STORE, RUNTIME)

# --- the page shared with the pool processes ----------------------------------------------

# Layout: [closed flag: double][report time per kind: double...][answered report time per
# kind: double...]. An anonymous mmap is MAP_SHARED: made in the main process before the
# pool forks, every child sees one page.
_FMT = "d" * (1 + 2 * len(KINDS))
_page = mmap.mmap(-1, mmap.PAGESIZE)


def _read() -> tuple[float, ...]:
    return struct.unpack_from(_FMT, _page, 0)


def _write(index: int, value: float) -> None:
    struct.pack_into("d", _page, index * 8, value)


def report(kind: str, reason: str) -> None:
    """A pool process met ``kind`` failing: the main process probes it at once."""
    log.error("%s unavailable in pool process: %s", kind, reason)
    _write(1 + KINDS.index(kind), time.time())


def closed_in_child() -> bool:
    """True while the main process keeps the gate closed (read in a pool process)."""
    return _read()[0] > 0


def last_report(kind: str) -> float:
    """When a pool process last reported ``kind`` failing (read by the main process)."""
    return _read()[1 + KINDS.index(kind)]


def pending_in_child() -> bool:
    """True while a failure a pool process reported has not been probed yet by the main
    process (read in a pool process): the gate may be about to close, so a job is handed
    back before its claim (no attempt counted) instead of meeting the same failure."""
    page = _read()
    n = len(KINDS)
    now = time.time()
    return any(
        page[1 + n + i] < page[1 + i] > now - PENDING_MAX_S  # a main process that never
        for i in range(n)  # probes (no gate) holds it up PENDING_MAX_S at most
    )


def answered(kind: str, reported_at: float) -> None:
    """The main process probed ``kind`` after its report of ``reported_at``."""
    _write(1 + len(KINDS) + KINDS.index(kind), reported_at)


def set_closed(closed: bool) -> None:
    """The main process's flag every pool process reads (``closed_in_child``)."""
    _write(0, 1.0 if closed else 0.0)
