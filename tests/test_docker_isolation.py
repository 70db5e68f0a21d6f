"""Every isolation control and limit of the docker runtime, asserted FROM INSIDE the sandbox:
the test's code runs in the container and reports what it sees. Every test runs twice: in a
container started for the job (cold) and in a pre-started one taken from the pool (pool):
the same results from inside. A third form runs them in pre-started sandboxes under gVisor's
runsc (pool-runsc: the form a worker with STUDIO_CODE_OCI_RUNTIME=auto uses on a host set up
by scripts/host-setup.sh); every job's code reports the kernel it met, and ``run`` checks it
is the one of the runtime the test names (testkit/gvisor.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import pytest

from executor.models import CodeJob, Status
from testkit.gvisor import RUNC, RUNSC, assert_ran_under, require_runsc
from tests.conftest import FORK_BOMB
from tests.snippets import READ_FIRST

pytestmark = pytest.mark.docker

PROBE = r"""
import ctypes, os, socket

def main(state):
    # prctl, not /proc/self/status's NoNewPrivs line (gVisor's /proc has none)
    no_new_privs = ctypes.CDLL(None).prctl(39, 0, 0, 0, 0)  # PR_GET_NO_NEW_PRIVS
    status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines()
                  if ":\t" in l)
    mounts = [l.split()[:4] for l in open("/proc/self/mounts")]
    writable = {}
    for d in ["/", "/tmp", "/dev", "/dev/shm", "/dev/mqueue", "/etc", "/var/tmp", "/run",
              "/home", "/root"]:
        try:
            with open(os.path.join(d, ".probe"), "w") as f:
                f.write("x")
            writable[d] = True
        except OSError:
            writable[d] = False
    st = os.statvfs("/tmp")
    return {
        # /proc/net/dev, not if_nameindex(): that opens an AF_NETLINK socket, which the
        # sandbox's seccomp profile refuses
        "ifaces": sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]),
        "uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(),
        "groups": os.getgroups(),
        "CapEff": status["CapEff"].strip(), "CapPrm": status["CapPrm"].strip(),
        "CapBnd": status["CapBnd"].strip(), "NoNewPrivs": str(no_new_privs),
        "mounts": mounts,
        "writable": writable,
        "tmp_bytes": st.f_blocks * st.f_frsize,
        "env": dict(os.environ),
        "stdin_is_empty": os.read(0, 1) == b"",
    }
"""


#: the first line of every job's code here: the kernel it meets, on stderr (the logs)
KERNEL_LINE = (
    "import os as _os, sys as _sys; print('studio-kernel', _os.uname().release, file=_sys.stderr)\n"
)


def oci_of(executor) -> str:
    return executor.settings.code_oci_runtime or RUNC


def check_kernel(executor, result) -> None:
    """The job's code ran under the runtime the test names (its KERNEL_LINE's report)."""
    found = re.search(r"studio-kernel (\S+)", result.logs)
    assert found is not None, f"the code did not report its kernel: {result.logs[:300]!r}"
    assert_ran_under(oci_of(executor), {"release": found.group(1)})


def run(executor, code: str, state: object = None, timeout_s: float | None = None, **kw):
    job = CodeJob(
        code=KERNEL_LINE + code,
        state_json=json.dumps(state if state is not None else {}),
        timeout_s=timeout_s,
        **kw,
    )
    result = executor.run(job)
    # The sandbox really was of the kind under test (a silent pool miss proves nothing).
    expected = "pool" if executor.runtime.pool is not None else "cold"
    assert [r.detail for r in result.trace if r.step == "sandbox.start"] == [expected], result
    check_kernel(executor, result)
    return result


@pytest.fixture(params=["cold", "pool", "pool-runsc"])
def sandbox_mode(request) -> str:
    return request.param


@pytest.fixture
def make_executor(make_settings, python_image, sandbox_mode, docker_client):
    """Executor(settings); in pool mode its pool of pre-started sandboxes is filled first
    (and its idle containers removed at the end); pool-runsc: the pool's under runsc."""
    from executor.service import Executor

    oci = RUNSC if sandbox_mode.endswith("-runsc") else ""
    require_runsc(docker_client.api, oci)
    made = []

    def make(**overrides):
        settings = make_settings(
            code_runtime="docker",
            code_image=python_image,
            code_languages="python",
            code_oci_runtime=oci,
            **overrides,
        )
        ex = Executor(settings)
        if sandbox_mode.startswith("pool"):
            ex.prepare()
            assert ex.runtime.pool is not None and ex.runtime.pool.wait_ready(60)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


