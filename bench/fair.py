"""Benchmark of fair share between users (worker.fair), in ONE run: its own redis-server,
one Celery worker (prefork, ``--slots`` run slots), the real client, Docker, a SQLite run
store. No assertions: it measures.

* a flood: user ``ann`` submits ``--flood`` trivial runs at once, alone; its wall time
  (first submit -> last stored result) and throughput;
* the same flood while ``--others`` other users each submit one run, spread over the
  flood: their start delay (submit -> claimed, the store's queued_at -> started_at) p50 /
  p99, and the flood's wall time beside the flood alone (with fairness it should stay
  >= 0.9 x the flood alone's throughput: fairness reorders, it must not slow);
* the same with STUDIO_QUEUE_RUN_FAIRNESS=off (one FIFO: the others wait behind the flood);
* submit overhead: ``submit()`` with fairness on vs off, interleaved (the enqueue script
  vs kombu's LPUSH), while the worker runs the jobs.

With ``--keys`` it measures only the concurrency keys' cost: submit -> claim (the store's
queued_at -> started_at) of one run at a time on an idle worker, keys on (the run names a
tenant and a workflow; STUDIO_QUEUE_RUN_SHARE_KEY=tenant/user, a tenant cap and a workflow
cap set high enough never to hold) vs off (user share, no caps, no keys), interleaved.

    python -m bench.fair [--slots 4] [--flood 500] [--others 10] [--submits 100] [--rounds 2]
    python -m bench.fair --keys [--submits 100]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

from bench.common import bench_stack, end_stack, pct
from bench.queue import TRIVIAL


def _wait(client: Any, ids: list[str], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        recs = client.store.get_many(ids, inputs=False)
        if len(recs) == len(ids) and all(r.finished for r in recs.values()):
            return recs
        if time.monotonic() > deadline:
            raise RuntimeError(f"{sum(not r.finished for r in recs.values())} runs not done")
        time.sleep(0.2)


def flood(
    client: Any, n: int, others: int = 0, spread_s: float = 0.0
) -> tuple[float, list[float], list[int]]:
    """ann's ``n`` runs, and ``others`` one-run users spread over ``spread_s``; returns the
    flood's wall time (s), the others' start delays (s) and how many of ann's runs started
    between each other run's submit and its start."""
    other_ids: list[str] = []

    def trickle() -> None:
        for i in range(others):
            time.sleep(spread_s / (others + 1))
            other_ids.append(client.submit(TRIVIAL, "python", {}, user=f"user{i:02d}"))

    side = threading.Thread(target=trickle)
    ids = [client.submit(TRIVIAL, "python", {}, user="ann") for _ in range(n)]
    side.start()
    side.join()
    recs = _wait(client, ids + other_ids, 60 + n * 2.0)
    ann = [recs[j] for j in ids]
    wall = (max(r.finished_at for r in ann) - min(r.queued_at for r in ann)).total_seconds()
    delays, ahead = [], []
    for j in other_ids:
        rec = recs[j]
        delays.append((rec.started_at - rec.queued_at).total_seconds())
        ahead.append(sum(1 for a in ann if rec.queued_at < a.started_at < rec.started_at))
    return wall, delays, ahead


def submit_overhead(on: Any, off: Any, n: int) -> tuple[list[float], list[float]]:
    """ms per submit(), fairness on vs off, interleaved (same machine noise on both)."""
    times: tuple[list[float], list[float]] = ([], [])
    ids: list[tuple[Any, str]] = []
    for _ in range(n):
        for i, client in enumerate((on, off)):
            t0 = time.perf_counter()
            job = client.submit(TRIVIAL, "python", {}, user="sub")
            times[i].append((time.perf_counter() - t0) * 1000)
            ids.append((client, job))
    _wait(on, [j for _, j in ids], 60 + n * 2.0)
    return times


#: the settings of the keys-on side (caps high enough never to hold a run)
KEYS_ON: dict[str, Any] = {
    "queue_run_share_key": "tenant/user",
    "queue_run_tenant_slots": 1000,
    "queue_run_workflow_slots": 1000,
}


