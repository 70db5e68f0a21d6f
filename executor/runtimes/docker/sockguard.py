"""The socket guard: what a worker may ask of the Docker engine.

Whoever reaches the Docker socket is root on the host. A worker needs only a few of the
engine's calls, so the guard listens on a unix socket of its own and gives the real socket
only those (``studio-code sockguard --listen ... --upstream ...``); everything else gets
HTTP 403 with a JSON ``{"message": "sockguard: ..."}`` body, which the Docker SDK shows as
the error, and a WARNING in the guard's log naming what was refused.

Rebuilt, never forwarded. The guard never passes the client's bytes on: it reads each
request strictly (its own checks on the raw head, then ``h11``), decides on what it read, and
sends the engine a request it writes itself: the method, a canonical path, the allowed query
parameters re-encoded, its own few headers (``Host``, ``Content-Type`` and ``Content-Length``
on create, ``Connection: Upgrade``/``Upgrade: tcp`` on attach) and, for a create, the body it
checked, serialised again. The only client bytes that reach the engine as written are that
validated body (re-serialised JSON) and, after an allowed attach is upgraded, the stream.
Refused before any decision (HTTP 400): a head with a bare CR or LF, a control or non-ASCII
byte, an obs-fold or a header line of another shape; ``Transfer-Encoding``, ``Expect``,
``TE``, ``Trailer``, two ``Content-Length`` or ``Host`` headers; a request line other than
``GET|HEAD|POST|DELETE /origin-form HTTP/1.1`` (no absolute form, no ``OPTIONS *``, no
HTTP/1.0); a body on any call but create. Other client headers (User-Agent, Accept,
X-Registry-Auth...) are dropped.

One API version: ``/v1.41`` (what the Docker SDK negotiates with this project's engines,
API 1.41 on Docker 20.10) or newer; an older prefix (which gives calls their legacy
meanings: below 1.24 a start takes a host config) or none is refused, except the SDK's
unversioned ``GET /version`` and ``/_ping``.

The engine's answers are framed by the guard: read whole with ``h11`` (a ``1xx`` is
consumed, never passed on), sent to the client with the guard's own status line, a few of the
engine's headers and its own ``Content-Length``. An engine connection is reused only after
an answer read completely; the lookup of a container's labels uses an engine connection of
its own and checks that the answer is for the container asked for (its ``Id`` starts with
the reference, or its ``Name`` is it).

Passed on:

* ``GET|HEAD /_ping``, ``GET /version``, ``GET /info``: the SDK's version negotiation,
  health and readiness probes, the engine's posture;
* ``GET /images/<name>/json`` for the configured images only (readiness, the pool's image
  id check);
* ``POST /containers/create?name=studio-code-...`` (the name is required) only in exactly the
  shape ``sandbox_policy`` (executor/runtimes/docker/policy.py) makes: its host config's fixed
  fields equal (network none, read-only root, the tmpfs, no binds, CapDrop ALL,
  no-new-privileges and the project's own seccomp profile, ipc none, the ulimits, no log
  driver, the configured OCI runtime), the limits present and within the settings' caps,
  every other field of the request empty (no Privileged, Mounts, Devices, CapAdd, host
  namespaces, MaskedPaths...) but ``CgroupParent`` of exactly ``<engine
  parent>/studio-code-usage-<16 hex>`` (a run's own below the engine's parent for containers,
  STUDIO_CODE_USAGE_CGROUP_PARENT, default ``/docker``, for its usage figures:
  ``parent_shape``), a configured image, the
  project's labels, and ``User`` the sandbox's ``uid:gid`` (``sandbox_ids``) or another
  ``uid:gid`` of decimal digits, both non-zero (no ``0``, ``00``, ``+0``, ``root``, no name);
* on a container carrying the project's labels (``studio.owner`` with ``studio.job_id`` or
  ``studio.pool``): attach (upgraded; the stream is then passed on raw both ways), start,
  wait, rename (to a ``studio-code-`` name), inspect, remove, and a read of the image's
  modules file (``GET .../archive`` of that one path: the save-time import check). The guard
  looks a container up (its labels), remembers the ids it checked or created, and passes the
  call on by full id, so a name cannot change hands in between;
* ``GET /containers/json`` only with a label filter of the project's;
* ``GET /events`` of one labelled container's ``kill``/``die``/``oom`` events between two
  moments, the second at most ``EVENTS_AHEAD_S`` ahead (an answer that ends: no endless
  stream), the filter written again by the guard with the container's full id: what tells a
  sandbox signalled through the engine (``docker kill``) from its code's own exit.

Each route's query parameters are an allow-list, each value checked. That is exactly what
the runtime, the pool, the reaper, the readiness and posture probes and the save-time import
check call (their tests run through a guard with every passed call logged:
``STUDIO_TEST_THROUGH_SOCKGUARD=1``); kill and stop, which nothing of the project calls
(a sandbox is ended by a forced remove), and any other events call, are refused too.
Everything else (exec, image pull/build/load/push, volumes, networks, swarm, plugins,
secrets, commit, update, copy into a container...) is refused.

What it does not stop: a client of the guard can attach to, start, wait on, rename and remove
any labelled sandbox on this engine, other jobs' included (the power of a job's worker, plus
reading their stdin). docs/security.md "The socket guard".

One thread per client connection; engine connections are kept between calls and reused (a
call costs a parse and a copy, not a connect).
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import os
import re
import resource
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode

import h11

from executor.runtimes.sandbox_names import (
    ENGINE_PARENT,
    LABEL_DEADLINE,
    LABEL_JOB,
    LABEL_OWNER,
    LABEL_POOL,
    LABELS,
    MODULES_PATH,
    NAME_PREFIX,
)
from executor.runtimes.sandbox_names import USAGE_PARENT_PREFIX as PARENT_PREFIX

log = logging.getLogger("studio_code.sockguard")

#: what marks a container as one of ours (executor/runtimes/sandbox_names.py)
OWNER, JOB, POOL, DEADLINE = LABEL_OWNER, LABEL_JOB, LABEL_POOL, LABEL_DEADLINE
OUR_LABELS = LABELS
#: the oldest API version passed on: what the Docker SDK negotiates with Docker 20.10 (the
#: oldest engine the project runs on); older versions give calls legacy meanings (below
#: 1.24 a start replaces the container's host config)
MIN_API_MINOR = 41
LOOKUP_VERSION = f"/v1.{MIN_API_MINOR}"

MAX_HEAD = 64 * 1024
MAX_BODY = 4 * 1024 * 1024
MAX_ANSWER = 64 * 1024 * 1024
CHUNK = 1 << 16
IDLE_UPSTREAM = 16

_VERSION = re.compile(r"^/v1\.([1-9][0-9]{0,2})(?=/)")
_CONTAINER_OP = re.compile(r"^/containers/([A-Za-z0-9][A-Za-z0-9_.-]{0,127})/([a-z]+)$")
_CONTAINER = re.compile(r"^/containers/([A-Za-z0-9][A-Za-z0-9_.-]{0,127})$")
_IMAGE = re.compile(r"^/images/([A-Za-z0-9][A-Za-z0-9_.:/@-]*)/json$")
_PATH = re.compile(r"^(/[A-Za-z0-9_.:@-]+)+$|^/$")
_NAME = re.compile(rf"^{NAME_PREFIX}[A-Za-z0-9_.-]{{1,200}}$")
_USER = re.compile(r"^([1-9][0-9]{0,9}):([1-9][0-9]{0,9})$")


def parent_shape(engine_parent: str) -> re.Pattern[str]:
    """The one cgroup parent a create may name: a run's own, made by runc below the engine's
    parent for containers (executor/runtimes/docker/usage.py), matched whole (``fullmatch``:
    no newline after)."""
    return re.compile(rf"{re.escape(engine_parent)}/{PARENT_PREFIX}[0-9a-f]{{16}}")


#: the operations on one of our containers, by method
CONTAINER_OPS = {
    ("POST", "attach"),
    ("POST", "start"),
    ("POST", "wait"),
    ("POST", "rename"),
    ("GET", "json"),
    ("GET", "archive"),
}
_BOOL = re.compile(r"^(0|1|true|false|True|False)$")
#: a moment as the engine's events call takes it: seconds, optionally with nanoseconds
_MOMENT = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,9})?$")
#: the events an events call may ask for (of one sandbox)
EVENT_KINDS = frozenset({"kill", "die", "oom"})
#: how far ahead an events call's ``until`` may be (the engine holds the answer open until
#: then): the answer ends, the guard's thread is not held
EVENTS_AHEAD_S = 5.0
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
#: query parameters each route may carry, each with the shape of its value (anything else
#: is refused); what the Docker SDK sends for the project's calls
QUERY: dict[str, dict[str, re.Pattern[str]]] = {
    "create": {"name": _NAME},
    "list": {
        "all": _BOOL,
        "limit": re.compile(r"^-?[0-9]{1,6}$"),
        "size": _BOOL,
        "filters": re.compile(r"^[ -~]{1,4096}$"),
        "trunc_cmd": _BOOL,
        "since": _REF,
        "before": _REF,
    },
    "attach": {
        "stdin": _BOOL,
        "stdout": _BOOL,
        "stderr": _BOOL,
        "stream": _BOOL,
        "logs": _BOOL,
        "detachKeys": re.compile(r"^[a-z0-9,@\[\\\]^_-]{1,64}$"),
    },
    "start": {},
    "wait": {"condition": re.compile(r"^(not-running|next-exit|removed)$")},
    "rename": {"name": _NAME},
    "json": {"size": _BOOL},
    "archive": {"path": re.compile(rf"^{re.escape(MODULES_PATH)}$")},
    "remove": {"force": _BOOL, "v": _BOOL, "link": _BOOL},
    "image": {},
    "plain": {},
}
#: the engine's answer headers passed back (framing and connection headers are the guard's)
ANSWER_HEADERS = ("content-type", "api-version", "docker-experimental", "ostype", "server", "date")


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
    user: str = ""  # the sandboxes' uid:gid (sandbox_ids), as the workers send it
    #: STUDIO_CODE_USAGE_CGROUP_PARENT: the per-run cgroup parents are below it
    engine_parent: str = ENGINE_PARENT

    @classmethod
    def from_settings(cls, settings: Any, images: list[str] | None = None) -> Policy:
        from docker.types import HostConfig

        from executor.languages import get_language
        from executor.models import CodeJob
        from executor.runtimes.docker.policy import sandbox_policy, shape_limits
        from executor.settings import sandbox_ids

        limits = shape_limits(settings.max_memory_bytes, settings.max_cpus, settings.code_pids)
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
            user="{}:{}".format(*sandbox_ids()),
            engine_parent=settings.code_usage_cgroup_parent,
        )

    def check_create(self, body: dict[str, Any], name: str | None) -> None:
        """Raise Refused unless ``body`` is a sandbox exactly as ``sandbox_policy`` makes it."""
        if name is None or not _NAME.match(name):
            raise Refused(
                f"container name {name!r}: a sandbox is created with ?name={NAME_PREFIX}..."
            )
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
        if not isinstance(user, str) or not _sandbox_user(user, self.user):
            raise Refused(
                f"User {user!r}: a sandbox runs as {self.user or 'uid:gid'} (decimal uid:gid, "
                "both non-zero), never as root or the image's user"
            )
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
        parent = host.get("cgroupparent")
        if parent not in (None, "") and not (
            isinstance(parent, str) and parent_shape(self.engine_parent).fullmatch(parent)
        ):
            raise Refused(
                f"HostConfig.CgroupParent {str(parent)[:120]!r}: a sandbox's cgroup parent is "
                f"its run's own {self.engine_parent}/{PARENT_PREFIX}<16 hex> (usage per run), "
                "or none"
            )
        fixed = {k.lower() for k in self.host_config}
        allowed = fixed | {"memory", "memoryswap", "nanocpus", "pidslimit", "cgroupparent"}
        _only_empty(host, allowed, "HostConfig.")


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


def _sandbox_user(user: str, configured: str) -> bool:
    """The sandbox's configured ``uid:gid``, or another of plain decimal digits (no sign, no
    leading zero: runc reads ``00`` and ``+0`` as 0) naming a non-zero uid and gid."""
    m = _USER.match(user)
    return m is not None and (user == configured or all(0 < int(n) < 2**31 for n in m.groups()))


def _only_empty(fields: dict[str, Any], allowed: set[str], prefix: str) -> None:
    for key, value in fields.items():
        if key not in allowed and value not in (None, False, 0, "", [], {}):
            raise Refused(f"{prefix}{key} {str(value)[:120]}: not a field a sandbox sets")


def _int_in(value: Any, top: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= top


def _ours(labels: Any) -> bool:
    return isinstance(labels, dict) and OWNER in labels and (JOB in labels or POOL in labels)


def _filter_values(value: Any) -> list[str] | None:
    """A filter's values, in either form the engine takes (``["a"]`` or ``{"a": true}``);
    None when it is neither, or holds anything but strings."""
    if isinstance(value, dict):
        value = [k for k, v in value.items() if v is True]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _label_filter(query: dict[str, str], what: str) -> None:
    """The list call must filter on one of the project's labels."""
    try:
        filters = json.loads(query.get("filters") or "{}")
    except ValueError:
        filters = None
    labels = _filter_values(filters.get("label")) if isinstance(filters, dict) else None
    if labels is None or not any(v.split("=", 1)[0] in OUR_LABELS for v in labels):
        raise Refused(f"{what} without a filter on a studio.* label: only sandboxes are listed")


