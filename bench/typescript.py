"""Benchmark of TypeScript code nodes, side by side in ONE run (interleaved, so both sides
see the same machine noise), in BOTH runtimes:

* e2e: a trivial TS node through ``Executor.run`` (save-time check, runner, result frame);
* bare: ``deno run`` of the SAME trivial program as the main module (it reads the state on
  stdin and prints main's JSON), with the same deno flags and environment: in docker a raw
  Docker SDK create→attach→start→wait→remove with the same image and ``sandbox_policy``; in
  subprocess mode a plain ``subprocess.run`` of deno (same uid, no rlimits);
* runner: the executor's exact argv and stdin (the runner) spawned the same bare way, which
  splits the difference into what the runner costs and what the executor costs.

    python -m bench.typescript [--n 20]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

from bench.common import interleave, pct, raw_container
from executor.languages import get_language
from executor.languages.typescript import RUNNER_URL
from executor.models import CodeJob
from executor.runtimes.docker.policy import sandbox_policy
from executor.service import Executor
from executor.settings import load_settings, sandbox_ids

TRIVIAL = "export function main(state: { n: number }) {\n  return { n: state.n + 1 };\n}\n"
STATE = '{"n": 41}'
EXPECTED = {"n": 42}
# The same program as a main module: read the state, call main, print its JSON.
BARE_TAIL = (
    "\nconst input = await new Response(Deno.stdin.readable).text();\n"
    "console.log(JSON.stringify(await main(JSON.parse(input))));\n"
)
BARE_URL = (
    "data:application/typescript;base64,"
    + base64.b64encode((TRIVIAL + BARE_TAIL).encode()).decode()
)


def bare_argv(argv: list[str]) -> list[str]:
    """The executor's argv with the runner (and its config) replaced by the bare program."""
    at = argv.index(RUNNER_URL)
    return [*argv[:at], BARE_URL]


def check_bare(stdout: bytes) -> None:
    assert json.loads(stdout.decode().strip().splitlines()[-1]) == EXPECTED, stdout


def via_executor(ex: Executor) -> Callable[[], object]:
    def run() -> None:
        r = ex.run(CodeJob(language="typescript", code=TRIVIAL, state_json=STATE, timeout_s=20))
        assert r.status == "succeeded" and r.output == EXPECTED, r.error

    return run


def docker_sdk(ex: Executor, *, bare: bool) -> Callable[[], object]:
    """create→attach→start→(stdin)→read→wait→remove, same image and sandbox_policy."""
    api = ex.runtime.api  # type: ignore[union-attr]
    lang = get_language("typescript")
    limits = ex.limits(20)

    def run() -> None:
        job = CodeJob(language="typescript", code=TRIVIAL, state_json=STATE)
        policy = sandbox_policy(ex.settings, lang, job, limits, "bench")
        if bare:
            policy["command"] = bare_argv(policy["command"])
        stdin = STATE.encode() if bare else lang.stdin_payload(job)
        assert raw_container(api, policy, stdin) == 0

    return run


def plain_subprocess(ex: Executor, *, bare: bool) -> Callable[[], object]:
    """subprocess.run of deno: same argv, environment and uid as the runtime, no rlimits."""
    lang = get_language("typescript")
    argv = lang.command(ex.settings, ex.limits(20), in_container=False)
    env = lang.environment(ex.settings, in_container=False)
    uid, gid = sandbox_ids()
    as_root = os.getuid() == 0
    job = CodeJob(language="typescript", code=TRIVIAL, state_json=STATE)
    payload = STATE.encode() if bare else lang.stdin_payload(job)
    if bare:
        argv = bare_argv(argv)

    def run() -> None:
        workdir = tempfile.mkdtemp(prefix="studio-bench-")
        try:
            if as_root:
                os.chown(workdir, uid, gid)
            proc = subprocess.run(
                argv,
                input=payload,
                capture_output=True,
                env=env,
                cwd=workdir,
                user=uid if as_root else None,
                group=gid if as_root else None,
                extra_groups=[] if as_root else None,
                check=True,
            )
            if bare:
                check_bare(proc.stdout)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    return run


def row(name: str, samples: list[float], base: list[float] | None) -> str:
    p50, p95 = pct(samples, 50), pct(samples, 95)
    if base is None:
        ratio = "1.00x"
    else:
        b50, b95 = pct(base, 50), pct(base, 95)
        ratio = f"{p50 / b50:.2f}x / {p95 / b95:.2f}x, +{p50 - b50:.1f} ms"
    return f"| {name} | {p50:.1f} | {p95:.1f} | {ratio} |"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.typescript")
    p.add_argument("--n", type=int, default=20, help="timed iterations per side (after 2 warm-ups)")
    n = p.parse_args().n
    print(f"# bench.typescript: trivial TS node, n={n} per side after 2 warm-ups, interleaved")
    print("| runtime: what | p50 ms | p95 ms | vs bare deno (p50 / p95) |")
    print("|---|---|---|---|")
    for runtime in ("docker", "subprocess"):
        ex = Executor(load_settings(enable_code_nodes=True, code_runtime=runtime))
        ready = ex.readiness(get_language("typescript"), fresh=True)
        if not ready.ready:
            print(f"| {runtime}: skipped | | | {ready.reason} |")
            continue
        if runtime == "docker":
            sides = [via_executor(ex), docker_sdk(ex, bare=False), docker_sdk(ex, bare=True)]
            how = "raw SDK"
        else:
            sides = [
                via_executor(ex),
                plain_subprocess(ex, bare=False),
                plain_subprocess(ex, bare=True),
            ]
            how = "subprocess.run"
        e2e, runner, bare = interleave(n, sides)
        print(row(f"{runtime}: Executor.run (e2e)", e2e, bare))
        print(row(f"{runtime}: runner, {how} (no executor)", runner, bare))
        print(row(f"{runtime}: bare `deno run` of the program, {how}", bare, None))
    print()
    lang = get_language("typescript")
    settings = load_settings(enable_code_nodes=True)
    limits = Executor(settings).limits(20)
    for runtime, in_container in (("docker", True), ("subprocess", False)):
        argv = lang.command(settings, limits, in_container=in_container)
        flags = " ".join(a for a in argv if a.startswith("--"))
        env = lang.environment(settings, in_container=in_container)
        print(f"{runtime}: deno run {flags}; env {' '.join(sorted(env))}")


if __name__ == "__main__":
    main()
