"""Pre-started sandboxes: a fresh container is already running when a job arrives, and is
still used for ONE job only.

Each pool process keeps STUDIO_CODE_PREWARM containers per offered language, created and
started with the whole ``sandbox_policy`` (same limits, user, seccomp, no network...) and
attached, their runner blocked reading stdin: both runners read ALL of stdin before they
look at any code, and the code only ever arrives on stdin. Nothing of a job is in a
pre-started container until it is taken.

* **Take** (``take``): a job whose create arguments equal the pooled ones (everything but the
  labels: a node's own timeout is host-side only) takes one. A job with other limits, or
  a pool that is empty with no container starting, is a miss: the caller starts a cold one.
  A container is taken out of the pool under its lock, so it can never serve two jobs,
  and a container whose attach stream shows anything before its job (it died, or printed)
  is thrown away, never handed out.
* **Run** (``run``): the job's stdin is written and the attach stream read exactly as for
  a cold container. The node's timeout counts from here, the job's start. A job still
  running STUDIO_CODE_PREWARM_RENAME_AFTER_S (0.5 s) later has its container renamed
  ``studio-code-<job id>``: labels cannot change after create, and the name is how ANY
  process's ``kill(job_id)`` (a cancel's backstop, 2 s after the revoke) and ``docker ps``
  find it. A job that ends sooner (most: a trivial one takes ~20 ms) is removed under its
  pool name, one engine call fewer per job (``python -m bench.engine_calls`` counts them).
* **Done at the frame**: EOF on the attach stream comes only when the container has exited
  (measured on Docker 20.10: closing fds 1 and 2 does not end it), ~30-150 ms after the
  result. So the job's header carries a per-job end-of-logs mark, which the runner writes to
  stderr after its result: when the logs END with the mark and stdout holds a whole result
  frame, the result and every log byte the runner wrote are in, and the caller has its
  answer at once; the container's exit and its removal happen in this pool's thread, off
  the caller's path. Code that forges the mark can only cut its own logs short (a result is
  still needed). Anything else (no frame, a timeout, a cancel, OOM) is read and removed as
  for a cold container.
* **Replace**: a replacement starts right after one is handed out, off the path. Idle
  containers older than STUDIO_CODE_PREWARM_MAX_IDLE_S, made from an image whose id
  changed since, or dead (an engine restart kills them), are removed and replaced.
  ``close`` (a stopping worker process) removes the idle ones; the reaper removes those
  whose owner died: they carry ``studio.pool`` = owner and a ``studio.deadline`` of
  creation + the idle bound + the longest run + grace.
* **Upkeep gets its turn** (``on_path``): a job's own upkeep (the removal of its used
  sandbox, the start of its replacement) waits for the end of ITS path, never for another
  job's: under a steady backlog a worker process is always on some job's path. Removals
  have a thread of their own (a start never delays them), and a take waits for removals
  that fall behind (more than MAX_PENDING_REMOVALS), so a process has at most
  MAX_PENDING_REMOVALS + 1 ended sandboxes (and their attach sockets) at any moment.
* **Engine away**: a removal that fails because the engine is away (a restart) is retried
  until it succeeds or, at ``close``, for LEFTOVERS_AT_CLOSE_S
  (``DockerRuntime.retry_leftovers``).
"""

from __future__ import annotations

import json
import logging
import secrets
import select
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import docker
from docker.errors import DockerException

from executor.errors import InfrastructureLost, RuntimeUnavailable
from executor.languages.base import Language
from executor.models import CodeJob, Limits, RawRun
from executor.runtimes.base import (
    LOG_TAP,
    BoundedBuffer,
    CancelCheck,
    CancelledBeforeStart,
    IdlePoolStats,
    PoolObserver,
    owner_id,
)
from executor.runtimes.constants import KILL_GRACE_S
from executor.runtimes.docker import preimport_memory
from executor.runtimes.docker.attached import RunLogs, run_attached
from executor.runtimes.docker.engine_errors import ENGINE_ERRORS, at_step, kind
from executor.runtimes.docker.policy import (
    LABEL_DEADLINE,
    LABEL_JOB,
    LABEL_POOL,
    container_name,
    sandbox_policy,
)
from executor.runtimes.docker.sandbox import Sandbox, create
from executor.sandbox_names import POOL_NAME_PREFIX
from executor.settings import Settings

