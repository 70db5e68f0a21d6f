"""The subprocess runtime: the code runs as a child of the server. THIS IS NOT A SANDBOX.

The child gets an empty environment, its own temporary folder (removed afterwards), its own
session, and on Linux rlimits on memory, CPU time, open files, file size and processes.
The time limit kills the whole process group. When the server runs as root, the child
runs as nobody so that the process limit (counted per uid) holds and it cannot read what
only root can. It can still use the network and read any file its uid can read.
"""

from __future__ import annotations

import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from executor.audit import SUBPROCESS_RUNTIME_USED
from executor.errors import RuntimeUnavailable
from executor.languages.base import Language
from executor.models import CodeJob, Limits
from executor.runtimes.base import POLL_S, BoundedBuffer, CancelCheck, RawRun, Runtime
from executor.settings import Settings, sandbox_ids

NOFILE = 256
FSIZE_BYTES = 64 * 1024 * 1024  # as much as the container's /tmp holds
RSS_POLL_S = 0.02
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

WARNING = (
    "STUDIO_CODE_RUNTIME=subprocess: Code nodes run on the host as child processes, NOT in "
    "a sandbox. Code can use the network and read any file the server user can read "
    "(including a SQLite database and secret.key). Use it only for trusted local work."
)
RUN_WARNING = (
    "Runs on host: this node ran as a child process of the server (STUDIO_CODE_RUNTIME="
    "subprocess), not in a sandbox."
)


def rlimits(limits: Limits, *, address_space: bool = True) -> dict[int, tuple[int, int]]:
    """The whole resource policy of a child, on one screen."""
    cpu_s = math.ceil(limits.timeout_s) + 1
    policy = {
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),
        resource.RLIMIT_NOFILE: (NOFILE, NOFILE),
        resource.RLIMIT_FSIZE: (FSIZE_BYTES, FSIZE_BYTES),
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NPROC: (limits.pids, limits.pids),
    }
    if address_space:  # V8 reserves far more address space than it uses: see _wait's watch
        policy[resource.RLIMIT_AS] = (limits.memory_bytes, limits.memory_bytes)
    return policy


class SubprocessRuntime(Runtime):
    """Runs each call as an rlimited child process in its own session."""

    name = "subprocess"
    isolated = False
    warnings = (WARNING,)
    run_warnings = (RUN_WARNING,)
    audit_event = SUBPROCESS_RUNTIME_USED

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def unavailable_reason(self, language: Language) -> str | None:
        binary = language.command(self.settings, _PROBE_LIMITS, in_container=False)[0]
        if shutil.which(binary) is None:
            return f"{binary} is not installed or not on PATH for the server user."
        if not sys.platform.startswith("linux"):
            return None  # runs, but without the memory limit: meta's warning says so
        return None

    def run(
        self,
        job: CodeJob,
        language: Language,
        limits: Limits,
        *,
        should_cancel: CancelCheck | None = None,
    ) -> RawRun:
        uid, gid = sandbox_ids()
        as_root = os.getuid() == 0
        workdir = tempfile.mkdtemp(prefix="studio-code-")
        if as_root:
            os.chown(workdir, uid, gid)
        address_space = language.name != "typescript"
        policy = rlimits(limits, address_space=address_space)
        argv = language.command(self.settings, limits, in_container=False)
        t0 = time.monotonic()
        try:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=language.environment(self.settings, in_container=False),
                start_new_session=True,
                close_fds=True,
                user=uid if as_root else None,
                group=gid if as_root else None,
                extra_groups=[] if as_root else None,
                preexec_fn=_apply(policy) if sys.platform.startswith("linux") else None,
            )
        except OSError as e:
            shutil.rmtree(workdir, ignore_errors=True)
            raise RuntimeUnavailable(f"Could not start {argv[0]}: {e}.") from e
        with self._lock:
            self._children[job.job_id] = child
        started = time.monotonic()
        out = BoundedBuffer(limits.output_max_bytes + 4096)
        logs = BoundedBuffer(limits.log_max_bytes)
        assert child.stdin and child.stdout and child.stderr
        threads = [
            threading.Thread(target=_feed, args=(child.stdin, language.stdin_payload(job))),
            threading.Thread(target=_drain, args=(child.stdout, out)),
            threading.Thread(target=_drain, args=(child.stderr, logs)),
        ]
        for t in threads:
            t.daemon = True
            t.start()
        ending = "eof"
        try:
            rss_cap = None if address_space else limits.memory_bytes
            ending = _wait(child, started + limits.timeout_s, should_cancel, rss_cap)
        finally:
            # Always: whatever the code started in its session dies with it.
            _kill_group(child.pid)
            exit_code = child.wait()
            for t in threads:
                t.join(timeout=2)
            with self._lock:
                self._children.pop(job.job_id, None)
            shutil.rmtree(workdir, ignore_errors=True)
        if ending == "eof" and exit_code == -signal.SIGKILL and should_cancel is not None:
            ending = "cancel" if should_cancel() else ending  # killed by kill() elsewhere
        # RLIMIT_CPU's SIGXCPU is the backstop of the wall-clock deadline: also a timeout.
        cpu_limit = ending == "eof" and exit_code == -signal.SIGXCPU
        return RawRun(
            exit_code=exit_code,
            stdout=out.getvalue(),
            stdout_truncated=out.truncated,
            logs=logs.getvalue(),
            logs_total=logs.total,
            timed_out=ending == "deadline" or cpu_limit,
            oom_killed=ending == "memory",
            cancelled=ending == "cancel",
            start_ms=(started - t0) * 1000,
            run_ms=(time.monotonic() - started) * 1000,
        )

    def kill(self, job_id: str) -> bool:
        with self._lock:
            child = self._children.get(job_id)
        if child is None:
            return False
        _kill_group(child.pid)
        return True


