"""The HTTP API under hostile callers and under load, over real HTTP: ``studio-code serve``
(uvicorn) on a loopback port with STUDIO_API_TOKEN set, a real Celery worker, a real
redis-server, Docker sandboxes, a SQLite run store.

What it shows: 200 editor test calls waiting while /healthz/live and GET /api/runs/{id}
still answer (the p99 figure is in ``make bench``, bench/http.py); the per-user in-flight
cap (429) and its slots given back when callers disconnect; the token; the Host
allow-list (DNS rebinding); repeated identity headers; body caps (Content-Length checked
before a byte is read, chunked bodies counted); the JSON depth cap; and every error, the
framework's own included, in the documented shape."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_client.http.limits import bind_refusal, is_loopback, json_depth_over
from testkit.api import fuzz_for_server_errors
from testkit.processes import free_port, wait_for
from testkit.stack import DOCKER_PYTHON, Stack
from tests.conftest import run_cli
from tests.snippets import OK_CODE, SLEEP_CODE

#: the module's stack starts its own redis-server (tests/conftest.py reads this table)
SERVICE_FIXTURES = {"stack": ("redis",)}

USER = "X-Studio-User"
ADMIN = "X-Studio-Admin"
BODY_MAX = 1024 * 1024
IN_FLIGHT = 10
EXTRA_HOST = "studio-code.internal"
#: the API token of the module's stack
TOKEN = secrets.token_hex(24)


def _user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


def _nested(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


def _error(r: httpx.Response, status: int, code: str) -> str:
    """Asserts the documented error shape; returns the message."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and len(body["error"]["message"]) > 20
    return str(body["error"]["message"])


# --- pure checks (no service) ----------------------------------------------------------------


def test_json_depth_is_counted_outside_strings() -> None:
    assert not json_depth_over(json.dumps({"s": _nested(63)}).encode(), 64)  # 64 deep
    assert json_depth_over(json.dumps({"s": _nested(64)}).encode(), 64)  # 65 deep
    assert json_depth_over(b"[" * 100_000, 64)
    # brackets inside strings, escaped quotes and backslashes do not count
    assert not json_depth_over(json.dumps({"a": "[" * 500, "b": '\\"[' * 300}).encode(), 64)
    assert not json_depth_over(json.dumps(["x\\", "[" * 100, "y\\\\", "{" * 100]).encode(), 64)
    # ...but an escaped backslash before a closing quote ends the string
    assert json_depth_over(b'["a\\\\", ' + b"[" * 70 + b"]" * 70 + b"]", 64)
    # many shallow containers are not deep
    assert not json_depth_over(json.dumps([[1, {"a": [2]}]] * 100_000).encode(), 64)


def test_loopback_and_the_bind_refusal(make_settings: Any) -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST."):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com", ""):
        assert not is_loopback(host), host
    bare = make_settings()
    assert bind_refusal(bare, "127.0.0.1") is None
    refusal = bind_refusal(bare, "0.0.0.0")
    assert refusal and "STUDIO_API_TOKEN" in refusal
    assert bind_refusal(make_settings(api_token="t" * 32), "0.0.0.0") is None


def test_the_token_setting_is_checked_and_never_echoed(make_settings: Any, tmp_path: Path) -> None:
    from executor.errors import SettingsError

    with pytest.raises(SettingsError) as e:
        make_settings(api_token="hunter2")
    assert "STUDIO_API_TOKEN" in e.value.message and "hunter2" not in e.value.message
    token = secrets.token_hex(16)
    f = tmp_path / "token"
    f.write_text(token + "\n")
    assert make_settings(api_token_file=str(f)).api_token_bytes == token.encode()
    with pytest.raises(SettingsError, match="STUDIO_API_TOKEN_FILE"):
        make_settings(api_token_file=str(tmp_path / "missing"))
    assert "hunter" not in repr(make_settings(api_token="hunter2-but-longer-now"))


