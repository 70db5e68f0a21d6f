"""What marks a Docker sandbox as the project's, in one place: the runtime (policy.py,
pool.py, usage.py, the save-time import check) makes sandboxes with these, the socket guard
(executor/runtimes/docker/sockguard/) passes calls on only for these. No imports: the guard
and the light paths (validate) read it without the Docker SDK."""

from __future__ import annotations

LABEL_JOB = "studio.job_id"
LABEL_OWNER = "studio.owner"
LABEL_DEADLINE = "studio.deadline"  # epoch seconds after which any reaper may remove it
LABEL_LANGUAGE = "studio.language"
#: a pre-started container waiting for a job carries its owner here instead of a job id
#: (labels are fixed at create): it gets its job's name when taken, see
#: executor/runtimes/docker/pool.py
LABEL_POOL = "studio.pool"
#: every label of a sandbox; one carries LABEL_OWNER, LABEL_DEADLINE and a job or pool
LABELS = frozenset({LABEL_JOB, LABEL_OWNER, LABEL_DEADLINE, LABEL_LANGUAGE, LABEL_POOL})

#: every sandbox's container name starts so (a job's: + its id; a pre-started one's: pool-)
NAME_PREFIX = "studio-code-"
POOL_NAME_PREFIX = NAME_PREFIX + "pool-"

#: the one file read out of a container: what the image's Python can import (the save-time
#: import check, executor/languages/python_modules.py)
MODULES_PATH = "/usr/share/studio-code/modules.json"

#: a run's own cgroup parent, below the engine's: <ENGINE_PARENT>/<USAGE_PARENT_PREFIX><16 hex>
#: (executor/runtimes/docker/usage.py)
USAGE_PARENT_PREFIX = "studio-code-usage-"
#: the engine's parent for containers with the cgroupfs driver when its ``cgroup-parent`` is
#: unset (STUDIO_CODE_USAGE_CGROUP_PARENT's default): the per-run parents go below it
ENGINE_PARENT = "/docker"


def container_name(job_id: str) -> str:
    """The container of job ``job_id``."""
    return f"{NAME_PREFIX}{job_id}"
