"""Retention: how long finished runs, and their payloads, stay in the run store.

The janitor of every worker calls ``apply_retention`` once per sweep
(STUDIO_QUEUE_REAP_INTERVAL_S). Each call does at most 20 short transactions of
STUDIO_RETENTION_BATCH_ROWS rows, so it never holds the store's write lock for long (SQLite
has one for the whole file) and a backlog of old runs drains over a few sweeps. Several
workers pruning at once is harmless: a row is deleted or cleared once, whoever gets it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from executor.settings import Settings
from executor.store import PruneReport, RunStore

log = logging.getLogger("studio_code.worker")

MAX_BATCHES_PER_SWEEP = 20


def cutoffs(
    settings: Settings, now: datetime | None = None
) -> tuple[datetime | None, datetime | None]:
    """(runs_before, payloads_before) for ``now``; None where the setting is 0 (keep)."""
    now = now or datetime.now(UTC)
    runs = now - timedelta(days=settings.runs_keep_days) if settings.runs_keep_days else None
    payloads = None
    if settings.runs_payload_keep_days:
        payloads = now - timedelta(days=settings.runs_payload_keep_days)
        if runs is not None and payloads < runs:
            payloads = None  # the rows go before their payloads would
    return runs, payloads


def apply_retention(
    store: RunStore, settings: Settings, now: datetime | None = None
) -> PruneReport | None:
    """One bounded retention pass; None when the pass failed (it is logged and tried again
    at the next sweep). With both settings 0 it removes expired idempotency keys only."""
    runs_before, payloads_before = cutoffs(settings, now)
    try:
        report = store.prune(
            runs_before=runs_before,
            payloads_before=payloads_before,
            keys_before=now or datetime.now(UTC),  # expired idempotency keys, always
            batch=settings.retention_batch_rows,
            max_batches=MAX_BATCHES_PER_SWEEP,
        )
    except Exception:  # noqa: BLE001 - retention must never stop the reaper
        log.exception("retention pass failed (tried again at the next sweep)")
        return None
    if report.deleted or report.payloads_cleared or report.keys_removed:
        log.info(
            "retention: %d runs deleted, %d payloads cleared, %d expired idempotency keys "
            "removed in %d batches",
            report.deleted,
            report.payloads_cleared,
            report.keys_removed,
            report.batches,
        )
    return report
