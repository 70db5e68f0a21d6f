"""Benchmark of pre-started sandboxes, side by side in ONE run (interleaved, so every side
sees the same machine noise):

* a trivial Python node, e2e through ``Executor.run`` with the pool (a prepared executor,
  as in a worker's pool process) vs the raw cold floor (Docker SDK
  create→attach→start→stdin→read→wait→remove, same image and ``sandbox_policy``) vs the
  executor cold; the same for TypeScript;
* the idle memory of one pre-started sandbox per language (its memory cgroup).

CPU per job (runc and crun) is ``bench/own_engine.py``: it needs an engine of its own.

    python -m bench.pool [--n 30]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import interleave, pct, row, timed
from bench.core import raw_docker_floor
from bench.typescript import EXPECTED, STATE, docker_sdk
from bench.typescript import TRIVIAL as TS_TRIVIAL
from executor.models import CodeJob
from executor.runtimes.docker import usage
from executor.service import Executor
from executor.settings import load_settings

PY_TRIVIAL = "def main(state):\n    return 1\n"


def via(ex: Executor, language: str, details: list[str]) -> Callable[[], object]:
    code, state = (PY_TRIVIAL, "{}") if language == "python" else (TS_TRIVIAL, STATE)
    expected = 1 if language == "python" else EXPECTED

    def run() -> None:
        r = ex.run(
            CodeJob(
                language=language,
                code=code,
                state_json=state,  # type: ignore[arg-type]
                timeout_s=20,
            )
        )
        assert r.status == "succeeded" and r.output == expected, r.error
        details.append(next(t.detail for t in r.trace if t.step == "sandbox.start"))

    return run


def idle_memory(ex: Executor) -> dict[str, float]:
    """MiB charged to each idle pre-started sandbox's memory cgroup (cgroup v1 or v2)."""
    pool = ex.runtime.pool  # type: ignore[union-attr]
    assert pool is not None and pool.wait_ready(60)
    time.sleep(1.0)
    out = {}
    for name, q in pool._idle.items():
        cid, meter = q[0].cid, q[0].meter
        # its run's own parent below the engine's (/docker/studio-code-usage-...), else /docker
        group = "/docker"
        if meter is not None and meter.host is not None and meter.parent is not None:
            group = meter.host.path(meter.parent)
        for path in (
            f"/sys/fs/cgroup/memory{group}/{cid}/memory.usage_in_bytes",
            f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/memory.current",
            f"/sys/fs/cgroup{group}/{cid}/memory.current",
        ):
            p = Path(path)
            if p.exists():
                out[name] = int(p.read_text()) / 2**20
                break
    return out


def usage_on_off(ex: Executor, n: int) -> tuple[list[float], list[float], int]:
    """A trivial Python node through the pool with the usage read on its path, and without,
    in turn; before each job (untimed) the pool settles, so every job takes a ready sandbox
    and the only difference is the read. Returns (with ms, without ms, pool hits)."""
    pool = ex.runtime.pool  # type: ignore[union-attr]
    details: list[str] = []
    run = via(ex, "python", details)
    out: tuple[list[float], list[float]] = ([], [])
    try:
        for i in range(2 * n + 4):
            on = i % 2 == 0
            assert pool.wait_settled(60)
            usage.READING = on
            ms = timed(run)
            if i >= 4:  # warm-up
                out[0 if on else 1].append(ms)
    finally:
        usage.READING = True
    return out[0], out[1], details[4:].count("pool")


def read_cost_us(ex: Executor, n: int = 2000) -> tuple[float, float]:
    """What hand-over + read cost on their own, on an idle pre-started sandbox: µs p50 / p95."""
    pool = ex.runtime.pool  # type: ignore[union-attr]
    api = ex.runtime.api  # type: ignore[union-attr]
    sandbox = next(q[0] for q in pool._idle.values() if q)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sandbox.hand_over(api)
        got = sandbox.usage(api)
        samples.append((time.perf_counter() - t0) * 1e6)
        assert got is not None
    return pct(samples, 50), pct(samples, 95)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pool")
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--usage-only", action="store_true", help="only the usage read vs not row")
    args = p.parse_args()
    n = args.n
    settings = load_settings(enable_code_nodes=True)
    cold = Executor(settings)
    pooled = Executor(settings)
    pooled.prepare()
    assert pooled.runtime is not None and pooled.runtime.pool is not None
    assert pooled.runtime.pool.wait_ready(60)
    print(
        f"# bench.pool: n={n} per side, interleaved; p50 / p95 in ms; STUDIO_CODE_PREWARM="
        f"{settings.code_prewarm}"
    )
    print("| what | p50 / p95 | floor p50 / p95 | ratio, delta | goal |")
    print("|---|---|---|---|---|")
    for language, goal in (
        () if args.usage_only else (("python", "≤ 0.2x"), ("typescript", "≤ 0.3x"))
    ):
        details: list[str] = []
        floor = (
            raw_docker_floor(cold, "{}") if language == "python" else docker_sdk(cold, bare=False)
        )
        e2e_pool, raw, e2e_cold = interleave(
            n, [via(pooled, language, details), floor, via(cold, language, [])]
        )
        hits = details[-n:].count("pool")
        print(
            row(
                f"{language}: trivial node e2e, pool ({hits}/{n} from the pool) vs raw cold floor",
                e2e_pool,
                raw,
                goal,
            )
        )
        print(
            row(
                f"{language}: trivial node e2e, cold executor vs raw cold floor",
                e2e_cold,
                raw,
                "(unchanged, ≈ 1x)",
            )
        )
    on, off, hits = usage_on_off(pooled, n)
    print(
        row(
            f"python: trivial node e2e, pool ({hits}/{2 * n} from the pool), usage read vs not",
            on,
            off,
            "≤ +1 ms at p50",
        )
    )
    us50, us95 = read_cost_us(pooled)
    print(f"| usage read alone (hand-over + read) | {us50:.0f} / {us95:.0f} µs | | | |")
    mem = idle_memory(pooled)
    print()
    print("| idle pre-started sandbox | memory charged (MiB) |")
    print("|---|---|")
    for name, mib in mem.items():
        print(f"| {name} | {mib:.1f} |")
    print(f"\npool after the run: {pooled.runtime.pool_stats()}")
    pooled.close()


if __name__ == "__main__":
    main()
