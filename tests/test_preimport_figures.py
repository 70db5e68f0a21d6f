"""The rule that makes a pre-import memory figure (executor/runtimes/docker/preimport_memory.py
``_measure_once``), on a pool and meters of the test's own: the real measurement is
tests/test_preimport.py and tests/test_preimport_meta.py on the engine; this holds the rule
a loaded host broke there (a sandbox read mid-import, below its bare twin: a negative figure
in meta)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from executor.runtimes.docker import preimport_memory


@dataclass
class _Meter:
    """Readings in order (the last one repeats); CPU time constant, so it is quiet."""

    readings: list[int]
    read: int = 0

    def _read(self, api: Any) -> tuple[int, int]:
        return (0, 1000)

    def resident(self) -> int:
        got = self.readings[min(self.read, len(self.readings) - 1)]
        self.read += 1
        return got

    def source(self) -> str:
        return "test"


@dataclass(eq=False)
class _Box:
    meter: _Meter
    cid: str = "c"
    language: str = "python"
    image_id: str = "sha256:test"


@dataclass(eq=False)  # hashed by identity, as the module keeps figures per pool
class _Pool:
    bare: _Box
    settings: Any = None
    limits: Any = field(default_factory=lambda: type("L", (), {"memory_bytes": 1 << 28})())
    api: Any = None

    def preimports(self, language: str) -> bool:
        return True

    def closing(self) -> bool:
        return False

    def is_idle(self, sandbox: Any) -> bool:
        return True

    def start_aside(self, language: str) -> _Box:
        return self.bare

    def release(self, sandbox: Any) -> None:
        pass


MIB = 1 << 20


def _figures(idle: list[int], bare: int) -> dict[str, Any] | None:
    pool = _Pool(_Box(_Meter([bare])))
    recorded = preimport_memory._measure_once(pool, _Box(_Meter(idle)))
    return preimport_memory.measured(pool).get("python") if recorded else None


def test_a_reading_below_its_bare_twin_is_read_again_and_never_a_figure() -> None:
    # read mid-import (3.0 MB) against a bare twin of 4.6 MB, and again at 3.0: not a figure
    assert _figures([3 * MIB, 3 * MIB], bare=46 * MIB // 10) is None
    # the second reading, after the twin went quiet, is the fuller one: that is the figure
    got = _figures([3 * MIB, 25 * MIB], bare=46 * MIB // 10)
    assert got is not None and got["idle_memory_bytes"] == 25 * MIB, got
    assert got["without_preimport_bytes"] == 46 * MIB // 10
    # a module that holds nothing: a few pages below the twin is still a figure (about 0)
    got = _figures([4 * MIB, 4 * MIB], bare=4 * MIB + 100 * 1024)
    assert got is not None and got["idle_memory_bytes"] == 4 * MIB, got
