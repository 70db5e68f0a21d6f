"""Landlock for subprocess runs (issue 30, item 6): a run may write only beneath its own
temporary folder, under a non-root server and a root one alike, on the cold path and the
pre-started one; and meta's ``run_can`` (read / write / signal / see) and warnings say what
the run really could do.

Each run tries, from inside, to write what the server owns (a file of the data folder, the
SQLite run store, ``secret.key`` beside it), to create files in the data folder, in the
server's home (a test-owned folder, never the real one) and in /tmp, and to write its own
folder; then to signal and read a helper ``sleep`` THIS TEST started (the only pid it is
given), to list /proc and to connect to an abstract Unix socket this test listens on. The
test then checks the host from outside (the files unchanged or changed). With
STUDIO_CODE_SUBPROCESS_LANDLOCK=off every write outside succeeds: the same claims flip.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import last_json_line, non_root_python, require
from tests.snippets import PRELUDE

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or not sys.platform.startswith("linux"),
    reason="the test starts a server of another uid and runs of their own uids: root on Linux",
)

SERVER_UID = 300124  # no account, outside the run range; not test_subprocess_isolation's

#: the run: what it could do, each attempt's errno name or "ok"
PROBE = (
    PRELUDE
    + r"""
import fcntl, platform, socket, tempfile

# add_key, keyctl by machine; KEY_SPEC_USER_KEYRING, KEYCTL_SEARCH, KEYCTL_GET_PERSISTENT
KEYS = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
USER_KEYRING, SEARCH, GET_PERSISTENT = -4, 10, 22
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def syscall(*args):
    ret = libc.syscall(*args)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret

def add_key(desc, keyring):
    return syscall(KEYS[0], b"user", desc.encode(), b"left by a run", 13, keyring)

def persistent():
    add_key(persistent_desc, syscall(KEYS[1], GET_PERSISTENT, -1, USER_KEYRING))

def find(desc):
    syscall(KEYS[1], SEARCH, USER_KEYRING, b"user", desc.encode(), 0)

def lock(path):  # a shared lock on a read-only descriptor (SQLite's -shm lock bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, 120)
    finally:
        os.close(fd)

def server_files(state):
    # what the run can do to the server's own files and folder, each: errno name or ok
    seen = {}
    for what in ("store", "secret", "data"):
        path, mode = state[what], state["modes"][what]  # chmod to the mode it has
        seen[f"stat_{what}"] = attempt(lambda: os.stat(path))
        if seen[f"stat_{what}"] == "ok" and os.stat(path).st_ino != state["inodes"][what]:
            seen[f"stat_{what}"] = "another inode (a cover)"
        seen[f"chmod_{what}"] = attempt(lambda: os.chmod(path, mode))
        seen[f"utime_{what}"] = attempt(lambda: os.utime(path))
        seen[f"setxattr_{what}"] = attempt(lambda: os.setxattr(path, "user.studio", b"run"))
        if what != "data":
            seen[f"lock_{what}"] = attempt(lambda: lock(path))
    seen["list_data"] = attempt(lambda: os.listdir(state["data"]))
    seen["list_home"] = attempt(lambda: os.listdir(state["home"]))
    return seen

def create(path):
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))

def open_for_writing(path):  # the run store and secret.key: opened, never changed
    os.close(os.open(path, os.O_WRONLY | os.O_APPEND))

def append(path):
    with open(path, "a") as f:
        f.write("changed by the run")

def connect(name):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect("\0" + name)
    finally:
        s.close()

def own_folder():
    create("own")
    append("own")
    os.truncate("own", 1)
    os.mkdir("sub")
    os.rename("own", "sub/own")
    os.symlink("sub/own", "link")
    os.mkfifo("fifo")
    for p in ("link", "fifo", "sub/own"):
        os.unlink(p)
    os.rmdir("sub")

