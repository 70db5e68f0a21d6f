"""Subprocess runs under a root server cannot see each other, the server or a Docker sandbox
(issue 9, item 5). Every program reports from inside what it tried and the errno it got;
the test then checks the host from outside (a pid gone, a file gone).

Hostile programs signal only pids their own test started and told them about: the other
test run, a Docker sandbox of this test, or (signal 0 only) the server, which is this
pytest process. Fork bombs run only under the dropped uid's RLIMIT_NPROC.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from executor.models import CodeJob, CodeResult, Status
from executor.service import Executor
from testkit.processes import alive, last_json_line, non_root_python, wait_for
from tests.conftest import FORK_BOMB, prewarm_both_ways
from tests.snippets import PRELUDE

#: every test here that builds its runtime with make_subprocess_executor (the ``iso``
#: fixture, the hostile-program table...) runs twice: cold runners, and runners pre-started
#: ahead of the job (STUDIO_CODE_PREWARM)
subprocess_prewarm = prewarm_both_ways

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or not sys.platform.startswith("linux"),
    reason="runs get uids of their own only under a root server on Linux",
)

DENIED = {"EACCES", "EPERM"}

#: the programs that write outside their own folder (files left for the sweep to remove)
#: run without Landlock, which would refuse those writes: they prove the fences under it,
#: what holds on a kernel without Landlock. tests/test_subprocess_landlock.py proves
#: Landlock itself. The others tell the test what it needs in a file of their own folder
#: (``run_file``), and the test answers in ``shared``, which they read.
NO_LANDLOCK = {"code_subprocess_landlock": "off"}


def run_file(name: str) -> Path | None:
    """The file ``name`` a run wrote in its own folder (the runtime's ``studio-code-*`` in
    the temporary folder; a server of another uid, with no TMPDIR, uses /tmp)."""
    for tmp in {tempfile.gettempdir(), "/tmp"}:
        found = sorted(Path(tmp).glob(f"studio-code-*/{name}"))
        if found:
            return found[0]
    return None


def run(executor: Executor, code: str, state: Any = None, timeout_s: float = 20) -> CodeResult:
    return executor.run(CodeJob(code=code, state_json=json.dumps(state or {}), timeout_s=timeout_s))


def uid_of(pid: int) -> int | None:
    """The real uid of a live (not zombie) process, None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields["State"].strip().startswith("Z"):
        return None
    return int(fields["Uid"].split()[0])


def gone(pid: int, uid: int) -> bool:
    """The run's process ``pid`` no longer exists (a reused pid of another uid is not it)."""
    return uid_of(pid) != uid


@pytest.fixture
def shared() -> Any:
    """A folder the runs and the test both use (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="studio-iso-"))
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def iso(make_subprocess_executor) -> Executor:  # type: ignore[no-untyped-def]
    ex = make_subprocess_executor(code_languages="python")
    iso = getattr(ex.runtime, "isolation", {})
    # the host these tests prove things on must give runs uids and cgroups of their own
    assert iso.get("separate_uids") and iso.get("cgroup"), iso
    return ex


# --- the table: one hostile program per row ---------------------------------------------


@dataclass
class Case:
    name: str
    code: str
    check: Callable[[CodeResult, dict[str, Any]], None]
    state: Callable[[dict[str, Any]], dict[str, Any]] = lambda ctx: {}
    settings: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 20


def _ok(r: CodeResult) -> Any:
    assert r.status is Status.SUCCEEDED, (r.status, r.error, r.logs)
    return r.output


def _own_uid(r: CodeResult, ctx: dict[str, Any]) -> None:
    out = _ok(r)
    assert out["uid"] in ctx["uids"] and out["uid"] != 65534
    assert out["gid"] == out["uid"] and out["groups"] in ([], [out["gid"]])
    assert out["no_new_privs"] == "1"
    assert out["setuid0"] in DENIED


def _server(field_name: str) -> Callable[[CodeResult, dict[str, Any]], None]:
    def check(r: CodeResult, ctx: dict[str, Any]) -> None:
        out = _ok(r)
        assert out["ppid"] == os.getpid()  # it really probed this server
        assert out["result"] in DENIED, out

    check.__name__ = f"server_{field_name}"
    return check


def _setsid_gone(r: CodeResult, ctx: dict[str, Any]) -> None:
    line = next(x for x in r.logs.splitlines() if x.startswith("grandchild "))
    _, pid, _, uid, _, escaped = line.split()
    assert escaped == "True"  # it left the run's session and process group
    assert gone(int(pid), int(uid)), f"grandchild {pid} of uid {uid} survived the run"


def _setsid_gone_after_timeout(r: CodeResult, ctx: dict[str, Any]) -> None:
    assert r.status is Status.TIMED_OUT, (r.status, r.error)
    _setsid_gone(r, ctx)


def _escape_cgroup(r: CodeResult, ctx: dict[str, Any]) -> None:
    out = _ok(r)
    assert "/studio-code/uid-" in out["cgroup"], out["cgroup"]
    assert out["tries"] and set(out["tries"].values()) <= DENIED, out["tries"]


def _files_gone(r: CodeResult, ctx: dict[str, Any]) -> None:
    out = _ok(r)
    assert len(out["made"]) >= 8
    left = [p for p in out["made"] if os.path.lexists(p)]
    assert not left, f"left behind: {left}"
    # never anything else: the link's target, the test's own files in /tmp and in the
    # world-writable folder the run wrote into
    assert ctx["victim"].read_text() == "the test's own"
    assert ctx["keep"].read_text() == "the test's own"
    assert ctx["root_tmp"].read_text() == "the test's own"


def _deep_tree_gone(r: CodeResult, ctx: dict[str, Any]) -> None:
    out = _ok(r)
    assert out["depth"] == 200
    assert not os.path.lexists(out["base"])
    assert not [n for n in os.listdir("/tmp") if n.startswith(".studio-code-sweep-")]


def _shm_charged(r: CodeResult, ctx: dict[str, Any]) -> None:
    # 5 x 60 MB in /dev/shm under 256 MB: the cgroup counts tmpfs pages, so either the
    # kernel ended the run (CODE_MEMORY) or a write failed inside
    if r.status is Status.SUCCEEDED:
        assert r.output["error"] in ("ENOSPC", "ENOMEM"), r.output
        assert r.output["written_mb"] < 300
    else:
        assert r.error and r.error.code == "CODE_MEMORY", (r.status, r.error, r.logs)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"iso-{ctx['token']}")]


def _processes_share_memory_limit(r: CodeResult, ctx: dict[str, Any]) -> None:
    # 4 processes x 100 MB: each under RLIMIT_AS, together over the cgroup's 256 MB
    assert r.error and r.error.code == "CODE_MEMORY", (r.status, r.error, r.output, r.logs)


def _fork_bomb(r: CodeResult, ctx: dict[str, Any]) -> None:
    out = _ok(r)
    assert out["error"] == "Resource temporarily unavailable" and out["forked"] < 16


def _pids_of_group(r: CodeResult, ctx: dict[str, Any]) -> None:
    out = _ok(r)
    assert out["pids_max"] == "24"  # STUDIO_CODE_PIDS of this row, the cgroup's pids.max


def _all_denied(r: CodeResult, keys: set[str]) -> None:
    out = _ok(r)
    assert set(out) == keys and set(out.values()) <= DENIED, out


def _ipc_gone(r: CodeResult) -> None:
    ids = _ok(r)
    assert all(i >= 0 for i in ids.values()), ids  # made inside the run
    for kind, column in (("shm", "shmid"), ("sem", "semid"), ("msg", "msqid")):
        header, *rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        at = header.split().index(column)
        assert ids[kind] not in {int(row.split()[at]) for row in rows}, kind


CASES = [
    Case(
        "own uid, no groups, no_new_privs",
        PRELUDE
        + r"""
