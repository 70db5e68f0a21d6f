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


#: a stack whose workflow cap (2) is tested with a worker SIGKILLed mid-run: 3 run slots
#: per worker, the kill's run delivered again within seconds (make_stack's settings)
SIGKILL_CAP_STACK: dict[str, Any] = {
    "code_concurrency": 3,
    "queue_test_slots": 0,
    "queue_run_workflow_slots": 2,
    "code_max_seconds": 5,
    "queue_visibility_timeout_s": 6,
    "queue_reap_interval_s": 1,
}


def kill_one_running(q: Any, worker: Any, ids: list[str]) -> str:
    """Once one of ``ids`` runs on ``worker`` (the Stack ``q``'s): SIGKILL the worker (main
    process and pool) and return that run's id."""
    from collections import Counter

    from executor.models import Status
    from testkit.processes import wait_for

    def runs_there() -> list[str]:
        recs = q.client.store.get_many(list(ids), inputs=False)
        return [
            j
            for j, rec in recs.items()
            if rec.status is Status.RUNNING and (rec.worker or "").startswith(f"{worker.name}@")
        ]

    def seen() -> Any:
        recs = q.client.store.get_many(list(ids), inputs=False).values()
        return Counter((str(r.status), (r.worker or "").split("@")[0]) for r in recs)

    killed = str(wait_for(runs_there, 120, f"a run on {worker.name}", describe=seen)[0])
    worker.kill_hard()
    return killed


def drain(r: Any, fair: Any, n: int) -> list[str]:
    """Runs released, ``code.run`` emptied before each release (every slot free again)."""
    out: list[str] = []
    while len(out) < n:
        r.delete("code.run")
        if not fair.release():
            break
        out += released(r)
    return out


class CapWatch:
    """Samples, every ``every_s`` (50 ms) in a thread of its own, one concurrency key's runs
    released and not ended (``held_key``'s field ``key`` in Redis, as worker/fair.lua counts
    them) and how many of ``ids`` (the key's runs: the test appends them as they are made)
    the run store says are running. A sample Redis cannot answer (a failover) counts its
    Redis side as unknown; the run store's side is still taken. ``with`` it: started, then
    stopped; ``peaks`` the most seen of each."""

    def __init__(
        self,
        client: Any,
        key: str,
        ids: list[str],
        *,
        held_key: str = "studio:fair:held_count",
        every_s: float = 0.05,
    ) -> None:
        import threading

        self.client = client
        self.key = key
        self.held_key = held_key
        self.ids = ids
        self.every_s = every_s
        #: (runs released and not ended, None: Redis unanswered; runs running)
        self.samples: list[tuple[int | None, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from executor.models import Status

        while not self._stop.is_set():
            held: int | None
            try:
                held = int(self.client.redis.hget(self.held_key, self.key) or 0)
            except Exception:  # noqa: BLE001 - Redis away (a failover): unknown this time
                held = None
            running = 0
            ids = list(self.ids)
            if ids:
                try:
                    statuses = self.client.store.statuses(ids)
                    running = sum(1 for s in statuses.values() if s is Status.RUNNING)
                except Exception:  # noqa: BLE001 - a busy SQLite: the next sample
                    pass
            self.samples.append((held, running))
            self._stop.wait(self.every_s)

    def __enter__(self) -> CapWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def peaks(self) -> tuple[int, int]:
        """The most runs released and not ended seen at once, and running at once."""
        held = [h for h, _ in self.samples if h is not None]
        return max(held, default=0), max((r for _, r in self.samples), default=0)

    def account(self, recs: dict[str, Any]) -> str:
        """The accounting a test prints: submitted, each outcome, lost (not finished), and
        the peaks over how many samples."""
        from collections import Counter

        outcomes = Counter(str(r.status) for r in recs.values())
        lost = sum(1 for j in self.ids if j not in recs or not recs[j].finished)
        held, running = self.peaks
        unknown = sum(1 for h, _ in self.samples if h is None)
        return (
            f"submitted {len(self.ids)} / {dict(outcomes)} / lost {lost} / max released "
            f"{held}, max running {running} over {len(self.samples)} samples every "
            f"{self.every_s * 1000:.0f} ms ({unknown} with Redis unanswered)"
        )
