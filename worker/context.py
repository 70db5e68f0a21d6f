"""The worker's own data, typed, in one place: ``StudioCelery`` (the project's Celery app, with
its Settings) and the ``WorkerContext`` it carries, instead of attributes hung on Celery's
objects.

One app per process (``celery -A worker``, ``studio-code worker``), so the context is the
worker's: its bootsteps fill it in the main process (the test slots before the pool forks, the
store id once the janitor opened the store) and every reader takes it from the app.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from executor.settings import Settings


def _serving() -> str | None:
    return None


def _no_engine() -> dict[str, Any] | None:
    return None


@dataclass
class WorkerContext:
    """What a worker's steps share.

    * ``test_slots``: pool processes kept for ``code.test`` (0: no split; worker.consumer.slots);
    * ``store_id``: the run store's id, read when the janitor opened it ("" before), announced
      by the heartbeat;
    * ``not_serving_reason``: why the worker should not count as serving now (None: it
      does); the gate's ``pause_reason`` on a worker.
    * ``fatal``: why the worker stopped itself (None: it did not), for the CLI's JSON line
      and exit code (worker.upkeep.owner: a store that never opened);
    * ``engine``: the engine under its sandboxes as the heartbeat announces it (None: none,
      or not read yet); the upkeep's ``EngineWatch.announcement`` on a worker.
    """

    test_slots: int = 0
    store_id: str = ""
    not_serving_reason: Callable[[], str | None] = field(default=_serving)
    engine: Callable[[], dict[str, Any] | None] = field(default=_no_engine)
    fatal: str | None = None


class StudioCelery(Celery):
    """A Celery app with the project's Settings and the worker's context."""

    def __init__(self, settings: Settings, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.context = WorkerContext()


def studio_app(app: Any) -> StudioCelery | None:
    """``app`` when it is the project's (a step or signal may run under another app)."""
    return app if isinstance(app, StudioCelery) else None


def context_of(app: Any) -> WorkerContext:
    """The worker context of ``app`` (a blank one for an app that is not the project's)."""
    ours = studio_app(app)
    return ours.context if ours is not None else WorkerContext()


def consumed_queues(app: Celery) -> set[str]:
    """The queues a worker of ``app`` consumes (-Q; every queue of the app without it)."""
    queues = app.amqp.queues
    return set(queues.consume_from or queues)
