"""The docker runtime: a NEW locked-down container for every call, through the Docker SDK.

The whole isolation policy is ``sandbox_policy`` (executor/runtimes/docker/policy.py), on one
screen; the attach stream of a run is executor/runtimes/docker/attached.py, the same for a
pre-started sandbox (executor/runtimes/docker/pool.py).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import docker
from docker.errors import DockerException

from executor.errors import InfrastructureLost, RuntimeUnavailable
from executor.floors import GVISOR_MIN_PIDS
from executor.languages.base import ImageFacts, Language
from executor.models import CodeJob, Limits, RawRun
from executor.runtimes.base import (
    CancelCheck,
    CancelledBeforeStart,
    MetaSection,
    PoolObserver,
    ProbeRun,
    Runtime,
    owner_dead,
    owner_id,
)
from executor.runtimes.docker import usage
from executor.runtimes.docker.attached import engine_stopping, run_attached
from executor.runtimes.docker.client import shared_api
from executor.runtimes.docker.engine_errors import (
    ANSWERED,
    AWAY,
    ENGINE_ERRORS,
    at_step,
    docker_down,
    kind,
    meaning,
)
from executor.runtimes.docker.images import DockerImageFacts
from executor.runtimes.docker.policy import (
    AUTO,
    LABEL_DEADLINE,
    LABEL_JOB,
    LABEL_OWNER,
    LABEL_POOL,
    container_name,
    oci_runtime,
    sandbox_policy,
)
from executor.runtimes.docker.pool import LEFTOVERS_AT_CLOSE_S, NAME_FREE_S, SandboxPool
from executor.runtimes.docker.sandbox import Sandbox, create
from executor.runtimes.docker.sandbox import remove as remove_sandbox
from executor.runtimes.docker.seccomp import is_gvisor
from executor.settings import KNOWN_LANGUAGES, Settings

if TYPE_CHECKING:
    from executor.runtimes.docker.posture import EnginePosture

log = logging.getLogger("studio_code")

LEFTOVERS_RETRY_S = 0.5


#: A sandbox still being started (state "created") by a live owner: how long past its
#: studio.deadline the reapers leave it (its owner either starts it, and its deadline moves
#: with the start, see start_delay, or removes it).
CREATED_HOLD_S = 600.0


def start_delay(api: docker.APIClient, c: dict[str, Any], now: float, deadline: float) -> float:
    """How far a live owner's sandbox's studio.deadline moves: by the time its start took.
    The label is written before the sandbox is made, counting the node's whole timeout from
    then, while the node's clock starts when the sandbox has started; a start that takes
    longer than KILL_GRACE_S (a loaded host, gVisor's) would otherwise let any reaper remove
    a sandbox whose node is still within its timeout. Read only for a sandbox already past
    its label (one inspect, rare); 0 when it cannot be read (the label alone decides, as
    before)."""
    if now <= deadline:
        return 0.0
    try:
        state = api.inspect_container(c["Id"]).get("State") or {}
    except ENGINE_ERRORS as e:
        if kind(e) == "gone":
            return float("inf")  # gone already: nothing to remove
        if kind(e) not in ANSWERED | AWAY:
            raise
        log.debug("reaper: %s not inspected (%s): its label decides", c["Id"][:12], e)
        return 0.0
    if state.get("Status") == "created":
        return CREATED_HOLD_S
    started = engine_time(state.get("StartedAt") or "")
    created = float(c.get("Created") or 0)
    if started is None or not created:
        return 0.0
    return max(0.0, started - created)


def engine_time(stamp: str) -> float | None:
    """Epoch seconds of an engine timestamp (RFC 3339 with nanoseconds, "Z"); None for the
    zero time ("0001-01-01T00:00:00Z", never started) or what does not parse."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    try:
        moment = datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    except ValueError:
        return None
    if moment.year < 1971:
        return None
    digits = "".join(ch for ch in frac if ch.isdigit())[:6]
    return moment.timestamp() + (int(digits) / 10 ** len(digits) if digits else 0.0)


class DockerRuntime(Runtime):
    """Runs each call in a new container and always removes it."""

    name = "docker"
    isolated = True
    service = "docker"
    #: no network, no host files, nothing kept after the call: a run the infrastructure
    #: killed runs again elsewhere without harm
    rerun_safe = True
    # the pool measures its sandboxes' pre-imports (preimport_memory)
    preimport_measured = True

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._api: docker.APIClient | None = None
        self._lock = threading.Lock()
        self.pool: SandboxPool | None = None
        #: sandboxes whose removal failed (the engine was away): retried, see retry_leftovers
        self._leftovers: set[Sandbox] = set()
        self._posture: tuple[float, EnginePosture] | None = None

    # --- what it can do (the Runtime interface) ---------------------------------------

    def prepare(
        self, languages: list[Language], limits: Limits, observe: PoolObserver | None = None
    ) -> None:
        try:
            _ = self.api  # connect now, not in the first job
        except RuntimeUnavailable as e:
            log.warning("Docker not reachable at process start: %s", e)
        if self.settings.code_prewarm > 0 and languages and self.pool is None:
            self.pool = SandboxPool(self, languages, limits, observe)
            self.pool.start()

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()  # retries the leftovers too
        else:
            self.retry_leftovers(LEFTOVERS_AT_CLOSE_S)
        with self._lock:
            api, self._api = self._api, None
        if api is not None:
            api.close()

    def image(self, language: Language) -> str | None:
        return language.image(self.settings)

    @classmethod
    def image_facts(cls, settings: Settings, language: Language) -> ImageFacts:
        return DockerImageFacts(settings, language)

    def health_problem(self) -> str | None:
        """Asked on a fresh connection (``engine_stopping``): an engine shutting down still
        answers on the connections kept alive from before, not on a new one; a ping on a
        kept one said "healthy" while every new sandbox failed (measured in the soak)."""
        try:
            api = self.api
        except RuntimeUnavailable as e:
            return e.message
        down = engine_stopping(api)
        return None if down is None else docker_down(RuntimeError(down))

    def pool_stats(self) -> dict[str, Any] | None:
        return self.pool.stats() if self.pool is not None else None

    def meta_section(
        self, posture: EnginePosture | None, *, fresh: bool, probe: ProbeRun
    ) -> MetaSection:
        """The seccomp profile the sandboxes get (under gVisor, the variant runsc gets:
        docs/security.md, "The second wall"), what a pre-started sandbox holds once its
        pre-imports are done (this process's pool; null figures without one), and, asked
        fresh with an engine that answers, what the kernel says inside one sandbox."""
        from executor.runtimes.docker import preimport_memory
        from executor.runtimes.docker.posture import sandbox_proof
        from executor.runtimes.docker.seccomp import profile_sha256

        s = self.settings
        gvisor = posture is not None and posture.oci_runtime_kernel == "gvisor"
        offered = [n for n in KNOWN_LANGUAGES if n in s.languages]
        return MetaSection(
            seccomp={
                "profile": "executor/runtimes/docker/seccomp.json",
                "sha256": profile_sha256(gvisor=gvisor),
                "variant": "gvisor (clone3 goes to gVisor's kernel)" if gvisor else None,
            },
            preimport_memory=preimport_memory.shown(s, offered, self.pool),
            sandbox=(
                sandbox_proof(probe)
                if fresh and posture is not None and "python" in s.languages
                else None
            ),
        )

    def engine_posture(self, *, fresh: bool = False) -> EnginePosture | None:
        # here: a one-shot run reads no posture, so it loads no table of escapes (tomllib)
        from executor.runtimes.docker.posture import POSTURE_TTL_S, read_posture

        cached = self._posture
        if cached is not None and not fresh and time.monotonic() - cached[0] < POSTURE_TTL_S:
            return cached[1]
        try:
            api = self.api
            posture = read_posture(api, oci_runtime=oci_runtime(self.settings, api) or "")
        except (DockerException, RuntimeUnavailable, OSError) as e:
            log.debug("engine posture not read: %s", e)
            return None
        self._posture = (time.monotonic(), posture)
        return posture

    def on_path(self) -> AbstractContextManager[None]:
        return self.pool.on_path() if self.pool is not None else nullcontext()

    def reap(self) -> list[str]:
        """Remove sandboxes (used or pre-started) whose owner on this host is dead, or
        whose studio.deadline passed; returns their job ids (``pool:<name>`` for a
        pre-started one that never got a job)."""
        api = self.api
        now = time.time()
        reaped = []
        for c in api.containers(all=True, filters={"label": LABEL_OWNER}):
            labels = c.get("Labels") or {}
            if LABEL_JOB not in labels and LABEL_POOL not in labels:
                continue  # not a sandbox of ours (a bench's raw container, say)
            try:
                deadline = float(labels.get(LABEL_DEADLINE) or "inf")
            except ValueError:
                deadline = float("inf")
            orphan = owner_dead(labels.get(LABEL_OWNER, ""))
            if not orphan and now <= deadline + start_delay(api, c, now, deadline):
                continue
            try:
                if not self.remove(api, c["Id"]):
                    continue
            except ENGINE_ERRORS as e:
                if kind(e) not in ANSWERED:
                    raise
                log.warning("reaper: could not remove %s: %s", c["Id"][:12], e)
                continue
            name = (c.get("Names") or ["?"])[0].lstrip("/")
            what = labels.get(LABEL_JOB) or f"pool:{name}"
            why = "its owner process is gone" if orphan else "it is past its deadline"
            log.warning(
                "reaper: removed the sandbox %s (%s, owner %s)", what, why, labels.get(LABEL_OWNER)
            )
            reaped.append(what)
        usage.sweep(self.settings, self.settings.code_max_seconds + usage.SWEEP_GRACE_S)
        return reaped

    @property
    def api(self) -> docker.APIClient:
        with self._lock:
            if self._api is None:
                try:
                    self._api = shared_api()
                except DockerException as e:
                    raise RuntimeUnavailable(docker_down(e)) from e
            return self._api

    # --- readiness --------------------------------------------------------------------

    def unavailable_reason(self, language: Language) -> str | None:
        down = self.health_problem()
        if down is not None:
            return down
        oci = self.settings.code_oci_runtime
        if oci and oci != AUTO:
            try:
                known = sorted((self.api.info().get("Runtimes") or {}).keys())
            except DockerException as e:
                return docker_down(e)
            if oci not in known:
                return (
                    f"STUDIO_CODE_OCI_RUNTIME={oci!r} is not a runtime this Docker engine "
                    f"knows (it has: {', '.join(known) or 'none'}): register it under "
                    '"runtimes" in /etc/docker/daemon.json, or leave the setting empty for '
                    "the engine's default."
                )
        refused = self.refused_engine()
        if refused is not None:
            return refused
        image = language.image(self.settings)
        try:
            self.api.inspect_image(image)
        except DockerException as e:
            if kind(e) == "no_image":
                return (
                    f"The {language.name} image {image} is missing: build it with `make image` "
                    f"(docker/build.sh {language.name})."
                )
            return docker_down(e)
        return None

    def refused_engine(self) -> str | None:
        """Why this engine is refused: its OCI runtime cannot start a sandbox under
        STUDIO_CODE_PIDS (gvisor_pids_problem), or STUDIO_CODE_ENGINE_REFUSE_VULNERABLE is
        on and it has known container escapes or its versions cannot be read; None: it is
        not. Asked by readiness, on every run's path and before each pre-start."""
        too_few = self.gvisor_pids_problem()
        if too_few is not None:
            return too_few
        if not self.settings.code_engine_refuse_vulnerable:
            return None
        posture = self.engine_posture()
        if posture is None:
            return (
                "STUDIO_CODE_ENGINE_REFUSE_VULNERABLE is on and the Docker engine's versions "
                "could not be read (docker version): check the engine, or turn the setting off."
            )
        if not posture.vulnerable:
            return None
        ids = ", ".join(f"{a.component} {a.cve}" for a in posture.advisories if a.applies)
        return (
            f"STUDIO_CODE_ENGINE_REFUSE_VULNERABLE is on and the Docker engine has known "
            f"container escapes ({ids}): upgrade it (docs/security.md, 'The engine posture'), "
            "or turn the setting off to run with a WARNING."
        )

    def gvisor_pids_problem(self) -> str | None:
        """Under gVisor the Sentry's own host threads count in the sandbox's pids limit
        (floors.GVISOR_MIN_PIDS): below that floor a sandbox fails to start, or ends
        mid-job, at random. Said once, plainly, instead of jobs failing now and then."""
        pids = self.settings.code_pids
        if pids >= GVISOR_MIN_PIDS:
            return None
        try:  # auto asks the engine (cached); an explicit name is read as it is
            runtime = oci_runtime(self.settings, self.api)
        except (DockerException, RuntimeUnavailable):
            return None  # the engine cannot be asked: its own error is what a job reports
        if not is_gvisor(runtime):
            return None
        return (
            f"STUDIO_CODE_PIDS={pids} is fewer processes than gVisor ({runtime}) needs: its "
            "own threads count in the sandbox's pids limit (33-38 at rest), so a sandbox "
            f"would fail to start or end mid-job at random. Give STUDIO_CODE_PIDS="
            f"{GVISOR_MIN_PIDS} or more (the default is 64), or another OCI runtime "
            "(STUDIO_CODE_OCI_RUNTIME)."
        )

    # --- one call -----------------------------------------------------------------------

    def run(
        self,
        job: CodeJob,
        language: Language,
        limits: Limits,
        *,
        should_cancel: CancelCheck | None = None,
    ) -> RawRun:
        try:
            api = self.api
        except InfrastructureLost:
            raise
        except RuntimeUnavailable as e:
            # nothing started: the engine is away (a restart, a host that lost it)
            raise InfrastructureLost(
                InfrastructureLost.ENGINE_UNREACHABLE, e.message, message=e.message
            ) from e
        # the readiness rule, on every run's path too: a process that runs a node without
        # asking readiness first (`studio-code run`) refuses it all the same
        refused = self.refused_engine()
        if refused is not None:
            raise RuntimeUnavailable(refused)
        if self._leftovers and self.pool is None:  # the pool's remover retries them itself
            self.retry_leftovers()
        policy = sandbox_policy(self.settings, language, job, limits, owner_id(), api=api)
        if self.pool is not None:
            asked = time.monotonic()
            pooled = self.pool.take(language, policy, should_cancel)
            if pooled is not None:
                return self.pool.run(pooled, job, language, limits, should_cancel, t0=asked)
        if should_cancel is not None and should_cancel():
            # e.g. cancelled while it waited for a pre-started one: make nothing
            raise CancelledBeforeStart()
        t0 = time.monotonic()
        box = self._create(api, policy, job.job_id)
        cid = box.cid
        sock = None
        lost = False
        try:
            with at_step(job.job_id, "start"):  # no input written yet
                sock = api.attach_socket(
                    cid, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
                )
                raw = getattr(sock, "_sock", sock)
                api.start(cid)
            with at_step(job.job_id, "run"):
                started = time.monotonic()
                payload = language.stdin_payload(job)
                run = run_attached(
                    api, cid, raw, payload, limits, should_cancel, started=started, t0=t0
                ).run
                run.usage = box.usage(api)
                return run
        except InfrastructureLost as e:
            lost = not e.engine_answers
            raise
        finally:
            if sock is not None:
                getattr(sock, "_sock", sock).close()  # SocketIO.close leaves the socket open
                sock.close()
            if lost:
                self.leave(box)
            else:
                self.remove_surely(api, box)

    def _create(self, api: docker.APIClient, policy: dict[str, Any], job_id: str) -> Sandbox:
        """Its sandbox (engine_errors.py: an answer of the engine is a refusal). A container
        of this job that already exists (409: a redelivery after a crash, or a re-run after
        the infrastructure lost the sandbox of an earlier attempt, whose removal may still be
        under way, off that attempt's path) must not run twice: the old one goes first, and
        the name is taken once the engine has let it go."""
        name = container_name(job_id)
        deadline: float | None = None  # from the first conflict on
        while True:
            try:
                return create(api, self.settings, policy, name)
            except ENGINE_ERRORS as e:
                if kind(e) != "conflict":
                    said = meaning(e, "create", job_id, image=policy["image"])
                    if said is None:
                        raise
                    raise said from e
                if deadline is None:
                    deadline = time.monotonic() + NAME_FREE_S
                elif time.monotonic() > deadline:
                    raise InfrastructureLost(
                        InfrastructureLost.ENGINE_ERROR,
                        f"the sandbox of an earlier attempt, {name}, was still not removed "
                        f"after {NAME_FREE_S:.0f} s: {e}",
                    ) from e
                else:
                    time.sleep(0.1)
            self.kill(job_id)

    def remove_surely(self, api: docker.APIClient, sandbox: Sandbox) -> None:
        """Remove in a ``finally``: retried, never raising. What still fails (the engine is
        away: a restart) is kept and retried later by ``retry_leftovers``, until this
        process stops; after that the reapers (its studio.deadline label says when anyone
        may remove it)."""
        for attempt in range(3):
            try:
                self.remove(api, sandbox)
                return
            except ENGINE_ERRORS as e:
                if kind(e) not in ANSWERED | AWAY:
                    raise
                log.warning(
                    "removing sandbox %s failed (attempt %d): %s", sandbox.cid[:12], attempt + 1, e
                )
                time.sleep(0.2 * (attempt + 1))
        with self._lock:
            self._leftovers.add(sandbox)

    def leave(self, sandbox: Sandbox) -> None:
        """A sandbox the infrastructure took (its engine away, restarting or gone): removed
        later by ``retry_leftovers``, never on its job's path (a removal that waits for an
        engine coming back held the job's hand-back 15 s, measured)."""
        with self._lock:
            self._leftovers.add(sandbox)

    def retry_leftovers(self, timeout_s: float = 0.0) -> None:
        """Remove the sandboxes whose removal failed before; with ``timeout_s`` (a stopping
        process), keep trying that long while the engine is away."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                todo = list(self._leftovers)
            if not todo:
                return
            away = False
            for box in todo:
                try:
                    self.remove(self.api, box)
                except RuntimeUnavailable:
                    away = True  # still away: try again later
                    break
                except ENGINE_ERRORS as e:
                    if kind(e) in AWAY:
                        away = True
                        break
                    if kind(e) in ANSWERED:
                        continue  # this one refused (the engine is up): the others go on
                    raise
                with self._lock:
                    self._leftovers.discard(box)
                log.info("removed sandbox %s, left over while the engine was away", box.cid[:12])
            if not away and len(todo) > len(self._leftovers):
                continue  # progress: once more for what came meanwhile (or to return)
            if time.monotonic() >= deadline:
                with self._lock:
                    left = len(self._leftovers)
                if timeout_s > 0:
                    log.warning(
                        "%d sandboxes could not be removed (is the Docker engine up? docker "
                        "info): the reapers remove them after their studio.deadline",
                        left,
                    )
                return
            time.sleep(LEFTOVERS_RETRY_S)

    @staticmethod
    def remove(api: docker.APIClient, sandbox: Sandbox | str) -> bool:
        """Force-remove (sandbox.remove); True when this call removed it."""
        return remove_sandbox(api, sandbox)

    # --- from anywhere ----------------------------------------------------------------

    def kill(self, job_id: str) -> bool:
        killed = bool(self.remove_where({"label": f"{LABEL_JOB}={job_id}"}))
        # A pre-started sandbox has no job label (labels are fixed at create): this
        # process finds it in its pool's map, any process by the name it got when taken.
        cid = self.pool.taken_by(job_id) if self.pool is not None else None
        try:
            killed |= self.remove(self.api, cid or container_name(job_id))
        except ENGINE_ERRORS as e:
            if kind(e) not in ANSWERED:
                raise
            log.warning("removing the sandbox of job %s failed: %s", job_id, e)
        return killed

    def remove_where(self, filters: dict[str, Any]) -> list[str]:
        """Force-remove every sandbox container matching ``filters``; returns their ids."""
        api = self.api
        return [
            c["Id"] for c in api.containers(all=True, filters=filters) if self.remove(api, c["Id"])
        ]

    def sandboxes(self) -> list[dict[str, Any]]:
        """Every container with a studio.job_id label on this engine."""
        return self.api.containers(all=True, filters={"label": LABEL_JOB})
