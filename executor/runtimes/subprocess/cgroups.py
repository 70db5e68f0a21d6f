"""A cgroup per subprocess run: memory and pids limits the whole run shares, and one kill
for everything in it.

rlimits are per process (memory) or per uid (processes), and they miss what a run keeps
outside its processes: ``tmpfs`` and ``/dev/shm`` pages are charged to the memory cgroup of
the process that touched them, so only a cgroup limit stops 5 x 60 MB written to
``/dev/shm`` under a 256 MB limit. And a process cannot leave its cgroup without write
access to another one's ``cgroup.procs``, so killing every process of the group at the end
of the run catches a grandchild that called ``setsid()``.

Where the groups go (STUDIO_CODE_SUBPROCESS_CGROUP):

- ``auto``: under the server's own cgroup, in ``studio-code/``. cgroup v1 (``memory`` and
  ``pids`` hierarchies mounted): ``<mount>/<own path>/studio-code/<run>`` per controller.
  cgroup v2: ``<own path>/studio-code/<run>``; this needs ``memory`` and ``pids`` enabled
  in the own cgroup's ``cgroup.subtree_control``, which the kernel refuses (EBUSY) when the
  own cgroup holds processes and is not the root: then use a path.
- a path such as ``/studio-code``: a cgroup (relative to the hierarchy's root) made for
  the server, e.g. by systemd ``Delegate=yes`` or by hand; runs go right under it.
- ``off``: no cgroup.

``find_parent`` proves the place at start-up by making and removing a probe group; when it
cannot, runs go on without one and meta and the start-up warning say what that loses.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"
OWN_CGROUP = "/proc/self/cgroup"
CONTROLLERS = ("memory", "pids")
SUBDIR = "studio-code"


class CgroupError(Exception):
    """Raised when a run's cgroup cannot be made or set up (the run goes on without)."""


