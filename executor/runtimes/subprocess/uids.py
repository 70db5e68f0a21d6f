"""One uid per subprocess run, for a root server: leases from STUDIO_CODE_SUBPROCESS_UIDS.

Under a root server every run used to run as nobody, so runs shared RLIMIT_NPROC (counted
per uid), could read each other's ``/proc/<pid>/mem`` and ``environ``, signal each other,
and read each other's files. A run now holds a uid (gid = the same number, no
supplementary group) that no other run on this host holds while it runs:

- **Across processes**: a lease is an exclusive ``flock`` on ``<LOCK_DIR>/<uid>.lock``, held
  from before the child starts until its uid has no process and no file left. The kernel
  drops it when the holder dies, so a killed worker never leaks a uid.
- **A dead holder's leftovers**: the lock file says ``busy`` while a run holds it and
  ``clean`` once the run's leftovers are gone; whoever takes a ``busy`` uid first kills
  every process of that uid and removes its files (``scrub``).

``kill_uid`` kills every process of a uid at once: a helper that runs AS that uid calls
``kill(-1, SIGKILL)``, which the kernel delivers to every process the sender may signal
(its own uid) in one pass under the task list lock, so a process forking meanwhile
cannot slip through. ``remove_owned_files`` then takes away every file the uid left in
the world-writable temporary folders, and ``remove_owned_ipc`` its System V shared memory,
semaphores and message queues (which outlive processes too).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from executor.errors import RuntimeUnavailable

LOCK_DIR = Path("/run/studio-code/uids")
#: where any uid may create files that outlive its processes (sticky, world-writable)
SWEPT_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
#: deeper directories are moved up to the top of their folder and swept from there, so a
#: hostile tree of any depth costs a bounded number of open descriptors and stack frames
SWEEP_MAX_DEPTH = 32
SWEEP_PARKING = ".studio-code-sweep-"
#: the lock file's whole content, the same length so no truncate is needed
MARK_BUSY, MARK_CLEAN = b"busy \n", b"clean\n"


@dataclass
class UidLease:
    """One uid held by this process for one run (gid is the same number)."""

    uid: int
    gid: int
    fd: int
    was_dirty: bool

    def release(self) -> None:
        """Mark the uid clean and drop the lock. Call only once the uid has no process
        and no file left."""
        try:
            os.pwrite(self.fd, MARK_CLEAN, 0)
        finally:
            os.close(self.fd)  # drops the flock


class UidPool:
    """Hands out uids of a range, one run at a time per uid, across every process of the
    host that uses the same LOCK_DIR."""

    def __init__(self, ids: range, lock_dir: Path = LOCK_DIR) -> None:
        self.ids = ids
        self.lock_dir = lock_dir
        self._lock = threading.Lock()

    def acquire(self) -> UidLease:
        """Lease a free uid of the range; raises RuntimeUnavailable when every uid is held."""
        try:
            self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise RuntimeUnavailable(
                f"Could not create {self.lock_dir} for the subprocess runs' uid leases ({e}): "
                "run the server as root with a writable /run."
            ) from e
        n = len(self.ids)
        start = random.randrange(n)  # spreads processes over the range: fewer busy probes
        with self._lock:
            for i in range(n):
                uid = self.ids[(start + i) % n]
                lease = self._try(uid)
                if lease is not None:
                    return lease
        raise RuntimeUnavailable(
            f"All {n} uids of STUDIO_CODE_SUBPROCESS_UIDS={self.ids[0]}-{self.ids[-1]} are "
            "held by running Code nodes: widen the range or lower the concurrency."
        )

    def _try(self, uid: int) -> UidLease | None:
        path = self.lock_dir / f"{uid}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        try:
            dirty = os.pread(fd, len(MARK_BUSY), 0) == MARK_BUSY
            # no fsync: the mark must outlive its process, not the machine (a reboot
            # leaves no process of the uid behind)
            os.pwrite(fd, MARK_BUSY, 0)
        except BaseException:
            os.close(fd)
            raise
        return UidLease(uid=uid, gid=uid, fd=fd, was_dirty=dirty)


def kill_uid(uid: int, gid: int) -> None:
    """SIGKILL every process whose uid is ``uid``, in one kernel pass (see the module
    docstring). Only when that helper cannot run, a slower scan of /proc kills them one by
    one until none is left (at most 2 s)."""
    try:
        # The helper never execs: Popen forks, drops to the uid (user=, group=), and the
        # preexec hook, which runs after the drop, sends the signal and exits. No kill(1)
        # binary and its dialect of options; no Python fork() in a threaded process.
        helper = subprocess.Popen(
            [sys.executable],
            user=uid,
            group=gid,
            extra_groups=[],
            env={},
            close_fds=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_kill_all_of_my_uid,
        )
        if helper.wait(timeout=10) == 0:
            return
    except (OSError, subprocess.SubprocessError):
        pass
    deadline = time.monotonic() + 2
    while True:
        left = pids_of_uid(uid)
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def _kill_all_of_my_uid() -> None:
    code = 0
    try:
        os.kill(-1, 9)  # every process this uid may signal, except this one
    except ProcessLookupError:
        pass  # none was left
    except OSError:
        code = 1
    os._exit(code)


def pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        try:
            real_uid = int(fields[b"Uid"].split()[0])
        except (KeyError, IndexError, ValueError):
            continue
        if real_uid == uid and not fields.get(b"State", b"").strip().startswith(b"Z"):
            found.append(int(name))
    return found


def remove_owned_files(uid: int, roots: Iterable[str] = SWEPT_DIRS) -> int:
    """Remove every entry owned by ``uid`` under ``roots``; returns how many.

    Only what ``uid`` owns goes: a directory of the uid that holds another uid's entry
    stays (with that entry). Symbolic links are removed, never followed; other file
    systems mounted below a root are not entered. A directory is entered only when the uid
    could have written in it: it owns it, or it is world-writable (ACLs are not read);
    another uid's world-writable directory is entered down to SWEEP_MAX_DEPTH levels only.
    Meant for a uid with no process left: nothing of the uid changes under the walk."""
    removed = 0
    for root in roots:
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            dev = os.fstat(fd).st_dev
            removed += _sweep(fd, fd, uid, dev, 0)
            # directories parked at the top of ``root`` by a walk that went too deep
            done: set[str] = set()
            while True:
                parked = [
                    n
                    for n in os.listdir(fd)
                    if n.startswith(f"{SWEEP_PARKING}{uid}-") and n not in done
                ]
                if not parked:
                    break
                for name in parked:
                    done.add(name)
                    removed += _sweep_dir(fd, fd, name, uid, dev, 0)
        finally:
            os.close(fd)
    return removed


def _sweep(root_fd: int, dir_fd: int, uid: int, dev: int, depth: int) -> int:
    removed = 0
    entries: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(dir_fd) as it:
            for e in it:
                try:
                    entries.append((e.name, e.stat(follow_symlinks=False)))
                except OSError:
                    continue  # gone since the listing (a shared /tmp changes all along)
    except OSError:
        return 0
    for name, st in entries:
        if stat.S_ISDIR(st.st_mode):
            if st.st_dev != dev or not (st.st_uid == uid or st.st_mode & 0o002):
                continue
            if depth >= SWEEP_MAX_DEPTH:
                if st.st_uid == uid:  # ours: moved up, swept from the top
                    parked = f"{SWEEP_PARKING}{uid}-{os.getpid()}-{st.st_ino}"
                    try:
                        os.rename(name, parked, src_dir_fd=dir_fd, dst_dir_fd=root_fd)
                    except OSError:
                        pass
                # another uid's world-writable chain this deep is not entered (it could be
                # endless): what this uid left down there stays, a stated limit
                continue
            removed += _sweep_dir(root_fd, dir_fd, name, uid, dev, depth + 1, st)
        elif st.st_uid == uid:
            try:
                os.unlink(name, dir_fd=dir_fd)
                removed += 1
            except OSError:
                pass
    return removed


def _sweep_dir(
    root_fd: int,
    parent_fd: int,
    name: str,
    uid: int,
    dev: int,
    depth: int,
    expected: os.stat_result | None = None,
) -> int:
    try:
        sub = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd
        )
    except OSError:
        return 0
    try:
        st = os.fstat(sub)
        if expected is not None and (st.st_ino, st.st_dev) != (expected.st_ino, expected.st_dev):
            return 0  # swapped between the look and the open: leave it
        if st.st_dev != dev:
            return 0
        removed = _sweep(root_fd, sub, uid, dev, depth)
    finally:
        os.close(sub)
    if st.st_uid == uid:
        try:
            os.rmdir(name, dir_fd=parent_fd)
            removed += 1
        except OSError:
            pass  # holds an entry of another uid: that one is not ours to remove
    return removed


IPC_RMID = 0
#: /proc/sysvipc file -> the column of the object's id
SYSV_IPC = {"shm": "shmid", "sem": "semid", "msg": "msqid"}


def remove_owned_ipc(uid: int) -> int:
    """Remove every System V IPC object (shared memory, semaphore set, message queue) that
    ``uid`` owns or created; returns how many. Pages of a segment stay charged to memory
    until it is removed, and the next run of another uid could attach a 0666 one."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    remove = {
        "shm": lambda i: libc.shmctl(i, IPC_RMID, None),
        "sem": lambda i: libc.semctl(i, 0, IPC_RMID),
        "msg": lambda i: libc.msgctl(i, IPC_RMID, None),
    }
    removed = 0
    for kind, id_column in SYSV_IPC.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = f.read().splitlines()
        except OSError:
            continue
        names = header.split()
        for row in rows:
            values = dict(zip(names, row.split(), strict=False))
            try:
                owners = {int(values["uid"]), int(values["cuid"])}
                ipc_id = int(values[id_column])
            except (KeyError, ValueError):
                continue
            if uid in owners and remove[kind](ipc_id) == 0:
                removed += 1
    return removed
