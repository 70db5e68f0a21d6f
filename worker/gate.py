"""The gate between a worker's main process and its pool processes, on their shared page
(worker.shared_page): the main process opens and closes it (worker.upkeep.gate_watch); a
pool process reads whether it is closed (``closed_in_child``) and reports a failure it met
(``report``): the main process then probes at once instead of at its next interval.

A pool process that meets a closed gate or a failing store hands the message back
(``Reject(requeue=True)``) before claiming, so the job is neither consumed nor counted as an
attempt.

Its reasons (``Gate``, ``gate()``, ``pause_reason``) are the main process's: the probe sets
them (worker.upkeep.gate_watch), the consumer's gate step reads them (worker.consumer.pause).
The page's slots, each written by one process: the closed flag and, per kind, the report
time the main process last answered (the main process's); per kind and pool process index,
the time that process last reported the kind failing (that pool process's).
"""

from __future__ import annotations

import logging
import threading
import time

from worker.shared_page import SharedPage

log = logging.getLogger("studio_code.worker")

#: the longest a reported failure that no probe answered holds a pool process's claims
PENDING_MAX_S = 5.0
RUN_STORE = "run_store"
RUNTIME = "runtime"
KINDS = (RUN_STORE, RUNTIME)
#: pool process indexes with report slots of their own (a larger index uses the last one)
PROCESSES = 64

# [closed][answered per kind][report per kind x process]
_CLOSED = 0
_ANSWERED = 1
_REPORTS = _ANSWERED + len(KINDS)
_page = SharedPage(_REPORTS + len(KINDS) * PROCESSES, 32)


def _report_slot(kind: str, index: int) -> int:
    return _REPORTS + KINDS.index(kind) * PROCESSES + min(index, PROCESSES - 1)


def _index() -> int:
    from celery.utils.log import current_process_index

    return current_process_index(base=0) or 0  # None: not a pool process (tests, solo)


def report(kind: str, reason: str, index: int | None = None) -> None:
    """A pool process met ``kind`` failing: the main process probes it at once. ``index``:
    its pool process index (Celery's by default)."""
    log.error("%s unavailable in pool process: %s", kind, reason)
    _page.write_float(_report_slot(kind, _index() if index is None else index), time.time())


def closed_in_child() -> bool:
    """True while the main process keeps the gate closed (read in a pool process)."""
    return _page.read_float(_CLOSED) > 0


def last_report(kind: str) -> float:
    """When a pool process last reported ``kind`` failing (read by the main process, and
    by a pool process before each job: 0.0 at once while none ever did)."""
    first = _report_slot(kind, 0)
    if _page.untouched(first, PROCESSES):
        return 0.0
    return max(_page.read_float(first + i) for i in range(PROCESSES))


def pending_in_child() -> bool:
    """True while a failure a pool process reported has not been probed yet by the main
    process (read in a pool process): the gate may be about to close, so a job is handed
    back before its claim (no attempt counted) instead of meeting the same failure. A main
    process that never probes (no gate) holds it up PENDING_MAX_S at most."""
    now = time.time()
    for kind in KINDS:
        reported = last_report(kind)
        if _page.read_float(_ANSWERED + KINDS.index(kind)) < reported > now - PENDING_MAX_S:
            return True
    return False


def answered(kind: str, reported_at: float) -> None:
    """The main process probed ``kind`` after its report of ``reported_at``."""
    _page.write_float(_ANSWERED + KINDS.index(kind), reported_at)


def set_closed(closed: bool) -> None:
    """The main process's flag every pool process reads (``closed_in_child``)."""
    _page.write_float(_CLOSED, 1.0 if closed else 0.0)


# --- the gate's reasons (main process) -----------------------------------------------------


class Gate:
    """Reasons this worker is not taking messages, by kind. Thread-safe."""

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}
        self._lock = threading.Lock()

    def set(self, kind: str, reason: str | None) -> None:
        with self._lock:
            before = self._reasons.get(kind)
            if reason is None:
                self._reasons.pop(kind, None)
            else:
                self._reasons[kind] = reason
            closed = bool(self._reasons)
        set_closed(closed)
        if reason is not None and before is None:
            log.error(
                "not taking jobs: %s. Messages stay in the queue for other workers; "
                "this worker resumes by itself when it answers again.",
                reason,
            )
        elif reason is None and before is not None:
            log.warning("taking jobs again: %s is back", kind.replace("_", " "))

    def reason(self) -> str | None:
        with self._lock:
            if not self._reasons:
                return None
            return "; ".join(self._reasons[k] for k in KINDS if k in self._reasons)

    def reasons(self) -> dict[str, str]:
        with self._lock:
            return dict(self._reasons)


_gate = Gate()


def gate() -> Gate:
    return _gate


def pause_reason() -> str | None:
    """Why this worker is not taking messages now (None: it is). A plain callable for the
    health endpoint and the worker's heartbeat."""
    return _gate.reason()
