"""The services a test or a bench starts end with its process, however it ends
(testkit/reaper.py): a process that started, through the test kit, a redis-server, a
Sentinel deployment, a PostgreSQL cluster, a relay and a dockerd of its own leaves none of
them running once it is SIGTERMed (its handler raises, its ``with`` blocks stop them in
order) or SIGKILLed (its reaper stops them by pid). Every process is checked by pid and
start time, from /proc."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import ROOT, require, wait_for
from testkit.reaper import process_tree, started

pytestmark = [
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.docker,
    pytest.mark.timeout(600),
]

#: the process under test: starts the services, says which they are, then sleeps in its
#: ``with`` block until it is signalled
HOLDER = r"""
import json, shutil, sys, time
from contextlib import ExitStack
from pathlib import Path

from testkit.engine import SecondEngine
from testkit.postgres import start_pg_cluster
from testkit.reaper import stop_on_sigterm
from testkit.redis import start_redis
from testkit.relay import Relay
from testkit.sentinel import start_sentinels

stop_on_sigterm()
work = Path(sys.argv[1])
with ExitStack() as stack:
    redis = stack.enter_context(start_redis(work))
    relay = stack.enter_context(Relay(redis.port))
    pg = stack.enter_context(start_pg_cluster())
    (work / "sentinels").mkdir()
    sentinels = stack.enter_context(start_sentinels(work / "sentinels"))
    engine = SecondEngine()

    def remove_engine():  # never through a live mount
        mounts = [ln.split()[1] for ln in open("/proc/mounts").read().splitlines()]
        if not any(m.startswith(str(engine.root)) for m in mounts):
            shutil.rmtree(engine.root, ignore_errors=True)

    stack.callback(remove_engine)
    stack.callback(engine.stop)
    engine.start()
    print(json.dumps({
        "redis": redis.proc.pid,
        "sentinels": [p.pid for p in sentinels.procs.values()],
        "postmaster": pg.postmaster,
        "pg_dir": str(pg.dir),
        "dockerd": engine.proc.pid,
        "engine_root": str(engine.root),
        "relay_port": relay.port,
    }), flush=True)
    time.sleep(600)
