"""Benchmark of a worker's upkeep under a backlog: N trivial jobs queued at once on one
worker (pre-started sandboxes on); sampled every 0.5 s (testkit/sandboxes.py watch_backlog):
the most ended sandboxes awaiting removal at once, and the drift of the worker's fds, RSS
and threads from job N/5 to job N. A worker whose upkeep starves grows here with N.

    python -m bench.upkeep [--n 300] [--slots 2]
"""

from __future__ import annotations

import argparse
import os
import time

from bench.common import bench_stack, end_stack
from testkit.processes import children
from testkit.sandboxes import watch_backlog

TRIVIAL = "def main(state):\n    return 1\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.upkeep")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--slots", type=int, default=2)
    args = p.parse_args()

    import docker

    stack = bench_stack(
        "upkeep", code_concurrency=args.slots, code_languages="python", queue_test_slots=0
    )
    try:
        client = stack.client
        worker = stack.start_worker(concurrency=args.slots, stop_timeout=30)
        owners = {f"{os.uname().nodename}:{pid}" for pid in children(worker.pid)}
        t0 = time.monotonic()
        ids = [client.submit(TRIVIAL, "python", {}) for _ in range(args.n)]
        api = docker.from_env(timeout=30).api
        seen = watch_backlog(api, client.store, ids, worker, owners, marks=(args.n // 5, args.n))
        took = time.monotonic() - t0
        ok = sum(1 for r in seen.records.values() if r.status == "succeeded")
        (f0, r0, t0_), (f1, r1, t1) = seen.usage[args.n // 5], seen.usage[args.n]
        print(
            f"# bench.upkeep: {args.n} trivial Python jobs queued at once on one worker "
            f"({args.slots} slots, 1 pre-started sandbox each), {ok} succeeded in {took:.1f} s"
        )
        print(
            f"| backlog of {args.n} | ended sandboxes awaiting removal: max "
            f"{seen.ended_max} ({seen.samples} samples; bound 2 x slots = {2 * args.slots}) | "
            f"job {args.n // 5} -> {args.n}: fds {f1 - f0:+d}, RSS {(r1 - r0) / 2**20:+.1f} MiB, "
            f"threads {t1 - t0_:+d} |"
        )
    finally:
        end_stack(stack)


if __name__ == "__main__":
    main()