def main(state):
    st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
    return {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
            "no_new_privs": st["NoNewPrivs"].strip(),
            "setuid0": attempt(lambda: os.setuid(0))}
""",
        _own_uid,
    ),
    Case(
        "server environ unreadable",
        PRELUDE
        + r"""
def main(state):
    return {"ppid": os.getppid(), "result": attempt(lambda: read(f"/proc/{os.getppid()}/environ"))}
""",
        _server("environ"),
    ),
    Case(
        "server memory unreadable",
        PRELUDE
        + r"""
def main(state):
    return {"ppid": os.getppid(), "result": attempt(lambda: open_only(f"/proc/{os.getppid()}/mem"))}
""",
        _server("mem"),
    ),
    Case(
        "server not traceable",
        PRELUDE
        + r"""
def main(state):
    return {"ppid": os.getppid(), "result": attempt(lambda: seize(os.getppid()))}
""",
        _server("ptrace"),
    ),
    Case(
        "server not signalable (signal 0)",
        PRELUDE
        + r"""
def main(state):
    return {"ppid": os.getppid(), "result": attempt(lambda: os.kill(os.getppid(), 0))}
""",
        _server("signal0"),
    ),
    Case(
        "setsid() grandchild gone at the end",
        PRELUDE
        + r"""
def main(state):
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            time.sleep(600)
            os._exit(0)
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.wait()
    escaped = os.getsid(pid) != os.getsid(0) and os.getpgid(pid) != os.getpgid(0)
    print("grandchild", pid, "uid", os.getuid(), "escaped", escaped, flush=True)
    if state.get("spin"):
        while True:
            pass
    return pid
""",
        _setsid_gone,
    ),
    Case(
        "setsid() grandchild gone after a timeout",
        "",
        _setsid_gone_after_timeout,
        state=lambda ctx: {"spin": True},
        timeout_s=2,
    ),
    Case(
        "cannot leave its cgroup",
        PRELUDE
        + r"""