# --- reading a request ---------------------------------------------------------------------

_REQUEST_LINE = re.compile(rb"^(GET|HEAD|POST|DELETE) (/[!-~]*) HTTP/1\.1$")
_HEADER_LINE = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+: *(?:[!-~](?:[ -~]*[!-~])?)? *$")
_NOT_HEAD_BYTE = re.compile(rb"[^\x20-\x7e\r\n]")
_BARE_LF = re.compile(rb"(?<!\r)\n")
_BARE_CR = re.compile(rb"\r(?!\n)")
_FOLD = re.compile(rb"\n[ \t]")
#: headers a request to the guard never carries (the framing is Content-Length only)
_NEVER = {b"transfer-encoding", b"expect", b"te", b"trailer", b"proxy-connection"}
_LENGTH = re.compile(rb"^(0|[1-9][0-9]{0,8})$")
_CONNECTION = {b"keep-alive", b"close", b"upgrade"}


def _check_raw(region: bytes, complete: bool) -> None:
    """Refuse what h11 would read leniently (or Go's net/textproto differently): a bare LF
    or CR, a control or non-ASCII byte, an obs-fold. ``region``: the head so far."""
    if not complete and region.endswith(b"\r"):
        region = region[:-1]  # its LF may come with the next read
    if m := _NOT_HEAD_BYTE.search(region):
        raise Refused(f"a control or non-ASCII byte {m.group(0)!r} in the request head", 400)
    if _BARE_LF.search(region):
        raise Refused("a bare LF in the request head: lines end with CRLF", 400)
    if _BARE_CR.search(region):
        raise Refused("a bare CR in the request head: lines end with CRLF", 400)
    if _FOLD.search(region):
        raise Refused("a folded header line (obs-fold) in the request head", 400)


