"""The main process's loops are never silently gone (worker.upkeep.loop): a loop whose body
raises is logged, counted and restarted; too many failures in a row stop the worker."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from testkit.processes import wait_for
from worker.upkeep.loop import Supervised


def test_a_loop_that_raises_is_logged_counted_and_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []

    def body(stop: threading.Event) -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise ValueError(f"boom {len(runs)}")
        stop.wait()  # the third start keeps running until stopped

    gave_up = threading.Event()
    loop = Supervised("test", body, on_give_up=gave_up.set, max_failures=3, pause_s=0.0)
    with caplog.at_level(logging.ERROR, logger="studio_code.worker"):
        loop.start()
        wait_for(lambda: len(runs) == 3, 30, "three runs", 0.01)
        assert loop.alive()
        loop.stop(5)
    assert not loop.alive()
    assert loop.restarts == 2
    assert not gave_up.is_set() and not loop.gave_up
    failed = [r for r in caplog.records if "test loop failed" in r.getMessage()]
    assert len(failed) == 2
    assert all(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in failed)


def test_a_loop_that_returns_by_itself_counts_as_a_failure() -> None:
    runs: list[int] = []

    def body(stop: threading.Event) -> None:
        runs.append(1)
        if len(runs) > 1:
            stop.wait()

    loop = Supervised("returns", body, on_give_up=lambda: None, pause_s=0.0)
    loop.start()
    wait_for(lambda: len(runs) == 2, 30, "two runs", 0.01)
    loop.stop(5)
    assert loop.restarts == 1


def test_failures_past_the_bound_stop_the_worker_process() -> None:
    """The default give-up is a SIGTERM to this process (Celery's warm shutdown)."""
    code = textwrap.dedent("""
        import logging, threading
        from worker.upkeep.loop import Supervised
        logging.basicConfig(level=logging.INFO)
        def body(stop):
            raise RuntimeError("always fails")
        loop = Supervised("doomed", body, max_failures=3, pause_s=0.0)
        loop.start()
        threading.Event().wait(60)
        print("still running")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "still running" not in proc.stdout
    assert "the worker's doomed loop failed 3 times within 600 s: stopping the worker" in (
        proc.stderr
    )
    assert proc.stderr.count("RuntimeError: always fails") == 3