def main(state):
    text = open("/proc/self/cgroup").read()
    tries = {}
    for line in text.splitlines():
        _, ctrls, path = line.split(":", 2)
        if ctrls in ("memory", "pids"):
            mount = f"/sys/fs/cgroup/{ctrls}"
        elif ctrls == "" and "/studio-code/" in path:
            mount = "/sys/fs/cgroup"
        else:
            continue
        up = path.rsplit("/studio-code/", 1)[0]
        for target in {mount + up, mount}:
            def move(target=target):
                with open(f"{target}/cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))
            tries[target] = attempt(move)
    return {"cgroup": text, "tries": tries}
""",
        _escape_cgroup,
    ),
    Case(
        "files in /tmp, /dev/shm, /var/tmp gone",
        PRELUDE
        + r"""
import socket
def main(state):
    t = state["token"]
    made = []
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        p = f"{d}/iso-{t}"
        with open(p, "w") as f:
            f.write("left for the next run")
        os.chmod(p, 0o666)
        made.append(p)
    tree = f"/tmp/iso-tree-{t}"
    os.makedirs(f"{tree}/a/b/c")
    open(f"{tree}/a/b/c/f", "w").write("x")
    made += [tree, f"{tree}/a/b/c/f"]
    os.symlink(state["victim"], f"/tmp/iso-link-{t}")
    made.append(f"/tmp/iso-link-{t}")
    os.mkfifo(f"/dev/shm/iso-fifo-{t}")
    made.append(f"/dev/shm/iso-fifo-{t}")
    s = socket.socket(socket.AF_UNIX)
    s.bind(f"/tmp/iso-sock-{t}")
    made.append(f"/tmp/iso-sock-{t}")
    p = f"{state['shared']}/iso-in-shared-{t}"
    open(p, "w").write("x")
    made.append(p)
    return {"made": made}
""",
        _files_gone,
        settings=NO_LANDLOCK,
        state=lambda ctx: {
            "token": ctx["token"],
            "victim": str(ctx["victim"]),
            "shared": str(ctx["shared"]),
        },
    ),
    Case(
        "a 200-deep tree in /tmp gone",
        PRELUDE
        + r"""
def main(state):
    base = f"/tmp/iso-deep-{state['token']}"
    os.mkdir(base)
    os.chdir(base)
    depth = 0
    for _ in range(200):
        os.mkdir("d")
        os.chdir("d")
        depth += 1
    open("leaf", "w").write("x")
    os.chdir("/")
    return {"base": base, "depth": depth}
""",
        _deep_tree_gone,
        state=lambda ctx: {"token": ctx["token"]},
        settings=NO_LANDLOCK,
    ),
    Case(
        "5 x 60 MB in /dev/shm under 256 MB",
        PRELUDE
        + r"""
def main(state):
    chunk = b"x" * (1 << 20)
    written = 0
    try:
        for i in range(5):
            with open(f"/dev/shm/iso-{state['token']}-{i}", "wb") as f:
                for _ in range(60):
                    f.write(chunk)
                    written += 1
    except OSError as e:
        return {"written_mb": written, "error": errno.errorcode.get(e.errno)}
    return {"written_mb": written, "error": None}
""",
        _shm_charged,
        state=lambda ctx: {"token": ctx["token"]},
        settings={"code_memory": "256m", **NO_LANDLOCK},
    ),
    Case(
        "4 processes x 100 MB under 256 MB",
        PRELUDE
        + r"""
def main(state):
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            block = b"x" * (100 << 20)
            time.sleep(1)
            os._exit(len(block) > 0 and 0)
        kids.append(pid)
    return [os.waitpid(k, 0)[1] for k in kids]
""",
        _processes_share_memory_limit,
        settings={"code_memory": "256m"},
    ),
    Case(
        "fork bomb stops at its own uid's nproc", FORK_BOMB, _fork_bomb, settings={"code_pids": 16}
    ),
    Case(
        "the cgroup's pids.max is STUDIO_CODE_PIDS",
        PRELUDE
        + r"""
def main(state):
    line = [l for l in open("/proc/self/cgroup").read().splitlines() if ":pids:" in l
            or l.startswith("0::")][0]
    path = line.split(":", 2)[2]
    mount = "/sys/fs/cgroup/pids" if ":pids:" in line else "/sys/fs/cgroup"
    return {"pids_max": open(f"{mount}{path}/pids.max").read().strip()}
""",
        _pids_of_group,
        settings={"code_pids": 24},
    ),
]
CASES.append(
    Case(
        "System V IPC objects gone",
        PRELUDE
        + r"""
def main(state):
    libc = ctypes.CDLL(None, use_errno=True)
    ids = {"shm": libc.shmget(0, 1 << 20, 0o1000 | 0o666),   # IPC_PRIVATE, IPC_CREAT
           "sem": libc.semget(0, 1, 0o1000 | 0o666),
           "msg": libc.msgget(0, 0o1000 | 0o666)}
    return ids
""",
        lambda r, ctx: _ipc_gone(r),
    )
)
CASES.append(
    Case(
        "cannot raise its own limits",
        PRELUDE
        + r"""
import resource
def main(state):
    line = [l for l in open("/proc/self/cgroup").read().splitlines() if ":memory:" in l
            or l.startswith("0::")][0]
    path = line.split(":", 2)[2]
    mount = "/sys/fs/cgroup/memory" if ":memory:" in line else "/sys/fs/cgroup"
    name = "memory.limit_in_bytes" if ":memory:" in line else "memory.max"
    def raise_memory():
        with open(f"{mount}{path}/{name}", "w") as f:
            f.write(str(8 << 30))
    def raise_nproc():
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (hard + 1, hard + 1))
        except ValueError:  # Python's word for the kernel's EPERM here
            raise PermissionError(errno.EPERM, "not allowed to raise maximum limit")
    return {"cgroup_memory": attempt(raise_memory), "nproc": attempt(raise_nproc)}
""",
        lambda r, ctx: _all_denied(r, {"cgroup_memory", "nproc"}),
    )
)
CASES.append(
    Case(
        "cannot touch the uid leases",
        PRELUDE
        + r"""
def main(state):
    lock = f"/run/studio-code/uids/{os.getuid()}.lock"
    return {"list": attempt(lambda: os.listdir("/run/studio-code/uids")),
            "open": attempt(lambda: open_only(lock)),
            "create": attempt(lambda: open("/run/studio-code/uids/999999.lock", "w"))}
""",
        lambda r, ctx: _all_denied(r, {"list", "open", "create"}),
    )
)
CASES[6].code = CASES[5].code  # the same program, left spinning until its timeout


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_program(case: Case, make_subprocess_executor, shared: Path) -> None:  # type: ignore[no-untyped-def]
    ex = make_subprocess_executor(code_languages="python", **case.settings)
    assert getattr(ex.runtime, "isolation", {}).get("cgroup"), "no cgroup on this host"
    token = uuid.uuid4().hex[:10]
    victim = shared / "victim"
    victim.write_text("the test's own")
    keep = shared / "keep"
    keep.write_text("the test's own")
    root_tmp = Path(f"/tmp/iso-root-{token}")
    root_tmp.write_text("the test's own")
    ctx = {
        "token": token,
        "victim": victim,
        "keep": keep,
        "shared": shared,
        "root_tmp": root_tmp,
        "uids": ex.settings.subprocess_uids,
    }
    try:
        r = run(ex, case.code, case.state(ctx), timeout_s=case.timeout_s)
        case.check(r, ctx)
    finally:
        root_tmp.unlink()


# --- two concurrent runs and a Docker sandbox ---------------------------------------------

PAIR = (
    PRELUDE
    + r"""
