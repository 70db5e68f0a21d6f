"""What the socket guard costs per job (issues 22, 30): a trivial Python node e2e through
``Executor.run`` with DOCKER_HOST on a ``studio-code sockguard`` (a real process on a unix
socket, in front of the engine) vs the same on the engine's own socket; cold executors and
pooled ones (pre-started sandboxes, as in a worker's pool process). Interleaved in one run,
so each side sees the same machine noise. Also the cost of one call alone (``GET /_ping``).
Since issue 30 the guard writes every request again (a strict read, h11 both ways, the
answer read whole and framed anew): the pooled row's goal is +2 ms at p50; the cold row is
reported (a create's body checked and serialised again, the rest is the engine's).

    python -m bench.sockguard [--n 30]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker

from bench.common import interleave, row, timed
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings
from testkit.sockguard import REAL_DOCKER_HOST, SockGuardProcess

TRIVIAL = "def main(state):\n    return 1\n"


def executor(docker_host: str, *, pooled: bool, **overrides: Any) -> Executor:
    """An executor whose Docker client is on ``docker_host`` (connected now: the env is
    read once, when the client is made); ``pooled``: one pre-started sandbox, filled;
    ``overrides``: more settings (load_settings')."""
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = docker_host
    try:
        ex = Executor(
            load_settings(
                enable_code_nodes=True,
                code_languages="python",
                code_prewarm=1 if pooled else 0,
                **overrides,
            )
        )
        _ = ex.runtime.api  # type: ignore[union-attr]
        if pooled:
            ex.prepare()
            assert ex.runtime.pool is not None and ex.runtime.pool.wait_ready(60)  # type: ignore[union-attr]
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
    return ex


def via(ex: Executor) -> Callable[[], object]:
    def run() -> None:
        r = ex.run(CodeJob(code=TRIVIAL, timeout_s=20))
        assert r.status == "succeeded" and r.output == 1, r.error

    return run


def pooled_pairs(n: int, a: Executor, b: Executor) -> tuple[list[float], list[float]]:
    """Like ``interleave``, but each job is timed once both pools are settled (full, nothing
    starting or being removed; the wait is not timed): a job that takes a pre-started
    sandbox, not one that waits for, or competes with, a refill (on a loaded machine a
    refill takes longer than a job, and would be what is measured)."""
    out: tuple[list[float], list[float]] = ([], [])
    pools = [ex.runtime.pool for ex in (a, b)]  # type: ignore[union-attr]
    for i in range(n + 2):
        for side, ex in enumerate((a, b)):
            assert all(p is not None and p.wait_settled(120) for p in pools)
            ms = timed(via(ex))
            if i >= 2:  # warm-up
                out[side].append(ms)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sockguard")
    p.add_argument("--n", type=int, default=30)
    n = p.parse_args().n
    with tempfile.TemporaryDirectory(prefix="bench-sockguard-") as tmp:
        # only refusals in its log: a line per passed call would be a cost of the bench's
        guard = SockGuardProcess(Path(tmp), trace=False)
        try:
            print(
                f"# bench.sockguard: n={n} per side, interleaved; p50 / p95 in ms; the guard "
                f"vs the engine's socket {REAL_DOCKER_HOST}"
            )
            print("| what | p50 / p95 | floor p50 / p95 | ratio, delta | goal |")
            print("|---|---|---|---|---|")
            bare_api = docker.APIClient(base_url=REAL_DOCKER_HOST)
            guard_api = docker.APIClient(base_url=guard.host)
            ping_g, ping_b = interleave(n * 10, [guard_api.ping, bare_api.ping])
            print(row("one call (GET /_ping), guard vs engine socket", ping_g, ping_b, ""))
            for pooled in (False, True):
                through, bare = (
                    executor(guard.host, pooled=pooled),
                    executor(REAL_DOCKER_HOST, pooled=pooled),
                )
                try:
                    if pooled:
                        g, b = pooled_pairs(n, through, bare)
                    else:
                        g, b = interleave(n, [via(through), via(bare)])
                finally:
                    through.close()
                    bare.close()
                what = "pooled" if pooled else "cold"
                goal = "≤ +2 ms p50" if pooled else "reported"
                print(row(f"python trivial node e2e, {what}: guard vs engine socket", g, b, goal))
            refused = guard.refusals()
            print(f"\nrefusals during the run: {len(refused)}")
            for line in refused[:5]:
                print(f"  {line}")
        finally:
            guard.stop()


if __name__ == "__main__":
    main()
