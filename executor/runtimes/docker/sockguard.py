"""The socket guard: what a worker may ask of the Docker engine.

Whoever reaches the Docker socket is root on the host. A worker needs only a few of the
engine's calls, so the guard listens on a unix socket of its own and passes to the real
socket only those (``studio-code sockguard --listen ... --upstream ...``); everything else
gets HTTP 403 with a JSON ``{"message": ...}`` body, which the Docker SDK shows as the
error, and a WARNING in the guard's log naming what was refused.

Passed on (any ``/v1.NN`` API version prefix):

* ``GET|HEAD /_ping``, ``GET /version``, ``GET /info``: the SDK's version negotiation,
  health and readiness probes, the engine's posture;
* ``GET /images/<name>/json`` for the configured images only (readiness, the pool's image
  id check);
* ``POST /containers/create`` only in exactly the shape ``sandbox_policy``
  (executor/runtimes/docker/policy.py) makes: its host config's fixed fields equal (network none,
  read-only root, the tmpfs, no binds, CapDrop ALL, no-new-privileges and the project's own
  seccomp profile, ipc none, the ulimits, no log driver, the configured OCI runtime), the
  limits present and within the settings' caps, every other field of the request empty
  (no Privileged, Mounts, Devices, CapAdd, host namespaces, MaskedPaths...), a configured
  image, a user other than root, the project's labels, a ``studio-code-`` name;
* on a container carrying the project's labels (``studio.owner`` with ``studio.job_id`` or
  ``studio.pool``): attach (the hijacked stream is passed on raw both ways), start, wait,
  rename (to a ``studio-code-`` name), inspect, remove, and a read of the
  image's modules file (``GET .../archive`` of that one path: the save-time import check).
  The guard looks a container up upstream (its labels), remembers the ids it checked or
  created, and passes the call on by id, so a name cannot change hands in between;
* ``GET /containers/json`` only with a label filter of the project's.

That is exactly what the runtime, the pool, the reaper, the readiness and posture probes and
the save-time import check call (their tests run through a guard with every passed call
logged: ``STUDIO_TEST_THROUGH_SOCKGUARD=1``); kill, stop and events, which nothing of the
project calls (a sandbox is ended by a forced remove), are refused too.

Everything else (exec, image pull/build/load/push, volumes, networks, swarm, plugins,
secrets, commit, update, copy into a container...) is refused.

One thread per client connection, one upstream connection per client connection, kept
alive: a request costs a parse and a copy, not a connect.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import socket
import stat
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

log = logging.getLogger("studio_code.sockguard")

#: what marks a container as one of ours (executor/runtimes/docker/policy.py's labels)
OWNER, JOB, POOL, DEADLINE, LANGUAGE = (
    "studio.owner",
    "studio.job_id",
    "studio.pool",
    "studio.deadline",
    "studio.language",
)
OUR_LABELS = frozenset({OWNER, JOB, POOL, DEADLINE, LANGUAGE})
NAME_PREFIX = "studio-code-"
#: the one file a container may be read from (executor/languages/python_modules.py)
MODULES_PATH = "/usr/share/studio-code/modules.json"

MAX_HEAD = 64 * 1024
MAX_BODY = 4 * 1024 * 1024
CHUNK = 1 << 16
IDLE_UPSTREAM = 16

_VERSION = re.compile(r"^/v[0-9]{1,2}\.[0-9]{1,3}(?=/)")
_CONTAINER_OP = re.compile(r"^/containers/([A-Za-z0-9][A-Za-z0-9_.-]*)/([a-z]+)$")
_CONTAINER = re.compile(r"^/containers/([A-Za-z0-9][A-Za-z0-9_.-]*)$")
_IMAGE = re.compile(r"^/images/([A-Za-z0-9][A-Za-z0-9_.:/@-]*)/json$")
#: the operations on one of our containers, by method
CONTAINER_OPS = {
    ("POST", "attach"),
    ("POST", "start"),
    ("POST", "wait"),
    ("POST", "rename"),
    ("GET", "json"),
    ("GET", "archive"),
}
#: query parameters each route may carry (anything else is refused)
QUERY = {
    "create": {"name"},
    "list": {"all", "limit", "size", "filters", "trunc_cmd", "since", "before"},
    "attach": {"stdin", "stdout", "stderr", "stream", "logs", "detachKeys"},
    "start": set(),
    "wait": {"condition"},
    "rename": {"name"},
    "json": {"size"},
    "archive": {"path"},
    "remove": {"force", "v", "link"},
    "image": set(),
    "plain": set(),
}


class Refused(Exception):
    """A call the guard does not pass on; the message says what and why."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class _Closed(Exception):
    """The peer closed its end."""


