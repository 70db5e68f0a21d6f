"""The socket guard's allow-list: ONE table of the calls passed on (``ROUTES``) and the pure
decision on a request read by ``grammar`` (``decide``).

Exactly what the runtime, the pool, the reaper, the readiness and posture probes and the
save-time import check call (their tests run through a guard with every passed call logged:
``STUDIO_TEST_THROUGH_SOCKGUARD=1``); anything else is refused (403). ``decide`` makes no
engine call: what it must know of a container (that it carries the project's labels, and
its full id) it asks of the ``lookup`` it is given, which the server answers from what it
created or checked before, or by an inspect of its own first (``NeedLookup``).

``studio-code sockguard --print-policy`` prints the table (``policy_table``);
docs/security.md carries the same text, held equal by tests/test_sockguard_policy.py.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from executor.runtimes.docker.sockguard.create import MIN_NANO_CPUS, NAME
from executor.runtimes.docker.sockguard.grammar import Refused, Request
from executor.runtimes.docker.sockguard.upstream import Call
from executor.sandbox_names import (
    LABEL_JOB,
    LABEL_OWNER,
    LABEL_POOL,
    LABELS,
    MODULES_PATH,
    NAME_PREFIX,
    USAGE_PARENT_PREFIX,
)

#: the oldest API version passed on: what the Docker SDK negotiates with Docker 20.10 (the
#: oldest engine the project runs on); older versions give calls legacy meanings (below
#: 1.24 a start replaces the container's host config)
MIN_API_MINOR = 41
LOOKUP_VERSION = f"/v1.{MIN_API_MINOR}"
#: the calls passed on without a version prefix: the Docker SDK's version negotiation
UNVERSIONED = frozenset({("GET", "/_ping"), ("HEAD", "/_ping"), ("GET", "/version")})
#: the events an events call may ask for (of one sandbox)
EVENT_KINDS = frozenset({"kill", "die", "oom"})
#: how far ahead an events call's ``until`` may be (the engine holds the answer open until
#: then): the answer ends, no connection is held by an endless stream
EVENTS_AHEAD_S = 5.0

_VERSION = re.compile(r"^/v1\.([1-9][0-9]{0,2})(?=/)")
_PATH = re.compile(r"^(/[A-Za-z0-9_.:@-]+)+$|^/$")
_REF_SHAPE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
_REF = re.compile(rf"^{_REF_SHAPE}$")
_BOOL = re.compile(r"^(0|1|true|false|True|False)$")
#: a moment as the engine's events call takes it: seconds, optionally with nanoseconds
_MOMENT = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,9})?$")

#: how a value's shape is printed in the table
_SHOWN = {
    _BOOL.pattern: "bool",
    NAME.pattern: f"{NAME_PREFIX}...",
    _REF.pattern: "a container",
    _MOMENT.pattern: "seconds",
    r"^-?[0-9]{1,6}$": "an integer",
    r"^[ -~]{1,4096}$": "printable, at most 4096",
    r"^[a-z0-9,@\[\\\]^_-]{1,64}$": "key names",
    r"^(not-running|next-exit|removed)$": "not-running, next-exit or removed",
    rf"^{re.escape(MODULES_PATH)}$": "that one path",
}


@dataclass(frozen=True)
class Route:
    """One call the guard passes on: ``methods`` on a path matching ``pattern`` (after the
    version prefix), its query parameters each of a shape, ``on`` what it acts (``engine``,
    a configured ``image``, or a ``sandbox``: a container carrying the project's labels,
    looked up, then addressed by its full id), ``when``: the condition besides, in words."""

    name: str
    methods: tuple[str, ...]
    path: str  # as printed
    pattern: re.Pattern[str]
    query: dict[str, re.Pattern[str]] = field(default_factory=dict)
    on: str = "engine"
    when: str = ""
    #: the path's suffix after the container's id (sandbox routes)
    suffix: str = ""


def _sandbox(called: str, method: str, suffix: str, when: str = "", **query: str) -> Route:
    path = "/containers/{sandbox}" + (f"/{suffix}" if suffix else "")
    pattern = re.compile(rf"^/containers/({_REF_SHAPE})" + (f"/{suffix}$" if suffix else "$"))
    shapes = {k: re.compile(v) for k, v in query.items()}
    return Route(called, (method,), path, pattern, shapes, "sandbox", when, suffix)


def _exact(path: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(path)}$")


#: THE table: every call passed on, in the order a request is matched
ROUTES: tuple[Route, ...] = (
    Route("ping", ("GET", "HEAD"), "/_ping", _exact("/_ping"), when="also unversioned"),
    Route("version", ("GET", "HEAD"), "/version", _exact("/version"), when="GET unversioned too"),
    Route("info", ("GET", "HEAD"), "/info", _exact("/info")),
    Route(
        "create",
        ("POST",),
        "/containers/create",
        _exact("/containers/create"),
        {"name": NAME},
        when=(
            "the name required; the body in sandbox_policy's shape: the fixed host config "
            "equal (network none, read-only root, the tmpfs /tmp, no binds, CapDrop ALL, "
            "no-new-privileges and the project's seccomp profile, ipc none, the ulimits, no "
            "log driver); Runtime exactly STUDIO_CODE_OCI_RUNTIME (unset: none named); "
            "Memory set, at most the cap, MemorySwap equal; NanoCpus set, at least "
            f"{MIN_NANO_CPUS} (0.01 CPU), at most the cap; PidsLimit set, at most the cap; "
            f"CgroupParent none or <engine parent>/{USAGE_PARENT_PREFIX}<16 hex>; a "
            "configured image; the studio labels; User a non-zero decimal uid:gid; "
            "NetworkDisabled; every other field empty"
        ),
    ),
    Route(
        "list",
        ("GET",),
        "/containers/json",
        _exact("/containers/json"),
        {
            "all": _BOOL,
            "limit": re.compile(r"^-?[0-9]{1,6}$"),
            "size": _BOOL,
            "filters": re.compile(r"^[ -~]{1,4096}$"),
            "trunc_cmd": _BOOL,
            "since": _REF,
            "before": _REF,
        },
        when="with a filter on a studio.* label",
    ),
    Route(
        "events",
        ("GET",),
        "/events",
        _exact("/events"),
        {"since": _MOMENT, "until": _MOMENT, "filters": re.compile(r"^.*$")},
        on="sandbox",
        when=(
            f"one sandbox's {'/'.join(sorted(EVENT_KINDS))} events between two moments, until "
            f"at most {EVENTS_AHEAD_S:g} s ahead; the filter written again with its full id"
        ),
    ),
    Route(
        "image",
        ("GET",),
        "/images/{name}/json",
        re.compile(r"^/images/([A-Za-z0-9][A-Za-z0-9_.:/@-]*)/json$"),
        on="image",
        when="a configured sandbox image only",
    ),
    _sandbox(
        "attach",
        "POST",
        "attach",
        "with Connection: Upgrade and Upgrade: tcp; then the stream raw both ways",
        stdin=_BOOL.pattern,
        stdout=_BOOL.pattern,
        stderr=_BOOL.pattern,
        stream=_BOOL.pattern,
        logs=_BOOL.pattern,
        detachKeys=r"^[a-z0-9,@\[\\\]^_-]{1,64}$",
    ),
    _sandbox("start", "POST", "start"),
    _sandbox("wait", "POST", "wait", condition=r"^(not-running|next-exit|removed)$"),
    _sandbox("rename", "POST", "rename", f"to a {NAME_PREFIX} name", name=NAME.pattern),
    _sandbox("inspect", "GET", "json", size=_BOOL.pattern),
    _sandbox(
        "archive",
        "GET",
        "archive",
        f"of {MODULES_PATH} only",
        path=rf"^{re.escape(MODULES_PATH)}$",
    ),
    _sandbox("remove", "DELETE", "", force=_BOOL.pattern, v=_BOOL.pattern, link=_BOOL.pattern),
)


class NeedLookup(Exception):
    """``decide`` must know container ``ref`` (its full id, if it is a sandbox) first."""

    def __init__(self, ref: str) -> None:
        super().__init__(ref)
        self.ref = ref


#: the full id of the sandbox a reference names; raises Refused (not a sandbox, no such
#: container: 404) or NeedLookup
Lookup = Callable[[str], str]


def decide(req: Request, lookup: Lookup, images: frozenset[str], now: float | None = None) -> Call:
    """The call to send the engine for ``req`` (its head read; a create's body is checked
    after, ``create.create_body``), or Refused. Pure: no I/O, the clock only as ``now``."""
    method, target = req.method, req.target
    length = int(req.get("content-length") or "0")
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
    if not version and (method, path) not in UNVERSIONED:
        raise Refused(f"{method} {path}: no API version (the guard passes on /v1.{MIN_API_MINOR}+)")
    if length and not (path == "/containers/create" and method == "POST"):
        raise Refused(f"{method} {path} with a body: only a create carries one")
    upgrade = req.get("upgrade")
    if upgrade is not None and not (method == "POST" and path.endswith("/attach")):
        raise Refused(f"{method} {path} with Upgrade: only an attach is upgraded")
    route, found = _route(method, path)

    def allowed() -> list[tuple[str, str]]:
        extra = set(query) - set(route.query)
        if extra:
            raise Refused(f"{method} {path} with {', '.join(sorted(extra))}: not passed on")
        for key, value in pairs:
            if not route.query[key].match(value):
                raise Refused(f"{method} {path}: {key}={value[:100]!r} is not a value it takes")
        return list(pairs)

    if route.name == "events":
        return _events(version, query, lookup, time.time() if now is None else now)
    if route.name == "list":
        _label_filter(query, "GET /containers/json")
    elif route.name == "image" and found.group(1) not in images:
        raise Refused(f"image inspect of {found.group(1)!r}: not a configured sandbox image")
    elif route.name == "rename" and not NAME.match(query.get("name", "")):
        raise Refused(f"rename to {query.get('name')!r}: a sandbox's name starts {NAME_PREFIX}")
    elif route.name == "archive" and query.get("path") != MODULES_PATH:
        raise Refused(f"archive of {query.get('path')!r}: only {MODULES_PATH} is read")
    elif route.name == "attach" and (
        (upgrade or "").lower() != "tcp" or "upgrade" not in (req.get("connection") or "").lower()
    ):
        raise Refused(f"{method} {path}: an attach asks for Upgrade: tcp")
    params = allowed()
    if route.on != "sandbox":
        return Call(method, version + path, params, op=route.name)
    cid = lookup(found.group(1))
    call_path = f"{version}/containers/{cid}" + (f"/{route.suffix}" if route.suffix else "")
    return Call(method, call_path, params, op=route.name, upgrade=route.name == "attach")


def _route(method: str, path: str) -> tuple[Route, re.Match[str]]:
    """The first route of the table that takes ``method`` on ``path``, else Refused."""
    for route in ROUTES:
        found = route.pattern.match(path)
        if found and method in route.methods:
            return route, found
    raise Refused(f"{method} {path}: not a call sandboxes need")


def _events(version: str, query: dict[str, str], lookup: Lookup, now: float) -> Call:
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
    if float(until) > now + EVENTS_AHEAD_S:
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
    cid = lookup(refs[0])
    rebuilt = {"container": [cid], "type": ["container"], "event": sorted(set(kinds))}
    return Call(
        "GET",
        f"{version}/events",
        [("since", since), ("until", until), ("filters", json.dumps(rebuilt))],
        op="events",
    )


def ours(labels: object) -> bool:
    """``labels`` mark a sandbox: the owner with a job or a pool."""
    return (
        isinstance(labels, dict)
        and LABEL_OWNER in labels
        and (LABEL_JOB in labels or LABEL_POOL in labels)
    )


def _filter_values(value: object) -> list[str] | None:
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
    if labels is None or not any(v.split("=", 1)[0] in LABELS for v in labels):
        raise Refused(f"{what} without a filter on a studio.* label: only sandboxes are listed")


def _shape(pattern: re.Pattern[str]) -> str:
    return _SHOWN.get(pattern.pattern, "checked")


def policy_table() -> str:
    """The table as ``--print-policy`` prints it and docs/security.md carries it."""
    lines = [
        "| call | query parameters (each value's shape checked) | on | besides |",
        "|---|---|---|---|",
    ]
    for r in ROUTES:
        query = ", ".join(f"`{k}` ({_shape(v)})" for k, v in r.query.items()) or "none"
        if r.name == "events":
            query = "`since`, `until` (seconds), `filters` (rebuilt)"
        on = {"engine": "the engine", "image": "an image", "sandbox": "a sandbox"}[r.on]
        call = f"`{', '.join(r.methods)} {r.path}`"
        lines.append(f"| {call} | {query} | {on} | {r.when or '-'} |")
    return "\n".join(lines) + "\n"
