"""The socket guard cannot be starved or ended by its clients (issue 38): a real
``studio-code sockguard`` process in front of the real engine, flooded with connections that
send a partial head and wait. Its other clients (a worker's Docker SDK, in a process of its
own) are still answered; in a pids cgroup of 120 a flood of 300 leaves it up and a job
running through it at that moment is not re-run; the bounds (per peer, a request's time, an
idle connection's) close what exceeds them, with an answer that names the setting."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import require, wait_for
from testkit.sockguard import SockGuardProcess

pytestmark = pytest.mark.docker

#: what each flooding client sends: a request head begun, never ended
PARTIAL = b"GET /v1.41/_ping HTTP/1.1\r\nHost: dock"

#: a worker's side: the Docker SDK in a process of its own (another peer than the test's)
PING = (
    "import docker, sys\n"
    "api = docker.APIClient(base_url=sys.argv[1], timeout=60)\n"
    "print(api.ping(), api.version()['ApiVersion'])\n"
)


def worker_ping(host: str) -> str:
    """``GET /_ping`` and ``GET /version`` through ``host`` from another process: its
    output (``True 1.4x``), or the failure."""
    proc = subprocess.run(
        [sys.executable, "-c", PING, host], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@contextmanager
def nofile(soft: int) -> Iterator[None]:
    """This process's RLIMIT_NOFILE soft limit set to ``soft`` (within the hard one), then
    back."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    require(before[1] >= soft, f"RLIMIT_NOFILE hard {before[1]} < {soft}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def flood(path: Path, n: int) -> list[socket.socket]:
    """``n`` connections to the guard, each with a partial head sent."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))  # blocking: waits for room in the guard's backlog
        s.settimeout(30)  # a hang guard, never a timing assertion
        s.sendall(PARTIAL)
        out.append(s)
    return out


def answer_of(s: socket.socket) -> tuple[int, str]:
    """What the guard answers on ``s`` before it closes: (status, message); (0, '') when it
    closes without a word."""
    buf = b""
    while data := s.recv(65536):
        buf += data
    if not buf:
        return 0, ""
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), str(json.loads(body)["message"])


def held(guard: SockGuardProcess) -> int:
    """The descriptors the guard's process holds."""
    return len(os.listdir(f"/proc/{guard.pid}/fd"))


def test_two_thousand_idle_connections_leave_a_workers_calls_answered(tmp_path: Path) -> None:
    """Before: one thread per connection and ``select()``: past descriptor 1024 every other
    client's call failed (``filedescriptor out of range in select()``)."""
    with (
        nofile(4500),
        SockGuardProcess(
            tmp_path / "guard",
            {
                "STUDIO_CODE_SOCKGUARD_MAX_PER_PEER": "4000",
                "STUDIO_CODE_SOCKGUARD_HEAD_TIMEOUT_S": "120",
            },
            trace=False,
        ) as guard,
    ):
        conns = flood(guard.path, 2000)
        try:
            # all of them accepted and held: descriptors past select()'s wall of 1024
            wait_for(lambda: held(guard) > 2000, 60, "the guard holding 2,000 connections")
            assert worker_ping(guard.host).startswith("True 1.4"), guard.tail()
            assert guard.alive(), guard.tail()
        finally:
            for s in conns:
                s.close()


