"""A Redis Sentinel deployment of the test's or the bench's own (a primary, a replica, three
sentinels), on loopback."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from testkit.processes import (
    StopsOnExit,
    free_port,
    require,
)
from testkit.reaper import disown, own
from testkit.redis import wait_redis
from testkit.relay import Relay


class SentinelSet(StopsOnExit):
    """A Redis Sentinel deployment of the test's own, all on free loopback ports with its
    own folders in ``workdir``: a primary, a replica and three sentinels (quorum 2, a
    primary unanswered for 1 s is down). Every node announces 127.0.0.1, so what the
    sentinels hand out is reachable here. ``url`` is the STUDIO_REDIS_URL of it (with
    ``master`` as STUDIO_REDIS_SENTINEL_MASTER).

    ``relayed_replica``: the replica reaches its primary through a Relay of the set's own,
    which ``cut_replication()`` silences: from then on the primary acknowledges writes the
    replica never gets (asynchronous replication's loss, on purpose), while the sentinels
    still reach both nodes directly and promote the replica when the primary dies."""

    master = "studio"

    def __init__(
        self,
        workdir: Path,
        *,
        password: str = "",
        sentinel_password: str = "",
        relayed_replica: bool = False,
    ):
        self.workdir = workdir
        self.password = password
        self.sentinel_password = sentinel_password
        self.relayed_replica = relayed_replica
        self.replica_relay: Relay | None = None
        self.ports = {"a": free_port(), "b": free_port()}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return self.sentinel_url()

    def sentinel_url(self, count: int = 3, db: int = 0) -> str:
        """The STUDIO_REDIS_URL of the first ``count`` sentinels, the master's password in
        the first part only (as an operator writes it), database ``db``."""
        auth = f":{self.password}@" if self.password else ""
        first, *rest = self.sentinel_ports[:count]
        parts = [f"sentinel://{auth}127.0.0.1:{first}/{db}"]
        return ";".join(parts + [f"sentinel://127.0.0.1:{p}" for p in rest])

    def primary_url(self, db: int = 0) -> str:
        """A plain redis:// URL of the primary (node ``a`` until a failover)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.ports['a']}/{db}"

    def _auth(self) -> list[str]:
        if not self.password:
            return []
        return ["--requirepass", self.password, "--masterauth", self.password]

    def start_node(self, name: str, replica_of: int | None = None) -> None:
        folder = self.workdir / f"redis-{name}"
        folder.mkdir(exist_ok=True)
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(self.ports[name]),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "no",
            "--replica-announce-ip",
            "127.0.0.1",
            "--logfile",
            str(folder / "redis.log"),
            *self._auth(),
        ]
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.procs[name] = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        own(self.procs[name].pid)  # stopped by the reaper if this process ends first
        wait_redis(self.ports[name], self.password)

    def start(self) -> SentinelSet:
        self.start_node("a")
        upstream = self.ports["a"]
        if self.relayed_replica:
            self.replica_relay = Relay(upstream)
            upstream = self.replica_relay.port
        self.start_node("b", replica_of=upstream)
        for i, port in enumerate(self.sentinel_ports):
            folder = self.workdir / f"sentinel-{i}"
            folder.mkdir(exist_ok=True)
            conf = [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {folder}",
                f"logfile {folder / 'sentinel.log'}",
                "sentinel announce-ip 127.0.0.1",
                "sentinel resolve-hostnames no",
                f"sentinel monitor {self.master} 127.0.0.1 {self.ports['a']} 2",
                f"sentinel down-after-milliseconds {self.master} 1000",
                f"sentinel failover-timeout {self.master} 10000",
                f"sentinel parallel-syncs {self.master} 1",
            ]
            if self.password:
                conf.append(f"sentinel auth-pass {self.master} {self.password}")
            if self.sentinel_password:
                conf.append(f"requirepass {self.sentinel_password}")
                conf.append(f"sentinel sentinel-pass {self.sentinel_password}")
            (folder / "sentinel.conf").write_text("\n".join(conf) + "\n")
            self.procs[f"s{i}"] = subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    str(folder / "sentinel.conf"),
                    "--sentinel",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            own(self.procs[f"s{i}"].pid)
            wait_redis(port, self.sentinel_password)
        self.wait_master(self.ports["a"])
        self.wait_synced("b")
        return self

    def wait_synced(self, name: str, timeout_s: float = 30.0) -> None:
        """Until replica ``name`` has its primary's data and follows it."""
        import redis

        c = redis.Redis(port=self.ports[name], password=self.password or None, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                info = c.info("replication")
                if info.get("master_link_status") == "up" and not info.get(
                    "master_sync_in_progress"
                ):
                    return
                time.sleep(0.1)
        finally:
            c.close()
        raise RuntimeError(f"the replica {name} did not sync with its primary")

    def master_port(self) -> int | None:
        """The primary's port as the first sentinel that answers sees it."""
        import redis

        for port in self.sentinel_ports:
            try:
                c = redis.Redis(
                    port=port, password=self.sentinel_password or None, socket_timeout=1
                )
                addr: Any = c.sentinel_get_master_addr_by_name(self.master)  # (host, port)
                c.close()
                return int(addr[1])
            except Exception:  # noqa: BLE001 - try the next sentinel
                continue
        return None

    def wait_master(self, port: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.master_port() == port:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the sentinels did not name 127.0.0.1:{port} the primary")

    def kill_primary(self) -> str:
        """SIGKILL the current primary (a crash); returns its name."""
        port = self.master_port()
        name = next(n for n, p in self.ports.items() if p == port)
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)
        disown(proc.pid)
        return name

    def cut_replication(self) -> None:
        """The replica's link to its primary goes silent for good (``relayed_replica``)."""
        if self.replica_relay is None:
            raise RuntimeError("cut_replication needs SentinelSet(..., relayed_replica=True)")
        self.replica_relay.cut()

    def other(self, name: str) -> str:
        return "b" if name == "a" else "a"

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            disown(proc.pid)
        self.procs.clear()
        if self.replica_relay is not None:
            self.replica_relay.stop()


def start_sentinels(workdir: Path, **options: Any) -> SentinelSet:
    """A started SentinelSet; a missing redis-server skips (fails under CI)."""
    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    return SentinelSet(workdir, **options).start()
