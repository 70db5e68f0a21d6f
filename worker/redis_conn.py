"""Every Redis connection of the studio is made here: workers (main and pool processes),
the API (sync, asyncio) and the CLI, and the options of Celery's broker connection
(kombu's Redis transport), so they all notice a dead connection the same way.

A connection that goes SILENT (no reply, no close, no RST: a failover behind a VIP, a
NAT or conntrack reset, a Redis host that lost power) is the hard case: nothing ever
fails on it by itself. So, with ``dead`` = STUDIO_REDIS_DEAD_AFTER_S:

* every read waits at most ``dead`` (+ the block time of a blocking command such as
  BLMOVE or XREAD BLOCK, so a live server's quiet answer is never mistaken for a dead
  one): ``socket_timeout``; a connect waits at most ``min(dead, 5)``;
* TCP keepalive probes an idle connection after ``dead / 2`` and gives up after three
  unanswered probes one second apart (a peer host that is gone, not a silent proxy:
  a proxy's kernel answers them);
* a pooled connection idle for ``dead / 2`` is PINGed before it is used again
  (redis-py's ``health_check_interval``), so a connection the server dropped is found
  before a command is lost on it;
* a command that fails on a connection error (a reset, a closed connection) is sent once
  more on a fresh connection; one that timed out is NOT resent (it may have run: Lua
  scripts and pushes must not run twice); its caller sees ``redis.TimeoutError`` and
  the next call connects again. So no call waits longer than its own timeout plus one
  connect.
* Celery's consumer (kombu's transport, which reads its BRPOP from the event loop where
  no socket timeout applies) checks every ``health_check_interval`` that its BRPOP
  (sent with a 1 s server-side timeout) got its answer, and drops the connection when it
  is overdue: a silent consumer connection is dropped within ``dead`` and Celery
  reconnects (``transport_options``).

STUDIO_REDIS_URL may name a Sentinel deployment, ``sentinel://[:PASSWORD@]HOST:PORT[/DB];
sentinel://HOST2:PORT2...`` with STUDIO_REDIS_SENTINEL_MASTER (and, when the sentinels
ask for one, STUDIO_REDIS_SENTINEL_PASSWORD); PASSWORD is the master's. Celery (kombu's
sentinel transport) and every redis-py client here then ask the sentinels for the master
and follow a failover by themselves.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from executor.settings import Settings

#: kombu's BRPOP server-side timeout (kombu.transport.redis.Transport.brpop_timeout)
KOMBU_BRPOP_TIMEOUT_S = 1.0
#: the longest a connect waits, whatever STUDIO_REDIS_DEAD_AFTER_S is
CONNECT_TIMEOUT_MAX_S = 5.0


@dataclass(frozen=True)
class Sentinels:
    """A sentinel:// STUDIO_REDIS_URL, parsed."""

    nodes: tuple[tuple[str, int], ...]
    master: str
    db: int
    username: str | None
    password: str | None
    sentinel_password: str | None


def is_sentinel(url: str) -> bool:
    return url.strip().lower().startswith("sentinel://")


def sentinels(settings: Settings) -> Sentinels | None:
    """The Sentinel deployment STUDIO_REDIS_URL names; None for a plain redis:// URL."""
    url = settings.redis_url
    if not is_sentinel(url):
        return None
    nodes: list[tuple[str, int]] = []
    db, username, password = 0, None, None
    for part in url.split(";"):
        part = part.strip()
        if not part:
            continue
        u = urlsplit(part)
        if u.scheme.lower() != "sentinel" or not u.hostname:
            raise ValueError(
                f"STUDIO_REDIS_URL part {part!r} is not sentinel://HOST:PORT: write every "
                "sentinel as sentinel://HOST:PORT, separated by ';'"
            )
        nodes.append((u.hostname, u.port or 26379))
        if u.password is not None and password is None:
            username = unquote(u.username) if u.username else None
            password = unquote(u.password)
        path = u.path.strip("/")
        if path and not db:
            db = int(path)
    secret = settings.redis_sentinel_password.get_secret_value()
    return Sentinels(
        tuple(nodes), settings.redis_sentinel_master, db, username, password, secret or None
    )


def _keepalive(dead_s: float) -> dict[int, int]:
    options = {}
    for name, value in (
        ("TCP_KEEPIDLE", max(1, int(dead_s / 2))),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", 3),
    ):
        opt = getattr(socket, name, None)
        if opt is not None:
            options[opt] = value
    return options


