"""The socket guard (``studio-code sockguard``, executor/runtimes/docker/sockguard/) as a real
process on a unix socket, in front of the real engine: what it refuses (403, its reason in
the message and the guard's log) and that jobs, cold and pooled, run through it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.sockguard import TRIVIAL, SockGuardProcess, sandbox_args

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def guard(tmp_path_factory: pytest.TempPathFactory, docker_client: Any) -> Iterator[Any]:
    with SockGuardProcess(tmp_path_factory.mktemp("guard")) as g:
        yield g


@pytest.fixture
def api(guard: Any) -> Iterator[Any]:
    import docker

    client = docker.APIClient(base_url=guard.host, timeout=30)
    yield client
    client.close()


def refused(guard: Any, api: Any, docker_client: Any, args: dict[str, Any]) -> str:
    """Create ``args`` through the guard: it must be refused (403) and nothing made."""
    import docker

    name = f"studio-code-guardtest-{uuid.uuid4().hex[:12]}"
    with pytest.raises(docker.errors.APIError) as info:
        api.create_container(name=name, **args)
    assert info.value.status_code == 403, info.value
    assert not docker_client.api.containers(all=True, filters={"name": name})
    message = str(info.value.explanation)
    assert message.startswith("sockguard:"), message
    assert any(message.removeprefix("sockguard: ") in line for line in guard.refusals()), (
        message,
        guard.refusals()[-3:],
    )
    return message


CASES = [
    ({"privileged": True}, "Privileged"),
    ({"binds": ["/:/host"]}, "Binds ['/:/host']"),
    ({"pid_mode": "host"}, "PidMode 'host'"),
    ({"network_mode": "host"}, "NetworkMode 'host'"),
    ({"cap_add": ["SYS_ADMIN"]}, "CapAdd ['SYS_ADMIN']"),
    ({"security_opt": ["no-new-privileges", "seccomp=unconfined"]}, "seccomp=unconfined"),
    ({"security_opt": ["no-new-privileges"]}, "SecurityOpt"),
    ({"mounts": [{"Type": "bind", "Source": "/", "Target": "/host"}]}, "Mounts"),
    ({"devices": ["/dev/sda:/dev/sda:rwm"]}, "Devices"),
    ({"ipc_mode": "host"}, "IpcMode 'host'"),
    ({"userns_mode": "host"}, "UsernsMode 'host'"),
    ({"read_only": False}, "ReadonlyRootfs"),
    ({"cap_drop": []}, "CapDrop"),
    ({"mem_limit": 64 << 30, "memswap_limit": 64 << 30}, "Memory"),
]


@pytest.mark.parametrize(("host", "named"), CASES, ids=[c[1].split()[0] for c in CASES])
def test_a_create_outside_the_sandbox_policy_is_refused_naming_why(
    guard: Any, api: Any, docker_client: Any, python_image: str, host: dict[str, Any], named: str
) -> None:
    message = refused(guard, api, docker_client, sandbox_args(api, python_image, **host))
    assert named in message, message


HEX = "0123456789abcdef"
#: cgroup parents of another shape than a run's own /docker/studio-code-usage-<16 hex> (below
#: the engine's parent, STUDIO_CODE_USAGE_CGROUP_PARENT's default): the old shape at the
#: hierarchy's root, the engine's or another service's group, a path out of /docker or below
#: a run's parent, another parent's name, upper-case or one hex digit more or less, a
#: trailing newline, an empty name, no leading slash
OTHER_PARENTS = [
    f"/studio-code-usage-{HEX}",
    "/docker",
    "/system.slice",
    f"/system.slice/studio-code-usage-{HEX}",
    f"/docker/../studio-code-usage-{HEX}",
    "/docker/../x",
    f"/docker/studio-code-usage-{HEX}/../../x",
    f"/docker/studio-code-usage-{HEX}/sub",
    f"/docker/x/studio-code-usage-{HEX}",
    f"/dockerx/studio-code-usage-{HEX}",
    f"/docker/studio-code-usage-{HEX.upper()}",
    f"/docker/studio-code-usage-{HEX[:-1]}",
    f"/docker/studio-code-usage-{HEX}0",
    f"/docker/studio-code-usage-{HEX}\n",
    f"/docker//studio-code-usage-{HEX}",
    f"//docker/studio-code-usage-{HEX}",
    f"docker/studio-code-usage-{HEX}",
]


def created_under(api: Any, docker_client: Any, python_image: str, parent: str) -> None:
    """A create with ``parent`` passes the guard and the engine keeps it (never started:
    no group is made)."""
    name = f"studio-code-guardtest-{uuid.uuid4().hex[:12]}"
    args = sandbox_args(api, python_image, cgroup_parent=parent)
    cid = api.create_container(name=name, **args)["Id"]
    try:
        assert docker_client.api.inspect_container(cid)["HostConfig"]["CgroupParent"] == parent
    finally:
        docker_client.api.remove_container(cid, force=True)


def test_a_cgroup_parent_of_another_shape_than_a_run_own_is_refused_named(
    guard: Any, api: Any, docker_client: Any, python_image: str
) -> None:
    """A run's own parent below /docker (usage per run) passes; any other CgroupParent is
    refused, named: a compromised worker cannot put a sandbox under the engine's or a
    service's group, nor beside /docker at the root (out of its limits and CPU weight)."""
    for parent in OTHER_PARENTS:
        args = sandbox_args(api, python_image, cgroup_parent=parent)
        message = refused(guard, api, docker_client, args)
        assert f"HostConfig.CgroupParent {parent!r}" in message, message
        assert "/docker/studio-code-usage-<16 hex>" in message, message
    created_under(api, docker_client, python_image, "/docker/studio-code-usage-" + HEX)
    parent = "/docker/studio-code-usage-" + uuid.uuid4().hex[:16]
    created_under(api, docker_client, python_image, parent)


