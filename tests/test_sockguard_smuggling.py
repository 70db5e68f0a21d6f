"""The socket guard (executor/runtimes/docker/sockguard/) against a hostile worker that
writes its own bytes on the guard's socket: request smuggling, framing tricks, legacy API
versions, oddly spelled root (issue 30).

Two halves. The differential one puts the guard in front of a recording engine of the test's
own (a unix-socket HTTP server that answers like the engine and keeps every byte it is sent)
and shows that for each hostile input the engine side receives nothing, or exactly the one
request the guard wrote itself (the bytes written out here, by hand: its own few headers, a
canonical path, a re-serialised create body). The other sends the same inputs, and the four
attacks that got through before (a start with a body on /v1.23, bare-LF smuggling,
``Expect: 100-continue`` desync, root spelled ``00``), to a real guard process in front of
the real engine: nothing is created, no host config replaced, no inspect leaked.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import pytest

from testkit.sockguard import SockGuardProcess

RECORDED_ID = "ab" * 32
PING_UP = b"GET /v1.41/_ping HTTP/1.1\r\nHost: docker\r\n\r\n"
SECRET_ENV = "STUDIO_GUARDTEST_SECRET"


# --- the hostile corpus ----------------------------------------------------------------------


@dataclass
class Case:
    id: str
    raw: bytes  # what the hostile client writes
    upstream: bytes | None = None  # what the engine may receive: None, nothing
    creates: bool = False  # passes a create (not sent to the real engine)

    @property
    def passed(self) -> bool:
        return self.upstream is not None


def _create(name: str, body: bytes, *, extra: bytes = b"", line_end: bytes = b"\r\n") -> bytes:
    head = [
        f"POST /v1.41/containers/create?name={name} HTTP/1.1".encode(),
        b"Host: docker",
        b"Content-Type: application/json",
        f"Content-Length: {len(body)}".encode(),
    ]
    return line_end.join(head) + line_end + extra + line_end + body


def _create_up(name: str, body: bytes) -> bytes:
    """The create as the guard writes it: its three headers, the body re-serialised."""
    canonical = json.dumps(json.loads(body)).encode()
    return (
        f"POST /v1.41/containers/create?name={name} HTTP/1.1\r\nHost: docker\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(canonical)}\r\n\r\n"
    ).encode() + canonical


def corpus(token: str, image: str, sandbox: dict[str, Any]) -> list[Case]:
    """≥ 40 framing and smuggling variants, and the semantic refusals of issue 30. ``sandbox``:
    a create body exactly as a worker sends it; ``token`` names and labels everything a
    hostile request would create, so the real engine can be asked what was made."""
    evil_name = f"studio-code-smug-{token}"
    evil = json.dumps(
        {
            "Image": image,
            "Cmd": ["true"],
            "Labels": {"studio.guardtest": token},
            "HostConfig": {"Privileged": True, "NetworkMode": "none"},
        }
    ).encode()
    smuggled = _create(evil_name, evil)
    good = json.dumps(sandbox).encode()
    good_name = f"studio-code-ok-{token}"

    def as_user(user: str) -> bytes:
        return json.dumps({**sandbox, "User": user}).encode()

    ping = b"GET /v1.41/_ping HTTP/1.1\r\nHost: docker\r\n"
    cases = [
        # bare LF / CR: the engine (Go's textproto) ends a line at a bare LF
        Case("bare-LF-ends-head-smuggles-create", ping + b"X-A: a\n\n" + smuggled),
        Case("bare-LF-everywhere", b"GET /v1.41/_ping HTTP/1.1\nHost: docker\n\n"),
        Case("bare-LF-line-then-CRLF", ping + b"X-A: a\nX-B: b\r\n\r\n"),
        Case("bare-CR-line-ends", b"GET /v1.41/_ping HTTP/1.1\rHost: docker\r\r"),
        Case("bare-CR-in-value", ping + b"X-A: a\rb\r\n\r\n"),
        Case("LF-in-value-smuggles-header", ping + b"X-A: a\nContent-Length: 99\r\n\r\n"),
        Case("CRLF-LF-blank-line", ping + b"\n" + smuggled),
        Case("create-with-bare-LF-head", _create(evil_name, evil, line_end=b"\n")),
        # folded and odd header lines
        Case("obs-fold-space", ping + b"X-A: a\r\n b\r\n\r\n"),
        Case("obs-fold-tab", ping + b"X-A: a\r\n\tb\r\n\r\n"),
        Case(
            "fold-hides-transfer-encoding", ping + b"X-A: a\r\n Transfer-Encoding: chunked\r\n\r\n"
        ),
        Case("space-before-colon", ping + b"Content-Length : 5\r\n\r\nhello"),
        Case("tab-before-colon", ping + b"X-A\t: a\r\n\r\n"),
        Case("no-colon", ping + b"X-A a\r\n\r\n"),
        Case("empty-name", ping + b": a\r\n\r\n"),
        Case("tab-in-value", ping + b"X-A: a\tb\r\n\r\n"),
        Case("NUL-in-value", ping + b"X-A: a\x00b\r\n\r\n"),
        Case("NUL-in-target", b"GET /v1.41/_ping\x00/x HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("DEL-in-value", ping + b"X-A: a\x7fb\r\n\r\n"),
        Case("ESC-in-value", ping + b"X-A: \x1b[2J\r\n\r\n"),
        Case("non-ASCII-in-value", ping + b"X-A: \xc3\xa9\r\n\r\n"),
        Case("non-ASCII-in-name", ping + b"X-\xc3\xa9: a\r\n\r\n"),
        Case("very-long-head", ping + b"X-A: " + b"a" * 70_000 + b"\r\n\r\n"),
        Case("leading-blank-line", b"\r\n" + ping + b"\r\n"),
        # body framing: Transfer-Encoding, Content-Length
        Case("CL-and-TE", _create(evil_name, evil, extra=b"Transfer-Encoding: chunked\r\n")),
        Case(
            "TE-chunked",
            f"POST /v1.41/containers/create?name={evil_name} HTTP/1.1\r\nHost: docker\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n{len(evil):x}\r\n".encode()
            + evil
            + b"\r\n0\r\n\r\n",
        ),
        Case(
            "TE-chunk-extension",
            f"POST /v1.41/containers/create?name={good_name} HTTP/1.1\r\nHost: docker\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n{len(good):x};ext=1\r\n".encode()
            + good
            + b"\r\n0\r\n\r\n",
        ),
        Case(
            "TE-trailers",
            f"POST /v1.41/containers/create?name={good_name} HTTP/1.1\r\nHost: docker\r\n"
            f"Transfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n{len(good):x}\r\n".encode()
            + good
            + b"\r\n0\r\nX-T: "
            + smuggled[:20]
            + b"\r\n\r\n",
        ),
        Case("TE-identity", ping + b"Transfer-Encoding: identity\r\n\r\n"),
        Case("TE-obfuscated", ping + b"Transfer-Encoding: xchunked\r\n\r\n"),
        Case("TE-two-values", ping + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n"),
        Case(
            "two-CL-equal",
            _create(evil_name, evil, extra=f"Content-Length: {len(evil)}\r\n".encode()),
        ),
        Case("two-CL-differ", _create(good_name, good, extra=b"Content-Length: 2\r\n")),
        Case("CL-list", ping + b"Content-Length: 0, 0\r\n\r\n"),
        Case("CL-plus-sign", ping + b"Content-Length: +0\r\n\r\n"),
        Case("CL-negative", ping + b"Content-Length: -1\r\n\r\n"),
        Case("CL-leading-zero", ping + b"Content-Length: 00\r\n\r\n"),
        Case("CL-huge", ping + b"Content-Length: 99999999999999999999\r\n\r\n"),
        Case(
            "body-on-ping-smuggles-create",
            ping + f"Content-Length: {len(smuggled)}\r\n\r\n".encode() + smuggled,
        ),
        Case(
            "body-on-list",
            b"GET /v1.41/containers/json HTTP/1.1\r\nHost: docker\r\nContent-Length: 2\r\n\r\n{}",
        ),
        # pipelining: each request is read, decided and written again on its own
        Case("pipelined-ping-then-create", ping + b"\r\n" + smuggled, PING_UP),
        Case(
            "pipelined-ping-then-exec",
            ping
            + b"\r\n"
            + b"POST /v1.41/containers/x/exec HTTP/1.1\r\nHost: docker\r\n"
            + b"Content-Length: 0\r\n\r\n",
            PING_UP,
        ),
        # Expect and other hop-by-hop tricks
        Case(
            "expect-100-continue-create",
            _create(good_name, good, extra=b"Expect: 100-continue\r\n"),
        ),
        Case(
            "expect-on-inspect",
            b"GET /v1.41/containers/x/json HTTP/1.1\r\nHost: docker\r\n"
            b"Expect: 100-continue\r\n\r\n",
        ),
        Case("TE-header", ping + b"TE: trailers\r\n\r\n"),
        Case("connection-drops-header", ping + b"Connection: close, Content-Length\r\n\r\n"),
        Case("upgrade-on-ping", ping + b"Connection: Upgrade\r\nUpgrade: h2c\r\n\r\n"),
        Case(
            "upgrade-on-create",
            _create(evil_name, evil, extra=b"Connection: Upgrade\r\nUpgrade: tcp\r\n"),
        ),
        Case("two-hosts", ping + b"Host: other\r\n\r\n"),
        # request lines
        Case("http-1.0", b"GET /v1.41/_ping HTTP/1.0\r\n\r\n"),
        Case("http-0.9", b"GET /v1.41/_ping\r\n\r\n"),
        Case("http-2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        Case("absolute-form", b"GET http://docker/v1.41/_ping HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case(
            "absolute-form-create", smuggled.replace(b"POST /v1.41", b"POST http://docker/v1.41", 1)
        ),
        Case("authority-form", b"CONNECT docker:80 HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("options-star", b"OPTIONS * HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("lowercase-method", b"get /v1.41/_ping HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("two-spaces", b"GET  /v1.41/_ping HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("tab-in-request-line", b"GET\t/v1.41/_ping HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("encoded-dots", b"GET /v1.41/containers/%2e%2e/exec HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("double-slash", b"GET /v1.41//containers/json HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("fragment", b"GET /v1.41/_ping#x HTTP/1.1\r\nHost: docker\r\n\r\n"),
        # versions and routes
        Case("old-version-create", smuggled.replace(b"/v1.41/", b"/v1.23/", 1)),
        Case(
            "old-version-start-body",
            b"POST /v1.23/containers/x/start HTTP/1.1\r\nHost: docker\r\nContent-Length: 19"
            b'\r\n\r\n{"Privileged":true}',
        ),
        Case("version-1.40-ping", b"GET /v1.40/_ping HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("version-leading-zero", b"GET /v1.041/info HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("version-upper-case", b"GET /V1.41/info HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case("unversioned-create", smuggled.replace(b"/v1.41/", b"/", 1)),
        Case("unversioned-inspect", b"GET /containers/x/json HTTP/1.1\r\nHost: docker\r\n\r\n"),
        Case(
            "start-with-body-1.41",
            b"POST /v1.41/containers/x/start HTTP/1.1\r\nHost: docker\r\n"
            b"Content-Length: 2\r\n\r\n{}",
        ),
        Case("query-twice", _create(good_name, good).replace(b"?name=", b"?name=x&name=", 1)),
        Case(
            "query-unknown",
            _create(good_name, good).replace(b"?name=", b"?platform=linux&name=", 1),
        ),
        Case("query-semicolon", b"GET /v1.41/_ping?a=1;b=2 HTTP/1.1\r\nHost: docker\r\n\r\n"),
        # the sandbox's identity
        *(
            Case(f"user-{u}", _create(good_name, as_user(u)))
            for u in ("00", "+0", "00:00", "0:1", "1:0", "0x0:0x0", " 1:1", "root", "65534", "1:01")
        ),
        Case(
            "create-without-name",
            _create(good_name, good).replace(f"?name={good_name}".encode(), b"", 1),
        ),
        Case("create-other-name", _create("evil", good)),
        # what passes: only the guard's own bytes reach the engine
        Case(
            "ping-with-client-headers",
            ping + b"User-Agent: x\r\nX-Registry-Auth: e30=\r\nAccept-Encoding: gzip\r\n"
            b"X-Forwarded-For: 1.2.3.4\r\nConnection: keep-alive\r\n\r\n",
            PING_UP,
        ),
        Case(
            "unversioned-version",
            b"GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n",
            b"GET /version HTTP/1.1\r\nHost: docker\r\n\r\n",
        ),
        Case(
            "create-re-serialised",
            _create(
                good_name,
                json.dumps(sandbox, indent=2).encode(),
                extra=b"X-Registry-Auth: e30=\r\n",
            ),
            _create_up(good_name, json.dumps(sandbox, indent=2).encode()),
            creates=True,
        ),
    ]
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids repeat"
    return cases


# --- a recording engine --------------------------------------------------------------------


class RecordingEngine:
    """A unix-socket HTTP server standing in for the engine: keeps every byte each connection
    sends it and answers like the engine (ping, version, create, a labelled inspect)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.received: list[bytearray] = []
        self.interim = False  # a 100 Continue before every answer
        self.inspect_id = RECORDED_ID  # the Id its inspect answers name
        self.lock = threading.Lock()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def take(self) -> list[bytes]:
        """What each connection received since the last take (connections that got nothing
        left out)."""
        with self.lock:
            out = [bytes(b) for b in self.received if b]
            for b in self.received:
                b.clear()
        return out

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            record = bytearray()
            with self.lock:
                self.received.append(record)
            threading.Thread(target=self._serve, args=(conn, record), daemon=True).start()

    def _serve(self, conn: socket.socket, record: bytearray) -> None:
        h = h11.Connection(h11.SERVER)
        try:
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    data = conn.recv(65536)
                    with self.lock:
                        record += data
                    h.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.EndOfMessage):
                    status, body = self._answer(request, self.inspect_id)
                    if self.interim:
                        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    headers = [("Content-Type", "application/json"), ("Api-Version", "1.41")]
                    headers.append(("Content-Length", str(len(body))))
                    out = h.send(h11.Response(status_code=status, headers=headers)) or b""
                    out += (h.send(h11.Data(data=body)) or b"") + (
                        h.send(h11.EndOfMessage()) or b""
                    )
                    conn.sendall(out)
                    h.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except (OSError, h11.ProtocolError):
            return
        finally:
            conn.close()

    @staticmethod
    def _answer(request: h11.Request, inspect_id: str) -> tuple[int, bytes]:
        path = request.target.split(b"?")[0].decode()
        if path.endswith("/_ping"):
            return 200, b"OK"
        if path.endswith("/version"):
            return 200, json.dumps({"ApiVersion": "1.41", "MinAPIVersion": "1.12"}).encode()
        if path.endswith("/containers/create"):
            return 201, json.dumps({"Id": RECORDED_ID, "Warnings": []}).encode()
        if path.endswith("/json") and "/containers/" in path:
            labels = {"studio.owner": "o", "studio.job_id": "j"}
            info = {"Id": inspect_id, "Name": "/studio-code-rec", "Config": {"Labels": labels}}
            return 200, json.dumps(info).encode()
        return 200, b"{}"


