"""Shared fixtures: real services only. A missing service skips a test on a laptop and
FAILS it when CI=true."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit import processes, xdist_groups
from testkit.postgres import POSTGRES_URL, pg_schema, pg_unreachable
from testkit.processes import ROOT, require
from testkit.reaper import stop_on_sigterm
from testkit.redis import RedisServer, start_redis
from testkit.sockguard import REAL_DOCKER_HOST, SockGuardProcess
from testkit.stack import Stack

#: the services each fixture needs, by the fixture's name: a test whose fixture closure has
#: one of these gets their markers (``pytest_collection_modifyitems``), so ``-m "not docker"``
#: and the others are true. A module adds its own fixtures in a ``SERVICE_FIXTURES`` dict of
#: the same shape (a module-scoped stack that starts its own redis-server, say). What a test
#: starts itself (testkit: start_redis, CeleryWorker) or takes by
#: ``request.getfixturevalue`` is checked when it runs (``testkit.processes.needs``,
#: ``_marked_for_what_it_uses``).
SERVICE_FIXTURES: dict[str, tuple[str, ...]] = {
    "docker_client": ("docker",),
    "redis_server": ("redis",),
    "postgres_url": ("postgres",),
    "deno_bin": ("deno",),
}
#: the markers of the services; ``make test-fast`` runs the tests with none of them (nor slow)
SERVICE_MARKERS = ("docker", "redis", "postgres", "deno", "compose")


def service_markers(item: pytest.Item, fixturenames: list[str]) -> set[str]:
    table = {**SERVICE_FIXTURES, **getattr(getattr(item, "module", None), "SERVICE_FIXTURES", {})}
    return {marker for f in fixturenames for marker in table.get(f, ())}


#: ``make test`` runs the suite on a few processes (pytest-xdist, ``--dist loadgroup``): each
#: module is one unit of work, kept on one process in its order (its module-scoped stacks
#: are made once), unless it names a group of its own with
#: ``pytestmark = pytest.mark.xdist_group("name")``: the modules of one group run one after
#: another on one process (never at the same time as each other). A new module joins with no
#: edit. The modules that hold a test marked ``slow`` are handed out first, so the longest
#: ones do not start last.
@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (testkit.xdist_groups)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)  # stable: the order within
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
        used = service_markers(item, getattr(item, "fixturenames", []))
        for name in sorted(used):
            item.add_marker(name)
        # the self-check of the fast tier: a test left with no service marker uses no
        # service fixture (a marker added above and then lost would show here)
        if not any(item.get_closest_marker(m) for m in SERVICE_MARKERS):
            assert not used, f"{item.nodeid} uses {used} but is not marked"


def pytest_configure(config: pytest.Config) -> None:
    # a SIGTERM (a CI job's timeout, an operator) ends the run as Ctrl-C does: pytest stops
    # and the fixtures' teardowns stop what they started; what a SIGKILL leaves behind,
    # each service's reaper stops (testkit/reaper.py)
    stop_on_sigterm(KeyboardInterrupt)
    # each module (or the group it names) on one process under --dist loadgroup
    if not config.pluginmanager.is_registered(xdist_groups):
        config.pluginmanager.register(xdist_groups, "studio-xdist-groups")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # before any fixture of the test (a module's stack too) is set up
    processes.CURRENT_MARKS = {m.name for m in item.iter_markers()}


@pytest.fixture(autouse=True)
def _marked_for_what_it_uses(request: pytest.FixtureRequest) -> Iterator[None]:
    """A service fixture taken by ``request.getfixturevalue`` is not in the closure the
    markers were derived from: the test must carry the marker itself (as a pytest.param's
    marks, for one parameter)."""
    yield
    marks = {m.name for m in request.node.iter_markers()}
    missing = service_markers(request.node, request.fixturenames) - marks
    assert not missing, f"{request.node.nodeid} needs {missing} (by getfixturevalue): mark it"


LABEL_JOB = "studio.job_id"
#: on every sandbox, used or pre-started (a pre-started one has no job id label yet)
LABEL_OWNER = "studio.owner"


#: forks until the process limit says no; it refuses to start as root, so it can only ever
#: run under a container's pids limit or the subprocess runtime's dropped-privilege nproc
FORK_BOMB = (
    "import os, time\n"
    "def main(state):\n"
    "    if os.getuid() == 0:\n"
    "        return {'forked': 0, 'error': 'refused to fork as root'}\n"
    "    n = 0\n"
    "    for _ in range(200):\n"
    "        try:\n"
    "            if os.fork() == 0:\n"
    "                time.sleep(30)\n"
    "                os._exit(0)\n"
    "            n += 1\n"
    "        except OSError as e:\n"
    "            return {'forked': n, 'error': e.strerror}\n"
    "    return {'forked': n, 'error': None}\n"
)


# --- Docker ---------------------------------------------------------------------------


#: STUDIO_TEST_THROUGH_SOCKGUARD=1: every executor and worker of the session reaches the
#: engine through a socket guard (``studio-code sockguard``) started for the session; the
#: tests' own checks (``docker_client``) still talk to the engine itself
THROUGH_SOCKGUARD = os.environ.get("STUDIO_TEST_THROUGH_SOCKGUARD") == "1"


@pytest.fixture(scope="session", autouse=True)
def _session_sockguard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if not THROUGH_SOCKGUARD:
        yield
        return
    guard = SockGuardProcess(tmp_path_factory.mktemp("sockguard"))
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = guard.host
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
        guard.stop()
        refused = guard.refusals()
        print(f"\nsocket guard log: {guard.log} ({len(refused)} refusals)")
        for line in refused:
            print(f"  {line}")


def _docker_client():  # type: ignore[no-untyped-def]
    try:
        import docker

        client = docker.DockerClient(base_url=REAL_DOCKER_HOST, timeout=30)
        client.ping()
        return client
    except Exception:  # noqa: BLE001 - any failure means "no engine"
        return None


#: the name of this process in an xdist run (``gw0``...; None: a run on one process)
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def _sandboxes(client) -> list[dict]:  # type: ignore[no-untyped-def]
    return list(client.api.containers(all=True, filters={"label": LABEL_OWNER}))


def _left_behind(client, before: set[str], ours_if_gone: bool) -> list[dict]:  # type: ignore[no-untyped-def]
    """The sandboxes this session made that are still there (not in ``before``), removed;
    a container still being removed by its runtime gets a moment to go."""
    left: list[dict] = []
    for _ in range(20):
        left = [
            c
            for c in _sandboxes(client)
            if c["Id"] not in before and _made_by_this_session(c, ours_if_gone)
        ]
        if not left:
            break
        time.sleep(0.25)
    for c in left:
        try:
            client.api.remove_container(c["Id"], force=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    return left


@pytest.fixture(scope="session")
def docker_client():  # type: ignore[no-untyped-def]
    client = _docker_client()
    require(client is not None, "no Docker engine reachable")
    before = {c["Id"] for c in _sandboxes(client)}
    yield client
    # The suite must leave no sandbox behind: whatever is left is a leak of the code path
    # that made it, so report it as an error after removing it. In an xdist process, only
    # those of its own live processes: one of a process that is gone may be another xdist
    # process's, still being cleaned up by its test; the controller looks for those once
    # every process has ended (``pytest_sessionfinish``).
    left = _left_behind(client, before, ours_if_gone=XDIST_WORKER is None)
    client.close()
    assert not left, f"sandbox containers left behind: {[c['Names'] for c in left]}"


@pytest.fixture(scope="session")
def deno_bin() -> str:
    """The deno binary of subprocess-mode TypeScript (a missing one skips, fails under CI)."""
    from executor.languages.typescript import deno_binary
    from executor.settings import load_settings

    path = deno_binary(load_settings())
    require(shutil.which(path) is not None, f"no deno binary ({path}): pip install deno")
    return path


def _xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin("dsession") and not hasattr(config, "workerinput")


_BEFORE = pytest.StashKey[set[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if _xdist_controller(session.config) and (client := _docker_client()) is not None:
        session.config.stash[_BEFORE] = {c["Id"] for c in _sandboxes(client)}
        client.close()


@pytest.hookimpl(tryfirst=True)  # before the terminal's summary
def pytest_sessionfinish(session: pytest.Session) -> None:
    """In the controller of an xdist run, the sandboxes of gone processes left by the run."""
    before = session.config.stash.get(_BEFORE, None)
    if before is None or (client := _docker_client()) is None:
        return
    left = _left_behind(client, before, ours_if_gone=True)
    client.close()
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"ERROR: sandbox containers left behind: {[c['Names'] for c in left]}", red=True
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _made_by_this_session(container: dict, ours_if_gone: bool = True) -> bool:
    """Started by this pytest process or one of its descendants (worker pools), or (with
    ``ours_if_gone``) by a process that is gone: another session's live sandboxes on a
    shared engine are not ours."""
    host, _, pid_text = container["Labels"].get("studio.owner", "").rpartition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if not Path(f"/proc/{pid}").exists():
        return ours_if_gone
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = _parent(pid)
    return False


def _ensure_image(client, tag: str, which: str) -> None:  # type: ignore[no-untyped-def]
    import docker

    try:
        client.images.get(tag)
        return
    except docker.errors.ImageNotFound:
        pass
    build = subprocess.run(
        [str(ROOT / "docker" / "build.sh"), which], cwd=ROOT, capture_output=True, text=True
    )
    require(build.returncode == 0, f"could not build {tag}: {build.stderr[-2000:]}")


@pytest.fixture(scope="session")
def python_image(docker_client) -> str:  # type: ignore[no-untyped-def]
    tag = os.environ.get("STUDIO_CODE_IMAGE", "studio-code:1")
    _ensure_image(docker_client, tag, "python")
    return tag


@pytest.fixture(scope="session")
def ts_image(docker_client) -> str:  # type: ignore[no-untyped-def]
    tag = os.environ.get("STUDIO_CODE_TS_IMAGE", "studio-code-ts:1")
    _ensure_image(docker_client, tag, "typescript")
    return tag


# --- Settings and executors ------------------------------------------------------------


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., object]:
    """Settings as an operator would set them, Code nodes on; keyword overrides win."""
    from executor.settings import load_settings

    def make(**overrides: object):  # type: ignore[no-untyped-def]
        base: dict[str, object] = {"enable_code_nodes": True, "data_dir": tmp_path}
        base.update(overrides)
        return load_settings(**base)

    return make


@pytest.fixture
def docker_executor(make_settings, python_image):  # type: ignore[no-untyped-def]
    from executor.service import Executor

    return Executor(make_settings(code_runtime="docker", code_image=python_image))


@pytest.fixture
def pooled(make_settings: Callable[..., Any], python_image: str) -> Iterator[Callable[..., Any]]:
    """Factory of executors with a filled pool (Python); closed at the end."""
    from executor.service import Executor

    made: list[Executor] = []

    def make(**overrides: Any) -> Executor:
        base = {"code_runtime": "docker", "code_image": python_image, "code_languages": "python"}
        ex = Executor(make_settings(**{**base, **overrides}))
        made.append(ex)
        ex.prepare()
        assert ex.runtime is not None and ex.runtime.pool is not None
        assert ex.runtime.pool.wait_ready(60)
        return ex

    yield make
    for ex in made:
        ex.close()


@pytest.fixture
def docker_pool_executor(make_settings, python_image):  # type: ignore[no-untyped-def]
    """A docker executor whose pool of pre-started sandboxes is filled (Python only), as in
    a worker's pool process; its idle sandboxes are removed at the end."""
    from executor.service import Executor

    ex = Executor(
        make_settings(code_runtime="docker", code_image=python_image, code_languages="python")
    )
    ex.prepare()
    assert ex.runtime.pool is not None and ex.runtime.pool.wait_ready(60)
    yield ex
    ex.close()


