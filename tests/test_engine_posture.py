"""The engine posture: the table of known container escapes (executor/runtimes/docker/escapes.py,
known_escapes.toml) against fake engine answers, and this machine's real engine read through
the Docker SDK, with what the sandboxes' kernel says from inside one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from executor.runtimes.docker import escapes
from executor.runtimes.docker.escapes import (
    dpkg_compare,
    is_package_version,
    load_table,
    parse_version,
)
from executor.runtimes.docker.posture import (
    WALL_GVISOR,
    WALL_HOST,
    posture_of,
    read_posture,
    sandbox_proof,
)
from testkit.processes import require

ROOT = Path(__file__).resolve().parent.parent
RUNC_2025 = {"CVE-2025-31133", "CVE-2025-52565", "CVE-2025-52881"}


# --- versions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.1.5", (1, 1, 5, 3, 0)),
        ("1.2.8", (1, 2, 8, 3, 0)),
        ("1.4.0-rc.3", (1, 4, 0, 2, 3)),
        ("v1.1.12-0-g51d5e94", (1, 1, 12, 3, 0)),
        ("1.1.5+ds1-1+deb12u1", (1, 1, 5, 3, 0)),
        ("1.6.20~ds1", (1, 6, 20, 3, 0)),
        ("1.0.0~rc93+ds1-5+deb11u2", (1, 0, 0, 2, 93)),
        ("1.0-rc6", (1, 0, 0, 2, 6)),
        ("20.10.24+dfsg1", (20, 10, 24, 3, 0)),
        ("not-a-version", None),
    ],
)
def test_upstream_versions_are_read(text: str, expected: tuple[int, ...] | None) -> None:
    assert parse_version(text) == expected


def test_a_release_candidate_comes_before_its_release() -> None:
    assert parse_version("1.4.0-rc.2") < parse_version("1.4.0-rc.3") < parse_version("1.4.0")  # type: ignore[operator]


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="dpkg compares Debian versions")
@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("1.1.5+ds1-1+deb12u1", "1.1.5+ds1-1"),
        ("1.1.5+ds1-1+deb12u1", "1.1.5+ds1-1+deb12u2"),
        ("1.6.20~ds1-1+deb12u3", "1.6.20~ds1-1+deb12u2"),
        ("1.6.20~ds1-1", "1.6.20-1"),
        ("20.10.24+dfsg1-1+deb12u1+b6", "20.10.24+dfsg1-1+deb12u1"),
        ("1:1.0-1", "2.0-1"),
        ("1.0.0~rc93+ds1-5", "1.0.0+ds1-1"),
        ("1.10-1", "1.9-1"),
        ("1.0a-1", "1.0-1"),
        ("1.0-1", "1.0-1"),
    ],
)
def test_debian_versions_compare_as_dpkg_does(a: str, b: str) -> None:
    def dpkg(op: str) -> bool:
        return subprocess.run(["dpkg", "--compare-versions", a, op, b], check=False).returncode == 0

    mine = dpkg_compare(a, b)
    assert (mine < 0, mine == 0, mine > 0) == (dpkg("lt"), dpkg("eq"), dpkg("gt")), (a, b, mine)


def test_package_versions_are_told_from_git_describe() -> None:
    assert is_package_version("1.1.5+ds1-1+deb12u1")
    assert is_package_version("1.6.20~ds1-1+deb12u3")
    assert not is_package_version("v1.1.12-0-g51d5e94")
    assert not is_package_version("1.1.12-0-g51d5e94")
    assert not is_package_version("ae07eda36dd25f8a1b98dfbf587313b99c0190bb")
    assert not is_package_version("1.1.12")


# --- the table --------------------------------------------------------------------------------


def test_the_table_holds_the_advisories_it_must() -> None:
    table = {a.cve: a for a in load_table()}
    for cve in RUNC_2025:
        assert table[cve].component == "runc"
        assert table[cve].fixed == ("1.2.8", "1.3.3", "1.4.0-rc.3")
    assert table["CVE-2024-21626"].fixed == ("1.1.12",)
    assert table["CVE-2024-41110"].component == "docker"
    assert table["CVE-2024-41110"].only_when == "authorization_plugin"
    for a in table.values():
        assert a.link.startswith("https://") and a.verified and a.summary


@pytest.mark.parametrize(
    ("version", "package", "affected"),
    [
        ("1.1.5", None, True),  # an older line: no fixed release was made for it
        ("1.2.7", None, True),
        ("1.2.8", None, False),
        ("1.3.2", None, True),
        ("1.3.3", None, False),
        ("1.4.0-rc.2", None, True),
        ("1.4.0-rc.3", None, False),
        ("1.4.0", None, False),
        ("1.5.1", None, False),  # a line newer than every listed one
        ("v1.2.8-0-g3f92552", None, False),
        ("garbage", None, True),  # what cannot be read is not believed fixed
    ],
)
def test_runc_2025_fixed_versions_per_release_line(
    version: str, package: str | None, affected: bool
) -> None:
    adv = next(a for a in load_table() if a.cve == "CVE-2025-31133")
    assert adv.affected(version, package) is affected


def test_a_distribution_backport_counts_only_for_its_own_upstream_version() -> None:
    adv = next(a for a in load_table() if a.cve == "CVE-2024-21626")
    assert adv.affected("1.1.5+ds1", "1.1.5+ds1-1") is True  # before Debian's security upload
    assert adv.affected("1.1.5+ds1", "1.1.5+ds1-1+deb12u1") is False
    assert adv.affected("1.1.5+ds1", "1.1.5+ds1-1+deb12u2") is False
    # a newer Debian revision of ANOTHER upstream version is not believed to carry it
    assert adv.affected("1.1.4+ds1", "1.1.4+ds1-9") is True
    assert adv.affected("1.1.12", None) is False


def test_a_malformed_entry_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text(
        '[[advisory]]\ncomponent = "crun"\ncve = "CVE-2025-1"\nghsa = "GHSA-9493-h29p-rfm2"\n'
        'fixed = ["x"]\nsummary = "s"\nlink = "https://x"\nverified = "v"\n'
    )
    with pytest.raises(ValueError, match="CVE-2025-1") as e:
        load_table(bad)
    assert "component 'crun'" in str(e.value) and "fixed ['x']" in str(e.value)


def test_the_command_line_answers_as_the_table_does() -> None:
    """scripts/host-setup.sh asks escapes.py with the system's python3 (-S: no site packages,
    no project installed): it must list exactly what the table says."""
    python3 = shutil.which("python3") or sys.executable
    for component, version, package in [
        ("runc", "1.1.5+ds1", "1.1.5+ds1-1+deb12u1"),
        ("runc", "1.1.5+ds1", "1.1.5+ds1-1"),
        ("runc", "1.3.3", None),
        ("containerd", "1.6.20~ds1", "1.6.20~ds1-1+deb12u3"),
        ("containerd", "1.6.20~ds1", "1.6.20~ds1-1"),
    ]:
        args = [component, version] + ([package] if package else [])
        out = subprocess.run(
            [python3, "-S", str(ROOT / "executor/runtimes/docker/escapes.py"), *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        listed = [line.split()[0] for line in out.splitlines()]
        assert listed == [a.cve for a in escapes.affecting(component, version, package)], args
    assert "CVE-2024-21626" in [
        a.cve for a in escapes.affecting("runc", "1.1.5+ds1", "1.1.5+ds1-1")
    ]


# --- fake engine answers ------------------------------------------------------------------------


def _version(runc: str, runc_commit: str, containerd: str = "1.7.27", docker: str = "27.5.1"):
    return {
        "Version": docker,
        "ApiVersion": "1.47",
        "Components": [
            {"Name": "Engine", "Version": docker, "Details": {"ApiVersion": "1.47"}},
            {"Name": "containerd", "Version": containerd, "Details": {"GitCommit": "ae07eda36"}},
            {"Name": "runc", "Version": runc, "Details": {"GitCommit": runc_commit}},
        ],
    }


def _info(**extra: object) -> dict[str, object]:
    info: dict[str, object] = {
        "ServerVersion": "27.5.1",
        "Runtimes": {"runc": {"path": "runc"}, "crun": {"path": "/usr/bin/crun"}},
        "DefaultRuntime": "runc",
        "CgroupVersion": "2",
        "CgroupDriver": "systemd",
        "SecurityOptions": ["name=seccomp,profile=builtin", "name=cgroupns"],
        "Plugins": {"Authorization": None},
    }
    info.update(extra)
    return info


def test_a_fixed_engine_is_not_vulnerable() -> None:
    p = posture_of(_version("1.2.8", "v1.2.8-0-g3f92552"), _info(), host_packages={})
    assert p.vulnerable is False and p.advisories == []
    assert (p.runc.version, p.runc.package) == ("1.2.8", None)  # type: ignore[union-attr]
    assert (p.cgroup_version, p.cgroup_driver, p.seccomp_default_profile) == (
        "2",
        "systemd",
        "builtin",
    )
    assert (p.userns_remap, p.rootless) == (False, False)
    assert p.warning() is None


def test_an_affected_runc_is_flagged_with_its_advisories() -> None:
    p = posture_of(
        _version("1.1.12", "v1.1.12-0-g51d5e94"),
        _info(SecurityOptions=["name=seccomp,profile=default", "name=userns", "name=rootless"]),
        host_packages={},
    )
    assert p.vulnerable is True
    assert {a.cve for a in p.advisories if a.applies} == RUNC_2025
    assert (p.userns_remap, p.rootless) == (True, True)
    warning = p.warning()
    assert warning is not None
    assert "runc 1.1.12 has CVE-2025-31133" in warning and "1.2.8 / 1.3.3 / 1.4.0-rc.3" in warning
    assert "download.docker.com" in warning and "backports" in warning
    assert p.compact()["advisories"] == sorted(RUNC_2025)


def test_debian_12_as_packaged() -> None:
    """Debian 12's engine, as it reports itself: the 2021/2024 fixes are backported (the
    package changelogs say so), the 2025 runc escapes are not."""
    version = _version("1.1.5+ds1", "1.1.5+ds1-1+deb12u1", "1.6.20~ds1", "20.10.24+dfsg1")
    version["Components"][1]["Details"]["GitCommit"] = "1.6.20~ds1-1+deb12u3"  # type: ignore[index]
    p = posture_of(
        version,
        _info(Plugins={"Authorization": ["authz-broker"]}),
        host_packages={"docker.io": "20.10.24+dfsg1-1+deb12u1+b6"},
    )
    assert p.runc.package == "1.1.5+ds1-1+deb12u1"  # type: ignore[union-attr]
    assert p.containerd.package == "1.6.20~ds1-1+deb12u3"  # type: ignore[union-attr]
    assert p.docker.package == "20.10.24+dfsg1-1+deb12u1+b6"
    assert {a.cve for a in p.advisories} == RUNC_2025  # CVE-2024-21626/-40635/-41110: patched
    # the same engine before Debian's docker.io security upload, with an AuthZ plugin
    p = posture_of(
        version,
        _info(Plugins={"Authorization": ["authz-broker"]}),
        host_packages={"docker.io": "20.10.24+dfsg1-1"},
    )
    assert "CVE-2024-41110" in {a.cve for a in p.advisories if a.applies}


def test_an_advisory_that_needs_a_feature_the_engine_lacks_does_not_apply() -> None:
    p = posture_of(_version("1.2.8", "v1.2.8-0-g3f92552", docker="26.1.4"), _info())
    authz = next(a for a in p.advisories if a.cve == "CVE-2024-41110")
    assert authz.applies is False and "authorization plugin" in (authz.note or "")
    assert p.vulnerable is False
    # runc advisories do not apply to sandboxes started with another OCI runtime
    p = posture_of(_version("1.1.12", "v1.1.12-0-g51d5e94"), _info(), oci_runtime="crun")
    assert p.oci_runtime == "crun" and p.oci_runtime_path == "/usr/bin/crun"
    assert p.advisories and not any(a.applies for a in p.advisories)


def test_a_runsc_sandbox_meets_gvisors_kernel_and_runcs_escapes_do_not_apply() -> None:
    """Debian 12's engine with gVisor registered as scripts/host-setup.sh does it: the
    sandboxes' runtime is named with its version, its platform and what it means, and
    runc's escapes are listed but do not apply (the sandboxes do not start with runc)."""
    version = _version("1.1.5+ds1", "1.1.5+ds1-1+deb12u1", "1.6.20~ds1", "20.10.24+dfsg1")
    version["Components"][1]["Details"]["GitCommit"] = "1.6.20~ds1-1+deb12u3"  # type: ignore[index]
    info = _info(
        Runtimes={
            "runc": {"path": "runc"},
            "runsc": {
                "path": "/usr/bin/runsc",
                "runtimeArgs": ["--platform=ptrace", "--network=none", "--oci-seccomp"],
            },
        }
    )
    host = {"runsc": "0.0~20221219.0-2+b3", "docker.io": "20.10.24+dfsg1-1+deb12u1+b6"}
    p = posture_of(version, info, oci_runtime="runsc", host_packages=host)
    assert (p.oci_runtime, p.oci_runtime_kernel, p.oci_runtime_platform) == (
        "runsc",
        "gvisor",
        "ptrace",
    )
    assert p.oci_runtime_version == "0.0~20221219.0-2+b3"
    assert p.wall == WALL_GVISOR and "not the host's" in p.wall
    line = p.runtime_line()
    assert line.startswith("sandboxes start with runsc 0.0~20221219.0-2+b3 (gVisor, platform")
    assert {a.cve for a in p.advisories} >= RUNC_2025
    assert not any(a.applies for a in p.advisories if a.component == "runc")
    assert p.vulnerable is False and p.warning() is None
    assert p.compact()["oci_runtime_kernel"] == "gvisor"
    # the same engine, sandboxes under its default runc: the host's kernel, the escapes apply
    p = posture_of(version, info, host_packages=host)
    assert (p.oci_runtime, p.oci_runtime_kernel, p.oci_runtime_platform) == ("runc", "host", None)
    assert p.oci_runtime_version == "1.1.5+ds1-1+deb12u1" and p.wall == WALL_HOST
    assert p.vulnerable is True
    # no --platform argument: runsc's own default, said so
    info["Runtimes"]["runsc"]["runtimeArgs"] = ["--network=none"]  # type: ignore[index]
    p = posture_of(version, info, oci_runtime="runsc", host_packages={})
    assert p.oci_runtime_platform == "default"