@dataclass(frozen=True)
class CgroupParent:
    """Where this process makes run cgroups: one directory (v2) or one per controller (v1)."""

    version: int
    dirs: dict[str, Path]  # v1: {"memory": ..., "pids": ...}; v2: {"": ...}

    def describe(self) -> str:
        where = ", ".join(f"{c} at {p}" if c else str(p) for c, p in self.dirs.items())
        return f"cgroup v{self.version} ({where})"

    def create(self, name: str, memory_bytes: int, pids: int) -> RunCgroup:
        """Make (or, left by a dead run of the same name, remake) the group ``name`` with
        its limits. Raises CgroupError."""
        group = RunCgroup(self.version, {c: p / name for c, p in self.dirs.items()})
        if any(d.exists() for d in group.dirs.values()):
            group.kill_all()
            group.remove()
        try:
            for d in group.dirs.values():
                d.mkdir()
            if self.version == 2:
                d = group.dirs[""]
                _write(d / "memory.max", memory_bytes)
                _write(d / "pids.max", pids)
                _write(d / "memory.swap.max", 0, optional=True)
                _write(d / "memory.oom.group", 1, optional=True)
            else:
                mem = group.dirs["memory"]
                _write(mem / "memory.limit_in_bytes", memory_bytes)
                # swap equal to memory, as the Docker sandboxes have it: none on top
                _write(mem / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                _write(group.dirs["pids"] / "pids.max", pids)
        except OSError as e:
            group.remove()
            raise CgroupError(f"could not set up the run's cgroup {name}: {e}") from e
        return group


@dataclass
class RunCgroup:
    """One run's cgroup (v1: the same name in each controller's hierarchy)."""

    version: int
    dirs: dict[str, Path]

    @property
    def procs_files(self) -> list[str]:
        """The files a child writes its pid to (before exec) to join the group."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def oom_kills(self) -> int:
        """How many processes of the group the kernel killed for memory."""
        d = self.dirs.get("") or self.dirs.get("memory")
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (d / name).read_text().splitlines():  # type: ignore[operator]
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError, TypeError):
            pass
        return 0

    def kill_all(self, timeout_s: float = 2.0) -> bool:
        """SIGKILL everything in the group, until it is empty (True) or ``timeout_s``.

        v2 has cgroup.kill (Linux 5.14), one kernel pass that forks cannot race. Otherwise
        each pass kills every member it lists; a member forked meanwhile is listed by the
        next pass (a killed process cannot fork any more), and pids.max bounds them all."""
        if self.version == 2:
            try:
                _write(self.dirs[""] / "cgroup.kill", 1)
            except OSError:
                pass  # older kernel: the loop below does it
        deadline = time.monotonic() + timeout_s
        while True:
            members = self.pids()
            if not members:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.002)

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Remove the group's directories; True when they are gone. A dying member keeps
        a group busy for a moment, so this retries until ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        ok = True
        for d in self.dirs.values():
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        ok = False
                        break
                    time.sleep(0.005)
        return ok


def find_parent(setting: str) -> tuple[CgroupParent | None, str]:
    """Where this process can make run cgroups per STUDIO_CODE_SUBPROCESS_CGROUP, proven
    by making and removing a probe group: (parent, description) or (None, why not)."""
    if setting == "off":
        return None, "STUDIO_CODE_SUBPROCESS_CGROUP=off"
    if not os.path.exists(OWN_CGROUP):
        return None, "this system has no cgroups (not Linux)"
    try:
        parent = _locate(setting)
        probe = parent.create(f"probe-{os.getpid()}", 64 * 1024 * 1024, 8)
        if not probe.remove():
            raise CgroupError(f"could not remove the probe cgroup {probe.dirs}")
    except (CgroupError, OSError) as e:
        return None, str(e)
    return parent, parent.describe()


def _locate(setting: str) -> CgroupParent:
    v1: dict[str, tuple[str, str]] = {}
    v2: tuple[str, str] | None = None
    with open(MOUNTINFO) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            root, mount = _unescape(fields[3]), _unescape(fields[4])
            if tail[0] == "cgroup2" and v2 is None:
                v2 = (root, mount)
            elif tail[0] == "cgroup":
                for opt in tail[2].split(","):
                    if opt in CONTROLLERS:
                        v1.setdefault(opt, (root, mount))
    own_v1: dict[str, str] = {}
    own_v2 = None
    with open(OWN_CGROUP) as f:
        for line in f:
            hid, _, rest = line.rstrip("\n").partition(":")
            ctrls, _, path = rest.partition(":")
            if hid == "0" and ctrls == "":
                own_v2 = path
            for c in ctrls.split(","):
                if c in CONTROLLERS:
                    own_v1[c] = path
    explicit = setting not in ("", "auto")
    if all(c in v1 for c in CONTROLLERS):
        dirs = {}
        for c in CONTROLLERS:
            root, mount = v1[c]
            rel = setting if explicit else _relative(own_v1.get(c, "/"), root)
            base = Path(mount) / rel.lstrip("/")
            dirs[c] = base if explicit else base / SUBDIR
        if not explicit:
            for d in dirs.values():
                _mkdir(d)
        return CgroupParent(1, dirs)
    if v2 is None:
        raise CgroupError(
            "neither the cgroup v1 memory and pids hierarchies nor cgroup v2 are mounted"
        )
    root, mount = v2
    base = Path(mount) / (setting if explicit else _relative(own_v2 or "/", root)).lstrip("/")
    available = _read(base / "cgroup.controllers").split()
    missing = [c for c in CONTROLLERS if c not in available]
    if missing:
        raise CgroupError(
            f"cgroup v2 at {base} does not offer the {', '.join(missing)} controller(s)"
        )
    _enable(base)
    if explicit:
        return CgroupParent(2, {"": base})
    parent = base / SUBDIR
    _mkdir(parent)
    _enable(parent)
    return CgroupParent(2, {"": parent})


def _enable(d: Path) -> None:
    enabled = _read(d / "cgroup.subtree_control").split()
    todo = [c for c in CONTROLLERS if c not in enabled]
    if not todo:
        return
    try:
        _write(d / "cgroup.subtree_control", " ".join(f"+{c}" for c in todo))
    except OSError as e:
        hint = (
            " (the kernel refuses while that cgroup holds processes itself: set "
            "STUDIO_CODE_SUBPROCESS_CGROUP to a cgroup made for the server, e.g. with "
            "systemd Delegate=yes)"
            if e.errno == errno.EBUSY
            else ""
        )
        raise CgroupError(f"could not enable {', '.join(todo)} in {d}: {e}{hint}") from e


def _mkdir(d: Path) -> None:
    try:
        d.mkdir(exist_ok=True)
    except OSError as e:
        raise CgroupError(f"could not create {d}: {e}") from e


def _relative(path: str, root: str) -> str:
    if root != "/" and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def _unescape(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise CgroupError(f"could not read {path}: {e}") from e


def _write(path: Path, value: object, *, optional: bool = False) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if optional:
            return
        raise
    try:
        os.write(fd, str(value).encode())
    except OSError:
        if not optional:
            raise
    finally:
        os.close(fd)