log = logging.getLogger("studio_code")

#: how long a job waits for a container already starting before it starts a cold one: a
#: start in flight is never slower than a new one, so a short wait only saves CPU
WAIT_FOR_STARTING_S = 3.0
#: how often a job waiting for a starting container asks whether it was cancelled
CANCEL_POLL_S = 0.1
TICK_S = 2.0  # idle-bound checks; the image id is checked every IMAGE_CHECK_S
IMAGE_CHECK_S = 10.0
BACKOFF_S = (1.0, 2.0, 5.0, 15.0, 30.0)
#: removals released but not done at which a job's take waits for them first: with one job
#: of a process at a time, it then has at most this many ended sandboxes plus its own
MAX_PENDING_REMOVALS = 1
#: the longest a take waits for removals that fell behind (an engine that slows down):
#: then the job goes on all the same, and says so in the log
REMOVAL_WAIT_S = 10.0
#: how long a stopping process keeps retrying removals that failed while the engine was away
LEFTOVERS_AT_CLOSE_S = 15.0
#: how long a new attempt waits for an earlier attempt's sandbox of the same job (same name)
#: to be removed; past it a cold create counts as lost to the infrastructure
NAME_FREE_S = 15.0


class SandboxHost(Protocol):
    """What a pool needs of its runtime (``DockerRuntime``): the engine, the settings, and the
    removals that never raise (what fails is retried by ``retry_leftovers``)."""

    settings: Settings

    @property
    def api(self) -> docker.APIClient: ...

    def remove(self, api: docker.APIClient, sandbox: Sandbox | str) -> bool: ...

    def remove_surely(self, api: docker.APIClient, sandbox: Sandbox) -> None: ...

    def leave(self, sandbox: Sandbox) -> None: ...

    def retry_leftovers(self, timeout_s: float = 0.0) -> None: ...

    def refused_engine(self) -> str | None: ...


@dataclass(eq=False)
class Pooled(Sandbox):
    """One pre-started container, waiting on stdin (its handle: id, name, usage meter)."""

    language: str
    shape: dict[str, Any]
    sock: Any
    raw: Any
    image_id: str
    created: float  # monotonic
    #: its rename to its job's name, once taken (joined before its removal)
    renamer: _Renamer | None = None
    #: retired unused and still running (past the idle bound, or of an old image): not an
    #: ended sandbox a take waits for
    unused: bool = False

    def fresh(self) -> bool:
        """Still running and silent: its runner writes nothing before its job, and a
        container that died closes the stream, so anything readable means: do not use."""
        try:
            ready, _, _ = select.select([self.raw], [], [], 0)
        except (OSError, ValueError):
            return False
        return not ready


def _shape(policy: dict[str, Any]) -> dict[str, Any]:
    """What a job must match to use a pooled container: every create argument but the
    labels (its job id and deadline: what the name and the reaper stand for)."""
    return {k: v for k, v in policy.items() if k != "labels"}


