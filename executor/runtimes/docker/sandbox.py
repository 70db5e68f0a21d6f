"""One sandbox's life on the engine: ``create`` makes every container of this runtime (a cold
run's, runtime.py; a pre-started one, pool.py; the never-started one an image's file is read
from, images.py) and returns its ``Sandbox`` handle, which its maker keeps until ``remove``.

The handle carries the sandbox's usage meter (usage.py): made with it, under its run's own
parent cgroup, read at hand-over and at the end of its job, released when the container is
removed. A pre-started sandbox's meter is found on its handle when a job takes it, never
looked up by container id.

``create`` raises what the engine raises: what an error means (the engine away, a refusal,
a name taken) depends on the step, and each caller asks engine_errors.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from executor.runtimes.docker import usage
from executor.runtimes.docker.engine_errors import ENGINE_ERRORS, kind

if TYPE_CHECKING:
    import docker

    from executor.models import Usage
    from executor.settings import Settings


@dataclass(eq=False)  # a handle: one per container, compared and hashed by identity
class Sandbox:
    """A container this process made, from its creation to its removal."""

    cid: str
    name: str
    #: what it uses (None: not measured: usage off, no view of the cgroups, never started)
    meter: usage.Meter | None

    def hand_over(self, api: docker.APIClient) -> None:
        """A pre-started sandbox gets its job now: what it used so far is not the job's."""
        usage.hand_over(api, self.meter)

    def usage(self, api: docker.APIClient) -> Usage | None:
        """What it used so far (its job's share), or None: not measured or not read."""
        return usage.read(api, self.meter)

    def released(self) -> None:
        """It was removed (or found gone): its meter's parent cgroup goes too."""
        if self.meter is not None:
            self.meter.release()


def create(
    api: docker.APIClient,
    settings: Settings,
    policy: dict[str, Any],
    name: str,
    *,
    measured: bool = True,
) -> Sandbox:
    """Create, never start, the container ``name`` with ``policy``: sandbox_policy's create
    arguments, its ``host_config`` as keywords. ``measured``: under a meter's own parent
    cgroup (STUDIO_CODE_USAGE and the view of the cgroups in ``settings`` allowing), the meter
    on the handle; not: a container that never starts (images.py)."""
    meter = usage.new_meter(settings) if measured else None
    host_config = api.create_host_config(**usage.host_config(meter, policy))
    cid = api.create_container(name=name, **{**policy, "host_config": host_config})["Id"]
    if meter is not None:
        meter.cid = cid
    return Sandbox(cid, name, meter)


def remove(api: docker.APIClient, sandbox: Sandbox | str) -> bool:
    """Force-remove ``sandbox`` (a handle of this process's, or the id or name of a container
    found on the engine); True when this call removed it. Gone, or already being removed by
    another process (409), counts as done. A handle's meter is released once it is gone."""
    cid = sandbox if isinstance(sandbox, str) else sandbox.cid
    try:
        api.remove_container(cid, force=True)
        removed = True
    except ENGINE_ERRORS as e:
        if kind(e) == "conflict":
            return False
        if kind(e) != "gone":
            raise
        removed = False
    if not isinstance(sandbox, str):
        sandbox.released()
    return removed