def main(state):
    d, me = state["dir"], f"{state['token']}-{state['name']}"
    with open(f"{me}.tmp", "w") as f:  # in its own folder: the test finds it there
        f.write(str(os.getpid()))
    os.rename(f"{me}.tmp", f"{me}.pid")
    go = f"{d}/{me}.go"
    for _ in range(2000):
        if os.path.exists(go):
            break
        time.sleep(0.01)
    # only the pids the test wrote here: the other test run and this test's Docker sandbox
    targets = json.load(open(go))
    report = {label: probe(pid, kill=True) for label, pid in targets.items()}
    open(f"{me}.done", "w").close()
    for _ in range(1000):  # stay alive (a target) until the test saw both runs done
        if os.path.exists(f"{d}/{state['token']}.release"):
            break
        time.sleep(0.01)
    return {"pid": os.getpid(), "uid": os.getuid(), "targets": targets, "report": report}
"""
)

SLEEPER = "import time\ndef main(state):\n    time.sleep(6)\n    return 'alive'\n"


def test_two_concurrent_runs_and_a_docker_sandbox_cannot_reach_each_other(
    iso: Executor,
    docker_executor: Executor,
    docker_client,
    shared: Path,  # type: ignore[no-untyped-def]
) -> None:
    results: dict[str, CodeResult] = {}

    def start(name: str, ex: Executor, job: CodeJob) -> threading.Thread:
        t = threading.Thread(target=lambda: results.__setitem__(name, ex.run(job)))
        t.start()
        return t

    sleeper = CodeJob(code=SLEEPER, timeout_s=30)
    threads = [start("docker", docker_executor, sleeper)]
    token = uuid.uuid4().hex[:10]
    for me in ("a", "b"):
        state = {"dir": str(shared), "name": me, "token": token}
        threads.append(
            start(me, iso, CodeJob(code=PAIR, state_json=json.dumps(state), timeout_s=30))
        )

    def container_pid() -> int:
        for c in docker_client.api.containers(
            filters={"label": f"studio.job_id={sleeper.job_id}", "status": "running"}
        ):
            pid = docker_client.api.inspect_container(c["Id"])["State"]["Pid"]
            if pid:
                return int(pid)
        return 0

    docker_pid = wait_for(container_pid, 60, "the Docker sandbox to start")
    pids = {}
    for me in ("a", "b"):
        path = wait_for(lambda me=me: run_file(f"{token}-{me}.pid"), 30, f"run {me} to start")
        pids[me] = int(path.read_text())
    # what each run is told is a process this test started: a run (our child, under a run
    # uid) and the sandbox (under the Docker sandboxes' uid)
    uids = iso.settings.subprocess_uids
    for me in ("a", "b"):
        assert uid_of(pids[me]) in uids
        assert (
            int(Path(f"/proc/{pids[me]}/stat").read_text().rsplit(") ", 1)[1].split()[1])
            == os.getpid()
        )
    assert uid_of(pids["a"]) != uid_of(pids["b"])
    docker_uid = uid_of(docker_pid)
    assert docker_uid is not None and docker_uid not in uids
    for me, other in (("a", "b"), ("b", "a")):
        go = shared / f"{token}-{me}.go"
        go.with_suffix(".tmp").write_text(json.dumps({"peer": pids[other], "docker": docker_pid}))
        go.with_suffix(".tmp").rename(go)
    try:  # each stays a target until both are done
        for me in ("a", "b"):
            wait_for(lambda me=me: run_file(f"{token}-{me}.done"), 30, f"run {me} to probe")
    finally:
        (shared / f"{token}.release").touch()
    for t in threads:
        t.join(timeout=60)

    for me in ("a", "b"):
        r = results[me]
        assert r.status is Status.SUCCEEDED, (me, r.status, r.error, r.logs)
        report = r.output["report"]
        for target in ("peer", "docker"):
            got = report[target]
            assert set(got) == {"environ", "mem", "cwd", "ptrace", "signal0", "sigkill"}
            assert set(got.values()) <= DENIED, (me, target, got)
    for me, other in (("a", "b"), ("b", "a")):  # each probed only what it was told
        assert results[me].output["targets"] == {
            "peer": results[other].output["pid"],
            "docker": docker_pid,
        }
    # both runs and the sandbox lived through the attacks and ended on their own
    assert results["a"].output["uid"] != results["b"].output["uid"]
    assert results["docker"].status is Status.SUCCEEDED and results["docker"].output == "alive"


HOLDER = r"""
import os, time
def main(state):
    kids = []
    for _ in range(state["n"]):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
    open(f"{state['token']}.holding", "w").close()  # in its own folder: the test finds it
    for _ in range(1500):
        if os.path.exists(state["release"]):
            break
        time.sleep(0.01)
    return {"held": len(kids), "kids": kids, "uid": os.getuid()}
"""

FORKER = r"""
import os
def main(state):
    n = 0
    try:
        for _ in range(state["n"]):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            n += 1
    except OSError as e:
        return {"forked": n, "error": e.strerror}
    for _ in range(n):
        os.wait()
    return {"forked": n, "error": None}
"""


def test_one_run_holding_many_processes_does_not_stop_a_concurrent_run(
    make_subprocess_executor,
    shared: Path,  # type: ignore[no-untyped-def]
) -> None:
    # 60 sleeping processes of one run under STUDIO_CODE_PIDS=64; the same uid for both
    # would leave the second run 3 forks; its own uid leases it all 64
    ex = make_subprocess_executor(code_languages="python", code_pids=64)
    token, release = uuid.uuid4().hex[:10], shared / "release"
    results: dict[str, CodeResult] = {}
    t = threading.Thread(
        target=lambda: results.__setitem__(
            "holder",
            run(ex, HOLDER, {"n": 60, "token": token, "release": str(release)}, 30),
        )
    )
    t.start()
    try:
        wait_for(lambda: run_file(f"{token}.holding"), 30, "the holder to start its processes")
        second = run(ex, FORKER, {"n": 30})
    finally:
        release.touch()
        t.join(timeout=60)
    assert second.status is Status.SUCCEEDED, (second.status, second.error)
    assert second.output == {"forked": 30, "error": None}
    held = results["holder"]
    assert held.status is Status.SUCCEEDED and held.output["held"] == 60
    uid = held.output["uid"]
    assert all(gone(pid, uid) for pid in held.output["kids"])  # ended with their run


def test_the_next_run_does_not_find_what_a_run_left(make_subprocess_executor) -> None:  # type: ignore[no-untyped-def]
    iso = make_subprocess_executor(code_languages="python", **NO_LANDLOCK)
    token = uuid.uuid4().hex[:10]
    writer = r"""