"""


def _identified(pids: list[int]) -> dict[int, int]:
    """``pids`` -> their start times (those still running)."""
    return {p: s for p in pids if (s := started(p)) is not None}


def _running(procs: dict[int, int]) -> dict[int, str]:
    """Those of ``procs`` (pid -> start time) still running -> their command."""
    out = {}
    for pid, start in procs.items():
        if started(pid) == start:
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                out[pid] = "?"
    return out


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


@pytest.fixture
def holder(tmp_path: Path) -> Any:
    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    require(shutil.which("dockerd") is not None and os.getuid() == 0, "dockerd as root")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        pytest.fail(f"the holder ended before its services ran:\n{proc.stderr.read()[-4000:]}")
    seen = json.loads(line)
    # every service's process and its tree: the holder's descendants (the redis-servers,
    # dockerd and its containerd, the reaper) and the postmaster's (pg_ctl daemonized it)
    tree = [p for p in process_tree(proc.pid) if p != proc.pid]
    procs = _identified(tree + process_tree(seen["postmaster"]))
    for pid in [seen["redis"], seen["postmaster"], seen["dockerd"], *seen["sentinels"]]:
        assert pid in procs, (pid, procs)
    assert len(procs) >= 1 + 5 + 2 + 2  # redis, the Sentinel set, postmaster+, dockerd+
    yield proc, seen, procs
    if proc.poll() is None:  # the test failed before its signal
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    # what a stop by the reaper leaves: the folders (removed once the services are gone)
    wait_for(lambda: not _running(procs), 120, "every service gone", 0.2, lambda: _running(procs))
    shutil.rmtree(seen["pg_dir"], ignore_errors=True)
    root = Path(seen["engine_root"])
    mounts = [ln.split()[1] for ln in Path("/proc/mounts").read_text().splitlines()]
    if root.exists() and not any(m.startswith(str(root)) for m in mounts):
        shutil.rmtree(root, ignore_errors=True)


def test_a_sigtermed_process_stops_its_services_on_its_way_out(holder: Any) -> None:
    """SIGTERM raises in the holder: its ``with`` blocks stop every service before it exits
    (its exit status is SystemExit's 143, not death by the signal), the cluster's folder is
    removed (its cleanup ran), and nothing of them is left for its reaper."""
    proc, seen, procs = holder
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(180)
    assert code == 128 + signal.SIGTERM, (code, proc.stderr.read()[-4000:])
    assert not Path(seen["pg_dir"]).exists(), "the PostgreSQL cluster's cleanup did not run"
    assert not Path(seen["engine_root"]).exists(), "the engine's folder was not removed"
    wait_for(lambda: not _running(procs), 120, "every service gone", 0.2, lambda: _running(procs))
    assert _refused(seen["relay_port"])


def test_a_sigkilled_process_leaves_no_service_running(holder: Any) -> None:
    """SIGKILL: nothing of the holder runs; its reaper (its pipe's end is the holder's end)
    stops every service by pid: the redis-servers, the sentinels, the postmaster and its
    backends, dockerd and its containerd; then it removes the cluster's and the engine's
    folders."""
    proc, seen, procs = holder
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    wait_for(lambda: not _running(procs), 180, "every service gone", 0.2, lambda: _running(procs))
    assert _refused(seen["relay_port"])  # a thread of the holder: gone with it
    folders = [Path(seen["pg_dir"]), Path(seen["engine_root"])]
    wait_for(lambda: not any(f.exists() for f in folders), 30, "their folders removed")


# --- a pytest run -----------------------------------------------------------------------------

#: a test of a pytest run under test (tests/conftest.py as a plugin): its redis-server's pid
#: in a file, then a long sleep; a fixture of its own says when its teardown ran
HELD_RUN = """
import os, time
from pathlib import Path

import pytest

OUT = Path(os.environ["HELD_OUT"])


@pytest.fixture
def marks_its_teardown():
    yield
    (OUT / "torn-down").write_text("yes")


def test_holds_a_redis_server(marks_its_teardown, redis_server):
    (OUT / "redis.pid").write_text(str(redis_server.proc.pid))
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_signalled_pytest_run_leaves_no_service_running(tmp_path: Path, sig: int) -> None:
    """SIGTERM: the run stops as on Ctrl-C (exit status 2, interrupted), its fixtures' teardowns
    run (the redis_server fixture's stop); SIGKILL: no teardown runs, the run's reaper stops
    the redis-server."""
    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    (tmp_path / "test_held.py").write_text(HELD_RUN)
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
        + ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-q"]
        + ["--basetemp", str(tmp_path / "base"), str(tmp_path / "test_held.py")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HELD_OUT": str(out), "CI": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        pid_file = out / "redis.pid"
        wait_for(
            lambda: (pid_file.exists() and pid_file.read_text()) or run.poll() is not None,
            120,
            "the held test",
        )
        assert run.poll() is None, run.communicate()[0][-4000:]
        redis = int(pid_file.read_text())
        procs = _identified([redis])
        assert procs, "its redis-server is not running"
        run.send_signal(sig)
        output = run.communicate(timeout=120)[0]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(30)
    if sig == signal.SIGTERM:
        assert run.returncode == pytest.ExitCode.INTERRUPTED, output[-4000:]
        assert (out / "torn-down").exists(), output[-4000:]
        assert not _running(procs), "the redis_server fixture's teardown did not stop it"
    else:
        assert run.returncode == -signal.SIGKILL
        assert not (out / "torn-down").exists()
        wait_for(lambda: not _running(procs), 120, "the redis-server gone", 0.2)
