"""API docs on an air-gapped site and a truthful OpenAPI.

The browser test runs the real API (``studio-code serve``) and a real headless Chromium
whose resolver knows no host but 127.0.0.1 (``--host-resolver-rules``): Swagger UI and
ReDoc must render the operations from assets the API serves itself, and Chromium's own
network log must show that the pages asked for nothing off this host."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.api import ApiServer
from testkit.processes import require
from testkit.stack import studio_env

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--virtual-time-budget=15000",
]


def _schema() -> dict[str, Any]:
    from api_client.http.app import create_app
    from executor.settings import load_settings

    return create_app(load_settings(redis_url="redis://127.0.0.1:1/0")).openapi()


def test_openapi_declares_security_errors_examples_and_ids() -> None:
    schema = _schema()
    schemes = schema["components"]["securitySchemes"]
    assert schemes["studioUser"] == {
        **schemes["studioUser"],
        "type": "apiKey",
        "in": "header",
        "name": "X-Studio-User",
    }
    assert schemes["studioAdmin"]["name"] == "X-Studio-Admin"
    paths = schema["paths"]
    ops = {(m, p): op for p, item in paths.items() for m, op in item.items()}
    ids = {op["operationId"] for op in ops.values()}
    assert {
        "list_runs",
        "submit_run",
        "get_run",
        "cancel_run",
        "validate_code",
        "test_code",
        "get_runtime_meta",
    } <= ids
    for (method, path), op in ops.items():
        # the caller header is a security requirement, not an optional parameter
        assert not [
            p
            for p in op.get("parameters", [])
            if p["in"] == "header" and p["name"].startswith("X-Studio-")
        ], (method, path)
        responses = op["responses"]
        # the bearer token (STUDIO_API_TOKEN) goes with every alternative when declared
        assert schemes["studioToken"]["scheme"] == "bearer"
        assert all("studioToken" in s for s in op["security"]), (method, path)
        if path == "/api/meta/runtime":  # no user needed
            assert not any("studioUser" in s for s in op["security"]), (method, path)
        else:
            assert any(s.get("studioUser") == [] for s in op["security"]), (method, path)
            assert "401" in responses, (method, path)
        assert ("404" in responses) == ("{job_id}" in path), (method, path)
        assert ("409" in responses) == path.endswith("/cancel"), (method, path)
        assert ("429" in responses) == (path == "/api/code/test"), (method, path)
        for status, response in responses.items():
            if status >= "400":
                example = response["content"]["application/json"]["example"]
                assert example["error"]["code"] and example["error"]["message"]
    retry = ops[("post", "/api/code/test")]["responses"]["429"]["headers"]["Retry-After"]
    assert retry["schema"]["type"] == "integer"
    body = ops[("post", "/api/runs")]["requestBody"]["content"]["application/json"]
    assert "def main" in body["example"]["code"]
    assert "403" in ops[("get", "/api/runs")]["responses"]


def _net_requests(netlog: Path) -> list[tuple[str, str]]:
    """(initiator, url) of every request Chromium started, from its --log-net-log."""
    d = json.loads(netlog.read_text())
    start = d["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [
        (e["params"].get("initiator", ""), e["params"]["url"])
        for e in d["events"]
        if e["type"] == start and "url" in e.get("params", {})
    ]


@pytest.mark.redis
def test_docs_and_redoc_render_offline_in_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    require(chromium is not None, "chromium is not installed (Debian package chromium)")
    assert chromium is not None
    # the docs need no service: an unreachable Redis and an empty store are enough
    env = studio_env("redis://127.0.0.1:1/0", f"sqlite:///{tmp_path / 'r.db'}", "none")
    api = ApiServer(env, tmp_path / "api.log")
    base = api.base
    try:
        for page, must_show in [("docs", 'data-path="/api/runs"'), ("redoc", "list_runs")]:
            netlog = tmp_path / f"{page}.json"
            out = subprocess.run(
                [
                    chromium,
                    *CHROMIUM_FLAGS,
                    f"--user-data-dir={tmp_path / ('chr-' + page)}",
                    f"--log-net-log={netlog}",
                    "--dump-dom",
                    f"{base}/{page}",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            dom = out.stdout
            assert must_show in dom, (page, out.stderr[-2000:], dom[:2000])
            if page == "docs":  # Swagger UI drew every operation
                for path in ("/api/runs/{job_id}/cancel", "/api/code/test", "/api/meta/runtime"):
                    assert f'data-path="{path}"' in dom, path
            else:  # ReDoc drew the operations and the security schemes
                assert "Submit Run" in dom and "studioUser" in dom
            page_requests = [(i, u) for i, u in _net_requests(netlog) if i == base]
            assert any(u.endswith(".js") for _, u in page_requests), page_requests
            off_host = [u for _, u in page_requests if not u.startswith(base + "/")]
            assert not off_host, f"/{page} fetched from another host: {off_host}"
        html = httpx.get(f"{base}/redoc").text + httpx.get(f"{base}/docs").text
        assert "cdn." not in html and "fonts.googleapis" not in html
        assert "default-src 'self'" in httpx.get(f"{base}/docs").headers["content-security-policy"]
    finally:
        api.stop(20)