import os
def main(state):
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        with open(f"{d}/iso-next-{state['t']}", "w") as f:
            f.write("secret")
        os.chmod(f"{d}/iso-next-{state['t']}", 0o644)
    return "written"
"""
    reader = r"""
import errno
def main(state):
    seen = {}
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        try:
            seen[d] = open(f"{d}/iso-next-{state['t']}").read()
        except OSError as e:
            seen[d] = errno.errorcode[e.errno]
    return seen
"""
    assert run(iso, writer, {"t": token}).output == "written"
    seen = run(iso, reader, {"t": token})
    assert seen.output == {"/tmp": "ENOENT", "/dev/shm": "ENOENT", "/var/tmp": "ENOENT"}


# --- leases across processes, settings, meta ----------------------------------------------


def test_uid_leases_never_collide_across_processes(tmp_path: Path) -> None:
    from executor.errors import RuntimeUnavailable
    from executor.runtimes.subprocess.uids import UidPool

    ids = range(300000, 300002)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from executor.runtimes.subprocess.uids import UidPool\n"
            f"lease = UidPool(range(300000, 300002), Path({str(tmp_path)!r})).acquire()\n"
            "print(lease.uid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert holder.stdout is not None
        held = int(holder.stdout.readline())
        pool = UidPool(ids, tmp_path)
        mine = pool.acquire()
        assert mine.uid != held and mine.uid in ids
        with pytest.raises(RuntimeUnavailable, match="STUDIO_CODE_SUBPROCESS_UIDS"):
            pool.acquire()
    finally:
        holder.kill()
        holder.wait()
    # the dead holder's uid is free again, and marked for a scrub of its leftovers
    again = pool.acquire()
    assert again.uid == held and again.was_dirty
    mine.release()
    again.release()
    assert not pool.acquire().was_dirty


@pytest.mark.parametrize(
    "value, sentence",
    [
        ("1000-1001", "uid 1000 is the account"),
        ("65000-66000", "a range without uid 65534"),
        ("200000", "a uid range FIRST-LAST"),
        ("5-10", "1000 <= FIRST"),
    ],
)
def test_a_bad_uid_range_stops_start_up_with_a_sentence(value: str, sentence: str) -> None:
    from executor.errors import SettingsError
    from executor.settings import load_settings

    if "account" in sentence:
        import pwd

        try:
            pwd.getpwuid(1000)
        except KeyError:
            pytest.skip("no account with uid 1000 on this host")
    with pytest.raises(SettingsError, match="STUDIO_CODE_SUBPROCESS_UIDS") as e:
        load_settings(code_runtime="subprocess", code_subprocess_uids=value)
    assert sentence in str(e.value)


def test_meta_says_what_holds(iso: Executor) -> None:
    from executor.meta import runtime_meta

    meta = runtime_meta(iso)
    iso_meta = meta["subprocess_isolation"]
    assert iso_meta["separate_uids"] is True and iso_meta["cgroup"]
    assert any("own uid" in w for w in meta["warnings"][1:])
    assert any("System V IPC" in s for s in iso_meta["holds"])
    assert any("use the network" in s for s in iso_meta["does_not_hold"])


def test_without_a_cgroup_the_run_still_ends_whole_and_meta_says_so(make_settings) -> None:  # type: ignore[no-untyped-def]
    ex = Executor(
        make_settings(
            code_runtime="subprocess", code_languages="python", code_subprocess_cgroup="off"
        )
    )
    iso = ex.runtime.isolation  # type: ignore[union-attr]
    assert iso["cgroup"] is None and iso["cgroup_reason"] == "STUDIO_CODE_SUBPROCESS_CGROUP=off"
    assert any("/dev/shm" in s for s in iso["does_not_hold"])
    r = run(ex, CASES[5].code)
    _setsid_gone(r, {})  # the run's uid is killed whole even without a cgroup


# --- a server that is not root: what meta claims is what a run can do ---------------------

#: no account, outside the run range (and test_subprocess_landlock's), one per test session:
#: a test counts every process of this uid, so two sessions on one machine must not share it
SERVER_UID = 310_000 + os.getpid() % 10_000

#: a run of the non-root server: starts a setsid() grandchild, says which pid namespace it
#: is in, waits for the pids the test found (the server, the other run), then reports what
#: it could do to each of them and to its parent, and what its /proc lists
NON_ROOT_RUN = """
import errno, json, os, signal, subprocess, sys, time
def attempt(fn):
    try:
        return fn()
    except OSError as e:
        return errno.errorcode[e.errno]
def environ(pid):
    return open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")[:4000]
def mem(pid):
    os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))
    return "ok"
def signal0(pid):
    os.kill(pid, 0)
    return "ok"
def main(state):
    d, me = state["dir"], f"{state['token']}-{state['name']}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    ns = os.readlink("/proc/self/ns/pid")
    with open(f"{me}.tmp", "w") as f:  # in its own folder: the test finds it there
        json.dump({"ns": ns, "pid": os.getpid()}, f)
    os.rename(f"{me}.tmp", f"{me}.ready")
    for _ in range(3000):
        if os.path.exists(f"{d}/{me}.go"):
            break
        time.sleep(0.01)
    targets = json.load(open(f"{d}/{me}.go"))
    targets["parent"] = os.getppid()
    seen = {label: {"environ": attempt(lambda: environ(pid)), "mem": attempt(lambda: mem(pid)),
                    "signal0": attempt(lambda: signal0(pid))}
            for label, pid in targets.items()}
    procs = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    open(f"{me}.done", "w").close()
    for _ in range(3000):  # stay a target until the test saw both runs done
        if os.path.exists(f"{d}/{state['token']}.release"):
            break
        time.sleep(0.01)
    nnp = [l for l in open("/proc/self/status") if l.startswith("NoNewPrivs:")][0]
    return {"pid": os.getpid(), "ppid": os.getppid(), "ns": ns, "targets": targets,
            "seen": seen, "procs": procs, "grandchild": child.pid, "env": sorted(os.environ),
            "no_new_privs": nnp.split()[1]}
