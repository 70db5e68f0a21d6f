"""The queue's worker side: the Celery app, the task, test slots, revoke -> kill, reaping.

Laid out by process (docs/architecture.md, "worker/, by process"): ``worker.assembly`` at the
top puts the worker together; ``job/`` (each pool process), ``upkeep/`` (the main process's
threads), ``metrics/`` and ``consumer/`` (Celery's consumer as the worker shapes it) are the
rooms; the modules at this level (``protocol``, ``registry``, ``broker``, ...) are what the
rooms and the API share. Arrows point down only (tests/test_imports.py).

``celery -A worker worker`` finds the app as ``worker.celery`` (built lazily from the
STUDIO_* environment, so importing this package reads no settings).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Celery's find_app tries ``worker.app`` first (not a name here: the app's module is
    # worker.assembly), then ``worker.celery``, which is the app. Hence no subpackage may be
    # named ``app`` or ``celery``.
    if name == "celery":
        from worker.assembly import default_app

        return default_app()
    raise AttributeError(name)