@pytest.fixture
def subprocess_prewarm() -> int:
    """STUDIO_CODE_PREWARM of ``make_subprocess_executor``: 0 (cold runners). A module
    overrides it with ``prewarm_both_ways`` to run its tests against pre-started ones too."""
    return 0


#: a module's ``subprocess_prewarm`` that runs each test with cold and pre-started runners
#: (2 of them: a test's two concurrent runs both get one)
prewarm_both_ways = pytest.fixture(params=[0, 2], ids=["cold", "prestarted"])(
    lambda request: request.param
)


@pytest.fixture
def make_subprocess_executor(make_settings, subprocess_prewarm):  # type: ignore[no-untyped-def]
    """Executors of the subprocess runtime (keyword settings win); with
    ``subprocess_prewarm`` > 0 prepared like a worker's, their runners started, and every
    run of the test must have been given a pre-started one. Closed at the end."""
    from executor.service import Executor

    made: list[Executor] = []

    def make(**overrides: object) -> Executor:
        settings = {"code_runtime": "subprocess", "code_prewarm": subprocess_prewarm}
        ex = Executor(make_settings(**{**settings, **overrides}))
        made.append(ex)
        if subprocess_prewarm:
            ex.prepare()
            assert ex.runtime.pool.wait_ready(30), ex.runtime.pool_stats()  # type: ignore[union-attr]
        return ex

    yield make
    for ex in made:
        stats = ex.runtime.pool_stats() if ex.runtime is not None else None
        ex.close()
        if subprocess_prewarm:
            assert stats is not None
            langs = stats["languages"].values()
            assert sum(s["hits"] for s in langs) >= 1 and not any(s["misses"] for s in langs), (
                f"a run of the prestarted variant did not get a pre-started runner: {stats}"
            )