"""

NON_ROOT_SERVER = r"""
import json, os, sys, threading
from executor.meta import runtime_meta
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

data_dir, shared, mode, CODE, prewarm, landlock, token = sys.argv[1:8]
ex = Executor(load_settings(enable_code_nodes=True, code_runtime="subprocess",
                            code_languages="python", data_dir=data_dir,
                            code_subprocess_namespaces=mode, code_prewarm=int(prewarm),
                            code_subprocess_landlock=landlock))
if int(prewarm):
    ex.prepare()
    assert ex.runtime.pool.wait_ready(30)
results = {}
def start(me, other):
    state = {"dir": shared, "name": me, "token": token}
    job = CodeJob(code=CODE, state_json=json.dumps(state), timeout_s=60)
    results[me] = ex.run(job)
threads = [threading.Thread(target=start, args=pair) for pair in (("a", "b"), ("b", "a"))]
for t in threads:
    t.start()
for t in threads:
    t.join()
# what prometheus-client's process metrics read of a non-dumpable server: its own /proc/self
from prometheus_client import CollectorRegistry, ProcessCollector
registry = CollectorRegistry()
ProcessCollector(registry=registry)
own = {s.name: s.value for m in registry.collect() for s in m.samples}
print(json.dumps({
    "own_process_metrics": own,
    "server_pid": os.getpid(),
    "runs": {me: {"status": str(r.status), "output": r.output,
                  "error": r.error and r.error.message} for me, r in results.items()},
    "isolation": runtime_meta(ex)["subprocess_isolation"],
}))
"""


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (with the pid, it names one process)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _global_pid(candidates: list[int], ns: str, inner: int) -> int:
    """Which of ``candidates`` is pid ``inner`` of pid namespace ``ns`` (as the run saw it)."""
    for pid in candidates:
        try:
            nspid = Path(f"/proc/{pid}/status").read_text().split("NSpid:")[1].split("\n")[0]
        except (OSError, IndexError):
            continue
        if _pid_namespace(pid) == ns and int(nspid.split()[-1]) == inner:
            return pid
    raise AssertionError(f"no process is pid {inner} of {ns} among {candidates}")


@pytest.mark.parametrize(
    "mode, prewarm, landlock",
    [("auto", 0, "auto"), ("auto", 2, "auto"), ("off", 0, "auto"), ("off", 2, "off")],
    ids=["auto-cold", "auto-prestarted", "off-cold", "off-prestarted-no-landlock"],
)
def test_a_non_root_server_claims_what_its_runs_can_really_do(
    mode: str, prewarm: int, landlock: str, shared: Path
) -> None:
    """A server of an unprivileged uid with a secret in its environment, two concurrent runs:
    each reports from inside what it could do to the server, to its parent and to the other
    run, and every claim of meta (holds / does_not_hold) is checked against it. Landlock
    (where the kernel has it) in three of the four; the fourth, neither namespaces nor
    Landlock, is a run with every door the server's uid leaves open."""
    from testkit.processes import kill_pids, process_tree

    marker, token = uuid.uuid4().hex, uuid.uuid4().hex[:10]
    data = shared / "data"  # the server's data folder (covered in its runs), not the shared one
    data.mkdir(mode=0o777)
    os.chmod(data, 0o777)
    server = non_root_python(
        NON_ROOT_SERVER,
        *(str(data), str(shared), mode, NON_ROOT_RUN, str(prewarm), landlock, token),
        uid=SERVER_UID,
        marker=marker,
        cwd=shared,
        stdin=subprocess.DEVNULL,
    )
    grandchildren: list[int] = []
    try:
        ready = {}
        for me in ("a", "b"):
            path = wait_for(
                lambda me=me: run_file(f"{token}-{me}.ready") or server.poll() is not None,
                60,
                f"run {me} to start",
            )
            assert server.poll() is None, server.stderr.read()[-3000:] if server.stderr else ""
            ready[me] = json.loads(path.read_text())
        tree = process_tree(server.pid)
        pids = {me: _global_pid(tree, r["ns"], r["pid"]) for me, r in ready.items()}
        # what each run's pid namespace holds while it runs (its init, the run, its setsid()
        # grandchild), by pid and start time: a namespace's id is reused once it is gone
        # (a pre-started runner started after the run may get it), so "left" is these alone
        members = {
            me: {(p, _started(p)) for p in tree if _pid_namespace(p) == r["ns"]}
            for me, r in ready.items()
        }
        assert pids["a"] != pids["b"] and all(uid_of(p) == SERVER_UID for p in pids.values())
        for me, other in (("a", "b"), ("b", "a")):
            go = shared / f"{token}-{me}.go"
            go.with_suffix(".tmp").write_text(
                json.dumps({"server": server.pid, "peer": pids[other]})
            )
            go.with_suffix(".tmp").rename(go)
        try:  # each stays a target until both are done
            for me in ("a", "b"):
                wait_for(lambda me=me: run_file(f"{token}-{me}.done"), 60, f"run {me} to probe")
        finally:
            (shared / f"{token}.release").touch()
        stdout, stderr = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, stderr[-3000:]
    assert marker not in stdout  # no run read the server's environment, nor its parent's
    seen = json.loads(stdout.strip().splitlines()[-1])
    assert seen["server_pid"] == server.pid
    own = seen["own_process_metrics"]  # stat, limits and fd of its own, still readable
    assert own["process_open_fds"] > 0 and own["process_max_fds"] > 0
    assert own["process_resident_memory_bytes"] > 0
    iso = seen["isolation"]
    held, lacks = " ".join(iso["holds"]), " ".join(iso["does_not_hold"])
    namespaced = iso["namespaces"]
    if mode == "off":
        assert (
            not namespaced and iso["namespaces_reason"] == "STUDIO_CODE_SUBPROCESS_NAMESPACES=off"
        )
    else:
        from executor.runtimes.subprocess.namespaces import refusing_knob

        # this kernel allows unprivileged user namespaces unless a knob says otherwise
        assert namespaced == (refusing_knob() is None), iso["namespaces_reason"]
    assert iso["separate_uids"] is False and iso["server_dumpable"] is False
    from executor.runtimes.subprocess.landlock import abi_version

    assert iso["landlock"] is (landlock == "auto" and abi_version()[1] is None), iso
    closed = DENIED | {"ENOENT", "ESRCH"}
    try:
        for me, other in (("a", "b"), ("b", "a")):
            run_seen = seen["runs"][me]
            assert run_seen["status"] == "succeeded", run_seen
            out = run_seen["output"]
            grandchildren.append(out["grandchild"])
            assert out["targets"]["peer"] == pids[other]  # it probed the other run...
            assert out["targets"]["server"] == server.pid  # ...and this server
            got = out["seen"]
            # not dumpable: the server's environment and memory are closed in both modes,
            # and so are those of the run's parent (the server, or init: a copy of it)
            assert "not dumpable" in held
            for target in ("server", "parent"):
                assert got[target]["environ"] in closed, (me, target, got[target])
                assert got[target]["mem"] in closed, (me, target, got[target])
            # signals and the host's processes: exactly what meta claims
            signals_open = got["server"]["signal0"] == "ok"
            assert ("signal the server" in lacks) == signals_open, (lacks, got)
            assert (got["peer"]["signal0"] == "ok") == signals_open, got
            assert iso["run_can"]["signal"] is signals_open, (iso["run_can"], got)
            sees_host = server.pid in out["procs"] or pids[other] in out["procs"]
            assert ("see every process of the host" in lacks) == sees_host, (lacks, out)
            assert iso["run_can"]["see"] is sees_host, (iso["run_can"], out["procs"])
            # the other run's environment: open only without namespaces and Landlock
            peer_open = got["peer"]["environ"] not in closed
            assert ("of concurrent runs" in lacks) == peer_open, (lacks, got["peer"])
            if namespaced:
                assert "namespace of its own" in held
                assert got["server"]["signal0"] == got["peer"]["signal0"] == "ESRCH"
                assert got["peer"]["environ"] in closed and got["peer"]["mem"] in closed
                # its /proc lists its init, itself and its grandchild: nothing else
                assert set(out["procs"]) == {1, out["pid"], out["grandchild"]}, out["procs"]
                assert out["ppid"] == 1 and out["pid"] == 2
            else:
                assert out["ppid"] == server.pid
                # same uid, dumpable: only Landlock keeps the other run's environment
                assert peer_open is not iso["landlock"], got["peer"]
            # a setsid() grandchild: gone with the run's namespace, or left (meta says so)
            if namespaced:
                assert len(members[me]) == 3, members[me]  # init, the run, its grandchild
                left = [p for p, t in members[me] if alive(p) and _started(p) == t]
                assert not left, f"processes left in the run's pid namespace: {left}"
                assert "survives the end of the run" not in lacks
            else:
                assert uid_of(out["grandchild"]) == SERVER_UID
                assert "survives the end of the run" in lacks
            # and what it says still holds: an empty environment, no_new_privs
            assert "empty environment" in held and set(out["env"]) <= {"LC_CTYPE"}
            assert "no_new_privs" in held and out["no_new_privs"] == "1"
        assert "are not removed" in lacks
    finally:
        if not namespaced:  # ours: started by this test's runs, in the host's namespace
            kill_pids([p for p in grandchildren if uid_of(p) == SERVER_UID])


