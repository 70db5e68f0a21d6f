"""Which pool processes got through their start, shared by the pool processes (they say so)
and the worker's main process (which waits for them before it takes any job).

A pool process starts in Celery's ``worker_process_init`` (worker.job.tasks): it opens the
run store, connects its runtime and pre-starts its sandboxes. Celery itself watches only the
processes that replace others (``worker_proc_alive_timeout``: killed and forked again when
not up in time); a first pool process stuck at start (a lock or a call that never returns)
is never looked at again, and its worker would answer pings and announce itself serving
while the jobs handed to that process wait for ever. So the main process waits for every
first pool process to say it started (worker.upkeep.pool_start) before its consumer starts:
no job is taken, no ping answered and no heartbeat sent before then.

The page: the worker's shared page (worker.shared_page, the one protocol between its
processes), one slot per pool process index (Celery's, 0..N-1) holding the pid that process
wrote at the end of its start.
"""

from __future__ import annotations

import os
import struct

from worker.shared_page import SharedPage

#: pool process indexes with a slot (a larger one is not waited for)
SLOTS = 1024
_PID = struct.Struct("<I")
_page = SharedPage(SLOTS, 16)


def mark_started(index: int | None = None) -> None:
    """In a pool process, once its start is over: its pid in its slot (``index``: its pool
    process index, Celery's by default)."""
    if index is None:
        from celery.utils.log import current_process_index

        index = current_process_index(base=0)
        if index is None:
            return  # not a pool process (solo, threads): nothing waits for it
    _page.write(index, _PID.pack(os.getpid()))  # no slot past SLOTS: not waited for


def started_pids() -> set[int]:
    """The pids the pool processes wrote as they started (main process)."""
    out = set()
    for i in range(SLOTS):
        data = _page.read(i)
        if data is not None and len(data) == _PID.size:
            out.add(_PID.unpack(data)[0])
    return out
