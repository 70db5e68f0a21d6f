"""The pre-import memory in the API's meta and `studio-code meta` (issue 34: "memory used by
pre-imports is counted against the sandbox's own limit and shown in meta"): a real Celery
worker (prefork) keeps pre-started sandboxes that import STUDIO_CODE_PREIMPORT; its pool
process measures one from the host (executor/runtimes/docker/preimport_memory.py) and hands
the figure to the worker's main process, whose heartbeat announces it in a real Redis
(worker/preimport.py); GET /api/meta/runtime (``studio-code serve``) and `studio-code meta`
read it from there. Without pre-started sandboxes, or without a pre-import, they say that
nothing is pre-imported, with null figures rather than 0. Real Docker, the real image."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.api import ApiServer
from testkit.processes import wait_for
from testkit.redis import RedisServer, start_redis
from testkit.stack import DOCKER_PYTHON, Stack
from tests.conftest import run_cli

pytestmark = [pytest.mark.docker, pytest.mark.redis]

MODULES = "pydantic.main,dateutil.parser"
MIB = 2**20


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with start_redis(tmp_path_factory.mktemp("preimport-meta")) as r:
        yield r


@contextmanager
def _serving(
    redis: RedisServer, tmp: Path, image: str, name: str, **settings: Any
) -> Iterator[Stack]:
    """A worker (one pool process) and the API (``studio-code serve``) on the module's Redis,
    ``settings`` on top."""
    with Stack(
        tmp,
        redis_url=redis.url,
        **DOCKER_PYTHON,
        code_image=image,
        queue_heartbeat_interval_s=1,
        **settings,
    ) as stack:
        stack.start_worker(name, 1)
        stack.start_api()
        yield stack


def _cli_meta(env: dict[str, str]) -> dict[str, Any]:
    proc = run_cli("meta", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(proc.stdout))


def _same_from_both(api: ApiServer, env: dict[str, str]) -> tuple[Any, Any]:
    """``preimport`` from the API and from `studio-code meta`, read while it held still: the
    figures are live (a refilled pool measures again, a heartbeat comes each second), so the
    command's is taken between two equal API reads (tried a few times)."""
    for _ in range(5):
        before = httpx.get(f"{api.base}/api/meta/runtime", timeout=60).json()["preimport"]
        cli = _cli_meta(env)["preimport"]
        after = httpx.get(f"{api.base}/api/meta/runtime", timeout=60).json()["preimport"]
        if before == after:
            return after, cli
    raise AssertionError(f"the API's preimport never held still: {before} / {after}")


def _python(api: ApiServer, node: str, measured: bool) -> dict[str, Any]:
    """The API's meta once it lists worker ``node`` (and, ``measured``, its figure)."""
    seen: dict[str, Any] = {}

    def ready() -> dict[str, Any] | None:
        nonlocal seen
        seen = httpx.get(f"{api.base}/api/meta/runtime", timeout=60).json()
        workers = seen["preimport"]["workers"]
        if node not in workers:
            return None  # not announced yet
        worker = workers[node]
        assert worker is not None, (
            f"{node}'s heartbeat announces no pre-import: {seen['preimport']}"
        )
        if measured and not worker["languages"]["python"]["idle_memory_bytes"]:
            return None
        return seen

    return dict(
        wait_for(
            ready, 240, f"{node} in the API's meta", 0.5, describe=lambda: seen.get("preimport")
        )
    )


@pytest.mark.timeout(600)
def test_the_api_and_the_cli_show_the_workers_pre_import_memory(
    redis: RedisServer, tmp_path: Path, python_image: str, docker_client: Any
) -> None:
    from executor.runtimes.docker.usage import cgroup_host
    from executor.settings import Settings

    if cgroup_host(Settings()) is None:
        pytest.skip("this host's cgroups cannot be read from here: nothing is measured")
    with _serving(
        redis, tmp_path, python_image, "preimport", code_prewarm=1, code_preimport=MODULES
    ) as stack:
        worker, api = stack.workers[0], stack.api
        assert api is not None
        meta = _python(api, worker.node, measured=True)
        pre = meta["preimport"]
        print("meta preimport:", json.dumps(pre, indent=1))
        python = pre["languages"]["python"]
        assert python["modules"] == MODULES.split(",")
        assert python["workers"] == 1 and python["note"] is None
        idle, without = python["idle_memory_bytes"], python["without_preimport_bytes"]
        added = python["preimport_bytes"]
        # one worker: its figure is the median and the largest
        assert idle["median"] == idle["max"] and added["median"] == added["max"]
        assert added["median"] == idle["median"] - without["median"]
        # pydantic alone holds megabytes; an idle sandbox holds far less than its limit
        assert 1 * MIB < added["median"] < 200 * MIB, added
        assert 1 * MIB < without["median"] < idle["median"] < python["memory_limit_bytes"]
        assert python["memory_limit_bytes"] == 256 * MIB  # STUDIO_CODE_MEMORY's default
        announced = pre["workers"][worker.node]["languages"]["python"]
        assert announced["source"].startswith("host, cgroup-v"), announced
        assert announced["processes"] == 1 and announced["idle_memory_bytes"] == idle["max"]
        # the API process keeps no pool: its own figure stays null, as before
        assert meta["pool"]["preimport_memory"]["python"]["idle_memory_bytes"] is None
        # `studio-code meta` is the same document, built by the same code
        api_pre, cli_pre = _same_from_both(api, stack.env())
        assert cli_pre == api_pre


@pytest.mark.timeout(600)
def test_without_a_pool_or_a_pre_import_they_say_nothing_is_pre_imported(
    redis: RedisServer, tmp_path: Path, python_image: str
) -> None:
    with _serving(redis, tmp_path, python_image, "cold", code_prewarm=0) as stack:
        worker, api = stack.workers[0], stack.api
        assert api is not None
        meta = _python(api, worker.node, measured=False)
        python = meta["preimport"]["languages"]["python"]
        assert python["note"].startswith("nothing is pre-imported: no live worker keeps pre-")
        assert python["workers"] == 0 and python["modules"] == []
        for figure in ("idle_memory_bytes", "without_preimport_bytes", "preimport_bytes"):
            assert python[figure] is None, python
        assert meta["preimport"]["workers"][worker.node] == {"pooled": False, "languages": {}}
        api_pre, cli_pre = _same_from_both(api, stack.env())
        assert cli_pre == api_pre == meta["preimport"]
    # pre-started sandboxes that import nothing: their idle memory shows, no pre-import cost
    with _serving(redis, tmp_path, python_image, "pooled", code_prewarm=1) as stack:
        worker, api = stack.workers[0], stack.api
        assert api is not None
        meta = _python(api, worker.node, measured=False)
        python = meta["preimport"]["languages"]["python"]
        assert python["note"] == (
            "nothing is pre-imported: the workers' pre-started python sandboxes import nothing "
            "while they wait (STUDIO_CODE_PREIMPORT is empty on the workers)"
        )
        assert python["modules"] == [] and python["preimport_bytes"] is None
        assert meta["preimport"]["workers"][worker.node]["pooled"] is True
        cli = _cli_meta(stack.env())["preimport"]["languages"]["python"]
        assert cli["note"] == python["note"]