@dataclass
class Request:
    """A request as the guard read it (h11's reading, after the guard's own checks)."""

    method: str
    target: str
    headers: list[tuple[str, str]]  # names lowercased
    body: bytes = b""

    def get(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        return values[0] if values else None


class _Late(Exception):
    """A request not read whole within the head timeout (from its first byte)."""


class _Client:
    """The client's socket (non-blocking) and what was read of it past the last request.
    A request must be read whole within ``head_timeout_s`` of its first byte; a connection
    with no request begun for ``idle_timeout_s`` is closed."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, bounds: Bounds
    ) -> None:
        self.sock = sock
        self.loop = loop
        self.bounds = bounds
        self.buf = bytearray()
        self.deadline: float | None = None  # monotonic: the request begun must be read by then

    async def _fill(self) -> None:
        if self.deadline is None:
            timeout = self.bounds.idle_timeout_s
        else:
            timeout = self.deadline - time.monotonic()
        try:
            data = await _recv(self.loop, self.sock, timeout)
        except _Late:
            if self.deadline is None:
                raise _Closed() from None  # idle: closed without a word
            raise
        if not data:
            raise _Closed()
        if self.deadline is None:
            self.deadline = time.monotonic() + self.bounds.head_timeout_s
        self.buf += data

    async def head(self) -> bytes:
        """Up to and including the blank line ending a request's head, checked as it comes."""
        self.deadline = (
            time.monotonic() + self.bounds.head_timeout_s if self.buf else None
        )  # a pipelined request's first bytes are here already
        while True:
            end = self.buf.find(b"\r\n\r\n")
            region = bytes(self.buf[: end + 4] if end >= 0 else self.buf[: MAX_HEAD + 4])
            _check_raw(region, end >= 0)
            if end >= 0:
                if end + 4 > MAX_HEAD:
                    raise Refused("the request head is too long", 431)
                del self.buf[: end + 4]
                return region
            if len(self.buf) > MAX_HEAD:
                raise Refused("the request head is too long", 431)
            await self._fill()

    async def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _parse_head(head: bytes) -> tuple[h11.Connection, Request, int]:
    """The request ``head`` names, read by the guard's line rules and by h11 (which must
    agree), and the length of its body."""
    lines = head[:-4].split(b"\r\n")
    m = _REQUEST_LINE.match(lines[0])
    if not m:
        raise Refused(
            f"the request line {lines[0][:100]!r}: the guard takes GET, HEAD, POST or DELETE "
            "of a path, HTTP/1.1",
            400,
        )
    names: list[bytes] = []
    for line in lines[1:]:
        if not _HEADER_LINE.match(line):
            raise Refused(f"a malformed header line {line[:80]!r}", 400)
        name, _, value = line.partition(b":")
        names.append(name.lower())
        if name.lower() == b"content-length" and not _LENGTH.match(value.strip()):
            raise Refused(f"Content-Length {value.strip()[:40]!r}: not a length", 400)
    for name in set(names):
        if name in _NEVER:
            raise Refused(f"the header {name.decode()}: the guard takes a plain request", 400)
        if names.count(name) > 1 and name in (
            b"content-length",
            b"host",
            b"connection",
            b"upgrade",
        ):
            raise Refused(f"the header {name.decode()} given twice", 400)
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD + 1)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as e:
        raise Refused(f"a malformed request ({e})", 400) from e
    if not isinstance(event, h11.Request) or event.http_version != b"1.1":
        raise Refused("a malformed request", 400)
    headers = [(k.decode("ascii"), v.decode("ascii")) for k, v in event.headers]
    req = Request(event.method.decode("ascii"), event.target.decode("ascii"), headers)
    if req.method != m.group(1).decode() or req.target != m.group(2).decode():
        raise Refused("a request line read two ways", 400)
    connection = req.get("connection")
    for option in connection.split(",") if connection is not None else []:
        if option.strip().lower().encode() not in _CONNECTION:
            raise Refused(f"Connection {req.get('connection')!r}: not a connection option", 400)
    return conn, req, int(req.get("content-length") or "0")