EXITS = r"""
import json, sys
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

data_dir, mode, languages, prewarm = sys.argv[1:5]
ex = Executor(load_settings(enable_code_nodes=True, code_runtime="subprocess",
                            code_languages=languages, data_dir=data_dir, code_memory="128m",
                            code_subprocess_namespaces=mode, code_prewarm=int(prewarm)))
if int(prewarm):
    ex.prepare()
    assert ex.runtime.pool.wait_ready(30)
out = []
for language, code in json.loads(sys.stdin.read()):
    r = ex.run(CodeJob(code=code, language=language, timeout_s=10))
    out.append([str(r.status), r.exit_code, r.error and str(r.error.code)])
print(json.dumps({"namespaces": ex.runtime.isolation["namespaces"], "results": out,
                  "pool": ex.runtime.pool_stats()}))
ex.close()
"""

#: program -> (status, exit code, error code) the server reports, the same in both modes
ENDINGS = [
    ("python", "import os\ndef main(state):\n    os._exit(7)\n", ["failed", 7, "CODE_ERROR"]),
    (
        "python",
        "import os, signal\ndef main(state):\n    os.kill(os.getpid(), signal.SIGTERM)\n",
        ["failed", -15, "CODE_ERROR"],
    ),
    ("python", "import os\ndef main(state):\n    os.abort()\n", ["failed", -6, "CODE_ERROR"]),
    (  # its own RLIMIT_CPU lowered to 1 s: SIGXCPU, which the runtime calls a timeout
        "python",
        "import resource\ndef main(state):\n"
        "    resource.setrlimit(resource.RLIMIT_CPU, (1, 5))\n    while True:\n        pass\n",
        ["timed_out", -24, "CODE_TIMEOUT"],
    ),
    (
        "python",
        "def main(state):\n    return len(bytearray(512 * 1024 * 1024))\n",
        ["failed", None, "CODE_MEMORY"],
    ),
    (  # ArrayBuffers V8's heap flag does not see: the runtime's RSS watch ends it
        "typescript",
        "export function main(state: unknown) {\n  const a = [];\n"
        "  for (let i = 0; i < 64; i++) { const b = new Uint8Array(16 << 20); b.fill(1); "
        "a.push(b); }\n  return a.length;\n}\n",
        ["failed", None, "CODE_MEMORY"],
    ),
]


