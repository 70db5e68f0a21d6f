"""The broker layer: the one place that chooses kombu's transport and channel for
STUDIO_REDIS_URL, for every process that sends or consumes (the API, the CLI, the worker).

A channel is kombu's own, plain (``redis://``) or Sentinel (``sentinel://``), with the
studio's parts composed over it, each written once:

* ``ChannelBase`` (here): one redis-py client per channel and pool instead of kombu's one
  per publish; a channel that was closed under its user raises a connection error kombu
  retries on a fresh channel (see ``ChannelBase._create_client``);
* ``FairChannel`` (worker.fair): a workflow run carrying its user goes to its user's
  waiting list instead of ``code.run``;
* ``PoisonChannel`` (worker.poison): an item that is not a kombu message is set aside,
  not fatal; a running job's message stays unacked when its channel closes.

``Channel`` and ``SentinelChannel`` below are those parts over kombu's ``Channel`` and
``SentinelChannel``; ``configure`` gives a Celery app the transport of its URL. A process
that only sends never pops (the poison part is idle there); the workers' own resends of a
workflow run (a retry's next attempt, a lost message) carry its user and the fair part
admits them once (worker.fair, ``again``); a message kombu restores or a worker hands
back is kombu's LPUSH, not a send: its run keeps the slot it holds.

Sentinel: kombu asks the sentinels of ``sentinel://H1:P1;sentinel://H2:P2...`` for the
master (``master_name``: STUDIO_REDIS_SENTINEL_MASTER, in worker.redis_conn's transport
options) and talks to the master through it. After a connection error it moves to the next
``sentinel://`` part of the URL and builds that part's transport BY ITS SCHEME: so
``transport_for`` makes the ``sentinel`` scheme name this module's transport in the process
(else fair share and poison handling would be gone after the first failover).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis
from kombu.transport import redis as kombu_redis

from executor.settings import Settings
from worker import fair, redis_conn
from worker.poison import PoisonChannel

if TYPE_CHECKING:
    _ChannelBase = kombu_redis.Channel
else:
    _ChannelBase = object


class ChannelBase(_ChannelBase):
    """What every studio channel does beside kombu (composed first, over the others)."""

    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        """kombu makes a new redis.Redis on its pool for every publish (its __init__ was a
        fifth of a submit's CPU); one per channel and pool does (redis.Redis is thread
        safe: each command takes a connection from the pool).

        A channel closed under its user (kombu's retry of a queue declaration moved the
        connection to the next sentinel, closing the channel the producer still holds) has
        no connection: kombu would fail with an AttributeError ("'NoneType' object has no
        attribute 'client'") that no retry catches. A connection error instead makes the
        publish's retry revive the producer on the new channel and send again."""
        if self.connection is None:
            raise redis.ConnectionError(
                "the broker channel was closed (its connection moved on): sent again on a "
                "new channel"
            )
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client()
        return client


class Channel(ChannelBase, fair.FairChannel, PoisonChannel, kombu_redis.Channel):
    """The studio's channel over kombu's plain Redis channel (``redis://``)."""


class SentinelChannel(ChannelBase, fair.FairChannel, PoisonChannel, kombu_redis.SentinelChannel):
    """The same over kombu's Sentinel channel (``sentinel://``): the master the sentinels
    name, followed through a failover."""


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


TRANSPORT = "worker.broker:Transport"
SENTINEL_TRANSPORT = "worker.broker:SentinelTransport"


def transport_for(redis_url: str) -> str:
    """The broker transport (Celery's ``broker_transport``) for STUDIO_REDIS_URL. With
    sentinels, kombu moves to the next ``sentinel://`` of the URL after a connection error
    and takes that part's transport by its scheme: the scheme names this one too, in this
    process, from now on."""
    if not redis_conn.is_sentinel(redis_url):
        return TRANSPORT
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES["sentinel"] = SENTINEL_TRANSPORT
    return SENTINEL_TRANSPORT


def transport_options(settings: Settings) -> dict[str, Any]:
    """kombu's transport options every channel reads: worker.redis_conn's (timeouts,
    health checks, the master's name with sentinels) and the fair part's."""
    return {**redis_conn.transport_options(settings), **fair.transport_options(settings)}


def configure(app: Any, settings: Settings) -> None:
    """Give ``app`` (before its first connection) the broker of STUDIO_REDIS_URL: its URL,
    its transport and the transport options of every part."""
    options = dict(app.conf.broker_transport_options or {})
    options.update(transport_options(settings))
    app.conf.update(
        broker_url=settings.redis_url,
        broker_transport=transport_for(settings.redis_url),
        broker_transport_options=options,
    )
