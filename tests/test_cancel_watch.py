"""A running job's ``should_cancel`` (worker.cancel.CancelWatch) on a real redis-server and
run store: a read of the Redis flag answers the calls of the next FRESH_S (the job's start
read, then the pool's take and the sandbox's first poll within milliseconds), and the
next call after it reads the flag again. The clock is the watch's own, moved by hand, so
nothing here depends on how fast the machine is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from executor.store import open_store
from testkit.redis import RedisServer
from worker import cancel
from worker.cancel import FRESH_S, CancelWatch
from worker.protocol import cancel_key


def _exists_calls(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get("cmdstat_exists", {}).get("calls", 0))


@pytest.mark.parametrize("flagged", [False, None])
def test_a_fresh_read_answers_the_next_calls_and_a_later_call_reads_again(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flagged: Any
) -> None:
    now = [1000.0]
    monkeypatch.setattr(cancel.time, "monotonic", lambda: now[0])
    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    client = redis.Redis.from_url(redis_server.url)
    try:
        job_id = "job-fresh-read"
        watch = CancelWatch(job_id, store=store, client=client, flagged=flagged)
        before = _exists_calls(client)
        if flagged is None:  # no start read: the first call reads
            assert not watch()
            before += 1
        client.set(cancel_key(job_id), "1")  # set just after the last read
        now[0] += FRESH_S / 2
        assert not watch() and not watch()  # the read FRESH_S / 2 ago answers
        assert _exists_calls(client) == before
        now[0] += FRESH_S
        assert watch()  # past FRESH_S after the read: read again, the flag seen
        assert _exists_calls(client) == before + 1
        now[0] += 0.01
        assert watch()  # and it keeps saying so, with no read
        assert _exists_calls(client) == before + 1
    finally:
        client.close()
        store.close()
