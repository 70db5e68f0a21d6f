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
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import pct
from testkit.redis import start_redis
from testkit.relay import Relay
from testkit.sentinel import start_sentinels
from testkit.worker import CeleryWorker

TRIVIAL = "def main(state):\n    return 1\n"


def _env(tmp: Path, redis_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STUDIO_")}
    env.update(
        {
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_REDIS_URL": redis_url,
            "STUDIO_DATABASE_URL": f"sqlite:///{tmp / 'runs.db'}",
            "STUDIO_DATA_DIR": str(tmp),
            "STUDIO_CODE_LANGUAGES": "python",
            "STUDIO_CODE_CONCURRENCY": "2",
            **extra,
        }
    )
    return env


def _client(tmp: Path, redis_url: str, **overrides: Any) -> Any:
    from api_client import CodeClient
    from executor.settings import load_settings

    return CodeClient(
        load_settings(
            enable_code_nodes=True,
            redis_url=redis_url,
            database_url=f"sqlite:///{tmp / 'runs.db'}",
            data_dir=tmp,
            queue_require_worker=False,  # submitted whatever the heartbeats say
            **overrides,
        )
    )


def _claimed_after(client: Any, job_id: str, since: float, timeout_s: float = 120) -> float:
    """Seconds from ``since`` (monotonic) until ``job_id`` is no longer queued."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rec = client.store.get(job_id, inputs=False)
        if rec is not None and rec.status != "queued":
            return time.monotonic() - since
        time.sleep(0.02)
    return float("nan")


def heal_rows(tmp: Path, cuts: int, cut_s: float) -> list[float]:
    out: list[float] = []
    with start_redis(tmp) as redis, Relay(redis.port) as relay:
        client = _client(tmp, redis.url)
        worker = CeleryWorker(
            _env(tmp, relay.url()), tmp / "heal-worker.log", loglevel="WARNING", stop_timeout=20
        )
        try:
            worker.wait_ready(60, app=client.app)
            for _ in range(cuts):
                client.wait(client.submit(TRIVIAL, "python", {}), 60)  # serving now
                relay.cut()
                time.sleep(cut_s / 2)
                job = client.submit(TRIVIAL, "python", {})
                time.sleep(cut_s / 2)
                relay.heal()
                out.append(_claimed_after(client, job, time.monotonic()))
                client.wait(job, 60)
        finally:
            worker.stop()
            client.close()
    return out


def failover_rows(tmp: Path) -> tuple[float, float]:
    with start_sentinels(tmp, password="bench-master-1") as sentinels:
        extra = {"redis_sentinel_master": sentinels.master}
        client = _client(tmp, sentinels.url, **extra)
        env = _env(tmp, sentinels.url, STUDIO_REDIS_SENTINEL_MASTER=sentinels.master)
        worker = CeleryWorker(env, tmp / "failover-worker.log", loglevel="WARNING")
        try:
            worker.wait_ready(60, app=client.app)
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
        finally:
            worker.stop()
            client.close()


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
