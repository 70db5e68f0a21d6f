"""Live logs, the worker's side: what a running node prints goes to a Redis stream as it
comes, so the API can show it before the node ends (``GET /api/runs/{id}/logs?follow=1``).

The runtime's logs buffer passes on each piece it KEEPS (``executor.runtimes.base.LOG_TAP``),
so the stream holds at most the same STUDIO_CODE_LOG_MAX_BYTES (64 KiB) as the stored logs;
the truncation mark comes from the stored logs at the end, which stay the truth.

Writing to Redis never slows the sandbox's pump: pieces go to an in-process queue and a
thread of this job sends them in batches (one XADD per batch). A Redis that is down loses
the live view only (logged once); the stored logs are written as always.

Stream ``studio:logs:{job_id}``: entries ``{"d": <bytes>}``, then ``{"end": "1"}`` when the
sandbox is done; it expires LIVE_TTL_S after its last entry. An attempt after the first (a
re-run after a sandbox lost to the infrastructure, or a redelivery after a worker stopped)
starts with ``{"rerun": "<attempt>"}``, so a reader can tell the earlier attempt's text from
the one that counts (api_client.log_follower's ``rerun`` event).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from executor.runtimes.base import LOG_TAP
from worker.protocol import LIVE_TTL_S, logs_key

log = logging.getLogger("studio_code.worker")

MAX_ENTRIES = 10_000  # a safety cap (64 KiB of logs make far fewer entries)
END_MARK = {"end": "1"}
_STOP = object()


class LivePublisher:
    """One job's pieces -> its Redis stream, from a thread of its own."""

    def __init__(self, client: Any, job_id: str, *, end_mark: bool = True) -> None:
        self.client = client
        self.key = logs_key(job_id)
        self.end_mark = end_mark
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failed = False
        # Started by the first piece: most nodes print nothing, and a thread per job (its
        # start and join) was a measurable part of the queue's own overhead.
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def write(self, piece: bytes) -> None:
        if self._thread is None:
            with self._starting:  # a runtime may read stdout and stderr on two threads
                if self._thread is None:
                    thread = threading.Thread(
                        target=self._loop, name="studio-live-logs", daemon=True
                    )
                    thread.start()
                    self._thread = thread
        self._q.put(piece)

    def _send(self, fields: dict[str, Any]) -> None:
        if self._failed:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.xadd(self.key, fields, maxlen=MAX_ENTRIES, approximate=True)
            pipe.expire(self.key, LIVE_TTL_S)
            pipe.execute()
        except Exception as e:  # noqa: BLE001 - the live view is best effort
            self._failed = True
            log.warning("live logs of %s not published (%s); the stored logs are kept", self.key, e)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            batch = []
            stop = item is _STOP
            if not stop:
                batch.append(item)
            while not stop:
                try:
                    more = self._q.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                else:
                    batch.append(more)
            if batch:
                self._send({"d": b"".join(batch)})
            if stop:
                if self.end_mark:
                    self._send(END_MARK)
                return

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is left (and the end mark, unless the caller adds it to its own
        round trip: ``add_end_mark``)."""
        if self._thread is None:  # nothing was printed: only the end mark
            if self.end_mark:
                self._send(END_MARK)
            return
        self._q.put(_STOP)
        self._thread.join(timeout_s)


def add_end_mark(pipe: Any, job_id: str) -> None:
    """The stream's end mark, added to a pipeline the job's end shares (after every piece
    was sent: ``close`` joined the sender)."""
    key = logs_key(job_id)
    pipe.xadd(key, END_MARK, maxlen=MAX_ENTRIES, approximate=True)
    pipe.expire(key, LIVE_TTL_S)


@contextmanager
def publishing(
    client: Any, job_id: str, *, end_mark: bool = True, attempt: int = 1
) -> Iterator[LivePublisher]:
    """Publish what the job prints while the block runs (the runtime reads LOG_TAP). With
    ``end_mark=False`` the caller writes the end mark (``add_end_mark``) with its next
    round trip: most nodes print nothing, and the mark alone was a round trip per job.
    ``attempt`` > 1 (a re-run) first writes the attempt boundary (one round trip, re-runs
    only), before any of this attempt's pieces."""
    publisher = LivePublisher(client, job_id, end_mark=end_mark)
    if attempt > 1:
        publisher._send({"rerun": str(attempt)})
    token = LOG_TAP.set(publisher.write)
    try:
        yield publisher
    finally:
        LOG_TAP.reset(token)
        publisher.close()
