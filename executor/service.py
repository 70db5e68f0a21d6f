"""The executor: runs ONE code node in the configured runtime and reads what it did.

No queue here: the CLI's ``run`` uses this directly; the Celery worker calls it too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from executor import tracing
from executor.audit import AuditSink, LogAuditSink
from executor.errors import (
    CodeInvalid,
    CodeNodesDisabled,
    ErrorCode,
    InfrastructureLost,
    RuntimeUnavailable,
    SandboxRefused,
    StudioCodeError,
)
from executor.inputs import (
    capped_timeout_s,
    check_cpus,
    check_memory,
    check_state_size,
    size_text,
)
from executor.languages import get_language, offered_language
from executor.languages.base import NO_FACTS, ImageFacts, Language, Problem
from executor.models import (
    CodeErrorInfo,
    CodeJob,
    CodeResult,
    Limits,
    RawRun,
    Status,
    TraceRow,
)
from executor.outputs import MESSAGE_MAX_CHARS, OutputInvalid, parse_reply, safe_text
from executor.runtimes.base import (
    CancelCheck,
    CancelledBeforeStart,
    PoolObserver,
    Runtime,
    owner_id,
)
from executor.settings import KNOWN_RUNTIMES, Settings

log = logging.getLogger("studio_code")

READINESS_TTL_S = 15.0
#: the only error codes a runner may report on the result channel
RUNNER_CODES = {
    str(c): c
    for c in (
        ErrorCode.CODE_ERROR,
        ErrorCode.CODE_INVALID,
        ErrorCode.CODE_OUTPUT_INVALID,
        ErrorCode.CODE_MEMORY,
    )
}
READINESS_TIMEOUT_S = 20.0
#: a run its cancel ended (its sandbox removed)
CANCELLED_MESSAGE = "The run was cancelled and its sandbox killed."

#: the trace row of a run whose sandbox the infrastructure killed (InfrastructureLost): its
#: detail is the machine-readable cause
LOST_STEP = "sandbox.lost"
#: the trace row of a run that is a re-run: its detail says why the job ran again
RERUN_STEP = "job.rerun"
#: the trace row of a run whose sandbox the engine refused before the job's input was
#: written (SandboxRefused): its detail is REFUSED_LIMITS (the node's own limits, ended
#: CODE_INVALID) or REFUSED_ENGINE (the server's defaults: RUNTIME_UNAVAILABLE); never re-run
REFUSED_STEP = "sandbox.refused"
REFUSED_LIMITS = "limits"
REFUSED_ENGINE = "engine"


@dataclass(frozen=True)
class Readiness:
    """Whether a language can run now, proven by running its test program."""

    ready: bool
    reason: str | None
    checked_at: float
    #: a ready language whose package setting disagrees with its image: the names, in one
    #: sentence (executor.package_lists.packages_warning)
    warning: str | None = None


def runtime_class(settings: Settings) -> type[Runtime] | None:
    """The class of the runtime STUDIO_CODE_RUNTIME names (None: unknown). The one place
    that reads the name: everything else asks the runtime what it can do."""
    if settings.code_runtime == "docker":
        from executor.runtimes.docker.runtime import DockerRuntime

        return DockerRuntime
    if settings.code_runtime == "subprocess":
        from executor.runtimes.subprocess.runtime import SubprocessRuntime

        return SubprocessRuntime
    return None


def make_runtime(settings: Settings) -> Runtime | None:
    """The runtime STUDIO_CODE_RUNTIME names, or None for an unknown value (Code nodes off)."""
    cls = runtime_class(settings)
    if cls is None:
        return None
    runtime = cls(settings)
    for warning in runtime.warnings:
        log.warning(warning)
    return runtime


class Executor:
    """Validates, runs and reads Code nodes under one Settings; one per server process."""

    def __init__(self, settings: Settings, *, audit: AuditSink | None = None) -> None:
        self.settings = settings
        self.audit_sink: AuditSink = audit or LogAuditSink()
        self.runtime = make_runtime(settings)
        self._slots = threading.BoundedSemaphore(settings.code_concurrency)
        self._readiness: dict[str, Readiness] = {}
        self._audit_lock = threading.Lock()
        self._audited = False
        #: the memory and CPU caps a node's ask is checked against (None: this process's
        #: STUDIO_CODE_MAX_MEMORY / _MAX_CPUS). The API sets the widest of its worker
        #: groups (executor.groups): the group's own is checked when it is chosen.
        self.caps: tuple[int, float] | None = None

    # --- what may run -----------------------------------------------------------------

    def disabled_reason(self) -> str | None:
        """Why Code nodes are off, or None when they are on."""
        s = self.settings
        if not s.enable_code_nodes:
            return (
                "Code nodes are off: set STUDIO_ENABLE_CODE_NODES=1 on the API and the workers "
                "to turn them on."
            )
        if not s.runtime_known:
            return (
                f"STUDIO_CODE_RUNTIME={s.code_runtime!r} is not a known runtime, so Code nodes "
                f"are off: set it to {' or '.join(KNOWN_RUNTIMES)}."
            )
        return None

    def language(self, name: str) -> Language:
        """The language ``name`` if it is offered; raises CodeInvalid saying what is."""
        return offered_language(name, self.settings)

    def limits(
        self,
        timeout_s: float | None = None,
        *,
        memory_bytes: int | None = None,
        cpus: float | None = None,
    ) -> Limits:
        """The limits of one call: a node's timeout is capped by STUDIO_CODE_MAX_SECONDS, its
        memory and CPU share (checked by ``check_limits``) by their caps."""
        s = self.settings
        timeout = capped_timeout_s(timeout_s, max_seconds=s.code_max_seconds)
        return Limits(
            memory_bytes=s.memory_bytes
            if memory_bytes is None
            else min(memory_bytes, s.max_memory_bytes),
            cpus=s.code_cpus if cpus is None else min(cpus, s.max_cpus),
            pids=s.code_pids,
            timeout_s=timeout,
            log_max_bytes=s.code_log_max_bytes,
            output_max_bytes=s.code_output_max_bytes,
        )

    def image_facts(self, language: Language) -> ImageFacts:
        """What ``language``'s image has, as this executor's runtime reads it (``NO_FACTS``
        without a runtime): the languages' save-time check and package lists take it."""
        if self.runtime is None:
            return NO_FACTS
        return self.runtime.image_facts(self.settings, language)

    def check_code(self, code: str, language: str) -> list[Problem]:
        """Save-time check: [] when the code may be saved. Raises CodeInvalid for a language
        that is not offered."""
        lang = self.language(language)
        return lang.check(code, self.settings, self.image_facts(lang))

    def check_job(
        self, job: CodeJob, *, language: Language | None = None, state_checked: bool = False
    ) -> Language:
        """Everything that refuses a job before a sandbox starts, in one place (the API's
        submit and the worker's run both call it): Code nodes off, a language not offered,
        save-time problems, a state over STUDIO_CODE_STATE_MAX_BYTES. Returns its language.
        A caller that has already looked up the language (``language``) or checked the
        state's size (``state_checked``) passes that on: each is checked once per process."""
        reason = self.disabled_reason()
        if reason:
            raise CodeNodesDisabled(reason)
        if language is None or language.name != job.language:
            language = self.language(job.language)
        problems = language.check(job.code, self.settings, self.image_facts(language))
        if problems:
            raise CodeInvalid("; ".join(str(p) for p in problems))
        self.check_limits(memory_bytes=job.memory_bytes, cpus=job.cpus)
        if not state_checked:
            check_state_size(job.state_json, max_bytes=self.settings.code_state_max_bytes)
        return language

    def check_limits(
        self,
        *,
        memory_bytes: int | None = None,
        cpus: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """What a node asks for, against the floors and the server's caps (one rule,
        executor.inputs): CodeInvalid giving the range."""
        s = self.settings
        max_memory, max_cpus = self.caps or (s.max_memory_bytes, s.max_cpus)
        check_memory(memory_bytes, max_bytes=max_memory)
        check_cpus(cpus, max_cpus=max_cpus)
        if timeout_s is not None and not 0 < timeout_s <= s.code_max_seconds:
            raise CodeInvalid(
                f"The node's timeout of {timeout_s:g} s is not allowed: give more than 0 and "
                f"at most the cap STUDIO_CODE_MAX_SECONDS={s.code_max_seconds:g}."
            )

    def validate_node(self, language: str) -> None:
        """Workflow validation of a Code node: raises CodeNodesDisabled, CodeInvalid (language
        not offered) or RuntimeUnavailable (with how to fix it); returns when it can run."""
        reason = self.disabled_reason()
        if reason:
            raise CodeNodesDisabled(reason)
        lang = self.language(language)
        ready = self.readiness(lang)
        if not ready.ready:
            raise RuntimeUnavailable(ready.reason or "The runtime is not ready.")

    def readiness(self, language: Language, *, fresh: bool = False) -> Readiness:
        """Runs the language's test program in the runtime (cached briefly)."""
        cached = self._readiness.get(language.name)
        now = time.monotonic()
        if cached and not fresh and now - cached.checked_at < READINESS_TTL_S:
            return cached
        result = self._probe(language)
        self._readiness[language.name] = result
        return result

    def _probe(self, language: Language) -> Readiness:
        now = time.monotonic()
        reason = self.disabled_reason()
        if reason is None and self.runtime is not None:
            reason = self.runtime.unavailable_reason(language)
        if reason is not None:
            return Readiness(False, reason, now)
        job = CodeJob(
            job_id=f"ready-{uuid.uuid4().hex[:12]}",
            language=language.name,  # type: ignore[arg-type]
            code=language.test_program,
            timeout_s=READINESS_TIMEOUT_S,
        )
        result = self._run(job, language, self.limits(READINESS_TIMEOUT_S), None, probe=True)
        if result.status is Status.SUCCEEDED and result.output == Language.TEST_OUTPUT:
            from executor.package_lists import compares, packages_warning

            warning = None
            if compares(self.settings, language.name):
                found = self.image_facts(language).packages()
                warning = packages_warning(self.settings, language.name, found)
            return Readiness(True, None, now, warning)
        detail = result.error.message if result.error else f"output {result.output!r}"
        return Readiness(
            False,
            f"The {language.name} test program did not run in the {self.runtime_name} "
            f"runtime: {detail}",
            now,
        )

    @property
    def runtime_name(self) -> str:
        return self.settings.code_runtime

    # --- the runtime's life in a long-lived process (a worker's pool process) ----------

    def prepare(self, observe: PoolObserver | None = None) -> None:
        """Connect the runtime and fill its pool of pre-started sandboxes for every offered
        language (STUDIO_CODE_PREWARM); a process that runs many jobs calls it once."""
        if self.runtime is None or self.disabled_reason():
            return
        languages = [get_language(name) for name in self.settings.languages]
        self.runtime.prepare(languages, self.limits(), observe)

    def close(self) -> None:
        """Remove the runtime's idle pre-started sandboxes (a stopping process)."""
        if self.runtime is not None:
            self.runtime.close()

    def on_path(self) -> AbstractContextManager[None]:
        """The block is one job's path to its caller: the runtime's background work (its
        pool's replacements and removals) waits until it ends (``Runtime.on_path``)."""
        return self.runtime.on_path() if self.runtime is not None else nullcontext()

    # --- one call ----------------------------------------------------------------------

    def run(self, job: CodeJob, *, should_cancel: CancelCheck | None = None) -> CodeResult:
        """Run one job to a result. Never raises for what the code did, nor for a runtime
        that is off or down: those are results with an error code too."""
        started = time.monotonic()
        try:
            language = self.check_job(job)
            limits = self.limits(job.timeout_s, memory_bytes=job.memory_bytes, cpus=job.cpus)
            return self._run(job, language, limits, should_cancel)
        except StudioCodeError as e:
            return self._result(
                job, Status.ended_by(e.code), error=e.code, message=e.message, t0=started
            )
        except Exception as e:  # a bug or a broken engine must still give the job an end
            log.exception("job %s: the executor failed", job.job_id)
            return self._result(
                job,
                Status.FAILED,
                error=ErrorCode.RUNTIME_UNAVAILABLE,
                message=f"The executor failed to run the job ({type(e).__name__}: {e}); run "
                "it again, and tell the operator if it keeps failing.",
                t0=started,
            )

    def _run(
        self,
        job: CodeJob,
        language: Language,
        limits: Limits,
        should_cancel: CancelCheck | None,
        *,
        probe: bool = False,
    ) -> CodeResult:
        assert self.runtime is not None
        t0 = time.monotonic()
        try:
            while not self._slots.acquire(timeout=0.1):
                if should_cancel is not None and should_cancel():
                    raise CancelledBeforeStart("Cancelled before it started.")
            try:
                if not probe:
                    self._audit_first_subprocess_call(job)
                started_ns = time.time_ns()  # the trace's sandbox_start begins here
                raw = self.runtime.run(job, language, limits, should_cancel=should_cancel)
            finally:
                self._slots.release()
        except CancelledBeforeStart as e:
            return self._result(
                job, Status.CANCELLED, error=ErrorCode.CODE_CANCELLED, message=str(e), t0=t0
            )
        except InfrastructureLost as e:
            if should_cancel is not None and should_cancel():
                # the cancel removed its sandbox (between its create and start, or before
                # the run saw the cancel): the job's end is the cancel, never a re-run
                return self._result(
                    job,
                    Status.CANCELLED,
                    error=ErrorCode.CODE_CANCELLED,
                    message=CANCELLED_MESSAGE,
                    t0=t0,
                )
            # never the code's: RUNTIME_UNAVAILABLE, and the trace row says the cause (the
            # worker runs it again elsewhere when the runtime's re-run is harmless)
            log.warning("job %s: sandbox lost to the infrastructure: %s", job.job_id, e.message)
            return self._result(
                job, Status.FAILED, error=e.code, message=e.message, t0=t0, lost=e.cause
            )
        except SandboxRefused as e:
            return self._refused(job, limits, e, t0)
        except StudioCodeError as e:
            status = Status.ended_by(e.code)
            return self._result(job, status, error=e.code, message=e.message, t0=t0)
        result = self._read(job, language, limits, raw, t0)
        tracing.sandbox(result, raw, started_ns)  # spans under a worker's job span, if any
        return result

    def _refused(self, job: CodeJob, limits: Limits, e: SandboxRefused, t0: float) -> CodeResult:
        """The engine refused the job's sandbox before its input was written: the job never
        ran and a re-run would repeat the refusal. CODE_INVALID naming the node's own
        request when its limits differ from the server's defaults, else the runtime's
        RUNTIME_UNAVAILABLE (the worker tells its runtime gate)."""
        s = self.settings
        asked = []
        if limits.cpus != s.code_cpus:
            asked.append(f"cpus={limits.cpus:g}")
        if limits.memory_bytes != s.memory_bytes:
            asked.append(f"memory={size_text(limits.memory_bytes)}")
        if asked:
            log.warning(
                "job %s: the engine refused its sandbox with %s: %s",
                job.job_id,
                ", ".join(asked),
                e.detail,
            )
            message = (
                f"The engine refused a sandbox with {', '.join(asked)}, so the job did not "
                f"run: {e.detail}. Use the defaults (cpus={s.code_cpus:g}, "
                f"memory={size_text(s.memory_bytes)}) or other limits this server's engine "
                "takes."
            )
            return self._result(
                job,
                Status.INVALID,
                error=ErrorCode.CODE_INVALID,
                message=message,
                t0=t0,
                refused=REFUSED_LIMITS,
            )
        log.error("job %s: the engine refused its sandbox: %s", job.job_id, e.detail)
        return self._result(
            job, Status.FAILED, error=e.code, message=e.message, t0=t0, refused=REFUSED_ENGINE
        )

    def _audit_first_subprocess_call(self, job: CodeJob) -> None:
        event = self.runtime.audit_event if self.runtime is not None else None
        if event is None or self._audited:
            return
        with self._audit_lock:
            if self._audited:
                return
            try:
                self.audit_sink.audit(
                    event,
                    {"owner": owner_id(), "job_id": job.job_id, "language": job.language},
                )
            except Exception:  # the next call tries again; the run itself goes on
                log.exception("could not write the %s audit entry", event)
                return
            self._audited = True

    # --- reading what the sandbox did -------------------------------------------------

    def _read(
        self, job: CodeJob, language: Language, limits: Limits, raw: RawRun, t0: float
    ) -> CodeResult:
        s = self.settings
        logs = raw.logs.decode("utf-8", errors="replace")
        if raw.logs_truncated:
            logs += (
                f"\n[logs truncated: {raw.logs_total - len(raw.logs)} more bytes were printed "
                f"than the {limits.log_max_bytes}-byte limit keeps]"
            )
        common: dict[str, Any] = {"logs": logs, "raw": raw, "t0": t0}
        if raw.cancelled:
            return self._result(
                job,
                Status.CANCELLED,
                error=ErrorCode.CODE_CANCELLED,
                message=CANCELLED_MESSAGE,
                **common,
            )
        if raw.timed_out:
            return self._result(
                job,
                Status.TIMED_OUT,
                error=ErrorCode.CODE_TIMEOUT,
                message=f"The code ran longer than its timeout of {limits.timeout_s:g} s and "
                "was stopped: make it faster, or raise the node's timeout (at most "
                f"STUDIO_CODE_MAX_SECONDS={s.code_max_seconds:g}).",
                **common,
            )
        if raw.oom_killed or _killed_at_its_memory_limit(raw, limits):
            return self._memory_result(job, limits, **common)
        crash = language.crash_error(raw)
        if crash is not None:
            if crash.code is ErrorCode.CODE_MEMORY:
                return self._memory_result(job, limits, **common)
            return self._result(
                job, Status.FAILED, error=crash.code, message=crash.message, **common
            )
        if raw.stdout_truncated:
            return self._result(
                job,
                Status.FAILED,
                error=ErrorCode.CODE_OUTPUT_INVALID,
                message=f"The output is larger than {limits.output_max_bytes} bytes: return "
                "less, or keep large data elsewhere.",
                **common,
            )
        stdout = language.result_bytes(job, raw)
        pids_peak = raw.usage.pids_peak if raw.usage is not None else None
        if not stdout and pids_peak is not None and pids_peak >= limits.pids:
            # under gVisor a sandbox that reaches its pids limit ends as a whole (its kernel
            # cannot start the host thread a new task needs), so the code never sees EAGAIN
            return self._result(
                job,
                Status.FAILED,
                error=ErrorCode.CODE_ERROR,
                message=f"The sandbox reached its limit of {limits.pids} processes and threads "
                f"(STUDIO_CODE_PIDS) and ended (exit status {raw.exit_code}) before main "
                "returned a value: start fewer processes or threads.",
                **common,
            )
        if not stdout:
            return self._result(
                job,
                Status.FAILED,
                error=ErrorCode.CODE_ERROR,
                message=f"The code ended the process (exit status {raw.exit_code}) before "
                "main returned a value: return the output from main instead of exiting or "
                "killing the process.",
                **common,
            )
        try:
            reply = parse_reply(stdout, max_bytes=limits.output_max_bytes + 4096)
        except OutputInvalid as e:
            return self._result(
                job, Status.FAILED, error=ErrorCode.CODE_OUTPUT_INVALID, message=str(e), **common
            )
        if reply["ok"]:
            return self._result(job, Status.SUCCEEDED, output=reply.get("output"), **common)
        err = reply.get("error")
        if not isinstance(err, dict):
            err = {"message": "The runner reported a failure it could not describe."}
        # Whatever reaches the result channel is only trusted so far: a runner reports these
        # codes and no other (user code that writes to the channel cannot claim, say,
        # RATE_LIMITED or RUNTIME_UNAVAILABLE).
        code = RUNNER_CODES.get(str(err.get("code")), ErrorCode.CODE_ERROR)
        if code is ErrorCode.CODE_MEMORY:
            return self._memory_result(job, limits, **common)
        status = Status.ended_by(code)
        message = err.get("message")
        if not isinstance(message, str) or not message.strip():
            message = "The code failed with an error that has no message."
        return self._result(job, status, error=code, message=message, **common)

    def _memory_result(self, job: CodeJob, limits: Limits, **common: Any) -> CodeResult:
        raw: RawRun = common["raw"]
        peak = raw.usage.memory_peak_bytes if raw.usage is not None else None
        used = (
            f"used {mib(peak)} of {mib(limits.memory_bytes)}"
            if peak is not None
            else f"used more than its limit of {mib(limits.memory_bytes)}"
        )
        return self._result(
            job,
            Status.FAILED,
            error=ErrorCode.CODE_MEMORY,
            message=f"The code {used} of memory (STUDIO_CODE_MEMORY="
            f"{self.settings.code_memory}) and was stopped: process less data at once, or "
            "ask the operator to raise STUDIO_CODE_MEMORY.",
            **common,
        )

    def _result(
        self,
        job: CodeJob,
        status: Status,
        *,
        t0: float,
        output: Any = None,
        error: ErrorCode | None = None,
        message: str = "",
        logs: str = "",
        raw: RawRun | None = None,
        lost: str | None = None,
        refused: str | None = None,
    ) -> CodeResult:
        runtime = self.runtime_name
        trace = []
        marker = (LOST_STEP, lost) if lost is not None else (REFUSED_STEP, refused)
        if marker[1] is not None:
            trace = [
                TraceRow(
                    step=marker[0],
                    runtime=runtime,
                    duration_ms=round((time.monotonic() - t0) * 1000, 3),
                    detail=marker[1],
                )
            ]
        elif raw is not None:
            trace = [
                TraceRow(
                    step="sandbox.start",
                    runtime=runtime,
                    duration_ms=round(raw.start_ms, 3),
                    detail="pool" if raw.pooled else "cold",
                ),
                TraceRow(
                    step="code.run",
                    runtime=runtime,
                    duration_ms=round(raw.run_ms, 3),
                    detail=str(status),
                ),
            ]
        warnings = list(self.runtime.run_warnings) if self.runtime is not None else []
        result = CodeResult(
            job_id=job.job_id,
            language=job.language,
            status=status,
            output=output,
            # the user's own words (an exception's text, what it printed) made storable
            error=(
                CodeErrorInfo(code=error, message=safe_text(message, MESSAGE_MAX_CHARS))
                if error
                else None
            ),
            logs=safe_text(logs),
            logs_truncated=bool(raw and raw.logs_truncated),
            runtime=runtime,
            code_runtime=runtime,
            duration_ms=round((time.monotonic() - t0) * 1000, 3),
            exit_code=raw.exit_code if raw else None,
            warnings=warnings,
            trace=trace,
            usage=raw.usage if raw is not None else None,
        )
        return result.with_sandbox(started=raw is not None, lost=lost, refused=refused)


def mib(n: int) -> str:
    """Bytes as the CODE_MEMORY message says them: "256 MiB" (one decimal below 10 MiB)."""
    m = n / (1 << 20)
    return f"{m:.1f} MiB" if m < 10 else f"{round(m)} MiB"


def _killed_at_its_memory_limit(raw: Any, limits: Any) -> bool:
    """A sandbox SIGKILLed (137) whose memory, measured by the host in its cgroup, reached
    its limit: the kernel's OOM killer, even where the engine does not flag it (under
    gVisor the host's OOM killer ends the sandbox's own kernel, and the engine's OOMKilled
    stays false). A timeout or a cancel is told apart before this is asked."""
    usage = getattr(raw, "usage", None)
    peak = getattr(usage, "memory_peak_bytes", None)
    return raw.exit_code == 137 and peak is not None and peak >= 0.95 * limits.memory_bytes
