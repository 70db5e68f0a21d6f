"""What one job asks of the Docker engine (issue 43): the calls it makes, counted per
endpoint, and the host CPU the engine spends on it, beside the raw lifecycle of one
container (create, attach, start, wait, remove with the Docker SDK, the same image, policy
and stdin: ``bench.common.raw_container``) measured in the same run. No assertions.

* **Calls**: the executor's client goes through a counting relay (``bench.engine_relay``, a
  unix socket of its own in front of the engine's, DOCKER_HOST pointed at it) and each HTTP
  request is counted as ``METHOD /path/template``. A pooled job (one pre-started sandbox,
  as a worker's pool process: each job taken once the pool is settled, its window running
  until it is settled again) counts its replacement's start and its own removal; a cold job
  its own life. What the pool does by the clock (the image id every 10 s) falls in too,
  spread over the jobs.
* **CPU**: on the engine's own socket (no relay), interleaved job by job: the CPU of dockerd
  and containerd (/proc/<pid>/stat, own + reaped children; both are the machine's, shared
  with anything else using the engine meanwhile), of the containerd shims of THIS run's
  containers (each shim's -id read from its command line; sampled every SAMPLE_S while it
  lives, its last few ms missed) and of their reaped children (runc, and the sandbox's own
  processes: the same runner and code on every side), and this process's own (the client:
  the SDK, the pool's threads). The engine here uses the cgroupfs driver on cgroup v1 with
  dockerd in the root cgroup, so there is no service cgroup whose cpu.stat would hold it all.

    python -m bench.engine_calls [--n 30] [--runtime runsc]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import raw_container
from bench.cpu import ENGINE, SHIM, pids_named, stat
from bench.engine_relay import CountingRelay
from bench.sockguard import TRIVIAL, executor, via
from executor.languages import get_language
from executor.models import CodeJob
from executor.runtimes.docker.policy import sandbox_policy
from executor.service import Executor
from testkit.sockguard import REAL_DOCKER_HOST

SAMPLE_S = 0.02
#: host CPU per pooled job over the raw lifecycle's (issue 43)
GOAL = 1.1


def raw_lifecycle(ex: Executor) -> Callable[[], object]:
    """The floor: one container's whole life with the SDK, on ``ex``'s client (the same
    engine, the same lightened connection pool), its image, policy and stdin."""
    api = ex.runtime.api  # type: ignore[union-attr]
    lang = get_language("python")
    limits = ex.limits(20)

    def run() -> None:
        job = CodeJob(code=TRIVIAL)
        policy = sandbox_policy(ex.settings, lang, job, limits, "bench")
        assert raw_container(api, policy, lang.stdin_payload(job)) == 0

    return run


def settle(ex: Executor) -> None:
    pool = ex.runtime.pool  # type: ignore[union-attr]
    if pool is not None:
        assert pool.wait_settled(120), "the pool did not settle"


def mine(ex: Executor, ours: set[str]) -> None:
    """Record the id of every container ``ex``'s client creates in ``ours``."""
    api = ex.runtime.api  # type: ignore[union-attr]
    create = api.create_container

    def recorded(*a: Any, **k: Any) -> Any:
        out = create(*a, **k)
        ours.add(out["Id"])
        return out

    api.create_container = recorded


# --- calls ----------------------------------------------------------------------------------