def main(state):
    d, home, tag = state["data"], state["home"], state["tag"]
    t = f"{state['token']}-{tag}"
    outside = {
        "append_to_a_data_file": attempt(lambda: append(f"{d}/victim-{tag}")),
        "truncate_a_data_file": attempt(lambda: os.truncate(f"{d}/victim-{tag}", 0)),
        "remove_a_data_file": attempt(lambda: os.unlink(f"{d}/doomed-{tag}")),
        "open_the_run_store_for_writing": attempt(lambda: open_for_writing(state["store"])),
        "open_secret_key_for_writing": attempt(lambda: open_for_writing(state["secret"])),
        "create_in_the_data_folder": attempt(lambda: create(f"{d}/new-{t}")),
        "mkdir_in_the_data_folder": attempt(lambda: os.mkdir(f"{d}/dir-{t}")),
        "symlink_in_the_data_folder": attempt(lambda: os.symlink("x", f"{d}/link-{t}")),
        "create_in_the_home": attempt(lambda: create(f"{home}/.profile-{t}")),
        "create_in_tmp": attempt(lambda: create(f"/tmp/studio-ll-{t}")),
    }
    global persistent_desc
    mine, before = f"studio-fence-{t}", f"studio-fence-{state['token']}-prestarted"
    persistent_desc = f"{mine}-persistent"
    keyrings = {
        "add_user": attempt(lambda: add_key(mine, USER_KEYRING)),
        "add_persistent": attempt(persistent),
        # the cold run looks for the key the pre-started one (run before it) left
        "find_previous": attempt(lambda: find(before)) if tag == "cold" else None,
    }
    fd, tmp = tempfile.mkstemp()
    os.close(fd)
    os.unlink(tmp)
    helper = state["helper"]
    return {
        "outside": outside,
        "server_files": server_files(state),
        "keyrings": keyrings,
        "own_folder": attempt(own_folder),
        "tempfile_in_own_folder": os.path.dirname(tmp) == os.getcwd(),
        "dev_null": attempt(lambda: append("/dev/null")),
        "read": {
            "store": attempt(lambda: open(state["store"], "rb").read(16)),
            "secret": attempt(lambda: open(state["secret"], "rb").read()),
        },
        "signal0": attempt(lambda: os.kill(helper, 0)),
        "sigcont": attempt(lambda: os.kill(helper, signal.SIGCONT)),
        "environ": attempt(lambda: open(f"/proc/{helper}/environ", "rb").read()),
        "sees": str(helper) in os.listdir("/proc"),
        "abstract": attempt(lambda: connect(state["abstract"])),
    }
"""
)

#: a non-root server: makes its data folder's files (the SQLite run store, secret.key, the
#: files the runs try to change), then one run on a pre-started runner and one cold
SERVER = r"""
import json, os, sys
from pathlib import Path
from executor.meta import runtime_meta
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings
from executor.store import open_store

data_dir, landlock, namespaces, code, state = sys.argv[1:6]
state = json.loads(state)
settings = load_settings(enable_code_nodes=True, code_runtime="subprocess",
                         code_languages="python", data_dir=data_dir, code_prewarm=1,
                         code_subprocess_landlock=landlock,
                         code_subprocess_namespaces=namespaces)
open_store(settings.sqlalchemy_url).close()
ex = Executor(settings)
ex.prepare()
assert ex.runtime.pool.wait_ready(30)
runs = {}
for tag, memory in (("prestarted", None), ("cold", 200 << 20)):
    job = CodeJob(code=code, state_json=json.dumps({**state, "tag": tag}), timeout_s=30,
                  memory_bytes=memory)
    r = ex.run(job)
    runs[tag] = {"status": str(r.status), "output": r.output,
                 "error": r.error and r.error.message, "logs": r.logs}
pool = ex.runtime.pool_stats()  # before meta, whose readiness check runs a program
meta = runtime_meta(ex)
print(json.dumps({"isolation": meta["subprocess_isolation"], "warnings": meta["warnings"],
                  "runs": runs, "pool": pool}))