def keys_latency(on: Any, off: Any, n: int) -> tuple[list[float], list[float]]:
    """ms from submit to claim (the store's queued_at -> started_at) of one run at a time,
    keys on vs off, interleaved (each side first in turn); each run ends before the next is
    sent."""
    times: tuple[list[float], list[float]] = ([], [])
    for k in range(n):
        for i in (0, 1) if k % 2 == 0 else (1, 0):  # each side first in turn
            client = (on, off)[i]
            keys = {"tenant": "acme", "workflow": "nightly"} if i == 0 else {}
            job = client.submit(TRIVIAL, "python", {}, user="ann", **keys)
            rec = _wait(client, [job], 60)[job]
            times[i].append((rec.started_at - rec.queued_at).total_seconds() * 1000)
    return times


def script_cost(client: Any, n: int) -> dict[str, tuple[list[float], list[float]]]:
    """µs of one enqueue (with its release) and one end of worker/fair.lua, keys on vs off,
    interleaved, on the stack's Redis (no worker: code.run emptied between the two)."""
    import json

    from worker.fair import FairQueue

    sides = {
        "on": (FairQueue(client, 0, share="tenant/user", tenant_cap=1000, workflow_cap=1000), 1),
        "off": (FairQueue(client, 0), 0),
    }
    msg = json.dumps({"headers": {"id": "x"}, "body": "x" * 600})
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in sides}
    for k in range(n):
        for name in ("on", "off") if k % 2 == 0 else ("off", "on"):
            fair, keyed = sides[name]
            keys = {"tenant": "acme", "workflow": "nightly"} if keyed else {}
            t0 = time.perf_counter()
            fair.enqueue(f"bench-{name}-{k}", "ann", msg, **keys)
            t1 = time.perf_counter()
            client.delete("code.run")
            t2 = time.perf_counter()
            fair.ended([f"bench-{name}-{k}"])
            t3 = time.perf_counter()
            out[name][0].append((t1 - t0) * 1e6)
            out[name][1].append((t3 - t2) * 1e6)
    return out


