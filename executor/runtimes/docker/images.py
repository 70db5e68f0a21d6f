"""Reading one file out of an image: an operation of the docker runtime.

A container is created from the image in the sandboxes' own shape (``sandbox_policy``: no
network, no mounts, every control, labelled, with a deadline any reaper honours) running
``true``; it is never started. The file is copied out of it (``GET .../archive``) and the
container removed. The socket guard (``sockguard/``) passes that create and the read of
the one file it allows (``MODULES_PATH``: what the image's Python can import, for the
save-time check in executor/languages/python_modules.py).

The settings are the caller's (the executor's own), not re-read from the environment: the
container has the limits the executor's sandboxes have.
"""

from __future__ import annotations

import io
import tarfile
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.settings import Settings


def read_file(api: Any, settings: Settings, image: str, path: str) -> bytes:
    """The bytes of the file at ``path`` in ``image``; raises what the engine raises (no such
    image or file, an engine that refuses) after removing the container it made."""
    cid = api.create_container(**_never_started(api, settings, image))["Id"]
    try:
        stream, _ = api.get_archive(cid, path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.extractfile(tar.getmembers()[0])
            if member is None:
                raise FileNotFoundError(f"{path} in {image} is not a file")
            return member.read()
    finally:
        api.remove_container(cid, force=True)


def _never_started(api: Any, settings: Settings, image: str) -> dict[str, Any]:
    """The create arguments of the container a file is copied out of: a sandbox's, running
    ``true``, never started."""
    from executor.languages import get_language
    from executor.models import CodeJob
    from executor.runtimes.base import owner_id
    from executor.runtimes.docker.policy import sandbox_policy, shape_limits
    from executor.sandbox_names import container_name

    limits = shape_limits(settings.memory_bytes, settings.code_cpus, settings.code_pids)
    job = CodeJob(job_id=f"modules-{uuid.uuid4().hex[:12]}", code="")
    policy = sandbox_policy(settings, get_language("python"), job, limits, owner_id(), api=api)
    return {
        **policy,
        "name": container_name(job.job_id),
        "image": image,
        "command": ["true"],
        "host_config": api.create_host_config(**policy["host_config"]),
    }