def talk(path: str, raw: bytes, *, one_answer: bool) -> list[tuple[int, bytes]]:
    """Write ``raw`` on a new connection to the guard and read its answers: until it closes,
    or (``one_answer``) the first whole one. (status, body) each."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)  # a hang guard, never a timing assertion
    s.connect(path)
    try:
        s.sendall(raw)
    except OSError:
        pass  # the guard refused and closed before reading all of it
    buf = b""
    answers: list[tuple[int, bytes]] = []
    while True:
        while (end := buf.find(b"\r\n\r\n")) >= 0:
            head = buf[:end].decode("latin-1").split("\r\n")
            fields = dict(line.split(": ", 1) for line in head[1:])
            length = int(fields.get("Content-Length", "0"))
            if len(buf) < end + 4 + length:
                break
            answers.append((int(head[0].split(" ")[1]), buf[end + 4 : end + 4 + length]))
            buf = buf[end + 4 + length :]
            if one_answer:
                s.close()
                return answers
        try:
            data = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            data = b""
        if not data:
            s.close()
            assert not buf, f"a partial answer: {buf[:200]!r}"
            return answers
        buf += data


def refused_answer(answers: list[tuple[int, bytes]]) -> str:
    """The guard's refusal among ``answers`` (the last one), its message."""
    assert answers, "no answer: the guard closed without its refusal"
    status, body = answers[-1]
    assert status in (400, 403, 413, 431, 502), (status, body[:300])
    message = json.loads(body)["message"]
    assert message.startswith("sockguard: "), message
    return str(message)