ex.close()
"""

TAGS = ("prestarted", "cold")


def _data_folder(base: Path, owner: int, mode_dir: int, mode_file: int) -> dict[str, Path]:
    """The data folder (the run store is made in it by the server), secret.key and the
    files the runs try to change, one set per run; a home folder beside it."""
    data, home = base / "data", base / "home"
    for d in (data, home):
        d.mkdir()
        os.chmod(d, mode_dir)
        os.chown(d, owner, owner)
    files = {"secret": data / "secret.key", "store": data / "studio-code.db"}
    for tag in TAGS:
        files[f"victim-{tag}"] = data / f"victim-{tag}"
        files[f"doomed-{tag}"] = data / f"doomed-{tag}"
    for name, path in files.items():
        if name != "store":  # empty: the server makes it a SQLite database
            path.write_text("the server's own" if name != "secret" else uuid.uuid4().hex)
        path.touch()
        os.chmod(path, mode_file)
        os.chown(path, owner, owner)
    return {"data": data, "home": home, **files}


def _state(paths: dict[str, Path], token: str, helper: int, abstract: Abstract) -> dict[str, Any]:
    """What a run is told: the paths to try (and the modes they have, for a chmod that
    changes nothing if allowed), and the only pid and socket it may reach."""
    modes = {k: paths[k].stat().st_mode & 0o7777 for k in ("data", "store", "secret")}
    return {
        **{k: str(paths[k]) for k in ("data", "home", "store", "secret")},
        "modes": modes,
        "inodes": {k: paths[k].stat().st_ino for k in ("data", "store", "secret")},
        "token": token,
        "helper": helper,
        "abstract": abstract.name,
    }


def _landlock_abi() -> int:
    from executor.runtimes.subprocess.landlock import abi_version

    abi, why = abi_version()
    require(why is None, f"this kernel offers no Landlock ({why})")
    return abi


class Abstract:
    """An abstract Unix socket this test listens on (never accepts)."""

    def __init__(self) -> None:
        self.name = f"studio-ll-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind("\0" + self.name)
        self.sock.listen(8)

    def close(self) -> None:
        self.sock.close()


def _check(seen: dict[str, Any], paths: dict[str, Path], landlock: str, abi: int) -> None:
    """Every claim of meta against what each run did, and the host from outside."""
    iso = seen["isolation"]
    can = iso["run_can"]
    held, lacks = " ".join(iso["holds"]), " ".join(iso["does_not_hold"])
    warning = seen["warnings"][0]
    if landlock == "auto":  # this kernel offers it: applied, at the ABI the kernel says
        assert iso["landlock"] is True and iso["landlock_abi"] == abi, iso
        assert can["write"] is False
        assert "cannot write outside its own temporary folder" in warning, warning
        assert "cannot write anywhere but beneath its own temporary folder" in held
    else:
        assert iso["landlock"] is False and iso["landlock_abi"] is None
        assert iso["landlock_reason"] == "STUDIO_CODE_SUBPROCESS_LANDLOCK=off"
        assert can["write"] is True
        assert "It can also write" in warning, warning
        assert "write every file" in lacks, lacks
    assert "write" in warning and "NOT in a sandbox" in warning
    assert ("It can signal a process outside its run" in warning) is can["signal"], warning
    assert ("it sees every process of the host" in warning) is can["see"], warning
    # the server's folders: covered (hidden) whenever they can be, and meta says so
    covered = not can["server_files"]
    assert covered is (iso["separate_uids"] or iso["namespaces"]), iso
    assert ("are each covered" in held) is covered, held
    assert ("but not the server's own folders" in warning) is covered, warning
    assert can["keyrings"] is False and "refuses the kernel keyrings" in held, iso
    for tag in TAGS:
        run = seen["runs"][tag]
        assert run["status"] == "succeeded", (tag, run)
        out = run["output"]
        # write: every attempt outside its folder is refused exactly when meta says so (a
        # covered folder's files cannot be named at all)
        for k, v in out["outside"].items():
            reachable = k == "create_in_tmp" or not covered
            assert (v == "ok") is (can["write"] and reachable), (tag, k, v, can)
        # stat, chmod, utime, setxattr, lock (Landlock covers none of these), list: the
        # cover refuses every one; without it the run's uid (a non-root server's) may
        server = out["server_files"]
        if covered:
            refused = {"EACCES", "ENOENT", "EROFS", "EPERM", "another inode (a cover)"}
            assert set(server.values()) <= refused, (tag, server)
        else:
            assert set(server.values()) == {"ok"}, (tag, server)
        # keyrings: refused by the seccomp filter (the cold run finds nothing either)
        keys = out["keyrings"]
        assert keys["add_user"] == keys["add_persistent"] == "EPERM", (tag, keys)
        assert keys["find_previous"] in (None, "EPERM"), (tag, keys)
        assert out["own_folder"] == "ok" and out["dev_null"] == "ok", (tag, out)
        # under Landlock tempfile skips /tmp (refused) for the run's own folder
        assert out["tempfile_in_own_folder"] is (not can["write"]), out
        # read: still holds for what is not covered, and meta says so
        assert can["read"] is True, can
        reads = set(out["read"].values())
        assert reads == ({"EACCES"} if covered else {"ok"}), (tag, out["read"])
        # signal / see: the helper this test started, exactly as meta says
        for sig in ("signal0", "sigcont"):
            assert (out[sig] == "ok") is can["signal"], (tag, sig, out[sig], can)
        assert out["sees"] is can["see"], (tag, out["sees"], can)
        # an abstract socket and the helper's environment: refused where meta says so
        scoped = "connect to an abstract Unix socket made outside its run" in held
        assert (out["abstract"] != "ok") is scoped, (out["abstract"], held)
        assert scoped is (landlock == "auto" and abi >= 6)
        if landlock == "auto":
            assert out["abstract"] == "EPERM"
            assert "read the memory or environment" in held and out["environ"] != "ok"
        # and from outside: the server's files changed exactly when meta says they can be
        writes = can["write"] and not covered
        victim = paths[f"victim-{tag}"]
        assert (victim.read_text() == "the server's own") is (not writes), tag
        assert paths[f"doomed-{tag}"].exists() is (not writes), tag
        made = [p for p in (*paths["data"].iterdir(), *paths["home"].iterdir()) if "-" in p.name]
        made = [p for p in made if p.name.split("-")[0] in ("new", "dir", "link", ".profile")]
        assert bool(made) is writes, made
    for what in ("data", "store", "secret"):  # from outside: no xattr was set
        has = "user.studio" in os.listxattr(paths[what])
        assert has is (not covered), (what, os.listxattr(paths[what]))


@pytest.mark.parametrize(
    "landlock, namespaces",
    [("auto", "off"), ("off", "off"), ("auto", "auto")],
    ids=["landlock", "no-landlock", "landlock+namespaces"],
)
def test_a_non_root_servers_runs_write_only_their_own_folder(
    landlock: str, namespaces: str
) -> None:
    """A server of an unprivileged uid, its data folder and home its own (0700, files
    0600): a pre-started run and a cold one. Without namespaces (the first two), the helper
    ``sleep`` of the server's uid is in the run's reach but for Landlock's scopes."""
    abi = _landlock_abi()
    base = Path(tempfile.mkdtemp(prefix="studio-ll-"))
    os.chmod(base, 0o755)
    paths = _data_folder(base, SERVER_UID, 0o700, 0o600)
    helper = subprocess.Popen(
        ["/bin/sleep", "300"], user=SERVER_UID, group=SERVER_UID, extra_groups=[]
    )
    abstract = Abstract()
    token = uuid.uuid4().hex[:10]
    state = _state(paths, token, helper.pid, abstract)
    try:
        server = non_root_python(
            SERVER,
            *(str(paths["data"]), landlock, namespaces, PROBE, json.dumps(state)),
            uid=SERVER_UID,
            env={"HOME": str(paths["home"])},
            marker="x",
            cwd=base,
            stdin=subprocess.DEVNULL,
        )
        seen = last_json_line(server, 120)
        assert helper.poll() is None  # SIGCONT and signal 0 only: it sleeps on
        pool = seen["pool"]["languages"]["python"]
        assert (pool["hits"], pool["misses"]) == (1, 1), pool  # one pre-started, one cold
        iso = seen["isolation"]
        assert iso["namespaces"] is (namespaces == "auto"), iso["namespaces_reason"]
        _check(seen, paths, landlock, abi)
    finally:
        helper.kill()
        helper.wait()
        abstract.close()
        shutil.rmtree(base, ignore_errors=True)
        for tag in TAGS:  # what a run without Landlock made in /tmp (not swept: not root)
            Path(f"/tmp/studio-ll-{token}-{tag}").unlink(missing_ok=True)


