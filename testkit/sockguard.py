"""The Docker socket guard (``studio-code sockguard``) as a process of the test's own."""

from __future__ import annotations

import os
import time
from pathlib import Path

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
