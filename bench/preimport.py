"""Benchmark of pre-import (STUDIO_CODE_PREIMPORT=pydantic.main,dateutil.parser: pydantic's
heavy part is its submodule, loaded lazily on first use of BaseModel, so ``image``, which
imports each listed package's top-level module, would leave it to the job), side by side in ONE run
(interleaved, so every side sees the same machine noise; before each job its side's idle
sandboxes are waited for until their CPU time stops growing: pre-imports done, runner blocked
on stdin, as in a worker whose sandboxes wait for jobs):

* a pooled node that imports the image's heaviest package (pydantic, and dateutil) and uses
  it, with pre-import on vs off;
* the trivial pooled node with pre-import on vs off (it must be unchanged: what the sandbox
  imported while it waited costs the job nothing);
* the idle memory of one pre-started sandbox with and without (its memory cgroup): what
  pre-import costs, counted against the sandbox's own limit.

    python -m bench.preimport [--n 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from bench.common import row, timed
from bench.pool import idle_memory
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

PREIMPORT = "pydantic.main,dateutil.parser"
TRIVIAL = "def main(state):\n    return 1\n"
HEAVY = (
    "import pydantic\n"
    "from dateutil import parser\n"
    "def main(state):\n"
    "    class Row(pydantic.BaseModel):\n"
    "        n: int\n"
    "    return Row(n=parser.parse('2024-01-02').day).n - 1\n"
)


def settle(ex: Executor) -> None:
    """Until the idle pre-started sandboxes' CPU time stops growing over 0.3 s."""
    pool, api = ex.runtime.pool, ex.runtime.api  # type: ignore[union-attr]
    assert pool is not None and pool.wait_ready(60)

    def cpu() -> list[int]:
        return [
            api.stats(p.cid, stream=False, one_shot=True)["cpu_stats"]["cpu_usage"]["total_usage"]
            for p in pool._idle["python"]
        ]

    before = cpu()
    while True:
        time.sleep(0.3)
        now = cpu()
        if now == before:
            return
        before = now


def via(ex: Executor, code: str, starts: list[str]) -> Callable[[], object]:
    def run() -> None:
        r = ex.run(CodeJob(code=code, timeout_s=20))
        assert r.status == "succeeded" and r.output == 1, r.error
        starts.append(next(t.detail for t in r.trace if t.step == "sandbox.start"))

    return run


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.preimport")
    p.add_argument("--n", type=int, default=10)
    n = p.parse_args().n
    sides = {}
    for name, value in (("on", PREIMPORT), ("off", "")):
        ex = Executor(
            load_settings(
                enable_code_nodes=True,
                code_languages="python",
                code_prewarm=2,
                code_preimport=value,
            )
        )
        ex.prepare()
        assert ex.runtime is not None and ex.runtime.pool is not None
        assert ex.runtime.pool.wait_ready(60)
        sides[name] = ex
    print(
        f"# bench.preimport: STUDIO_CODE_PREIMPORT={PREIMPORT} vs none; n={n} per side, "
        "interleaved, each job sent to settled sandboxes; "
        "p50 / p95 in ms; pooled (prewarm 2)"
    )
    print("| what | p50 / p95 | without pre-import p50 / p95 | ratio, delta | goal |")
    print("|---|---|---|---|---|")
    for label, code, goal in (
        ("node importing pydantic + dateutil", HEAVY, "< 1x"),
        ("trivial node", TRIVIAL, "≈ 1x (unchanged)"),
    ):
        on_starts: list[str] = []
        off_starts: list[str] = []
        runs = {"on": via(sides["on"], code, on_starts), "off": via(sides["off"], code, off_starts)}
        times: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(n + 1):  # the first round warms up
            for side in ("on", "off"):
                settle(sides[side])
                ms = timed(runs[side])
                if i:
                    times[side].append(ms)
        on, off = times["on"], times["off"]
        hits = f"{on_starts.count('pool')}+{off_starts.count('pool')}/{2 * n} pooled"
        print(row(f"{label}, pre-import on vs off ({hits})", on, off, goal))
    print()
    print("| idle pre-started Python sandbox | memory charged (MiB) |")
    print("|---|---|")
    for name, ex in sides.items():
        settle(ex)
        mib = idle_memory(ex).get("python", float("nan"))
        print(f"| pre-import {name} | {mib:.1f} |")
    for ex in sides.values():
        ex.close()


if __name__ == "__main__":
    main()