def test_the_bounds_close_what_exceeds_them_naming_the_setting(tmp_path: Path) -> None:
    """A peer past STUDIO_CODE_SOCKGUARD_MAX_PER_PEER is answered 503 (another peer is
    not); a request not whole within STUDIO_CODE_SOCKGUARD_HEAD_TIMEOUT_S 408; a connection
    with nothing sent for STUDIO_CODE_SOCKGUARD_IDLE_TIMEOUT_S closed. The guard raised its
    RLIMIT_NOFILE soft limit to the hard one."""
    env = {
        "STUDIO_CODE_SOCKGUARD_MAX_PER_PEER": "5",
        "STUDIO_CODE_SOCKGUARD_HEAD_TIMEOUT_S": "1",
        "STUDIO_CODE_SOCKGUARD_IDLE_TIMEOUT_S": "1",
    }
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    # the guard starts with a low soft limit: 256, or more when this process (an xdist
    # process that ran other modules before) holds many descriptors itself
    low = max(256, len(os.listdir("/proc/self/fd")) + 64)
    with nofile(low):
        guard = SockGuardProcess(tmp_path / "guard", env, trace=False)
    with guard:
        limits = Path(f"/proc/{guard.pid}/limits").read_text()
        row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        soft = int(row.split()[3])
        assert soft == hard != low, row
        conns = flood(guard.path, 5)
        try:
            over = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            over.settimeout(30)
            over.connect(str(guard.path))
            status, message = answer_of(over)
            over.close()
            assert status == 503 and "STUDIO_CODE_SOCKGUARD_MAX_PER_PEER" in message, message
            assert "at most 5" in message, message
            assert worker_ping(guard.host).startswith("True"), guard.tail()  # another peer
            for s in conns:
                status, message = answer_of(s)
                assert status == 408 and "not whole within 1 s" in message, message
        finally:
            for s in conns:
                s.close()
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.settimeout(30)
        idle.connect(str(guard.path))
        assert answer_of(idle) == (0, "")  # closed, without a word
        idle.close()
        out = guard.output()
        assert "refused a connection" in out and "not whole within" in out, guard.tail()
        assert guard.alive()


SLEEPY = "import time\n\ndef main(state):\n    time.sleep(4)\n    return 'ok'\n"


@pytest.fixture
def pids_group() -> Iterator[Any]:
    """A pids cgroup of 120 of the test's own (v1 or v2, as the subprocess runtime makes
    its runs'): a process moved in shares it with its threads."""
    from executor.runtimes.subprocess.cgroups import find_parent

    parent, why = find_parent("auto")
    require(parent is not None, f"no cgroup of the test's own to make a pids group in: {why}")
    assert parent is not None
    group = parent.create(f"guardtest-{uuid.uuid4().hex[:8]}", 1 << 30, 120)
    try:
        yield group
    finally:
        group.kill_all()
        group.remove()


def test_a_guard_in_a_pids_cgroup_of_120_outlives_a_flood_of_300_and_a_job_is_not_rerun(
    tmp_path: Path, redis_server: Any, python_image: str, pids_group: Any
) -> None:
    """Before: a thread per connection; at the cgroup's limit ``can't start new thread``
    escaped the accept loop and the guard ended; the job whose attach stream it carried was
    lost to the infrastructure and ran again."""
    from testkit.stack import DOCKER_PYTHON, Stack

    env = {"STUDIO_CODE_SOCKGUARD_HEAD_TIMEOUT_S": "120"}
    with SockGuardProcess(tmp_path / "guard", env, trace=False) as guard:
        for procs in pids_group.procs_files:
            Path(procs).write_text(str(guard.pid))
        assert guard.pid in pids_group.pids()
        with Stack(
            tmp_path,
            redis_url=redis_server.url,
            env={"DOCKER_HOST": guard.host},
            **DOCKER_PYTHON,
            code_image=python_image,
        ) as stack:
            stack.start_worker(concurrency=1)
            job = stack.client.submit(SLEEPY)
            rec = stack.client.store.get(job)
            while rec is None or rec.status.value != "running":
                rec = stack.client.wait(job, 0.05)  # woken by its progress
                assert not rec.finished, rec
            conns = flood(guard.path, 300)
            try:
                assert guard.alive(), guard.tail()
                rec = stack.client.wait(job, 60)
                assert rec.status.value == "succeeded" and rec.output == "ok", rec
                assert rec.attempts == 1, rec
                assert guard.alive(), guard.tail()
                assert worker_ping(guard.host).startswith("True"), guard.tail()
            finally:
                for s in conns:
                    s.close()
