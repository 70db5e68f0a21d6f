"""The fair queue's script on a real redis-server, as its tests drive it: a live worker
announced, the runs it released read back, slots freed between releases."""

from __future__ import annotations

import json
from typing import Any


def announce(r: Any, slots: int) -> None:
    """A live serving worker of code.run with ``slots`` run slots (as worker.upkeep.heartbeat)."""
    from worker.protocol import QUEUE_RUN
    from worker.upkeep.heartbeat import Heartbeat

    url = r.connection_pool.connection_kwargs
    hb = Heartbeat(
        f"redis://{url['host']}:{url['port']}/0",
        "w@test",
        {QUEUE_RUN: slots},
        interval_s=60,
        ttl_s=60,
    )
    hb.beat()
    hb.redis.close()


def released(r: Any) -> list[str]:
    """The messages in code.run, oldest first, as job ids."""
    return [json.loads(m)["headers"]["id"] for m in reversed(r.lrange("code.run", 0, -1))]


def drain(r: Any, fair: Any, n: int) -> list[str]:
    """Runs released, ``code.run`` emptied before each release (every slot free again)."""
    out: list[str] = []
    while len(out) < n:
        r.delete("code.run")
        if not fair.release():
            break
        out += released(r)
    return out
