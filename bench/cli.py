"""What the `studio-code` command costs on top of the work it does, measured side by side in
ONE run (interleaved, so every side sees the same machine noise):

* ``studio-code --help`` and ``studio-code validate node.py`` vs a bare ``python -c pass`` of
  the same interpreter: the price of starting the command (its imports, its settings);
* ``studio-code run node.py`` (a whole process) vs the same run in this process through a
  warm ``Executor``: what a person pays for the command around the run, in the subprocess
  runtime and in the docker runtime (a cold container on both sides: no pre-started one).

    python -m bench.cli [--n 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import interleave, row
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

NODE = "def main(state):\n    return state['n'] + 1\n"
STATE = '{"n": 1}'


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20)
    n = p.parse_args().n
    python = sys.executable
    cli = str(Path(python).with_name("studio-code"))
    env = {**os.environ, "STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_CODE_RUNTIME": "subprocess"}
    runtimes = ("subprocess", "docker")
    with tempfile.TemporaryDirectory() as tmp:
        node = Path(tmp, "node.py")
        node.write_text(NODE)

        def proc(*argv: str, runtime: str = "subprocess") -> Callable[[], object]:
            run_env = {**env, "STUDIO_CODE_RUNTIME": runtime}

            def run() -> None:
                done = subprocess.run(
                    argv,
                    env=run_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
                assert done.returncode == 0, done.stdout

            return run

        def in_process(runtime: str) -> Callable[[], object]:
            ex = Executor(load_settings(enable_code_nodes=True, code_runtime=runtime))

            def run() -> None:
                r = ex.run(CodeJob(code=NODE, state_json=STATE, timeout_s=20))
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


if __name__ == "__main__":
    main()
