"""Heavy imports before the job (issue 34): a pre-started sandbox imports STUDIO_CODE_PREIMPORT
(``image``: the packages the image lists) while it waits, inside the same fresh container its
one job then uses; a cold run imports nothing ahead; nothing carries from one job to the
next; a job that comes before the imports are done is not held for the rest. What each
sandbox had imported is reported from inside it, by the node's own code (which imports
nothing itself). Real Docker, the real image (STUDIO_CODE_IMAGE)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from executor.models import CodeJob, Status
from testkit.processes import wait_for
from testkit.sandboxes import pool_containers

SEEN = (
    "import os, sys\n"
    "def main(state):\n"
    "    mark = getattr(sys.modules.get('dateutil'), 'LEFT_BY_A_JOB', None)\n"
    "    if state.get('leave'):\n"
    "        import dateutil\n"
    "        dateutil.LEFT_BY_A_JOB = 1\n"
    "    return {'imported': sorted(m for m in ('pydantic', 'dateutil', 'no_such_module_i34')\n"
    "                                if m in sys.modules),\n"
    "            'env': os.environ.get('STUDIO_PREIMPORT'), 'mark': mark}\n"
)


def _waiting(ex: Any, docker_client: Any) -> None:
    """Until every idle pre-started sandbox's CPU time stops growing over half a second: its
    runner is done importing and blocked on its stdin (a wait, not a timing assertion)."""
    assert ex.runtime.pool.wait_ready(60)
    cids = [p.cid for p in ex.runtime.pool._idle["python"]]

    def cpu() -> list[int]:
        return [
            docker_client.api.stats(c, stream=False, one_shot=True)["cpu_stats"]["cpu_usage"][
                "total_usage"
            ]
            for c in cids
        ]

    def still() -> bool:
        before = cpu()
        time.sleep(0.5)
        return cpu() == before

    wait_for(still, 120, "the pre-started sandbox to finish its pre-import")


def _run(ex: Any, state: str = "{}") -> tuple[dict[str, Any], str]:
    """The node's report from inside its sandbox, and where the sandbox came from."""
    r = ex.run(CodeJob(code=SEEN, state_json=state, timeout_s=20))
    assert r.status is Status.SUCCEEDED, r.error
    start = next(t.detail for t in r.trace if t.step == "sandbox.start")
    return r.output, start


def test_a_prestarted_sandbox_has_the_image_packages_imported_before_its_job(
    pooled: Any, docker_client: Any
) -> None:
    ex = pooled(code_preimport="image")
    _waiting(ex, docker_client)
    seen, start = _run(ex)
    assert start == "pool"
    assert seen == {"imported": ["dateutil", "pydantic"], "env": None, "mark": None}
    # the next job: a fresh container, pre-imported again, nothing of the first job's left
    _waiting(ex, docker_client)
    first, _ = _run(ex, '{"leave": true}')
    _waiting(ex, docker_client)
    second, start = _run(ex)
    assert start == "pool" and first["mark"] is None and second["mark"] is None
    assert second["imported"] == ["dateutil", "pydantic"]


def test_a_named_list_is_imported_and_a_missing_module_left_to_the_job(
    pooled: Any, docker_client: Any
) -> None:
    ex = pooled(code_preimport="no_such_module_i34,dateutil")
    _waiting(ex, docker_client)
    seen, start = _run(ex)
    assert start == "pool" and seen["imported"] == ["dateutil"]


def test_a_job_already_there_is_not_held_for_the_list(tmp_path: Path) -> None:
    """The runner stops pre-importing once its stdin has bytes (a job that comes early waits
    for one module's import at most). Here the job is in the stdin file before the runner
    starts (the runner on this host's Python, as in subprocess mode): nothing is imported
    ahead."""
    from executor.languages.python import RUNNER_SOURCE

    job = tmp_path / "job"
    code = (
        "import sys\ndef main(state):\n"
        "    return sorted(m for m in ('decimal', 'fractions') if m in sys.modules)\n"
    )
    job.write_text(json.dumps({"code": code}) + "\n{}")
    with job.open("rb") as stdin:
        out = subprocess.run(
            [sys.executable, "-I", "-c", RUNNER_SOURCE, "65536"],
            stdin=stdin,
            capture_output=True,
            env={"STUDIO_PREIMPORT": "decimal,fractions"},
            timeout=60,
        )
    assert json.loads(out.stdout) == {"ok": True, "output": []}, out.stderr