# --- the policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What a create must look like, from the same settings the workers run with."""

    images: frozenset[str]
    host_config: dict[str, Any]  # the fixed fields of sandbox_policy's host config
    max_memory: int
    max_nano_cpus: int
    max_pids: int

    @classmethod
    def from_settings(cls, settings: Any, images: list[str] | None = None) -> Policy:
        from docker.types import HostConfig

        from executor.languages import get_language
        from executor.models import CodeJob, Limits
        from executor.runtimes.docker.policy import sandbox_policy

        limits = Limits(
            memory_bytes=settings.max_memory_bytes,
            cpus=settings.max_cpus,
            pids=settings.code_pids,
            timeout_s=1,
            log_max_bytes=1,
            output_max_bytes=1,
        )
        python = get_language("python")
        policy = sandbox_policy(settings, python, CodeJob(code=""), limits, "guard:0")
        fixed = dict(HostConfig(version="1.41", **policy["host_config"]))
        for varying in ("Memory", "MemorySwap", "NanoCpus", "PidsLimit"):
            fixed.pop(varying, None)
        return cls(
            images=frozenset(images or [settings.code_image, settings.code_ts_image]),
            host_config=fixed,
            max_memory=settings.max_memory_bytes,
            max_nano_cpus=int(settings.max_cpus * 1e9),
            max_pids=settings.code_pids,
        )

    def check_create(self, body: dict[str, Any], name: str | None) -> None:
        """Raise Refused unless ``body`` is a sandbox exactly as ``sandbox_policy`` makes it."""
        if name is not None and not name.startswith(NAME_PREFIX):
            raise Refused(f"container name {name!r}: a sandbox's name starts with {NAME_PREFIX}")
        top = _fields(body, "the create request")
        image = top.get("image")
        if image not in self.images:
            raise Refused(
                f"image {image!r} is not one of the configured sandbox images "
                f"({', '.join(sorted(self.images))})"
            )
        labels = top.get("labels")
        if not isinstance(labels, dict) or not (
            OWNER in labels and DEADLINE in labels and (JOB in labels or POOL in labels)
        ):
            raise Refused(
                f"labels {labels!r}: a sandbox carries {OWNER}, {DEADLINE} and {JOB} or {POOL}"
            )
        user = top.get("user")
        if not isinstance(user, str) or user.split(":")[0] in ("", "0", "root"):
            raise Refused(f"User {user!r}: a sandbox never runs as root or the image's user")
        if top.get("networkdisabled") is not True:
            raise Refused("NetworkDisabled is not true: a sandbox has no network")
        allowed_top = {
            "image", "labels", "user", "networkdisabled", "hostconfig", "hostname", "cmd",
            "env", "workingdir", "tty", "openstdin", "stdinonce", "attachstdin",
            "attachstdout", "attachstderr",
        }  # fmt: skip
        _only_empty(top, allowed_top, "")
        hc = top.get("hostconfig")
        if not isinstance(hc, dict):
            raise Refused("no HostConfig: a sandbox is created with the project's host config")
        host = _fields(hc, "HostConfig")
        self._check_host(host)

    def _check_host(self, host: dict[str, Any]) -> None:
        # the refusals an operator is most likely to look for, named first
        if host.get("privileged"):
            raise Refused("HostConfig.Privileged: a sandbox is never privileged")
        for key in ("binds", "mounts", "volumesfrom", "devices", "devicerequests"):
            if host.get(key):
                raise Refused(
                    f"HostConfig.{_NAMES[key]} {host[key]!r}: a sandbox has no host "
                    "mounts or devices (a tmpfs /tmp only)"
                )
        for key in ("pidmode", "ipcmode", "utsmode", "usernsmode", "cgroupnsmode"):
            if str(host.get(key) or "").startswith(("host", "container:")):
                raise Refused(
                    f"HostConfig.{_NAMES[key]} {host[key]!r}: no host or shared namespace"
                )
        if host.get("networkmode") != "none":
            raise Refused(
                f"HostConfig.NetworkMode {host.get('networkmode')!r}: a sandbox's network is none"
            )
        if host.get("capadd"):
            raise Refused(f"HostConfig.CapAdd {host['capadd']!r}: a sandbox adds no capability")
        opts = host.get("securityopt") or []
        for opt in opts if isinstance(opts, list) else [opts]:
            if isinstance(opt, str) and opt.replace(":", "=").split("=")[0] in (
                "seccomp",
                "apparmor",
                "label",
                "systempaths",
            ):
                if "unconfined" in opt or "disable" in opt:
                    raise Refused(f"HostConfig.SecurityOpt {opt!r}: confinement is never off")
        for key in ("maskedpaths", "readonlypaths"):
            if key in host:
                raise Refused(f"HostConfig.{_NAMES[key]}: the engine's masked /proc paths stay")
        # then the whole shape: the fixed fields equal to sandbox_policy's
        for key, want in self.host_config.items():
            got = host.get(key.lower())
            if got != want:
                shown = str(got)[:120] + ("..." if len(str(got)) > 120 else "")
                raise Refused(f"HostConfig.{key} {shown}: not the sandbox policy's value")
        memory, swap = host.get("memory"), host.get("memoryswap")
        if not _int_in(memory, self.max_memory) or swap != memory:
            raise Refused(
                f"HostConfig.Memory {memory!r} / MemorySwap {swap!r}: a sandbox's memory is "
                f"set, at most {self.max_memory}, and its swap equal to it"
            )
        if not _int_in(host.get("nanocpus"), self.max_nano_cpus):
            raise Refused(
                f"HostConfig.NanoCpus {host.get('nanocpus')!r}: set, at most {self.max_nano_cpus}"
            )
        if not _int_in(host.get("pidslimit"), self.max_pids):
            raise Refused(
                f"HostConfig.PidsLimit {host.get('pidslimit')!r}: set, at most {self.max_pids}"
            )
        fixed = {k.lower() for k in self.host_config}
        _only_empty(host, fixed | {"memory", "memoryswap", "nanocpus", "pidslimit"}, "HostConfig.")