# --- fixtures --------------------------------------------------------------------------------


def _sandbox_body(image: str, token: str) -> dict[str, Any]:
    """A create body exactly as a worker's Docker SDK writes it (sandbox_policy), labelled
    with ``token``."""
    import docker

    from testkit.sockguard import sandbox_args

    api = docker.APIClient(base_url="unix:///nonexistent", version="1.41")
    args = sandbox_args(api, image)
    args["labels"] = {**args["labels"], "studio.guardtest": token}
    return dict(api.create_container_config(**args))


@pytest.fixture(scope="module")
def token() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RecordingEngine, str]]:
    """A guard (in this process, on a thread) in front of a recording engine."""
    from executor.runtimes.docker.sockguard import Policy, SockGuard
    from executor.settings import load_settings

    tmp = tmp_path_factory.mktemp("smuggle")
    engine = RecordingEngine(tmp / "engine.sock")
    guard = SockGuard(
        Policy.from_settings(load_settings(enable_code_nodes=True)),
        str(tmp / "guard.sock"),
        engine.path,
    )
    guard.bind()
    threading.Thread(target=guard.serve_forever, daemon=True).start()
    yield engine, guard.listen
    guard.close()
    engine.close()


def _cases() -> list[Case]:
    """The corpus with placeholders (for the test ids; each test builds its own)."""
    from executor.settings import load_settings

    return corpus("ids", load_settings().code_image, {"Image": "x"})


