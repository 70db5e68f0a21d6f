"""Chaos soak (``make soak``, not part of ``make test``): trivial jobs over 2 workers while a
driver kills, at random moments, a worker's main process, a pool process, Redis (its own
redis-server with AOF) and the run store (its own PostgreSQL cluster), or cuts the workers'
Redis connections silently (they reach Redis through a loopback relay of the soak's own,
testkit/relay.py: every connection goes silent, no FIN, no RST, new ones held for 5-25 s),
for a bounded time. ``--faults`` picks the faults (worker pool redis store silent, the
default; engine; sentinel):

* ``engine``: the workers use a dockerd of the soak's own (testkit.engine.SecondEngine,
  never the machine's), restarted mid-burst; at the end no container is left on it;
* ``sentinel``: Redis is a primary, a replica and 3 sentinels on loopback, the workers and
  the client use its sentinel:// URL; the primary is SIGKILLed mid-burst (and started again
  as a replica). The relay faults (redis, silent) cannot share it: with both asked, the
  soak runs two rounds, each with its own services and accounting.

``--long`` (default 20,000 jobs): jobs are submitted in waves (``--wave`` outstanding at
most twice), and every ``--sample-every`` ended jobs a row is printed: each worker's open
fds, RSS and threads (its whole process tree) and the soak's containers (running+exited).
The faults are spread over the whole run (one every ``--fault-gap`` seconds, each kind
asked for once before any twice) until 90% of the jobs have ended. The verdict compares,
per worker, the first and last sample of its longest life (a worker whose main process a
fault killed starts afresh, so a leak shows within one life), and the containers over the
whole run. ``--jobs`` is the total over the rounds (two rounds when Sentinel and the relay
faults are both asked: each runs half).

``--retries``: every job is submitted with a retry policy (executor.retry) and four in ten
are made to test it: one in ten a node that allocates 150 MB under 128m (CODE_MEMORY; its
retry asks for more memory and passes; its policy retries CODE_TIMEOUT too: on a loaded host
the cgroup's reclaim before the OOM kill can outlast the timeout), two in ten that raise
(CODE_ERROR, their policy names it) while the clock is before a time the soak gives in their
state (the submit's time + FLAKY_S; their retries wait 60 s, then 120 s: an attempt before
it fails, the third passes at the latest), one in ten that always raises under a policy that
does not name CODE_ERROR (it must end failed after one attempt), the rest trivial under the
default policy (CODE_TIMEOUT, CODE_MEMORY). The accounting then counts attempts by cause
(the code's: CODE_ERROR, memory, timeout; the infrastructure's re-runs: claims beyond the
code's attempts) and fails the soak when a job made more code attempts than its policy
allows, retried an outcome its policy does not name, ended otherwise than its kind must, or
was executed more times than it was claimed (a job's claims = 1 + its policy retries taken +
the infrastructure's re-runs).

It prints the accounting: submitted, ended per status, executed more than once (counted
from Docker's events: a container started with the job's label, or a pre-started one
renamed to the job's name when the job took it; more executions than claims fail the
soak, more than one is allowed only for a job its worker's death or its policy ran again,
and listed), lost (must be 0), stuck (must be 0), containers left (must be 0). Exit 1
when an invariant fails.

    .venv/bin/python -m bench.soak --jobs 1000 --chaos-s 120

Everything runs on loopback; only the processes started here are killed, by pid. A SIGTERM
ends the soak through each round's ``finally`` (workers, relay, Redis, PostgreSQL, engine
stopped); after a SIGKILL its reaper stops them (testkit/reaper.py): none is left running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor.sandbox_names import NAME_PREFIX, POOL_NAME_PREFIX  # noqa: E402
from testkit.engine import SecondEngine  # noqa: E402
from testkit.postgres import PgCluster  # noqa: E402
from testkit.processes import kill_pids, process_tree, tree_usage  # noqa: E402
from testkit.reaper import disown, own, stop_on_sigterm  # noqa: E402
from testkit.redis import RedisServer  # noqa: E402
from testkit.relay import Relay  # noqa: E402
from testkit.sentinel import SentinelSet  # noqa: E402
from testkit.stack import base_env  # noqa: E402

CELERY = Path(sys.executable).with_name("celery")
TRIVIAL = "def main(state):\n    return state['n'] * 2\n"
LABEL_JOB = "studio.job_id"
LABEL_POOL = "studio.pool"
FAULTS = ("worker", "pool", "redis", "store", "silent", "engine", "sentinel")
DEFAULT_FAULTS = ("worker", "pool", "redis", "store", "silent")
RELAY_FAULTS = {"redis", "silent"}  # through the soak's relay: not with Sentinel

# --- --retries: the jobs' kinds, their policies and the ends they must reach --------------

#: a flaky node fails (CODE_ERROR) while the clock is before its state's ``until`` (its
#: submit + FLAKY_S, long enough for most first attempts of a burst to come before it); its
#: retries wait 60 s, then 120 s: its third attempt at the latest passes
FLAKY_S = 150.0
#: allocates and touches 150 MB: killed under 128m (CODE_MEMORY), passes under 256m
MEMORY_HOG = (
    "def main(state):\n"
    "    b = bytearray(150_000_000)\n"
    "    b[::4096] = b'x' * len(b[::4096])\n"
    "    return state['n'] * 2\n"
)
FLAKY = (
    "import time\n\n"
    "def main(state):\n"
    "    if time.time() < state['until']:\n"
    "        raise RuntimeError('flaky: this attempt came before ' + str(state['until']))\n"
    "    return state['n'] * 2\n"
)
RAISES = "def main(state):\n    raise ValueError('always: a bug the policy does not retry')\n"
#: kind -> (code, its retry policy, the memory it asks for)
KINDS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    # a cgroup at its limit without swap reclaims the interpreter's own pages before its OOM
    # kill: on a loaded host that can outlast the timeout (CODE_TIMEOUT, the same 128m next)
    "memory": (
        MEMORY_HOG,
        {
            "max_attempts": 3,
            "on": ["CODE_MEMORY", "CODE_TIMEOUT"],
            "backoff": {"initial_s": 0.5, "jitter": 0},
        },
        "128m",
    ),
    "flaky": (
        FLAKY,
        {
            "max_attempts": 4,
            "on": ["CODE_ERROR", "CODE_TIMEOUT"],
            "backoff": {"initial_s": 60, "factor": 2, "jitter": 0},
        },
        None,
    ),
    "raises": (RAISES, {"max_attempts": 3, "backoff": {"initial_s": 0.5, "jitter": 0}}, None),
    "trivial": (TRIVIAL, {"max_attempts": 2, "backoff": {"initial_s": 0.5}}, None),
}
#: what a retried attempt's outcome is counted as
CAUSE = {"CODE_ERROR": "code", "CODE_MEMORY": "memory", "CODE_TIMEOUT": "timeout"}


def kind_of(n: int, retries: bool) -> str:
    if not retries:
        return "plain"
    return {0: "memory", 1: "flaky", 2: "flaky", 3: "raises"}.get(n % 10, "trivial")


def submission(n: int, retries: bool) -> tuple[str, Any, dict[str, Any]]:
    """Job ``n``'s code, state and submit options."""
    kind = kind_of(n, retries)
    if kind == "plain":
        return TRIVIAL, {"n": n}, {}
    code, policy, memory = KINDS[kind]
    state: dict[str, Any] = {"n": n}
    if kind == "flaky":
        state["until"] = time.time() + FLAKY_S
    return code, state, {"retry": policy, "memory": memory}


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
        own(self.proc.pid)  # stopped by the soak's reaper if the soak ends first

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid) if self.proc else []

    def kill_main(self) -> None:
        """SIGKILL the main process; its orphaned pool processes are then killed too (by the
        pids read before), and the worker is started again."""
        assert self.proc is not None
        tree = self.pids()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        disown(self.proc.pid)
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
        disown(self.proc.pid)


