"""A node's limits are its own only within range (issue 38, items 1 and 2).

* A CPU share below 0.01 (1 ms in every 100 ms, the kernel's smallest CFS quota) and memory
  below what a runner starts in are CODE_INVALID at every door: the editor's check, the
  submit (CodeClient), the executor's own check and the CLI (the settings:
  tests/test_settings.py; the HTTP bodies: tests/test_http.py). Before, 1e-10 gave a
  sandbox with NO CPU quota (0 NanoCpus is "unlimited" to the engine) and 0.005 one that
  runc refused at start.
* Whatever a node asks for, its sandbox has a real CPU quota, read from INSIDE it.
* An engine that refuses a sandbox before the job's input was written (a create or a start
  it answers with an error) lost nothing: the job ends at once, never re-run, CODE_INVALID
  naming the node's own request when it asked for limits of its own, else
  RUNTIME_UNAVAILABLE naming the engine's refusal, the worker's runtime gate told once.
  Played on the machine's engine: its CPU range (more CPUs than the host has: a 400 at
  create), and on cgroup v1 a quota the kernel refuses at start (a 500: runc's
  "cfs_quota_us: invalid argument") under a cgroup parent of the test's own whose quota is
  smaller than the sandbox's, through a real Celery worker.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from executor.errors import CodeInvalid
from executor.floors import MIN_CPUS, MIN_MEMORY_BYTES, MIN_NANO_CPUS
from executor.models import CodeJob
from testkit.stack import Stack
from tests.conftest import THROUGH_SOCKGUARD, run_cli
from tests.snippets import CGROUP_CODE, TRIVIAL, cpu_share

#: no CPU quota at all before (0 NanoCpus); a quota runc refuses (500 us < 1 ms)
BELOW_FLOOR = [1e-10, 0.005]
SUB = {"STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_CODE_RUNTIME": "subprocess"}


# --- every door --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        ({"cpus": 1e-10}, "cpus=1e-10 is not a CPU share"),
        ({"cpus": 0.005}, "cpus=0.005 is not a CPU share"),
        ({"cpus": 0.0}, "cpus=0 is not a CPU share"),
        ({"memory": "32m"}, "memory=32m is less memory than a sandbox can start in"),
    ],
)
def test_every_door_refuses_a_limit_below_its_floor(
    make_settings: Any, tmp_path: Path, asked: dict[str, Any], says: str
) -> None:
    from api_client import CodeClient
    from executor.inputs import memory_bytes
    from executor.service import Executor

    settings = make_settings(code_runtime="subprocess", code_languages="python", code_max_cpus=2)
    the_range = "from 0.01" if "cpus" in asked else "from 64m"
    executor = Executor(settings)
    own = {"cpus": asked.get("cpus"), "memory_bytes": memory_bytes(asked.get("memory"))}
    with pytest.raises(CodeInvalid) as e:
        executor.check_limits(**own)
    assert says in e.value.message and the_range in e.value.message, e.value.message
    # a run: ended CODE_INVALID before any sandbox (studio-code run, a worker)
    r = executor.run(CodeJob(code=TRIVIAL, **own))
    assert (r.status.value, r.error and r.error.code) == ("invalid", "CODE_INVALID"), r
    assert says in r.error.message and r.trace == [], r
    with CodeClient(settings) as client:
        for door in (client.validate, client.prepare, client.submit):
            with pytest.raises(CodeInvalid) as e:
                door(TRIVIAL, "python", **asked)
            assert says in e.value.message and the_range in e.value.message, (door, e.value)
    flag, value = next(iter(asked.items()))
    if value not in BELOW_FLOOR:
        return  # the CLI's check is the same rule: its two cases of the issue are enough
    node = tmp_path / "node.py"
    node.write_text(TRIVIAL)
    for command in ("run", "submit"):
        proc = run_cli(command, str(node), f"--{flag}", str(value), env=SUB)
        out = proc.stdout.strip().splitlines()
        assert proc.returncode == 1 and len(out) == 1, proc.stdout + proc.stderr
        assert '"CODE_INVALID"' in out[0] and f"--{says}" in out[0], out[0]


@pytest.mark.parametrize("cpus", [*BELOW_FLOOR, MIN_CPUS])
def test_the_docker_policy_never_emits_a_nano_cpus_below_the_floor(
    make_settings: Any, cpus: float
) -> None:
    """The last guard: a Limits below the floor built by hand (no door checked it) raises,
    it is never rounded (to 0: no limit) nor clamped."""
    from executor.languages import get_language
    from executor.runtimes.docker.policy import sandbox_policy, shape_limits

    settings = make_settings(code_runtime="docker")
    limits = shape_limits(MIN_MEMORY_BYTES, cpus, 64)
    job = CodeJob(code=TRIVIAL)
    if cpus < MIN_CPUS:
        with pytest.raises(CodeInvalid, match="from 0.01"):
            sandbox_policy(settings, get_language("python"), job, limits, "test:1")
    else:
        policy = sandbox_policy(settings, get_language("python"), job, limits, "test:1")
        assert policy["host_config"]["nano_cpus"] == MIN_NANO_CPUS == 10_000_000


# --- seen from inside ---------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.parametrize("cpus", [None, *BELOW_FLOOR, MIN_CPUS, 0.25])
def test_whatever_a_node_asks_its_sandbox_has_a_real_cpu_quota(
    docker_executor: Any, cpus: float | None
) -> None:
    """Each share is refused at the door or read back from inside the sandbox as its quota:
    never "max" (v2) or -1 (v1)."""
    r = docker_executor.run(CodeJob(code=CGROUP_CODE, cpus=cpus, timeout_s=20))
    print(f"\ncpus={cpus}: {r.status.value} {r.error} {r.output}")
    if cpus is not None and cpus < MIN_CPUS:
        assert r.error is not None and r.error.code == "CODE_INVALID", r
        return
    assert r.status.value == "succeeded", r.error
    assert cpu_share(r.output) == (docker_executor.settings.code_cpus if cpus is None else cpus)


# --- an engine's refusal before the job's input --------------------------------------------


@pytest.mark.docker
@pytest.mark.parametrize("pool", ["cold", "pool"])
@pytest.mark.parametrize(("cpus", "code"), [(None, "RUNTIME_UNAVAILABLE"), (0.25, "CODE_INVALID")])
def test_an_engine_refusal_at_start_is_never_lost_to_the_infrastructure(
    request: pytest.FixtureRequest,
    docker_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    pool: str,
    cpus: float | None,
    code: str,
) -> None:
    """The executor, on the machine's engine, with its cold sandboxes' NanoCpus replaced by
    5e6 (a 500 us quota: what a node's 0.005 gave before the floor): runc refuses the start
    (the engine's 500). Not InfrastructureLost (sandbox.lost, which a worker runs again):
    the default limits give RUNTIME_UNAVAILABLE naming the engine's words, the node's own
    CODE_INVALID naming its request; no sandbox is left. With a pool of pre-started
    sandboxes (made with the real policy), the job's other shape misses it and goes cold."""
    import executor.runtimes.docker.runtime as docker_runtime

    ex = request.getfixturevalue("docker_pool_executor" if pool == "pool" else "docker_executor")
    real = docker_runtime.sandbox_policy

    def refused_quota(*args: Any, **kwargs: Any) -> dict[str, Any]:
        policy = real(*args, **kwargs)
        policy["host_config"]["nano_cpus"] = 5_000_000
        return policy

    monkeypatch.setattr(docker_runtime, "sandbox_policy", refused_quota)
    job = CodeJob(code=TRIVIAL, cpus=cpus, timeout_s=20)
    r = ex.run(job)
    print(f"\n{r.status.value} {r.error} {[(t.step, t.detail) for t in r.trace]}")
    assert r.error is not None and r.error.code == code, r
    assert "invalid argument" in r.error.message, r.error  # runc's own words
    if cpus is None:
        assert r.status.value == "failed" and "refused to start the sandbox" in r.error.message
        assert [(t.step, t.detail) for t in r.trace] == [("sandbox.refused", "engine")]
    else:
        assert r.status.value == "invalid" and "with cpus=0.25" in r.error.message, r.error
        assert [(t.step, t.detail) for t in r.trace] == [("sandbox.refused", "limits")]
    assert not docker_client.containers.list(all=True, filters={"name": job.job_id})


# --- through a real worker ---------------------------------------------------------------

CPU_ROOT = "/sys/fs/cgroup/cpu"


def _v1_parent_possible() -> str | None:
    """Why the cgroup v1 parent of the test's own cannot be made here (None: it can)."""
    if THROUGH_SOCKGUARD:
        return "the socket guard passes only its own cgroup parent"
    if not os.path.isdir(CPU_ROOT) or not os.path.isdir("/sys/fs/cgroup/memory"):
        return "not cgroup v1 (v2 lets a child's cpu.max exceed its parent's: no refusal)"
    if not os.access(CPU_ROOT, os.W_OK):
        return "the cgroup v1 hierarchy is not writable here (not root)"
    return None


def _remove_groups(name: str) -> None:
    """Every group the engine made below /<name> in each v1 hierarchy, then /<name>."""
    for root in Path("/sys/fs/cgroup").iterdir():
        top = root / name
        if not top.is_dir() or top.is_symlink():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


@pytest.fixture(scope="module")
def refusing(
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: Any,
    python_image: str,
) -> Iterator[tuple[Stack, bool]]:
    """One worker (one slot, no pre-started sandboxes) whose sandboxes go under a cgroup
    parent of the test's own, /studio-test-refuse-<hex>, holding at most 0.25 CPU (cgroup
    v1, where the kernel refuses a child's quota above its parent's); where that cannot be
    made, under the engine's own parent. Yields the stack and whether the parent holds."""
    name = f"studio-test-refuse-{secrets.token_hex(4)}"
    capped = _v1_parent_possible() is None
    overrides: dict[str, Any] = {}
    if capped:
        for controller in ("cpu", "memory"):
            Path(f"/sys/fs/cgroup/{controller}/{name}").mkdir()
        Path(f"{CPU_ROOT}/{name}/cpu.cfs_quota_us").write_text("25000")  # of 100000 us
        overrides["code_usage_cgroup_parent"] = f"/{name}"
    try:
        with Stack(
            tmp_path_factory.mktemp("refusing"),
            code_runtime="docker",
            code_languages="python",
            code_image=python_image,
            code_prewarm=0,
            code_concurrency=1,
            code_max_cpus=64,
            code_max_seconds=15,
            **overrides,
        ) as stack:
            stack.start_worker("refusing", concurrency=1)
            yield stack, capped
    finally:
        if capped:
            _remove_groups(name)


def _gate_told(stack: Stack) -> int:
    return stack.workers[0].output().count("runtime unavailable in pool process")


@pytest.mark.docker
@pytest.mark.redis
def test_a_cpu_share_the_engine_refuses_ends_code_invalid_at_once(
    refusing: tuple[Stack, bool], docker_client: Any
) -> None:
    """More CPUs than the engine's host has (within STUDIO_CODE_MAX_CPUS=64): the engine
    refuses the create (400, "Range of CPUs is from 0.01 to N.00"). The job ends at once,
    CODE_INVALID naming the node's request, attempts 1; the gate is not told (the engine
    is fine: the node asked for too much)."""
    stack, _ = refusing
    cpus = int(docker_client.info()["NCPU"]) + 1
    told = _gate_told(stack)
    job = stack.client.submit(TRIVIAL, "python", {"n": 1}, timeout_s=10, cpus=cpus)
    r = stack.client.wait(job, 60)
    print(f"\n{r.status.value} {r.attempts} {r.error} {[(t.step, t.detail) for t in r.trace]}")
    assert r.status.value == "invalid" and r.error is not None, r
    assert r.error.code == "CODE_INVALID" and f"with cpus={cpus}" in r.error.message, r.error
    assert "Range of CPUs" in r.error.message, r.error  # the engine's own words
    assert r.attempts == 1, r
    assert [(t.step, t.detail) for t in r.trace] == [("sandbox.refused", "limits")]
    assert _gate_told(stack) == told


@pytest.mark.docker
@pytest.mark.redis
def test_sandboxes_the_kernel_refuses_at_start_end_at_once_never_run_again(
    refusing: tuple[Stack, bool],
) -> None:
    """Under the test's parent of 0.25 CPU the kernel refuses a sandbox's larger quota when
    runc writes it (the engine's start answers 500: what a node's 0.005 met before the
    floor). Before: InfrastructureLost(engine_error), the job ran three times, each attempt
    telling the worker's gate, and ended "lost to the infrastructure". Now each ends at
    once, attempts 1: with the server's default share (0.5) RUNTIME_UNAVAILABLE naming the
    engine's refusal, the gate told once; with the node's own share (1) CODE_INVALID naming
    it. A share the parent holds (0.2) runs, its quota read from inside."""
    stack, capped = refusing
    reason = _v1_parent_possible()
    if not capped:
        pytest.skip(reason or "no parent")
    told = _gate_told(stack)
    default = stack.client.submit(TRIVIAL, "python", {"n": 1}, timeout_s=10)
    r = stack.client.wait(default, 60)
    print(f"\ndefault: {r.status.value} {r.attempts} {r.error} {r.trace}")
    assert r.status.value == "failed" and r.error is not None, r
    assert r.error.code == "RUNTIME_UNAVAILABLE", r.error
    assert "refused to start the sandbox" in r.error.message, r.error
    assert "cfs_quota_us" in r.error.message and "invalid argument" in r.error.message
    assert r.attempts == 1, r
    assert [(t.step, t.detail) for t in r.trace] == [("sandbox.refused", "engine")]
    deadline = time.monotonic() + 5  # the gate's line is logged before the result is stored
    while _gate_told(stack) == told and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gate_told(stack) == told + 1

    own = stack.client.submit(TRIVIAL, "python", {"n": 1}, timeout_s=10, cpus=1)
    r = stack.client.wait(own, 60)
    print(f"own: {r.status.value} {r.attempts} {r.error} {r.trace}")
    assert r.status.value == "invalid" and r.error is not None, r
    assert r.error.code == "CODE_INVALID" and "with cpus=1" in r.error.message, r.error
    assert "use the defaults" in r.error.message.lower(), r.error
    assert r.attempts == 1, r

    held = stack.client.submit(CGROUP_CODE, "python", {}, timeout_s=10, cpus=0.2)
    r = stack.client.wait(held, 60)
    assert r.status.value == "succeeded" and cpu_share(r.output) == 0.2, (r.error, r.output)
    assert _gate_told(stack) == told + 1