CASE_IDS = [c.id for c in _cases()]


def test_the_corpus_is_large_enough() -> None:
    framing = [c for c in _cases() if not c.id.startswith(("user-", "create-"))]
    assert len(framing) >= 40, len(framing)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_the_engine_receives_nothing_or_only_what_the_guard_wrote(
    recorded: tuple[RecordingEngine, str], case_id: str, token: str
) -> None:
    from executor.settings import load_settings

    engine, listen = recorded
    image = load_settings().code_image
    case = next(c for c in corpus(token, image, _sandbox_body(image, token)) if c.id == case_id)
    engine.take()
    pipelined = case.id.startswith("pipelined")
    answers = talk(listen, case.raw, one_answer=case.passed and not pipelined)
    got = engine.take()
    if case.passed:
        assert answers and answers[0][0] in (200, 201), answers
        assert got == [case.upstream], got
        # and that is one request, read so by a parser of its own
        h = h11.Connection(h11.SERVER)
        h.receive_data(got[0])
        events = []
        while (event := h.next_event()) is not h11.NEED_DATA:
            events.append(type(event).__name__)
            if isinstance(event, h11.EndOfMessage):  # answer it, to read what follows
                h.send(h11.Response(status_code=204, headers=[]))
                h.send(h11.EndOfMessage())
                h.start_next_cycle()
        assert events.count("Request") == 1, events
    else:
        refused_answer(answers)
        assert got == [], got
    if pipelined:
        refused_answer(answers)  # the second request of the two


