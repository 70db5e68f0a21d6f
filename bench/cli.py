"""What the `studio-code` command costs on top of the work it does, measured side by side in
ONE run (interleaved, so every side sees the same machine noise):

* ``studio-code --help`` and ``studio-code validate node.py`` vs a bare ``python -c pass`` of
  the same interpreter: the price of starting the command (its imports, its settings);
* ``studio-code run node.py`` (a whole process) vs the same run in this process through a
  warm ``Executor``: what a person pays for the command around the run, in the subprocess
  runtime and in the docker runtime (a cold container on both sides: no pre-started one).

    python -m bench.cli [--n 20]

The project's modules are compiled first, as an install does (pip, ``make install``): with
PYTHONDONTWRITEBYTECODE=1 a checkout that never had them compiled (a fresh clone, a git
worktree) has no ``.pyc``, and each ``studio-code`` process compiled its modules from
source again, 40 to 55 ms of CPU here that the in-process side pays once and an installed
command never pays.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import interleave, row
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

NODE = "def main(state):\n    return state['n'] + 1\n"
STATE = '{"n": 1}'


def _cpu_ms(usage: resource.struct_rusage) -> float:
    return (usage.ru_utime + usage.ru_stime) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20)
    n = p.parse_args().n
    root = Path(__file__).resolve().parent.parent
    for package in ("executor", "worker", "api_client"):  # as the Makefile's install does
        compileall.compile_dir(root / package, quiet=1)
    python = sys.executable
    cli = str(Path(python).with_name("studio-code"))
    env = {**os.environ, "STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_CODE_RUNTIME": "subprocess"}
    runtimes = ("subprocess", "docker")
    #: CPU ms of each side's samples (warm-ups included): a whole process's (its own and its
    #: reaped children's) by (runtime, *argv), an in-process run's by ("in-process", runtime)
    cpu: dict[tuple[str, ...], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        node = Path(tmp, "node.py")
        node.write_text(NODE)

        def proc(*argv: str, runtime: str = "subprocess") -> Callable[[], object]:
            run_env = {**env, "STUDIO_CODE_RUNTIME": runtime}

            def run() -> None:
                r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                done = subprocess.run(
                    argv,
                    env=run_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                assert done.returncode == 0, done.stdout
                cpu.setdefault((runtime, *argv), []).append(_cpu_ms(r1) - _cpu_ms(r0))

            return run

        def in_process(runtime: str) -> Callable[[], object]:
            ex = Executor(load_settings(enable_code_nodes=True, code_runtime=runtime))

            def run() -> None:
                c0, r0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
                r = ex.run(CodeJob(code=NODE, state_json=STATE, timeout_s=20))
                kids = _cpu_ms(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu_ms(r0)
                # this process's CPU and its reaped children's (the subprocess runtime's
                # runner), as the command's side counts its own
                cpu.setdefault(("in-process", runtime), []).append(
                    (time.process_time() - c0) * 1000 + kids
                )
                assert r.status == "succeeded", r.error

            return run

        bare = proc(python, "-c", "pass")
        help_t, validate_t, bare_t = interleave(
            n, [proc(cli, "--help"), proc(cli, "validate", str(node)), bare]
        )
        run_t = {
            rt: interleave(
                n, [proc(cli, "run", str(node), "--state", STATE, runtime=rt), in_process(rt)]
            )
            for rt in runtimes
        }
    print(f"# bench.cli: n={n} per side, interleaved; p50 / p95 in ms")
    print("| what | command p50 / p95 | floor p50 / p95 | ratio, delta | goal |")
    print("|---|---|---|---|---|")
    print(row("`studio-code --help` vs `python -c pass`", help_t, bare_t, "≤ +150 ms"))
    print(
        row("`studio-code validate node.py` vs `python -c pass`", validate_t, bare_t, "≤ +200 ms")
    )
    for rt, (whole_t, inproc_t) in run_t.items():
        name = f"`studio-code run node.py` ({rt} runtime), whole process vs the same run in-process"
        print(row(name, whole_t, inproc_t, "≤ +150 ms"))
    # CPU, which a loaded machine stretches less than wall time: what the command costs
    # this host beyond the same run in-process (the engine's and the sandbox's aside)
    for rt in runtimes:
        whole = cpu[(rt, cli, "run", str(node), "--state", STATE)][-n:]
        inproc = cpu[("in-process", rt)][-n:]
        name = f"… its CPU (user + system, its children's too) vs the in-process run's ({rt})"
        print(row(name, whole, inproc, ""))


if __name__ == "__main__":
    main()