@pytest.fixture
def docker_executor(make_executor):
    return make_executor()


@pytest.fixture
def seen(docker_executor, monkeypatch):
    # A server secret in the process that starts the sandbox must never reach it.
    monkeypatch.setenv("STUDIO_FAKE_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "also-secret")
    result = run(docker_executor, PROBE)
    assert result.status is Status.SUCCEEDED, result
    return result.output


def test_no_network_interface_but_loopback(seen):
    assert seen["ifaces"] == ["lo"]


def test_root_is_read_only_and_tmp_is_the_only_writable_place(seen):
    root = next(m for m in seen["mounts"] if m[1] == "/")
    assert root[3].split(",")[0] == "ro"
    assert {d for d, ok in seen["writable"].items() if ok} == {"/tmp"}


def test_tmp_is_a_64mb_tmpfs(seen, docker_executor):
    tmp = next(m for m in seen["mounts"] if m[1] == "/tmp")
    assert tmp[2] == "tmpfs"
    # each kernel writes the size its own way (the host's 65536k, gVisor's as it was given)
    size = "size=64m" if oci_of(docker_executor) == RUNSC else "size=65536k"
    assert size in tmp[3].split(",") and "noexec" in tmp[3]
    assert seen["tmp_bytes"] == 64 * 1024 * 1024


def test_no_host_mounts(seen, docker_executor):
    # Docker itself mounts proc, sys, dev, cgroups and the container's own /etc/hostname;
    # anything else backed by a real filesystem would be a host mount. Under gVisor the root
    # and /etc/hostname are served by its gofer (9p): the same two, read-only.
    virtual = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "overlay"}
    real = [m for m in seen["mounts"] if m[2] not in virtual]
    if oci_of(docker_executor) == RUNSC:
        assert [(m[1], m[2]) for m in real] == [("/", "9p"), ("/etc/hostname", "9p")], real
    else:
        assert [m[1] for m in real] == ["/etc/hostname"]
    assert all(m[3].startswith("ro") for m in real)
    assert "/dev/shm" not in {m[1] for m in seen["mounts"]}


def test_no_capabilities_and_no_new_privileges(seen):
    assert seen["CapEff"] == "0000000000000000"
    assert seen["CapPrm"] == "0000000000000000"
    assert seen["CapBnd"] == "0000000000000000"
    assert seen["NoNewPrivs"] == "1"


def test_runs_as_the_servers_uid_or_nobody_never_root(seen):
    expected = (65534, 65534) if os.getuid() == 0 else (os.getuid(), os.getgid())
    assert (seen["uid"], seen["gid"]) == expected
    assert seen["euid"] != 0
    assert set(seen["groups"]) <= {seen["gid"]}


def test_environment_holds_home_and_python_flags_and_nothing_of_the_server(seen):
    env = seen["env"]
    assert env["HOME"] == "/tmp"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    # PATH and LANG come from the image, HOSTNAME from Docker; nothing else may appear.
    assert set(env) <= {
        "HOME",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "PATH",
        "HOSTNAME",
        "LANG",
    }
    assert env.get("HOSTNAME") == "sandbox"
    assert "hunter2" not in json.dumps(env) and "also-secret" not in json.dumps(env)


def test_state_arrives_on_stdin_and_stdin_is_then_closed(seen):
    assert seen["stdin_is_empty"] is True