def test_a_guard_for_an_engine_with_another_parent_passes_that_shape_only(
    tmp_path: Path, docker_client: Any, python_image: str
) -> None:
    """STUDIO_CODE_USAGE_CGROUP_PARENT (an engine with a cgroup-parent of its own): the guard
    passes a run's parent below it, and refuses one below /docker, or at the root."""
    import docker

    env = {"STUDIO_CODE_USAGE_CGROUP_PARENT": "/studio.engine/containers"}
    with SockGuardProcess(tmp_path / "guard", env) as other:
        api = docker.APIClient(base_url=other.host, timeout=30)
        try:
            good = f"/studio.engine/containers/studio-code-usage-{HEX}"
            created_under(api, docker_client, python_image, good)
            for parent in (
                f"/docker/studio-code-usage-{HEX}",
                f"/studio-code-usage-{HEX}",
                f"/studio.engine/studio-code-usage-{HEX}",
                f"/studioXengine/containers/studio-code-usage-{HEX}",
            ):
                args = sandbox_args(api, python_image, cgroup_parent=parent)
                message = refused(other, api, docker_client, args)
                assert f"HostConfig.CgroupParent {parent!r}" in message, message
                assert f"own {good[: -len(HEX)]}<16 hex>" in message, message
        finally:
            api.close()


def test_an_image_outside_the_list_and_a_root_user_are_refused(
    guard: Any, api: Any, docker_client: Any, python_image: str
) -> None:
    args = sandbox_args(api, python_image)
    message = refused(guard, api, docker_client, {**args, "image": "debian:12"})
    assert "image 'debian:12' is not one of the configured sandbox images" in message
    message = refused(guard, api, docker_client, {**args, "user": "0:0"})
    assert "User '0:0'" in message
    message = refused(guard, api, docker_client, {**args, "labels": {}})
    assert "studio.owner" in message


