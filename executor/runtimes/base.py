"""What every runtime does: start one sandbox for one job, feed it, bound it, end it."""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from executor.languages.base import Language
from executor.models import CodeJob, Limits
from executor.settings import Settings

#: polled while a sandbox runs; True means "the job was cancelled: kill it now"
CancelCheck = Callable[[], bool]
POLL_S = 0.05


def owner_id() -> str:
    """Who started a sandbox: host and pid, so a restarted worker can reap what it left."""
    return f"{socket.gethostname()}:{os.getpid()}"


#: Set by a caller (the worker) around a run: a runtime hands it to its logs buffer, which
#: passes each kept piece on as it comes (live logs). Same cap as the stored logs, since
#: only what the buffer keeps is passed on. It must be quick and never raise.
LOG_TAP: ContextVar[Callable[[bytes], None] | None] = ContextVar("studio_log_tap",
                                                                 default=None)


class BoundedBuffer:
    """Keeps the first ``limit`` bytes of a stream and counts the rest, so a print flood
    costs the host no memory. ``tap`` (optional) gets each kept piece as it is written."""

    def __init__(self, limit: int, tap: Callable[[bytes], None] | None = None) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.kept = 0
        self.total = 0
        self.tap = tap

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - self.kept
        if room > 0:
            piece = data[:room]
            self.chunks.append(piece)
            self.kept += len(piece)
            if self.tap is not None and piece:
                try:
                    self.tap(piece)
                except Exception:  # noqa: BLE001, S110 - live logs never break a run
                    pass

    @property
    def truncated(self) -> bool:
        return self.total > self.kept

    def getvalue(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class RawRun:
    """What a sandbox did, before it is read as a result."""

    exit_code: int | None
    stdout: bytes
    stdout_truncated: bool
    logs: bytes
    logs_total: int
    timed_out: bool = False
    oom_killed: bool = False
    cancelled: bool = False
    start_ms: float = 0.0
    run_ms: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def logs_truncated(self) -> bool:
        return self.logs_total > len(self.logs)


class Runtime(ABC):
    """A way to run one job: ``docker`` or ``subprocess``."""

    name: str

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @abstractmethod
    def run(
        self,
        job: CodeJob,
        language: Language,
        limits: Limits,
        *,
        should_cancel: CancelCheck | None = None,
    ) -> RawRun:
        """Run ``job`` in a new sandbox and always clean it up. Raises RuntimeUnavailable
        when the sandbox cannot start; what the code did is in the RawRun."""

    @abstractmethod
    def kill(self, job_id: str) -> bool:
        """Kill the sandbox of ``job_id`` if this process (or, for docker, any) can see it.
        Already gone counts as success; returns True when something was killed."""

    @abstractmethod
    def unavailable_reason(self, language: Language) -> str | None:
        """Why this runtime cannot run ``language`` at all (a cheap check), or None."""
