"""What the studio's API imports: ``CodeClient`` (submit, wait, status, cancel, validate,
meta, rate-limited editor test calls) and the errors it raises.

The names load on first use (``from api_client import CodeClient`` works as before), so
importing ``api_client.cli`` for ``studio-code --help`` does not load Redis, SQLAlchemy or
the Docker SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api_client.client import CodeClient, JobNotFound
    from api_client.idempotency import IdempotencyConflict
    from executor.errors import (
        CodeInvalid,
        CodeNodesDisabled,
        ErrorCode,
        RateLimited,
        RuntimeUnavailable,
        StoreUnavailable,
        StudioCodeError,
    )
    from executor.models import CodeResult, Status
    from executor.store import JobRecord

#: each exported name and the module it lives in
_HOMES = {
    "CodeClient": "api_client.client",
    "JobNotFound": "api_client.client",
    "IdempotencyConflict": "api_client.idempotency",
    "CodeInvalid": "executor.errors",
    "CodeNodesDisabled": "executor.errors",
    "ErrorCode": "executor.errors",
    "RateLimited": "executor.errors",
    "RuntimeUnavailable": "executor.errors",
    "StoreUnavailable": "executor.errors",
    "StudioCodeError": "executor.errors",
    "CodeResult": "executor.models",
    "Status": "executor.models",
    "JobRecord": "executor.store",
}

__all__ = [
    "CodeClient",
    "CodeInvalid",
    "CodeNodesDisabled",
    "CodeResult",
    "ErrorCode",
    "IdempotencyConflict",
    "JobNotFound",
    "JobRecord",
    "RateLimited",
    "RuntimeUnavailable",
    "Status",
    "StoreUnavailable",
    "StudioCodeError",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'api_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
