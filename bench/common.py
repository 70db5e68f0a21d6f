"""What every benchmark section shares: percentiles, interleaved timing, the raw container,
and the stack a section starts (``bench_stack``: testkit's Stack, quiet)."""

from __future__ import annotations

import math
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from testkit.stack import Stack


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


def row(name: str, a: list[float], b: list[float] | None, goal: str | None = "") -> str:
    """One table row: ``a``'s p50 / p95, the floor ``b``'s, their ratio and delta at p50, and
    the goal (``goal=None``: a table without a goal column)."""
    a50, a95 = pct(a, 50), pct(a, 95)
    if b is None:
        cells = f"| {name} | {a50:.1f} / {a95:.1f} | | |"
    else:
        b50, b95 = pct(b, 50), pct(b, 95)
        cells = (
            f"| {name} | {a50:.1f} / {a95:.1f} | {b50:.1f} / {b95:.1f} | "
            f"{a50 / b50:.2f}x, {a50 - b50:+.1f} ms |"
        )
    return cells if goal is None else f"{cells} {goal} |"


def bench_stack(name: str, *, quiet: bool = True, **overrides: Any) -> Stack:
    """The stack of a bench section (testkit.stack.Stack: its own redis-server unless given
    ``redis_url``, a SQLite store unless given ``database_url``, workers and the API as the
    section starts them), ``quiet`` (workers log at WARNING, the API writes no access log),
    in a new temporary folder ``studio-bench-<name>-*``. The section ends it with
    ``end_stack``."""
    from testkit.stack import Stack

    workdir = Path(tempfile.mkdtemp(prefix=f"studio-bench-{name}-"))
    return Stack(workdir, quiet=quiet, **overrides)


def end_stack(stack: Stack | None) -> None:
    """``stack`` stopped (API, workers, client, its redis-server) and its folder removed."""
    if stack is not None:
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)