# --- this machine's engine ----------------------------------------------------------------------


@pytest.mark.docker
def test_this_machines_engine_as_reported(docker_client) -> None:  # type: ignore[no-untyped-def]
    posture = read_posture(docker_client.api)
    print("\nengine posture of this machine:\n" + posture.model_dump_json(indent=1))
    reported = docker_client.version()
    assert posture.docker.version == reported["Version"]
    assert posture.api_version == reported["ApiVersion"]
    info = docker_client.info()
    assert posture.cgroup_version == str(info.get("CgroupVersion"))
    assert posture.default_runtime == info["DefaultRuntime"]
    assert posture.seccomp == any("seccomp" in o for o in info["SecurityOptions"])
    runc = next(c for c in reported["Components"] if c["Name"] == "runc")
    assert posture.runc is not None and posture.runc.version == runc["Version"]
    if shutil.which("runc"):
        # the runc binary on this host says the same (the engine runs this one)
        first = subprocess.run(["runc", "--version"], capture_output=True, text=True).stdout
        assert first.splitlines()[0] == f"runc version {posture.runc.version}"
    flagged = {a.cve for a in posture.advisories if a.component == "runc" and a.applies}
    runc_v = parse_version(posture.runc.version)
    assert runc_v is not None
    older = runc_v < parse_version("1.2.8")  # type: ignore[operator]
    assert (flagged >= RUNC_2025) is older, (posture.runc, flagged)
    assert posture.vulnerable is bool([a for a in posture.advisories if a.applies]), (
        posture.advisories
    )