class StartCounter(threading.Thread):
    """Counts the executions of the soak's jobs from Docker's events: a container started
    with a job's label (a cold start), or a pre-started one renamed to a job's name (the
    pool's, executor.runtimes.docker.pool: renamed when a job takes it, the soak's workers
    have STUDIO_CODE_PREWARM_RENAME_AFTER_S=0). From a stream that
    is opened again when the engine goes away (an engine restart ends the stream, and a
    restarted dockerd has forgotten its earlier events)."""

    def __init__(self, dk: Any, since: int) -> None:
        super().__init__(daemon=True)
        self.dk, self.since = dk, since
        self.seen: set[tuple[str, int]] = set()
        self.starts: Counter[str] = Counter()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                stream = self.dk.api.events(
                    since=self.since,
                    decode=True,
                    filters={"type": "container", "event": ["start", "rename"]},
                )
                for ev in stream:
                    key = (ev.get("id", ""), int(ev.get("timeNano", 0)))
                    self.since = max(self.since, int(ev.get("time", self.since)))
                    if key in self.seen:
                        continue
                    self.seen.add(key)
                    job = job_of_event(ev)
                    if job:
                        self.starts[job] += 1
                    if self.done.is_set():
                        break
            except Exception:  # noqa: BLE001 - the engine restarts: open the stream again
                pass
            self.done.wait(1)


