"""Where audit entries go. The run store persists them; with no store they are logged."""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

log = logging.getLogger("studio_code.audit")

SUBPROCESS_RUNTIME_USED = "system.code_runtime_subprocess"


class AuditSink(Protocol):
    """Anything that can record an audit entry (the run store is one)."""

    def audit(self, event: str, details: dict[str, Any], *, actor: str = "system") -> None: ...


class LogAuditSink:
    """Writes audit entries to the log, for the embedded default with no run store."""

    def audit(self, event: str, details: dict[str, Any], *, actor: str = "system") -> None:
        log.warning("audit %s by %s: %s", event, actor, json.dumps(details, sort_keys=True))