def keys_main(args: Any) -> None:
    from testkit.stack import Stack

    slots = {"code_concurrency": args.slots, "queue_test_slots": 0}
    # the workers run with the keys' settings (their releases pass the caps); the off side
    # is a client without them, on the same Redis and store
    stack = bench_stack("fair-keys", queue_run_fairness="users", **slots, **KEYS_ON)
    plain = Stack(
        stack.workdir, redis_url=stack.redis_url, database_url=stack.database_url, **slots
    )
    try:
        on, off = stack.client, plain.client
        stack.start_worker(concurrency=args.slots, stop_timeout=30)
        for _ in range(2 * args.slots):  # warm-up: every pool process, the engine, the store
            on.wait(on.submit(TRIVIAL, "python", {}), 60)
        t_on, t_off = keys_latency(on, off, args.submits)
        for worker in stack.workers:  # the worker gone: the script alone, on the same Redis
            worker.stop()
        cost = script_cost(plain.client.redis, 20 * args.submits)
        print(
            f"# bench.fair --keys: 1 worker, {args.slots} run slots, prefork; SQLite store; "
            f"redis-server; trivial Python node, one run at a time; {os.cpu_count()} CPUs"
        )
        print("| what | keys on | keys off | on − off |")
        print("|---|---|---|---|")
        print(
            f"| submit → claim, p50 / p95 (n={args.submits} each, interleaved; on: tenant + "
            f"workflow named, share key tenant/user, tenant and workflow caps) | "
            f"{pct(t_on, 50):.2f} / {pct(t_on, 95):.2f} ms | "
            f"{pct(t_off, 50):.2f} / {pct(t_off, 95):.2f} ms | "
            f"{pct(t_on, 50) - pct(t_off, 50):+.2f} ms (goal: within 1 ms) |"
        )
        for i, what in enumerate(("enqueue (+ its release)", "end of a run (+ release)")):
            on_us, off_us = cost["on"][i], cost["off"][i]
            print(
                f"| worker/fair.lua {what}, p50 / p95 (n={len(on_us)} each, interleaved, "
                f"client round trip included) | {pct(on_us, 50):.0f} / {pct(on_us, 95):.0f} µs | "
                f"{pct(off_us, 50):.0f} / {pct(off_us, 95):.0f} µs | "
                f"{(pct(on_us, 50) - pct(off_us, 50)) / 1000:+.3f} ms |"
            )
    finally:
        plain.stop()
        end_stack(stack)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--flood", type=int, default=500)
    p.add_argument("--others", type=int, default=10)
    p.add_argument("--submits", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2, help="floods of each kind")
    p.add_argument("--keys", action="store_true", help="only the keys on vs off row")
    args = p.parse_args()
    if args.keys:
        keys_main(args)
        return

    from testkit.stack import Stack

    slots = {"code_concurrency": args.slots, "queue_test_slots": 0}
    stack = bench_stack("fair", queue_run_fairness="users", **slots)
    # the same Redis and store, fairness off: a client only
    fifo = Stack(
        stack.workdir,
        redis_url=stack.redis_url,
        database_url=stack.database_url,
        queue_run_fairness="off",
        **slots,
    )
    try:
        on, off = stack.client, fifo.client
        stack.start_worker(concurrency=args.slots, stop_timeout=30)
        for _ in range(2 * args.slots):  # warm-up: every pool process, the engine, the store
            on.wait(on.submit(TRIVIAL, "python", {}), 60)

        alone, _, _ = flood(on, args.flood)
        spread = alone * 0.8
        walls: dict[str, list[float]] = {"alone": [alone], "on": [], "off": []}
        delays: dict[str, list[float]] = {"on": [], "off": []}
        ahead: dict[str, list[int]] = {"on": [], "off": []}
        # rounds in turn (alone, fair, FIFO; then the next round in another order), so
        # each side sees the same machine noise
        for r in range(args.rounds):
            order = ["on", "off", "alone"] if r % 2 == 0 else ["alone", "off", "on"]
            for side in order:
                if side == "alone" and r == 0:
                    continue  # measured above (it also sized the spread)
                client = off if side == "off" else on
                others = 0 if side == "alone" else args.others
                wall, d, a = flood(client, args.flood, others, spread)
                walls[side].append(wall)
                if side != "alone":
                    delays[side] += d
                    ahead[side] += a
        alone = sum(walls["alone"]) / len(walls["alone"])
        fair_wall = sum(walls["on"]) / len(walls["on"])
        fifo_wall = sum(walls["off"]) / len(walls["off"])
        fair_delays, fifo_delays = delays["on"], delays["off"]
        fair_ahead, fifo_ahead = ahead["on"], ahead["off"]
        sub_on, sub_off = submit_overhead(on, off, args.submits)

        def s(xs: list[float], q: float) -> str:
            return f"{pct(xs, q):.2f} s"

        print(
            f"# bench.fair: 1 worker, {args.slots} run slots (STUDIO_QUEUE_TEST_SLOTS=0), "
            f"prefork; SQLite store; redis-server (AOF everysec); trivial Python node; "
            f"{os.cpu_count()} CPUs"
        )
        print("| what | fairness users | fairness off |")
        print("|---|---|---|")
        print(
            f"| other users' start delay behind a {args.flood}-run flood, p50 / p99 "
            f"({args.others} users, one run each, spread over the flood) | "
            f"{s(fair_delays, 50)} / {s(fair_delays, 99)} | "
            f"{s(fifo_delays, 50)} / {s(fifo_delays, 99)} |"
        )
        print(
            f"| … the flood's runs that started before theirs, p50 / max | "
            f"{pct([float(a) for a in fair_ahead], 50):.0f} / {max(fair_ahead, default=0)} | "
            f"{pct([float(a) for a in fifo_ahead], 50):.0f} / {max(fifo_ahead, default=0)} |"
        )
        print(
            f"| flood throughput, alone ({args.flood} runs, fairness on) | "
            f"{args.flood / alone:.2f} runs/s ({alone:.1f} s, mean of {len(walls['alone'])}) | |"
        )
        print(
            f"| flood throughput with the others | {args.flood / fair_wall:.2f} runs/s "
            f"({fair_wall:.1f} s; throughput with / alone = {alone / fair_wall:.2f}, goal ≥ 0.9) | "
            f"{args.flood / fifo_wall:.2f} runs/s ({fifo_wall:.1f} s) |"
        )
        print(
            f"| submit() overhead, p50 / p95 (n={args.submits} each, interleaved) | "
            f"{pct(sub_on, 50):.2f} / {pct(sub_on, 95):.2f} ms | "
            f"{pct(sub_off, 50):.2f} / {pct(sub_off, 95):.2f} ms |"
        )
    finally:
        fifo.stop()
        end_stack(stack)


if __name__ == "__main__":
    main()
