"""What the studio's API imports: ``CodeClient`` (submit, wait, status, cancel, validate,
meta, rate-limited editor test calls) and the errors it raises."""

from __future__ import annotations

from api_client.client import CodeClient, JobNotFound
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

__all__ = [
    "CodeClient",
    "CodeInvalid",
    "CodeNodesDisabled",
    "CodeResult",
    "ErrorCode",
    "JobNotFound",
    "JobRecord",
    "RateLimited",
    "RuntimeUnavailable",
    "Status",
    "StoreUnavailable",
    "StudioCodeError",
]
