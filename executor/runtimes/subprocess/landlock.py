"""Landlock for subprocess runs: a run may write only beneath its own temporary folder.

Without it a run may write every file its uid may: under a non-root server that is every
file of the server's user (the SQLite run store, the data folder, ``secret.key``, its home);
under a root server every world-writable file and folder (``/tmp``, ``/dev/shm``). Landlock
(Linux >= 5.13, ``CONFIG_SECURITY_LANDLOCK`` and ``landlock`` in the boot's LSM list) lets
an unprivileged process give up rights for itself and everything it starts, for good:

- **Files** (every ABI): every write-ish right the kernel's ABI knows is *handled*
  (``WRITE_FILE``, ``REMOVE_DIR``, ``REMOVE_FILE``, ``MAKE_*``; ``REFER`` from ABI 2,
  ``TRUNCATE`` from 3, ``IOCTL_DEV`` from 5) and allowed only beneath the run's folder, plus
  writing ``/dev/null`` and ``/dev/zero``. Reading and executing are not handled: the
  interpreter loads its libraries, and the run reads what its uid may read. Nor does any
  ABI have a right for a file's mode, owner, times, extended attributes or locks: what
  keeps a run from those of the server's files is ``fence`` (they are hidden). Descriptors open
  before (stdin, stdout, stderr: pipes) are not affected. A handled right also takes
  ``mount(2)``/``pivot_root(2)`` away from the run.
- **Processes** (every ABI): the run cannot ptrace, or read the ``environ``/``mem`` of, any
  process outside its own domain (its run).
- **Scopes** (ABI >= 6): it cannot signal a process outside its run
  (``LANDLOCK_SCOPE_SIGNAL``) nor connect to an abstract Unix socket made outside it
  (``LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET``).

The network is not handled (a subprocess run keeps it: it is not a sandbox).

The ruleset is made in the server, before the fork (``ruleset``: three syscalls and two
``open(O_PATH)``), and only ``landlock_restrict_self`` runs in the child between fork and
exec (``restrict``), after the namespaces are made (a Landlock domain may not mount
``/proc``) and after ``no_new_privs``, which the kernel requires of an unprivileged caller.
At start-up ``probe`` proves it in a throwaway thread (no process started).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

#: the three syscalls, the same numbers on x86_64 and aarch64 (the generic table)
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

ACCESS_FS_EXECUTE = 1 << 0
ACCESS_FS_WRITE_FILE = 1 << 1
ACCESS_FS_READ_FILE = 1 << 2
ACCESS_FS_READ_DIR = 1 << 3
ACCESS_FS_REMOVE_DIR = 1 << 4
ACCESS_FS_REMOVE_FILE = 1 << 5
ACCESS_FS_MAKE_CHAR = 1 << 6
ACCESS_FS_MAKE_DIR = 1 << 7
ACCESS_FS_MAKE_REG = 1 << 8
ACCESS_FS_MAKE_SOCK = 1 << 9
ACCESS_FS_MAKE_FIFO = 1 << 10
ACCESS_FS_MAKE_BLOCK = 1 << 11
ACCESS_FS_MAKE_SYM = 1 << 12
ACCESS_FS_REFER = 1 << 13  # ABI 2
ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
ACCESS_FS_IOCTL_DEV = 1 << 15  # ABI 5
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6

#: the write-ish rights of ABI 1, then what each later ABI adds
WRITE_ABI1 = (
    ACCESS_FS_WRITE_FILE
    | ACCESS_FS_REMOVE_DIR
    | ACCESS_FS_REMOVE_FILE
    | ACCESS_FS_MAKE_CHAR
    | ACCESS_FS_MAKE_DIR
    | ACCESS_FS_MAKE_REG
    | ACCESS_FS_MAKE_SOCK
    | ACCESS_FS_MAKE_FIFO
    | ACCESS_FS_MAKE_BLOCK
    | ACCESS_FS_MAKE_SYM
)
WRITE_SINCE = {2: ACCESS_FS_REFER, 3: ACCESS_FS_TRUNCATE, 5: ACCESS_FS_IOCTL_DEV}
#: rights a rule on a file (not a folder) may carry
FILE_RIGHTS = (
    ACCESS_FS_EXECUTE
    | ACCESS_FS_WRITE_FILE
    | ACCESS_FS_READ_FILE
    | ACCESS_FS_TRUNCATE
    | ACCESS_FS_IOCTL_DEV
)
#: the files every run may still open for writing (outside its folder)
WRITABLE_FILES = ("/dev/null", "/dev/zero")
SCOPES_SINCE = 6


class RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),  # ABI 4
        ("scoped", ctypes.c_uint64),  # ABI 6
    ]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
    _syscall: Any = _libc.syscall
    _syscall.restype = ctypes.c_long
    _prctl: Any = _libc.prctl
except (OSError, AttributeError):
    _libc = _syscall = _prctl = None


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def abi_version() -> tuple[int, str | None]:
    """The Landlock ABI this kernel offers (0: none) and, when none, why not."""
    if not sys.platform.startswith("linux") or _syscall is None:
        return 0, "not Linux"
    if os.uname().machine not in ("x86_64", "aarch64"):
        return 0, f"not known on {os.uname().machine} (only x86_64 and aarch64 are)"
    abi = _syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), CREATE_RULESET_VERSION)
    if abi >= 1:
        return int(abi), None
    e = ctypes.get_errno()
    if e == errno.EOPNOTSUPP:
        return 0, (
            "the kernel has Landlock but it is off (add landlock to the lsm= boot parameter "
            "or CONFIG_LSM)"
        )
    return 0, (
        "the kernel has no Landlock (Linux before 5.13, built without it, or a seccomp "
        f"filter such as a container's refuses its syscalls: {os.strerror(e)})"
    )


def handled_fs(abi: int) -> int:
    """The write-ish rights ABI ``abi`` knows: all of them are handled."""
    rights = WRITE_ABI1
    for since, right in WRITE_SINCE.items():
        if abi >= since:
            rights |= right
    return rights


def scopes(abi: int) -> int:
    return SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET if abi >= SCOPES_SINCE else 0


def ruleset(abi: int, folder: str) -> int:
    """A ruleset (its fd, close-on-exec) that allows writing beneath ``folder`` and the
    WRITABLE_FILES only, with the scopes of ``abi``. Made by the server before the fork."""
    handled = handled_fs(abi)
    attr = RulesetAttr(handled, 0, scopes(abi))
    size = 8 if abi < 4 else 16 if abi < SCOPES_SINCE else 24  # the struct this ABI knows
    fd = _check(
        _syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0),
        "landlock_create_ruleset",
    )
    try:
        _allow(fd, folder, handled, directory=True)
        for path in WRITABLE_FILES:
            if os.path.exists(path):
                _allow(fd, path, handled & FILE_RIGHTS & ~ACCESS_FS_IOCTL_DEV, directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _allow(ruleset_fd: int, path: str, rights: int, *, directory: bool) -> None:
    flags = os.O_PATH | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    target = os.open(path, flags)
    try:
        rule = PathBeneathAttr(rights, target)
        _check(
            _syscall(SYS_ADD_RULE, ruleset_fd, RULE_PATH_BENEATH, ctypes.byref(rule), 0),
            f"landlock_add_rule {path}",
        )
    finally:
        os.close(target)


def restrict(ruleset_fd: int) -> None:
    """In the child, between fork and exec: ``no_new_privs``, then enter the ruleset's
    domain (this thread and everything it starts, for good). No allocation but ctypes'
    own: the functions were looked up at import."""
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_syscall(SYS_RESTRICT_SELF, ruleset_fd, 0), "landlock_restrict_self")


def _attempt_create(path: str) -> str:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))


def probe(abi: int) -> str | None:
    """Enter a ruleset the way a run does, in a throwaway thread (Landlock and no_new_privs
    hold for the calling thread only: the server's other threads keep every right, and no
    process is started); None when the thread could write its folder and not the folder
    beside it, else why not."""
    parent = tempfile.mkdtemp(prefix="studio-code-landlock-")
    seen: list[Any] = []

    def trial() -> None:
        try:
            restrict(fd)
            seen.extend(_attempt_create(os.path.join(d, "f")) for d in (inside, parent))
        except OSError as e:
            seen.append(e)

    try:
        inside = os.path.join(parent, "run")
        os.mkdir(inside)
        fd = ruleset(abi, inside)
        try:
            t = threading.Thread(target=trial, name="studio-landlock-probe")
            t.start()
            t.join()
        finally:
            os.close(fd)
    except OSError as e:
        return f"the kernel refused a Landlock ruleset ({e})"
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    if seen != ["ok", "EACCES"]:
        return (
            "a thread under a Landlock ruleset could not write its folder or could write "
            f"beside it (saw {seen})"
        )
    return None
