"""One job in an attached, started container: the one sequence of a cold sandbox
(executor/runtimes/docker/runtime.py) and of a pre-started one (executor/runtimes/docker/pool.py).

``run_attached`` writes the job's stdin (a thread of its own: ``feed``), demultiplexes
Docker's attach stream into stdout and logs (``pump``) until EOF, the node's deadline, a
cancel or (a pre-started sandbox) a complete answer, then on EOF reads the exit status and
OOM from the container's state (``exit_state``, bounded by the same deadline). What makes
the sandbox and what removes it stay with the caller.

Infrastructure or code (``InfrastructureLost``, never a ``CODE_*`` outcome): a sandbox whose
wait or stream broke with an engine error, that vanished without a cancel, that ended
without the runner's clean exit while its engine takes no new connection (a stopping engine
closes its socket first, then kills its containers: what an upgrade's restart does; a
killed engine takes none at all), or that the engine was asked to signal while it ran (its
``kill`` event: a ``docker kill``/``docker stop``, an orchestrator; the project itself never
signals a sandbox, it removes it) was lost to the infrastructure. A sandbox that ended on
its own (any exit status) while its engine answers on a fresh connection and signalled it
not is the code's. An engine that refuses to make or start a sandbox (before the job's
input is written) lost nothing: the job never ran (``SandboxRefused``). What each engine error
means is engine_errors.py's rule, asked by the callers (``at_step``) and by ``exit_state``.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import docker

from executor.errors import InfrastructureLost
from executor.models import Limits, RawRun
from executor.runtimes.base import LOG_TAP, POLL_S, BoundedBuffer, CancelCheck
from executor.runtimes.docker.engine_errors import ENGINE_ERRORS, kind, unreachable


def engine_stopping(api: docker.APIClient) -> str | None:
    """Why the engine behind ``api`` takes no new connection now (None: it does), asked on a
    connection of its own, made as ``api`` was (DOCKER_HOST): the kept-alive connections of
    ``api`` are still served by an engine that is shutting down (dockerd closes its socket
    first, then stops its containers)."""
    import docker as sdk
    from docker.utils import kwargs_from_env

    try:
        fresh = sdk.APIClient(**kwargs_from_env(), version=api.api_version, timeout=FRESH_PING_S)
    except Exception as e:  # noqa: BLE001 - any failure to reach it is the answer
        return str(e)
    try:
        fresh.ping()
    except Exception as e:  # noqa: BLE001
        return str(e)
    finally:
        fresh.close()
    return None


#: how long the fresh-connection check of a sandbox that ended without its runner's clean
#: exit waits for the engine
FRESH_PING_S = 5.0


def killed_through_engine(api: docker.APIClient, cid: str, since: float) -> str | None:
    """The signal the engine was asked to send ``cid`` since ``since`` (wall clock, the
    job's start): a ``kill`` event (``docker kill``, ``docker stop``, an orchestrator). The
    project never signals a sandbox (it removes one, and a removal's kill leaves the
    container ``removing``: ``exit_state``), so such an event is not the job's. None when
    there is none, or when the events cannot be read (an older socket guard refuses the
    call): then the ending stays the code's, as before the check."""
    try:
        stream = api.events(
            since=f"{since - 1:.9f}",  # a second of slack for the engine's clock
            until=f"{time.time():.9f}",  # the past: the engine answers at once, then closes
            filters={"container": cid, "type": "container", "event": "kill"},
            decode=True,
        )
    except Exception:  # noqa: BLE001 - no events: the ending stays the code's
        return None
    try:
        for event in stream:  # the filter leaves this sandbox's kill events only
            attrs = (event.get("Actor") or {}).get("Attributes") or {}
            return f"signal {attrs.get('signal', '?')}"
    except Exception:  # noqa: BLE001
        return None
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return None


class RunLogs(BoundedBuffer):
    """A run's logs as read from the attach stream (live through ``tap``)."""

    def final(self) -> tuple[bytes, int]:
        """What the run's logs are once the stream is read: the kept bytes and the total."""
        return self.getvalue(), self.total


class Attached(NamedTuple):
    run: RawRun
    #: the runner's whole answer was in (``answered``): its exit was not waited for
    answered: bool


def run_attached(
    api: docker.APIClient,
    cid: str,
    raw: socket.socket,
    payload: bytes,
    limits: Limits,
    should_cancel: CancelCheck | None,
    *,
    started: float,
    t0: float,
    logs: RunLogs | None = None,
    answered: Callable[[BoundedBuffer], bool] | None = None,
    pooled: bool = False,
) -> Attached:
    """Run the job whose stdin is ``payload`` in the started container ``cid`` attached on
    ``raw``. The node's timeout counts from ``started`` (start_ms from ``t0``, when the job
    asked for a sandbox). ``answered(stdout)``: the runner's answer is complete (asked after
    every read), so exit 0 is taken without waiting for the exit. Engine and socket errors
    propagate: the caller wraps them (``engine_errors.at_step``) and removes the container."""
    writer = threading.Thread(target=feed, args=(raw, payload), daemon=True)
    writer.start()
    out = BoundedBuffer(limits.output_max_bytes + 4096)
    if logs is None:
        logs = RunLogs(limits.log_max_bytes, tap=LOG_TAP.get())  # live logs
    done = None if answered is None else (lambda: answered(out))
    deadline = started + limits.timeout_s
    ending = pump(raw, out, logs, deadline, should_cancel, done)
    kept, total = logs.final()
    run = RawRun(
        exit_code=None,
        stdout=out.getvalue(),
        stdout_truncated=out.truncated,
        logs=kept,
        logs_total=total,
        pooled=pooled,
        start_ms=(started - t0) * 1000,
    )
    if answered is not None and (ending == "done" or (ending == "eof" and answered(out))):
        # The runner wrote its whole result, then the end-of-logs mark after every log byte
        # it wrote: the answer is complete. It exits 0 right after (its contract); that exit
        # is not waited for here.
        run.exit_code = 0
        run.run_ms = (time.monotonic() - started) * 1000
        return Attached(run, True)
    exit_code, oom = None, False
    if ending == "eof":
        # The streams closed, but code can close its fds and go on: the wait for the exit is
        # bounded by the same deadline. On "deadline"/"cancel" nothing is waited for: the
        # caller's forced removal kills it.
        exit_code, oom, ending = exit_state(api, cid, deadline)
    if ending == "eof" and exit_code in (None, 137) and not oom and should_cancel:
        # Killed from outside (cancel by label from another process) before we polled.
        ending = "cancel" if should_cancel() else ending
    if ending == "eof" and exit_code is None:
        raise InfrastructureLost(
            InfrastructureLost.SANDBOX_VANISHED,
            "the sandbox was removed while it ran, and not by a cancel",
        )
    if ending == "eof" and exit_code != 0 and not oom:
        # Not the runner's clean exit: the code's own end (os._exit, a crash), or a kill
        # from outside. An engine shutting down kills its containers after it closed its
        # socket: the engine, not the code, when it takes no new connection now.
        down = engine_stopping(api)
        if down is not None:
            raise InfrastructureLost(
                InfrastructureLost.ENGINE_STOPPING,
                f"the sandbox ended (exit status {exit_code}) while its engine took no new "
                f"connection: {down}",
            )
        signalled = killed_through_engine(api, cid, time.time() - (time.monotonic() - started))
        if signalled is not None:
            raise InfrastructureLost(
                InfrastructureLost.SANDBOX_KILLED,
                f"the sandbox ended (exit status {exit_code}) after its engine was asked to "
                f"send it {signalled} (a docker kill or stop, not the job's code)",
            )
    run.exit_code = exit_code
    run.oom_killed = oom
    run.timed_out = ending == "deadline"
    run.cancelled = ending == "cancel"
    run.run_ms = (time.monotonic() - started) * 1000
    return Attached(run, False)


def exit_state(api: docker.APIClient, cid: str, deadline: float) -> tuple[int | None, bool, str]:
    """Exit status, OOM-killed (from the container state, never guessed) and the ending."""
    try:
        code = api.wait(cid, timeout=max(0.5, deadline - time.monotonic()))["StatusCode"]
    except ENGINE_ERRORS as e:
        what = kind(e)
        if what == "gone":
            return None, False, "eof"  # removed from outside (a cancel by label, or not)
        if what == "no_answer":
            return None, False, "deadline"  # still running with its streams closed
        if what == "down":
            # The engine itself went away (stopped or crashed, and the sandbox with it): not
            # the code's timeout, which is what no answer in time means.
            raise unreachable(e) from e
        raise
    oom = False
    if code == 137:  # only a SIGKILL can be the OOM killer's
        try:
            state = api.inspect_container(cid)["State"]
        except ENGINE_ERRORS as e:
            if kind(e) != "gone":
                raise
            state = {"Status": "removing"}
        if state.get("Status") in ("removing", "dead") or state.get("Dead"):
            # killed by a removal from outside (a `docker rm -f`, a cancel by label: the
            # engine marks it before its kill): the caller asks whether it was a cancel
            return None, False, "eof"
        oom = bool(state.get("OOMKilled"))
    return code, oom, "eof"


def feed(raw: socket.socket, payload: bytes) -> None:
    try:
        raw.sendall(payload)
        raw.shutdown(socket.SHUT_WR)  # EOF on the sandbox's stdin
    except OSError:
        pass  # the sandbox ended before reading it all; its exit status says why


_HEADER = struct.Struct(">BxxxL")


def pump(
    raw: socket.socket,
    out: BoundedBuffer,
    logs: BoundedBuffer,
    deadline: float,
    should_cancel: CancelCheck | None,
    done: Callable[[], bool] | None = None,
) -> str:
    """Demultiplex Docker's attach stream into stdout and logs until EOF, the deadline,
    a cancel or (with ``done``) the runner saying its result and logs are complete.
    Returns "eof", "deadline", "cancel" or "done"."""
    buf = bytearray()
    next_check = 0.0
    while True:
        now = time.monotonic()
        if now >= deadline:
            return "deadline"
        if should_cancel is not None and now >= next_check:
            if should_cancel():
                return "cancel"
            next_check = now + POLL_S * 2
        ready, _, _ = select.select([raw], [], [], min(POLL_S * 2, deadline - now))
        if not ready:
            continue
        chunk = raw.recv(1 << 16)
        if not chunk:
            return "eof"
        buf += chunk
        while len(buf) >= _HEADER.size:
            stream, size = _HEADER.unpack_from(buf)
            if len(buf) < _HEADER.size + size:
                break
            data = bytes(buf[_HEADER.size : _HEADER.size + size])
            del buf[: _HEADER.size + size]
            (out if stream == 1 else logs).write(data)
        if done is not None and done():
            return "done"
