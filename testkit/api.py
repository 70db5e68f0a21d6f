"""The API (``studio-code serve``) on a free loopback port, and the fuzzing of its OpenAPI."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.processes import (
    BIN,
    Service,
    free_port,
)


def wait_http(url: str, timeout: float = 30.0, proc: Service | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and not proc.alive():
            break
        time.sleep(0.1)
    out = proc.output()[-4000:] if proc else ""
    pytest.fail(f"{url} did not answer:\n{out}")


class ApiServer(Service):
    """``studio-code serve`` on a free loopback port, answering ``/healthz/live``."""

    stop_timeout = 20.0

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *,
        ready_timeout: float = 30.0,
        log_level: str | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [str(BIN / "studio-code"), "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if log_level is not None:  # e.g. "warning": no access log line per request (benches)
            argv += ["--log-level", log_level]
        super().__init__(argv, env, log)
        try:
            wait_http(f"{self.base}/healthz/live", ready_timeout, proc=self)
        except BaseException:
            self.stop()
            raise


def read_sse(
    http: httpx.Client,
    path: str,
    headers: dict[str, str] | None = None,
    on_event: Any = None,
    timeout: float = 60,
) -> list[tuple[str, str, str | None]]:
    """GET ``path`` (a Server-Sent Events route, e.g. ``/api/runs/ID/logs?follow=1``) and
    read the stream to its ``end`` event: [(event, data, id)]; ``on_event`` sees each as it
    comes."""
    out: list[tuple[str, str, str | None]] = []
    event, eid = "message", None
    data: list[str] = []
    with http.stream("GET", path, headers=headers or {}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line == "":
                if data:
                    out.append((event, "\n".join(data), eid))
                    if on_event is not None:
                        on_event(out[-1])
                    if event == "end":
                        break
                event, data, eid = "message", [], None
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif line.startswith("id:"):
                eid = line[3:].strip()
    return out


def fuzz_for_server_errors(base: str, headers: dict[str, str]) -> None:
    """schemathesis on every operation of the served OpenAPI: no answer is a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=headers)
    ran: dict[str, int] = {}

    def fuzz(operation: Any) -> None:
        strategy = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
            GenerationMode.NEGATIVE
        )

        @given(case=strategy)
        @settings(
            max_examples=25,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            response = case.call(base_url=base, headers=headers, timeout=60)
            ran[operation.label] = ran.get(operation.label, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])

        check()

    for result in schema.get_all_operations():
        fuzz(result.ok())  # type: ignore[union-attr]  # an Err (unreadable) fails here
    assert len(ran) == 9, ran  # with GET /api/runs and /logs (api_client.http.routes.runs)
    # GET /api/meta/runtime takes no input: one example is all there is
    assert all(n >= 5 for op, n in ran.items() if op != "GET /api/meta/runtime"), ran
