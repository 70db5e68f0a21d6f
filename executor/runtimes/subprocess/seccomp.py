"""A seccomp filter for subprocess runs: no kernel keyrings.

A uid's kernel keyrings (its user keyring ``@u``, user-session keyring ``@us``, persistent
keyring) outlive its processes: under a root server a run's leased uid is the next run's,
another user's, which would read what the first left there (``add_key`` then
``keyctl(KEYCTL_READ)``); under a non-root server every run shares the server's. The Docker
sandboxes refuse these calls (their seccomp profile does not list them); so does each
subprocess run: ``add_key``, ``request_key`` and ``keyctl`` fail with EPERM, as in Docker.
Nothing else is filtered (a subprocess run is not a sandbox).

The filter is classic BPF, built once in the server (``program``): the syscall numbers of
every ABI a process of this machine may call with (x86_64, its x32 and i386 forms; aarch64
and 32-bit ARM), so a run cannot reach the keyrings through another entry. The child
installs it between fork and exec (``install``: one ``prctl``, after ``no_new_privs``); it
is inherited by everything the run starts and cannot be removed. ``probe`` proves it at
start-up in a throwaway thread (the filter binds that thread only).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from typing import Any

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_RET_K = 0x06
NR_OFFSET, ARCH_OFFSET = 0, 4  # struct seccomp_data
X32_BIT = 0x40000000

#: AUDIT_ARCH_* -> add_key, request_key, keyctl in that ABI's table
KEYRING_CALLS: dict[int, tuple[int, ...]] = {
    0xC000003E: (248, 249, 250, X32_BIT | 248, X32_BIT | 249, X32_BIT | 250),  # x86_64, x32
    0x40000003: (286, 287, 288),  # i386
    0xC00000B7: (217, 218, 219),  # aarch64
    0x40000028: (309, 310, 311),  # arm (EABI)
}
#: the ABIs a process of this machine may use
MACHINE_ARCHES = {"x86_64": (0xC000003E, 0x40000003), "aarch64": (0xC00000B7, 0x40000028)}
KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING = 0, -4


class SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
    _prctl: Any = _libc.prctl
    _syscall: Any = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):
    _libc = _prctl = _syscall = None


class Filter:
    """A built program and the memory it lives in (the child only points the kernel at it)."""

    def __init__(self, insns: list[tuple[int, int, int, int]]) -> None:
        self.insns = (SockFilter * len(insns))(*(SockFilter(*i) for i in insns))
        self.prog = SockFprog(len(insns), self.insns)


def instructions(arches: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """The program: for each arch of ``arches``, its keyring calls -> EPERM; all else
    allowed. (code, jt, jf, k) each."""
    deny = (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM)
    allow = (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)
    body: list[tuple[int, int, int, int]] = []
    for arch in arches:
        calls = KEYRING_CALLS[arch]
        block = [(BPF_LD_W_ABS, 0, 0, NR_OFFSET)]
        for i, nr in enumerate(calls):  # jump to the deny after this block's checks
            block.append((BPF_JEQ_K, len(calls) - i, 0, nr))
        block += [allow, deny]
        # reload the arch, skip the block when it is not this arch
        body += [(BPF_LD_W_ABS, 0, 0, ARCH_OFFSET), (BPF_JEQ_K, 0, len(block), arch), *block]
    return [*body, allow]


def program() -> tuple[Filter | None, str | None]:
    """The filter for this machine, or None and why none."""
    if not sys.platform.startswith("linux") or _prctl is None:
        return None, "not Linux"
    arches = MACHINE_ARCHES.get(os.uname().machine)
    if arches is None:
        return None, f"not known on {os.uname().machine} (only x86_64 and aarch64 are)"
    return Filter(instructions(arches)), None


def install(f: Filter) -> None:
    """In the child, between fork and exec, after no_new_privs (which the kernel requires of
    an unprivileged caller; set again here, it is harmless)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(f.prog), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_SECCOMP): {os.strerror(e)}")


def probe(f: Filter) -> str | None:
    """Install ``f`` in a throwaway thread and ask for the user keyring's id: None when the
    kernel refused it with EPERM, else why not."""
    keyctl = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
    seen: list[Any] = []

    def trial() -> None:
        try:
            install(f)
        except OSError as e:
            seen.append(e)
            return
        ret = _syscall(keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 0)
        seen.append(ctypes.get_errno() if ret < 0 else ret)

    t = threading.Thread(target=trial, name="studio-seccomp-probe")
    t.start()
    t.join()
    if seen != [errno.EPERM]:
        return f"the kernel did not apply a seccomp filter to a trial thread (saw {seen})"
    return None
