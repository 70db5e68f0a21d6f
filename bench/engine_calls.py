"""What one job asks of the Docker engine (issue 43): the calls it makes, counted per
endpoint, and the host CPU the engine spends on it, beside the raw lifecycle of one
container (create, attach, start, wait, remove with the Docker SDK, the same image, policy
and stdin: ``bench.common.raw_container``) measured in the same run. No assertions.

* **Calls**: the executor's client goes through a counting relay (``bench.engine_relay``, a
  unix socket of its own in front of the engine's, DOCKER_HOST pointed at it) and each HTTP
  request is counted as ``METHOD /path/template``. A pooled job (one pre-started sandbox,
  as a worker's pool process: each job taken once the pool is settled, its window running
  until it is settled again) counts its replacement's start and its own removal; a cold job
  its own life. The pooled job is measured both ways: with the rename deferred
  (STUDIO_CODE_PREWARM_RENAME_AFTER_S=0.5, the opt-in cut: a short job never renamed) and
  as the default (``pooled, renamed at take``: 0, every taken sandbox renamed after its
  job, which is what removes an earlier attempt's sandbox of a re-run job). What
  the pool does by the clock (the image id every 10 s) falls in too, spread over the jobs.
* **CPU**: interleaved job by job, each side's jobs through the engine's socket itself (no
  relay), all of it in a Docker engine of the bench's own (``bench.own_engine.OwnEngine``:
  its own dockerd and containerd, started inside a cpuacct cgroup of their own, which their
  shims and every runc call inherit; the machine's engine, shared with whatever else runs
  here, is not used): the engine's CPU is that cgroup's ``cpuacct.usage``, the sandboxes'
  own processes are read from the cgroup parent the engine and the runs put them under
  (STUDIO_CODE_USAGE_CGROUP_PARENT), and this process's own (the client: the SDK, the
  pool's threads) from ``time.process_time``.

    python -m bench.engine_calls [--n 30]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.core import raw_docker_floor
from bench.engine_relay import CountingRelay
from bench.own_engine import OwnEngine
from bench.sockguard import executor, via
from executor.service import Executor
from executor.settings import load_settings

#: host CPU per pooled job over the raw lifecycle's (issue 43)
GOAL = 1.1
#: the sides, in the tables' order: (pre-started sandboxes, more settings)
SIDES: dict[str, tuple[bool, dict[str, Any]]] = {
    # STUDIO_CODE_PREWARM_RENAME_AFTER_S=0.5: a short job never renamed (the opt-in cut)
    "pooled": (True, {"code_prewarm_rename_after_s": 0.5}),
    # the default: every taken sandbox renamed after its job at once
    "pooled, renamed at take": (True, {"code_prewarm_rename_after_s": 0}),
    "cold": (False, {}),
    "raw": (False, {}),
}
HEADS_BEFORE = "pooled, renamed at take"
HEADS = {
    "pooled": "pooled job, rename deferred 0.5 s",
    "pooled, renamed at take": "pooled, renamed at take (the default)",
    "cold": "cold job",
    "raw": "raw lifecycle",
}


def raw_lifecycle(ex: Executor) -> Callable[[], object]:
    """The floor: one container's whole life with the SDK, on ``ex``'s client (the same
    engine, the same lightened connection pool), its image, policy and stdin."""
    return raw_docker_floor(ex, "{}")


def settle(ex: Executor) -> None:
    pool = ex.runtime.pool  # type: ignore[union-attr]
    if pool is not None:
        assert pool.wait_settled(120), "the pool did not settle"


# --- calls ----------------------------------------------------------------------------------


def count_calls(n: int, engine: OwnEngine, overrides: dict[str, Any]) -> dict[str, Counter[str]]:
    """Calls per side over ``n`` jobs each (not yet divided)."""
    out: dict[str, Counter[str]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-calls-") as tmp:
        relay = CountingRelay(Path(tmp) / "relay.sock", engine.host.removeprefix("unix://"))
        try:
            for side, (pool, more) in SIDES.items():
                ex = executor(relay.host, pooled=pool, **overrides, **more)
                try:
                    job = raw_lifecycle(ex) if side == "raw" else via(ex)
                    settle(ex)
                    job()  # warm-up (the image id read once, connections opened)
                    settle(ex)
                    before = relay.counts()
                    for _ in range(n):
                        job()
                        settle(ex)
                    out[side] = relay.counts() - before
                finally:
                    ex.close()
        finally:
            relay.close()
    return out


# --- CPU ------------------------------------------------------------------------------------


def engine_of_own(overrides: dict[str, Any]) -> OwnEngine:
    """The bench's own engine, started, with the sandbox image in it."""
    engine = OwnEngine().start()
    try:
        engine.load([load_settings(**overrides).code_image])
    except BaseException:
        engine.stop()
        raise
    return engine