def test_loopback_listener_of_the_host_is_unreachable(docker_executor):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = (
        "import socket\n"
        "def main(state):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', state['port']), timeout=2)\n"
        "        return 'connected'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__ + ': ' + str(e)\n"
    )
    try:
        result = run(docker_executor, code, {"port": port})
    finally:
        stop.set()
        t.join()
        listener.close()
    assert result.status is Status.SUCCEEDED
    # the seccomp profile refuses AF_INET sockets: not even the sandbox's own lo is reachable
    assert result.output.startswith("PermissionError"), result.output
    assert accepted == []


def test_memory_above_the_limit_ends_code_memory(make_executor):
    ex = make_executor(code_memory="64m")
    code = "def main(state):\n    x = []\n    while True:\n        x.append(bytearray(1 << 20))\n"
    result = run(ex, code, timeout_s=20)
    assert result.status is Status.FAILED
    assert result.error.code == "CODE_MEMORY"
    assert "STUDIO_CODE_MEMORY=64m" in result.error.message


def test_fork_bomb_stops_at_the_pids_limit(make_executor, sandbox_mode):
    if sandbox_mode.endswith("-runsc"):
        # gVisor's own threads (~33 at rest with ptrace) count in the pids cgroup too: a
        # limit of 16 cannot start it at all. At 64 the code's forks take the rest, and the
        # sandbox ends as a whole when they reach it (its kernel cannot start the host
        # thread a new task needs): the code never sees EAGAIN, the job says why.
        ex = make_executor(code_pids=64)
        result = run(ex, FORK_BOMB, timeout_s=20)
        assert result.status is Status.FAILED, result
        assert result.error.code == "CODE_ERROR"
        assert "limit of 64 processes and threads (STUDIO_CODE_PIDS)" in result.error.message
        assert result.usage.pids_peak == 64
        return
    ex = make_executor(code_pids=16)
    # Runs ONLY inside the container, under its pids limit of 16.
    result = run(ex, FORK_BOMB, timeout_s=20)
    assert result.status is Status.SUCCEEDED, result
    assert result.output["error"] == "Resource temporarily unavailable"
    assert 0 < result.output["forked"] < 16


def test_endless_loop_ends_code_timeout_within_timeout_plus_one_second(docker_executor):
    t0 = time.monotonic()
    result = run(docker_executor, "def main(state):\n    while True:\n        pass\n", timeout_s=2)
    elapsed = time.monotonic() - t0
    assert result.status is Status.TIMED_OUT
    assert result.error.code == "CODE_TIMEOUT"
    assert elapsed < 2 + 1, elapsed


def test_node_timeout_is_capped_by_max_seconds(make_executor):
    ex = make_executor(code_max_seconds=1)
    t0 = time.monotonic()
    result = run(ex, "import time\ndef main(state):\n    time.sleep(60)\n", timeout_s=60)
    assert result.status is Status.TIMED_OUT
    assert "timeout of 1 s" in result.error.message
    assert time.monotonic() - t0 < 2


