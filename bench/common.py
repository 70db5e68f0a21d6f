"""What every benchmark section shares: percentiles, interleaved timing, the raw container."""

from __future__ import annotations

import math
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (nan for no samples)."""
    if not samples:
        return float("nan")
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, math.ceil(len(s) * q / 100) - 1))]


def timed(fn: Callable[[], object]) -> float:
    """Milliseconds ``fn`` took."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def interleave(n: int, fns: list[Callable[[], object]], warmup: int = 2) -> list[list[float]]:
    """Time each of ``fns`` n times, one after the other in turn, so every side sees the same
    machine noise; returns one list of milliseconds per function."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(n):
        for i, fn in enumerate(fns):
            out[i].append(timed(fn))
    return out


def raw_container(api: Any, policy: dict[str, Any], stdin: bytes) -> int:
    """The floor any executor pays: create→attach→start→(stdin)→read→wait→remove with the
    Docker SDK, given create arguments (``sandbox_policy``'s); returns the exit status."""
    policy = {**policy, "host_config": api.create_host_config(**policy["host_config"])}
    cid = api.create_container(name=f"studio-code-bench-{uuid.uuid4().hex}", **policy)["Id"]
    try:
        sock = api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        raw = sock._sock
        api.start(cid)
        raw.sendall(stdin)
        raw.shutdown(socket.SHUT_WR)
        while raw.recv(1 << 16):
            pass
        status = int(api.wait(cid)["StatusCode"])
        sock.close()
        return status
    finally:
        api.remove_container(cid, force=True)
