"""What a subprocess run used, read by the host: its per-run cgroup (cgroups.py) for the
memory peak and the processes, and the kernel's rusage of its process tree for the CPU.

- **memory, processes**: the run's cgroup (v1 ``memory.max_usage_in_bytes`` and
  ``pids.peak``; v2 ``memory.peak`` and ``pids.peak``), read after the run was killed and
  before the group is removed. Without a cgroup: ``ru_maxrss`` of the wait4 rusage, the
  largest single process of the tree (source ``rusage``), no processes figure.
- **CPU**: the child is reaped with ``wait4``, whose rusage is the child's user + system
  time and that of every descendant waited for in the tree (a pid namespace's init waits
  for all of them). ``_wait`` therefore checks the child's exit without reaping it
  (``exited``), and ``reap`` does the one reap.

A pre-started runner's interpreter start is not its job's: ``hand_over`` reads its CPU time
so far (/proc/<pid>/stat, in clock ticks: 10 ms steps) and, on cgroup v1, resets the
group's memory peak to its current usage (the idle interpreter's memory stays in).
``STUDIO_CODE_USAGE=0`` (``Settings.code_usage``, passed by the runtime as ``on``): nothing
is read (usage null).
"""

from __future__ import annotations

import os
import resource
import subprocess
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor.models import Usage
from executor.runtimes.subprocess.cgroups import RunCgroup

if TYPE_CHECKING:
    from executor.runtimes.subprocess.prestarted import Runner

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: the rusage of each child reaped by ``reap``
_rusage: weakref.WeakKeyDictionary[subprocess.Popen[bytes], resource.struct_rusage] = (
    weakref.WeakKeyDictionary()
)


def exited(child: subprocess.Popen[bytes]) -> bool:
    """Has ``child`` ended? Without reaping it (its rusage is read when ``reap`` does)."""
    if child.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return child.poll() is not None  # reaped elsewhere: Popen knows its status


def reap(child: subprocess.Popen[bytes]) -> int:
    """Wait for ``child`` (killed) and reap it with its rusage; returns its exit status as
    Popen says it (``-signal`` for a signal)."""
    if child.returncode is not None:
        return child.returncode
    try:
        _, status, ru = os.wait4(child.pid, 0)
    except ChildProcessError:
        return child.wait()  # reaped elsewhere
    child.returncode = os.waitstatus_to_exitcode(status)
    _rusage[child] = ru
    return child.returncode


@dataclass
class Baseline:
    """What a runner had used when its job was handed over."""

    cpu_ms: float = 0.0


def hand_over(runner: Runner, *, on: bool) -> Baseline:
    """At the start of a job: a pre-started runner's CPU so far, and its peak reset (``on``:
    usage is read, STUDIO_CODE_USAGE)."""
    if not runner.prestarted or not on:
        return Baseline()
    pid, group = runner.runner_pid(), runner.group
    cpu_ms = 0.0
    if pid is not None:
        cpu_ms = _cpu_so_far_ms(pid)
    if group is not None and group.version == 1:
        try:
            (group.dirs["memory"] / "memory.max_usage_in_bytes").write_bytes(b"0")
        except OSError:
            pass  # not ours to write: the peak counts the start
    return Baseline(cpu_ms)


def measure(
    child: subprocess.Popen[bytes], group: RunCgroup | None, base: Baseline, *, on: bool
) -> Usage | None:
    """After ``reap``, before the group is removed: what the run used (None: not read, or
    not ``on``: STUDIO_CODE_USAGE=0)."""
    if not on:
        return None
    ru = _rusage.pop(child, None)
    cpu_ms = None
    if ru is not None:
        cpu_ms = round(max(0.0, (ru.ru_utime + ru.ru_stime) * 1000 - base.cpu_ms), 3)
    memory = pids = None
    source = "rusage"
    if group is not None:
        if group.version == 1:
            memory = _int(group.dirs["memory"] / "memory.max_usage_in_bytes")
            pids = _int(group.dirs["pids"] / "pids.peak") if "pids" in group.dirs else None
        else:
            memory = _int(group.dirs[""] / "memory.peak")
            pids = _int(group.dirs[""] / "pids.peak")
        if memory is not None:
            source = f"cgroup-v{group.version}"
    if memory is None and ru is not None:
        memory = ru.ru_maxrss * 1024  # KiB on Linux: the largest process, not the sum
    if memory is None and cpu_ms is None:
        return None
    return Usage(
        memory_peak_bytes=memory,
        cpu_ms=cpu_ms,
        pids_peak=pids,
        source=source,  # type: ignore[arg-type]
        cpu_source="rusage" if source != "rusage" and cpu_ms is not None else None,
    )


def _cpu_so_far_ms(pid: int) -> float:
    """The CPU time ``pid`` used so far: /proc/<pid>/schedstat's run time in ns (what its
    rusage is made from), else /proc/<pid>/stat's utime + stime in clock ticks."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e6
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1000 / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def _int(path: os.PathLike[str]) -> int | None:
    try:
        with open(path, "rb") as f:
            return int(f.read(64))
    except (OSError, ValueError):
        return None