def test_an_interim_answer_is_consumed_and_a_lookup_must_name_the_container_asked_for(
    recorded: tuple[RecordingEngine, str],
) -> None:
    engine, listen = recorded
    inspect = b"GET /v1.41/containers/studio-code-rec/json HTTP/1.1\r\nHost: docker\r\n\r\n"
    lookup = inspect  # the guard's own lookup, on the version it looks up with
    engine.take()
    engine.interim = True
    try:
        last = PING_UP.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        answers = talk(listen, PING_UP + inspect + last, one_answer=False)
        # three answers, none of them the 100: the guard frames each itself
        assert [a[0] for a in answers] == [200, 200, 200], answers
        assert json.loads(answers[1][1])["Id"] == RECORDED_ID
        sent = engine.take()
        assert b"".join(sent).count(b"GET ") == 4, sent  # ping, lookup, inspect, ping
    finally:
        engine.interim = False
    # an answer for another container than the one asked for: refused, nothing else sent
    engine.inspect_id = "cd" * 32
    try:
        other = inspect.replace(b"studio-code-rec", b"studio-code-other")
        message = refused_answer(talk(listen, other, one_answer=False))
        assert "for another container" in message, message
        assert engine.take() == [lookup.replace(b"studio-code-rec", b"studio-code-other")]
    finally:
        engine.inspect_id = RECORDED_ID


