"""The worker's view of the engine under its sandboxes (its posture:
executor/runtimes/docker/posture.py): read in the MAIN process through the upkeep's runtime
(worker.upkeep.owner), logged as a WARNING at start-up (and again when it changes) while a
known container escape applies, and announced in the heartbeat (``WorkerContext.engine``),
so the API's meta shows each worker's engine (docs/security.md, "The engine posture").

Cost: two engine calls every POSTURE_TTL_S (five minutes; every RETRY_S while the engine
does not answer), in a thread of their own after the first; a beat reads the last answer.
A vulnerable engine is never a refusal here: STUDIO_CODE_ENGINE_REFUSE_VULNERABLE makes the
docker runtime itself not ready, and the gate pauses the worker with that reason.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from executor.runtimes.docker.posture import POSTURE_TTL_S

if TYPE_CHECKING:
    from executor.runtimes.base import Runtime
    from executor.runtimes.docker.posture import EnginePosture

log = logging.getLogger("studio_code.worker")

#: how soon an engine that did not answer is asked again
RETRY_S = 30.0


class EngineWatch:
    """The reader of this worker's engine posture, through ``runtime`` (None: no runtime).

    ``announcement`` never waits for the engine after the first read: a stale posture is read
    again in a thread of its own, so an engine that hangs cannot delay a heartbeat."""

    def __init__(self, runtime: Runtime | None) -> None:
        self.runtime = runtime
        self._warned: str | None = None
        self._told: str | None = None  # the runtime line last logged
        self._last: dict[str, Any] | None = None
        self._read_at: float | None = None
        self._reading: threading.Thread | None = None
        self._lock = threading.Lock()

    def posture(self) -> EnginePosture | None:
        """Read the posture now (None: no engine, or it does not answer); logs the WARNING
        when the engine's known escapes first show or change, and when they are gone."""
        runtime = self.runtime
        posture = runtime.engine_posture(fresh=True) if runtime is not None else None
        with self._lock:
            self._read_at = time.monotonic()
            self._last = posture.compact() if posture is not None else None
            if posture is None:
                return None
            warning = posture.warning()
            before, self._warned = self._warned, warning
            line = posture.runtime_line()
            told, self._told = self._told, line
        if line != told:  # at start-up, and when the engine's runtime changes
            log.info("%s", line)
        if warning is not None and warning != before:
            log.warning("%s", warning)
        elif warning is None and before is not None:
            log.warning("the Docker engine no longer has a known container escape of the table")
        return posture

    def announcement(self) -> dict[str, Any] | None:
        """What the heartbeat carries (``EnginePosture.compact``), or None."""
        with self._lock:
            read_at, last = self._read_at, self._last
            # an engine that did not answer is asked again sooner
            every = POSTURE_TTL_S if last is not None else RETRY_S
            stale = read_at is not None and time.monotonic() - read_at >= every
            if stale and (self._reading is None or not self._reading.is_alive()):
                self._reading = threading.Thread(
                    target=self.posture, name="studio-engine", daemon=True
                )
                self._reading.start()
        if read_at is None:  # the first beat waits for it: the start-up WARNING is logged now
            self.posture()
            with self._lock:
                last = self._last
        return last
