"""Benchmark of Redis faults, in ONE run, with the tests' own services (testkit/,
testkit/relay.py): how long after Redis is usable again a worker consumes a job. No
assertions.

* heal -> first job consumed: a worker reaches its redis-server through a loopback relay;
  every connection goes silent (no FIN, no RST) and new ones are held for ``--cut-s``;
  a job submitted during the cut; the relay heals; the time until the job is claimed
  (its row leaves ``queued``). p50 over ``--cuts`` cuts;
* Sentinel failover -> first job consumed: a primary, a replica and three sentinels; the
  primary SIGKILLed; a job submitted every 0.2 s from then on; the time from the kill to
  the first claimed job, beside the time the sentinels took to name the new primary.

    python -m bench.redis_faults [--cuts 3] [--cut-s 15]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import pct
from testkit.redis import start_redis
from testkit.relay import Relay
from testkit.sentinel import start_sentinels

if TYPE_CHECKING:
    from testkit.stack import Stack

TRIVIAL = "def main(state):\n    return 1\n"


def _claimed_after(client: Any, job_id: str, since: float, timeout_s: float = 120) -> float:
    """Seconds from ``since`` (monotonic) until ``job_id`` is no longer queued."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rec = client.store.get(job_id, inputs=False)
        if rec is not None and rec.status != "queued":
            return time.monotonic() - since
        time.sleep(0.02)
    return float("nan")


def _stack(tmp: Path, redis_url: str, **overrides: Any) -> Stack:
    """A stack on ``redis_url``, its client submitting whatever the heartbeats say."""
    from testkit.stack import Stack

    return Stack(
        tmp,
        redis_url=redis_url,
        quiet=True,
        code_languages="python",
        code_concurrency=2,
        queue_require_worker=False,
        **overrides,
    )


def heal_rows(tmp: Path, cuts: int, cut_s: float) -> list[float]:
    out: list[float] = []
    with start_redis(tmp) as redis, Relay(redis.port) as relay, _stack(tmp, redis.url) as stack:
        client = stack.client
        stack.start_worker("heal-worker", stop_timeout=20, redis_url=relay.url())
        for _ in range(cuts):
            client.wait(client.submit(TRIVIAL, "python", {}), 60)  # serving now
            relay.cut()
            time.sleep(cut_s / 2)
            job = client.submit(TRIVIAL, "python", {})
            time.sleep(cut_s / 2)
            relay.heal()
            out.append(_claimed_after(client, job, time.monotonic()))
            client.wait(job, 60)
    return out


def failover_rows(tmp: Path) -> tuple[float, float]:
    with (
        start_sentinels(tmp, password="bench-master-1") as sentinels,
        _stack(tmp, sentinels.url, redis_sentinel_master=sentinels.master) as stack,
    ):
        client = stack.client
        stack.start_worker("failover-worker")
        client.wait(client.submit(TRIVIAL, "python", {}), 60)
        time.sleep(1)  # the replica has it all
        dead = sentinels.kill_primary()
        killed = time.monotonic()
        new_port = sentinels.ports[sentinels.other(dead)]
        switched = float("nan")
        jobs: list[str] = []
        first = float("nan")
        deadline = killed + 120
        while time.monotonic() < deadline:
            if math.isnan(switched) and sentinels.master_port() == new_port:
                switched = time.monotonic() - killed
            try:
                jobs.append(client.submit(TRIVIAL, "python", {}))
            except Exception:  # noqa: BLE001 - the old primary is gone: try again
                pass
            taken = [j for j, s in client.store.statuses(jobs).items() if s != "queued"]
            if taken:
                first = time.monotonic() - killed
                break
            time.sleep(0.2)
        return switched, first


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cuts", type=int, default=3)
    p.add_argument("--cut-s", type=float, default=15.0)
    args = p.parse_args(argv or [])
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as d:
        (Path(d) / "heal").mkdir()
        (Path(d) / "failover").mkdir()
        heal = heal_rows(Path(d) / "heal", args.cuts, args.cut_s)
        switched, first = failover_rows(Path(d) / "failover")
    print("\nRedis faults (STUDIO_REDIS_DEAD_AFTER_S=10, one worker of 2 processes), seconds")
    print("| what | p50 | max | n |")
    print("|---|---|---|---|")
    print(
        f"| silent cut of {args.cut_s:g} s: heal -> first job consumed | {pct(heal, 50):.2f} "
        f"| {max(heal):.2f} | {len(heal)} |"
    )
    print(f"| Sentinel: primary killed -> new primary named | {switched:.2f} | | 1 |")
    print(f"| Sentinel: primary killed -> first job consumed | {first:.2f} | | 1 |")


if __name__ == "__main__":
    main()
