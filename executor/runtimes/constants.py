"""Timing constants every runtime and the queue share, apart from any runtime's SDK, so the
queue's wire contract (worker.protocol) can import them without loading Docker."""

from __future__ import annotations

#: seconds a sandbox gets past its timeout before it is killed for good; the queue's
#: timings (visibility timeout, stuck-job sweep, Celery's hard time limit) add it too
KILL_GRACE_S = 10.0