@pytest.mark.docker
@pytest.mark.parametrize("oci", ["", "runsc"], ids=["runc", "runsc"])
def test_the_sandboxes_kernel_applies_no_new_privileges_and_seccomp(  # type: ignore[no-untyped-def]
    oci, make_settings, python_image, docker_client
) -> None:
    """What the posture's policy promises, from inside a sandbox: NoNewPrivs 1, Seccomp 2
    (a filter), no effective capabilities, not root; under runc and gVisor alike (the probe
    asks prctl: gVisor's /proc/self/status has no NoNewPrivs line)."""
    from executor.service import Executor
    from testkit.gvisor import require_runsc

    require_runsc(docker_client.api, oci)
    docker_executor = Executor(
        make_settings(code_runtime="docker", code_image=python_image, code_oci_runtime=oci)
    )
    proof = sandbox_proof(docker_executor.run)
    print("\nfrom inside a sandbox:", json.dumps(proof))
    assert proof == {
        "no_new_privs": True,
        "seccomp_filter": True,
        "cap_eff": "0000000000000000",
        "uid": proof["uid"],
    }
    assert proof["uid"] not in (None, "0")


@pytest.mark.docker
def test_a_refusing_setting_makes_a_vulnerable_engine_not_ready(make_settings, python_image):  # type: ignore[no-untyped-def]
    from executor.service import Executor

    executor = Executor(
        make_settings(
            code_runtime="docker", code_image=python_image, code_engine_refuse_vulnerable=True
        )
    )
    posture = executor.runtime.engine_posture()  # type: ignore[union-attr]
    require(posture is not None, "the engine's posture cannot be read")
    ready = executor.readiness(executor.language("python"), fresh=True)
    if posture.vulnerable:  # type: ignore[union-attr]
        assert ready.ready is False
        assert "STUDIO_CODE_ENGINE_REFUSE_VULNERABLE" in (ready.reason or "")
        for a in posture.advisories:  # type: ignore[union-attr]
            if a.applies:
                assert a.cve in (ready.reason or "")
    else:
        assert ready.ready is True, ready.reason