def job_of_event(ev: dict[str, Any]) -> str | None:
    """The job a start event (its label) or a rename event (its new name) executes."""
    attrs = ev.get("Actor", {}).get("Attributes") or {}
    action = ev.get("Action") or ev.get("status")
    if action == "start":
        return attrs.get(LABEL_JOB)
    if action == "rename":
        name = str(attrs.get("name", "")).lstrip("/")
        if name.startswith(NAME_PREFIX) and not name.startswith(POOL_NAME_PREFIX):
            return name[len(NAME_PREFIX) :]
    return None


def soak_containers(dk: Any, jobs: dict[str, int], pids: set[int], own_engine: bool) -> list[Any]:
    """The soak's containers (running and exited): on its own engine all of them; on the
    machine's, those of its jobs and the pre-started ones of its workers' processes."""
    found = dk.api.containers(all=True)
    if own_engine:
        return list(found)
    mine = []
    for c in found:
        labels = c.get("Labels") or {}
        pool = labels.get(LABEL_POOL, "")
        if labels.get(LABEL_JOB) in jobs or (
            pool.rpartition(":")[2].isdigit() and int(pool.rpartition(":")[2]) in pids
        ):
            mine.append(c)
    return mine


def sample(workers: list[Worker], containers: list[Any]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for w in workers:
        fds, rss, threads = tree_usage(w.proc.pid) if w.proc else (0, 0, 0)
        row[w.name] = (fds, rss / 2**20, threads)
        row[f"{w.name} life"] = w.starts
    row["running"] = sum(1 for c in containers if c.get("State") == "running")
    row["exited"] = len(containers) - row["running"]
    return row


def print_row(ended: int, at: float, row: dict[str, Any], names: list[str]) -> None:
    cells = [f"{ended:>7}", f"{at:7.0f}"]
    for n in names:
        fds, rss, thr = row[n]
        cells.append(f"{fds:>5} {rss:8.1f} {thr:>4}")
    cells.append(f"{row['running']:>4} {row['exited']:>4}")
    print(" | ".join(cells), flush=True)


def longest_life(samples: list[dict[str, Any]], name: str, warmup: int) -> list[dict[str, Any]]:
    """The samples of worker ``name``'s longest life (consecutive rows with the same start
    count), its first ``warmup`` rows skipped (a fresh worker fills its caches)."""
    lives: list[list[dict[str, Any]]] = []
    for row in samples:
        if lives and lives[-1][0][f"{name} life"] == row[f"{name} life"]:
            lives[-1].append(row)
        else:
            lives.append([row])
    best = max(lives, key=len, default=[])
    return best[warmup:]


def flat_verdict(samples: list[dict[str, Any]], names: list[str], warmup: int) -> bool:
    """Flat: per worker, over its longest life, at most +16 fds, +25% (and 30 MB) RSS, +4
    threads; containers (running+exited) over the whole run at most 10 more."""
    ok = True
    for n in names:
        life = longest_life(samples, n, warmup)
        if len(life) < 2:
            print(f"  {n}: no life of {warmup + 2} samples or more (--sample-every)  NOT MEASURED")
            ok = False
            continue
        first, last = life[0], life[-1]
        (f0, r0, t0), (f1, r1, t1) = first[n], last[n]
        grew = []
        if f1 - f0 > 16:
            grew.append(f"fds {f0}->{f1}")
        if r1 - r0 > max(30.0, 0.25 * r0):
            grew.append(f"RSS {r0:.0f}->{r1:.0f} MB")
        if t1 - t0 > 4:
            grew.append(f"threads {t0}->{t1}")
        print(
            f"  {n} (life {first[f'{n} life']}: {last['ended'] - first['ended']} jobs ended "
            f"over {last['at'] - first['at']:.0f} s, {len(life)} samples): fds {f0}->{f1}, "
            f"RSS {r0:.1f}->{r1:.1f} MB, threads {t0}->{t1}",
            end="",
        )
        print(f"  GROWS ({', '.join(grew)})" if grew else "  flat")
        ok = ok and not grew
    first, last = samples[min(warmup, len(samples) - 1)], samples[-1]
    c0, c1 = first["running"] + first["exited"], last["running"] + last["exited"]
    print(
        f"  containers (samples at {first['at']:.0f} s and {last['at']:.0f} s): {c0}->{c1}",
        "flat" if c1 - c0 <= 10 else "GROWS",
    )
    return ok and c1 - c0 <= 10


def rounds_of(faults: list[str]) -> list[list[str]]:
    """Sentinel workers get the primary from the sentinels, so the relay faults (and the
    single redis-server they act on) run in a round of their own."""
    if "sentinel" in faults and RELAY_FAULTS & set(faults):
        return [
            [f for f in faults if f != "sentinel"],
            [f for f in faults if f not in RELAY_FAULTS],
        ]
    return [faults]


def remove_engine(engine: SecondEngine) -> None:
    """SecondEngine.remove without pytest: never rm -rf through a live mount."""
    mounted = [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(str(engine.root))
    ]
    if mounted:
        print(f"soak: the soak's engine left mounts, {engine.root} kept: {mounted}")
        return
    shutil.rmtree(engine.root, ignore_errors=True)


def run_round(args: argparse.Namespace, faults: list[str], seed: int) -> bool:
    rng = random.Random(seed)
    random.seed(seed)

    import docker

    from api_client import CodeClient
    from executor.settings import load_settings

    tmp = Path(tempfile.mkdtemp(prefix="studio-soak-"))
    sentinel = "sentinel" in faults
    redis: RedisServer | None = None
    relay: Relay | None = None
    sentinels: SentinelSet | None = None
    engine: SecondEngine | None = None
    extra_settings: dict[str, Any] = {}
    env = base_env()  # this checkout's, without this process's STUDIO_*
    if sentinel:
        sentinels = SentinelSet(tmp).start()
        client_url = workers_url = sentinels.url
        env["STUDIO_REDIS_SENTINEL_MASTER"] = sentinels.master
        extra_settings["redis_sentinel_master"] = sentinels.master
    else:
        redis = RedisServer(tmp)
        redis.start()
        relay = Relay(redis.port)  # the workers' way to Redis; the client's is direct
        client_url, workers_url = redis.url, relay.url()
    pg = PgCluster()
    pg.init()
    pg.start()
    if "engine" in faults:
        engine = SecondEngine()
        engine.start()
        engine.load(args.image)
        env["DOCKER_HOST"] = engine.host
        dk = docker.DockerClient(base_url=engine.host, timeout=60)
    else:
        dk = docker.from_env(timeout=60)
    env.update(
        {
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_REDIS_URL": workers_url,
            "STUDIO_DATABASE_URL": pg.url,
            "STUDIO_DATA_DIR": str(tmp),
            "STUDIO_CODE_IMAGE": args.image,
            "STUDIO_CODE_CONCURRENCY": "2",
            "STUDIO_CODE_MAX_SECONDS": "10",
            "STUDIO_QUEUE_VISIBILITY_TIMEOUT_S": "25",
            "STUDIO_QUEUE_REAP_INTERVAL_S": "5",
            "STUDIO_QUEUE_PROBE_INTERVAL_S": "2",
            "STUDIO_CODE_LANGUAGES": "python",
            # every pre-started sandbox renamed after the job that takes it, however short:
            # the executions are counted from those renames (StartCounter)
            "STUDIO_CODE_PREWARM_RENAME_AFTER_S": "0",
        }
    )
    # The burst is queued as the workers start (before their first heartbeat): the client
    # queues it anyway instead of refusing it (STUDIO_QUEUE_REQUIRE_WORKER=0).
    settings = load_settings(
        enable_code_nodes=True,
        redis_url=client_url,
        database_url=pg.url,
        data_dir=tmp,
        code_concurrency=2,
        queue_require_worker=False,
        **extra_settings,
    )
    workers = [Worker("soak1", env, tmp), Worker("soak2", env, tmp)]
    names = [w.name for w in workers]
    counter = StartCounter(dk, int(time.time()) - 1)
    counter.start()
    t_start = time.monotonic()
    events: list[str] = []
    pids: set[int] = set()  # every pid of the workers' trees seen (their pre-started sandboxes)
    jobs: dict[str, int] = {}
    pending: set[str] = set()
    ended = 0
    submit_errors = 0
    self_exits = 0  # workers that stopped without a fault killing them, restarted
    first_error = ""
    samples: list[dict[str, Any]] = []
    client = None
    left: list[str] = []
    bag: list[str] = []
    try:
        for w in workers:
            w.start()
        client = CodeClient(settings)
        print(
            f"soak: seed {seed}, faults {' '.join(faults) or 'none'}, {args.jobs} jobs"
            + (" with retry policies (--retries)" if args.retries else "")
            + (f" in waves of {args.wave}" if args.long else "")
            + (
                f"; chaos for {args.chaos_s:g} s"
                if args.chaos_s is not None
                else f"; chaos until {int(args.jobs * 0.9)} jobs have ended"
            )
            + f", a fault every {args.fault_gap[0]:g}-{args.fault_gap[1]:g} s",
            flush=True,
        )
        if args.long:
            print(
                f"{'ended':>7} | {'s':>7} | "
                + " | ".join(f"{n + ' fds':>5} {'RSS MB':>8} {'thr':>4}" for n in names)
                + " | run  exit",
                flush=True,
            )
        chaos_end = t_start + (args.chaos_s if args.chaos_s is not None else float("inf"))
        kinds: Counter[str] = Counter()

        def chaos_on() -> bool:
            if args.chaos_s is None:  # --long: over the run, until 90% of the jobs ended
                return ended < args.jobs * 0.9
            return time.monotonic() < chaos_end

        next_fault = time.monotonic() + rng.uniform(*args.fault_gap)
        next_sample = args.sample_every
        deadline = t_start + args.deadline_s
        n = 0
        while time.monotonic() < deadline:
            # a wave when the backlog is under one (all of them at once without --long)
            if n < args.jobs and len(pending) < args.wave:
                upto = min(args.jobs, n + (args.wave if args.long else args.jobs))
                while n < upto:
                    try:
                        node, state, options = submission(n, args.retries)
                        job = client.submit(node, "python", state, user=f"soak{n % 3}", **options)
                    except Exception as e:  # noqa: BLE001 - Redis or the store mid-fault: later
                        submit_errors += 1
                        first_error = first_error or f"{type(e).__name__}: {e}"[:300]
                        break
                    jobs[job] = n
                    pending.add(job)
                    n += 1
            if faults and chaos_on() and time.monotonic() >= next_fault:
                if not bag:
                    bag = list(faults)
                    rng.shuffle(bag)  # every fault asked for comes once before any twice
                kind = what = bag.pop()
                at = time.monotonic() - t_start
                what = fault(what, rng, workers, redis, relay, pg, engine, sentinels)
                if what:
                    kinds[kind] += 1
                    verb = "cut" if what.startswith("silently") else "killed"
                    told = what if what.startswith("restarted") else f"{verb} {what}"
                    events.append(f"{at:6.1f} s  {told}")
                    print(f"  {events[-1]}", flush=True)
                next_fault = time.monotonic() + rng.uniform(*args.fault_gap)
            try:
                done = [j for j, s in client.store.statuses(pending).items() if s.finished]
            except Exception:  # noqa: BLE001 - the store may be restarting
                time.sleep(1)
                continue
            pending.difference_update(done)
            ended += len(done)
            for w in workers:
                if w.proc is not None and w.proc.poll() is not None:
                    # it stopped by itself (e.g. Celery's "Could not start worker processes"
                    # when a pool process is killed as it starts): a supervisor's
                    # restart: on-failure, counted and told
                    exited = w.proc.returncode
                    kill_pids(w.pids())
                    w.start()
                    self_exits += 1
                    at = time.monotonic() - t_start
                    events.append(f"{at:6.1f} s  {w.name} exited by itself ({exited}): restarted")
                    print(f"  {events[-1]}", flush=True)
                pids.update(w.pids())
            if args.long and ended >= next_sample:
                next_sample += args.sample_every
                row = sample(workers, soak_containers(dk, jobs, pids, engine is not None))
                row["at"] = time.monotonic() - t_start
                row["ended"] = ended
                samples.append(row)
                print_row(ended, time.monotonic() - t_start, row, names)
            if n >= args.jobs and not pending and not chaos_on():
                break
            time.sleep(0.5 if pending else 1)
        took = time.monotonic() - t_start
        time.sleep(3)
        for w in workers:
            pids.update(w.pids())
            w.stop()
        time.sleep(2)
        left = [c["Id"][:12] for c in soak_containers(dk, jobs, pids, engine is not None)]
        # the accounting, a chunk at a time (no list of 20,000 records kept)
        statuses: Counter[str] = Counter()
        wrong = lost = stuck = 0
        not_succeeded: dict[str, Any] = {}
        failed_by_infra = blamed_on_code = 0
        attempts: dict[str, int] = {}
        twice = {j: k for j, k in counter.starts.items() if k > 1 and j in jobs}
        retried = RetryBook()
        ids = list(jobs)
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            recs = client.store.get_many(chunk, inputs=False)
            lost += sum(1 for j in chunk if j not in recs)
            for j, r in recs.items():
                statuses[r.status.value] += 1
                kind = kind_of(jobs[j], args.retries)
                if args.retries:
                    retried.add(j, kind, r, counter.starts.get(j, 0))
                if r.status == "queued":
                    lost += 1
                elif r.status in ("running", "cancelling"):
                    stuck += 1
                elif kind == "raises":
                    pass  # its own end is judged by RetryBook (failed CODE_ERROR, once)
                elif r.status == "succeeded" and r.output != 2 * jobs[j]:
                    wrong += 1
                elif r.finished and r.status != "succeeded":
                    # every soak job but a "raises" one (--retries) ends succeeded: any other
                    # end is the infrastructure's doing (the faults); a CODE_* one blames the
                    # code for it
                    failed_by_infra += 1
                    code = r.error.code.value if r.error is not None else None
                    blamed_on_code += bool(code and code.startswith("CODE_"))
                    if len(not_succeeded) < 10:
                        not_succeeded[j] = (r.status.value, code, r.error and r.error.message)
                if j in twice:
                    attempts[j] = r.attempts
    finally:
        counter.done.set()
        for w in workers:
            w.stop()
        if client is not None:
            client.close()
        if relay is not None:
            relay.stop()
        if redis is not None:
            redis.stop()
        if sentinels is not None:
            sentinels.stop()
        pg.cleanup()
        if engine is not None:
            engine.stop()
            remove_engine(engine)
    twice_list = {j: {"executions": k, "claims": attempts.get(j)} for j, k in twice.items()}
    # a job's claims are 1 + its policy's retries taken + the infrastructure's re-runs
    unexplained_twice = {j: twice_list[j] for j, k in twice.items() if k > (attempts.get(j) or 0)}
    report = {
        "seed": seed,
        "faults asked": faults,
        "duration_s": round(took, 1),
        "faults made, per kind": dict(kinds),
        "faults": events,
        "workers that exited by themselves (restarted)": self_exits,
        "submitted": len(jobs),
        "submits refused (tried again)": submit_errors,
        "first refusal": first_error,
        "ended": dict(statuses),
        "wrong outputs": wrong,
        "executed more than once": len(twice_list) if args.retries else twice_list,
        "executed more times than claimed (beyond the policy and the re-runs)": unexplained_twice,
        "not succeeded": not_succeeded,
        "failed by infrastructure": failed_by_infra,
        "blamed on code": blamed_on_code,
        "lost": lost,
        "stuck": stuck,
        "containers left": len(left),
    }
    if args.retries:
        report["retries"] = retried.report()
    print(json.dumps(report, indent=2))
    flat = True
    if args.long:
        if len(samples) >= 2:
            print(f"the longest life of each worker, its first {args.warmup} sample(s) skipped:")
            flat = flat_verdict(samples, names, args.warmup)
            restarts = {w.name: w.starts - 1 for w in workers}
            print(
                "  verdict:",
                "FLAT" if flat else "NOT FLAT",
                f"(worker restarts by the faults: {restarts})",
            )
        else:
            print("verdict: too few samples (--sample-every)")
            flat = False
    ok = (
        not lost
        and not stuck
        and not left
        and not wrong
        and not unexplained_twice
        and not failed_by_infra
        and flat
        and (not args.retries or retried.ok())
    )
    print("soak:", "PASS" if ok else "FAIL", f"(logs in {tmp})", flush=True)
    return ok


class RetryBook:
    """The accounting of ``--retries``: attempts by cause, and the policy kept."""

    def __init__(self) -> None:
        self.kinds: dict[str, Counter[str]] = {}
        self.causes: Counter[str] = Counter()
        self.claims = self.executions = 0
        self.memory_raised = 0
        #: invariant -> {job: what was seen} (at most 10 listed each, all counted)
        self.broken: dict[str, dict[str, Any]] = {}
        self.broken_count: Counter[str] = Counter()

    def _broke(self, what: str, job: str, seen: Any) -> None:
        self.broken_count[what] += 1
        listed = self.broken.setdefault(what, {})
        if len(listed) < 10:
            listed[job] = seen

    def add(self, job: str, kind: str, r: Any, executions: int) -> None:
        _, policy, _ = KINDS[kind]
        on = policy.get("on", ["CODE_TIMEOUT", "CODE_MEMORY"])
        history = list(r.history)
        ends = self.kinds.setdefault(kind, Counter())
        ends["jobs"] += 1
        ends[r.status.value] += 1
        if not r.finished:
            return  # lost or stuck: counted by the soak's own accounting
        code_attempts = len(history)
        infra = max(0, r.attempts - max(1, code_attempts))
        self.claims += r.attempts
        self.executions += executions
        self.causes["first attempts"] += 1 if code_attempts else 0
        self.causes["infrastructure (re-runs: claims beyond the code's attempts)"] += infra
        for a in history[:-1]:
            self.causes[f"{CAUSE.get(a.code or '', a.code)} ({a.code} retried)"] += 1
            if a.code not in on or a.retry_at is None:
                self._broke("retried an outcome its policy does not name", job, a.code)
        if code_attempts > policy["max_attempts"]:
            self._broke("more code attempts than its policy allows", job, code_attempts)
        last = history[-1].code if history else None
        seen = (r.status.value, r.error.code.value if r.error else None, code_attempts)
        if kind == "raises":
            good = r.status == "failed" and last == "CODE_ERROR" and code_attempts == 1
        elif kind == "memory":
            # succeeded, after a CODE_MEMORY attempt whose next one had more memory
            oom = [i for i, a in enumerate(history[:-1]) if a.code == "CODE_MEMORY"]
            good = r.status == "succeeded" and bool(oom)
            raised = bool(oom) and (history[oom[0] + 1].memory_bytes or 0) > (
                history[oom[0]].memory_bytes or 0
            )
            if good and raised:
                self.memory_raised += 1
            elif good:
                self._broke(
                    "a memory retry without more memory", job, [a.memory_bytes for a in history]
                )
        else:
            good = r.status == "succeeded"
        if good:
            ends["as its kind must end"] += 1
        else:
            self._broke(f"a {kind} job did not end as it must", job, seen)
        if code_attempts and r.attempts < code_attempts:
            self._broke("fewer claims than code attempts", job, (r.attempts, code_attempts))

    def ok(self) -> bool:
        return not self.broken_count

    def report(self) -> dict[str, Any]:
        return {
            "policies": {k: policy for k, (_, policy, _) in KINDS.items()},
            "per kind": {k: dict(v) for k, v in sorted(self.kinds.items())},
            "attempts by cause": dict(self.causes),
            "memory retries that asked for more memory": self.memory_raised,
            "claims (1 + policy retries taken + infrastructure re-runs, summed)": self.claims,
            "executions seen (container starts + pool renames)": self.executions,
            "invariants broken": {k: self.broken_count[k] for k in self.broken_count},
            "first offenders": self.broken,
        }


def down(stop: Any, start: Any, seconds: float) -> float:
    """``stop()``, ``seconds`` later ``start()``; returns ``seconds``."""
    stop()
    time.sleep(seconds)
    start()
    return seconds


def fault(
    what: str,
    rng: random.Random,
    workers: list[Worker],
    redis: RedisServer | None,
    relay: Relay | None,
    pg: PgCluster,
    engine: SecondEngine | None,
    sentinels: SentinelSet | None,
) -> str:
    """Make fault ``what``; returns how it is told ('' when there was nothing to do)."""
    if what == "worker":
        rng.choice(workers).kill_main()
        return "worker main"
    if what == "pool":
        return "pool process" if rng.choice(workers).kill_pool_process() else ""
    if what == "redis" and redis is not None:
        down(lambda: redis.stop(kill=True), redis.start, rng.uniform(0.5, 5))
        return "redis"
    if what == "silent" and relay is not None:
        cut = down(relay.cut, relay.heal, rng.uniform(5, 25))
        return f"silently: the workers' Redis connections ({cut:.0f} s)"
    if what == "store":
        return f"store ({down(pg.stop, pg.start, rng.uniform(2, 20)):.0f} s)"
    if what == "engine" and engine is not None:
        off = down(engine.stop, engine.start, rng.uniform(1, 5))
        return f"restarted the soak's Docker engine (down {off:.0f} s)"
    if what == "sentinel" and sentinels is not None:
        dead = sentinels.kill_primary()
        new = sentinels.other(dead)
        t0 = time.monotonic()
        try:
            sentinels.wait_master(sentinels.ports[new], 30)
        except RuntimeError:
            return f"the Redis primary {dead} (no failover in 30 s)"
        took = time.monotonic() - t0
        sentinels.start_node(dead, replica_of=sentinels.ports[new])  # the next kill's replica
        try:
            sentinels.wait_synced(dead, 30)
        except RuntimeError:
            pass
        return f"the Redis primary {dead} (SIGKILL; {new} primary after {took:.1f} s)"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=None, help="1000; 20,000 with --long")
    ap.add_argument("--long", action="store_true", help="waves, resource samples, verdict")
    ap.add_argument("--wave", type=int, default=500, help="jobs per wave (--long)")
    ap.add_argument("--sample-every", type=int, default=None, help="ended jobs per sample row")
    ap.add_argument("--warmup", type=int, default=1, help="samples before the first compared")
    ap.add_argument("--faults", nargs="*", choices=FAULTS, default=list(DEFAULT_FAULTS))
    ap.add_argument(
        "--chaos-s",
        type=float,
        default=None,
        help="how long faults are made: 120; the run with --long",
    )
    ap.add_argument(
        "--fault-gap",
        type=float,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="seconds between faults: 3 10; 20 60 with --long",
    )
    ap.add_argument("--deadline-s", type=float, default=None, help="bound on each round")
    ap.add_argument(
        "--retries",
        action="store_true",
        help="submit with retry policies (some nodes fail once for memory or CODE_ERROR) "
        "and count attempts by cause",
    )
    ap.add_argument("--image", default="studio-code:1")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    # SIGTERM raises SystemExit: each round's finally stops its workers and services (what
    # a SIGKILL leaves, the soak's reaper stops: testkit/reaper.py)
    stop_on_sigterm()
    if args.jobs is None:
        args.jobs = 20_000 if args.long else 1000
    if args.chaos_s is None and not args.long:
        args.chaos_s = 120.0
    if args.fault_gap is None:
        args.fault_gap = [20.0, 60.0] if args.long else [3.0, 10.0]
    if args.sample_every is None:
        args.sample_every = max(100, args.jobs // 20)
    if args.deadline_s is None:
        args.deadline_s = max(900.0, args.jobs * 0.5) if args.long else 900.0
    seed = args.seed if args.seed is not None else int(time.time())
    ok = True
    rounds = rounds_of(list(dict.fromkeys(args.faults)))
    total = args.jobs
    for i, faults in enumerate(rounds):
        # --jobs is the total: each round runs its share
        args.jobs = total // len(rounds) + (1 if i < total % len(rounds) else 0)
        ok = run_round(args, faults, seed + i) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
