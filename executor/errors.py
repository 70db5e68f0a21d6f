"""Error codes and the one exception hierarchy of the executor.

What the user's code did (a timeout, an OOM, a non-JSON return) is a *result* with an
error code, never an exception. Exceptions here are for what the caller must act on:
bad settings, Code nodes off, a runtime that cannot start, refused input.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Machine-readable error codes; part of the public contract (CLI JSON, HTTP, run store)."""

    CODE_NODES_DISABLED = "CODE_NODES_DISABLED"
    RUNTIME_UNAVAILABLE = "RUNTIME_UNAVAILABLE"
    CODE_INVALID = "CODE_INVALID"
    CODE_ERROR = "CODE_ERROR"
    CODE_TIMEOUT = "CODE_TIMEOUT"
    CODE_MEMORY = "CODE_MEMORY"
    CODE_OUTPUT_INVALID = "CODE_OUTPUT_INVALID"
    CODE_CANCELLED = "CODE_CANCELLED"
    RATE_LIMITED = "RATE_LIMITED"

    @property
    def http_status(self) -> int:
        """The HTTP status of a request refused with this code: 400 for input to fix, 429
        to wait, 503 for the service (Code nodes off, a runtime or the store down). The one
        mapping: the HTTP API reads it here."""
        return _HTTP_STATUS.get(self, 503)


_HTTP_STATUS = {
    ErrorCode.CODE_INVALID: 400,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.CODE_NODES_DISABLED: 503,
    ErrorCode.RUNTIME_UNAVAILABLE: 503,
}


class StudioCodeError(Exception):
    """Raised when the executor cannot do what was asked; carries a code and a sentence."""

    code: ErrorCode = ErrorCode.RUNTIME_UNAVAILABLE

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        return {"code": str(self.code), "message": self.message}


class SettingsError(StudioCodeError):
    """Raised when a STUDIO_* variable is malformed; start-up must stop."""

    code = ErrorCode.RUNTIME_UNAVAILABLE


class CodeNodesDisabled(StudioCodeError):
    """Raised when Code nodes are off (STUDIO_ENABLE_CODE_NODES unset or an unknown runtime)."""

    code = ErrorCode.CODE_NODES_DISABLED


class RuntimeUnavailable(StudioCodeError):
    """Raised when the runtime cannot run code: Docker unreachable, image or Deno missing."""

    code = ErrorCode.RUNTIME_UNAVAILABLE


class CodeInvalid(StudioCodeError):
    """Raised when code cannot be saved or run: syntax error, no main, a refused import."""

    code = ErrorCode.CODE_INVALID


class RateLimited(StudioCodeError):
    """Raised when a user made more editor test calls than STUDIO_CODE_TEST_PER_MINUTE."""

    code = ErrorCode.RATE_LIMITED

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "retry_after_s": str(self.retry_after_s)}


class StoreUnavailable(RuntimeUnavailable):
    """Raised when the run store cannot be reached, opened or read; the message names it
    (its URL without the password) and says what to check."""

    code = ErrorCode.RUNTIME_UNAVAILABLE


class SandboxRefused(RuntimeUnavailable):
    """Raised by a runtime when its engine refused to make or start the job's sandbox, before
    the job's input was written to it (a create or start the engine answered with an error:
    runc refusing a CPU quota, the engine's CPU range, a socket guard's 403). The job never
    ran, so running it again, here or elsewhere, repeats the refusal: never
    ``InfrastructureLost``. The executor ends the job at once: CODE_INVALID naming the
    node's own limits when they differ from the server's defaults (the engine refused what
    the node asked for), else RUNTIME_UNAVAILABLE with this message (the worker tells its
    runtime gate, once). ``detail``: the engine's own words."""

    def __init__(self, detail: str, *, message: str) -> None:
        super().__init__(message)
        self.detail = detail


class InfrastructureLost(RuntimeUnavailable):
    """Raised by a runtime when a sandbox ended because of the infrastructure, not its code:
    the engine went away or restarted, the sandbox vanished or was killed through the engine
    by something other than the job (``docker kill``/``docker stop``), its stream or its wait
    broke with an engine error. Never a ``CODE_*`` outcome: a runtime whose re-run is harmless
    (``Runtime.rerun_safe``) has the job run again elsewhere (worker/job/tasks.py); otherwise,
    and once the attempts are spent, the job ends RUNTIME_UNAVAILABLE with this message.

    ``cause`` is machine-readable (one of CAUSES): the trace row ``sandbox.lost`` carries it."""

    ENGINE_UNREACHABLE = "engine_unreachable"
    ENGINE_STOPPING = "engine_stopping"
    SANDBOX_VANISHED = "sandbox_vanished"
    STREAM_BROKEN = "stream_broken"
    ENGINE_ERROR = "engine_error"
    SANDBOX_KILLED = "sandbox_killed"
    CAUSES = (
        ENGINE_UNREACHABLE,
        ENGINE_STOPPING,
        SANDBOX_VANISHED,
        STREAM_BROKEN,
        ENGINE_ERROR,
        SANDBOX_KILLED,
    )

    def __init__(self, cause: str, detail: str, *, message: str | None = None) -> None:
        """``message``: the sentence, when the sandbox never started (the engine was away
        before it): nothing was lost, the runtime's own words say why."""
        super().__init__(
            message
            or f"The job's sandbox was lost to the infrastructure, not to its code ({cause}: "
            f"{detail}). Check the Docker engine (docker info, its log); the job can be run "
            "again as it is."
        )
        self.cause = cause
        self.detail = detail

    @property
    def engine_answers(self) -> bool:
        """The sandbox's engine answered after the loss (it was signalled through a healthy
        engine): what is left of it is removed at once, not left for later."""
        return self.cause == self.SANDBOX_KILLED