@pytest.mark.docker
def test_a_refusing_setting_does_not_refuse_a_runsc_sandbox_for_runcs_escapes(  # type: ignore[no-untyped-def]
    make_settings, python_image, docker_client
):
    """STUDIO_CODE_ENGINE_REFUSE_VULNERABLE=1 on this engine: runc's escapes refuse a runc
    sandbox, not one gVisor starts (auto picks runsc here); the runsc one runs, and its code
    reports gVisor's kernel."""
    from executor.models import CodeJob
    from executor.service import Executor
    from testkit.gvisor import KERNEL_PROBE, RUNSC, assert_ran_under, require_runsc

    require_runsc(docker_client.api, RUNSC)

    def executor(oci: str) -> Executor:
        return Executor(
            make_settings(
                code_runtime="docker",
                code_image=python_image,
                code_engine_refuse_vulnerable=True,
                code_oci_runtime=oci,
            )
        )

    under_runc = executor("")
    runc_posture = under_runc.runtime.engine_posture()  # type: ignore[union-attr]
    require(runc_posture is not None, "the engine's posture cannot be read")
    auto = executor("auto")
    posture = auto.runtime.engine_posture()  # type: ignore[union-attr]
    assert posture is not None and posture.oci_runtime == RUNSC
    assert posture.oci_runtime_kernel == "gvisor" and not posture.vulnerable, posture.advisories
    assert auto.readiness(auto.language("python"), fresh=True).ready is True
    result = auto.run(CodeJob(code=KERNEL_PROBE, timeout_s=20))
    assert result.status == "succeeded", result.error
    assert_ran_under(RUNSC, result.output)  # type: ignore[arg-type]
    # the control: the same engine under runc is refused when its runc has them
    ready = under_runc.readiness(under_runc.language("python"), fresh=True)
    assert ready.ready is (not runc_posture.vulnerable), ready.reason  # type: ignore[union-attr]