def count_calls(n: int, overrides: dict[str, Any]) -> dict[str, Counter[str]]:
    """Calls per side over ``n`` jobs each (not yet divided)."""
    out: dict[str, Counter[str]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-calls-") as tmp:
        relay = CountingRelay(Path(tmp) / "relay.sock", REAL_DOCKER_HOST.removeprefix("unix://"))
        try:
            for side in ("pooled", "cold", "raw"):
                ex = executor(relay.host, pooled=side == "pooled", **overrides)
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


class Shims(threading.Thread):
    """Every containerd shim's CPU (own, reaped children's) and its container id, read every
    SAMPLE_S while it lives; ``read()`` reads them now and returns the last of each."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.last: dict[int, tuple[str, float, float]] = {}
        self.halt = threading.Event()
        self._lock = threading.Lock()
        #: this thread's own CPU ms so far: not the client's
        self.spent = 0.0

    def run(self) -> None:
        while not self.halt.wait(SAMPLE_S):
            t0 = time.thread_time()
            self.read()
            self.spent += (time.thread_time() - t0) * 1000

    def read(self) -> dict[int, tuple[str, float, float]]:
        with self._lock:
            for pid in pids_named((), SHIM):
                s = stat(pid)
                if s == (0.0, 0.0):
                    continue
                cid = self.last[pid][0] if pid in self.last else _shim_id(pid)
                self.last[pid] = (cid, *s)
            return dict(self.last)


def _shim_id(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    for i, a in enumerate(argv[:-1]):
        if a == b"-id":
            return argv[i + 1].decode()
    return ""


def engine_now(shims: Shims) -> tuple[float, dict[int, tuple[str, float, float]]]:
    """(dockerd + containerd ms, the shims) now."""
    return sum(sum(stat(p)) for p in pids_named(ENGINE)), shims.read()


def client_now(shims: Shims) -> float:
    """This process's CPU ms now, the shim sampler's aside."""
    return time.process_time() * 1000 - shims.spent


def cpu_window(
    shims: Shims, ours: set[str], fn: Callable[[], object], into: dict[str, float]
) -> None:
    d0, s0 = engine_now(shims)
    c0 = client_now(shims)
    fn()
    c1 = client_now(shims)
    d1, s1 = engine_now(shims)
    own = kids = 0.0
    for pid, (cid, o, k) in s1.items():
        if cid in ours:
            _, o0, k0 = s0.get(pid, (cid, 0.0, 0.0))
            own, kids = own + o - o0, kids + k - k0
    for key, v in (("daemons", d1 - d0), ("shims", own), ("kids", kids), ("client", c1 - c0)):
        into[key] = into.get(key, 0.0) + v


def measure_cpu(n: int, overrides: dict[str, Any]) -> dict[str, dict[str, float]]:
    """CPU ms per job per side, interleaved job by job on the engine's own socket."""
    ours: set[str] = set()
    pooled = executor(REAL_DOCKER_HOST, pooled=True, **overrides)
    cold = executor(REAL_DOCKER_HOST, pooled=False, **overrides)
    shims = Shims()
    shims.start()
    try:
        for ex in (pooled, cold):
            mine(ex, ours)  # (both share one client: the raw lifecycle's creates too)

        def pooled_job() -> None:  # its replacement's start and its removal in its window
            via(pooled)()
            settle(pooled)

        sides: dict[str, Callable[[], object]] = {
            "pooled": pooled_job,
            "cold": via(cold),
            "raw": raw_lifecycle(cold),
        }
        totals: dict[str, dict[str, float]] = {k: {} for k in sides}
        for i in range(n + 2):
            for side, fn in sides.items():
                settle(pooled)
                time.sleep(0.05)  # the last shim's exit read
                if i < 2:
                    fn()  # warm-up
                else:
                    cpu_window(shims, ours, fn, totals[side])
        # the engine's own rate with nothing of ours to do (others' use, its own timers)
        settle(pooled)
        idle: dict[str, float] = {}
        t0 = time.monotonic()
        cpu_window(shims, ours, lambda: time.sleep(5), idle)
        idle_rate = idle["daemons"] / (time.monotonic() - t0)
        out = {side: {k: v / n for k, v in t.items()} for side, t in totals.items()}
        out["idle"] = {"daemons per s": idle_rate}
        return out
    finally:
        shims.halt.set()
        pooled.close()
        cold.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_calls")
    p.add_argument("--n", type=int, default=30, help="jobs per side")
    p.add_argument("--runtime", default="", help="STUDIO_CODE_OCI_RUNTIME (e.g. runsc)")
    args = p.parse_args()
    n = args.n
    overrides: dict[str, Any] = {"code_oci_runtime": args.runtime} if args.runtime else {}
    label = args.runtime or "the engine's default (runc)"
    calls = count_calls(n, overrides)
    print(
        f"# bench.engine_calls: engine calls per job through a counting relay, n={n} per side, "
        f"OCI runtime {label}; a trivial Python node (pooled: its replacement's start and its "
        "own removal included)"
    )
    print("| call | pooled job | cold job | raw lifecycle |")
    print("|---|---|---|---|")
    keys = sorted(set().union(*calls.values()), key=lambda k: (k.split(" ", 1)[1], k))
    for key in keys:
        cells = " | ".join(f"{calls[s][key] / n:.2f}" for s in ("pooled", "cold", "raw"))
        print(f"| `{key}` | {cells} |")
    totals = " | ".join(f"**{sum(calls[s].values()) / n:.2f}**" for s in ("pooled", "cold", "raw"))
    print(f"| **in all** | {totals} |")

    cpu = measure_cpu(n, overrides)
    print(
        f"\n# bench.engine_calls: host CPU per job (ms), n={n} per side interleaved, on the "
        f"engine's own socket; {os.cpu_count()} CPUs; the engine's idle rate meanwhile "
        f"{cpu['idle']['daemons per s']:.1f} ms/s (not subtracted)"
    )
    print("| process | pooled job | cold job | raw lifecycle | pooled / raw | goal |")
    print("|---|---|---|---|---|---|")
    rows = [
        ("dockerd + containerd", ("daemons",), ""),
        ("containerd shims (own)", ("shims",), ""),
        ("shims' children (runc, the sandbox)", ("kids",), ""),
        ("**the engine's, in all**", ("daemons", "shims", "kids"), f"≤ {GOAL}x"),
        ("this process (the client, the pool's threads)", ("client",), ""),
        ("**host, in all**", ("daemons", "shims", "kids", "client"), ""),
    ]
    for name, keys_, goal in rows:
        v = {s: sum(cpu[s][k] for k in keys_) for s in ("pooled", "cold", "raw")}
        ratio = v["pooled"] / v["raw"] if v["raw"] else float("nan")
        print(
            f"| {name} | {v['pooled']:.1f} | {v['cold']:.1f} | {v['raw']:.1f} | "
            f"{ratio:.2f}x | {goal} |"
        )


if __name__ == "__main__":
    main()
