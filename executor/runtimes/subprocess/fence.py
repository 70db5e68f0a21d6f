"""Covers: a subprocess run cannot name the server's own folders.

Landlock refuses writing, but not a file's metadata: a run whose uid owns the server's files
(a non-root server's) could still ``chmod`` the run store or ``secret.key``, change their
times, set extended attributes, or hold a lock on the SQLite store's ``-shm`` write-lock
byte (every server write then fails "database is locked" for the run's length). And it
reads every file its uid can read, the server's own included.

So, before exec, each run gets a mount namespace in which the server's folders (the data
folder, the run store's folder, the server's home, the folder of STUDIO_API_TOKEN_FILE:
``server_folders``) are each covered by an empty, read-only tmpfs (mode 000, or 0111 where
something the run needs lies beneath: see below). Inside the run these paths are empty
folders it cannot list, so every file in them is out of reach: no open, no stat, no chmod,
utime, setxattr or lock (the call fails before any permission check on the real file, with
ENOENT or EACCES; the cover itself is read-only: EROFS).

- **Root server** (a uid per run): the child, still root, makes a mount namespace of its own
  (``unshare(CLONE_NEWNS)``, no extra process) and covers, then drops to the run's uid.
- **Non-root server**: the covers are made in the run's user + mount namespace
  (``namespaces.enter``), so they need namespaces (STUDIO_CODE_SUBPROCESS_NAMESPACES=auto
  and a kernel that allows them); without them there is no cover and meta says so.

The run cannot remove a cover: it has no capability once it has exec'd (a non-zero uid),
Landlock's domain refuses ``mount(2)``/``umount(2)``, and a mount namespace the run could
make of its own (in a user namespace of its own) gets these mounts locked together with
what they cover (the kernel's ``MNT_LOCKED``: no umount, no move, no bind of what is
beneath).

What the run needs beneath a covered folder is bound back (``Plan.exposes``): its own
temporary folder (writable) and, read-only, the interpreter's folders (a Python prefix, a
Deno binary's folder, STUDIO_CODE_TS_DENO_DIR), which a non-root server often has in its
home. A covered folder beneath one of those is covered again. The child then changes to its
folder again (``chdir``), so its working folder is the bound one and ``..`` never leads
beneath a cover.

Not covered: "/" and the system folders (``NEVER``), a path that does not exist when the run
starts, and other names for the same files (a hard link, or another mount of the same
file system elsewhere). ``probe`` proves it at start-up with a trial run.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.runtimes.subprocess.namespaces import _check, _libc
from executor.settings import Settings

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 0x4000, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
#: statvfs's f_flag -> the mount flag a read-only bind remount must keep (the kernel refuses
#: to clear a flag locked by a more privileged namespace)
ST_TO_MS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
COVER_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
#: folders never covered: the run would lose its system
NEVER = frozenset(
    "/ /bin /boot /dev /dev/shm /etc /home /lib /lib32 /lib64 /libx32 /media /mnt /opt /proc "
    "/run /run/lock /sbin /srv /sys /tmp /usr /usr/local /var /var/lib /var/tmp".split()
)


def _beneath(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _real(path: str | Path) -> str:
    return os.path.realpath(os.path.abspath(path))


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite URL (``sqlite:///rel.db``, ``sqlite:////abs.db``,
    ``sqlite+pysqlite:///...``), None for another database or an in-memory one. Parsed
    here: a run's start does not load SQLAlchemy."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0].lower() != "sqlite":
        return None
    path = rest[1:].split("?")[0] if rest.startswith("/") else ""
    return path if path and path != ":memory:" else None


def server_folders(settings: Settings) -> dict[str, str]:
    """What is covered, by name: each folder's real path (existing folders only, never a
    system folder)."""
    named: list[tuple[str, str | Path]] = [("the data folder", settings.data_dir)]
    store = sqlite_path(settings.sqlalchemy_url)
    if store:
        named.append(("the run store's folder", Path(store).parent))
    homes = [os.environ.get("HOME", "")]  # $HOME first, then the passwd entry's
    try:
        import pwd

        homes.append(pwd.getpwuid(os.getuid()).pw_dir)
    except (ImportError, KeyError):
        pass
    named += [("the server's home", h) for h in homes if h and os.path.isabs(h)]
    if settings.api_token_file:
        named.append(("the token file's folder", Path(settings.api_token_file).parent))
    folders: dict[str, str] = {}
    for name, path in named:
        real = _real(path)
        if real in NEVER or not os.path.isdir(real) or real in folders.values():
            continue
        folders[name if name not in folders else f"{name} ({real})"] = real
    return folders


def needed_paths(settings: Settings, argvs: list[list[str]]) -> list[str]:
    """What a run reads beneath a covered folder, to be bound back read-only: each command's
    installation (the folder above its binary's, as named and resolved: a virtualenv and the
    Python it was made from), the server's own Python's prefixes when a command is it, and
    STUDIO_CODE_TS_DENO_DIR."""
    needed: list[str] = []
    for argv in argvs:
        binary = shutil.which(argv[0]) or argv[0]
        if not os.path.isabs(binary):
            continue
        for b in (os.path.abspath(binary), _real(binary)):
            needed.append(_real(os.path.dirname(os.path.dirname(b))))
        if _real(binary) == _real(sys.executable):
            needed += [_real(sys.prefix), _real(sys.base_prefix)]
    if settings.code_ts_deno_dir and os.path.isabs(settings.code_ts_deno_dir):
        needed.append(_real(settings.code_ts_deno_dir))
    return sorted({p for p in needed if os.path.exists(p)})


@dataclass(frozen=True)
class Plan:
    """What one run's mount namespace gets: ``covers`` (real paths, each an empty read-only
    tmpfs), ``exposes`` (paths beneath a cover bound back read-only), ``workdir`` (the run's
    folder, bound back writable when beneath a cover; the child's working folder)."""

    covers: tuple[str, ...]
    exposes: tuple[str, ...]
    workdir: str

    @classmethod
    def make(cls, covers: list[str], needed: list[str], workdir: str) -> Plan:
        workdir = _real(workdir)
        under = [p for p in needed if any(_beneath(p, c) for c in covers)]
        return cls(tuple(covers), tuple(p for p in under if p not in covers), workdir)

    def steps(self) -> list[tuple[str, str]]:
        """("cover" | "expose" | "workdir", path), shallowest first (a cover beneath a bound
        folder comes after it: covered again)."""
        steps = [("cover", p) for p in self.covers] + [("expose", p) for p in self.exposes]
        if any(_beneath(self.workdir, c) for c in self.covers):
            steps.append(("workdir", self.workdir))
        return sorted(steps, key=lambda s: (s[1].count("/"), s[0] != "cover", s[1]))

    def apply(self) -> None:
        """In the child, in its own (private) mount namespace, before exec and before
        dropping the uid or entering Landlock: make the mounts, then change to its folder.
        (A method: ``namespaces.enter`` calls it without importing this module, which
        imports that one.)"""
        _apply(self)


def unshare_mounts() -> None:
    """A root child: a mount namespace of its own whose mounts never propagate back."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def _apply(plan: Plan) -> None:
    steps = plan.steps()
    fds: dict[str, int] = {}
    tmpfs: list[str] = []
    try:
        for kind, path in steps:  # opened before any cover hides them
            if kind != "cover":
                fds[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
        for kind, path in steps:
            if kind == "cover":
                if not os.path.isdir(path):  # hidden already by a shallower cover
                    continue
                through = any(_beneath(p, path) and p != path for k, p in steps if k != "cover")
                opts = f"mode={'0111' if through else '0000'},size=4k,nr_inodes=64"
                _check(
                    _libc.mount(b"none", path.encode(), b"tmpfs", COVER_FLAGS, opts.encode()),
                    f"cover {path}",
                )
                tmpfs.append(path)
            else:
                _bind(fds[path], path, writable=kind == "workdir")
        for path in reversed(tmpfs):
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | COVER_FLAGS
            _check(_libc.mount(None, path.encode(), None, flags, None), f"read-only {path}")
        os.chdir(plan.workdir)  # resolved again: through the bound folder, never beneath
    finally:
        for fd in fds.values():
            os.close(fd)


def _bind(fd: int, path: str, *, writable: bool) -> None:
    if not os.path.lexists(path):  # a mount point in the cover above (still writable)
        _mkdirs(os.path.dirname(path))
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.mkdir(path, 0o111)
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
    source = f"/proc/self/fd/{fd}".encode()
    _check(_libc.mount(source, path.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
    if not writable:
        kept = os.statvfs(path).f_flag
        locked = sum(ms for st, ms in ST_TO_MS.items() if kept & st)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | locked
        _check(_libc.mount(None, path.encode(), None, flags, None), f"read-only {path}")


def _mkdirs(path: str) -> None:
    if os.path.lexists(path):
        return
    _mkdirs(os.path.dirname(path))
    os.mkdir(path, 0o111)


PROBE_CODE = (
    "import os, sys\n"
    "seen = []\n"
    "for p in sys.argv[1:]:\n"
    "    try:\n"
    "        seen.append(str(len(os.listdir(p))))\n"
    "    except OSError as e:\n"
    "        seen.append(type(e).__name__)\n"
    "print(' '.join(seen))\n"
)


def probe(interpreter: str, setup: Any, folder: str, workdir: str) -> str | None:
    """A trial run started with ``setup`` (its pre-exec step, covering ``folder``, a
    throwaway folder holding one file): None when the run found ``folder`` empty,
    unreadable or gone and its own ``workdir`` (empty) there, else why not."""
    try:
        seen = subprocess.run(
            [interpreter, "-S", "-I", "-c", PROBE_CODE, folder, workdir],
            preexec_fn=setup,
            capture_output=True,
            timeout=30,
            start_new_session=True,
            env={},
            cwd=workdir,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"the kernel refused a trial run with its folders covered ({e})"
    # the folder holds a file: covered, it is empty, cannot be listed (a run not root) or
    # is not there at all (beneath another cover)
    hidden = (b"0", b"PermissionError", b"FileNotFoundError")
    words = seen.stdout.split()
    if seen.returncode != 0 or len(words) != 2 or words[0] not in hidden or words[1] != b"0":
        return (
            "a trial run could still list a covered folder "
            f"(exit {seen.returncode}, saw {seen.stdout[:80]!r} {seen.stderr[-200:]!r})"
        )
    return None
