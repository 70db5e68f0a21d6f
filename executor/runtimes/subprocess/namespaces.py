"""What keeps a non-root server's subprocess runs from the server and from each other.

A non-root server cannot give a run a uid of its own, so the kernel's other fences do it:

- ``make_undumpable``: the server process is not dumpable (``PR_SET_DUMPABLE`` 0), so its
  ``/proc/<pid>`` files belong to root and a same-uid run cannot read its ``environ`` or
  ``mem`` or ptrace it (the kernel asks for CAP_SYS_PTRACE in the user namespace of the
  server's memory). Inherited by fork (a Celery pool process), reset by execve (the runs).
  The server still reads its own ``/proc/self`` (stat, limits, fd: the kernel lets a
  thread group read its own fd directory), which is what prometheus-client reads.
- ``enter``: each run starts in its own user, PID and mount namespace with a private
  ``/proc``, where the kernel allows unprivileged user namespaces (``probe``). It keeps the
  server's uid (mapped onto itself), has no capability once it has exec'd, sees only its
  own processes, and the server, its other children and concurrent runs have no pid it can
  name: it cannot signal, trace or read them. In its mount namespace the server's own
  folders are covered before anything else runs (``fence``).

The process tree of a run, every process in the run's session and process group (one
``killpg`` from the server kills all three)::

    server
      └─ relay    the Popen child, in the server's PID namespace: waits for init, then
         │        ends the way the runner ended (its exit status, or the same signal)
         └─ init  PID 1 of the new namespace: reaps orphans; when the runner ends it exits,
            │     and the kernel kills whatever is left in the namespace (setsid() too)
            └─ runner  PID 2: the language's interpreter (exec)

A run killed from the server (its time limit, a cancel, a runner that is not used) loses its
relay at once and its init a moment later: the server holds a pidfd of the init
(``open_init``) and reports the end only once that init has exited (``wait_closed``), which
the kernel allows only when nothing else is left in the namespace.

The runner is not PID 1 because the kernel ignores, for a namespace's PID 1, every signal
it has no handler for sent from inside the namespace: ``os.kill(os.getpid(), SIGTERM)``,
``abort()`` and RLIMIT_CPU's SIGXCPU would not end it, and exit codes would change. Relay
and init are forks of the server (no exec, no new interpreter: the namespaces cost two forks
and a mount per run) with the server's signal handlers reset and its file descriptors
closed; they are not dumpable, so the runner cannot read them either.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
from typing import Any, Protocol

PR_SET_DUMPABLE = 4
PR_SET_PDEATHSIG = 1
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
#: init's exit status when it failed before reporting the runner's end (it never does)
INIT_FAILED = 125

#: kernel settings that refuse unprivileged user namespaces -> the value that refuses
KNOBS = {
    "/proc/sys/user/max_user_namespaces": "0",
    "/proc/sys/kernel/unprivileged_userns_clone": "0",
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns": "1",
}

try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
    _libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
except (OSError, AttributeError):
    _libc = None


class Cover(Protocol):
    """What ``enter`` is given to cover the server's folders (``fence.Plan``, which imports
    this module)."""

    def apply(self) -> None: ...


def _check(ret: int, what: str) -> int:
    if ret == -1:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def make_undumpable() -> bool:
    """Make this process not dumpable (see the module docstring); False off Linux."""
    if _libc is None or not sys.platform.startswith("linux"):
        return False
    return _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


def is_dumpable() -> bool:
    return _libc is not None and _libc.prctl(3, 0, 0, 0, 0) == 1  # PR_GET_DUMPABLE


def refusing_knob() -> str | None:
    """The kernel setting that refuses unprivileged user namespaces here, as name=value."""
    for path, refuses in KNOBS.items():
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value == refuses:
            return f"{path.removeprefix('/proc/sys/').replace('/', '.')}={value}"
    return None


def probe() -> str | None:
    """Start a trivial program the way a run starts; None when it came up as PID 2 of a
    namespace of its own, else why not (the kernel setting, or what failed)."""
    if _libc is None or not sys.platform.startswith("linux"):
        return "not Linux"
    knob = refusing_knob()
    if knob is not None:
        return f"the kernel refuses unprivileged user namespaces ({knob})"
    try:
        seen = subprocess.run(
            [sys.executable, "-S", "-I", "-c", "import os; print(os.getpid(), os.getuid())"],
            preexec_fn=enter,
            capture_output=True,
            timeout=30,
            start_new_session=True,
            env={},
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"the kernel refused a trial run in new namespaces ({e})"
    if seen.returncode != 0 or seen.stdout.split() != [b"2", str(os.getuid()).encode()]:
        return (
            "a trial run in new namespaces did not come up as PID 2 with the server's uid "
            f"(exit {seen.returncode}, saw {seen.stdout[:80]!r})"
        )
    return None


def enter(cover: Cover | None = None) -> None:
    """Between fork and exec of a run (the end of Popen's preexec_fn): make the namespaces,
    cover the server's folders in the new mount namespace (``cover``: ``fence``), fork
    init and the runner. Returns only in the runner; the relay and init never return
    (they ``_exit``), so nothing but the runner reaches the exec."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS), "unshare")
    # While the process is not dumpable its /proc files are root's, uid_map included: it is
    # dumpable for these three writes only, and no run can name its pid meanwhile.
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        maps = {"setgroups": "deny", "uid_map": f"{uid} {uid} 1", "gid_map": f"{gid} {gid} 1"}
        for name, line in maps.items():
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
    finally:
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    if cover is not None:
        cover.apply()
    _reset_signals()
    status_r, status_w = os.pipe()
    init = _check(_libc.fork(), "fork")
    if init:
        _relay(init, status_r, status_w)
    os.close(status_r)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the relay gone: all goes
    proc_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    _check(_libc.mount(b"proc", b"/proc", b"proc", proc_flags, None), "mount /proc")
    runner = _check(_libc.fork(), "fork")
    if runner:
        _init(runner, status_w)
    os.close(status_w)


def _reset_signals() -> None:
    # the server's Python handlers (a worker's SIGTERM) must never run in a copy of it
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass


def _close_all_but(keep: int) -> None:
    os.closerange(0, keep)
    os.closerange(keep + 1, 1 << 20)


def _init(runner: int, status_w: int) -> None:
    """PID 1: reap everything until the runner ends, pass its wait status to the relay."""
    try:
        _close_all_but(status_w)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == runner:
                break
        os.write(status_w, str(status).encode())
    except BaseException:
        os._exit(INIT_FAILED)
    os._exit(0)  # the kernel now kills what is left in the namespace


def _relay(init: int, status_r: int, status_w: int) -> None:
    """End the way the runner ended: its exit status, or death by the same signal."""
    try:
        os.close(status_w)
        _close_all_but(status_r)
        _, status = os.waitpid(init, 0)
        reported = os.read(status_r, 32)
        if reported:
            status = int(reported)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)  # a signal this process cannot die of (none is left)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    except BaseException:
        os._exit(INIT_FAILED)


def _first_child(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def runner_pid(relay: int) -> int | None:
    """The runner's pid in the server's namespace: the relay's child's first child."""
    init = _first_child(relay)
    return None if init is None else _first_child(init)


def open_init(relay: int) -> int | None:
    """A pidfd of the init of the run whose relay is ``relay`` (its only child), or None
    (not forked yet, gone, or no pidfd here). Opened before the run is killed: once the
    relay is dead its init is no longer found under it."""
    init = _first_child(relay)
    if init is None:
        return None
    try:
        fd = os.pidfd_open(init)
    except (AttributeError, OSError):
        return None
    try:  # the pid still names the relay's child: the pidfd holds that process
        with open(f"/proc/{init}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        ppid = None
    if ppid != relay:
        os.close(fd)
        return None
    return fd


def wait_closed(pidfd: int, timeout_s: float) -> bool:
    """Wait until the process of ``pidfd`` (a run's init) has exited, which the kernel
    allows only once every other process of its namespace is gone; closes ``pidfd``."""
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(pidfd)
