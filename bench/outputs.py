"""What the hostile-output defences cost, side by side in ONE run (interleaved):

- a sandbox under our seccomp profile vs the same raw SDK container under Docker's built-in
  default profile (the only difference is the ``seccomp=`` security option);
- the host's checked reading of a large result (``parse_reply``: UTF-8, bounded-depth JSON,
  depth and surrogate check) vs a bare ``json.loads`` of the same bytes.

    python -m bench.outputs [--n 20]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from bench.common import interleave, raw_container, row
from executor.languages import get_language
from executor.models import CodeJob
from executor.outputs import parse_reply
from executor.runtimes.docker.policy import sandbox_policy
from executor.service import Executor
from executor.settings import load_settings

TRIVIAL = "def main(state):\n    return 1\n"


def container(ex: Executor, *, own_profile: bool) -> Callable[[], object]:
    api = ex.runtime.api  # type: ignore[union-attr]
    lang = get_language("python")
    limits = ex.limits(10)

    def run() -> None:
        job = CodeJob(code=TRIVIAL)
        policy = sandbox_policy(ex.settings, lang, job, limits, "bench")
        if not own_profile:
            host = dict(policy["host_config"])
            host["security_opt"] = [o for o in host["security_opt"] if not o.startswith("seccomp=")]
            policy = {**policy, "host_config": host}
        assert raw_container(api, policy, lang.stdin_payload(job)) == 0

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20)
    n = p.parse_args().n
    ex = Executor(load_settings(enable_code_nodes=True, code_runtime="docker"))
    print(f"# bench.outputs: n={n} per side, interleaved; p50 / p95 in ms")
    print("| what | ours p50 / p95 | floor p50 / p95 | ratio, delta | goal |")
    print("|---|---|---|---|---|")
    ours, default = interleave(
        n, [container(ex, own_profile=True), container(ex, own_profile=False)]
    )
    print(
        row(
            "docker: raw container under our seccomp profile vs Docker's default",
            ours,
            default,
            "≤ +10 ms",
        )
    )
    rows = [{"id": i, "name": f"row-{i}", "tags": ["a", "b"], "v": i * 0.5} for i in range(100_000)]
    data = json.dumps({"ok": True, "output": rows}).encode()

    def checked() -> None:
        parse_reply(data, max_bytes=len(data))

    def bare() -> None:
        json.loads(data)

    a, b = interleave(max(5, n // 2), [checked, bare])
    print(
        row(
            f"host: parse_reply of a {len(data) / 1e6:.1f} MB result vs bare json.loads",
            a,
            b,
            "(cost of the checks)",
        )
    )


if __name__ == "__main__":
    main()
