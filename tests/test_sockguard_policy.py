"""The socket guard's one table of allowed calls (executor/runtimes/docker/sockguard/routes.py):
``studio-code sockguard --print-policy`` prints it, docs/security.md carries the same text,
and the decision on a request (``decide``) is pure: what it must know of a container it asks
of the lookup it is given, and it passes exactly the table's calls."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from testkit.processes import BIN

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "security.md"
CID = "ab" * 32


def docs_table() -> str:
    text = DOCS.read_text()
    m = re.search(r"<!-- sockguard-policy -->\n(.*?)<!-- /sockguard-policy -->", text, re.S)
    assert m, "docs/security.md has no <!-- sockguard-policy --> block"
    return m.group(1)


def test_the_docs_list_is_the_table_the_guard_prints() -> None:
    out = subprocess.run(
        [str(BIN / "studio-code"), "sockguard", "--print-policy"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out == docs_table(), "docs/security.md's table differs from --print-policy's"
    from executor.runtimes.docker.sockguard import ROUTES

    assert len(out.strip().splitlines()) == len(ROUTES) + 2


def request(head: str) -> object:
    from executor.runtimes.docker.sockguard.grammar import parse_head

    raw = head.replace("\n", "\r\n").encode() + b"Host: docker\r\n\r\n"
    return parse_head(raw)[1]


#: one request each route of the table passes (lookups answered by the test)
PASSED = {
    "ping": ("GET /_ping HTTP/1.1\n", "GET", "/_ping"),
    "version": ("GET /v1.41/version HTTP/1.1\n", "GET", "/v1.41/version"),
    "info": ("HEAD /v1.43/info HTTP/1.1\n", "HEAD", "/v1.43/info"),
    "create": (
        "POST /v1.41/containers/create?name=studio-code-x HTTP/1.1\nContent-Length: 2\n",
        "POST",
        "/v1.41/containers/create",
    ),
    "list": (
        'GET /v1.41/containers/json?all=1&filters={"label":["studio.owner"]} HTTP/1.1\n',
        "GET",
        "/v1.41/containers/json",
    ),
    "events": (
        "GET /v1.41/events?since=1&until=2&filters="
        '{"container":["studio-code-x"],"event":["kill"]} HTTP/1.1\n',
        "GET",
        "/v1.41/events",
    ),
    "image": ("GET /v1.41/images/studio-code:1/json HTTP/1.1\n", "GET", None),
    "attach": (
        "POST /v1.41/containers/studio-code-x/attach?stream=1 HTTP/1.1\n"
        "Connection: Upgrade\nUpgrade: tcp\n",
        "POST",
        f"/v1.41/containers/{CID}/attach",
    ),
    "start": ("POST /v1.41/containers/studio-code-x/start HTTP/1.1\n", "POST", None),
    "wait": (
        "POST /v1.41/containers/studio-code-x/wait?condition=removed HTTP/1.1\n",
        "POST",
        None,
    ),
    "rename": (
        "POST /v1.41/containers/studio-code-x/rename?name=studio-code-y HTTP/1.1\n",
        "POST",
        None,
    ),
    "inspect": ("GET /v1.41/containers/studio-code-x/json HTTP/1.1\n", "GET", None),
    "archive": (
        "GET /v1.41/containers/studio-code-x/archive?path=/usr/share/studio-code/modules.json"
        " HTTP/1.1\n",
        "GET",
        f"/v1.41/containers/{CID}/archive",
    ),
    "remove": ("DELETE /v1.41/containers/studio-code-x?force=1 HTTP/1.1\n", "DELETE", None),
}


def test_decide_passes_each_route_of_the_table_asking_its_lookup_only() -> None:
    from executor.runtimes.docker.sockguard import ROUTES, decide
    from executor.runtimes.docker.sockguard.routes import NeedLookup

    assert set(PASSED) == {r.name for r in ROUTES}
    images = frozenset({"studio-code:1"})
    for name, (head, method, path) in PASSED.items():
        asked: list[str] = []

        def lookup(ref: str, asked: list[str] = asked) -> str:
            asked.append(ref)
            return CID

        call = decide(request(head), lookup, images, now=1.0)  # type: ignore[arg-type]
        assert call.op == name and call.method == method, (name, call)
        if path is not None:
            assert call.path == path, (name, call)
        route = next(r for r in ROUTES if r.name == name)
        assert asked == (["studio-code-x"] if route.on == "sandbox" else []), (name, asked)
        if route.on == "sandbox" and name != "events":
            assert CID in call.path, call

        def unknown(ref: str) -> str:
            raise NeedLookup(ref)

        if route.on == "sandbox":  # the server looks it up, then decides again
            with pytest.raises(NeedLookup):
                decide(request(head), unknown, images, now=1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "head",
    [
        "POST /v1.41/containers/studio-code-x/kill HTTP/1.1\n",
        "POST /v1.41/containers/studio-code-x/stop HTTP/1.1\n",
        "POST /v1.41/containers/studio-code-x/exec HTTP/1.1\n",
        "POST /v1.41/images/create?fromImage=alpine HTTP/1.1\n",
        "GET /v1.41/volumes HTTP/1.1\n",
        "HEAD /v1.41/events HTTP/1.1\n",
        "GET /v1.41/containers/studio-code-x/start HTTP/1.1\n",
        "GET /v1.41/images/debian:12/json HTTP/1.1\n",
        "GET /info HTTP/1.1\n",
        "GET /v1.40/_ping HTTP/1.1\n",
    ],
)
def test_decide_refuses_what_the_table_lacks_without_a_lookup(head: str) -> None:
    from executor.runtimes.docker.sockguard import Refused, decide

    def lookup(ref: str) -> str:
        raise AssertionError(f"looked up {ref}")

    with pytest.raises(Refused) as info:
        decide(request(head), lookup, frozenset({"studio-code:1"}), now=1.0)  # type: ignore[arg-type]
    assert info.value.status == 403, info.value.message
