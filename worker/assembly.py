"""The worker's assembly, at the top of worker/: the Celery app (Redis broker, two queues, late
acks, one prefork process per slot) and what a worker adds to it (the task, the consumer's
steps, the upkeep's steps, the signals). Nothing in worker/ imports this module back: the
rooms below (job/, upkeep/, metrics/, consumer/) and the shared modules beside it know
nothing of how they are put together.

``celery -A worker worker`` finds the app through ``worker.celery`` (built from the STUDIO_*
environment on first use); ``studio-code worker`` builds the same app from its Settings.
The studio's API and CLI (``api_client``) build a client-side app with ``make_app``: same
broker (the transport and channel worker.broker chooses from the URL), queues and options,
no worker hooks.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kombu import Exchange, Queue

from executor.runtimes.constants import KILL_GRACE_S
from executor.settings import Settings, load_settings
from worker import broker, redis_conn
from worker.context import StudioCelery
from worker.protocol import (
    group_queues,
    restore_interval_s,
    restore_mutex_s,
    visibility_timeout_s,
)

log = logging.getLogger("studio_code.worker")


def make_app(settings: Settings) -> StudioCelery:
    """A Celery app configured for ``settings``: enough to send jobs and cancels."""
    app = StudioCelery(settings, "studio_code", set_as_current=False)
    test_q, run_q = group_queues(settings.worker_group)
    # every connection notices a silent Redis within STUDIO_REDIS_DEAD_AFTER_S; a
    # sentinel:// URL gets its master's name (worker.redis_conn)
    redis_options = redis_conn.transport_options(settings)
    app.conf.update(
        # Celery's result backend carries no data: the run store is the result. Every send
        # passes ignore_result so no client subscribes to result channels.
        result_backend=settings.redis_url,
        result_backend_transport_options=redis_options,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        # the queues of this process's worker group (STUDIO_WORKER_GROUP; the default
        # group's are code.test and code.run): what a worker consumes. A client sends to
        # another group's queue by name (Celery declares it on first use, as these).
        task_queues=tuple(
            Queue(q, Exchange(q, type="direct"), routing_key=q) for q in (test_q, run_q)
        ),
        task_default_queue=run_q,
        # A message is acknowledged when its job ENDS, so a worker that dies mid-job gives it
        # back (after the visibility timeout), and one message per free slot is fetched.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.code_concurrency,
        worker_pool="prefork",
        worker_consumer="worker.consumer.slots:StudioConsumer",
        broker_transport_options={
            # See visibility_timeout_s: longer than the longest wait inside a worker +
            # STUDIO_CODE_MAX_SECONDS + the kill grace, or a running job is handed out twice.
            "visibility_timeout": visibility_timeout_s(settings),
            # A worker that consumes both queues through ONE consumer (no test slots, see
            # worker.consumer.slots) reads code.test before code.run instead of round robin.
            "queue_order_strategy": "priority",
            # Messages of a dead worker come back within one sweep of the visibility timeout
            # (kombu's default sweeps every 100 s).
            "unacked_restore_interval": restore_interval_s(settings),
            "unacked_restore_throttle": 1,
            # a worker killed mid-restore holds kombu's restore lock this long, not 300 s
            "unacked_mutex_expire": restore_mutex_s(settings),
        },
        broker_connection_retry_on_startup=True,
        # A Redis blip must not kill running sandboxes: their result goes to the run store
        # anyway, and a redelivered message finds the job finished (claim returns None).
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # The executor stops a job at its timeout; this is only for a process stuck in a
        # Docker call. Celery then kills the process; the reaper removes its container and
        # fail_stuck ends its job.
        task_time_limit=settings.code_max_seconds + 3 * KILL_GRACE_S + 60,
        task_publish_retry_policy={
            "max_retries": 3,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 2,
        },
        worker_send_task_events=False,
        task_send_sent_event=False,
    )
    # the broker: STUDIO_REDIS_URL's transport (plain or Sentinel) with fair share and
    # poison handling, its URL and the options of every connection, for every process
    # alike (worker.broker)
    broker.configure(app, settings)
    return app


def worker_app(settings: Settings) -> StudioCelery:
    """The app a worker runs: make_app + the task + the worker's hooks (test slots, child
    process set-up, janitor: reaper, revoke backstop)."""
    app = make_app(settings)
    from worker import gate, outcomes
    from worker.consumer import pause, slots
    from worker.job import tasks
    from worker.upkeep import broker_watch, heartbeat, owner, pool_start

    vis = visibility_timeout_s(settings)
    if vis < settings.code_max_seconds + KILL_GRACE_S:
        log.warning(
            "STUDIO_QUEUE_VISIBILITY_TIMEOUT_S=%g is shorter than STUDIO_CODE_MAX_SECONDS=%g "
            "+ the %g s kill grace: a job that runs that long is handed to another worker "
            "and runs twice. Raise it (or set 0 for the default).",
            vis,
            settings.code_max_seconds,
            KILL_GRACE_S,
        )

    tasks.register(app)
    # Task events on Flower's request, without blocking the loop while Redis is away
    app.events.dispatcher_cls = "worker.consumer.events:QuietDispatcher"
    app.steps["worker"].add(slots.ReserveTestSlots)
    app.steps["consumer"].add(slots.CodeTestConsumer)
    app.steps["consumer"].add(pause.GateStep)
    # The main process's loops, store, Redis client and runtime: the gate's probe, the
    # janitor (reaper, revoke backstop, queued sweep, retention), the parked-result flush.
    app.steps["worker"].add(owner.UpkeepStep)
    # The consumer (jobs, pings, the heartbeat) starts once every pool process has started;
    # Celery kills a replacing one that is not up by then (its default: 4 s, which a loaded
    # host's pre-start can take)
    app.steps["worker"].add(pool_start.PoolStartStep)
    app.conf.worker_proc_alive_timeout = settings.queue_pool_start_timeout_s
    # Announces the worker per queue, "paused" with the gate's reason while the gate is
    # closed (its store or runtime is down), so the API refuses what no worker would take.
    app.context.not_serving_reason = gate.pause_reason
    app.steps["consumer"].add(heartbeat.HeartbeatStep)
    # "serving" is proven: each queue's consumer shows round trips to Redis, or the
    # heartbeat says paused ("broker connection lost"); a stuck one exits the worker
    app.steps["consumer"].add(broker_watch.BrokerWatchStep)
    app.steps["worker"].add(broker_watch.BrokerWatchdogStep)
    tasks.connect_process_signals()
    outcomes.register_inspect_commands()
    _connect_metrics(settings)
    return app


def _connect_metrics(settings: Settings) -> None:
    try:
        from worker.metrics import server as metrics_server
    except ImportError as e:  # prometheus-client missing: a worker still runs jobs
        log.warning("worker metrics are off: %s", e)
        return
    from worker.upkeep.gate_watch import gate_checks

    metrics_server.connect_worker_signals(lambda: settings, paused=gate_checks)


_default: StudioCelery | None = None
_default_lock = threading.Lock()


def default_app() -> StudioCelery:
    """The worker app of this process, from the environment (``celery -A worker``)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = worker_app(load_settings())
        return _default


def __getattr__(name: str) -> Any:
    if name == "celery":
        return default_app()
    raise AttributeError(name)