def cpu_window(engine: OwnEngine, fn: Callable[[], object], into: dict[str, float]) -> None:
    """Add the CPU ms of ``fn()`` to ``into``: the engine's, the sandboxes', the client's."""
    e0, b0 = engine.cpu_ms()
    c0 = time.process_time()
    fn()
    c1 = time.process_time()
    e1, b1 = engine.cpu_ms()
    for key, v in (("engine", e1 - e0), ("sandboxes", b1 - b0), ("client", (c1 - c0) * 1000)):
        into[key] = into.get(key, 0.0) + v


def pooled_job(ex: Executor) -> Callable[[], None]:
    def job() -> None:  # its replacement's start and its removal in its window
        via(ex)()
        settle(ex)

    return job


def measure_cpu(
    n: int, engine: OwnEngine, overrides: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """CPU ms per job per side, interleaved job by job on the engine's own socket."""
    more = {"code_usage_cgroup_parent": engine.cg_parent, **overrides}
    executors = {
        side: executor(engine.host, pooled=pool, **more, **extra)
        for side, (pool, extra) in SIDES.items()
        if side != "raw"
    }
    pools = [ex for side, ex in executors.items() if SIDES[side][0]]
    try:
        sides: dict[str, Callable[[], object]] = {
            side: pooled_job(ex) if SIDES[side][0] else via(ex) for side, ex in executors.items()
        }
        sides["raw"] = raw_lifecycle(executors["cold"])
        totals: dict[str, dict[str, float]] = {k: {} for k in sides}
        for i in range(n + 2):
            for side, fn in sides.items():
                for ex in pools:
                    settle(ex)
                if i < 2:
                    fn()  # warm-up
                else:
                    cpu_window(engine, fn, totals[side])
        # the engine's own rate with nothing to do (its timers, the pools' image checks)
        idle: dict[str, float] = {}
        t0 = time.monotonic()
        cpu_window(engine, lambda: time.sleep(5), idle)
        out = {side: {k: v / n for k, v in t.items()} for side, t in totals.items()}
        out["idle"] = {"engine per s": idle["engine"] / (time.monotonic() - t0)}
        return out
    finally:
        for ex in executors.values():
            ex.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_calls")
    p.add_argument("--n", type=int, default=30, help="jobs per side")
    args = p.parse_args()
    n = args.n
    overrides: dict[str, Any] = {}  # runc: the own engine has no runsc (nor crun here)
    label = "the engine's default (runc)"
    engine = engine_of_own(overrides)
    try:
        calls = count_calls(n, engine, overrides)
        cpu = measure_cpu(n, engine, overrides)
    finally:
        engine.stop()
    print(
        f"# bench.engine_calls: engine calls per job through a counting relay, n={n} per side, "
        f"OCI runtime {label}; a trivial Python node (pooled: its replacement's start and its "
        "own removal included)"
    )
    print(f"| call | {' | '.join(HEADS.values())} |")
    print("|---|---|---|---|---|")
    keys = sorted(set().union(*calls.values()), key=lambda k: (k.split(" ", 1)[1], k))
    for key in keys:
        cells = " | ".join(f"{calls[s][key] / n:.2f}" for s in SIDES)
        print(f"| `{key}` | {cells} |")
    totals = " | ".join(f"**{sum(calls[s].values()) / n:.2f}**" for s in SIDES)
    print(f"| **in all** | {totals} |")

    print(
        f"\n# bench.engine_calls: host CPU per job (ms), n={n} per side interleaved, in an "
        f"engine of the bench's own (its cgroup's cpuacct); {os.cpu_count()} CPUs; the "
        f"engine's idle rate {cpu['idle']['engine per s']:.1f} ms/s (not subtracted)"
    )
    print(f"| process | {' | '.join(HEADS.values())} | deferred / raw | default / raw | goal |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [
        ("the engine: dockerd, containerd, shims, runc", ("engine",), ""),
        ("the sandboxes' own processes (runner, code)", ("sandboxes",), ""),
        ("this process (the client, the pool's threads)", ("client",), ""),
        ("**host, in all**", ("engine", "sandboxes", "client"), f"≤ {GOAL}x"),
    ]
    for name, keys_, goal in rows:
        v = {s: sum(cpu[s][k] for k in keys_) for s in SIDES}
        raw = v["raw"] or float("nan")
        cells = " | ".join(f"{v[s]:.1f}" for s in SIDES)
        print(
            f"| {name} | {cells} | {v['pooled'] / raw:.2f}x | {v[HEADS_BEFORE] / raw:.2f}x | "
            f"{goal} |"
        )


if __name__ == "__main__":
    main()
