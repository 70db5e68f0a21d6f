"""A worker app (``celery -A testkit.hang_app worker``): the studio's, whose pool processes
hang for TESTKIT_POOL_HANG_S seconds as they start, before the studio's own start (a call
that never returns, a lock never released): what a pool process stuck at start is to its
main process."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import signals


def _hang(**_: Any) -> None:
    time.sleep(float(os.environ.get("TESTKIT_POOL_HANG_S", "0")))


# connected first, so it runs before the studio's own start (worker.job.tasks)
signals.worker_process_init.connect(_hang, weak=False)

from worker.assembly import default_app  # noqa: E402 - after the hang is connected

app = default_app()