@pytest.mark.parametrize("prewarm", [0, 1], ids=["cold", "prestarted"])
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_non_root_servers_runs_end_the_same_with_or_without_namespaces(
    mode: str, prewarm: int, shared: Path
) -> None:
    """Exit statuses, signal deaths (SIGXCPU of RLIMIT_CPU included) and both memory
    limits, as the executor reports them: a run in namespaces is PID 2 under an init, so
    nothing changes."""
    cases = ENDINGS if (Path(sys.prefix) / "bin" / "deno").exists() else ENDINGS[:-1]
    server = non_root_python(
        *(EXITS, str(shared), mode, "python,typescript", str(prewarm)),
        uid=SERVER_UID,
        marker="x",
        cwd=shared,
        stdin=subprocess.PIPE,
    )
    stdout, stderr = server.communicate(json.dumps([c[:2] for c in cases]), timeout=180)
    assert server.returncode == 0, stderr[-3000:]
    seen = json.loads(stdout.strip().splitlines()[-1])
    assert seen["namespaces"] is (mode == "auto")
    if prewarm:  # every run was given a pre-started runner (its RLIMIT_CPU set then)
        pool = seen["pool"]["languages"]
        assert sum(p["hits"] for p in pool.values()) == len(cases), pool
    results = seen["results"]
    for (language, code, want), got in zip(cases, results, strict=True):
        if want[1] is None:  # the memory limits: the exit code is the runner's own word
            got = [got[0], None, got[2]]
        assert got == want, (language, code)


KILLED = r"""
import json, os, sys
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

data_dir, mode = sys.argv[1:3]
ex = Executor(load_settings(enable_code_nodes=True, code_runtime="subprocess",
                            code_languages="python", data_dir=data_dir,
                            code_subprocess_namespaces=mode))
CODE = (
    "import subprocess, sys, time\n"
    # each holds 48 MiB it wrote: its exit takes a while to give the pages back
    "CHILD = ('import time; b = bytearray(48 << 20); b[::4096] = bytes(len(b) // 4096);'\n"
    "         'time.sleep(60)')\n"
    "def main(state):\n"
    "    for _ in range(3):\n"
    "        subprocess.Popen([sys.executable, '-c', CHILD], start_new_session=True)\n"
    "    time.sleep(60)\n"
)
me, uid = os.getpid(), os.getuid()
def others():  # every process of this server's uid but the server itself
    found = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and int(p) != me and os.stat(f"/proc/{p}").st_uid == uid:
                state = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(p))
        except OSError:
            pass
    return found
out = []
for _ in range(int(sys.argv[3])):
    r = ex.run(CodeJob(code=CODE, timeout_s=1))
    out.append([str(r.status), others()])  # read the moment run() returns
print(json.dumps({"namespaces": ex.runtime.isolation["namespaces"], "runs": out}))
ex.close()
"""


def test_a_non_root_servers_killed_run_is_gone_whole_when_its_result_is(shared: Path) -> None:
    """A run in namespaces that is killed (its time limit) while three setsid() grandchildren
    sleep: the moment ``run`` returns, no process of the server's uid is left but the server.
    The relay dies at once and the kernel empties the namespace only as its init exits, so
    the result waits for that init. (Before it did, this passed here too: the window is
    microseconds; the test keeps the promise, it did not catch the race.)"""
    server = non_root_python(
        KILLED,
        str(shared),
        "auto",
        "3",
        uid=SERVER_UID,
        marker="k",
        cwd=shared,
        stdin=subprocess.DEVNULL,
    )
    from executor.runtimes.subprocess.namespaces import refusing_knob

    seen = last_json_line(server, 180)
    # this kernel allows unprivileged user namespaces unless a knob says otherwise
    assert seen["namespaces"] == (refusing_knob() is None), refusing_knob()
    if not seen["namespaces"]:
        pytest.skip(f"this kernel gives a non-root server's runs no namespaces ({refusing_knob()})")
    assert [status for status, _ in seen["runs"]] == ["timed_out"] * 3
    assert [left for _, left in seen["runs"]] == [[]] * 3


def test_a_dead_workers_uid_is_scrubbed_before_its_next_run(make_settings) -> None:  # type: ignore[no-untyped-def]
    """A worker killed mid-run leaves its uid's lock free but marked busy, a process of
    that uid in a session of its own and a file in /tmp: the next holder of the uid kills
    and removes them before its own run starts."""
    from executor.runtimes.subprocess.uids import LOCK_DIR, MARK_BUSY

    uid = 300500
    ex = Executor(
        make_settings(
            code_runtime="subprocess", code_languages="python", code_subprocess_uids=f"{uid}-{uid}"
        )
    )
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    (LOCK_DIR / f"{uid}.lock").write_bytes(MARK_BUSY)
    stale = Path(f"/tmp/iso-stale-{uuid.uuid4().hex[:10]}")
    stale.write_text("left by a dead run")
    os.chown(stale, uid, uid)
    left = subprocess.Popen(
        ["/bin/sleep", "120"], user=uid, group=uid, extra_groups=[], start_new_session=True
    )
    try:
        r = run(ex, "import os\ndef main(state):\n    return os.getuid()\n")
        assert r.status is Status.SUCCEEDED and r.output == uid
        assert left.wait(timeout=5) == -9  # killed before the run, not by this test
        assert not stale.exists()
        assert (LOCK_DIR / f"{uid}.lock").read_bytes() != MARK_BUSY
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()
        stale.unlink(missing_ok=True)