async def _read_body(cs: _Client, conn: h11.Connection, req: Request, length: int) -> None:
    if length > MAX_BODY:
        raise Refused("the request body is too large for a sandbox call", 413)
    conn.receive_data(await cs.exact(length) if length else b"")
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise Refused(f"a malformed request body ({e})", 400) from e
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
        else:  # NEED_DATA: h11 and the guard disagree on the framing
            raise Refused("a request body framed two ways", 400)
    if len(body) != length:
        raise Refused("a request body framed two ways", 400)
    req.body = bytes(body)


def _refusal(status: int, message: str) -> bytes:
    body = json.dumps({"message": message}).encode()
    reason = {
        400: "Bad Request",
        403: "Forbidden",
        404: "Not Found",
        408: "Request Timeout",
        431: "Too Large",
        503: "Service Unavailable",
    }
    return (
        f"HTTP/1.1 {status} {reason.get(status, 'Refused')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def _drop(sock: socket.socket, last: bytes) -> None:
    """Close a client's connection, with ``last`` if its socket takes it at once. What the
    client sent and the guard did not read is read first (a unix socket closed with unread
    bytes resets its peer, which would lose ``last``)."""
    try:
        if last:
            sock.send(last, socket.MSG_DONTWAIT)
        sock.shutdown(socket.SHUT_WR)
        for _ in range(16):
            if not sock.recv(CHUNK, socket.MSG_DONTWAIT):
                break
    except OSError:
        pass
    sock.close()


# --- what is sent upstream -----------------------------------------------------------------


@dataclass
class Call:
    """The request the guard sends the engine, written by the guard."""

    method: str
    path: str  # canonical, with the version prefix
    query: list[tuple[str, str]] = field(default_factory=list)
    body: bytes | None = None  # create's validated body
    upgrade: bool = False  # attach
    op: str = ""

    @property
    def target(self) -> str:
        return self.path + (f"?{urlencode(self.query)}" if self.query else "")

    def request(self) -> list[Any]:
        """The h11 events of this call."""
        headers = [("Host", "docker")]
        if self.body is not None:
            headers += [("Content-Type", "application/json")]
        if self.method == "POST":
            headers += [("Content-Length", str(len(self.body or b"")))]
        if self.upgrade:
            headers += [("Connection", "Upgrade"), ("Upgrade", "tcp")]
        events: list[Any] = [h11.Request(method=self.method, target=self.target, headers=headers)]
        if self.body:
            events.append(h11.Data(data=self.body))
        events.append(h11.EndOfMessage())
        return events


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    upgraded: bytes | None = None  # after a 101: what the engine sent past the head

    def render(self, head_only: bool = False, closing: bool = False) -> bytes:
        """The answer as the guard frames it for the client."""
        try:
            reason = http.HTTPStatus(self.status).phrase
        except ValueError:
            reason = "Unknown"
        lines = [f"HTTP/1.1 {self.status} {reason}"]
        lines += [f"{k.title()}: {v}" for k, v in self.headers if k in ANSWER_HEADERS]
        if self.status == 101:
            lines += ["Connection: Upgrade", "Upgrade: tcp"]
        elif head_only:
            length = next((v for k, v in self.headers if k == "content-length"), None)
            lines += [f"Content-Length: {length}"] if length is not None else []
        elif self.status not in (204, 304):
            lines += [f"Content-Length: {len(self.body)}"]
        if closing:
            lines += ["Connection: close"]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head if head_only or self.status in (101, 204, 304) else head + self.body


class _Upstream:
    """A connection to the engine and h11's state of it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    def reusable(self) -> bool:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
            return True
        return False


def _wake(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


async def _readable(
    loop: asyncio.AbstractEventLoop, socks: list[socket.socket], timeout: float | None
) -> socket.socket:
    """The first of ``socks`` that is readable (or closed); _Late after ``timeout`` s. A
    readiness wait (the event loop's epoll), nothing read: no bytes lost if it is left."""
    fut: asyncio.Future[Any] = loop.create_future()
    fds = [s.fileno() for s in socks]
    for s, fd in zip(socks, fds, strict=True):
        loop.add_reader(fd, _wake, fut, s)
    late = loop.call_later(max(timeout, 0.0), _wake, fut, None) if timeout is not None else None
    try:
        ready = await fut
    finally:
        for fd in fds:
            loop.remove_reader(fd)
        if late is not None:
            late.cancel()
    if ready is None:
        raise _Late()
    return ready  # type: ignore[no-any-return]


async def _recv(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float | None = None
) -> bytes:
    """What ``sock`` (non-blocking) has, up to CHUNK; b"" once it is closed."""
    while True:
        try:
            return sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            pass
        await _readable(loop, [sock], timeout)


async def _exchange(
    loop: asyncio.AbstractEventLoop,
    up: _Upstream,
    call: Call,
    client: socket.socket | None = None,
) -> Answer:
    """Send ``call`` on ``up`` and read its answer whole (1xx consumed), or up to a 101.
    While it waits, a ``client`` that closes ends the call (a client that gave up on a long
    poll); one that sends (a pipelined request) waits in the kernel."""
    await loop.sock_sendall(up.sock, b"".join(up.conn.send(e) or b"" for e in call.request()))
    status, headers, body = 0, [], bytearray()
    watching = client is not None
    while True:
        try:
            event = up.conn.next_event()
        except h11.RemoteProtocolError as e:
            raise _Broken(f"the engine's answer to {call.method} {call.path} ({e})") from e
        if event is h11.NEED_DATA:
            if watching and client is not None:
                if await _readable(loop, [up.sock, client], None) is client:
                    try:
                        if not client.recv(1, socket.MSG_PEEK):
                            raise _Closed()
                        watching = False
                    except (BlockingIOError, InterruptedError):
                        pass
                    continue
            up.conn.receive_data(await _recv(loop, up.sock))
        elif isinstance(event, h11.InformationalResponse):
            if event.status_code == 101 and call.upgrade:
                data, _ = up.conn.trailing_data
                hdrs = [(k.decode(), v.decode("latin-1")) for k, v in event.headers]
                return Answer(101, hdrs, b"", upgraded=bytes(data))
            continue  # a 1xx (100 Continue...) is never passed on
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = [(k.decode(), v.decode("latin-1")) for k, v in event.headers]
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_ANSWER:
                raise _Broken(f"the engine's answer to {call.method} {call.path} is too long")
        elif isinstance(event, h11.EndOfMessage):
            return Answer(status, headers, bytes(body))
        else:  # ConnectionClosed, PAUSED
            raise _Broken(f"the engine closed before answering {call.method} {call.path}")


class _Broken(Exception):
    """The engine's side failed or answered in a way the guard cannot frame."""


async def _splice(
    loop: asyncio.AbstractEventLoop,
    client: socket.socket,
    pending: bytes,
    up: socket.socket,
    upgraded: bytes,
) -> None:
    """After an upgrade (attach): raw bytes both ways until both ends closed. A half-close
    (the sandbox's stdin EOF) is passed on as one."""
    if upgraded:
        await loop.sock_sendall(client, upgraded)
    if pending:
        await loop.sock_sendall(up, pending)

    async def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := await _recv(loop, src):
                await loop.sock_sendall(dst, data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    await asyncio.gather(pump(client, up), pump(up, client))


# --- the server ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    """How much of the guard one client, and all of them, may hold (issue 38): connections
    in total and per peer (the connecting process as SO_PEERCRED names it: uid and pid; a
    peer in another pid namespace, such as a worker container, is pid 0, so those of one
    uid share one bound), the time a request may take from its first byte to its last,
    and the time a connection may sit with no request begun. STUDIO_CODE_SOCKGUARD_*."""

    max_connections: int = 4096
    max_per_peer: int = 1024
    head_timeout_s: float = 5.0
    idle_timeout_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: Any) -> Bounds:
        return cls(
            max_connections=settings.code_sockguard_max_connections,
            max_per_peer=settings.code_sockguard_max_per_peer,
            head_timeout_s=settings.code_sockguard_head_timeout_s,
            idle_timeout_s=settings.code_sockguard_idle_timeout_s,
        )


#: descriptors kept free of clients: the listening socket, the log, the engine lookups'
FD_RESERVE = 64
#: the longest pause of the accept loop after a failure (EMFILE, no memory for a task)
MAX_BACKOFF_S = 1.0


def raise_nofile() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to its hard limit; the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def peer_of(sock: socket.socket) -> tuple[int, int]:
    """The connecting process's (uid, pid) (SO_PEERCRED); (-1, -1) when unknown."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
    except OSError:
        return -1, -1
    return uid, pid


class _Every:
    """A log line at most once a second, saying how many like it were left out."""

    def __init__(self) -> None:
        self.next = 0.0
        self.skipped = 0

    def log(self, level: int, message: str) -> None:
        now = time.monotonic()
        if now < self.next:
            self.skipped += 1
            return
        if self.skipped:
            message += f" (and {self.skipped} more like it in the last second)"
        self.next, self.skipped = now + 1.0, 0
        log.log(level, message)


class SockGuard:
    """Listens on ``listen`` (a unix socket path) and passes allowed calls to ``upstream``.

    One thread, one event loop (asyncio's epoll; never ``select()``, which fails past
    descriptor 1024): a connection costs its descriptor and a little memory, no thread.
    ``bounds`` caps what clients hold; a failure to accept (EMFILE...) or to start a
    connection's task closes that client and pauses the accept loop, never ends the guard.
    """

    def __init__(
        self,
        policy: Policy,
        listen: str,
        upstream: str,
        *,
        mode: int = 0o660,
        trace: bool = False,
        bounds: Bounds | None = None,
    ) -> None:
        self.policy, self.listen, self.upstream = policy, listen, upstream
        self.mode, self.trace = mode, trace
        self.bounds = bounds or Bounds()
        self._ours: set[str] = set()  # full ids checked (or created) as sandboxes
        self._server: socket.socket | None = None
        self._closing = False
        self._idle: list[_Upstream] = []  # engine connections between two calls
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._peers: dict[tuple[int, int], int] = {}
        self._open = 0
        self._max_open = self.bounds.max_connections
        self._refusing = _Every()
        self._late = _Every()
        self._failing = _Every()

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
        server.listen(4096)
        server.setblocking(False)
        self._server = server

    def serve_forever(self) -> None:
        if self._server is None:
            self.bind()
        soft = raise_nofile()
        # each client may hold an engine connection too: two descriptors
        self._max_open = max(1, min(self.bounds.max_connections, (soft - FD_RESERVE) // 2))
        log.info(
            "sockguard: listening on %s, passing sandbox calls on to %s (images: %s); at most "
            "%d connections (%d per peer; RLIMIT_NOFILE %d), a request whole within %g s",
            self.listen,
            self.upstream,
            ", ".join(sorted(self.policy.images)),
            self._max_open,
            self.bounds.max_per_peer,
            soft,
            self.bounds.head_timeout_s,
        )
        if self._max_open < self.bounds.max_connections:
            log.warning(
                "sockguard: RLIMIT_NOFILE %d allows %d connections, not the %d of "
                "STUDIO_CODE_SOCKGUARD_MAX_CONNECTIONS",
                soft,
                self._max_open,
                self.bounds.max_connections,
            )
        if not self._closing:
            asyncio.run(self._main())

    def close(self) -> None:
        """Stop serving (from any thread, or a signal handler)."""
        self._closing = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop has ended
        elif self._server is not None:
            self._server.close()
        try:
            os.unlink(self.listen)
        except OSError:
            pass

    async def _main(self) -> None:
        assert self._server is not None
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._closing:
            return
        accepting = asyncio.create_task(self._accept(self._server))
        try:
            await self._stop.wait()
        finally:
            accepting.cancel()
            self._server.close()

    async def _accept(self, server: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.0
        tasks: set[asyncio.Task[None]] = set()
        while not self._closing:
            if backoff:
                await asyncio.sleep(backoff)
            try:
                client, _ = await loop.sock_accept(server)
            except OSError as e:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: wait for clients to go, then on
                backoff = min(MAX_BACKOFF_S, max(0.05, backoff * 2))
                self._failing.log(logging.ERROR, f"sockguard: accepting a connection: {e}")
                continue
            peer = peer_of(client)
            refusal = self._admit(peer)
            if refusal:
                self._refusing.log(logging.WARNING, f"sockguard refused a connection: {refusal}")
                _drop(client, _refusal(503, f"sockguard: {refusal}"))
                continue
            try:
                client.setblocking(False)
                task = loop.create_task(self._serve(client, peer))
            except Exception as e:  # no memory for it: this client goes, the guard stays
                self._release(peer)
                _drop(client, b"")
                backoff = min(MAX_BACKOFF_S, max(0.05, backoff * 2))
                self._failing.log(logging.ERROR, f"sockguard: serving a connection: {e!r}")
                continue
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            backoff = 0.0

    def _admit(self, peer: tuple[int, int]) -> str:
        """Count a new connection of ``peer`` in, or say why not."""
        if self._open >= self._max_open:
            return (
                f"{self._open} connections open, at most {self._max_open} "
                "(STUDIO_CODE_SOCKGUARD_MAX_CONNECTIONS)"
            )
        held = self._peers.get(peer, 0)
        if held >= self.bounds.max_per_peer:
            return (
                f"uid {peer[0]} pid {peer[1]} holds {held} connections, at most "
                f"{self.bounds.max_per_peer} (STUDIO_CODE_SOCKGUARD_MAX_PER_PEER)"
            )
        self._open += 1
        self._peers[peer] = held + 1
        return ""

    def _release(self, peer: tuple[int, int]) -> None:
        self._open -= 1
        left = self._peers.get(peer, 1) - 1
        if left > 0:
            self._peers[peer] = left
        else:
            self._peers.pop(peer, None)

    # --- one client connection ---------------------------------------------------------

    async def _serve(self, client: socket.socket, peer: tuple[int, int]) -> None:
        loop = asyncio.get_running_loop()
        cs = _Client(client, loop, self.bounds)
        try:
            while await self._one(cs):
                pass
        except (OSError, _Closed):
            pass
        except _Late:
            self._late.log(
                logging.WARNING,
                f"sockguard: a request of uid {peer[0]} pid {peer[1]} not whole within "
                f"{self.bounds.head_timeout_s:g} s (STUDIO_CODE_SOCKGUARD_HEAD_TIMEOUT_S): "
                "connection closed",
            )
            _drop(
                client,
                _refusal(
                    408,
                    f"sockguard: the request was not whole within {self.bounds.head_timeout_s:g} s",
                ),
            )
        except Exception:  # a bug in a connection's handling ends it, never the guard
            log.exception("sockguard: a connection failed")
        finally:
            client.close()
            self._release(peer)

    async def _one(self, cs: _Client) -> bool:
        """Read, decide and pass on one request; False: close the client connection."""
        loop = cs.loop
        what = ""
        try:
            head = await cs.head()
            what = head.split(b"\r\n", 1)[0].decode("ascii")[:200]
            conn, req, length = _parse_head(head)
            call = await self._decide(req, length)
            await _read_body(cs, conn, req, length)
            cs.deadline = None
            if call.op == "create":
                call.body = self._check_create(req, call)
        except Refused as e:
            if not what and cs.buf:
                first = bytes(cs.buf[:200]).split(b"\n", 1)[0]
                what = first.decode("ascii", "backslashreplace").rstrip("\r")
            if e.status == 404:  # the engine's own answer, not a refusal
                log.info("sockguard: %s: %s", what, e.message)
            else:
                log.warning("sockguard refused %s: %s", what, e.message)
            await loop.sock_sendall(cs.sock, _refusal(e.status, f"sockguard: {e.message}"))
            return False
        if self.trace:
            log.info("sockguard passed %s %s", call.method, call.target)
        try:
            up = self._connect()
        except OSError as e:  # EMFILE, or the engine is gone: this client's call fails
            self._failing.log(logging.ERROR, f"sockguard: connecting to the engine: {e}")
            message = f"sockguard: the engine's socket could not be reached ({e})"
            await loop.sock_sendall(cs.sock, _refusal(503, message))
            return False
        try:
            answer = await _exchange(loop, up, call, cs.sock)
        except (_Broken, _Closed, OSError) as e:
            up.sock.close()
            if isinstance(e, _Broken):
                log.warning("sockguard: %s", e)
            return False
        except BaseException:
            up.sock.close()
            raise
        if answer.upgraded is not None:
            try:
                await loop.sock_sendall(cs.sock, answer.render())
                pending, cs.buf = bytes(cs.buf), bytearray()
                await _splice(loop, cs.sock, pending, up.sock, answer.upgraded)
            finally:
                up.sock.close()
            return False
        self._after(call, answer)
        if up.reusable():
            self._put_back(up)
        else:
            up.sock.close()
        closing = (req.get("connection") or "").lower() == "close"
        await loop.sock_sendall(
            cs.sock, answer.render(head_only=call.method == "HEAD", closing=closing)
        )
        return not closing

    def _after(self, call: Call, answer: Answer) -> None:
        """What the guard learns from an answer: the ids it created, the ids removed."""
        if call.op == "create" and answer.status == 201:
            try:
                self._remember(str(json.loads(answer.body)["Id"]))
            except (ValueError, KeyError, TypeError):
                pass
        elif call.op == "remove" and 200 <= answer.status < 300:
            self._ours.discard(call.path.rsplit("/", 1)[1])

    def _connect(self) -> _Upstream:
        """An idle engine connection the engine still holds open, else a new one (the Docker
        SDK opens a connection per URL, so most client connections carry one call: reusing
        the engine's side saves a connect per call)."""
        while self._idle:
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
        try:
            s.connect(self.upstream)  # a unix socket: at once, or refused
        except OSError:
            s.close()
            raise
        s.setblocking(False)
        return _Upstream(s)

    def _put_back(self, up: _Upstream) -> None:
        if len(self._idle) < IDLE_UPSTREAM:
            self._idle.append(up)
            return
        up.sock.close()

    # --- the decision ------------------------------------------------------------------

    async def _decide(self, req: Request, length: int) -> Call:
        """The call to send the engine for ``req`` (its body not read yet), or Refused."""
        method, target = req.method, req.target
        raw_path, _, query_text = target.partition("?")
        if not _PATH.match(raw_path) or "/." in raw_path or "#" in query_text:
            raise Refused(f"{method} {target[:100]}: not a plain path")
        m = _VERSION.match(raw_path)
        path = raw_path[m.end() :] if m else raw_path
        version = f"/v1.{m.group(1)}" if m else ""
        if m and int(m.group(1)) < MIN_API_MINOR:
            raise Refused(
                f"{method} {raw_path[:100]}: API version 1.{m.group(1)}; the guard passes on "
                f"1.{MIN_API_MINOR} and newer only (older versions give calls other meanings)"
            )
        try:
            pairs = parse_qsl(query_text, keep_blank_values=True, strict_parsing=bool(query_text))
        except ValueError as e:
            raise Refused(f"{method} {path}: a malformed query") from e
        query = dict(pairs)
        if len(query) != len(pairs):
            raise Refused(f"{method} {path}: a query parameter given twice")
        if not version and not (
            (path == "/_ping" and method in ("GET", "HEAD"))
            or (path == "/version" and method == "GET")
        ):
            raise Refused(
                f"{method} {path}: no API version (the guard passes on /v1.{MIN_API_MINOR}+)"
            )
        if length and not (path == "/containers/create" and method == "POST"):
            raise Refused(f"{method} {path} with a body: only a create carries one")
        upgrade = req.get("upgrade")
        if upgrade is not None and not (method == "POST" and path.endswith("/attach")):
            raise Refused(f"{method} {path} with Upgrade: only an attach is upgraded")

        def allow(route: str, op: str, call_path: str, **kw: Any) -> Call:
            shapes = QUERY[route]
            extra = set(query) - set(shapes)
            if extra:
                raise Refused(f"{method} {path} with {', '.join(sorted(extra))}: not passed on")
            for key, value in pairs:
                if not shapes[key].match(value):
                    raise Refused(f"{method} {path}: {key}={value[:100]!r} is not a value it takes")
            return Call(method, version + call_path, list(pairs), op=op, **kw)

        if path in ("/_ping", "/version", "/info") and method in ("GET", "HEAD"):
            return allow("plain", "plain", path)
        if path == "/containers/create" and method == "POST":
            return allow("create", "create", path)
        if path == "/containers/json" and method == "GET":
            _label_filter(query, "GET /containers/json")
            return allow("list", "list", path)
        if path == "/events" and method == "GET":
            return await self._events(version, query)
        im = _IMAGE.match(path)
        if im and method == "GET":
            if im.group(1) not in self.policy.images:
                raise Refused(f"image inspect of {im.group(1)!r}: not a configured sandbox image")
            return allow("image", "image", path)
        ref, op = None, None
        cm = _CONTAINER_OP.match(path)
        if cm and (method, cm.group(2)) in CONTAINER_OPS:
            ref, op = cm.group(1), cm.group(2)
        elif (cm2 := _CONTAINER.match(path)) and method == "DELETE":
            ref, op = cm2.group(1), "remove"
        if ref is None or op is None:
            raise Refused(f"{method} {path}: not a call sandboxes need")
        if op == "rename" and not _NAME.match(query.get("name", "")):
            raise Refused(f"rename to {query.get('name')!r}: a sandbox's name starts {NAME_PREFIX}")
        if op == "archive" and query.get("path") != MODULES_PATH:
            raise Refused(f"archive of {query.get('path')!r}: only {MODULES_PATH} is read")
        if op == "attach" and (
            (upgrade or "").lower() != "tcp"
            or "upgrade" not in (req.get("connection") or "").lower()
        ):
            raise Refused(f"{method} {path}: an attach asks for Upgrade: tcp")
        call = allow(op, op, "", upgrade=op == "attach")
        cid = await self._sandbox_id(ref)
        call.path = f"{version}/containers/{cid}" + (f"/{op}" if op != "remove" else "")
        return call

    async def _events(self, version: str, query: dict[str, str]) -> Call:
        """An events call of one sandbox's kill/die/oom events between two moments, its
        filter written by the guard; anything else is Refused."""
        extra = set(query) - {"since", "until", "filters"}
        if extra:
            raise Refused(f"GET /events with {', '.join(sorted(extra))}: not passed on")
        since, until = query.get("since", ""), query.get("until", "")
        if not (_MOMENT.match(since) and _MOMENT.match(until)):
            raise Refused(
                "GET /events without since and until (seconds): only the events between two "
                "moments are passed on, never an endless stream"
            )
        if float(until) > time.time() + EVENTS_AHEAD_S:
            raise Refused(f"GET /events until {until}: more than {EVENTS_AHEAD_S:g} s ahead")
        try:
            filters = json.loads(query.get("filters") or "null")
        except ValueError:
            filters = None
        if not isinstance(filters, dict) or set(filters) - {"container", "type", "event"}:
            raise Refused("GET /events: the filter is one container's, type and event only")
        picked = {k: _filter_values(v) for k, v in filters.items()}
        refs, kinds = picked.get("container"), picked.get("event")
        if refs is None or len(refs) != 1 or picked.get("type", ["container"]) != ["container"]:
            raise Refused("GET /events: the events of one container, by its id or name")
        if not kinds or not set(kinds) <= EVENT_KINDS:
            raise Refused(f"GET /events: events {sorted(EVENT_KINDS)} only, named")
        if not _REF.match(refs[0]):
            raise Refused(f"GET /events of {refs[0][:100]!r}: not a container reference")
        cid = await self._sandbox_id(refs[0])
        rebuilt = {"container": [cid], "type": ["container"], "event": sorted(set(kinds))}
        return Call(
            "GET",
            f"{version}/events",
            [("since", since), ("until", until), ("filters", json.dumps(rebuilt))],
            op="events",
        )

    def _check_create(self, req: Request, call: Call) -> bytes:
        """The create body to send: ``req``'s, checked against the policy, serialised again."""
        try:
            spec = json.loads(req.body or b"null")
        except ValueError as e:
            raise Refused(f"the create body is not JSON ({e})", 400) from e
        if not isinstance(spec, dict):
            raise Refused("the create body is not a JSON object", 400)
        try:
            self.policy.check_create(spec, dict(call.query).get("name"))
        except Refused as e:
            raise Refused(f"a sandbox create refused: {e.message}") from e
        # what was checked is what the engine reads: no duplicate key whose last copy the
        # engine and this parser might disagree on
        return json.dumps(spec).encode()

    async def _sandbox_id(self, ref: str) -> str:
        """The full id of the container ``ref`` names if it is one of ours, else Refused. The
        lookup has an engine connection of its own."""
        if ref in self._ours:
            return ref
        try:
            up = self._connect()
        except OSError as e:
            raise Refused(f"looking up {ref}: {e}", 502) from e
        try:
            loop = asyncio.get_running_loop()
            lookup = Call("GET", f"{LOOKUP_VERSION}/containers/{ref}/json")
            answer = await _exchange(loop, up, lookup)
        except (_Broken, OSError) as e:
            up.sock.close()
            raise Refused(f"looking up {ref}: {e}", 502) from e
        if up.reusable():
            self._put_back(up)
        else:
            up.sock.close()
        if answer.status == 404:
            raise Refused(f"No such container: {ref}", 404)
        if answer.status != 200:
            raise Refused(f"the engine answered {answer.status} looking up {ref}", 502)
        try:
            info = json.loads(answer.body)
            cid, name = str(info["Id"]), info.get("Name")
        except (ValueError, KeyError, TypeError) as e:
            raise Refused(f"the engine's answer looking up {ref} is not an inspect", 502) from e
        if not (re.match(r"^[0-9a-f]{64}$", cid) and (cid.startswith(ref) or name == f"/{ref}")):
            raise Refused(f"the engine's answer looking up {ref} is for another container", 502)
        if not _ours((info.get("Config") or {}).get("Labels")):
            raise Refused(f"container {ref}: not a sandbox (no {OWNER} label with a job or pool)")
        self._remember(cid)
        return cid

    def _remember(self, cid: str) -> None:
        if len(self._ours) > 100_000:
            self._ours.clear()
        self._ours.add(cid)
