"""The queue's worker side: the Celery app, the task, test slots, revoke -> kill, reaping.

``celery -A worker worker`` finds the app as ``worker.celery`` (built lazily from the
STUDIO_* environment, so importing this package reads no settings).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Celery's find_app tries ``worker.app`` first (not a name here: the app's module is
    # worker.glue.app), then ``worker.celery``, which is the app. Hence no subpackage may be
    # named ``app`` or ``celery``.
    if name == "celery":
        from worker.glue.app import default_app

        return default_app()
    raise AttributeError(name)