# --- the real engine, a real guard process ---------------------------------------------------


@pytest.fixture(scope="module")
def real_guard(tmp_path_factory: pytest.TempPathFactory, docker_client: Any) -> Iterator[Any]:
    with SockGuardProcess(tmp_path_factory.mktemp("smuggle-real")) as g:
        yield g


def _made(docker_client: Any, token: str) -> list[str]:
    """The containers the engine holds that a hostile request of this module made."""
    found = {c["Id"] for c in docker_client.api.containers(all=True, filters={"name": token})}
    found |= {
        c["Id"]
        for c in docker_client.api.containers(
            all=True, filters={"label": f"studio.guardtest={token}"}
        )
    }
    return sorted(found)


@pytest.fixture(scope="module")
def cleanup(docker_client: Any, token: str) -> Iterator[None]:
    yield
    for cid in _made(docker_client, token):
        docker_client.api.remove_container(cid, force=True)


@pytest.mark.docker
def test_the_corpus_against_the_real_engine_creates_nothing(
    real_guard: Any, docker_client: Any, python_image: str, token: str, cleanup: None
) -> None:
    cases = corpus(token, python_image, _sandbox_body(python_image, token))
    assert _made(docker_client, token) == []
    for case in cases:
        if case.creates:
            continue
        pipelined = case.id.startswith("pipelined")
        answers = talk(
            real_guard.path.as_posix(), case.raw, one_answer=case.passed and not pipelined
        )
        if case.passed:
            assert answers[0][0] == 200, (case.id, answers)
        if not case.passed or pipelined:
            refused_answer(answers)
    assert _made(docker_client, token) == []


@pytest.fixture
def sandbox(real_guard: Any, docker_client: Any, python_image: str, token: str) -> Iterator[str]:
    """A labelled sandbox created through the guard, as a worker does (never started)."""
    import docker

    from testkit.sockguard import sandbox_args

    api = docker.APIClient(base_url=real_guard.host, timeout=30)
    args = sandbox_args(api, python_image)
    cid = api.create_container(name=f"studio-code-guardtest-{uuid.uuid4().hex[:12]}", **args)["Id"]
    try:
        yield cid
    finally:
        api.close()
        docker_client.api.remove_container(cid, force=True)


