"""The studio's HTTP routes, end to end: a real uvicorn (``studio-code serve``) on a loopback
port, a real Celery worker process (prefork), a real redis-server, real Docker sandboxes,
a SQLite run store; requests with httpx, and schemathesis against the served OpenAPI.

The processes are started and stopped with testkit/ (one Stack for the module)."""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.api import ApiServer, fuzz_for_server_errors
from testkit.processes import free_port
from testkit.sandboxes import containers_of
from testkit.stack import DOCKER_PYTHON, Stack, studio_env
from tests.snippets import ADMIN, OK_CODE, RAISE_CODE, SLEEP_CODE, USER

pytestmark = [pytest.mark.docker, pytest.mark.redis]


# --- the stack ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, python_image: str
) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("http"), **DOCKER_PYTHON, code_image=python_image) as s:
        s.start_worker("worker")
        s.start_api()
        yield s


def _user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


# --- who is calling ----------------------------------------------------------------------


def test_a_call_without_the_user_header_is_401(stack: Stack) -> None:
    for method, path, body in [
        ("POST", "/api/code/validate", {"code": OK_CODE}),
        ("POST", "/api/code/test", {"code": OK_CODE}),
        ("POST", "/api/runs", {"code": OK_CODE}),
        ("GET", "/api/runs/abc", None),
        ("POST", "/api/runs/abc/cancel", None),
    ]:
        r = stack.http.request(method, path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "UNAUTHENTICATED"
        assert USER in r.json()["error"]["message"]
    # an empty header is no user either
    r = stack.http.post("/api/runs", json={"code": OK_CODE}, headers={USER: ""})
    assert r.status_code == 401


def test_workflow_validation_of_a_code_node(stack: Stack) -> None:
    r = stack.http.post(
        "/api/code/nodes/check", json={"language": "python"}, headers={USER: _user()}
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"ok": True, "language": "python"}
    # this stack offers python only (STUDIO_CODE_LANGUAGES=python)
    r = stack.http.post(
        "/api/code/nodes/check", json={"language": "typescript"}, headers={USER: _user()}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "CODE_INVALID"
    assert "not offered here" in r.json()["error"]["message"]


def test_meta_reports_python_ready(stack: Stack) -> None:
    r = stack.http.get("/api/meta/runtime")
    assert r.status_code == 200, r.text
    meta = r.json()
    assert meta["enabled"] is True and meta["code_runtime"] == "docker"
    python = next(x for x in meta["languages"] if x["name"] == "python")
    assert python["ready"] is True, python
    assert meta["limits"]["test_per_minute"] == 20


def test_meta_shows_the_engine_posture(stack: Stack, docker_client: Any) -> None:
    """The engine under the sandboxes, over HTTP: the API process's own (it has the socket
    here) and the worker's, from its heartbeat; the versions as the engine reports them."""
    reported = docker_client.version()
    runc = next(c["Version"] for c in reported["Components"] if c["Name"] == "runc")
    meta = stack.http.get("/api/meta/runtime").json()
    engine = meta["engine"]
    assert engine["refuse_vulnerable"] is False
    here = engine["this_process"]
    assert here["docker"]["version"] == reported["Version"]
    assert here["api_version"] == reported["ApiVersion"]
    assert here["runc"]["version"] == runc
    for field in ("containerd", "oci_runtime", "cgroup_version", "cgroup_driver", "seccomp"):
        assert field in here, field
    for field in ("userns_remap", "rootless", "advisories", "vulnerable"):
        assert field in here, field
    flagged = [a["cve"] for a in here["advisories"] if a["applies"]]
    assert here["vulnerable"] is bool(flagged)
    if flagged:  # said in the warnings too, with the way out, and in the worker's start-up log
        assert any(all(cve in w for cve in flagged) for w in meta["warnings"]), meta["warnings"]
        logged = [line for line in stack.workers[0].output().splitlines() if "escapes" in line]
        assert logged and "WARNING" in logged[0], logged
        assert all(cve in logged[0] for cve in flagged) and "upgrade" in logged[0].lower()
    workers = engine["workers"]
    assert workers, engine  # the stack's one worker
    (announced,) = workers.values()
    assert announced["docker"] == reported["Version"] and announced["runc"] == runc
    assert announced["vulnerable"] is here["vulnerable"]
    assert sorted(announced["advisories"]) == sorted(flagged)


# --- validate ----------------------------------------------------------------------------


def test_validate_returns_code_invalid_with_the_reason(stack: Stack) -> None:
    h = stack.as_user(_user())
    r = stack.http.post(
        "/api/code/validate", json={"code": "def main(state:\n  return 1\n"}, headers=h
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "CODE_INVALID"
    assert "SyntaxError" in err["message"] and "line 1" in err["message"]
    assert err["problems"][0]["line"] == 1

    r = stack.http.post("/api/code/validate", json={"code": "x = 1\n"}, headers=h)
    assert r.status_code == 400
    assert "main" in r.json()["error"]["message"]

    r = stack.http.post(
        "/api/code/validate", json={"code": OK_CODE, "language": "python"}, headers=h
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"ok": True, "language": "python", "problems": []}


def test_a_malformed_body_is_a_json_error_not_a_500(stack: Stack) -> None:
    h = stack.as_user(_user())
    r = stack.http.post("/api/runs", json={"code": OK_CODE, "language": "cobol"}, headers=h)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "REQUEST_INVALID"
    r = stack.http.post(
        "/api/runs", content=b"{not json", headers={**h, "content-type": "application/json"}
    )
    assert r.status_code == 422
    r = stack.http.post("/api/runs", json={"code": OK_CODE, "timeout_s": -1}, headers=h)
    assert r.status_code == 422


@pytest.mark.parametrize("cpus", [1e-10, 0.005, 0])
def test_a_limit_below_its_floor_is_code_invalid_on_every_route(stack: Stack, cpus: float) -> None:
    """A CPU share below 0.01 (1e-10 gave a sandbox with no CPU quota at all, 0.005 one runc
    refused at start) and memory below 64m: 400 CODE_INVALID with the range, on the routes
    that take a node's limits; the floor itself is taken, and the schema shows it."""
    h = stack.as_user(_user())
    for route in ("/api/runs", "/api/code/test", "/api/code/validate"):
        r = stack.http.post(route, json={"code": OK_CODE, "cpus": cpus}, headers=h)
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["code"] == "CODE_INVALID", (route, err)
        assert f"cpus={cpus:g} is not a CPU share" in err["message"], err
        assert "from 0.01" in err["message"] and "STUDIO_CODE_MAX_CPUS" in err["message"], err
        r = stack.http.post(route, json={"code": OK_CODE, "memory": "32m"}, headers=h)
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["code"] == "CODE_INVALID", r.text
        assert "from 64m" in r.json()["error"]["message"], r.text
    r = stack.http.post(
        "/api/code/validate", json={"code": OK_CODE, "cpus": 0.01, "memory": "64m"}, headers=h
    )
    assert r.status_code == 200, r.text
    field = stack.http.get("/openapi.json").json()["components"]["schemas"]["RunBody"]
    assert field["properties"]["cpus"]["minimum"] == 0.01, field["properties"]["cpus"]


# --- runs ----------------------------------------------------------------------------------


def test_submit_then_poll_gives_the_result(stack: Stack) -> None:
    user = _user()
    r = stack.http.post(
        "/api/runs", json={"code": OK_CODE, "state": {"n": 21}}, headers=stack.as_user(user)
    )
    assert r.status_code == 202, r.text
    run = r.json()
    assert run["status"] in ("queued", "running", "succeeded")
    assert run["kind"] == "run" and run["user"] == user
    done = stack.until(run["job_id"], user)
    assert done["status"] == "succeeded", done
    assert done["output"] == {"double": 42}
    assert done["runtime"] == "docker" and done["worker"]
    assert [t["step"] for t in done["trace"]] == ["sandbox.start", "code.run"]
    # what it used, measured by the worker's host, stored and shown (issue 33)
    used = done["usage"]
    assert used["source"] in ("cgroup-v1", "cgroup-v2"), used
    assert 1_000_000 < used["memory_peak_bytes"] < 256 * 2**20 and used["cpu_ms"] > 0, used
    history = stack.http.get("/api/runs", headers=stack.as_user(user)).json()["runs"]
    assert [r["usage"] for r in history if r["job_id"] == run["job_id"]] == [used]


def test_an_invalid_run_is_refused_at_submit(stack: Stack) -> None:
    r = stack.http.post("/api/runs", json={"code": "def nope(:"}, headers=stack.as_user(_user()))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "CODE_INVALID"


def test_cancel_kills_the_running_sandbox(stack: Stack, docker_client: Any) -> None:
    user = _user()
    h = stack.as_user(user)
    r = stack.http.post("/api/runs", json={"code": SLEEP_CODE, "state": {"s": 60}}, headers=h)
    assert r.status_code == 202
    job_id = r.json()["job_id"]
    stack.until(job_id, user, {"running"})
    deadline = time.monotonic() + 20
    while not containers_of(docker_client, job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert containers_of(docker_client, job_id), "the sandbox never started"

    t0 = time.monotonic()
    r = stack.http.post(f"/api/runs/{job_id}/cancel", headers=h)
    assert r.status_code == 202, r.text
    assert r.json()["status"] in ("cancelling", "cancelled")
    done = stack.until(job_id, user, timeout=30)
    assert done["status"] == "cancelled"
    assert done["error"]["code"] == "CODE_CANCELLED"
    assert time.monotonic() - t0 < 15, "the cancel took longer than the kill grace"
    deadline = time.monotonic() + 15
    while containers_of(docker_client, job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not containers_of(docker_client, job_id), "the sandbox outlived its cancel"

    # a second cancel of a cancelled run is fine; of a succeeded one, a conflict
    assert stack.http.post(f"/api/runs/{job_id}/cancel", headers=h).status_code == 202
    r = stack.http.post("/api/runs", json={"code": OK_CODE}, headers=h)
    ok_id = r.json()["job_id"]
    stack.until(ok_id, user)
    r = stack.http.post(f"/api/runs/{ok_id}/cancel", headers=h)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "CONFLICT"


def test_another_users_run_is_hidden_but_an_admin_sees_it(stack: Stack) -> None:
    owner, other = _user(), _user()
    r = stack.http.post("/api/runs", json={"code": OK_CODE}, headers=stack.as_user(owner))
    job_id = r.json()["job_id"]
    stack.until(job_id, owner)

    for method, path in [("GET", f"/api/runs/{job_id}"), ("POST", f"/api/runs/{job_id}/cancel")]:
        r = stack.http.request(method, path, headers=stack.as_user(other))
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "NOT_FOUND"
    # exactly what an unknown id answers: existence is not revealed
    unknown = stack.http.get("/api/runs/" + uuid.uuid4().hex, headers=stack.as_user(other))
    assert unknown.status_code == 404
    assert (
        unknown.json()["error"]["message"].split("'")[0]
        == r.json()["error"]["message"].split("'")[0]
    )

    r = stack.http.get(f"/api/runs/{job_id}", headers=stack.as_user(other, admin=True))
    assert r.status_code == 200 and r.json()["user"] == owner
    # a client cannot make itself admin with another value than the studio's "1"
    r = stack.http.get(f"/api/runs/{job_id}", headers={USER: other, ADMIN: "0"})
    assert r.status_code == 404


def test_get_run_with_wait_answers_when_the_run_finishes(stack: Stack) -> None:
    """GET /api/runs/{id}?wait=S, the long poll: an unfinished run is answered once it has
    finished (the same view a plain GET gives then), or as it is when the wait ends; a
    finished one, another user's (404) and a wait out of range (422) at once."""
    user = _user()
    h = stack.as_user(user)
    job_id = stack.http.post(
        "/api/runs", json={"code": SLEEP_CODE, "state": {"s": 2}}, headers=h
    ).json()["job_id"]
    assert not stack.http.get(f"/api/runs/{job_id}", headers=h).json()["finished"]
    t0 = time.monotonic()
    r = stack.http.get(f"/api/runs/{job_id}", params={"wait": 30}, headers=h)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["status"] == "succeeded" and done["output"] == 1, done
    assert time.monotonic() - t0 < 25, "the wait ran to its end instead of the run's"
    assert stack.http.get(f"/api/runs/{job_id}", headers=h).json() == done
    assert stack.http.get(f"/api/runs/{job_id}", params={"wait": 5}, headers=h).json() == done
    # a finished run is answered from its done notice: still only to its user
    r = stack.http.get(f"/api/runs/{job_id}", params={"wait": 5}, headers=stack.as_user(_user()))
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND", r.text

    slow = stack.http.post(
        "/api/runs", json={"code": SLEEP_CODE, "state": {"s": 60}}, headers=h
    ).json()["job_id"]
    try:
        r = stack.http.get(f"/api/runs/{slow}", params={"wait": 0.5}, headers=h)
        assert r.status_code == 200, r.text
        assert r.json()["status"] in ("queued", "running") and not r.json()["finished"]
        r = stack.http.get(f"/api/runs/{slow}", params={"wait": 30}, headers=stack.as_user(_user()))
        assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND", r.text
        for bad in (-1, 31, "soon"):
            r = stack.http.get(f"/api/runs/{slow}", params={"wait": bad}, headers=h)
            assert r.status_code == 422 and r.json()["error"]["code"] == "REQUEST_INVALID", r.text
    finally:
        stack.http.post(f"/api/runs/{slow}/cancel", headers=h)


# --- editor test calls ----------------------------------------------------------------------


def test_a_test_call_answers_with_the_result(stack: Stack) -> None:
    h = stack.as_user(_user())
    r = stack.http.post("/api/code/test", json={"code": OK_CODE, "state": {"n": 2}}, headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "succeeded" and body["output"] == {"double": 4}
    assert body["kind"] == "test"

    r = stack.http.post("/api/code/test", json={"code": RAISE_CODE}, headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "failed"
    assert body["error"]["code"] == "CODE_ERROR"
    assert "boom from the node" in body["error"]["message"] + body["logs"]


def test_the_21st_test_call_in_a_minute_is_429_with_retry_after(stack: Stack) -> None:
    user = _user()
    h = stack.as_user(user)

    def call(_: int) -> httpx.Response:
        return stack.http.post(
            "/api/code/test", json={"code": OK_CODE, "state": {"n": 1}}, headers=h
        )

    # calls refused before their job is queued (code that does not parse) do not count:
    # admission counts a call with its in-flight slot and gives both back then
    # (a small body is checked on the event loop while its admission is on the wire, a
    # big one in a thread: both are refused and refunded the same way)
    big_state = {"pad": "x" * (100 * 1024)}
    for state in ({}, {}, big_state):
        bad = stack.http.post(
            "/api/code/test", json={"code": "def main(:\n", "state": state}, headers=h
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["code"] == "CODE_INVALID"
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        first = list(pool.map(call, range(20)))
    # the window is one minute: the 21st call must come within it to prove anything
    assert time.monotonic() - t0 < 50, "20 test calls took most of a minute"
    assert [r.status_code for r in first] == [200] * 20, [
        r.text for r in first if r.status_code != 200
    ][:1]
    assert all(r.json()["status"] == "succeeded" for r in first)

    r = call(21)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "RATE_LIMITED"
    retry = int(r.headers["Retry-After"])
    assert 1 <= retry <= 60 and err["retry_after_s"] == retry
    # over the limit, the limit is what is said first, even for code that does not parse
    bad = stack.http.post("/api/code/test", json={"code": "def main(:\n"}, headers=h)
    assert bad.status_code == 429, bad.text
    # per user: someone else still gets through
    r = stack.http.post("/api/code/test", json={"code": OK_CODE}, headers=stack.as_user(_user()))
    assert r.status_code == 200, r.text
    # and the API counted the refusal
    from prometheus_client.parser import text_string_to_metric_families

    text = stack.http.get("/metrics").text
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    refused = [
        s.value
        for s in fam["studio_code_rate_limited"].samples
        if s.name == "studio_code_rate_limited_total"
    ]
    assert refused and refused[0] >= 1


# --- health ---------------------------------------------------------------------------------


def test_ready_is_200_with_every_dependency_up(stack: Stack) -> None:
    r = stack.http.get("/healthz/ready")
    assert r.status_code == 200, r.text
    body = r.json()
    assert {k: body[k] for k in ("ok", "checks")} == {
        "ok": True,
        "checks": {"redis": None, "run_store": None, "docker": None},
    }
    # the live workers per queue: the stack's one worker, -c 2 (one slot kept for tests)
    assert body["workers"] == {
        "code.test": {"serving": 1, "slots": 1, "paused": []},
        "code.run": {"serving": 1, "slots": 1, "paused": []},
    }


@pytest.mark.parametrize("down", ["redis", "run_store", "docker"])
def test_ready_is_503_while_a_dependency_is_unreachable(
    tmp_path: Path, python_image: str, redis_server: Any, down: str
) -> None:
    redis_url = redis_server.url
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    extra: dict[str, str] = {}
    if down == "redis":
        redis_url = f"redis://127.0.0.1:{free_port()}/0"
    elif down == "run_store":
        db = f"postgresql+psycopg://studio@127.0.0.1:{free_port()}/studio?connect_timeout=3"
    else:
        extra["DOCKER_HOST"] = f"unix://{tmp_path / 'no-docker.sock'}"
    env = studio_env(redis_url, db, python_image, **extra)
    api = ApiServer(env, tmp_path / "api.log")
    base = api.base
    try:
        r = httpx.get(f"{base}/healthz/ready", timeout=30)
        assert r.status_code == 503, r.text
        checks = r.json()["checks"]
        assert checks[down], checks
        assert all(v is None for k, v in checks.items() if k != down), checks
        assert {
            "redis": "STUDIO_REDIS_URL",
            "run_store": "STUDIO_DATABASE_URL",
            "docker": "docker.sock",
        }[down] in checks[down]
        assert httpx.get(f"{base}/healthz/live").status_code == 200
        if down == "docker":
            # workflow validation of a Code node says why it cannot run, and how to fix it
            r = httpx.post(
                f"{base}/api/code/nodes/check",
                json={"language": "python"},
                headers={USER: "u"},
                timeout=30,
            )
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "RUNTIME_UNAVAILABLE"
            assert "Docker is not reachable" in r.json()["error"]["message"]
        else:
            # a submit says so in the error body (503), not a 500
            r = httpx.post(
                f"{base}/api/code/test", json={"code": OK_CODE}, headers={USER: "u"}, timeout=30
            )
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "RUNTIME_UNAVAILABLE"
    finally:
        code = api.stop(20)
    # `studio-code serve` stops on SIGTERM and says so in one JSON object
    assert code == 0, api.output()[-2000:]
    stopped = [json.loads(line) for line in api.output().splitlines() if line.startswith("{")]
    assert stopped and stopped[-1]["command"] == "serve" and stopped[-1]["status"] == "stopped"


# --- the OpenAPI contract ------------------------------------------------------------------


def test_openapi_has_the_routes_and_models(stack: Stack) -> None:
    spec = stack.http.get("/openapi.json").json()
    assert set(spec["paths"]) == {
        "/api/meta/runtime",
        "/api/code/validate",
        "/api/code/nodes/check",
        "/api/code/test",
        "/api/runs",
        "/api/runs/{job_id}",
        "/api/runs/{job_id}/cancel",
        "/api/runs/{job_id}/logs",
    }  # api_client.http.routes
    schemas = spec["components"]["schemas"]
    for name in ("RunBody", "CodeBody", "RunView", "ErrorBody", "RuntimeMeta"):
        assert name in schemas
    # the caller headers are security schemes (api_client.http.docs), required per route
    schemes = spec["components"]["securitySchemes"]
    assert {schemes["studioUser"]["name"], schemes["studioAdmin"]["name"]} == {USER, ADMIN}
    assert any(s.get("studioUser") == [] for s in spec["paths"]["/api/runs"]["post"]["security"])


def test_schemathesis_finds_no_server_error(stack: Stack) -> None:
    fuzz_for_server_errors(stack.base, {USER: f"fuzz-{uuid.uuid4().hex[:6]}"})