@pytest.mark.docker
def test_a_refusing_worker_pre_starts_no_sandbox_on_a_vulnerable_engine(  # type: ignore[no-untyped-def]
    make_settings, python_image, docker_client
):
    """The refusal holds before any job too: a pool on an engine the runs refuse starts no
    sandbox (the same pool with the setting off does, on the same engine)."""
    import time

    from executor.runtimes.base import owner_id
    from executor.service import Executor

    def pooled(refuse: bool):  # type: ignore[no-untyped-def]
        return Executor(
            make_settings(
                code_runtime="docker",
                code_image=python_image,
                code_languages="python",
                code_prewarm=1,
                code_engine_refuse_vulnerable=refuse,
            )
        )

    def ours() -> list[object]:
        return docker_client.containers.list(
            all=True, filters={"label": f"studio.pool={owner_id()}"}
        )

    refusing = pooled(True)
    posture = refusing.runtime.engine_posture()  # type: ignore[union-attr]
    require(posture is not None, "the engine's posture cannot be read")
    refusing.prepare()
    try:
        pool = refusing.runtime.pool  # type: ignore[union-attr]
        assert pool is not None
        if posture.vulnerable:  # type: ignore[union-attr]
            time.sleep(3)  # the pool's first starts (and back-off) are made by now
            assert not pool.wait_ready(0.1) and not ours(), ours()
        else:
            assert pool.wait_ready(60)
    finally:
        refusing.close()
    allowing = pooled(False)  # the control: the same engine, the setting off
    allowing.prepare()
    try:
        assert allowing.runtime.pool.wait_ready(60) and ours()  # type: ignore[union-attr]
    finally:
        allowing.close()


