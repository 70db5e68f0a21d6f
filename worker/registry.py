"""Who serves which queue, as the API reads it: the live workers' announcements in Redis.

The worker's main process writes them (worker/upkeep/heartbeat.py, every
STUDIO_QUEUE_HEARTBEAT_INTERVAL_S); the API, the CLI and an autoscaler read them here
(``WorkerRegistry``, ``AsyncWorkerRegistry``), so a job that no live worker would take is
refused at once. One Redis hash per queue (``protocol.workers_key``): field = the worker's
nodename, value = JSON (``WorkerInfo``) with ``seen_at`` / ``expires_at`` in Redis's clock.
A read is one script call (worker/registry_read.lua) for all the queues asked, returning only
the entries that have not expired.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from executor.groups import DEFAULT_GROUP
from worker import lua
from worker.protocol import QUEUE_RUN, QUEUE_TEST, workers_key

SERVING = "serving"
PAUSED = "paused"

#: the read's script (worker/registry_read.lua: what it takes and returns)
_READ_LUA = lua.source(__package__, "registry_read.lua")


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker's announcement for one queue."""

    nodename: str
    queue: str
    slots: int
    state: str = SERVING
    reason: str | None = None
    host: str = ""
    pid: int = 0
    store: str = ""
    store_id: str = ""
    seen_at: float = 0.0
    expires_at: float = 0.0
    engine: dict[str, Any] | None = None
    #: its pre-started sandboxes and what they pre-import (worker/preimport.py); None: an
    #: older worker that does not say
    preimport: dict[str, Any] | None = None
    #: its worker group (executor.groups) and what one of its slots holds (its caps); 0:
    #: an older worker that does not say (it counts as holding any job of its queue)
    group: str = DEFAULT_GROUP
    memory_bytes: int = 0
    cpus: float = 0.0

    def holds(self, memory_bytes: int, cpus: float) -> bool:
        """Whether one of its slots holds a job asking this much (unknown: yes)."""
        if self.memory_bytes and memory_bytes > self.memory_bytes:
            return False
        return not (self.cpus and cpus > self.cpus + 1e-9)

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodename": self.nodename,
            "slots": self.slots,
            "state": self.state,
            "reason": self.reason,
            "host": self.host,
            "pid": self.pid,
            "store": self.store,
            "store_id": self.store_id,
            "engine": self.engine,
            "group": self.group,
            "memory_bytes": self.memory_bytes or None,
            "cpus": self.cpus or None,
        }

    @classmethod
    def parse(cls, raw: str | bytes, queue: str) -> WorkerInfo | None:
        try:
            d = json.loads(raw)
            return cls(
                nodename=str(d["nodename"]),
                queue=queue,
                slots=int(d.get("slots") or 0),
                state=str(d.get("state") or SERVING),
                reason=d.get("reason") or None,
                host=str(d.get("host") or ""),
                pid=int(d.get("pid") or 0),
                store=str(d.get("store") or ""),
                store_id=str(d.get("store_id") or ""),
                engine=_engine(d.get("engine")),
                seen_at=float(d.get("seen_at") or 0),
                expires_at=float(d.get("expires_at") or 0),
                preimport=d["preimport"] if isinstance(d.get("preimport"), dict) else None,
                group=str(d.get("group") or DEFAULT_GROUP),
                memory_bytes=int(d.get("memory_bytes") or 0),
                cpus=float(d.get("cpus") or 0),
            )
        except (ValueError, TypeError, KeyError):
            return None


#: the queues a registry read asks about when none are named
ALL_QUEUES = (QUEUE_TEST, QUEUE_RUN)


class _Registry:
    """What both registries share: the read script on ``client`` (sync or redis.asyncio),
    the keys a read asks for, and how its reply becomes WorkerInfos (``_parse_live``)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._read = client.register_script(_READ_LUA)

    @staticmethod
    def _ask(queues: Iterable[str]) -> tuple[list[str], list[str]]:
        names = list(queues)
        return names, [workers_key(q) for q in names]


class WorkerRegistry(_Registry):
    """Reads the announcements (what the API and an autoscaler call)."""

    def live(self, queues: Iterable[str] = ALL_QUEUES) -> dict[str, list[WorkerInfo]]:
        """The live workers of each queue (paused ones included; check ``serving``), in
        ONE round trip. Raises redis.RedisError when Redis cannot be read."""
        names, keys = self._ask(queues)
        return _parse_live(names, self._read(keys=keys))


class AsyncWorkerRegistry(_Registry):
    """``WorkerRegistry.live`` on a redis.asyncio client (the API's event loop)."""

    async def live(self, queues: Iterable[str] = ALL_QUEUES) -> dict[str, list[WorkerInfo]]:
        names, keys = self._ask(queues)
        return _parse_live(names, await self._read(keys=keys))

    def add_live(self, pipe: Any, queues: Iterable[str]) -> list[str]:
        """The read of ``live`` added to a pipeline of this client (one round trip with the
        caller's own commands); returns the names ``parse_live`` takes with its reply. The
        script is called by its hash: a Redis that does not know it answers NoScriptError
        in its place (``live`` then reads again, loading it)."""
        names, keys = self._ask(queues)
        pipe.evalsha(self._read.sha, len(keys), *keys)
        return names

    @staticmethod
    def parse_live(names: list[str], reply: Any) -> dict[str, list[WorkerInfo]]:
        """``live``'s answer from the reply of the read ``add_live`` added."""
        return _parse_live(names, reply)


def _parse_live(names: list[str], reply: Any) -> dict[str, list[WorkerInfo]]:
    """The read script's reply as the live workers of each of ``names``."""
    out: dict[str, list[WorkerInfo]] = {}
    for queue, entries in zip(names, reply[1:], strict=False):
        infos = [WorkerInfo.parse(raw, queue) for raw in entries or []]
        out[queue] = sorted((i for i in infos if i is not None), key=lambda i: i.nodename)
    for queue in names:
        out.setdefault(queue, [])
    return out


def _engine(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        return None
    # Redis's cjson writes an empty list back as {}
    return {**raw, "advisories": list(raw.get("advisories") or [])}


def summary(live: dict[str, list[WorkerInfo]]) -> dict[str, dict[str, Any]]:
    """What readiness and meta show per queue: workers serving, their slots, the paused
    ones with their reasons."""
    out = {}
    for queue, infos in live.items():
        serving = [i for i in infos if i.serving]
        out[queue] = {
            "serving": len(serving),
            "slots": sum(i.slots for i in serving),
            "paused": [
                {"nodename": i.nodename, "reason": i.reason} for i in infos if not i.serving
            ],
        }
    return out