def test_cpu_share_and_limits_are_visible_in_the_cgroup(make_executor, sandbox_mode):
    # under gVisor its own threads take ~33-38 of the pids limit: 32 is refused there
    # (test_a_pids_limit_below_gvisors_floor_is_said_not_failed_at_random)
    pids = 64 if sandbox_mode.endswith("-runsc") else 32
    ex = make_executor(code_cpus=0.5, code_pids=pids, code_memory="128m")
    code = READ_FIRST + (
        "def main(state):\n"
        "    return {\n"
        "      'quota': read('/sys/fs/cgroup/cpu/cpu.cfs_quota_us', '/sys/fs/cgroup/cpu.max'),\n"
        "      'period': read('/sys/fs/cgroup/cpu/cpu.cfs_period_us'),\n"
        "      'pids': read('/sys/fs/cgroup/pids/pids.max', '/sys/fs/cgroup/pids.max'),\n"
        "      'mem': read('/sys/fs/cgroup/memory/memory.limit_in_bytes',\n"
        "                  '/sys/fs/cgroup/memory.max'),\n"
        "      'memsw': read('/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes',\n"
        "                    '/sys/fs/cgroup/memory.swap.max'),\n"
        "    }\n"
    )
    result = run(ex, code)
    assert result.status is Status.SUCCEEDED, result
    out = result.output
    if oci_of(ex) == RUNSC:
        # gVisor's /sys has no cgroup tree: the limits hold its whole sandbox from the host
        # (the memory, pids and timeout tests here show them acting), unseen from inside
        assert out == dict.fromkeys(("quota", "period", "pids", "mem", "memsw")), out
        return
    if out["period"]:  # cgroup v1
        assert int(out["quota"]) / int(out["period"]) == 0.5
    else:
        quota, period = out["quota"].split()
        assert int(quota) / int(period) == 0.5
    assert out["pids"] == "32"
    assert int(out["mem"]) == 128 * 1024 * 1024
    # swap equal to memory: memory+swap total equals memory (v1) or no swap at all (v2)
    assert out["memsw"] in (str(128 * 1024 * 1024), "0", None)


def test_a_pids_limit_below_gvisors_floor_is_said_not_failed_at_random(
    make_settings, python_image, docker_client
):
    """Under gVisor the Sentry's own host threads count in the sandbox's pids limit: below
    floors.GVISOR_MIN_PIDS a sandbox failed to start, or ended mid-job, at random (a CI run:
    a pre-started runsc sandbox at 32 ended with no output, its pids peak 32). Readiness and
    each run say so plainly; at the floor, sandboxes start every time; runc is not held to
    it."""
    from executor.floors import GVISOR_MIN_PIDS
    from executor.languages import get_language
    from executor.service import Executor

    require_runsc(docker_client.api, RUNSC)

    def executor(oci: str, pids: int) -> Executor:
        return Executor(
            make_settings(
                code_runtime="docker",
                code_image=python_image,
                code_languages="python",
                code_oci_runtime=oci,
                code_pids=pids,
            )
        )

    code = "def main(state):\n    return 1\n"
    low = executor(RUNSC, 32)
    said = low.runtime.unavailable_reason(get_language("python"))
    assert said is not None and "STUDIO_CODE_PIDS=32 is fewer processes than gVisor" in said
    assert f"STUDIO_CODE_PIDS={GVISOR_MIN_PIDS} or more" in said, said
    r = low.run(CodeJob(code=code, timeout_s=20))
    assert (r.status, r.error.code) == (Status.FAILED, "RUNTIME_UNAVAILABLE"), r
    assert r.error.message == said
    assert executor(RUNC, 32).runtime.unavailable_reason(get_language("python")) is None
    floor = executor(RUNSC, GVISOR_MIN_PIDS)
    assert floor.runtime.unavailable_reason(get_language("python")) is None
    results = [floor.run(CodeJob(code=code, timeout_s=30)) for _ in range(3)]
    assert [(r.status, r.output) for r in results] == [(Status.SUCCEEDED, 1)] * 3, results


def test_print_flood_is_truncated_and_the_result_survives(docker_executor):
    code = (
        "import sys\n"
        "def main(state):\n"
        "    line = 'x' * 1023 + '\\n'\n"
        "    for _ in range(20 * 1024):\n"  # 20 MiB of logs
        "        sys.stdout.write(line)\n"
        "    return 'done'\n"
    )
    result = run(docker_executor, code, timeout_s=25)
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == "done"
    assert result.logs_truncated is True
    assert len(result.logs) < 64 * 1024 + 200
    assert "[logs truncated:" in result.logs


