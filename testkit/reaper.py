"""What a test or a bench starts ends with it, however it ends.

Two parts:

* ``stop_on_sigterm()``: a SIGTERM raises (``SystemExit`` in a bench, ``KeyboardInterrupt``
  in pytest) in the main thread, so every ``with`` block and ``finally`` clause on the way
  out stops what it started, in order (the workers before their Redis), as on Ctrl-C;
* the reaper: one watchdog process per process that starts a service (``own(pid)`` when it
  starts one, ``disown(pid)`` when it stopped it). It reads a pipe whose only writer is that
  process; the pipe's end (EOF) is that process's end, whatever ended it (a return, an
  exception, SIGTERM, SIGKILL, an OOM kill). Then it sends each service still running its
  stop signal (the one a clean stop sends: SIGTERM, SIGINT for PostgreSQL's fast shutdown),
  the last started first, waits for each, SIGKILLs what is left of their process trees and
  removes the folders they were owned with (a cluster's, an engine's).

Processes are named by pid AND start time (``/proc/<pid>/stat``), so a pid reused after a
service ended is never signalled; nothing is looked up by name.

Why not PR_SET_PDEATHSIG on the children: it fires when the THREAD that started the child
ends (a service started from a helper thread would die with that thread), a fork clears it
(``pg_ctl`` starts the postmaster through a fork, so the postmaster would not have it), so
does a change of uid (``runuser -u postgres``), and it kills only the direct child (a
dockerd's containerd and a worker's pool processes would be left).

This file is also the watchdog's program (``python reaper.py``): standard library only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

#: how long the reaper waits for a service to stop on its stop signal (and for them all)
#: before SIGKILL
GRACE_S = 30.0
BUDGET_S = 120.0


# --- processes by pid and start time --------------------------------------------------------


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, read from /proc."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += children(p)
    return seen


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot; with the pid it names one process),
    None when there is no such process or it is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


# --- the owner's side -----------------------------------------------------------------------

_lock = threading.Lock()
_pipe: int | None = None  # the write end (None in a forked child: it is no owner)
_owned: dict[int, str] = {}  # pid -> the line that told the watchdog
_PROGRAM = os.path.abspath(__file__)  # this file, wherever the owner's cwd goes later
#: the watchdogs started (a forked child keeps its parent's in the list, never waits for it)
_watchdogs: list[subprocess.Popen[bytes]] = []


def _forget_in_child() -> None:
    """A forked child is not the owner: it closes its copy of the write end (else the
    reaper would wait for it too) and starts a reaper of its own if it starts a service."""
    global _pipe, _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    if _pipe is not None:
        try:
            os.close(_pipe)
        except OSError:
            pass
    _pipe = None
    _owned.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _start_watchdog() -> None:
    global _pipe
    read, write = os.pipe()  # both close-on-exec: no other program inherits them
    watchdog = subprocess.Popen(
        [sys.executable, "-S", "-I", _PROGRAM],
        stdin=read,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the owner's process group: it outlives it
    )
    os.close(read)
    _watchdogs.append(watchdog)
    _pipe = write
    for line in _owned.values():  # a watchdog started again (one ended) learns them all
        os.write(write, line.encode())


def _send(pid: int, line: str | None) -> None:
    """``line`` (None: forget ``pid``) to this process's watchdog, started on first use
    (it learns every pid owned then, this one too)."""
    global _pipe
    with _lock:
        if line is None:
            _owned.pop(pid, None)
        else:
            _owned[pid] = line
        if _pipe is None:  # (a forked child's is None: see _forget_in_child)
            if line is not None:
                _start_watchdog()
            return
        try:
            os.write(_pipe, (line or json.dumps({"disown": pid}) + "\n").encode())
        except OSError:  # its watchdog ended (killed by hand?): a new one takes them all
            os.close(_pipe)
            _pipe = None
            _start_watchdog()


def own(pid: int, stop_signal: int = signal.SIGTERM, *, remove: str | Path | None = None) -> None:
    """Process ``pid`` (a service this process started) ends when this process ends: the
    reaper sends it ``stop_signal`` then, SIGKILLs what is left of its tree, and removes its
    folder ``remove`` (if given) once it is gone."""
    start = started(pid)
    if start is not None:
        message: dict[str, object] = {"own": pid, "start": start, "signal": int(stop_signal)}
        if remove is not None:
            message["remove"] = str(remove)
        _send(pid, json.dumps(message) + "\n")


def disown(pid: int) -> None:
    """Process ``pid`` was stopped (or handed on): the reaper forgets it."""
    if pid in _owned:
        _send(pid, None)


def stop_on_sigterm(raising: Callable[[], BaseException] | None = None) -> None:
    """A SIGTERM raises ``raising()`` (``SystemExit(143)`` unless told) in the main thread,
    once: a second SIGTERM ends the process at once (the reaper still stops its services).
    Called from another thread, or where SIGTERM has a handler already, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def raise_on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise raising() if raising is not None else SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, raise_on_sigterm)


# --- the watchdog ---------------------------------------------------------------------------


def _kill(pid: int, start: int, sig: int) -> None:
    if started(pid) == start:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _tree_of(pid: int) -> dict[int, int]:
    return {p: s for p in process_tree(pid) if (s := started(p)) is not None}


def _remove(folder: str) -> None:
    """``folder`` removed, never through a live mount (a dockerd's data-root)."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    if not any(m == folder or m.startswith(folder + "/") for m in mounts):
        shutil.rmtree(folder, ignore_errors=True)


def reap(owned: dict[int, dict], grace_s: float = GRACE_S, budget_s: float = BUDGET_S) -> None:
    """Stop each of ``owned`` (pid -> {"start", "signal", "remove"}) still running, the last
    owned first (the workers before their Redis, as the owner's ``with`` blocks would):
    its stop signal, up to ``grace_s`` for it to end (``budget_s`` for them all); then
    SIGKILL to what is left of their trees (as they were before and after the stop), and
    the folders to ``remove`` of those that ended."""
    live = {pid: v for pid, v in owned.items() if started(pid) == v["start"]}
    tree: dict[int, int] = {}
    end_by = time.monotonic() + budget_s
    for pid, v in reversed(live.items()):
        tree.update(_tree_of(pid))
        _kill(pid, v["start"], v["signal"])
        deadline = min(end_by, time.monotonic() + grace_s)
        while started(pid) == v["start"] and time.monotonic() < deadline:
            time.sleep(0.05)
        if started(pid) == v["start"]:
            tree.update(_tree_of(pid))
    for pid, start in tree.items():
        _kill(pid, start, signal.SIGKILL)
    time.sleep(0.5)  # the kernel's reaping of what it killed
    for pid, v in owned.items():
        if v.get("remove") and started(pid) != v["start"]:
            _remove(v["remove"])


def watch() -> None:
    """The watchdog: the owner's messages on stdin until its end, then ``reap``."""
    owned: dict[int, dict] = {}
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if "own" in message:
            owned.pop(message["own"], None)  # a reused pid owned again goes last
            owned[message["own"]] = message
        elif "disown" in message:
            owned.pop(message["disown"], None)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it finishes its work
    reap(owned)


if __name__ == "__main__":
    watch()
