"""The Docker socket guard (``studio-code sockguard``) as a process of the test's own."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from testkit.processes import (
    BIN,
    Service,
)

#: the engine's socket as this process found it, before any test pointed DOCKER_HOST at a guard
REAL_DOCKER_HOST = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


class SockGuardProcess(Service):
    """``studio-code sockguard`` on a unix socket in ``workdir``, passing on to the real
    engine; ``host`` is the DOCKER_HOST that goes through it. With ``trace`` every call it
    passes is logged (``--log-requests``) beside its refusals: what a test asked of the
    engine."""

    stop_timeout = 10.0

    def __init__(
        self, workdir: Path, env: dict[str, str] | None = None, *, trace: bool = True
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.path = workdir / "guard.sock"
        self.host = f"unix://{self.path}"
        upstream = REAL_DOCKER_HOST.removeprefix("unix://")
        argv = [str(BIN / "studio-code"), "sockguard", "--listen", str(self.path)]
        argv += ["--upstream", upstream] + (["--log-requests"] if trace else [])
        base = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
        super().__init__(argv, {**base, **(env or {})}, workdir / "guard.log")
        deadline = time.monotonic() + 30
        while not self.path.exists():
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the socket guard did not start: {self.tail()}")
            time.sleep(0.05)

    def refusals(self) -> list[str]:
        return [line for line in self.output().splitlines() if "sockguard refused" in line]


TRIVIAL = "def main(state):\n    return state['n'] + 1\n"


def sandbox_args(api: Any, image: str, **host: Any) -> dict[str, Any]:
    """``sandbox_policy``'s create arguments (what a worker sends), ``host`` changed."""
    from executor.languages import get_language
    from executor.models import CodeJob
    from executor.runtimes.base import owner_id
    from executor.runtimes.docker.policy import sandbox_policy
    from executor.service import Executor
    from executor.settings import load_settings

    settings = load_settings(enable_code_nodes=True, code_runtime="docker", code_image=image)
    limits = Executor(settings).limits()
    policy = sandbox_policy(
        settings, get_language("python"), CodeJob(code=TRIVIAL), limits, owner_id()
    )
    policy.pop("detach")
    policy.pop("use_config_proxy")
    policy["host_config"] = api.create_host_config(**{**policy["host_config"], **host})
    return policy
