"""Two hosts on one machine, and what happens to a run when its host loses its engine.

A second Docker engine (testkit.engine.SecondEngine: its own data-root, exec-root, socket,
pidfile, containerd; no bridge, no iptables) with the sandbox image loaded stands for a second
worker machine. One ``studio-code worker`` per engine (e1: the machine's engine, e2: the
second one; DOCKER_HOST differs), one Redis and one PostgreSQL of this module's own on
loopback ports: what docs/operations.md calls a multi-host deployment. The engine, the
workers and the servers are started once for the module (~20 s) and shared by its cases, in
order; only the SECOND engine is ever stopped, restarted or killed.

The rule each fault case holds (docs/operations.md, "Many hosts" and "Faults"): infrastructure
never fails a run and never blames its code. Every job of a burst ends ``succeeded``, exactly
once (one row, one result), none ``CODE_*`` nor RUNTIME_UNAVAILABLE; a run whose sandbox the
fault killed ran again (``attempts`` >= 2) and its trace's first row (``job.rerun``) names
the cause; a job e2's worker took after its engine stopped answering was handed back and
ran on e1.

* the engine restarted under a burst (SIGTERM to dockerd, as a package upgrade does: it
  closes its socket, kills its containers ten seconds later, exits; then started again);
* the engine's dockerd and a running sandbox's containerd-shim SIGKILLed mid-run (then the
  engine is started again, so the next case has it);
* the engine stopped for good under a burst.

A long job sleeps until a wall-clock time in its state (not for a duration), so the run the
fault killed is long (it is running when the engine kills it ten seconds after a stop) and
its re-run short.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from testkit.engine import KillableEngine
from testkit.postgres import PgCluster, start_pg_cluster
from testkit.processes import Service, require
from testkit.stack import DOCKER_PYTHON, Stack
from tests.conftest import LABEL_JOB

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.redis, pytest.mark.postgres]

#: sleeps ``s`` seconds, or until the wall-clock time ``until``, whichever is later
WORK = (
    "import time\n\n"
    "def main(state):\n"
    "    time.sleep(max(state.get('s', 0), state.get('until', 0) - time.time()))\n"
    "    return state['i']\n"
)
#: a long job's end, from its submit: the engine's kill (ten seconds after a stop) comes
#: well before it, its re-run sleeps what is left
LONG_S = 25.0
MAX_SECONDS = 40
CODE_ERRORS = {"CODE_ERROR", "CODE_TIMEOUT", "CODE_MEMORY", "CODE_OUTPUT_INVALID"}
RERUN_STEP = "job.rerun"
CAUSES = (
    "engine_stopping",
    "engine_unreachable",
    "sandbox_vanished",
    "stream_broken",
    "sandbox_killed",
)


@dataclass
class Hosts:
    """The module's deployment: two workers, two engines, a client."""

    engine2: KillableEngine
    client: Any
    names: dict[str, str]
    workers: dict[str, Service]
    docker_client: Any
    submitted: list[str] = field(default_factory=list)

    def engine_of(self, worker: str | None) -> str:
        node = (worker or "").split("@")[0]
        return next((e for e, n in self.names.items() if n == node), f"unknown:{worker}")

    def submit(self, i: int, *, s: float = 0.0, until: float = 0.0) -> str:
        job = self.client.submit(
            WORK, "python", {"i": i, "s": s, "until": until}, timeout_s=MAX_SECONDS, user="two"
        )
        self.submitted.append(job)
        return job

    def on_e2(self) -> list[str]:
        """Job ids of the sandboxes running on the second engine: a sandbox is named
        studio-code-<job id> (a pre-started one is renamed so when a job takes it)."""
        out = self.engine2.docker("ps", "--format", "{{.Names}}", check=False).stdout.split()
        return [
            n.removeprefix("studio-code-")
            for n in out
            if n.startswith("studio-code-") and not n.startswith("studio-code-pool-")
        ]

    def wait_on_e2(self, jobs: list[str], timeout_s: float = 60) -> list[str]:
        """Wait until one of ``jobs`` runs on the second engine; those running there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = [j for j in self.on_e2() if j in jobs]
            if running:
                return running
            time.sleep(0.1)
        pytest.fail(f"none of {len(jobs)} jobs ran on the second engine")

    def account(self, jobs: list[str], expect: dict[str, int]) -> dict[str, Any]:
        """Wait for every job; assert each ended ``succeeded`` once with its own output, and
        that a re-run says why in its trace. Returns the records and the accounting."""
        recs = {j: self.client.wait(j, 240) for j in jobs}
        outcome: Counter[str] = Counter()
        for j, r in recs.items():
            assert r.status.finished, f"{j} is stuck {r.status.value}"
            code = r.error.code if r.error is not None else None
            outcome[f"{r.status.value} {code or ''}".strip()] += 1
            assert code not in CODE_ERRORS, f"{j} was blamed on its code: {r.error}"
            assert r.status.value == "succeeded", f"{j}: {r.status.value} {r.error}"
            assert r.output == expect[j], r
            steps = [t.step for t in r.trace]
            assert steps.count(RERUN_STEP) <= 1 and steps.count("code.run") == 1, r.trace
            assert 1 <= r.attempts <= 3, (j, r.attempts)
            if r.attempts > 1:  # nothing else hands a job back here: the row says why
                assert steps[0] == RERUN_STEP, (j, r.attempts, r.trace)
                assert any(c in r.trace[0].detail for c in CAUSES), r.trace[0]
        rerun = {j: r for j, r in recs.items() if r.attempts > 1}
        per_engine = Counter(self.engine_of(r.worker) for r in recs.values())
        reran = "; ".join(
            f"{j[:8]} attempts {r.attempts} ({r.trace[0].detail})" for j, r in rerun.items()
        )
        print(f"{len(jobs)} submitted: {dict(outcome)}; ran on {dict(per_engine)}; re-run: {reran}")
        # one row per job, one result: the store's row is the job (its id is its key)
        assert len(recs) == len(set(jobs)) == outcome["succeeded"]
        return {"recs": recs, "rerun": rerun, "per_engine": per_engine}

    def no_sandbox_left_on_e1(self, jobs: list[str]) -> None:
        """A pre-started sandbox answers at its result frame and is removed right after its
        job's done notice, off the caller's path: the last ones get a moment."""
        deadline = time.monotonic() + 30
        for j in jobs:
            while True:
                left = self.docker_client.containers.list(
                    all=True, filters={"label": f"{LABEL_JOB}={j}"}, ignore_removed=True
                ) + self.docker_client.containers.list(
                    all=True, filters={"name": f"studio-code-{j}"}, ignore_removed=True
                )
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert not left, f"sandbox of {j} left on engine 1"

    def serving(self, key: str, timeout_s: float = 60) -> None:
        """Wait until worker ``key`` takes jobs again, its gate open (it logs "consumers
        paused" when its gate closes, "consumers resumed" when it opens again)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.workers[key].output()
            if out.count("consumers resumed") >= out.count("consumers paused"):
                return
            time.sleep(0.3)
        pytest.fail(f"worker {key} did not take jobs again:\n{self.workers[key].output()[-3000:]}")


@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, python_image: str
) -> Iterator[Hosts]:
    require(os.geteuid() == 0, "a second dockerd needs root")
    require(shutil.which("runuser") is not None, "runuser is missing")
    tmp = tmp_path_factory.mktemp("two-hosts")
    engine2 = KillableEngine()
    pg: PgCluster | None = None
    try:
        t0 = time.monotonic()
        engine2.start()
        engine2.load(python_image)
        pg = start_pg_cluster()
        with Stack(
            tmp,
            database_url=pg.url,
            **{**DOCKER_PYTHON, "code_max_seconds": MAX_SECONDS},
            code_image=python_image,
        ) as stack:
            tag = uuid.uuid4().hex[:4]
            names = {"e1": f"e1-{tag}", "e2": f"e2-{tag}"}
            hosts = {"e1": "unix:///var/run/docker.sock", "e2": engine2.host}
            # `studio-code worker` on each engine (DOCKER_HOST), both started, then waited for
            workers = {
                key: stack.start_worker(
                    names[key], 3, cli=True, ping=False, stop_timeout=60, env={"DOCKER_HOST": host}
                )
                for key, host in hosts.items()
            }
            for w in workers.values():
                w.wait_ready(90)
            print(f"\ntwo hosts up in {time.monotonic() - t0:.1f}s")
            h = Hosts(engine2, stack.client, names, dict(workers), docker_client)
            yield h
            h.no_sandbox_left_on_e1(h.submitted)
            assert workers["e1"].alive(), workers["e1"].output()[-3000:]
    finally:
        engine2.stop()
        left = engine2.end_leftovers()
        if left:
            print(f"ended what the stopped engine left running: pids {left}")
        engine2.unmount_own()
        engine2.remove()
        if pg is not None:
            pg.cleanup()


