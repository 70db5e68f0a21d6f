"""What two machine-wide kernel settings do to a cold start and to a job's host CPU here
(issue 43): ``rcu_expedited`` (/sys/kernel/rcu_expedited = 1: RCU grace periods are waited
for the expedited way, IPIs to every CPU instead of waiting for each to pass a quiescent
state) and, on a cgroup v2 mount, ``favordynmods`` (the cgroup threadgroup lock kept in its
slow-reader, fast-writer mode: a task moved between cgroups, as runc does to every container's
first process, waits for no RCU grace period; the lock is global, whichever hierarchy's
mount sets it). Both are where container start-up waits on a VM: runc's cgroup writes wait
for a grace period.

Each is SET for its block and RESTORED to the value it had before, in a ``finally`` (and on
SIGTERM/SIGINT): the machine is left as found. Blocks alternate (baseline, each setting,
baseline, ...) ``--rounds`` times, so every side sees the same load; per block ``--k`` of each:

* ``docker run --rm`` of the sandbox image running ``true`` (the CLI, as an operator
  would): wall time, and its host CPU (the engine's, the container's, the CLI's own);
* a pooled trivial job (a pre-started sandbox, its replacement's start and its removal
  included) and the raw SDK lifecycle of one container: wall time and host CPU.

All of it in a Docker engine of the bench's own (bench.engine_calls' accounting: its cgroup's
cpuacct, the sandboxes' parent cgroup, this process and its children), never the machine's.

favordynmods is measured only where the cgroup2 mount can be remounted with it and back to
its exact options (here: cgroup v1 for the engine, an unused cgroup2 at
/sys/fs/cgroup/unified); otherwise the bench says why not.

    python -m bench.host_tuning [--rounds 4] [--k 8]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import pct
from bench.engine_calls import cpu_window, engine_of_own, pooled_job, raw_lifecycle, settle
from bench.sockguard import executor

RCU = Path("/sys/kernel/rcu_expedited")
MS_REMOUNT = 32


def cgroup2_mount() -> tuple[str, str] | None:
    """(mount point, its super-block options) of the cgroup2 mount, or None."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fs = post.split()
        if fs and fs[0] == "cgroup2":
            return pre.split()[4], fs[2]
    return None


def favordynmods_blocker() -> str | None:
    """Why favordynmods is not measured here, or None."""
    m = cgroup2_mount()
    if m is None:
        return "no cgroup2 mount"
    point, opts = m
    if "favordynmods" in opts.split(","):
        return f"{point} already has it"
    if os.geteuid() != 0:
        return "not root"
    # a remount replaces every cgroup2 flag: only one whose flags are none but rw is put
    # back exactly by a remount with no options
    if set(opts.split(",")) - {"rw"}:
        return f"{point} has options {opts}: a remount could not restore them exactly"
    return None


@contextmanager
def rcu_expedited() -> Iterator[None]:
    before = RCU.read_text().strip()
    RCU.write_text("1")
    try:
        yield
    finally:
        RCU.write_text(before)


def remount(point: str, options: str) -> None:
    """mount(2) with MS_REMOUNT and exactly ``options`` (the mount(8) command adds the
    mount's current options to a remount's: it could never take favordynmods away)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, point.encode(), None, MS_REMOUNT, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"remount {point} -o {options!r}: {os.strerror(err)}")


@contextmanager
def favordynmods() -> Iterator[None]:
    m = cgroup2_mount()
    assert m is not None
    point, before = m
    remount(point, "favordynmods")
    try:
        yield
    finally:
        remount(point, "")  # its options were none but rw (favordynmods_blocker)
        after = cgroup2_mount()
        if after != m:
            raise RuntimeError(f"{point} was not restored: {before} -> {after}")


@contextmanager
def baseline() -> Iterator[None]:
    yield


def docker_run(host: str, image: str) -> Callable[[], object]:
    argv = ["docker", "-H", host, "run", "--rm", "--network", "none"]

    def run() -> None:
        subprocess.run([*argv, image, "true"], check=True, capture_output=True)

    return run


def children_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r.ru_utime + r.ru_stime) * 1000


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.host_tuning")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--k", type=int, default=8, help="of each kind per block")
    args = p.parse_args()
    overrides: dict[str, Any] = {}  # runc: the own engine has no runsc (nor crun here)
    settings: dict[str, Callable[[], Any]] = {
        "baseline": baseline,
        "rcu_expedited=1": rcu_expedited,
    }
    blocker = favordynmods_blocker()
    if blocker is None:
        settings["cgroup2 favordynmods"] = favordynmods
    rcu_before = RCU.read_text().strip()

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # the finally blocks restore what was set

    signal.signal(signal.SIGTERM, stop)
    engine = engine_of_own(overrides)
    walls: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], dict[str, float]] = {}
    pooled = None
    try:
        more = {"code_usage_cgroup_parent": engine.cg_parent, **overrides}
        pooled = executor(engine.host, pooled=True, **more)
        image = pooled.settings.code_image
        kinds: dict[str, Callable[[], object]] = {
            "docker run --rm (CLI) true": docker_run(engine.host, image),
            "pooled job (+ its refill, removal)": pooled_job(pooled),
            "raw SDK lifecycle": raw_lifecycle(pooled),
        }
        for fn in kinds.values():  # warm-up
            settle(pooled)
            fn()
        for _ in range(args.rounds):
            for name, setting in settings.items():
                with setting():
                    for kind, fn in kinds.items():
                        for _ in range(args.k):
                            settle(pooled)
                            time.sleep(0.05)
                            into = cpu.setdefault((name, kind), {})
                            t0, c0 = time.perf_counter(), children_ms()
                            cpu_window(engine, fn, into)
                            walls.setdefault((name, kind), []).append(
                                (time.perf_counter() - t0) * 1000
                            )
                            into["cli"] = into.get("cli", 0.0) + children_ms() - c0
    finally:
        if RCU.read_text().strip() != rcu_before:  # never left set
            RCU.write_text(rcu_before)
        if pooled is not None:
            pooled.close()
        engine.stop()
    n = args.rounds * args.k
    print(
        f"# bench.host_tuning: {args.rounds} rounds of alternating blocks, {args.k} of each "
        f"per block (n={n} per cell); rcu_expedited was {rcu_before} and is "
        f"{RCU.read_text().strip()} again; favordynmods: "
        + ("measured" if blocker is None else f"not measured ({blocker})")
    )
    print(
        "| what | setting | wall p50 / p95 ms | vs baseline p50 | host CPU ms per run | "
        "vs baseline |"
    )
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        base_w = pct(walls[("baseline", kind)], 50)
        base_c = sum(cpu[("baseline", kind)].values()) / n
        for name in settings:
            w = walls[(name, kind)]
            c = sum(cpu[(name, kind)].values()) / n
            print(
                f"| {kind} | {name} | {pct(w, 50):.1f} / {pct(w, 95):.1f} | "
                f"{pct(w, 50) / base_w:.2f}x | {c:.1f} | {c / base_c:.2f}x |"
            )


if __name__ == "__main__":
    main()