@pytest.mark.docker
def test_a_start_with_a_host_config_on_an_old_api_version_is_refused(
    real_guard: Any, docker_client: Any, sandbox: str, tmp_path: Path
) -> None:
    """Below API 1.24 the engine replaces a container's whole host config on start."""
    body = json.dumps({"Privileged": True, "Binds": [f"{tmp_path}:/host:rw"]}).encode()
    for version in ("/v1.23", "/v1.41", ""):
        raw = (
            f"POST {version}/containers/{sandbox}/start HTTP/1.1\r\nHost: docker\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        message = refused_answer(talk(real_guard.path.as_posix(), raw, one_answer=False))
        assert "API version" in message or "with a body" in message, message
    info = docker_client.api.inspect_container(sandbox)
    assert info["State"]["Status"] == "created", info["State"]
    assert info["HostConfig"]["Privileged"] is False
    assert not info["HostConfig"]["Binds"], info["HostConfig"]["Binds"]


@pytest.mark.docker
def test_a_bare_LF_smuggles_no_create_past_the_guard(
    real_guard: Any, docker_client: Any, python_image: str, token: str, cleanup: None
) -> None:
    evil = json.dumps(
        {"Image": python_image, "Cmd": ["true"], "Labels": {"studio.guardtest": token},
         "HostConfig": {"Privileged": True}}
    ).encode()  # fmt: skip
    raw = (
        b"GET /_ping HTTP/1.1\r\nHost: docker\r\nX-A: a\n\n"
        + f"POST /v1.41/containers/create?name=studio-code-lf-{token} HTTP/1.1\n"
        f"Host: docker\nContent-Type: application/json\nContent-Length: {len(evil)}\n\n".encode()
        + evil
        + b"\r\n\r\n"
    )
    answers = talk(real_guard.path.as_posix(), raw, one_answer=False)
    assert _made(docker_client, token) == []
    assert "bare LF" in refused_answer(answers)


@pytest.mark.docker
def test_expect_100_continue_leaks_no_other_containers_inspect(
    real_guard: Any, docker_client: Any, python_image: str, sandbox: str, token: str, cleanup: None
) -> None:
    """Before: the guard took the engine's interim 100 as the answer, its answers fell one
    behind, and its label lookup approved a container that is no sandbox; the client got
    that container's inspect, its environment included."""
    secret = uuid.uuid4().hex
    other = docker_client.api.create_container(
        python_image,
        ["true"],
        name=f"guardtest-secret-{token}",
        environment={SECRET_ENV: secret},
        network_disabled=True,
    )["Id"]
    try:
        import docker

        from testkit.sockguard import sandbox_args

        api = docker.APIClient(base_url=real_guard.host, timeout=30)
        body = json.dumps(
            dict(api.create_container_config(**sandbox_args(api, python_image)))
        ).encode()
        api.close()
        path = real_guard.path.as_posix()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        seen = b""
        requests = [
            _create(f"studio-code-expect-{token}", body, extra=b"Expect: 100-continue\r\n"),
            f"GET /v1.41/containers/{sandbox}/json HTTP/1.1\r\nHost: docker\r\n\r\n".encode(),
            f"GET /v1.41/containers/{other}/json HTTP/1.1\r\nHost: docker\r\n\r\n".encode(),
        ]
        for raw in requests:
            try:
                s.sendall(raw)
            except OSError:
                break
            # what the guard answers to this request: a refusal and a close, or answers
            # read until a pause (a window to collect, not a timing assertion)
            s.settimeout(1.5)
            try:
                while data := s.recv(65536):
                    seen += data
            except TimeoutError:
                pass
            except OSError:
                break
        s.close()
        assert secret.encode() not in seen, "another container's inspect reached the client"
        assert b"the header expect" in seen  # the refusal names it
        # and on connections of its own, that container stays out of reach
        message = refused_answer(talk(path, requests[2], one_answer=False))
        assert "not a sandbox" in message, message
    finally:
        docker_client.api.remove_container(other, force=True)
        for cid in _made(docker_client, token):
            docker_client.api.remove_container(cid, force=True)


@pytest.mark.docker
@pytest.mark.parametrize("user", ["00", "+0", "00:00", "0:0", "65534:0"])
def test_root_spelled_oddly_is_refused(
    real_guard: Any, docker_client: Any, python_image: str, token: str, user: str, cleanup: None
) -> None:
    body = json.dumps({**_sandbox_body(python_image, token), "User": user}).encode()
    raw = _create(f"studio-code-user-{token}-{uuid.uuid4().hex[:6]}", body)
    message = refused_answer(talk(real_guard.path.as_posix(), raw, one_answer=False))
    assert f"User {user!r}" in message, message
    assert _made(docker_client, token) == []


@pytest.mark.docker
def test_a_create_without_a_sandbox_name_is_refused(
    real_guard: Any, docker_client: Any, python_image: str, token: str, cleanup: None
) -> None:
    body = json.dumps(_sandbox_body(python_image, token)).encode()
    raw = _create("x", body).replace(b"?name=x", b"", 1)
    message = refused_answer(talk(real_guard.path.as_posix(), raw, one_answer=False))
    assert "name" in message, message
    assert _made(docker_client, token) == []