def test_a_field_spelled_in_another_case_is_refused(
    guard: Any, api: Any, docker_client: Any, python_image: str
) -> None:
    """The engine reads JSON keys case-insensitively: ``privileged`` is Privileged to it."""

    args = sandbox_args(api, python_image)
    body = dict(api.create_container_config(**args))
    body["HostConfig"] = {**body["HostConfig"], "privileged": True}
    name = f"studio-code-guardtest-{uuid.uuid4().hex[:12]}"
    r = api._post(
        api._url("/containers/create"),
        params={"name": name},
        data=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 403, r.text
    assert "HostConfig.Privileged" in r.json()["message"]
    body["HostConfig"] = {**args["host_config"], "PRIVILEGED": True, "Privileged": False}
    r = api._post(api._url("/containers/create"), params={"name": name}, data=json.dumps(body))
    assert r.status_code == 403 and "ambiguous" in r.json()["message"], r.text
    assert not docker_client.api.containers(all=True, filters={"name": name})


def test_exec_pull_and_calls_on_other_containers_are_refused(
    guard: Any, api: Any, docker_client: Any, python_image: str
) -> None:
    import docker

    # a sandbox made through the guard (never started): exec into it is refused
    args = sandbox_args(api, python_image)
    cid = api.create_container(name=f"studio-code-guardtest-{uuid.uuid4().hex[:12]}", **args)["Id"]
    try:
        with pytest.raises(docker.errors.APIError) as info:
            api.exec_create(cid, ["sh"])
        assert info.value.status_code == 403 and "/exec" in str(info.value.explanation)
        for unused in (api.kill, api.stop):  # nothing of the project calls them
            with pytest.raises(docker.errors.APIError) as info:
                unused(cid)
            assert info.value.status_code == 403, unused
        assert api.inspect_container(cid)["Id"] == cid  # its own calls pass
    finally:
        api.remove_container(cid, force=True)
    with pytest.raises(docker.errors.APIError) as info:
        api.pull("alpine", tag="3")  # refused before any registry is asked
    assert info.value.status_code == 403 and "/images/create" in str(info.value.explanation)
    # a container that is not a sandbox (made on the engine itself, no studio labels)
    other = docker_client.api.create_container(python_image, ["true"], network_disabled=True)
    try:
        for call in (api.start, api.inspect_container, api.remove_container):
            with pytest.raises(docker.errors.APIError) as info:
                call(other["Id"])
            assert info.value.status_code == 403, call
            assert "not a sandbox" in str(info.value.explanation)
        assert docker_client.api.inspect_container(other["Id"])["State"]["Status"] == "created"
    finally:
        docker_client.api.remove_container(other["Id"], force=True)
    for refused_call, named in (
        (lambda: api.containers(all=True), "GET /containers/json"),
        (lambda: api.volumes(), "/volumes"),
        (lambda: api.networks(), "/networks"),
        (lambda: api.inspect_image("debian:12"), "debian:12"),
    ):
        with pytest.raises(docker.errors.APIError) as info:
            refused_call()
        assert info.value.status_code == 403 and named in str(info.value.explanation)
    events = api._get(api._url("/events"), params={"filters": '{"label": ["studio.owner"]}'})
    assert events.status_code == 403 and "/events" in events.json()["message"]
    assert "since and until" in events.json()["message"]  # never an endless stream
    # a missing sandbox is the engine's 404 (the SDK's NotFound), not a refusal
    with pytest.raises(docker.errors.NotFound):
        api.remove_container(f"studio-code-missing-{uuid.uuid4().hex}", force=True)


def test_the_events_of_one_sandbox_between_two_moments_pass_rebuilt(
    guard: Any, api: Any, docker_client: Any, python_image: str
) -> None:
    """The one events call the runtime makes (attached.killed_through_engine): one
    sandbox's kill events, since and until given; the guard writes the filter again with
    the full id. Any other events call is refused: no until (an endless stream), an until
    far ahead, two containers, a container that is not a sandbox, other event kinds."""
    import time

    import docker

    args = sandbox_args(api, python_image)
    name = f"studio-code-guardtest-{uuid.uuid4().hex[:12]}"
    cid = api.create_container(name=name, **args)["Id"]
    other = docker_client.api.create_container(python_image, ["true"], network_disabled=True)
    since = time.time() - 1
    try:
        api.start(cid)
        docker_client.api.kill(cid)  # an operator's `docker kill`, on the engine itself
        docker_client.api.wait(cid, timeout=20)

        def events(**kw: Any) -> Any:
            return api._get(api._url("/events"), params=kw)

        def kills(ref: str) -> list[dict[str, Any]]:
            r = events(
                since=f"{since:.9f}",
                until=f"{time.time():.9f}",
                filters=json.dumps({"container": [ref], "type": ["container"], "event": ["kill"]}),
            )
            assert r.status_code == 200, r.text
            return [json.loads(line) for line in r.text.splitlines() if line.strip()]

        for ref in (cid, cid[:12], name):  # by full id, short id or name: the same answer
            seen = kills(ref)
            assert [(e["Action"], e["Actor"]["ID"]) for e in seen] == [("kill", cid)], seen
            assert seen[0]["Actor"]["Attributes"]["signal"] == "9", seen
        # what the runtime calls, through the SDK
        stream = api.events(
            since=f"{since:.9f}",
            until=f"{time.time():.9f}",
            filters={"container": cid, "type": "container", "event": "kill"},
            decode=True,
        )
        assert [e["Action"] for e in stream] == ["kill"]
        now = f"{time.time():.9f}"
        one = json.dumps({"container": [cid], "event": ["kill"]})
        for params, named in (
            ({"since": now, "filters": one}, "since and until"),
            ({"since": now, "until": f"{time.time() + 60:.0f}", "filters": one}, "ahead"),
            ({"since": now, "until": now, "filters": json.dumps({"event": ["kill"]})}, "one"),
            (
                {
                    "since": now,
                    "until": now,
                    "filters": json.dumps({"container": [cid, other["Id"]], "event": ["kill"]}),
                },
                "one container",
            ),
            (
                {"since": now, "until": now, "filters": json.dumps({"container": [cid]})},
                "named",
            ),
            (
                {
                    "since": now,
                    "until": now,
                    "filters": json.dumps({"container": [cid], "event": ["exec_create"]}),
                },
                "only",
            ),
            (
                {
                    "since": now,
                    "until": now,
                    "filters": json.dumps({"container": [other["Id"]], "event": ["kill"]}),
                },
                "not a sandbox",
            ),
            (
                {"since": now, "until": now, "filters": one, "type": "container"},
                "not passed on",
            ),
        ):
            r = events(**params)
            assert r.status_code == 403, (params, r.status_code, r.text)
            assert named in r.json()["message"], (params, r.json())
        with pytest.raises(docker.errors.APIError):
            api.remove_container(other["Id"], force=True)  # still not the guard's to touch
    finally:
        api.remove_container(cid, force=True)
        docker_client.api.remove_container(other["Id"], force=True)


def test_a_job_signalled_through_the_engine_is_lost_not_the_codes_through_the_guard(
    guard: Any,
    monkeypatch: pytest.MonkeyPatch,
    make_settings: Any,
    python_image: str,
    docker_client: Any,
) -> None:
    """Behind the guard, the runtime still tells a `docker kill` from the code's own end."""
    from testkit.sandboxes import run_and_end_from_outside

    ex = _executor(monkeypatch, guard, make_settings, python_image)
    try:
        r = run_and_end_from_outside(ex, docker_client, lambda c: c.kill())
    finally:
        ex.close()
    assert r.status.value == "failed" and r.error is not None, r
    assert r.error.code == "RUNTIME_UNAVAILABLE" and "sandbox_killed" in r.error.message, r.error


def _executor(
    monkeypatch: pytest.MonkeyPatch, guard: Any, make_settings: Any, image: str, **kw: Any
) -> Any:
    from executor.service import Executor

    monkeypatch.setenv("DOCKER_HOST", guard.host)
    return Executor(make_settings(code_runtime="docker", code_image=image, **kw))


def test_a_job_runs_through_the_guard_cold_and_pooled(
    guard: Any,
    monkeypatch: pytest.MonkeyPatch,
    make_settings: Any,
    python_image: str,
    tmp_path: Path,
) -> None:
    from executor.models import CodeJob

    before = len(guard.refusals())
    cold = _executor(monkeypatch, guard, make_settings, python_image)
    assert cold.runtime.unavailable_reason(cold.language("python")) is None
    r = cold.run(CodeJob(code=TRIVIAL, state_json='{"n": 41}'))
    assert r.status == "succeeded" and r.output == 42, r.error
    cold.close()
    pooled = _executor(
        monkeypatch, guard, make_settings, python_image, code_languages="python", code_prewarm=1
    )
    pooled.prepare()
    try:
        assert pooled.runtime.pool is not None and pooled.runtime.pool.wait_ready(60)
        for n in range(3):
            r = pooled.run(CodeJob(code=TRIVIAL, state_json=json.dumps({"n": n})))
            assert r.status == "succeeded" and r.output == n + 1, r.error
        # a job that runs on past STUDIO_CODE_PREWARM_RENAME_AFTER_S: its sandbox takes its name
        slow = "import time\n\ndef main(state):\n    time.sleep(1.5)\n    return 1\n"
        r = pooled.run(CodeJob(code=slow, timeout_s=20))
        assert r.status == "succeeded" and r.output == 1, r.error
        stats = pooled.runtime.pool.stats()["languages"]["python"]
        assert stats["hits"] >= 1, stats
        # the reaper's list and removals pass too (on a shared engine it may find the dead
        # sandboxes of other sessions); this pool's idle sandboxes are not its to take
        assert pooled.runtime.pool.wait_ready(60)
        idle = {f"pool:{p.name}" for q in pooled.runtime.pool._idle.values() for p in q}
        assert idle and not idle & set(pooled.runtime.reap())
    finally:
        pooled.close()
    passed = guard.output()
    assert "passed POST" in passed and "/rename?name=studio-code-" in passed
    assert guard.refusals()[before:] == []


@pytest.mark.parametrize("nano_cpus", [1, 5_000_000, 9_999_999, 0])
def test_a_create_below_the_cpu_floor_or_without_a_cpu_limit_is_refused(
    guard: Any, api: Any, docker_client: Any, python_image: str, nano_cpus: int
) -> None:
    """NanoCpus below 10_000_000 (0.01 CPU: a quota the kernel refuses at the default
    period) or none (the SDK drops a 0: no CPU limit at all) is refused (issue 38)."""
    message = refused(
        guard, api, docker_client, sandbox_args(api, python_image, nano_cpus=nano_cpus)
    )
    assert "HostConfig.NanoCpus" in message and "at least 10000000" in message, message


def test_the_runtime_is_the_configured_oci_runtime_only(
    guard: Any, api: Any, tmp_path: Path, docker_client: Any, python_image: str
) -> None:
    """``HostConfig.Runtime``: none named when STUDIO_CODE_OCI_RUNTIME is unset (the engine's
    default); exactly its value when set (gVisor's runsc, crun...): any other is refused."""
    import docker

    for other in ("runc", "runsc", "io.containerd.runc.v2"):
        message = refused(guard, api, docker_client, sandbox_args(api, python_image, runtime=other))
        assert f"HostConfig.Runtime {other!r}" in message, message
        assert "STUDIO_CODE_OCI_RUNTIME" in message and "none named" in message, message
    with SockGuardProcess(tmp_path / "guard", {"STUDIO_CODE_OCI_RUNTIME": "runc"}) as runc:
        api_runc = docker.APIClient(base_url=runc.host, timeout=30)
        try:
            name = f"studio-code-guardtest-{uuid.uuid4().hex[:12]}"
            args = sandbox_args(api_runc, python_image, runtime="runc")
            cid = api_runc.create_container(name=name, **args)["Id"]
            try:
                assert docker_client.api.inspect_container(cid)["HostConfig"]["Runtime"] == "runc"
            finally:
                docker_client.api.remove_container(cid, force=True)
            for other in (None, "runsc", "io.containerd.runc.v2"):
                args = sandbox_args(api_runc, python_image, runtime=other)
                message = refused(runc, api_runc, docker_client, args)
                assert f"HostConfig.Runtime {str(other)!r}" in message, message
                assert "the configured OCI runtime 'runc'" in message, message
        finally:
            api_runc.close()


@pytest.mark.parametrize("prewarm", [0, 1], ids=["cold", "pooled"])
def test_a_runsc_sandbox_passes_a_guard_set_to_auto_and_its_code_meets_gvisor(
    prewarm: int,
    tmp_path: Path,
    docker_client: Any,
    python_image: str,
    make_settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """STUDIO_CODE_OCI_RUNTIME=auto on both sides of the guard: the guard resolves it as the
    workers do (runsc when the engine lists it) and lets exactly that runtime, with gVisor's
    seccomp variant, through; a node run through it reports gVisor's kernel from inside."""
    from executor.models import CodeJob
    from executor.service import Executor
    from testkit.gvisor import KERNEL_PROBE, RUNSC, assert_ran_under, require_runsc

    require_runsc(docker_client.api, RUNSC)
    with SockGuardProcess(tmp_path / "guard", {"STUDIO_CODE_OCI_RUNTIME": "auto"}) as g:
        monkeypatch.setenv("DOCKER_HOST", g.host)
        settings = make_settings(
            code_runtime="docker",
            code_image=python_image,
            code_languages="python",
            code_oci_runtime="auto",
            code_prewarm=prewarm,
        )
        executor = Executor(settings)
        try:
            result = executor.run(CodeJob(code=KERNEL_PROBE, timeout_s=30))
        finally:
            executor.close()
        assert result.status == "succeeded", (result.error, result.logs, g.refusals())
        assert_ran_under(RUNSC, result.output)