_PROBE_LIMITS = Limits(
    memory_bytes=1, cpus=1, pids=1, timeout_s=1, log_max_bytes=1, output_max_bytes=1
)


def _apply(policy: dict[int, tuple[int, int]]):  # type: ignore[no-untyped-def]
    def set_limits() -> None:
        for which, value in policy.items():
            resource.setrlimit(which, value)

    return set_limits


def _wait(
    child: subprocess.Popen[bytes],
    deadline: float,
    should_cancel: CancelCheck | None,
    rss_cap: int | None = None,
) -> str:
    """Wait for the child's exit, the deadline, a cancel or (with ``rss_cap``) too much
    resident memory: "eof", "deadline", "cancel" or "memory".

    A pidfd wakes us the moment the child exits; Popen.wait(timeout) would poll with a
    back-off of up to 50 ms, which is most of a trivial node's cost. ``rss_cap`` is for Deno,
    which cannot run under RLIMIT_AS or RLIMIT_DATA (V8 reserves gigabytes of address space
    up front): V8's heap flag caps JavaScript objects, and this watch, every 20 ms, caps
    what the heap flag does not see (ArrayBuffers); it may overshoot by what can be touched
    in 20 ms."""
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        pidfd = None  # not Linux >= 5.3: poll
    step_max = RSS_POLL_S if rss_cap else POLL_S * 2
    try:
        while child.poll() is None:
            now = time.monotonic()
            if now >= deadline:
                return "deadline"
            if should_cancel is not None and should_cancel():
                return "cancel"
            if rss_cap is not None and _rss_bytes(child.pid) > rss_cap:
                return "memory"
            step = min(step_max, deadline - now)
            if pidfd is not None:
                select.select([pidfd], [], [], step)
            else:
                try:
                    child.wait(timeout=step)
                except subprocess.TimeoutExpired:
                    pass
        return "eof"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0  # gone, or not Linux


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _feed(pipe: IO[bytes], payload: bytes) -> None:
    try:
        pipe.write(payload)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _drain(pipe: IO[bytes], sink: BoundedBuffer) -> None:
    fd = pipe.fileno()
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        sink.write(chunk)
    pipe.close()
