"""Constants every runtime and the queue share (timings, the size of /tmp), apart from any
runtime's SDK, so the queue's wire contract (worker.protocol) can import them without
loading Docker."""

from __future__ import annotations

#: seconds a sandbox gets past its timeout before it is killed for good; the queue's
#: timings (visibility timeout, stuck-job sweep, Celery's hard time limit) add it too
KILL_GRACE_S = 10.0

#: what a sandbox's /tmp holds (the docker runtime's tmpfs; the subprocess runtime's
#: RLIMIT_FSIZE is the same 64 MiB): meta's ``limits.tmp_size``
TMPFS_SIZE = "64m"

#: the ``source`` of a language whose pre-started sandboxes were not measured (yet, or at
#: all): written by the runtime that measures them (runtimes/docker/preimport_memory.py),
#: read by the API's summary of the workers' announcements (worker/preimport.py)
PREIMPORT_NOT_YET = (
    "not measured yet: measured by the process that keeps pre-started sandboxes (a worker's "
    "pool process, STUDIO_CODE_PREWARM > 0) once its first one is idle"
)
