"""A redis-server of the test's or the bench's own, on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from testkit.processes import (
    StopsOnExit,
    free_port,
    needs,
    require,
)
from testkit.reaper import disown, own


class RedisServer(StopsOnExit):
    """A redis-server of the test's own on a free loopback port; it can be stopped and
    started again, with AOF as deploy/compose.yaml runs it (appendfsync everysec: what it
    acknowledged more than a second ago survives even a SIGKILL)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        needs("redis", "a redis-server")
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
                "--daemonize",
                "no",
                "--logfile",
                str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        own(self.proc.pid)  # stopped by the reaper if this process ends first
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (Redis flushes and exits) or, with kill, SIGKILL (a crash)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.proc:
            disown(self.proc.pid)
        self.proc = None


def start_redis(workdir: Path) -> RedisServer:
    """A started RedisServer in ``workdir``; a missing redis-server skips (fails under CI)."""
    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    server = RedisServer(workdir)
    server.start()
    return server


def wait_redis(port: int, password: str = "", timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    hello = (f"AUTH {password}\r\nPING\r\n" if password else "PING\r\n").encode()
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(hello)
                if b"+PONG" in s.recv(64):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis on port {port} did not start")


def take_lost(app: Any, queue: str) -> str:
    """Take the next message of ``queue`` as a worker does (kombu moves it into its
    ``unacked`` hash and ``unacked_index``, with the time of this delivery) and lose it as a
    worker cut off from a dead primary does (its channel never puts it back); its delivery
    tag. ``app``: a Celery app of the studio's broker (``CodeClient.app``)."""
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        message = channel.basic_get(queue, no_ack=False)
        if message is None:
            raise AssertionError(f"no message in {queue}")
        channel.qos._delivered.pop(message.delivery_tag, None)  # not restored on close
        return str(message.delivery_tag)