class SandboxPool(IdlePoolStats):
    """The pre-started containers of one process (one per ``DockerRuntime``)."""

    def __init__(
        self,
        runtime: SandboxHost,
        languages: list[Language],
        limits: Limits,
        observe: PoolObserver | None = None,
    ) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.size = self.settings.code_prewarm
        self.max_idle_s = self.settings.code_prewarm_max_idle_s
        self.limits = limits
        self.observe = observe
        self.languages = {lang.name: lang for lang in languages}
        self.owner = owner_id()
        self._idle: dict[str, deque[Pooled]] = {name: deque() for name in self.languages}
        self._starting: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._retry_at: dict[str, float] = {}
        #: released for removal (the remover thread's queue)
        self._retire: deque[Pooled] = deque()
        self._taken: dict[str, str] = {}
        self._removing = 0
        #: jobs of this process on their caller's path (see on_path): no upkeep of theirs
        self._on_path = 0
        #: this thread's path: the sandboxes its job handed off (removed when it ends)
        self._path = threading.local()
        #: replacement starts reserved when a path ended (counted in _starting already)
        self._reserved: deque[str] = deque()
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._stop = False
        #: sandboxes started aside (the pre-import measurement's bare twin) not released yet:
        #: ``close`` waits for them, or one started as it closes is left behind
        self._aside = 0
        self._thread: threading.Thread | None = None
        self._remover: threading.Thread | None = None
        self._image_ids: dict[str, str] = {}
        self._images_checked = 0.0

    # --- life ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="studio-pool", daemon=True)
        self._thread.start()
        self._remover = threading.Thread(
            target=self._remove_loop, name="studio-pool-remove", daemon=True
        )
        self._remover.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop refilling, remove every idle container, wait for removals in flight."""
        with self._cond:
            self._stop = True
            for q in self._idle.values():
                self._retire.extend(q)
                q.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        with self._cond:  # a bare twin being measured: released once it sees the stop
            self._cond.wait_for(lambda: self._aside == 0, max(0.0, deadline - time.monotonic()))
        for thread in (self._thread, self._remover):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        self._thread = self._remover = None
        self._drain_retired()  # whatever the threads left (never started, or timed out)
        left = max(0.0, deadline - time.monotonic())
        self.runtime.retry_leftovers(min(left, LEFTOVERS_AT_CLOSE_S))
        # the last take may not have been reported (its refill never ran): a process that
        # ends (a worker stop, --max-tasks-per-child) reports its final counts
        self._notify()

    def wait_settled(self, timeout_s: float = 60.0) -> bool:
        """Block until the pool is full and nothing is being started or removed (benchmarks
        that count a job's whole cost, its replacement and removal included)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._busy() and self.wait_ready(max(0.0, deadline - time.monotonic())):
                if not self._busy():
                    return True
            time.sleep(0.02)
        return False

    def _busy(self) -> bool:
        with self._cond:
            return bool(
                self._retire or self._reserved or any(self._starting.values()) or self._removing
            )

    @contextmanager
    def on_path(self) -> Iterator[None]:
        """While a job is on its caller's path (a worker: claim -> result stored -> done
        notice), its own upkeep waits: the sandbox it used is removed, and its replacement
        started, when the block ends (measured on 2 cores, a replacement's start, ~135 ms
        of runc, shim, dockerd CPU and this process's GIL for the SDK, running beside the
        job's last steps added 20-40 ms to the caller's wait). Only its OWN: upkeep left by
        a job whose path ended goes on while the next job runs, or a steady backlog, always
        on some job's path, would never see it done. Work already under way goes on (a job
        that finds the pool empty waits for a container that is starting, as always)."""
        outer = getattr(self._path, "held", None) is not None  # nested: the outer one ends it
        if not outer:
            self._path.held = []
        with self._cond:
            self._on_path += 1
        try:
            yield
        finally:
            with self._cond:
                self._on_path -= 1
                if not outer:
                    self._retire.extend(self._path.held)
                    self._path.held = None
                    self._reserve_fills()
                self._cond.notify_all()

    def _reserve_fills(self) -> None:
        """Count the replacements this pool lacks as starting now (with the lock held), so
        a job that comes next waits for them instead of starting a cold one; the pool's
        thread starts them whatever path is open by then."""
        if self._stop:
            return
        while (lang := self._wanted()) is not None:
            self._starting[lang] += 1
            self._reserved.append(lang)

    # --- take and run ---------------------------------------------------------------------

    def take(
        self,
        language: Language,
        policy: dict[str, Any],
        should_cancel: CancelCheck | None = None,
    ) -> Pooled | None:
        """A fresh container for a job with create arguments ``policy``, or None (a miss:
        start a cold one). While it waits for one that is starting, it asks
        ``should_cancel`` every CANCEL_POLL_S: a cancelled job raises CancelledBeforeStart
        (it takes nothing, and no cold one is started for it)."""
        name = language.name
        shape = _shape(policy)
        deadline = time.monotonic() + WAIT_FOR_STARTING_S
        asked = False  # should_cancel asked since the last wait
        retired = False  # a stale one put aside for the remover
        with self._cond:
            try:
                if name not in self._idle or self._stop:
                    self.misses[name] += 1
                    return None
                self._wait_for_removals(should_cancel)
                while True:
                    q = self._idle[name]
                    while q:
                        p = q[0]
                        if p.shape != shape:  # other limits: this job goes cold
                            self.misses[name] += 1
                            return None
                        q.popleft()
                        if not p.fresh():
                            log.warning("pre-started sandbox %s was not fresh; removed", p.name)
                            self._retire.append(p)
                            retired = True
                            continue
                        self.hits[name] += 1
                        return p
                    left = deadline - time.monotonic()
                    if self._starting[name] > self._waiting[name] and left > 0 and not self._stop:
                        if should_cancel is not None and not asked:
                            if self._asked_to_cancel(should_cancel):
                                raise CancelledBeforeStart()
                            asked = True
                            continue  # the lock was let go: look at the queue again first
                        self._waiting[name] += 1
                        try:
                            self._cond.wait(min(left, CANCEL_POLL_S))
                        finally:
                            self._waiting[name] -= 1
                        asked = False
                        continue
                    self.misses[name] += 1
                    return None
            finally:
                # the thread starts a replacement, the remover removes a stale one; on a
                # job's path the replacement waits for the path's end (on_path wakes it),
                # so with nothing retired neither thread is woken for nothing
                if retired or not self._on_path:
                    self._cond.notify_all()

    def _wait_for_removals(self, should_cancel: CancelCheck | None) -> None:
        """With the lock held: while more than MAX_PENDING_REMOVALS used sandboxes wait for
        their removal, wait for the remover (at most REMOVAL_WAIT_S), asking
        ``should_cancel`` every CANCEL_POLL_S."""
        deadline = time.monotonic() + REMOVAL_WAIT_S
        while (pending := self._ended_pending()) > MAX_PENDING_REMOVALS and not self._stop:
            if time.monotonic() >= deadline:
                log.warning(
                    "%d used sandboxes still wait for their removal after %g s; the job goes "
                    "on (is the Docker engine slow? docker info)",
                    pending,
                    REMOVAL_WAIT_S,
                )
                return
            if should_cancel is not None and self._asked_to_cancel(should_cancel):
                raise CancelledBeforeStart()
            self._cond.wait(CANCEL_POLL_S)

    def _ended_pending(self) -> int:
        """Used or dead sandboxes released and not removed yet (the one being removed
        counts, whatever it is); with the lock held."""
        queued = sum(1 for x in self._retire if not x.unused)
        return queued + self._removing

    def _asked_to_cancel(self, should_cancel: CancelCheck) -> bool:
        """``should_cancel()`` without the pool's lock (it may read Redis or the store: the
        pool's thread must not wait for that); called and returned with the lock held."""
        self._cond.release()
        try:
            return bool(should_cancel())
        finally:
            self._cond.acquire()

    def taken_by(self, job_id: str) -> str | None:
        """The container id a running job of this process took from the pool."""
        with self._cond:
            return self._taken.get(job_id)

    def run(
        self,
        p: Pooled,
        job: CodeJob,
        language: Language,
        limits: Limits,
        should_cancel: CancelCheck | None,
        *,
        t0: float | None = None,
    ) -> RawRun:
        """Give ``job`` to the taken container ``p``: its one and only job. ``t0``: when the
        job asked for a sandbox (its start_ms counts a wait in ``take`` too)."""
        runtime = self.runtime
        api = runtime.api
        t0 = time.monotonic() if t0 is None else t0
        with self._cond:
            self._taken[job.job_id] = p.cid
        handed_off = False
        # The container takes its job's name (so any process finds it by name: a cancel's
        # backstop, `docker ps`) once the job has run code_prewarm_rename_after_s, and the
        # answer never waits for it: the rename is a daemon round trip of 10-40 ms (more
        # on a busy engine), and a job that ends sooner needs none. Until it lands this
        # process finds the container by id (taken_by), a dead owner's reaper by its pool
        # label; its removal waits for it (_drain_retired), a job that ended calls it off.
        renamer = p.renamer = _Renamer(self, p, job.job_id)
        lost = False
        try:
            with at_step(job.job_id, "run"):
                p.hand_over(api)  # its start so far is not the job's
                started = time.monotonic()
                mark = f"\x1estudio-end:{secrets.token_hex(16)}\x1e"
                payload = language.stdin_payload(job, end_mark=mark)
                logs = _Logs(limits.log_max_bytes, mark.encode("utf-8"), tap=LOG_TAP.get())

                def answered(out: BoundedBuffer) -> bool:
                    return (
                        logs.at_end
                        and not out.truncated
                        and _complete(language, job, out.getvalue())
                    )

                run, answered_now = run_attached(
                    api,
                    p.cid,
                    p.raw,
                    payload,
                    limits,
                    should_cancel,
                    started=started,
                    t0=t0,
                    logs=logs,
                    answered=answered,
                    pooled=True,
                )
                renamer.call_off()
                run.usage = p.usage(api)
                if answered_now:
                    # the answer is complete: the container's exit and its removal happen
                    # off the caller's path (when the job's path ends)
                    self._hand_off(p)
                    handed_off = True
                return run
        except InfrastructureLost as e:
            lost = not e.engine_answers
            raise
        finally:
            renamer.call_off()
            with self._cond:
                self._taken.pop(job.job_id, None)
            if lost:  # its engine is away: removed later, off the job's path
                _close(p)
                runtime.leave(p)
            elif not handed_off:
                renamer.join()
                _close(p)
                runtime.remove_surely(api, p)

    def _rename(self, p: Pooled, job_id: str) -> None:
        api = self.runtime.api
        name = container_name(job_id)
        try:
            api.rename(p.cid, name)
            return
        except ENGINE_ERRORS as e:
            if kind(e) != "conflict":
                raise
        # A container of this job already exists (a redelivery after a crash, or a re-run
        # after an earlier attempt's sandbox was lost, its removal perhaps still under way):
        # it must not run twice, so the old one goes first (never ours: it has another id),
        # and the name is taken once the engine has let it go.
        deadline = time.monotonic() + NAME_FREE_S
        while True:
            for c in api.containers(all=True, filters={"label": f"{LABEL_JOB}={job_id}"}):
                if c["Id"] != p.cid:
                    self.runtime.remove(api, c["Id"])
            try:
                old = api.inspect_container(name)["Id"]
                if old != p.cid:
                    self.runtime.remove(api, old)
            except DockerException:
                pass
            try:
                api.rename(p.cid, name)
                return
            except ENGINE_ERRORS as e:
                if kind(e) != "conflict" or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def _hand_off(self, p: Pooled) -> None:
        """``p`` answered its job: removed when the job's path ends (at once outside one)."""
        held = getattr(self._path, "held", None)
        with self._cond:
            if held is not None and not self._stop:
                held.append(p)
            else:
                self._retire.append(p)
                self._cond.notify_all()

    # --- what it shows ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``IdlePoolStats.stats`` and ``preimport_memory``: per language measured, what an
        idle pre-started sandbox holds (preimport_memory.measured). Its observer, a worker's
        pool process, passes that on to the worker's heartbeat (worker/preimport.py)."""
        return {**super().stats(), "preimport_memory": preimport_memory.measured(self)}

    # --- what preimport_memory.py asks of it (its MeasuredPool) -----------------------------

    @property
    def api(self) -> docker.APIClient:
        return self.runtime.api

    def preimports(self, language: str) -> bool:
        return bool(self.languages[language].preimport(self.settings))

    def closing(self) -> bool:
        return self._stop

    def is_idle(self, sandbox: Pooled) -> bool:
        with self._cond:
            return any(q is sandbox for q in self._idle[sandbox.language])

    def start_aside(self, language: str) -> Pooled:
        with self._cond:  # the stop and the count under one lock: close waits for it
            if self._stop:
                raise RuntimeUnavailable("the sandbox pool is closing")
            self._aside += 1
        try:
            return self._create(self.languages[language], preimport=False)
        except BaseException:
            with self._cond:
                self._aside -= 1
                self._cond.notify_all()
            raise

    def release(self, sandbox: Pooled) -> None:
        with self._cond:
            self._retire.append(sandbox)
            self._aside -= 1
            self._cond.notify_all()

    # --- the pool's thread: start, replace, remove ----------------------------------------

    def _loop(self) -> None:
        """Starts: those reserved when a path ended, else (outside any path) what the pool
        lacks; every TICK_S, ``_maintain``."""
        next_tick = 0.0
        while True:
            with self._cond:
                lang = self._next_start(next_tick)
                if lang is None and self._stop:
                    while self._reserved:  # never started: not starting any more
                        self._starting[self._reserved.popleft()] -= 1
                    self._cond.notify_all()
                    return
            try:
                if lang is not None:
                    self._fill(lang)
                else:
                    self._maintain()
                    next_tick = time.monotonic() + TICK_S
                    self._notify()
            except Exception:  # noqa: BLE001 - the pool thread must live on
                log.exception("sandbox pool thread")

    def _next_start(self, next_tick: float) -> str | None:
        """With the lock held, wait for a start to make (its language, counted as
        starting) or the next tick (None); None at once when stopping."""
        while not self._stop:
            if self._reserved:
                return self._reserved.popleft()
            if not self._on_path:
                lang = self._wanted()
                if lang is not None:
                    self._starting[lang] += 1
                    return lang
            left = next_tick - time.monotonic()
            if left <= 0:
                return None
            self._cond.wait(max(0.01, min(left, TICK_S)))
        return None

    def _remove_loop(self) -> None:
        """The remover: removes what is released, one at a time, as soon as it is; every
        TICK_S with nothing to do, retries removals the engine refused while it was away."""
        while True:
            with self._cond:
                if not self._retire:
                    if self._stop:
                        return
                    self._cond.wait(TICK_S)
                work = bool(self._retire)
            try:
                if work:
                    self._drain_retired(one=True)
                else:
                    self.runtime.retry_leftovers()
            except Exception:  # noqa: BLE001 - the remover must live on
                log.exception("sandbox pool remover")

    def _wanted(self) -> str | None:
        """A language that needs one more container now (not in back-off), or None."""
        now = time.monotonic()
        for name, q in self._idle.items():
            if len(q) + self._starting[name] < self.size and self._retry_at.get(name, 0) <= now:
                return name
        return None

    def _fill(self, name: str) -> None:
        made: Pooled | None = None
        try:
            made = self._create(self.languages[name])
        except Exception as e:  # noqa: BLE001 - a job that misses reports it as its result
            self._failures[name] += 1
            delay = BACKOFF_S[min(self._failures[name], len(BACKOFF_S)) - 1]
            self._retry_at[name] = time.monotonic() + delay
            # Said once, then every 10th time: a missing image must not flood the log (its
            # jobs start cold and report the problem themselves).
            level = logging.WARNING if self._failures[name] % 10 == 1 else logging.DEBUG
            log.log(
                level,
                "could not pre-start a %s sandbox (failure %d, retrying in %g s): %s",
                name,
                self._failures[name],
                delay,
                e,
            )
        with self._cond:
            self._starting[name] -= 1
            if made is not None:
                self._failures[name] = 0
                if self._stop:
                    self._retire.append(made)
                else:
                    self._idle[name].append(made)
            self._cond.notify_all()
        self._notify()
        if made is not None and not self._stop:  # what it holds once idle (meta)
            preimport_memory.after_fill(self, made)

    def _create(self, language: Language, *, preimport: bool = True) -> Pooled:
        refused = self.runtime.refused_engine()
        if refused is not None:  # nothing is pre-started on an engine the runs refuse
            raise RuntimeUnavailable(refused)
        api = self.runtime.api
        placeholder = CodeJob(
            job_id=f"pool-{uuid.uuid4().hex[:12]}",
            language=language.name,  # type: ignore[arg-type]
            code="",
        )
        policy = sandbox_policy(
            self.settings, language, placeholder, self.limits, self.owner, api=api
        )
        shape = _shape(policy)
        # what it imports while it waits (STUDIO_CODE_PREIMPORT): not in the shape a job
        # matches, since a cold run of that job imports nothing ahead
        if preimport:  # (off: preimport_memory.py's figure without it)
            policy["environment"] = {**policy["environment"], **language.preimport(self.settings)}
        labels = dict(policy["labels"])
        labels.pop(LABEL_JOB, None)
        labels[LABEL_POOL] = self.owner
        # Any reaper may remove it after: idle at most max_idle_s (+ a tick), then one job.
        labels[LABEL_DEADLINE] = str(
            int(
                time.time()
                + self.max_idle_s
                + TICK_S
                + self.settings.code_max_seconds
                + KILL_GRACE_S
            )
        )
        name = f"{POOL_NAME_PREFIX}{uuid.uuid4().hex[:12]}"
        # The id _maintain read last (every IMAGE_CHECK_S), not an inspect per container: a
        # rebuild in between makes this one look old at the next check, and it is replaced.
        image_id = self._image_id(language)
        box = create(api, self.settings, {**policy, "labels": labels}, name)
        cid = box.cid
        sock = None
        try:
            sock = api.attach_socket(
                cid, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            )
            api.start(cid)
        except BaseException:
            if sock is not None:
                _close_sock(sock)
            self.runtime.remove_surely(api, box)
            raise
        return Pooled(
            cid=cid,
            name=name,
            meter=box.meter,
            language=language.name,
            shape=shape,
            sock=sock,
            raw=getattr(sock, "_sock", sock),
            image_id=image_id,
            created=time.monotonic(),
        )

    def _image_id(self, language: Language, *, fresh: bool = False) -> str:
        if fresh or language.name not in self._image_ids:
            image = language.image(self.settings)
            self._image_ids[language.name] = str(self.runtime.api.inspect_image(image)["Id"])
        return self._image_ids[language.name]

    def _maintain(self) -> None:
        """Replace containers idle too long, dead, or made from an image that was rebuilt."""
        now = time.monotonic()
        check_images = now - self._images_checked >= IMAGE_CHECK_S
        current: dict[str, str] = {}
        if check_images:
            self._images_checked = now
            for name, lang in self.languages.items():
                try:
                    current[name] = self._image_id(lang, fresh=True)
                except DockerException:
                    pass
        with self._cond:
            for name, q in self._idle.items():
                keep: deque[Pooled] = deque()
                for p in q:
                    if now - p.created > self.max_idle_s:
                        p.unused = True
                        self._retire.append(p)
                    elif not p.fresh():
                        log.warning("pre-started sandbox %s died idle; replacing it", p.name)
                        self._retire.append(p)
                    elif name in current and p.image_id != current[name]:
                        log.info("image of %s changed: replacing its pre-started sandbox", name)
                        p.unused = True
                        self._retire.append(p)
                    else:
                        keep.append(p)
                self._idle[name] = keep
            self._cond.notify_all()

    def _drain_retired(self, *, one: bool = False) -> None:
        api = None
        while True:
            with self._cond:
                if not self._retire:
                    return
                item = self._retire.popleft()
                self._removing += 1
            if item.renamer is not None:
                item.renamer.join()
            _close(item)
            try:
                api = api or self.runtime.api
                self.runtime.remove_surely(api, item)
            except RuntimeUnavailable as e:
                log.warning("could not remove sandbox %s: %s", item.cid[:12], e)
            finally:
                with self._cond:
                    self._removing -= 1
            if one:
                return


class _Renamer:
    """``SandboxPool._rename`` on a thread of its own, ``code_prewarm_rename_after_s`` after
    the job was given to the container (above 0: unless the job ended first, ``call_off``), joined
    before its removal (a failure is logged: the job ran all the same; only finding it by
    name was missed)."""

    JOIN_S = 30.0

    def __init__(self, pool: SandboxPool, p: Pooled, job_id: str) -> None:
        self.pool, self.p, self.job_id = pool, p, job_id
        self.error: BaseException | None = None
        self._joined = False
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="studio-pool-rename", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        after = self.pool.settings.code_prewarm_rename_after_s
        # 0 (the default): always renamed, however soon the job ends (the rename is what
        # removes an earlier attempt's sandbox of the same job); above 0: not if it ended first
        if after > 0 and self._ended.wait(after):
            return  # the job ended under the pool name
        try:
            self.pool._rename(self.p, self.job_id)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def call_off(self) -> None:
        """The job ended: no rename from now on (one under way goes on)."""
        self._ended.set()

    def join(self) -> None:
        self.call_off()
        if self._joined:
            return
        self._joined = True
        self._thread.join(self.JOIN_S)
        if self.error is not None or self._thread.is_alive():
            log.warning(
                "pre-started sandbox %s of job %s kept its pool name: %s",
                self.p.name,
                self.job_id,
                self.error or "the rename did not answer",
            )


class _Logs(RunLogs):
    """The logs, watching for the runner's end-of-logs mark (which may arrive past the
    kept bytes of a print flood) and keeping it out of what the user sees."""

    def __init__(self, limit: int, mark: bytes, tap: Callable[[bytes], None] | None = None) -> None:
        super().__init__(limit)  # no tap of its own: the mark must never reach live logs
        self.mark = mark
        self.tail = b""
        self.seen = False
        self.live_tap = tap
        self.held = b""  # kept bytes not yet passed on: they may be the mark's beginning

    def write(self, data: bytes) -> None:
        before = self.kept
        super().write(data)
        self.tail = (self.tail + data)[-len(self.mark) :]
        self.seen = self.seen or self.tail == self.mark
        if self.live_tap is None:
            return
        self.held += data[: self.kept - before]
        if self.at_end:
            self.flush_tap()
            return
        # hold back only a tail that may be the mark's beginning (it starts with \x1e)
        keep = 0
        for k in range(min(len(self.held), len(self.mark) - 1), 0, -1):
            if self.held.endswith(self.mark[:k]):
                keep = k
                break
        if len(self.held) > keep:
            self._pass_on(self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep :]

    def flush_tap(self) -> None:
        """Pass on what is held (without the mark): at the end of the logs, or of the run."""
        held, self.held = self.held, b""
        if held.endswith(self.mark):
            held = held[: -len(self.mark)]
        if held:
            self._pass_on(held)

    def _pass_on(self, piece: bytes) -> None:
        try:
            self.live_tap(piece)  # type: ignore[misc]
        except Exception:  # noqa: BLE001, S110 - live logs never break a run
            pass

    @property
    def at_end(self) -> bool:
        """The last bytes written are the mark: nothing the runner wrote is still to come."""
        return self.tail == self.mark

    def final(self) -> tuple[bytes, int]:
        """At the end of the stream: what is held passed on, the logs without the mark."""
        self.flush_tap()
        return self.without_mark(), self.total_without_mark

    def without_mark(self) -> bytes:
        kept = self.getvalue()
        at = kept.rfind(self.mark) if self.seen else -1
        return kept if at < 0 else kept[:at] + kept[at + len(self.mark) :]

    @property
    def total_without_mark(self) -> int:
        return self.total - len(self.mark) if self.seen else self.total


def _complete(language: Language, job: CodeJob, stdout: bytes) -> bool:
    """The runner's whole result is in ``stdout``: its JSON parses to the runner's object."""
    probe = RawRun(exit_code=None, stdout=stdout, stdout_truncated=False, logs=b"", logs_total=0)
    frame = language.result_bytes(job, probe)
    if not frame:
        return False
    try:
        reply = json.loads(frame)
    except ValueError:
        return False
    return isinstance(reply, dict) and "ok" in reply


def _close(p: Pooled) -> None:
    _close_sock(p.sock)


def _close_sock(sock: Any) -> None:
    try:
        getattr(sock, "_sock", sock).close()  # SocketIO.close leaves the socket open
        sock.close()
    except OSError:
        pass
