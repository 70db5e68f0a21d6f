"""What tests send: the header names of the API and the Code nodes many test files run."""

from __future__ import annotations

from typing import Any

USER = "X-Studio-User"

ADMIN = "X-Studio-Admin"

OK_CODE = "def main(state):\n    return {'double': state.get('n', 0) * 2}\n"

SLEEP_CODE = "import time\n\ndef main(state):\n    time.sleep(state.get('s', 60))\n    return 1\n"

RAISE_CODE = "def main(state):\n    raise ValueError('boom from the node')\n"

TRIVIAL = "def main(state):\n    return state.get('n', 0) * 2\n"

SPIN = "def main(state):\n    while True:\n        pass\n"


def sleeper(seconds: float, out: str = "slept") -> str:
    return f"import time\n\ndef main(state):\n    time.sleep({seconds})\n    return {out!r}\n"


#: reports (and prints to the logs, for runs that end without a result) the id of the
#: container it runs in, and whether anything ran in this container before it
WHOAMI = r"""
import os, re, time

def cid():
    for line in open("/proc/self/mountinfo"):
        m = re.search(r"/containers/([0-9a-f]{64})/hostname", line)
        if m:
            return m.group(1)

def main(state):
    me = cid()
    print("cid", me, flush=True)
    reused = os.path.exists("/tmp/used")
    open("/tmp/used", "w").write("x")
    mode = state.get("mode")
    if mode == "spin":
        while True:
            pass
    if mode == "sleep":
        time.sleep(60)
    if mode == "oom":
        hog = []
        while True:
            hog.append(bytearray(1 << 20))
    return {"cid": me, "reused": reused}
"""


#: a node's helper: the first of ``paths`` it can read, stripped (None: none)
READ_FIRST = (
    "def read(*paths):\n"
    "    for p in paths:\n"
    "        try:\n"
    "            return open(p).read().strip()\n"
    "        except OSError:\n"
    "            pass\n"
)

#: reports the sandbox's own CPU quota and memory limit, read from INSIDE it (cgroup v2:
#: cpu.max, memory.max; v1: cpu.cfs_quota_us and cpu.cfs_period_us, memory.limit_in_bytes)
CGROUP_CODE = READ_FIRST + (
    "def main(state):\n"
    "    return {'cpu': read('/sys/fs/cgroup/cpu.max'),\n"
    "            'quota': read('/sys/fs/cgroup/cpu/cpu.cfs_quota_us'),\n"
    "            'period': read('/sys/fs/cgroup/cpu/cpu.cfs_period_us'),\n"
    "            'mem': read('/sys/fs/cgroup/memory.max',\n"
    "                        '/sys/fs/cgroup/memory/memory.limit_in_bytes')}\n"
)


def cpu_share(out: dict[str, Any]) -> float | None:
    """The CPU share CGROUP_CODE's answer shows; None when the sandbox has no CPU quota (v1
    quota -1, v2 "max")."""
    if out["period"]:  # cgroup v1
        quota = int(out["quota"])
        return None if quota < 0 else quota / int(out["period"])
    quota, period = out["cpu"].split()
    return None if quota == "max" else int(quota) / int(period)


#: shared by the hostile programs of tests/test_subprocess_isolation.py and
#: tests/test_subprocess_landlock.py: try one thing, report "ok" or the errno's name
PRELUDE = r"""
import ctypes, errno, os, signal, sys, time, json

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

def read(path):
    with open(path, "rb") as f:
        f.read()

def open_only(path):
    os.close(os.open(path, os.O_RDONLY))

def seize(pid):
    # PTRACE_SEIZE does not stop the tracee; detach at once if the kernel allowed it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(0x4206, pid, None, None) == 0:
        libc.ptrace(17, pid, None, None)
        return
    e = ctypes.get_errno()
    raise OSError(e, os.strerror(e))

def probe(pid, kill):
    r = {
        "environ": attempt(lambda: read(f"/proc/{pid}/environ")),
        "mem": attempt(lambda: open_only(f"/proc/{pid}/mem")),
        "cwd": attempt(lambda: os.listdir(f"/proc/{pid}/cwd")),
        "ptrace": attempt(lambda: seize(pid)),
        "signal0": attempt(lambda: os.kill(pid, 0)),
    }
    if kill:
        r["sigkill"] = attempt(lambda: os.kill(pid, signal.SIGKILL))
    return r
"""