def test_without_the_setting_and_cold_nothing_is_imported_ahead(
    pooled: Any, make_settings: Any, python_image: str
) -> None:
    from executor.service import Executor

    seen, start = _run(pooled())
    assert start == "pool" and seen["imported"] == []
    cold = Executor(
        make_settings(code_runtime="docker", code_image=python_image, code_preimport="image")
    )
    seen, start = _run(cold)
    assert start != "pool" and seen["imported"] == []


def test_meta_shows_the_setting(make_settings: Any) -> None:
    from executor.meta import runtime_meta
    from executor.service import Executor

    ex = Executor(make_settings(code_runtime="subprocess", code_preimport=" pandas, numpy ,pandas"))
    pool = runtime_meta(ex)["pool"]
    assert pool["preimport"] == "pandas,numpy"
    assert pool["preimport_memory"] is None  # no Docker sandboxes: nothing to measure


def _memory(ex: Any) -> dict[str, Any]:
    """Meta's figure for the Python pool of ``ex``, once its pool has measured it."""
    from executor.meta import runtime_meta

    def shown() -> dict[str, Any] | None:
        got = runtime_meta(ex)["pool"]["preimport_memory"]["python"]
        return got if got["idle_memory_bytes"] is not None else None

    wait_for(shown, 180, "the pool to measure its idle sandbox")
    got = shown()
    assert got is not None
    return got


@pytest.mark.timeout(400)
def test_meta_shows_the_memory_pre_imports_hold_measured_by_the_host(
    pooled: Any, docker_client: Any
) -> None:
    """What an idle pre-started sandbox holds once its pre-imports are done, read by the host
    from its cgroup: more than a sandbox without pre-import holds (measured both by the
    pool itself, side by side, and by another pool with no pre-import at all), and below the
    sandbox's own memory limit, against which it counts."""
    from executor.runtimes.docker.usage import cgroup_host

    ex = pooled(code_preimport="pydantic.main,dateutil.parser", code_prewarm=1)
    if cgroup_host(ex.settings) is None:
        pytest.skip("this process cannot read the sandboxes' cgroups")
    before = _memory(ex)
    bare = pooled(code_prewarm=1)
    without = _memory(bare)
    print("pre-import memory:", before, "without pre-import (another pool):", without)
    assert before["modules"] == ["pydantic.main", "dateutil.parser"]
    assert before["source"].startswith("host, cgroup-v")
    # pydantic alone holds megabytes: the pre-imported sandbox holds more, by over 1 MiB
    assert before["idle_memory_bytes"] > before["without_preimport_bytes"] + 2**20
    assert before["idle_memory_bytes"] > without["idle_memory_bytes"] + 2**20
    assert without["without_preimport_bytes"] == without["idle_memory_bytes"]
    assert before["memory_limit_bytes"] == ex.settings.memory_bytes
    assert 0 < before["without_preimport_bytes"] < before["idle_memory_bytes"]
    assert before["idle_memory_bytes"] < before["memory_limit_bytes"]
    # the sandbox measured without pre-import went, like any other one not handed out
    wait_for(
        lambda: len(pool_containers(docker_client, ex.runtime.pool.owner)) <= 2,
        60,
        "the sandbox measured aside to be removed",
    )


@pytest.mark.parametrize("value", ["pandas,numpy-x", "image,pandas", "../etc"])
def test_a_bad_preimport_setting_is_refused_naming_the_entry(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from executor.settings import load_settings

    monkeypatch.setenv("STUDIO_CODE_PREIMPORT", value)
    with pytest.raises(
        Exception, match="STUDIO_CODE_PREIMPORT entry '(numpy-x|image|../etc)' (is not|stands)"
    ):
        load_settings()