@pytest.mark.parametrize("landlock", ["auto", "off"], ids=["landlock", "no-landlock"])
def test_a_root_servers_runs_write_only_their_own_folder(  # type: ignore[no-untyped-def]
    landlock: str, make_settings, monkeypatch
) -> None:
    """A root server whose data folder and home are world-writable (0777, files 0666): the
    run's own uid would let it write them all, so Landlock is what refuses. The helper is
    root's: no run uid may signal it, Landlock or not."""
    from executor.meta import runtime_meta
    from executor.models import CodeJob
    from executor.service import Executor
    from executor.store import open_store

    abi = _landlock_abi()
    base = Path(tempfile.mkdtemp(prefix="studio-ll-"))
    os.chmod(base, 0o755)
    paths = _data_folder(base, 0, 0o777, 0o666)
    monkeypatch.setenv("HOME", str(paths["home"]))  # the server's home: covered too
    helper = subprocess.Popen(["/bin/sleep", "300"])
    abstract = Abstract()
    token = uuid.uuid4().hex[:10]
    state = _state(paths, token, helper.pid, abstract)
    settings = make_settings(
        code_runtime="subprocess",
        code_languages="python",
        data_dir=paths["data"],
        code_prewarm=1,
        code_subprocess_landlock=landlock,
    )
    open_store(settings.sqlalchemy_url).close()
    os.chmod(paths["store"], 0o666)
    ex = Executor(settings)
    try:
        ex.prepare()
        assert ex.runtime.pool.wait_ready(30)  # type: ignore[union-attr]
        runs = {}
        for tag, memory in (("prestarted", None), ("cold", 200 << 20)):
            job = CodeJob(
                code=PROBE,
                state_json=json.dumps({**state, "tag": tag}),
                timeout_s=30,
                memory_bytes=memory,
            )
            r = ex.run(job)
            runs[tag] = {"status": str(r.status), "output": r.output, "logs": r.logs}
        pool = ex.runtime.pool_stats()["languages"]["python"]  # type: ignore[union-attr]
        assert (pool["hits"], pool["misses"]) == (1, 1), pool
        meta = runtime_meta(ex)  # after: its readiness check runs a program
        seen = {
            "isolation": meta["subprocess_isolation"],
            "warnings": meta["warnings"],
            "runs": runs,
        }
        assert seen["isolation"]["separate_uids"] is True
        _check(seen, paths, landlock, abi)
    finally:
        ex.close()
        helper.kill()
        helper.wait()
        abstract.close()
        shutil.rmtree(base, ignore_errors=True)