@pytest.fixture
def subprocess_executor(make_subprocess_executor):  # type: ignore[no-untyped-def]
    return make_subprocess_executor()


# --- Redis and PostgreSQL ---------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with start_redis(tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url() -> str:
    why = pg_unreachable(POSTGRES_URL)
    require(why is None, str(why))
    return POSTGRES_URL


@pytest.fixture
def pg_schema_url(postgres_url: str) -> Iterator[str]:
    """postgres_url with a fresh schema of its own (dropped afterwards): the run store's
    tables of this test only, so tests and sessions never see each other's jobs."""
    with pg_schema(postgres_url) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty run store of the test's own: a SQLite file, or a PostgreSQL schema
    (``pg_schema_url``). A module may define its own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'runs.db'}"
    else:
        yield request.getfixturevalue("pg_schema_url")


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Run the real `studio-code` console script; returns the CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    exe = Path(sys.executable).with_name("studio-code")
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, env=full_env, timeout=timeout
    )


# --- the queue of one test ------------------------------------------------------------------


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store' / 'studio-code.db'}"


@pytest.fixture
def make_stack(
    redis_server: Any, sqlite_url: str, tmp_path: Path, python_image: str
) -> Iterator[Callable[..., Stack]]:
    """Factory: ``make_stack(**settings_overrides)`` -> a Stack on the test's redis-server and
    SQLite store, two slots unless told (stopped, with its workers, at the end)."""
    made: list[Stack] = []

    def make(database_url: str = sqlite_url, **overrides: Any) -> Stack:
        stack = Stack(
            tmp_path,
            redis_url=redis_server.url,
            database_url=database_url,
            code_image=python_image,
            **{"code_concurrency": 2, **overrides},
        )
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.stop()
