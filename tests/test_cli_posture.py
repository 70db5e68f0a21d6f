"""The engine posture's refusal and meta, through the `studio-code` CLI (issue 30, item 9).

* ``studio-code run`` with STUDIO_CODE_ENGINE_REFUSE_VULNERABLE=1 on this machine's engine
  (runc 1.1.5: CVE-2025-31133, CVE-2025-52565, CVE-2025-52881) is refused, RUNTIME_UNAVAILABLE
  naming the advisories, and starts no container; without the setting it runs.
* ``studio-code meta`` prints the document of GET /api/meta/runtime (the same keys, the
  workers and each worker's engine from their heartbeats, the fair share), against the
  same Redis and run store with a real worker.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from testkit.processes import free_port, wait_for
from testkit.sandboxes import sandbox_events
from tests.conftest import run_cli

NODE = "def main(state):\n    return state.get('n', 0) + 1\n"


def one_json(proc: Any) -> dict[str, Any]:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def posture(docker_client: Any) -> Any:
    """This machine's engine, read by the test itself (the table of known escapes)."""
    from executor.runtimes.docker.posture import read_posture

    return read_posture(docker_client.api)


def cli_run(tmp_path: Any, image: str, **env: str) -> tuple[Any, dict[str, Any]]:
    path = tmp_path / "node.py"
    path.write_text(NODE)
    proc = run_cli(
        "run",
        str(path),
        "--state",
        '{"n": 41}',
        env={
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_CODE_RUNTIME": "docker",
            "STUDIO_CODE_IMAGE": image,
            "STUDIO_DATA_DIR": str(tmp_path),
            **env,
        },
    )
    return proc, one_json(proc)


@pytest.mark.docker
def test_run_refuses_a_vulnerable_engine_when_told(
    tmp_path: Any, python_image: str, posture: Any, docker_client: Any
) -> None:
    since = int(time.time()) - 1
    proc, out = cli_run(tmp_path, python_image, STUDIO_CODE_ENGINE_REFUSE_VULNERABLE="1")
    applying = [a.cve for a in posture.advisories if a.applies]
    if not posture.vulnerable:  # an engine with no known escape has nothing to refuse
        assert (proc.returncode, out["status"], out["output"]) == (0, "succeeded", 42), out
        return
    assert proc.returncode == 1, out
    assert (out["status"], out["output"]) == ("failed", None), out
    assert out["error"]["code"] == "RUNTIME_UNAVAILABLE", out
    message = out["error"]["message"]
    assert "STUDIO_CODE_ENGINE_REFUSE_VULNERABLE" in message
    for cve in applying:
        assert cve in message, message
    if posture.runc is not None and posture.runc.version.startswith(
        "1.1."
    ):  # this machine's runc: the advisory
        assert "CVE-2025-31133" in message, message
    # refused before any container: the engine saw nothing of this job
    events = sandbox_events(docker_client, out["job_id"], since, int(time.time()) + 1)
    assert events == [], events


@pytest.mark.docker
def test_run_without_the_setting_runs_on_the_same_engine(tmp_path: Any, python_image: str) -> None:
    proc, out = cli_run(tmp_path, python_image, STUDIO_CODE_ENGINE_REFUSE_VULNERABLE="0")
    assert (proc.returncode, out["status"], out["output"], out["error"]) == (
        0,
        "succeeded",
        42,
        None,
    ), out


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_cli_meta_is_the_api_meta(make_stack: Any, tmp_path: Any) -> None:
    q = make_stack(code_concurrency=1, queue_test_slots=0, code_languages="python")
    worker = q.start_worker("w1", 1)
    env = q.env()
    with q.start_api() as api:

        def api_meta() -> dict[str, Any]:
            r = httpx.get(f"{api.base}/api/meta/runtime", timeout=60)
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]

        # the worker announces its engine with its heartbeat
        served = wait_for(
            lambda: (m := api_meta())["engine"]["workers"].get(worker.node) and m,
            60,
            "the worker's engine in the API's meta",
            interval_s=0.5,
        )
        proc = run_cli("meta", env=env)
    cli = one_json(proc)
    assert proc.returncode == 0, cli

    assert set(cli) == set(served)
    for key in ("engine", "fairness", "store", "pool", "limits"):
        assert set(cli[key]) == set(served[key]), key
    assert set(cli["workers"]) == set(served["workers"]) == {"code.run", "code.test"}
    assert cli["workers"]["code.run"]["serving"] == served["workers"]["code.run"]["serving"] == 1
    # each worker's engine, from its heartbeat: the same worker, the same engine
    mine = cli["engine"]["workers"]
    assert mine is not None and set(mine) == set(served["engine"]["workers"]) == {worker.node}
    assert mine[worker.node]["runc"] == served["engine"]["workers"][worker.node]["runc"]
    assert mine[worker.node]["vulnerable"] == served["engine"]["workers"][worker.node]["vulnerable"]
    assert cli["store"] == served["store"] and cli["store"]["id"] is not None
    assert cli["fairness"] == served["fairness"]  # nothing waits: mode, cap, zero counts
    assert cli["fairness"]["mode"] == "users" and cli["fairness"]["top"] == []
    # asked fresh, as docs/security.md says: what the kernel applied inside a sandbox
    assert cli["engine"]["sandbox"]["no_new_privs"] is True, cli["engine"]


def test_cli_meta_without_redis_or_a_store_says_so_and_creates_nothing(tmp_path: Any) -> None:
    """The embedded default: no store yet, no Redis. The document keeps its shape and says
    why the queue's parts are missing, as the API says it; meta creates no store."""
    data = tmp_path / "data"
    proc = run_cli(
        "meta",
        env={
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_CODE_RUNTIME": "subprocess",
            "STUDIO_CODE_LANGUAGES": "python",
            "STUDIO_DATA_DIR": str(data),
            "STUDIO_DATABASE_URL": "",
            "STUDIO_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens
        },
    )
    out = one_json(proc)
    assert proc.returncode == 0, out
    assert {"workers", "fairness", "store", "engine"} <= set(out)
    assert "STUDIO_REDIS_URL cannot be read" in out["workers"]["error"]
    assert "STUDIO_REDIS_URL cannot be read" in out["fairness"]["error"]
    assert out["fairness"]["mode"] == "users"
    assert out["engine"]["workers"] is None
    assert out["store"] == {"url": f"sqlite:///{data / 'studio-code.db'}", "id": None}
    assert not data.exists(), "meta created a run store"
