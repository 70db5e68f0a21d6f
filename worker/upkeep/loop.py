"""A main-process loop that is never silently gone: each runs in a thread of its own under
``Supervised``.

Each loop already logs and carries on when one iteration fails (a probe, a sweep, a beat).
What gets out of the loop's body anyway (a bug, something unforeseen) is logged with its
traceback, counted (``restarts``; the metric ``studio_code_worker_loop_restarts_total{loop}``)
and the body is started again after RESTART_PAUSE_S. MAX_FAILURES within FAILURE_WINDOW_S stop
the worker instead (a warm shutdown, SIGTERM to this process, with one CRITICAL line saying
which loop and why), so its supervisor starts a fresh one rather than a worker serving without
its reaper or gate. A body that returns while not asked to stop counts as a failure too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("studio_code.worker")

MAX_FAILURES = 5
FAILURE_WINDOW_S = 600.0
RESTART_PAUSE_S = 1.0


def stop_this_worker() -> None:
    """A warm shutdown of this worker (Celery's handler of SIGTERM in the main process)."""
    os.kill(os.getpid(), signal.SIGTERM)


class Supervised:
    """``body(stop)`` in a thread named ``studio-<name>``, restarted when it raises (above)."""

    def __init__(
        self,
        name: str,
        body: Callable[[threading.Event], None],
        *,
        on_give_up: Callable[[], None] = stop_this_worker,
        max_failures: int = MAX_FAILURES,
        window_s: float = FAILURE_WINDOW_S,
        pause_s: float = RESTART_PAUSE_S,
    ) -> None:
        self.name = name
        self.body = body
        self.on_give_up = on_give_up
        self.max_failures = max_failures
        self.window_s = window_s
        self.pause_s = pause_s
        self.restarts = 0
        self.gave_up = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stopping(self) -> threading.Event:
        return self._stop

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"studio-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        failures: deque[float] = deque()
        while not self._stop.is_set():
            try:
                self.body(self._stop)
                if self._stop.is_set():
                    return
                raise RuntimeError(f"the {self.name} loop returned while the worker runs")
            except Exception:  # noqa: BLE001 - reported, counted, restarted or the worker stops
                now = time.monotonic()
                failures.append(now)
                while failures and failures[0] < now - self.window_s:
                    failures.popleft()
                self.restarts += 1
                _count(self.name)
                if len(failures) >= self.max_failures:
                    log.critical(
                        "the worker's %s loop failed %d times within %g s: stopping the "
                        "worker (its supervisor starts a fresh one); see the tracebacks above",
                        self.name,
                        len(failures),
                        self.window_s,
                        exc_info=True,
                    )
                    self.gave_up = True
                    self.on_give_up()
                    return
                log.exception(
                    "the worker's %s loop failed (%d time(s) within %g s); restarting it in %g s",
                    self.name,
                    len(failures),
                    self.window_s,
                    self.pause_s,
                )
                self._stop.wait(self.pause_s)


def _count(name: str) -> None:
    try:
        from worker import metrics

        metrics.record_loop_restart(name)
    except Exception as e:  # noqa: BLE001 - a metric is never worth the loop
        log.warning("loop restart metric failed: %s", e)
