"""Processes a test or a bench starts: each its own session, output to a log file, stopped by
pid (SIGTERM, then SIGKILL of what is left of its process tree and group), never by name.
Every class is also a context manager that stops it at the end. Also ``wait_for`` (the one
polling helper) and the rule a missing service follows (``require``: skip on a laptop, fail
under CI=true) and the check that a test is marked for what it starts (``needs``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest

from testkit.reaper import children as children  # re-exported: tests read it here
from testkit.reaper import disown, own, process_tree

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"
BIN = Path(sys.executable).parent
HOST = socket.gethostname()


#: the markers of the test being run, set by tests/conftest.py; None outside a pytest run
#: (bench/): what starts a service checks it with ``needs``
CURRENT_MARKS: set[str] | None = None


def needs(marker: str, what: str) -> None:
    """Refuse to start ``what`` in a test not marked ``marker``: ``-m "not <marker>"`` (the
    fast tier, ``make test-fast``) must leave out every test that needs the service."""
    if CURRENT_MARKS is not None and marker not in CURRENT_MARKS:
        raise AssertionError(
            f"this test starts {what} but is not marked {marker!r}: add "
            f"@pytest.mark.{marker} (or pytestmark) so `-m 'not {marker}'` leaves it out"
        )


def require(ok: bool, what: str) -> None:
    """Skip (laptop) or fail (CI=true) when a service the test needs is missing."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} (CI=true: a missing service fails the suite)")
    pytest.skip(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- processes by pid ----------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL each of ``pids`` still alive (pids this test or bench started)."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def in_processes(
    target: Callable[..., None], args: Sequence[tuple[Any, ...]], timeout_s: float = 240
) -> list[Any]:
    """``target(*a, barrier, out)`` for each ``a`` of ``args``, each in a spawned process of
    its own; ``barrier`` lets them all go at once and each puts one report on ``out``.
    Returns the reports, as they came, once every process ended with status 0 (one still
    running a minute after its report is killed)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(args))
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args]
    for p in procs:
        p.start()
    try:
        reports = [out.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        out.join_thread()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return reports


class StopsOnExit:
    """``with`` it: ``stop()`` at the end, whatever happened."""

    def stop(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class Service(StopsOnExit):
    """A process this test started (its own session, output to a log file, or stdout to a
    pipe with ``capture_stdout``); stopped by pid."""

    #: how long ``stop()`` waits for a clean exit after SIGTERM before SIGKILL
    stop_timeout = 60.0

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        *,
        capture_stdout: bool = False,
        stop_timeout: float | None = None,
    ) -> None:
        self.log = log
        if stop_timeout is not None:
            self.stop_timeout = stop_timeout
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE if capture_stdout else out,
                stderr=out,
                start_new_session=True,
            )
        own(self.proc.pid)  # stopped by the reaper if this process ends first

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def tree(self) -> list[int]:
        return process_tree(self.pid)

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_hard(self) -> list[int]:
        """SIGKILL the main process and every child, by pid (from the process tree)."""
        pids = self.tree()
        kill_pids(pids)
        self.proc.wait(timeout=10)
        disown(self.pid)
        return pids

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (a worker's warm shutdown), then SIGKILL of what is left: the processes
        of its tree as it was before the SIGTERM, and its own process group. Returns its
        exit code (None when it could not be reaped)."""
        if not self.alive():
            disown(self.pid)
            return self.proc.returncode
        pids = self.tree()
        self.signal(signal.SIGTERM)
        code = self.wait(self.stop_timeout if timeout is None else timeout)
        kill_pids(pids)
        if code is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = self.wait(10)
        disown(self.pid)
        return code


def non_root_python(
    script: str, *args: str, uid: int, marker: str, env: dict[str, str] | None = None, **kw: Any
) -> subprocess.Popen[str]:
    """``script`` run by /usr/bin/python3 as a server of uid ``uid`` (no supplementary
    group) with this checkout and the tests' virtualenv on its path, ``marker`` in its
    STUDIO_ISO_MARKER (and ``env``'s variables); ``kw`` for Popen. Its stdout and stderr
    are pipes (``last_json_line``)."""
    venv = Path(sys.prefix)  # the tests' own virtualenv (a worktree has none of its own)
    site = next((venv / "lib").glob("python3*/site-packages"))
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 for the unprivileged server")
    env = {
        **(env or {}),
        "PYTHONPATH": f"{ROOT}:{site}",
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "STUDIO_ISO_MARKER": marker,
    }
    return subprocess.Popen(
        ["/usr/bin/python3", "-c", script, *args],
        user=uid,
        group=uid,
        extra_groups=[],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def last_json_line(server: subprocess.Popen[str], timeout_s: float) -> Any:
    """The last line ``server`` prints, as JSON, once it exited 0 (killed if it does not)."""
    try:
        stdout, stderr = server.communicate(timeout=timeout_s)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def tree_usage(pid: int) -> tuple[int, int, int]:
    """Open fds, RSS (bytes) and threads of ``pid``'s process tree, from /proc."""
    fds = rss = threads = 0
    for p in process_tree(pid):
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
        except OSError:
            pass
    return fds, rss, threads


# --- waiting ---------------------------------------------------------------------------------


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """The first true value ``predicate`` returns, asked every ``interval_s``; after
    ``timeout_s`` (a hang guard, never a timing assertion) the test fails naming ``what`` it
    waited for and what it saw last (``describe()``, else the last value)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    seen = describe() if describe is not None else last
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {seen!r})")