#: the engine's spelling of the fields the refusals name
_NAMES = {
    n.lower(): n
    for n in (
        "Binds Mounts VolumesFrom Devices DeviceRequests PidMode IpcMode UTSMode UsernsMode "
        "CgroupnsMode NetworkMode CapAdd SecurityOpt MaskedPaths ReadonlyPaths"
    ).split()
}


def _fields(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``obj``'s keys lowercased (the engine matches JSON keys case-insensitively): two keys
    that differ only in case, or a key that is not plain ASCII, are refused."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        low = key.lower()
        if not key.isascii() or low in out:
            raise Refused(f"{where}: the key {key!r} is ambiguous")
        out[low] = value
    return out


def _only_empty(fields: dict[str, Any], allowed: set[str], prefix: str) -> None:
    for key, value in fields.items():
        if key not in allowed and value not in (None, False, 0, "", [], {}):
            raise Refused(f"{prefix}{key} {str(value)[:120]}: not a field a sandbox sets")


def _int_in(value: Any, top: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= top


def _ours(labels: Any) -> bool:
    return isinstance(labels, dict) and OWNER in labels and (JOB in labels or POOL in labels)


def _label_filter(query: dict[str, str], what: str) -> None:
    """The list call must filter on one of the project's labels."""
    try:
        filters = json.loads(query.get("filters") or "{}")
    except ValueError:
        filters = None
    labels = filters.get("label") if isinstance(filters, dict) else None
    if isinstance(labels, dict):  # the engine also takes {"label": {"k=v": true}}
        labels = [k for k, v in labels.items() if v]
    if not isinstance(labels, list) or not any(
        isinstance(v, str) and v.split("=", 1)[0] in OUR_LABELS for v in labels
    ):
        raise Refused(f"{what} without a filter on a studio.* label: only sandboxes are listed")


# --- HTTP on a socket ----------------------------------------------------------------------


class _Stream:
    """A socket with a read buffer: lines, exact reads, and what is buffered so far."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(CHUNK)
        if not data:
            raise _Closed()
        self.buf += data

    def head(self) -> bytes:
        """Up to and including the blank line ending a message's head."""
        start = 0
        while True:
            end = self.buf.find(b"\r\n\r\n", start)
            if end >= 0:
                out = bytes(self.buf[: end + 4])
                del self.buf[: end + 4]
                return out
            if len(self.buf) > MAX_HEAD:
                raise Refused("the request head is too long", 431)
            start = max(0, len(self.buf) - 3)
            self._fill()

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                out = bytes(self.buf[: end + 1])
                del self.buf[: end + 1]
                return out
            if len(self.buf) > MAX_HEAD:
                raise _Closed()
            self._fill()

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def some(self, n: int) -> bytes:
        """Up to ``n`` bytes: what is buffered, else one recv."""
        if not self.buf:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


@dataclass
class _Message:
    first: str  # the request or status line
    headers: list[tuple[str, str]]
    body: bytes | None = None  # a request body to send instead of the one read

    def get(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def render(self, first: str | None = None) -> bytes:
        lines = [first or self.first] + [f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse(head: bytes) -> _Message:
    text = head.decode("latin-1")
    lines = text[:-4].split("\r\n")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or name != name.strip() or not name:
            raise Refused(f"a malformed header line {line[:80]!r}", 400)
        headers.append((name, value.strip()))
    return _Message(lines[0], headers)


def _refusal(status: int, message: str) -> bytes:
    body = json.dumps({"message": message}).encode()
    reason = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 431: "Too Large"}
    return (
        f"HTTP/1.1 {status} {reason.get(status, 'Refused')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


# --- the server ------------------------------------------------------------------------------


class SockGuard:
    """Listens on ``listen`` (a unix socket path) and passes allowed calls to ``upstream``."""

    def __init__(
        self, policy: Policy, listen: str, upstream: str, *, mode: int = 0o660, trace: bool = False
    ) -> None:
        self.policy, self.listen, self.upstream = policy, listen, upstream
        self.mode, self.trace = mode, trace
        self._ours: set[str] = set()  # full ids checked (or created) as sandboxes
        self._ours_lock = threading.Lock()
        self._server: socket.socket | None = None
        self._closing = False
        self._idle: list[_Stream] = []  # upstream connections between two calls
        self._idle_lock = threading.Lock()

    def bind(self) -> None:
        try:
            if stat.S_ISSOCK(os.lstat(self.listen).st_mode):
                os.unlink(self.listen)  # a previous guard's
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~self.mode)
        try:
            server.bind(self.listen)
        finally:
            os.umask(old)
        os.chmod(self.listen, self.mode)
        server.listen(128)
        self._server = server

    def serve_forever(self) -> None:
        if self._server is None:
            self.bind()
        assert self._server is not None
        log.info(
            "sockguard: listening on %s, passing sandbox calls on to %s (images: %s)",
            self.listen,
            self.upstream,
            ", ".join(sorted(self.policy.images)),
        )
        while not self._closing:
            try:
                client, _ = self._server.accept()
            except OSError:
                if self._closing:
                    return
                raise
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def close(self) -> None:
        self._closing = True
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        try:
            os.unlink(self.listen)
        except OSError:
            pass

    # --- one client connection ---------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        up: _Stream | None = None
        cs = _Stream(client)
        try:
            while True:
                try:
                    head = cs.head()
                except _Closed:
                    if up is not None and not up.buf:  # its last answer complete: reusable
                        self._put_back(up)
                        up = None
                    return
                what = head.split(b"\r\n", 1)[0].decode("latin-1").rsplit(" ", 1)[0][:200]
                try:
                    req = _parse(head)
                    method, target, body = self._read_request(cs, req)
                    if up is None:
                        up = self._connect()
                    target = self._decide(up, method, target, req, body)
                    body = body if req.body is None else req.body
                except Refused as e:
                    if e.status == 404:  # the engine's own answer, not a refusal
                        log.info("sockguard: %s: %s", what, e.message)
                    else:
                        log.warning("sockguard refused %s: %s", what, e.message)
                    client.sendall(_refusal(e.status, f"sockguard: {e.message}"))
                    return
                if self.trace:
                    log.info("sockguard passed %s %s", method, target)
                keep = self._forward(cs, up, req, method, target, body)
                if not keep:
                    return
        except (OSError, _Closed):
            return
        finally:
            client.close()
            if up is not None:
                up.sock.close()

    def _connect(self) -> _Stream:
        """An idle upstream connection the engine still holds open, else a new one (the
        Docker SDK opens a connection per URL, so most client connections carry one call:
        reusing the engine's side saves a connect per call)."""
        while True:
            with self._idle_lock:
                if not self._idle:
                    break
                up = self._idle.pop()
            try:
                if up.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    up.sock.close()  # closed by the engine meanwhile
                    continue
            except BlockingIOError:
                return up  # open, nothing unread: as it was left
            except OSError:
                pass
            up.sock.close()  # unread bytes or an error: not reusable
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.upstream)
        return _Stream(s)

    def _put_back(self, up: _Stream) -> None:
        with self._idle_lock:
            if len(self._idle) < IDLE_UPSTREAM:
                self._idle.append(up)
                return
        up.sock.close()

    def _read_request(self, cs: _Stream, req: _Message) -> tuple[str, str, bytes]:
        parts = req.first.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise Refused(f"a malformed request line {req.first[:80]!r}", 400)
        method, target = parts[0], parts[1]
        te, length = req.get("Transfer-Encoding"), req.get("Content-Length")
        if te is not None:
            if te.lower() != "chunked" or length is not None:
                raise Refused(f"Transfer-Encoding {te!r}: the guard takes a plain body", 400)
            body = bytearray()
            while True:
                size = int(cs.line().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while cs.line() not in (b"\r\n", b"\n"):
                        pass
                    break
                body += cs.exact(size)
                cs.exact(2)
                if len(body) > MAX_BODY:
                    raise Refused("the request body is too large for a sandbox call")
            req.headers = [(k, v) for k, v in req.headers if k.lower() != "transfer-encoding"]
            req.headers.append(("Content-Length", str(len(body))))
            return method, target, bytes(body)
        n = int(length) if length and length.isdigit() else 0
        if n > MAX_BODY:
            raise Refused("the request body is too large for a sandbox call")
        return method, target, cs.exact(n) if n else b""

    def _decide(self, up: _Stream, method: str, target: str, req: _Message, body: bytes) -> str:
        """The target to send upstream, or Refused."""
        split = urlsplit(target)
        raw_path, query_text = split.path, split.query
        if split.scheme or split.netloc or split.fragment or not raw_path.startswith("/"):
            raise Refused(f"{method} {target[:100]}: not a plain path")
        if "%" in raw_path or "//" in raw_path or "/." in raw_path or ";" in query_text:
            raise Refused(f"{method} {raw_path[:100]}: an encoded or dotted path")
        m = _VERSION.match(raw_path)
        prefix = m.group(0) if m else ""
        path = raw_path[len(prefix) :]
        pairs = parse_qsl(query_text, keep_blank_values=True)
        query = dict(pairs)
        if len(query) != len(pairs):
            raise Refused(f"{method} {path}: a query parameter given twice")

        def allow(route: str) -> None:
            extra = set(query) - QUERY[route]
            if extra:
                raise Refused(f"{method} {path} with {', '.join(sorted(extra))}: not passed on")

        if path in ("/_ping", "/version", "/info") and method in ("GET", "HEAD"):
            allow("plain")
            return target
        if path == "/containers/create" and method == "POST":
            allow("create")
            try:
                spec = json.loads(body or b"null")
            except ValueError as e:
                raise Refused(f"the create body is not JSON ({e})", 400) from e
            if not isinstance(spec, dict):
                raise Refused("the create body is not a JSON object", 400)
            try:
                self.policy.check_create(spec, query.get("name"))
            except Refused as e:
                raise Refused(f"a sandbox create refused: {e.message}") from e
            # what was checked is what the engine reads: no duplicate key whose last copy
            # the engine and this parser might disagree on
            req.body = json.dumps(spec).encode()
            req.headers = [(k, v) for k, v in req.headers if k.lower() != "content-length"]
            req.headers.append(("Content-Length", str(len(req.body))))
            return target
        if path == "/containers/json" and method == "GET":
            allow("list")
            _label_filter(query, "GET /containers/json")
            return target
        im = _IMAGE.match(path)
        if im and method == "GET":
            allow("image")
            if im.group(1) not in self.policy.images:
                raise Refused(f"image inspect of {im.group(1)!r}: not a configured sandbox image")
            return target
        ref, op = None, None
        cm = _CONTAINER_OP.match(path)
        if cm and (method, cm.group(2)) in CONTAINER_OPS:
            ref, op = cm.group(1), cm.group(2)
        elif (cm2 := _CONTAINER.match(path)) and method == "DELETE":
            ref, op = cm2.group(1), "remove"
        if ref is None or op is None:
            raise Refused(f"{method} {path}: not a call sandboxes need")
        allow(op)
        if op == "rename" and not query.get("name", "").startswith(NAME_PREFIX):
            raise Refused(f"rename to {query.get('name')!r}: a sandbox's name starts {NAME_PREFIX}")
        if op == "archive" and query.get("path") != MODULES_PATH:
            raise Refused(f"archive of {query.get('path')!r}: only {MODULES_PATH} is read")
        cid = self._sandbox_id(up, prefix, ref)
        tail = f"/{op}" if op != "remove" else ""
        return f"{prefix}/containers/{cid}{tail}" + (f"?{query_text}" if query_text else "")

    def _sandbox_id(self, up: _Stream, prefix: str, ref: str) -> str:
        """The full id of the container ``ref`` names if it is one of ours, else Refused."""
        with self._ours_lock:
            if ref in self._ours:
                return ref
        up.sock.sendall(
            f"GET {prefix}/containers/{ref}/json HTTP/1.1\r\nHost: docker\r\n\r\n".encode()
        )
        resp = _parse(up.head())
        status = int(resp.first.split(" ")[1])
        data = self._read_whole(up, resp)
        if status == 404:
            raise Refused(f"No such container: {ref}", 404)
        if status != 200:
            raise Refused(f"the engine answered {status} looking up {ref}", 502)
        info = json.loads(data)
        cid = str(info["Id"])
        if not _ours((info.get("Config") or {}).get("Labels")):
            raise Refused(f"container {ref}: not a sandbox (no {OWNER} label with a job or pool)")
        self._remember(cid)
        return cid

    def _remember(self, cid: str) -> None:
        with self._ours_lock:
            if len(self._ours) > 100_000:
                self._ours.clear()
            self._ours.add(cid)

    def _read_whole(self, up: _Stream, resp: _Message) -> bytes:
        if (resp.get("Transfer-Encoding") or "").lower() == "chunked":
            out = bytearray()
            while size := int(up.line().split(b";")[0].strip() or b"0", 16):
                out += up.exact(size)
                up.exact(2)
            while up.line() not in (b"\r\n", b"\n"):
                pass
            return bytes(out)
        return up.exact(int(resp.get("Content-Length") or "0"))

    # --- passing it on -----------------------------------------------------------------

    def _forward(
        self, cs: _Stream, up: _Stream, req: _Message, method: str, target: str, body: bytes
    ) -> bool:
        """Send the request upstream and its answer back; False: close the connection."""
        up.sock.sendall(req.render(f"{method} {target} HTTP/1.1") + body)
        head = up.head()
        resp = _parse(head)
        status = int(resp.first.split(" ")[1])
        client = cs.sock
        if status == 101 or (
            target.split("?")[0].endswith("/attach")
            and resp.get("Content-Length") is None
            and resp.get("Transfer-Encoding") is None
        ):
            client.sendall(head)
            _splice(cs, up)
            return False
        if method == "POST" and target.split("?")[0].endswith("/containers/create"):
            data = self._read_whole(up, resp)
            if status == 201:
                self._remember(str(json.loads(data)["Id"]))
            if (resp.get("Transfer-Encoding") or "").lower() == "chunked":
                resp.headers = [(k, v) for k, v in resp.headers if k.lower() != "transfer-encoding"]
                resp.headers.append(("Content-Length", str(len(data))))
                head = resp.render()
            client.sendall(head + data)
        elif method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            client.sendall(head)
        elif (resp.get("Transfer-Encoding") or "").lower() == "chunked":
            client.sendall(head)
            while True:
                if not up.buf:
                    _await(up, cs)
                line = up.line()
                client.sendall(line)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:
                        trailer = up.line()
                        client.sendall(trailer)
                        if trailer in (b"\r\n", b"\n"):
                            break
                    break
                _copy(up, cs, size + 2)
        elif resp.get("Content-Length") is not None:
            client.sendall(head)
            _copy(up, cs, int(resp.get("Content-Length") or "0"))
        else:  # no length: until the engine closes
            client.sendall(head)
            try:
                while True:
                    _copy(up, cs, CHUNK, until_close=True)
            except _Closed:
                return False
        if status == 200 and method == "DELETE":
            with self._ours_lock:
                self._ours.discard(target.split("?")[0].rsplit("/", 1)[1])
        closing = (resp.get("Connection") or "").lower() == "close"
        if closing:
            up.sock.close()
            return False
        return (req.get("Connection") or "").lower() != "close"


def _copy(src: _Stream, dst: _Stream, n: int, until_close: bool = False) -> None:
    """Copy ``n`` bytes from ``src`` to ``dst``; while waiting, notice ``dst`` closing (a
    client that gave up on a long poll) so the upstream call ends with it."""
    while n > 0:
        if not src.buf:
            _await(src, dst)
        piece = src.some(min(n, CHUNK))
        dst.sock.sendall(piece)
        if not until_close:
            n -= len(piece)


def _await(src: _Stream, dst: _Stream) -> None:
    """Wait for ``src`` to have data; raise _Closed if ``dst`` closes meanwhile."""
    while True:
        ready, _, _ = select.select([src.sock, dst.sock], [], [])
        if src.sock in ready:
            return
        if not dst.sock.recv(1, socket.MSG_PEEK):
            raise _Closed()
        # a pipelined request waits in the kernel: wait for this answer only
        select.select([src.sock], [], [])
        return


def _splice(cs: _Stream, up: _Stream) -> None:
    """After an upgrade (attach): raw bytes both ways until both ends closed. A half-close
    (the sandbox's stdin EOF) is passed on as one."""
    if up.buf:
        cs.sock.sendall(bytes(up.buf))
        up.buf.clear()
    if cs.buf:
        up.sock.sendall(bytes(cs.buf))
        cs.buf.clear()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    other = threading.Thread(target=pump, args=(cs.sock, up.sock), daemon=True)
    other.start()
    pump(up.sock, cs.sock)
    other.join()
