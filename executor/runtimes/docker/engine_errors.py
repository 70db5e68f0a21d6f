"""What an error of the Docker engine, or of the way to it, means: the one rule of the docker
runtime (runtime.py, attached.py, pool.py and sandbox.py ask it), in two questions.

``kind(e)``: what happened, whatever the step.

- ``down``: no answer at all (a refused or reset connection): the engine is away (stopped,
  restarting, never there).
- ``no_answer``: an answer that did not come in time (a read timeout).
- ``stream``: a socket of ours to the engine broke (an attach stream).
- ``gone``: 404, the container is not there (removed, or never made); ``no_image``: 404 for
  the image.
- ``conflict``: 409, a name taken or a removal already under way (at ``start``: the
  sandbox was removed from outside between its create and its start, lost).
- ``failed``: 5xx, the engine failed the call (runc refusing a CPU quota is a 500 too).
- ``refused``: another 4xx, the engine (or a socket guard, 403) refused the call.
- None: not the engine's (a bug of ours): passed on as it is.

``meaning(e, step, job_id)``: the error a job reports for it at ``step`` (None: passed on as
it is). Before the job's input is written (``create``, ``start``) an answer of the engine is
a refusal (``SandboxRefused``: the job never ran, and a re-run would be refused the same
way); while it runs, an engine that broke, a sandbox gone or a stream cut is the
infrastructure's (``InfrastructureLost``, run again elsewhere), a 4xx a fault to report
(``RuntimeUnavailable``). The error codes and sentences are a contract (ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound

from executor.errors import InfrastructureLost, RuntimeUnavailable, SandboxRefused

Kind = Literal["down", "no_answer", "stream", "gone", "no_image", "conflict", "failed", "refused"]
#: ``create``: making the container; ``start``: attaching and starting it, no input written
#: yet; ``run``: from its input on, until its end is read
Step = Literal["create", "start", "run"]

#: what an engine call raises (the SDK's errors, requests' ones: OSErrors, a socket's)
ENGINE_ERRORS = (DockerException, OSError)
#: the engine answered (an HTTP status): it is up, and refused or failed this call
ANSWERED: frozenset[Kind] = frozenset({"gone", "no_image", "conflict", "failed", "refused"})
#: the engine did not answer: away, or too slow
AWAY: frozenset[Kind] = frozenset({"down", "no_answer"})


def kind(e: BaseException) -> Kind | None:
    """What the engine's error ``e`` says happened (the module's docstring)."""
    if isinstance(e, ImageNotFound):
        return "no_image"
    if isinstance(e, NotFound):
        return "gone"
    if isinstance(e, APIError):
        if e.status_code == 409:
            return "conflict"
        return "failed" if e.is_server_error() else "refused"
    if isinstance(e, requests.exceptions.ConnectionError):
        return "down"
    if isinstance(e, requests.exceptions.RequestException):
        return "no_answer"
    if isinstance(e, OSError):
        return "stream"
    return None


def meaning(
    e: BaseException, step: Step, job_id: str, *, image: str = ""
) -> RuntimeUnavailable | None:
    """The error job ``job_id`` reports for the engine's error ``e`` at ``step`` (``image``:
    the one a create asked for); None: ``e`` is passed on as it is (not the engine's, or,
    at ``create``, a conflict or no answer: the caller's to decide)."""
    what = kind(e)
    if what is None:
        return None
    if what == "down":
        return unreachable(e)
    if step == "create":
        if what == "no_image":
            return RuntimeUnavailable(f"The image {image} is missing: build it with `make image`.")
        if what in ("gone", "failed", "refused"):
            return refusal(e, step, job_id)
        return None
    if what in ("gone", "no_image"):
        return InfrastructureLost(
            InfrastructureLost.SANDBOX_VANISHED,
            f"the sandbox of job {job_id} was removed while it ran ({e})",
        )
    if what == "conflict" and step == "start":
        # 409 at start: "container is marked for removal and cannot be started" (someone
        # removed it between its create and its start: an operator's `docker rm -f`, a
        # reaper) or paused from outside; never this job's own request, so never a refusal
        # a re-run would meet again (a CI run saw the battery's job end "refused" so)
        return InfrastructureLost(
            InfrastructureLost.SANDBOX_VANISHED,
            f"the sandbox of job {job_id} was being removed before it started ({e})",
        )
    if what in ("no_answer", "stream"):
        return InfrastructureLost(
            InfrastructureLost.STREAM_BROKEN, f"the sandbox's stream to the engine broke: {e}"
        )
    if step == "start":
        return refusal(e, step, job_id)
    if what == "failed":
        return InfrastructureLost(
            InfrastructureLost.ENGINE_ERROR, f"the engine failed the sandbox: {e}"
        )
    return RuntimeUnavailable(
        f"The sandbox for job {job_id} failed to run: {e}. Check the Docker "
        "engine (docker info) and the image."
    )


@contextmanager
def at_step(job_id: str, step: Step) -> Iterator[None]:
    """Engine calls of job ``job_id``'s sandbox at ``step``: an engine's error raises what it
    means (``meaning``); any other error passes on as it is."""
    try:
        yield
    except ENGINE_ERRORS as e:
        said = meaning(e, step, job_id)
        if said is None:
            raise
        raise said from e


def unreachable(e: BaseException) -> InfrastructureLost:
    """The engine gave no answer at all (``down``), whatever the step: lost to it."""
    return InfrastructureLost(InfrastructureLost.ENGINE_UNREACHABLE, docker_down(e))


def docker_down(e: BaseException) -> str:
    return (
        f"Docker is not reachable ({e}). Start the Docker engine, or under Compose mount "
        "/var/run/docker.sock into this service; or set STUDIO_CODE_RUNTIME=subprocess for "
        "trusted local work only."
    )


def refusal(e: BaseException, step: str, job_id: str) -> SandboxRefused:
    """The engine's error ``e`` at ``step`` (create, start) of job ``job_id``'s sandbox."""
    detail = str(getattr(e, "explanation", None) or e).strip()
    return SandboxRefused(
        detail,
        message=f"The Docker engine refused to {step} the sandbox of job {job_id}, so the job "
        f"did not run (and is not run again: it would be refused the same way): {detail}. "
        "Check the Docker engine (docker info, its log), its OCI runtime "
        "(STUDIO_CODE_OCI_RUNTIME) and the limits STUDIO_CODE_CPUS, STUDIO_CODE_MEMORY and "
        "STUDIO_CODE_PIDS.",
    )