# --- the heartbeat carries it -------------------------------------------------------------------


@pytest.mark.redis
def test_the_heartbeat_carries_the_engine_through_redis(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A worker's engine goes through Redis's Lua (cjson) and back unchanged, an empty list
    of advisories included (cjson writes [] back as {})."""
    from worker.registry import WorkerRegistry
    from worker.upkeep.heartbeat import Heartbeat

    fixed = posture_of(_version("1.2.8", "v1.2.8-0-g3f92552"), _info(), host_packages={})
    engine: list[dict[str, object] | None] = [fixed.compact()]

    def announce() -> dict[str, object] | None:
        if engine[0] is None:
            raise ConnectionError("the engine does not answer")
        return engine[0]

    beat = Heartbeat(
        redis_server.url, "engine@test", {"code.run": 1}, interval_s=60, ttl_s=60, engine=announce
    )
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_server.url)
    try:
        registry = WorkerRegistry(client)
        beat.beat()
        (info,) = registry.live(["code.run"])["code.run"]
        assert info.engine == {**fixed.compact(), "advisories": []}
        engine[0] = None  # an engine that fails to answer: announced without it, still serving
        assert beat.beat() == "serving"
        (info,) = registry.live(["code.run"])["code.run"]
        assert info.engine is None
    finally:
        beat.stop()
        client.close()


def test_a_worker_says_at_start_up_which_runtime_starts_its_sandboxes(caplog) -> None:  # type: ignore[no-untyped-def]
    """The start-up line names the runtime, its version, the platform and what it means;
    logged once, and again when the engine's runtime changes."""
    import logging

    from worker.upkeep.engine_watch import EngineWatch

    version = _version("1.2.8", "v1.2.8-0-g3f92552")
    runsc = {"path": "/usr/bin/runsc", "runtimeArgs": ["--platform=ptrace", "--network=none"]}
    info = _info(Runtimes={"runc": {"path": "runc"}, "runsc": runsc})
    seen = [posture_of(version, info, oci_runtime="runsc", host_packages={"runsc": "20221219"})]

    class Runtime:
        def engine_posture(self, *, fresh: bool = False):  # type: ignore[no-untyped-def]
            return seen[0]

    watch = EngineWatch(Runtime())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="studio_code"):
        watch.posture()
        watch.posture()  # unchanged: not again
        seen[0] = posture_of(version, info, host_packages={})  # back to runc
        watch.posture()
    lines = [r.getMessage() for r in caplog.records if "sandboxes start with" in r.getMessage()]
    assert lines == [
        "sandboxes start with runsc 20221219 (gVisor, platform ptrace): " + WALL_GVISOR,
        "sandboxes start with runc 1.2.8: " + WALL_HOST,
    ]