def test_serve_refuses_a_non_loopback_address_without_a_token() -> None:
    env = {"STUDIO_API_TOKEN": "", "STUDIO_API_TOKEN_FILE": ""}
    r = run_cli("serve", "--host", "0.0.0.0", "--port", "1", env=env, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    out = json.loads(r.stdout)
    assert out["ok"] is False and out["command"] == "serve"
    assert "STUDIO_API_TOKEN" in out["error"]["message"]
    assert "Uvicorn running" not in r.stderr  # refused before binding anything


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_statuses_reads_what_a_waiter_needs_in_one_query(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """What async waits re-read every second: the status of many jobs, unknown ids left out."""
    from executor.models import CodeJob, Status
    from executor.store import open_store

    url = (
        f"sqlite:///{tmp_path / 'runs.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("pg_schema_url")
    )
    with open_store(url) as store:
        jobs = [CodeJob(code=OK_CODE, state_json=json.dumps({"big": "x" * 1000})) for _ in range(3)]
        for job in jobs:
            store.create(job, code_runtime="docker")
        store.request_cancel(jobs[1].job_id)
        got = store.statuses([j.job_id for j in jobs] + ["unknown"])
        assert got == {
            jobs[0].job_id: Status.QUEUED,
            jobs[1].job_id: Status.CANCELLED,
            jobs[2].job_id: Status.QUEUED,
        }


def test_a_failed_wait_raises_its_own_error_and_a_disconnect_ends_it() -> None:
    """What a test call's wait raises reaches the route's error handling as itself (a
    store outage is a 503, not a 500 from an ExceptionGroup); a disconnect ends the wait."""
    from starlette.requests import Request

    from api_client.client import JobNotFound
    from api_client.http.routes.code import _unless_disconnected

    async def silent() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {}

    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def fails() -> Any:
        await asyncio.sleep(0.01)
        raise JobNotFound("abc")

    async def forever() -> Any:
        await asyncio.sleep(3600)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    with pytest.raises(JobNotFound):
        asyncio.run(_unless_disconnected(Request(scope, silent), fails()))

    async def disconnected() -> Any:
        return await asyncio.wait_for(_unless_disconnected(Request(scope, gone), forever()), 5)

    assert asyncio.run(disconnected()) is None


# --- the stack -------------------------------------------------------------------------------


def job_ids(stack: Stack, users: set[str]) -> list[str]:
    """The user's jobs, straight from the run store (no route lists them)."""
    with sqlite3.connect(stack.workdir / "runs.db", timeout=30) as conn:
        rows = conn.execute("SELECT job_id, user FROM code_jobs").fetchall()
    return [job for job, user in rows if user in users]


def cancel_all(stack: Stack, users: set[str]) -> None:
    for job_id in job_ids(stack, users):
        r = stack.http.post(f"/api/runs/{job_id}/cancel", headers=stack.as_user("admin", True))
        assert r.status_code in (202, 409), r.text


def send_raw(stack: Stack, request: bytes, *, then: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send bytes as they are (what httpx will not send), return the whole answer."""
    assert stack.api is not None
    with socket.create_connection(("127.0.0.1", stack.api.port), timeout=timeout) as s:
        s.sendall(request)
        if then:
            try:
                s.sendall(then)
            except OSError:
                pass  # the server answered and closed: that is the point
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            out += chunk
        return out


def _status_and_body(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, python_image: str
) -> Iterator[Stack]:
    with Stack(
        tmp_path_factory.mktemp("http-limits"),
        **DOCKER_PYTHON,
        code_image=python_image,
        api_token=TOKEN,
        api_allowed_hosts=EXTRA_HOST,
        code_test_per_minute=1000,
        code_test_in_flight=IN_FLIGHT,
        api_body_max_bytes=BODY_MAX,
    ) as s:
        s.start_worker("worker", 1)
        s.start_api()
        yield s


# --- the shared secret -----------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
def test_the_token_is_required_on_every_route_but_liveness(stack: Stack) -> None:
    routes = [
        ("GET", "/api/meta/runtime"),
        ("POST", "/api/code/validate"),
        ("POST", "/api/code/test"),
        ("POST", "/api/runs"),
        ("GET", "/api/runs/x"),
        ("POST", "/api/runs/x/cancel"),
        ("GET", "/healthz/ready"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/no/such/route"),
    ]
    wrong = [
        None,
        "Bearer " + "x" * 48,
        f"Basic {TOKEN}",
        f"Bearer {TOKEN}x",
        TOKEN,
        f"Bearer {TOKEN[:-1]}",
    ]
    with httpx.Client(base_url=stack.base, timeout=30) as bare:
        for method, path in routes:
            for auth in wrong:
                headers = {USER: _user(), **({"Authorization": auth} if auth else {})}
                r = bare.request(
                    method,
                    path,
                    headers=headers,
                    json={"code": OK_CODE} if method == "POST" else None,
                )
                message = _error(r, 401, "UNAUTHENTICATED")
                assert "Bearer" in message and r.headers["WWW-Authenticate"] == "Bearer"
        # liveness needs no token; the scheme is case-insensitive; with the token all is well
        assert bare.get("/healthz/live").json() == {"ok": True}
        r = bare.get("/api/meta/runtime", headers={"Authorization": f"bearer {TOKEN}"})
        assert r.status_code == 200, r.text
    assert stack.http.get("/healthz/ready").status_code == 200
    # and the API counts what it refused, by code
    from prometheus_client.parser import text_string_to_metric_families

    fam = {f.name: f for f in text_string_to_metric_families(stack.http.get("/metrics").text)}
    refused = {
        s.labels["code"]: s.value
        for s in fam["studio_code_http_refused"].samples
        if s.name == "studio_code_http_refused_total"
    }
    assert refused["UNAUTHENTICATED"] >= len(routes) * len(wrong), refused


# --- Host and repeated headers -------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
def test_a_rebound_host_is_refused_before_anything_runs(stack: Stack) -> None:
    user = _user()
    for host in (
        "attacker.example",
        f"attacker.example:{stack.api.port}",
        "127.0.0.1.nip.io",
        "localhost.attacker.example",
        "",
        "0.0.0.0",
    ):
        r = stack.http.post(
            "/api/runs", json={"code": OK_CODE}, headers={**stack.as_user(user), "Host": host}
        )
        assert "attacker" not in _error(r, 400, "HOST_NOT_ALLOWED") or host
    assert job_ids(stack, {user}) == [], "a refused Host still queued a run"
    for host in (
        f"localhost:{stack.api.port}",
        f"127.0.0.1:{stack.api.port}",
        f"[::1]:{stack.api.port}",
        "LOCALHOST",
        EXTRA_HOST,
        f"{EXTRA_HOST.upper()}:{stack.api.port}",
    ):
        r = stack.http.get("/api/meta/runtime", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    # liveness answers any Host (a Kubernetes probe sends the pod's IP)
    r = httpx.get(stack.base + "/healthz/live", headers={"Host": "10.0.0.7:8080"})
    assert r.status_code == 200


@pytest.mark.docker
@pytest.mark.redis
def test_an_identity_header_sent_twice_is_refused(stack: Stack) -> None:
    user = _user()
    auth = ("Authorization", f"Bearer {TOKEN}")
    for headers in (
        [auth, (USER, user), (USER, "someone-else")],
        [auth, (USER, user), (ADMIN, "0"), (ADMIN, "1")],
        [auth, auth, (USER, user)],
        [auth, (USER, user), ("x-studio-user", user)],  # same name, other case
    ):
        r = httpx.post(stack.base + "/api/runs", json={"code": OK_CODE}, headers=headers)
        assert "more than once" in _error(r, 400, "HEADER_REPEATED")
    assert job_ids(stack, {user}) == []
    # two Host headers (httpx cannot send that): uvicorn's parser refuses them itself, with
    # a 400 of its own, before the app sees the request (the app would say HEADER_REPEATED)
    raw = send_raw(
        stack,
        f"POST /api/runs HTTP/1.1\r\nHost: localhost\r\nHost: attacker.example\r\n"
        f"Authorization: Bearer {TOKEN}\r\n{USER}: {user}\r\nContent-Type: "
        "application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}".encode(),
    )
    assert raw.startswith(b"HTTP/1.1 400 "), raw[:300]
    assert job_ids(stack, {user}) == []


# --- bodies ----------------------------------------------------------------------------------


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.docker
@pytest.mark.redis
def test_a_body_over_the_cap_is_413_before_it_is_read(stack: Stack) -> None:
    user = _user()
    head = (
        f"POST /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        f"{TOKEN}\r\n{USER}: {user}\r\nContent-Type: application/json\r\n"
    )
    # Content-Length says 100 MB and not a byte follows: the answer comes anyway (a server
    # that waited for the body would leave this read to its 10 s timeout)
    status, body = _status_and_body(
        send_raw(stack, (head + "Content-Length: 100000000\r\n\r\n").encode(), timeout=10)
    )
    assert (status, body["error"]["code"]) == (413, "REQUEST_TOO_LARGE"), body
    assert str(BODY_MAX) in body["error"]["message"]

    # a chunked body is counted as it arrives: 100 MB offered, refused near the cap, and
    # the API's memory does not grow by the body
    rss0 = _rss_kb(stack.api.pid)
    chunk = b"x" * 65536
    stream = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * 1600  # 100 MiB
    status, body = _status_and_body(
        send_raw(
            stack, (head + "Transfer-Encoding: chunked\r\n\r\n").encode(), then=stream, timeout=30
        )
    )
    assert (status, body["error"]["code"]) == (413, "REQUEST_TOO_LARGE"), body
    assert _rss_kb(stack.api.pid) - rss0 < 30 * 1024, "the API kept the body"
    assert job_ids(stack, {user}) == []

    # under the cap it runs; each route has its own cap (a language check takes 64 KiB)
    state = {"blob": "y" * (BODY_MAX // 2)}
    r = stack.http.post(
        "/api/runs", json={"code": OK_CODE, "state": state}, headers=stack.as_user(user)
    )
    assert r.status_code == 202, r.text
    cancel_all(stack, {user})
    r = stack.http.post(
        "/api/code/nodes/check",
        content=b" " * 70_000 + b'{"language": "py"}',
        headers={**stack.as_user(user), "Content-Type": "application/json"},
    )
    _error(r, 413, "REQUEST_TOO_LARGE")


@pytest.mark.docker
@pytest.mark.redis
def test_json_nested_too_deep_is_refused_before_it_is_parsed(stack: Stack) -> None:
    user = _user()
    # 100,000 deep (the stdlib parser would raise RecursionError on it)
    deep = b'{"code": "x", "state": {"v": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    r = stack.http.post(
        "/api/runs",
        content=deep,
        headers={**stack.as_user(user), "Content-Type": "application/json"},
    )
    assert "STUDIO_API_JSON_MAX_DEPTH=64" in _error(r, 400, "REQUEST_TOO_DEEP")
    # the body, the state and 62 arrays: 64 levels, the limit, pass; one more does not
    r = stack.http.post(
        "/api/runs",
        json={"code": OK_CODE, "state": {"v": _nested(62)}},
        headers=stack.as_user(user),
    )
    assert r.status_code == 202, r.text
    r = stack.http.post(
        "/api/runs",
        json={"code": OK_CODE, "state": {"v": _nested(63)}},
        headers=stack.as_user(user),
    )
    _error(r, 400, "REQUEST_TOO_DEEP")
    # a body sent with no Content-Type is parsed as JSON by the framework: checked too
    r = stack.http.post(
        "/api/code/validate", content=b"[" * 70 + b"]" * 70, headers=stack.as_user(user)
    )
    _error(r, 400, "REQUEST_TOO_DEEP")
    cancel_all(stack, {user})


# --- heads -----------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
def test_a_header_or_a_head_over_its_cap_is_431(stack: Stack) -> None:
    """16 KiB a header line and 64 KiB a head (the defaults): a header line of exactly 16 KiB
    runs; a 64 KiB tracestate is 431 HEADERS_TOO_LARGE naming the header; five 15 KiB
    headers (each within the cap, 75 KiB in all) are 431 naming the head's cap; nothing of
    them runs."""
    user = _user()
    line = 16 * 1024
    pad = "p" * (line - len("X-Pad: "))
    r = stack.http.post(
        "/api/runs", json={"code": OK_CODE}, headers={**stack.as_user(user), "X-Pad": pad}
    )
    assert r.status_code == 202, r.text
    cancel_all(stack, {user})
    refused = _user()
    r = stack.http.post(
        "/api/runs",
        json={"code": OK_CODE},
        headers={**stack.as_user(refused), "tracestate": "a=" + "b" * (64 * 1024)},
    )
    message = _error(r, 431, "HEADERS_TOO_LARGE")
    assert "'tracestate' header" in message and "STUDIO_API_HEADER_MAX_BYTES" in message
    many = {f"X-Pad-{i}": "p" * (15 * 1024) for i in range(5)}
    r = stack.http.post(
        "/api/runs", json={"code": OK_CODE}, headers={**stack.as_user(refused), **many}
    )
    assert "STUDIO_API_HEAD_MAX_BYTES" in _error(r, 431, "HEADERS_TOO_LARGE")
    assert job_ids(stack, {refused}) == []


@pytest.mark.docker
@pytest.mark.redis
def test_a_head_that_never_ends_is_431_while_it_is_read(stack: Stack) -> None:
    """A 4 MiB header whose head never ends (no blank line: the app never sees it): the
    server answers 431 HEADERS_TOO_LARGE and closes once the head passes the cap, without
    waiting for the rest (a server that kept reading would leave this read to its 10 s
    timeout with no answer), and the API's memory does not grow by the header."""
    rss0 = _rss_kb(stack.api.pid)
    head = (
        f"POST /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"{USER}: {_user()}\r\ntracestate: a="
    ).encode()
    raw = send_raw(stack, head, then=b"b" * (4 * 1024 * 1024), timeout=10)
    assert raw.startswith(b"HTTP/1.1 431 "), raw[:300]
    status, body = _status_and_body(raw)
    assert (status, body["error"]["code"]) == (431, "HEADERS_TOO_LARGE"), body
    assert "STUDIO_API_HEAD_MAX_BYTES" in body["error"]["message"]
    assert _rss_kb(stack.api.pid) - rss0 < 2 * 1024, "the API kept the head"


@pytest.mark.docker
@pytest.mark.redis
def test_every_framework_error_has_the_shape(stack: Stack) -> None:
    h = stack.as_user(_user())
    _error(stack.http.get("/no/such/route", headers=h), 404, "NOT_FOUND")
    r = stack.http.get("/api/code/test", headers=h)
    assert "POST" in _error(r, 405, "METHOD_NOT_ALLOWED") and r.headers["Allow"] == "POST"
    _error(stack.http.delete("/api/runs/abc", headers=h), 405, "METHOD_NOT_ALLOWED")
    _error(stack.http.post("/api/runs", json={"code": 1}, headers=h), 422, "REQUEST_INVALID")
    _error(stack.http.post("/api/runs", json=None, headers=h), 422, "REQUEST_INVALID")
    _error(
        stack.http.post(
            "/api/runs", content=b"{not json", headers={**h, "Content-Type": "application/json"}
        ),
        422,
        "REQUEST_INVALID",
    )
    # not UTF-8: the framework cannot decode it
    r = stack.http.post(
        "/api/runs",
        content=b'{"code": "\xff\xfe"}',
        headers={**h, "Content-Type": "application/json"},
    )
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["code"] == "REQUEST_INVALID"


@pytest.mark.docker
@pytest.mark.redis
def test_schemathesis_finds_no_server_error_behind_the_token_and_limits(stack: Stack) -> None:
    fuzz_for_server_errors(stack.base, {**stack.auth, USER: f"fuzz-{uuid.uuid4().hex[:6]}"})


# --- waiting: the in-flight cap and 200 waiting calls ---------------------------------------


async def _fire(
    stack: Stack,
    calls: list[tuple[str, dict[str, Any]]],
    stop: asyncio.Event,
    results: list[Any],
    answered: list[str],
) -> None:
    """Send every call at once and keep them open until they all answer or ``stop`` is
    set (then the rest disconnect)."""
    limits = httpx.Limits(max_connections=len(calls) + 10)
    async with httpx.AsyncClient(
        base_url=stack.base, headers=stack.auth, limits=limits, timeout=120
    ) as client:
        tasks = [
            asyncio.ensure_future(client.post("/api/code/test", json=body, headers={USER: user}))
            for user, body in calls
        ]
        for t in tasks:
            t.add_done_callback(lambda t: answered.append(_how_it_ended(t)))
        stopper = asyncio.ensure_future(stop.wait())
        pending: set[asyncio.Future[Any]] = {*tasks, stopper}
        while not stopper.done() and not all(t.done() for t in tasks):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            try:
                results.append(await t)
            except (asyncio.CancelledError, httpx.HTTPError) as e:
                results.append(e)
        stopper.cancel()


def _how_it_ended(task: asyncio.Future[Any]) -> str:
    """A call's end in a few words, for a failure message: its status and error, or what
    it raised."""
    if task.cancelled():
        return "cancelled"
    e = task.exception()
    if e is not None:
        return f"{type(e).__name__}: {e}"
    r = task.result()
    return f"{r.status_code} {r.text[:200]}"


class Burst:
    """``calls`` editor test calls held open from a thread of their own."""

    def __init__(self, stack: Stack, calls: list[tuple[str, dict[str, Any]]]) -> None:
        self.results: list[Any] = []
        #: one entry per call that has ended, as it ends: how (``_how_it_ended``)
        self.answered: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()  # bound to the loop that first waits on it
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._run(stack, calls),), daemon=True
        )
        self._thread.start()

    async def _run(self, stack: Stack, calls: list[tuple[str, dict[str, Any]]]) -> None:
        await _fire(stack, calls, self._stop, self.results, self.answered)

    def disconnect(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _wait_for_jobs(
    stack: Stack, users: set[str], n: int, timeout: float, burst: Burst | None = None
) -> None:
    def seen() -> str:
        ended = f"; calls that had ended: {burst.answered[:5]}" if burst is not None else ""
        return f"{len(job_ids(stack, users))} of {n} test calls submitted{ended}"

    wait_for(
        lambda: len(job_ids(stack, users)) >= n,
        timeout,
        f"{n} test calls submitted",
        0.2,
        describe=seen,
    )


def _each_call_ended(stack: Stack, user: str, queued: int, burst: Burst) -> None:
    """Until each call of ``burst`` queued its run (``queued``: the user's runs before) or
    was answered."""
    wait_for(
        lambda: len(job_ids(stack, {user})) - queued + len(burst.answered) >= IN_FLIGHT,
        60,
        "each call of the burst queued or answered",
        0.2,
        describe=lambda: burst.answered[:5],
    )


@pytest.mark.docker
@pytest.mark.redis
def test_the_in_flight_cap_is_429_and_a_disconnect_gives_the_slot_back(stack: Stack) -> None:
    user = _user()
    body = {"code": SLEEP_CODE, "state": {"s": 60}, "timeout_s": 15}
    # the stack is shared: start once the API sees code.test served (one CI run of stop 27
    # found no live code.test heartbeat right after the fuzzing test, and every call 503)
    wait_for(
        lambda: stack.http.get("/healthz/ready").json()["workers"]["code.test"]["serving"],
        30,
        "the API seeing code.test served",
        0.2,
    )
    burst = Burst(stack, [(user, body)] * IN_FLIGHT)
    try:
        _wait_for_jobs(stack, {user}, IN_FLIGHT, 60, burst)
        r = stack.http.post("/api/code/test", json=body, headers=stack.as_user(user))
        message = _error(r, 429, "RATE_LIMITED")
        assert f"STUDIO_CODE_TEST_IN_FLIGHT={IN_FLIGHT}" in message
        assert r.headers["Retry-After"] == "2" and r.json()["error"]["retry_after_s"] == 2
        assert len(job_ids(stack, {user})) == IN_FLIGHT, "a refused call still queued a run"
    finally:
        burst.disconnect()
        assert burst.join(30), "the waiting calls did not end"
    # every slot came back: the user may wait on IN_FLIGHT calls again. Each call of a
    # burst is seen to its end first (its run queued, or answered): on a loaded machine a
    # call cut off before it reached the API would prove nothing
    deadline = time.monotonic() + 60
    while True:
        queued = len(job_ids(stack, {user}))
        again = Burst(stack, [(user, body)] * IN_FLIGHT)
        _each_call_ended(stack, user, queued, again)
        again.disconnect()
        assert again.join(30)
        codes = [getattr(x, "status_code", None) for x in again.results]
        if 429 not in codes or time.monotonic() > deadline:
            break
    assert 429 not in codes, codes
    _wait_for_jobs(stack, {user}, 2 * IN_FLIGHT, 30)
    cancel_all(stack, {user})


@pytest.mark.docker
@pytest.mark.redis
def test_200_waiting_test_calls_leave_the_api_responsive(stack: Stack) -> None:
    users = [_user() for _ in range(20)]
    body = {"code": SLEEP_CODE, "state": {"s": 60}, "timeout_s": 15}
    ok = stack.http.post("/api/runs", json={"code": OK_CODE}, headers=stack.as_user("prober"))
    probe_id = ok.json()["job_id"]
    burst = Burst(stack, [(u, body) for u in users for _ in range(IN_FLIGHT)])
    failures: list[str] = []
    probes = 0
    try:
        _wait_for_jobs(stack, set(users), 200, 120, burst)
        # every call is now waiting in the API; the API answers others meanwhile
        deadline = time.monotonic() + 5
        with httpx.Client(base_url=stack.base, headers=stack.auth, timeout=10) as c:
            while time.monotonic() < deadline:
                for path, h in (
                    ("/healthz/live", {}),
                    (f"/api/runs/{probe_id}", stack.as_user("prober")),
                ):
                    probes += 1
                    try:
                        r = c.get(path, headers=h)
                        if r.status_code != 200:
                            failures.append(f"{path}: {r.status_code} {r.text[:200]}")
                    except httpx.HTTPError as e:
                        failures.append(f"{path}: {type(e).__name__} {e}")
                time.sleep(0.05)
        assert not burst.answered, "test calls ended before their runs did"
        # the runs end (cancelled), and every waiting call answers with its run
        cancel_all(stack, set(users))
        assert burst.join(60), "the waiting calls did not end after their runs did"
    finally:
        burst.disconnect()
        burst.join(30)
        cancel_all(stack, set(users))
    assert not failures, failures[:5]
    assert probes > 20
    answers = [r for r in burst.results if isinstance(r, httpx.Response)]
    assert len(answers) == 200, [r for r in burst.results if not isinstance(r, httpx.Response)][:3]
    assert {r.status_code for r in answers} == {200}, [
        r.text for r in answers if r.status_code != 200
    ][:2]
    assert {r.json()["status"] for r in answers} == {"cancelled"}


# --- the router mounted in a studio's own app -------------------------------------------------


def test_the_router_mounted_in_another_app_keeps_its_limits_and_leaves_the_rest(
    make_settings: Any,
) -> None:
    """A studio app of its own with the routers and RequestLimits(router_only=True): the
    routers' paths are bounded (Host, depth, size, repeated headers) and answer in the error
    shape; the studio's own route is untouched (any Host, any body)."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from api_client.http.kit import Services
    from api_client.http.limits import RequestLimits
    from api_client.http.routes import ROUTERS

    settings = make_settings(redis_url="redis://127.0.0.1:1/0", api_body_max_bytes=4096)
    studio = FastAPI()
    for router in ROUTERS:
        studio.include_router(router)
    studio.state.studio_code = services = Services(settings)
    studio.add_middleware(RequestLimits, settings=settings, router_only=True)

    async def own(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    studio.router.add_route("/studio/own", own, methods=["POST"])  # the studio's own route

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(studio, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://localhost:{port}", timeout=30) as c:
            h = {USER: "u1"}
            r = c.post("/api/code/validate", json={"code": OK_CODE}, headers=h)
            assert r.status_code == 200, r.text
            _error(
                c.post("/api/code/validate", json={"code": "def main(:"}, headers=h),
                400,
                "CODE_INVALID",
            )
            _error(
                c.post("/api/code/validate", json={"code": 1}, headers=h), 422, "REQUEST_INVALID"
            )
            _error(
                c.post("/api/code/validate", content=b"[" * 100 + b"]" * 100, headers=h),
                400,
                "REQUEST_TOO_DEEP",
            )
            _error(
                c.post("/api/runs", json={"code": "x" * 5000}, headers=h), 413, "REQUEST_TOO_LARGE"
            )
            _error(
                c.post("/api/runs", json={"code": OK_CODE}, headers=[(USER, "a"), (USER, "b")]),
                400,
                "HEADER_REPEATED",
            )
            _error(
                c.get("/api/runs/x", headers={**h, "Host": "evil.example"}), 400, "HOST_NOT_ALLOWED"
            )
            # the studio's own route: not the router's business
            r = c.post("/studio/own", content=b"[" * 10_000, headers={"Host": "evil.example"})
            assert r.json() == {"bytes": 10_000}
    finally:
        server.should_exit = True
        thread.join(20)
        services.close()
