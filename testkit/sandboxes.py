"""What the tests and the benches see of the sandboxes on the Docker engine: a job's
containers and events, the ended ones awaiting removal while a worker works."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from testkit.processes import (
    Service,
    tree_usage,
)


def sandbox_events(docker_client: Any, job_id: str, since: int, until: int) -> list[dict]:
    """Every Docker event between ``since`` and ``until`` (Unix seconds) of a container
    made for ``job_id`` (its label) or renamed to it (a pre-started one taken by the job, once
    the job ran STUDIO_CODE_PREWARM_RENAME_AFTER_S: a shorter one keeps its pool name)."""
    events: list[dict] = []
    for filters in (
        {"type": "container", "label": [f"studio.job_id={job_id}"]},
        {"type": "container", "container": [f"studio-code-{job_id}"]},
    ):
        events += docker_client.api.events(since=since, until=until, decode=True, filters=filters)
    return events


def run_and_end_from_outside(executor: Any, docker_client: Any, end: Any) -> Any:
    """Run a node that sleeps 20 s on ``executor``; once its sandbox runs, ``end(container)``
    it as an operator would (``docker rm -f``, ``docker kill``...); returns the result."""
    from executor.models import CodeJob

    code = "import time\n\ndef main(state):\n    time.sleep(20)\n    return 1\n"
    job = CodeJob(code=code, timeout_s=30)
    out: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: out.setdefault("r", executor.run(job)))
    runner.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the job's sandbox is named after it once it runs
        found = docker_client.containers.list(filters={"name": f"studio-code-{job.job_id}"})
        if found:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the job's sandbox never ran")
    time.sleep(0.5)  # its code is sleeping now
    end(found[0])
    runner.join(30)
    return out["r"]


def containers_of(docker_client: Any, job_id: str, *, running: bool = False) -> list[Any]:
    """The sandbox of ``job_id`` (a docker SDK Container; only a running one with
    ``running``): found by its name, which a container started for the job has from its
    create and a pre-started one from the moment it is taken (its labels were fixed before
    the job was known)."""
    filters: dict[str, Any] = {"name": f"^/studio-code-{job_id}$"}
    if running:
        filters["status"] = "running"
    # ignore_removed: a sandbox removed between the list and its inspect is gone, not an error
    return docker_client.containers.list(all=True, filters=filters, ignore_removed=True)


LABEL_POOL = "studio.pool"
LABEL_OWNER = "studio.owner"


def pool_containers(docker_client: Any, owner: str) -> list[dict]:
    """The pre-started sandboxes of the pool ``owner`` (its studio.pool label), any state."""
    return docker_client.api.containers(all=True, filters={"label": f"{LABEL_POOL}={owner}"})


#: a sandbox that ran and ended: what awaits its removal (a pre-started one waiting for its
#: job is running; one being created for a cold job is "created", not used yet)
ENDED = ("exited", "dead")


def ended_sandboxes(api: Any, owners: set[str]) -> list[dict]:
    """The sandboxes of ``owners`` (host:pid of a worker's pool processes: their
    studio.owner label) that ended and are not removed yet, on the engine of ``api``."""
    out = []
    for status in ENDED:
        for c in api.containers(all=True, filters={"label": LABEL_OWNER, "status": status}):
            if (c.get("Labels") or {}).get(LABEL_OWNER) in owners:
                out.append(c)
    return out


@dataclass
class Backlog:
    """What ``watch_backlog`` saw."""

    records: dict[str, Any]
    samples: int = 0
    ended_max: int = 0
    worst: list[str] = field(default_factory=list)  # the sandboxes of the worst sample
    #: finished jobs -> the worker tree's (fds, RSS bytes, threads) when first reached
    usage: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def summary(self) -> str:
        first, last = min(self.usage), max(self.usage)
        (f0, r0, t0), (f1, r1, t1) = self.usage[first], self.usage[last]
        return (
            f"ended-awaiting-removal max {self.ended_max} over {self.samples} samples; "
            f"job {first} -> job {last}: fds {f0} -> {f1}, "
            f"RSS {r0 / 2**20:.1f} -> {r1 / 2**20:.1f} MiB, threads {t0} -> {t1}"
        )


def watch_backlog(
    api: Any,
    store: Any,
    job_ids: list[str],
    worker: Service,
    owners: set[str],
    *,
    marks: Sequence[int],
    interval_s: float = 0.5,
    timeout_s: float = 480.0,
) -> Backlog:
    """Until every one of ``job_ids`` is finished (in ``store``), sample every
    ``interval_s``: the ended sandboxes of ``owners`` awaiting removal, and the worker's
    fds/RSS/threads when the count of finished jobs first reaches each of ``marks``."""
    seen = Backlog(records={})
    deadline = time.monotonic() + timeout_s
    while True:
        ended = ended_sandboxes(api, owners)
        seen.samples += 1
        if len(ended) > seen.ended_max:
            seen.ended_max = len(ended)
            seen.worst = [f"{c['Names'][0]} {c['Status']}" for c in ended[:8]]
        seen.records = store.get_many(job_ids)
        done = sum(1 for r in seen.records.values() if r.finished)
        for mark in marks:
            if done >= mark and mark not in seen.usage:
                seen.usage[mark] = tree_usage(worker.pid)
        if done == len(job_ids):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(job_ids) - done} of {len(job_ids)} jobs not finished after "
                f"{timeout_s:g} s\n{worker.tail(40)}"
            )
        time.sleep(interval_s)