def test_two_engines_share_jobs(hosts: Hosts) -> None:
    """Both engines take jobs; each sandbox is on its worker's engine."""
    first = [hosts.submit(i, s=1.0) for i in range(12)]
    seen_on_e2 = set(hosts.wait_on_e2(first))
    acc = hosts.account(first, {j: i for i, j in enumerate(first)})
    per_engine = acc["per_engine"]
    assert per_engine["e1"] > 0 and per_engine["e2"] > 0, per_engine
    assert not acc["rerun"], "nothing failed: nothing ran twice"
    assert all(hosts.engine_of(hosts.client.status(j).worker) == "e2" for j in seen_on_e2)


def burst(hosts: Hosts, fault: Callable[[list[str]], None]) -> dict[str, Any]:
    """Long jobs (until LONG_S after their submit) and short ones (1.5 s) on both workers;
    ``fault(long jobs running on e2)`` as soon as a long one runs there. Returns the
    accounting, and which long jobs ran on e2 when the fault came."""
    hosts.serving("e2")
    until = time.time() + LONG_S
    jobs = {}
    for i in range(4):
        jobs[hosts.submit(i, until=until)] = i
    for i in range(4, 16):
        jobs[hosts.submit(i, s=1.5)] = i
    long_jobs = list(jobs)[:4]
    hit = hosts.wait_on_e2(long_jobs)
    fault(hit)
    # the engine kills a running sandbox at once (SIGKILL) or ten seconds after a stop:
    # both before the long jobs' end, or none would have been killed
    assert time.time() < until, "the fault came after the long jobs' end: too slow to test"
    acc = hosts.account(list(jobs), jobs)
    acc["hit"] = hit
    return acc