def health_check_interval_s(settings: Settings) -> int:
    """Seconds between kombu's checks of its long-lived connections (a BRPOP overdue by
    1 s + this is dropped, so a silent one goes within 1 s + 2 x this <= dead), also
    redis-py's idle time before a pooled connection is PINGed."""
    return max(1, int((settings.redis_dead_after_s - KOMBU_BRPOP_TIMEOUT_S) / 2))


def _retry(cls: Any) -> Any:
    """Once more on a fresh connection after a reset; never after a timeout (see above)."""
    return cls(ExponentialBackoff(cap=0.5, base=0.05), 1, (redis.ConnectionError,))


def connection_options(settings: Settings, *, block_s: float = 0.0) -> dict[str, Any]:
    """redis-py connection options; ``block_s``: the longest a command of this client
    blocks on the server (BLMOVE, XREAD BLOCK), added to the read timeout."""
    dead = float(settings.redis_dead_after_s)
    return {
        "socket_timeout": dead + block_s,
        "socket_connect_timeout": min(dead, CONNECT_TIMEOUT_MAX_S),
        "socket_keepalive": True,
        "socket_keepalive_options": _keepalive(dead),
        "health_check_interval": health_check_interval_s(settings),
        "retry": _retry(Retry),
    }


def _sentinel_kwargs(settings: Settings, s: Sentinels) -> dict[str, Any]:
    dead = float(settings.redis_dead_after_s)
    out: dict[str, Any] = {
        "socket_timeout": min(dead, CONNECT_TIMEOUT_MAX_S),
        "socket_connect_timeout": min(dead, CONNECT_TIMEOUT_MAX_S),
        "socket_keepalive": True,
        "socket_keepalive_options": _keepalive(dead),
    }
    if s.sentinel_password:
        out["password"] = s.sentinel_password
    return out


def client(settings: Settings, *, block_s: float = 0.0, **extra: Any) -> redis.Redis:
    """A redis-py client of STUDIO_REDIS_URL (plain or Sentinel) with the options above."""
    options = {**connection_options(settings, block_s=block_s), **extra}
    s = sentinels(settings)
    if s is None:
        return redis.Redis.from_url(settings.redis_url, **options)
    from redis.sentinel import Sentinel

    manager = Sentinel(list(s.nodes), sentinel_kwargs=_sentinel_kwargs(settings, s))
    return manager.master_for(
        s.master, db=s.db, username=s.username, password=s.password, **options
    )


def async_client(
    settings: Settings,
    *,
    block_s: float = 0.0,
    max_connections: int | None = None,
    pool_timeout_s: float | None = None,
) -> Any:
    """A redis.asyncio client of STUDIO_REDIS_URL with the same options. With
    ``max_connections``, a call waits up to ``pool_timeout_s`` for a free connection
    (Sentinel: the pool cannot wait; past the cap a call fails at once)."""
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    options = connection_options(settings, block_s=block_s)
    options["retry"] = _retry(AsyncRetry)
    s = sentinels(settings)
    if s is None:
        if max_connections is None:
            return redis.asyncio.Redis.from_url(settings.redis_url, **options)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            settings.redis_url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            **options,
        )
        return redis.asyncio.Redis.from_pool(pool)
    from redis.asyncio.sentinel import Sentinel

    manager = Sentinel(list(s.nodes), sentinel_kwargs=_sentinel_kwargs(settings, s))
    if max_connections is not None:
        options["max_connections"] = max_connections
    return manager.master_for(
        s.master, db=s.db, username=s.username, password=s.password, **options
    )


def transport_options(settings: Settings) -> dict[str, Any]:
    """kombu's Redis transport options for Celery's broker connection (every process that
    sends or consumes): the same timeouts and keepalive, kombu's health checks of its
    BRPOP and pub/sub connections, and the master's name with a Sentinel URL."""
    dead = float(settings.redis_dead_after_s)
    options: dict[str, Any] = {
        # The event loop reads BRPOP only when its socket is readable; this bounds every
        # synchronous command of the loop (acks, restores, the broker watch's PING) and a
        # connect's handshake, so a silent connection blocks the loop for half the bound
        # at most. Above BRPOP's 1 s, which a drain_events consumer waits in the read.
        "socket_timeout": max(KOMBU_BRPOP_TIMEOUT_S + 1, dead / 2),
        "socket_connect_timeout": min(dead, CONNECT_TIMEOUT_MAX_S),
        "socket_keepalive": True,
        "socket_keepalive_options": _keepalive(dead),
        "health_check_interval": health_check_interval_s(settings),
        # A pipeline of publishes is not resent after a timeout (it may have run).
        "retry_on_timeout": False,
    }
    s = sentinels(settings)
    if s is not None:
        options["master_name"] = s.master
        options["sentinel_kwargs"] = _sentinel_kwargs(settings, s)
    return options
