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

The page: one 4-byte pid per pool process index (Celery's, 0..N-1), written by that process
at the end of its start; an anonymous mmap made in the main process before the pool forks
(MAP_SHARED: every pool process sees the same page).
"""

from __future__ import annotations

import mmap
import os
import struct

#: pool process indexes with a slot (a larger one is not waited for)
SLOTS = 1024
_PID = struct.Struct("<I")
_page = mmap.mmap(-1, SLOTS * _PID.size)


def mark_started(index: int | None = None) -> None:
    """In a pool process, once its start is over: its pid in its slot (``index``: its pool
    process index, Celery's by default)."""
    if index is None:
        from celery.utils.log import current_process_index

        index = current_process_index(base=0)
        if index is None:
            return  # not a pool process (solo, threads): nothing waits for it
    if 0 <= index < SLOTS:
        _PID.pack_into(_page, index * _PID.size, os.getpid())


def started_pids() -> set[int]:
    """The pids the pool processes wrote as they started (main process)."""
    pids = (_PID.unpack_from(_page, i * _PID.size)[0] for i in range(SLOTS))
    return {pid for pid in pids if pid}
