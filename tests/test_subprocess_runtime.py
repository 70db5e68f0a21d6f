"""The subprocess runtime: what its limits do, asserted from inside the child, and every
place the specification says this mode must be visible."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest

from executor.audit import SUBPROCESS_RUNTIME_USED
from executor.models import CodeJob, Status
from executor.service import Executor
from tests.conftest import FORK_BOMB, prewarm_both_ways

#: every test here that builds its runtime with make_subprocess_executor runs twice: cold
#: runners, and runners pre-started ahead of the job (STUDIO_CODE_PREWARM)
subprocess_prewarm = prewarm_both_ways

PROBE = r"""
import os, resource

def main(state):
    names = ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_FSIZE",
             "RLIMIT_CORE"]
    return {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "cwd_listing": os.listdir("."),
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "own_session": os.getsid(0) == os.getpid(),
        "limits": {n: list(resource.getrlimit(getattr(resource, n))) for n in names},
        "cpu_used_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
    }
"""


def run(executor, code, state="{}", timeout_s=20):
    return executor.run(CodeJob(code=code, state_json=state, timeout_s=timeout_s))


@pytest.fixture
def seen(subprocess_executor, monkeypatch):
    monkeypatch.setenv("STUDIO_FAKE_SECRET", "hunter2")
    r = run(subprocess_executor, PROBE)
    assert r.status is Status.SUCCEEDED, r
    return r.output


def test_the_environment_is_empty(seen):
    # Python's own PEP 538 locale coercion may add LC_CTYPE; nothing comes from the server.
    assert set(seen["env"]) <= {"LC_CTYPE"}
    assert "hunter2" not in json.dumps(seen["env"])


def test_the_child_has_its_own_temporary_folder_removed_afterwards(seen):
    cwd = Path(seen["cwd"])
    assert cwd.name.startswith("studio-code-")
    assert seen["cwd_listing"] == []
    assert not cwd.exists()


def test_the_child_runs_in_its_own_session(seen):
    assert seen["own_session"] is True


def test_a_root_server_drops_the_child_to_a_uid_of_its_own(seen, subprocess_executor):
    if os.getuid() == 0:
        # never nobody (the Docker sandboxes' uid): one of STUDIO_CODE_SUBPROCESS_UIDS
        assert seen["uid"] in subprocess_executor.settings.subprocess_uids
        assert seen["uid"] != 65534 and seen["gid"] == seen["uid"]
        assert set(seen["groups"]) <= {seen["gid"]}
    else:
        assert seen["uid"] == os.getuid()


def test_rlimits_on_memory_cpu_files_and_processes(seen, subprocess_executor):
    s = subprocess_executor.settings
    lim = seen["limits"]
    assert lim["RLIMIT_AS"] == [s.memory_bytes, s.memory_bytes]
    assert lim["RLIMIT_NPROC"] == [s.code_pids, s.code_pids]
    assert lim["RLIMIT_NOFILE"] == [256, 256]
    assert lim["RLIMIT_CORE"] == [0, 0]
    # the probe's timeout + 1 (wall clock stops it first), counted from the hand-out: a
    # pre-started runner's limit adds the CPU it used before (rounded up to whole seconds)
    cpu = lim["RLIMIT_CPU"]
    if subprocess_executor.runtime.pool is None:
        assert cpu == [20 + 1, 20 + 2]
    else:
        assert 21 <= cpu[0] <= 21 + math.ceil(seen["cpu_used_s"]) and cpu[1] == cpu[0] + 1


def test_memory_above_the_limit_ends_code_memory(make_subprocess_executor):
    ex = make_subprocess_executor(code_memory="128m")
    r = run(ex, "def main(state):\n    return len(bytearray(512 * 1024 * 1024))\n")
    assert r.status is Status.FAILED and r.error.code == "CODE_MEMORY"


@pytest.mark.skipif(os.getuid() != 0, reason="the nproc limit holds only for a dropped uid")
def test_fork_bomb_stops_at_the_nproc_limit_of_the_dropped_user(make_subprocess_executor):
    # Runs ONLY as nobody under RLIMIT_NPROC=16, never as root on the host.
    ex = make_subprocess_executor(code_pids=16)
    r = run(ex, FORK_BOMB)
    assert r.status is Status.SUCCEEDED, r
    assert r.output["error"] == "Resource temporarily unavailable"
    assert r.output["forked"] < 16


def test_timeout_kills_the_whole_process_group(subprocess_executor):
    code = (
        "import subprocess, sys\n"
        "def main(state):\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    print('grandchild', p.pid, flush=True)\n"
        "    while True:\n"
        "        pass\n"
    )
    t0 = time.monotonic()
    r = run(subprocess_executor, code, timeout_s=2)
    assert time.monotonic() - t0 < 3
    assert r.status is Status.TIMED_OUT and r.error.code == "CODE_TIMEOUT", r.error
    grandchild = int(r.logs.split("grandchild ")[1].split()[0])
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(") ")[1][0] != "Z"


def test_every_place_says_it_runs_on_the_host(make_settings, caplog):
    from executor.audit import LogAuditSink
    from executor.meta import runtime_meta

    sink = LogAuditSink()
    with caplog.at_level(logging.WARNING, logger="studio_code"):
        ex = Executor(make_settings(code_runtime="subprocess", code_languages="python"), audit=sink)
    assert any(
        "NOT in a sandbox" in r.getMessage() for r in caplog.records if r.name == "studio_code"
    )  # the start-up WARNING
    first = run(ex, "def main(state):\n    return 1\n")
    second = run(ex, "def main(state):\n    return 2\n")
    for r in (first, second):
        assert r.code_runtime == "subprocess" and r.runtime == "subprocess"
        assert {row.runtime for row in r.trace} == {"subprocess"}
        assert len(r.warnings) == 1 and "Runs on host" in r.warnings[0]
    # one audit entry on the first call after each start, not per call
    audits = [r.getMessage() for r in caplog.records if r.name == "studio_code.audit"]
    assert len(audits) == 1 and audits[0].startswith(f"audit {SUBPROCESS_RUNTIME_USED} ")
    meta = runtime_meta(ex)
    assert meta["code_runtime"] == "subprocess" and meta["isolated"] is False
    assert meta["warnings"] and "NOT in a sandbox" in meta["warnings"][0]


def test_it_never_takes_over_by_itself(make_settings, monkeypatch):
    # Default docker runtime with no reachable Docker: Code nodes fail validation.
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    ex = Executor(make_settings())
    assert ex.settings.code_runtime == "docker"
    from executor.errors import RuntimeUnavailable

    with pytest.raises(RuntimeUnavailable, match="Docker is not reachable"):
        ex.validate_node("python")
    r = run(ex, "def main(state):\n    return 1\n")
    assert r.status is Status.FAILED and r.error.code == "RUNTIME_UNAVAILABLE"
    assert r.runtime == "docker"


def test_a_kernel_that_refuses_user_namespaces_is_named_and_meta_says_what_still_holds(
    make_settings, tmp_path, monkeypatch
):
    # The refusing kernel is faked (a knob file of tmp_path): this host allows them, and
    # its real knobs are the machine's. tests/test_subprocess_isolation.py runs both real
    # cases (namespaces, and none with STUDIO_CODE_SUBPROCESS_NAMESPACES=off) from inside.
    from executor.runtimes.subprocess import namespaces, runtime

    knob = tmp_path / "user" / "max_user_namespaces"
    knob.parent.mkdir()
    knob.write_text("0\n")
    monkeypatch.setattr(namespaces, "KNOBS", {str(knob): "0"})
    reason = namespaces.probe()
    assert reason is not None and "user.max_user_namespaces=0" in reason, reason
    monkeypatch.setattr(runtime.os, "getuid", lambda: 300123)  # the report of a non-root server
    report = runtime.isolation_report(
        make_settings(code_runtime="subprocess"),
        None,
        None,
        "off",
        namespaces_note=reason,
        undumpable=True,
    )
    held, lacks = " ".join(report["holds"]), " ".join(report["does_not_hold"])
    assert report["namespaces"] is False and report["namespaces_reason"] == reason
    assert "not dumpable" in held and "/proc/<server>/environ" in held  # still closed
    assert "namespace of its own" not in held
    assert reason in lacks and "signal the server" in lacks
    assert "see every process of the host" in lacks
    assert "survives the end of the run" in lacks


def test_the_folders_each_run_gets_covered_are_the_servers_own(
    make_settings, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """What ``fence`` covers in each run: the data folder, a SQLite store's folder elsewhere,
    the server's home and the token file's folder, by their real paths; never a system
    folder (a data folder in /tmp is not covered), and no folder that does not exist."""
    from executor.runtimes.subprocess import fence

    data, store, home, secrets = (tmp_path / n for n in ("data", "store", "home", "secrets"))
    for d in (data, store, home, secrets):
        d.mkdir()
    (secrets / "token").write_text("t" * 48)
    (tmp_path / "link").symlink_to(home)
    monkeypatch.setenv("HOME", str(tmp_path / "link"))
    settings = make_settings(
        data_dir=data,
        database_url=f"sqlite:///{store}/runs.db",
        api_token_file=str(secrets / "token"),
    )
    folders = fence.server_folders(settings)
    assert {k: v for k, v in folders.items() if v.startswith(str(tmp_path))} == {
        "the data folder": str(data),
        "the run store's folder": str(store),
        "the server's home": str(home),  # resolved
        "the token file's folder": str(secrets),
    }
    elsewhere = make_settings(data_dir="/tmp", database_url="postgresql://u@localhost/db")
    covered = fence.server_folders(elsewhere).values()
    assert "/tmp" not in covered and not any(p.startswith(str(tmp_path / "store")) for p in covered)


@pytest.mark.skipif(os.geteuid() != 0, reason="files of another uid need a root server")
def test_the_sweep_of_a_uids_files_skips_an_entry_gone_since_the_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared /tmp changes all along: an entry of another process removed between the
    sweep's listing and its look at it is skipped, and the run's own files beside it are
    still removed (the whole folder was left, its leftovers for the next run of the uid)."""
    from executor.runtimes.subprocess import uids

    uid = 299_999
    for name in ("a", "b", "c"):
        (tmp_path / name).write_text("left by the run")
        os.chown(tmp_path / name, uid, uid)
    (tmp_path / "vanishing").write_text("another process's")
    real_scandir = os.scandir

    class Vanishing:
        """An entry whose file went away after the listing (its stat fails)."""

        def __init__(self, entry: os.DirEntry[str]) -> None:
            self.entry, self.name = entry, entry.name

        def stat(self, follow_symlinks: bool = True) -> os.stat_result:
            if self.name == "vanishing":
                raise FileNotFoundError(self.name)
            return self.entry.stat(follow_symlinks=follow_symlinks)

    class Listing:
        def __init__(self, fd: int) -> None:
            self.it = real_scandir(fd)

        def __enter__(self) -> Listing:
            return self

        def __exit__(self, *exc: object) -> None:
            self.it.close()

        def __iter__(self):  # type: ignore[no-untyped-def]
            return (Vanishing(e) for e in self.it)

    monkeypatch.setattr(uids.os, "scandir", Listing)
    assert uids.remove_owned_files(uid, [str(tmp_path)]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vanishing"]
