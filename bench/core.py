"""Benchmark of the executor core, measured side by side in ONE run (interleaved, so both
sides see the same machine noise): the executor vs the raw floor of the same work.

    python -m bench.core [--n 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Callable

from bench.common import interleave, raw_container, row
from executor.languages import get_language
from executor.models import CodeJob
from executor.runtimes.docker.policy import sandbox_policy
from executor.service import Executor
from executor.settings import load_settings

TRIVIAL = "def main(state):\n    return 1\n"


def raw_docker_floor(ex: Executor, state_json: str) -> Callable[[], object]:
    """create→attach→start→(stdin)→read→wait→remove with the Docker SDK, same image, same
    flags (sandbox_policy), same runner and stdin: what any executor must pay."""
    api = ex.runtime.api  # type: ignore[union-attr]
    lang = get_language("python")
    limits = ex.limits(10)

    def run() -> None:
        job = CodeJob(code=TRIVIAL, state_json=state_json)
        policy = sandbox_policy(ex.settings, lang, job, limits, "bench")
        assert raw_container(api, policy, lang.stdin_payload(job)) == 0

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=30)
    n = p.parse_args().n
    docker_ex = Executor(load_settings(enable_code_nodes=True, code_runtime="docker"))
    sub_ex = Executor(load_settings(enable_code_nodes=True, code_runtime="subprocess"))
    small = json.dumps({"blob": "x" * 1000})
    big = json.dumps({"rows": ["y" * 1000 for _ in range(10 * 1024)]})

    def via(ex: Executor, state: str) -> Callable[[], object]:
        def run() -> None:
            r = ex.run(CodeJob(code=TRIVIAL, state_json=state, timeout_s=20))
            assert r.status == "succeeded", r.error

        return run

    lang = get_language("python")
    limits = sub_ex.limits(10)
    argv = lang.command(sub_ex.settings, limits, in_container=False)
    payload = lang.stdin_payload(CodeJob(code=TRIVIAL))

    def bare_runner() -> None:
        subprocess.run(argv, input=payload, capture_output=True, env={}, check=True)

    def bare_python() -> None:
        subprocess.run([argv[0], "-c", "pass"], capture_output=True, env={}, check=True)

    print(f"# bench.core: n={n} per side, interleaved; p50 / p95 in ms")
    print("| what | executor p50 / p95 | floor p50 / p95 | ratio, delta | goal |")
    print("|---|---|---|---|---|")
    e2e, floor = interleave(n, [via(docker_ex, "{}"), raw_docker_floor(docker_ex, "{}")])
    print(
        row(
            "docker: trivial node e2e vs raw SDK create→attach→start→wait→remove",
            e2e,
            floor,
            "≤ 1.25x",
        )
    )
    sub, runner, bare = interleave(n, [via(sub_ex, "{}"), bare_runner, bare_python])
    print(row("subprocess: trivial node vs the same runner spawned bare", sub, runner, "≤ +15 ms"))
    print(row("subprocess: trivial node vs bare `python3 -c pass`", sub, bare, "≤ +15 ms"))
    big_t, small_t = interleave(max(5, n // 3), [via(docker_ex, big), via(docker_ex, small)])
    print(row("docker: 10 MB state vs 1 KB state", big_t, small_t, "(cost of size)"))


if __name__ == "__main__":
    main()
