"""Chaos soak (``make soak``, not part of ``make test``): trivial jobs over 2 workers while a
driver kills, at random moments, a worker's main process, a pool process, Redis (its own
redis-server with AOF) and the run store (its own PostgreSQL cluster), or cuts the workers'
Redis connections silently (they reach Redis through a loopback relay of the soak's own,
tests/relay.py: every connection goes silent, no FIN, no RST, new ones held for 5-25 s),
for a bounded time.

It prints the accounting: submitted, ended per status, executed more than once (counted
from Docker's container start events; allowed only for a job whose worker died while it
ran, and listed), lost (must be 0), stuck (must be 0), containers left (must be 0). Exit 1
when an invariant fails.

    .venv/bin/python -m bench.soak --jobs 1000 --chaos-s 120

Everything runs on loopback; only the processes started here are killed, by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.relay import Relay  # noqa: E402
from tests.services import PgCluster, RedisServer, kill_pids, process_tree  # noqa: E402 - test helpers, reused

CELERY = Path(sys.executable).with_name("celery")
TRIVIAL = "def main(state):\n    return state['n'] * 2\n"
LABEL_JOB = "studio.job_id"


class Worker:
    def __init__(self, name: str, env: dict[str, str], logdir: Path) -> None:
        self.name, self.env, self.logdir = name, env, logdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.logdir / f"{self.name}.{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(CELERY),
                "-A",
                "worker",
                "worker",
                "--pool",
                "prefork",
                "-c",
                "2",
                "-Q",
                "code.test,code.run",
                "--hostname",
                f"{self.name}@%h",
                "--loglevel",
                "INFO",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid) if self.proc else []

    def kill_main(self) -> None:
        """SIGKILL the main process; its orphaned pool processes are then killed too (by the
        pids read before), and the worker is started again."""
        assert self.proc is not None
        tree = self.pids()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        time.sleep(1)
        kill_pids(tree)
        self.start()

    def kill_pool_process(self) -> bool:
        assert self.proc is not None
        kids = [p for p in self.pids() if p != self.proc.pid]
        if not kids:
            return False
        os.kill(random.choice(kids), signal.SIGKILL)
        return True

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        tree = self.pids()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        kill_pids(tree)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--chaos-s", type=float, default=120.0, help="how long faults are made")
    ap.add_argument("--deadline-s", type=float, default=900.0, help="bound on the whole run")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    random.seed(seed)

    import docker

    from api_client import CodeClient
    from executor.settings import load_settings

    tmp = Path(tempfile.mkdtemp(prefix="studio-soak-"))
    redis = RedisServer(tmp)
    redis.start()
    relay = Relay(redis.port)  # the workers' way to Redis; the client's is direct
    pg = PgCluster()
    pg.init()
    pg.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STUDIO_")}
    env.update(
        {
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_REDIS_URL": relay.url(),
            "STUDIO_DATABASE_URL": pg.url,
            "STUDIO_DATA_DIR": str(tmp),
            "STUDIO_CODE_CONCURRENCY": "2",
            "STUDIO_CODE_MAX_SECONDS": "10",
            "STUDIO_QUEUE_VISIBILITY_TIMEOUT_S": "25",
            "STUDIO_QUEUE_REAP_INTERVAL_S": "5",
            "STUDIO_QUEUE_PROBE_INTERVAL_S": "2",
            "STUDIO_CODE_LANGUAGES": "python",
        }
    )
    # The burst is queued as the workers start (before their first heartbeat): the client
    # queues it anyway instead of refusing it (STUDIO_QUEUE_REQUIRE_WORKER=0).
    settings = load_settings(
        enable_code_nodes=True,
        redis_url=redis.url,
        database_url=pg.url,
        data_dir=tmp,
        code_concurrency=2,
        queue_require_worker=False,
    )
    workers = [Worker("soak1", env, tmp), Worker("soak2", env, tmp)]
    dk = docker.from_env(timeout=60)
    since = int(time.time()) - 1
    t_start = time.monotonic()
    events: list[str] = []
    worker_deaths: list[tuple[float, float]] = []  # (time, time) a worker died mid-run
    client = None
    try:
        for w in workers:
            w.start()
        client = CodeClient(settings)
        # three users, so the chaos also hits runs waiting on their lists (worker.fair)
        jobs = {
            client.submit(TRIVIAL, "python", {"n": i}, user=f"soak{i % 3}"): i
            for i in range(args.jobs)
        }
        print(
            f"soak: seed {seed}, {len(jobs)} jobs submitted in "
            f"{time.monotonic() - t_start:.1f} s; chaos for {args.chaos_s:g} s",
            flush=True,
        )
        chaos_end = time.monotonic() + args.chaos_s
        actions = ["worker main", "pool process", "redis", "store", "redis silent"]
        while time.monotonic() < chaos_end:
            time.sleep(rng.uniform(3, 10))
            what = rng.choice(actions)
            at = time.monotonic() - t_start
            if what == "worker main":
                w = rng.choice(workers)
                w.kill_main()
                worker_deaths.append((time.time(), time.time()))
            elif what == "pool process":
                w = rng.choice(workers)
                if not w.kill_pool_process():
                    continue
                worker_deaths.append((time.time(), time.time()))
            elif what == "redis":
                redis.stop(kill=True)
                time.sleep(rng.uniform(0.5, 5))
                redis.start()
            elif what == "redis silent":
                relay.cut()
                cut = rng.uniform(5, 25)
                time.sleep(cut)
                relay.heal()
                what = f"silently: the workers' Redis connections ({cut:.0f} s)"
            else:
                pg.stop()
                down = rng.uniform(2, 20)
                time.sleep(down)
                pg.start()
                what += f" ({down:.0f} s)"
            verb = "cut" if what.startswith("silently") else "killed"
            events.append(f"{at:6.1f} s  {verb} {what}")
            print(f"  {events[-1]}", flush=True)
        # Let it settle: every job must end by the deadline.
        ids = list(jobs)
        deadline = t_start + args.deadline_s
        recs: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                recs = client.store.get_many(ids)
            except Exception:  # noqa: BLE001 - the store may be restarting
                time.sleep(1)
                continue
            if len(recs) == len(ids) and all(r.finished for r in recs.values()):
                break
            time.sleep(2)
        took = time.monotonic() - t_start
        time.sleep(3)
        starts: Counter[str] = Counter()
        for ev in dk.api.events(
            since=since,
            until=int(time.time()) + 1,
            decode=True,
            filters={"type": "container", "event": "start", "label": LABEL_JOB},
        ):
            job = (ev.get("Actor", {}).get("Attributes") or {}).get(LABEL_JOB)
            if job in jobs:
                starts[job] += 1
        left = [
            c["Id"][:12]
            for c in dk.api.containers(all=True, filters={"label": LABEL_JOB})
            if (c.get("Labels") or {}).get(LABEL_JOB) in jobs
        ]
    finally:
        for w in workers:
            w.stop()
        if client is not None:
            client.close()
        relay.stop()
        redis.stop()
        pg.cleanup()
    statuses = Counter(r.status.value for r in recs.values())
    wrong = [j for j, r in recs.items() if r.status == "succeeded" and r.output != 2 * jobs[j]]
    twice = {j: n for j, n in starts.items() if n > 1}
    lost = [j for j in jobs if j not in recs or recs[j].status == "queued"]
    stuck = [j for j, r in recs.items() if r.status in ("running", "cancelling")]
    not_succeeded = {
        j: (r.status.value, r.error and r.error.message)
        for j, r in recs.items()
        if r.finished and r.status != "succeeded"
    }
    twice_list = {
        j: {"starts": n, "attempts": recs[j].attempts if j in recs else None}
        for j, n in twice.items()
    }
    unexplained_twice = {
        j: v for j, v in twice_list.items() if v["attempts"] is not None and v["attempts"] < 2
    }
    report = {
        "seed": seed,
        "duration_s": round(took, 1),
        "faults": events,
        "submitted": len(jobs),
        "ended": dict(statuses),
        "wrong outputs": len(wrong),
        "executed more than once": twice_list,
        "executed more than once without a worker dying mid-run": unexplained_twice,
        "not succeeded": dict(list(not_succeeded.items())[:10]),
        "lost": len(lost),
        "stuck": len(stuck),
        "containers left": len(left),
    }
    print(json.dumps(report, indent=2))
    ok = not lost and not stuck and not left and not wrong and not unexplained_twice
    print("soak:", "PASS" if ok else "FAIL", f"(logs in {tmp})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