def test_ten_megabyte_state_round_trips(docker_executor):
    state = {"rows": ["y" * 1000 for _ in range(10 * 1024)]}
    result = run(
        docker_executor, "def main(state):\n    return len(state['rows'])\n", state, timeout_s=25
    )
    assert result.status is Status.SUCCEEDED, result.error
    assert result.output == 10 * 1024


def test_each_call_gets_a_new_container(docker_executor):
    code = (
        "import os\n"
        "def main(state):\n"
        "    seen = os.path.exists('/tmp/mark')\n"
        "    open('/tmp/mark', 'w').write('x')\n"
        "    return seen\n"
    )
    assert run(docker_executor, code).output is False
    assert run(docker_executor, code).output is False


def test_containers_are_labelled_and_always_removed(docker_executor, docker_client):
    seen: list[tuple[str, dict]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for c in docker_client.api.containers(all=True, filters={"label": "studio.owner"}):
                seen.append((c["Names"][0].lstrip("/"), c["Labels"]))
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    job = CodeJob(
        code=KERNEL_LINE + "import time\ndef main(state):\n    time.sleep(1)\n    return 1\n"
    )
    try:
        result = docker_executor.run(job)
    finally:
        stop.set()
        t.join()
    assert result.status is Status.SUCCEEDED
    check_kernel(docker_executor, result)
    name = f"studio-code-{job.job_id}"
    mine = [labels for n, labels in seen if n == name]
    assert mine, "the container was never seen with its job's name"
    owner = mine[0]["studio.owner"]
    assert owner.endswith(f":{os.getpid()}")
    assert int(mine[0]["studio.deadline"]) > time.time()
    if docker_executor.runtime.pool is None:
        assert mine[0]["studio.job_id"] == job.job_id
        assert "studio.pool" not in mine[0]
    else:
        # Pre-started before its job was known: a pool label (its owner) instead of a job
        # id, and the job's name from the moment it was taken.
        assert mine[0]["studio.pool"] == owner
        assert "studio.job_id" not in mine[0]
    # Removed whatever happens (a pooled one just after the answer, off the caller's path).
    deadline = time.monotonic() + 10
    while docker_client.api.containers(all=True, filters={"name": name}):
        assert time.monotonic() < deadline, "the sandbox was not removed"
        time.sleep(0.05)


def test_kill_by_label_from_another_process_ends_cancelled(docker_executor):
    # Another process (the worker's backstop) removes the container by its label after the
    # cancel intent was recorded (intent first, then signal); the runtime may see the stream
    # end before its next poll of the intent, and must still read the job as cancelled.
    job = CodeJob(
        code=KERNEL_LINE + "def main(state):\n    while True:\n        pass\n", timeout_s=30
    )
    intent = threading.Event()

    def cancel_from_elsewhere() -> None:
        from executor.runtimes.docker.runtime import DockerRuntime

        intent.set()
        # False only when the runtime's own poll of the intent removed it first
        DockerRuntime(docker_executor.settings).kill(job.job_id)

    killer = threading.Timer(1.5, cancel_from_elsewhere)
    killer.start()
    result = docker_executor.run(job, should_cancel=intent.is_set)
    killer.join()
    assert result.status is Status.CANCELLED
    assert result.error.code == "CODE_CANCELLED"
    check_kernel(docker_executor, result)
    left = docker_executor.runtime.sandboxes()
    assert all(c["Labels"]["studio.job_id"] != job.job_id for c in left)


def test_code_that_closes_its_streams_still_ends_at_its_timeout(docker_executor):
    # Closing stdout/stderr ends the attach stream early; the process still runs and must
    # be stopped as a timeout, not reported as a broken engine.
    code = (
        "import os\n"
        "def main(state):\n"
        "    for fd in range(0, 10):\n"
        "        try:\n"
        "            os.close(fd)\n"
        "        except OSError:\n"
        "            pass\n"
        "    while True:\n"
        "        pass\n"
    )
    result = run(docker_executor, code, timeout_s=2)
    assert result.status is Status.TIMED_OUT
    assert result.error.code == "CODE_TIMEOUT"
