"""What keeping subprocess runs apart costs (issue 9): a trivial Python node with a uid and
a cgroup of its own, with a uid but no cgroup, against the same runner spawned bare.
Under a non-root server (issue 22): a run in namespaces of its own against one without
(STUDIO_CODE_SUBPROCESS_NAMESPACES=off), and both against the runner spawned bare.
Issue 21: the same node with pre-started runners (STUDIO_CODE_PREWARM) against the runner
spawned bare. Issue 30: runs under Landlock against runs without
(STUDIO_CODE_SUBPROCESS_LANDLOCK=off), cold and pre-started. Interleaved in one run, so each
side sees the same machine noise.

    python -m bench.isolation [--n 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Callable

from bench.common import interleave, row
from executor.languages import get_language
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

TRIVIAL = "def main(state):\n    return 1\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.isolation")
    p.add_argument("--n", type=int, default=30)
    n = p.parse_args().n
    full = Executor(
        load_settings(enable_code_nodes=True, code_runtime="subprocess", code_languages="python")
    )
    # a root server: without its cgroup; a non-root one: without its namespaces
    less = {"code_subprocess_cgroup" if os.getuid() == 0 else "code_subprocess_namespaces": "off"}
    lesser = Executor(
        load_settings(
            enable_code_nodes=True, code_runtime="subprocess", code_languages="python", **less
        )
    )
    no_landlock = {"code_subprocess_landlock": "off"}
    unlocked = Executor(
        load_settings(
            enable_code_nodes=True,
            code_runtime="subprocess",
            code_languages="python",
            **no_landlock,
        )
    )
    prestarted, prestarted_unlocked = (
        Executor(
            load_settings(
                enable_code_nodes=True,
                code_runtime="subprocess",
                code_languages="python",
                code_prewarm=1,
                **extra,
            )
        )
        for extra in ({}, no_landlock)
    )
    for ex in (prestarted, prestarted_unlocked):
        ex.prepare()
        assert ex.runtime is not None and ex.runtime.pool is not None
        assert ex.runtime.pool.wait_ready(30)
    iso = full.runtime.isolation  # type: ignore[union-attr]
    print(
        f"# bench.isolation: n={n} per side, interleaved; p50 / p95 in ms; server uid "
        f"{os.getuid()}, separate uids {iso['separate_uids']}, cgroup {iso['cgroup']}, "
        f"namespaces {iso['namespaces']} ({iso['namespaces_reason']}), Landlock ABI "
        f"{iso['landlock_abi']} ({iso['landlock_reason']})"
    )

    def via(ex: Executor) -> Callable[[], object]:
        def run() -> None:
            r = ex.run(CodeJob(code=TRIVIAL, timeout_s=20))
            assert r.status == "succeeded", r.error

        return run

    lang = get_language("python")
    argv = lang.command(full.settings, full.limits(10), in_container=False)
    payload = lang.stdin_payload(CodeJob(code=TRIVIAL))

    def bare_runner() -> None:
        subprocess.run(argv, input=payload, capture_output=True, env={}, check=True)

    # the pre-started side runs right after the bare runner: its replacement's start (off
    # its path) overlaps the next round's first side, never the floor
    a, b, c, d, e, f = interleave(
        n,
        [
            via(full),
            via(lesser),
            bare_runner,
            via(prestarted),
            via(unlocked),
            via(prestarted_unlocked),
        ],
    )
    assert prestarted.runtime is not None
    stats = prestarted.runtime.pool_stats() or {}
    hits = stats.get("languages", {}).get("python", {}).get("hits", 0)
    prestarted.close()
    prestarted_unlocked.close()
    print("| what | p50 / p95 | floor p50 / p95 | ratio, delta |")
    print("|---|---|---|---|")
    if os.getuid() == 0:
        print(row("own uid + cgroup vs the runner spawned bare", a, c, None))
        print(row("own uid, no cgroup vs the runner spawned bare", b, c, None))
        print(row("own uid + cgroup vs own uid, no cgroup", a, b, None))
    else:
        print(row("non-root, own namespaces vs the runner spawned bare", a, c, None))
        print(row("non-root, no namespaces vs the runner spawned bare", b, c, None))
        print(row("non-root, own namespaces vs no namespaces", a, b, None))
    print(row(f"pre-started runners ({hits}/{n + 2} hits) vs the runner spawned bare", d, c, None))
    print(row("pre-started runners vs cold runners, same isolation", d, a, None))
    print(row("Landlock vs none, cold runners", a, e, None))
    print(row("Landlock vs none, pre-started runners", d, f, None))


if __name__ == "__main__":
    main()