def test_a_kernel_without_landlock_is_named_and_meta_says_runs_write(
    make_settings, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """An old kernel (faked: this one has Landlock, proved above): the reason is named, the
    runs go on as before, and meta and the warning say they can write."""
    from executor.runtimes.subprocess import landlock, runtime

    monkeypatch.setattr(
        landlock, "abi_version", lambda: (0, "the kernel has no Landlock (Linux before 5.13)")
    )
    settings = make_settings(code_runtime="subprocess", code_languages="python")
    abi, why = runtime._landlock(settings)
    assert (abi, why) == (0, "the kernel has no Landlock (Linux before 5.13)")
    monkeypatch.setattr(runtime.os, "getuid", lambda: SERVER_UID)  # a non-root server's
    report = runtime.isolation_report(
        settings, None, None, "off", namespaces_note=None, undumpable=True, landlock_note=why
    )
    assert report["landlock"] is False and report["landlock_reason"] == why
    assert report["run_can"] == {
        "read": True,
        "write": True,
        "signal": False,
        "see": False,
        "server_files": True,  # no cover asked for here
        "keyrings": True,
    }
    lacks = " ".join(report["does_not_hold"])
    assert "read and write every file the server can" in lacks and why in lacks
    assert "It can also write every file" in runtime.startup_warning(report)


def test_an_abi_2_ruleset_leaves_truncate_open_and_meta_says_so(make_settings, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Linux 5.19 to 6.1 (Landlock ABI 2) cannot refuse truncate(2). This kernel enforces an
    ABI 2 ruleset as such a kernel would (the rights it handles are ABI 2's): a real run
    empties a world-writable data file and creates nothing, and meta says it can write."""
    from executor.meta import runtime_meta
    from executor.models import CodeJob
    from executor.runtimes.subprocess import runtime
    from executor.service import Executor

    require(_landlock_abi() >= 2, "this kernel's Landlock is older than ABI 2")
    monkeypatch.setattr(runtime, "_landlock", lambda settings: (2, None))
    base = Path(tempfile.mkdtemp(prefix="studio-ll-"))
    os.chmod(base, 0o755)
    paths = _data_folder(base, 0, 0o777, 0o666)
    paths["store"].write_text("a store")
    os.chmod(paths["store"], 0o666)
    helper = subprocess.Popen(["/bin/sleep", "300"])
    abstract = Abstract()
    try:
        ex = Executor(make_settings(code_runtime="subprocess", code_languages="python"))
        state = _state(paths, uuid.uuid4().hex[:10], helper.pid, abstract)
        r = ex.run(CodeJob(code=PROBE, state_json=json.dumps({**state, "tag": "cold"})))
        meta = runtime_meta(ex)
    finally:
        helper.kill()
        helper.wait()
        abstract.close()
    try:
        iso = meta["subprocess_isolation"]
        assert iso["landlock_abi"] == 2 and iso["run_can"]["write"] is True
        assert "truncate(2)" in " ".join(iso["does_not_hold"])
        assert "empty a file it may write with truncate(2)" in meta["warnings"][0]
        assert r.output is not None, (r.status, r.error, r.logs)
        outside = dict(r.output["outside"])
        assert outside.pop("truncate_a_data_file") == "ok"  # what ABI 2 leaves open...
        assert paths["victim-cold"].read_text() == ""  # ...seen from outside: emptied
        assert set(outside.values()) == {"EACCES"}, outside  # the rest is refused
        assert r.output["abstract"] == "ok"  # no scopes before ABI 6: meta does not claim it
        assert "abstract Unix socket" not in " ".join(iso["holds"])
    finally:
        shutil.rmtree(base, ignore_errors=True)


#: a run that leaves a key in its uid's user keyring, or looks for one a run left before
KEYRING_PROBE = r"""
import ctypes, errno, os, platform

ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
USER_KEYRING, SEARCH, READ = -4, 10, 11
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(*args):
    ret = libc.syscall(*args)
    return ret if ret >= 0 else errno.errorcode[ctypes.get_errno()]

def main(state):
    desc = state["desc"].encode()
    if state["leave"]:
        secret = b"another user's secret"
        seen = call(ADD_KEY, b"user", desc, secret, len(secret), USER_KEYRING)
    else:
        key = call(KEYCTL, SEARCH, USER_KEYRING, b"user", desc, 0)
        seen = key
        if isinstance(key, int):
            buf = ctypes.create_string_buffer(64)
            n = call(KEYCTL, READ, key, buf, 64)
            seen = buf.raw[:n].decode() if isinstance(n, int) else n
    return {"uid": os.getuid(), "seen": seen if isinstance(seen, str) else "ok"}
"""


def test_a_root_servers_next_run_of_a_uid_reads_nothing_from_its_keyring(make_settings) -> None:  # type: ignore[no-untyped-def]
    """A root server with ONE run uid: two runs in turn (another user's each) have the same
    uid. The first tries to leave a key in its user keyring, the second to read it: the
    seccomp filter refuses both (EPERM, as the Docker sandboxes' profile does)."""
    from executor.meta import runtime_meta
    from executor.models import CodeJob
    from executor.service import Executor

    uid = 201_777  # no account; outside the default range
    settings = make_settings(
        code_runtime="subprocess",
        code_languages="python",
        code_prewarm=0,
        code_subprocess_uids=f"{uid}-{uid}",
    )
    ex = Executor(settings)
    desc = f"studio-fence-{uuid.uuid4().hex[:10]}"
    try:
        seen = []
        for leave in (True, False):
            state = json.dumps({"desc": desc, "leave": leave})
            r = ex.run(CodeJob(code=KEYRING_PROBE, state_json=state, timeout_s=30))
            assert r.output is not None, (r.status, r.error, r.logs)
            seen.append(r.output)
        can = runtime_meta(ex)["subprocess_isolation"]["run_can"]
    finally:
        ex.close()
    assert [s["uid"] for s in seen] == [uid, uid]  # the same uid, one run after the other
    assert [s["seen"] for s in seen] == ["EPERM", "EPERM"], seen
    assert can["keyrings"] is False


#: a run under a server whose Python (a virtualenv) is in its covered home
EXPOSED_PROBE = (
    PRELUDE
    + r"""
def main(state):
    home = state["home"]
    with open("mine", "w") as f:
        f.write("ok")
    return {
        "prefix": sys.prefix,
        "cwd": os.getcwd(),
        "own_file": open("mine").read(),
        "list_home": attempt(lambda: os.listdir(home)),
        "list_parent": attempt(lambda: os.listdir("..")),
        "read_data_file": attempt(lambda: open(f"{home}/data/secret.key").read()),
        "chmod_venv": attempt(lambda: os.chmod(f"{home}/venv", 0o700)),
        "create_in_venv": attempt(lambda: open(f"{home}/venv/new", "w").close()),
    }
"""
)

EXPOSED_SERVER = r"""
import json, os, sys
from executor.meta import runtime_meta
from executor.models import CodeJob
from executor.service import Executor
from executor.settings import load_settings

home, code = sys.argv[1:3]
settings = load_settings(enable_code_nodes=True, code_runtime="subprocess",
                         code_languages="python", data_dir=f"{home}/data",
                         python=f"{home}/venv/bin/python", code_prewarm=0)
ex = Executor(settings)
r = ex.run(CodeJob(code=code, state_json=json.dumps({"home": home}), timeout_s=30))
iso = runtime_meta(ex)["subprocess_isolation"]
print(json.dumps({"status": str(r.status), "output": r.output, "logs": r.logs,
                  "error": r.error and r.error.message, "covered": iso["covered"]}))
ex.close()
"""


def test_what_a_run_needs_beneath_a_cover_is_bound_back_read_only() -> None:
    """A non-root server whose interpreter is a virtualenv in its home, and whose runs'
    folders (TMPDIR) are in its data folder, both covered: the run starts (the virtualenv
    is bound back, read-only), works in its own folder (bound back, writable), and sees
    nothing else of the home or the data folder, not even through ``..``."""
    base = Path(tempfile.mkdtemp(prefix="studio-ll-"))
    os.chmod(base, 0o755)
    home = base / "home"
    for d in (home, home / "data", home / "data" / "tmp"):
        d.mkdir()
        os.chown(d, SERVER_UID, SERVER_UID)
    os.chmod(home, 0o700)
    (home / "data" / "secret.key").write_text("the server's own")
    os.chown(home / "data" / "secret.key", SERVER_UID, SERVER_UID)
    try:
        subprocess.run(
            ["/usr/bin/python3", "-m", "venv", "--without-pip", str(home / "venv")],
            user=SERVER_UID,
            group=SERVER_UID,
            extra_groups=[],
            check=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        server = non_root_python(
            EXPOSED_SERVER,
            str(home),
            EXPOSED_PROBE,
            uid=SERVER_UID,
            env={"HOME": str(home), "TMPDIR": str(home / "data" / "tmp")},
            marker="x",
            cwd=base,
            stdin=subprocess.DEVNULL,
        )
        seen = last_json_line(server, 60)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert seen["covered"] == ["the data folder", "the server's home"], seen
    assert seen["status"] == "succeeded", seen
    out = seen["output"]
    assert out["prefix"] == str(home / "venv") and out["own_file"] == "ok", out
    assert out["cwd"].startswith(str(home / "data" / "tmp") + "/"), out
    assert out["list_home"] == out["list_parent"] == "EACCES", out
    assert out["read_data_file"] in ("ENOENT", "EACCES"), out  # not there in the cover
    assert out["chmod_venv"] == "EROFS" and out["create_in_venv"] in ("EROFS", "EACCES"), out