def test_engine_restarted_under_a_burst_blames_no_code_and_fails_no_run(hosts: Hosts) -> None:
    """(a) SIGTERM to e2's dockerd (it closes its socket, then kills its containers ten
    seconds later: the long job running there dies with exit status 137), then started
    again: the killed run ran again and succeeded, its trace names the cause."""
    restarted: list[float] = []

    def restart(hit: list[str]) -> None:
        hosts.engine2.stop()  # graceful: returns when dockerd has exited
        hosts.engine2.start()
        restarted.append(time.time())

    acc = burst(hosts, restart)
    for j in acc["hit"]:
        r = acc["recs"][j]
        assert r.attempts >= 2, f"{j} ran on e2 when its engine stopped, yet ran once: {r}"
        assert r.trace[0].step == RERUN_STEP, r.trace
    hosts.serving("e2")


def test_engine_and_shim_sigkilled_mid_run(hosts: Hosts) -> None:
    """(c) SIGKILL of e2's dockerd and of the containerd-shim of a long job's sandbox
    while it runs: the attach stream and the engine go at once. The run ran again on e1
    (e2's engine is down: its worker steps aside); then e2's engine is started again."""
    killed: list[int] = []

    def kill(hit: list[str]) -> None:
        cid = hosts.engine2.docker(
            "inspect", "--format", "{{.Id}}", f"studio-code-{hit[0]}"
        ).stdout.strip()
        killed.extend(hosts.engine2.kill_hard(cid))

    try:
        acc = burst(hosts, kill)
    finally:
        if not hosts.engine2.running():
            hosts.engine2.start()
    print(f"SIGKILLed dockerd and shim: {killed}")
    for j in acc["hit"]:
        r = acc["recs"][j]
        assert r.attempts >= 2 and r.trace[0].step == RERUN_STEP, r
        assert hosts.engine_of(r.worker) == "e1", r  # e2 had no engine until the end
    hosts.serving("e2")


def test_engine_stopped_for_good_under_a_burst(hosts: Hosts) -> None:
    """(b) e2's engine stopped and not started again: the long job it killed, and every
    job its worker took after the stop, ran on e1; its worker stepped aside (its health
    says why) and took nothing more."""
    stopped: list[float] = []

    def stop(hit: list[str]) -> None:
        hosts.engine2.stop()
        stopped.append(time.time())

    acc = burst(hosts, stop)
    assert not hosts.engine2.running()
    for j in acc["hit"]:
        r = acc["recs"][j]
        assert r.attempts >= 2 and r.trace[0].step == RERUN_STEP, r
        assert hosts.engine_of(r.worker) == "e1", r
    for j, r in acc["recs"].items():
        if hosts.engine_of(r.worker) == "e2":  # only what ended before its engine was gone
            assert r.finished_at is not None and r.finished_at.timestamp() <= stopped[0], (j, r)
    out = hosts.workers["e2"].output()
    assert "Docker is not reachable" in out, out[-3000:]
