"""The route groups of the HTTP API, each an ``APIRouter`` of ``kit.ErrorRoute``s:
``code`` (the editor's meta, validate, node check, test call) and ``runs`` (submit, read,
cancel, history, logs). ``ROUTERS`` is every group, in the order an app includes them."""

from __future__ import annotations

from api_client.http.routes import code, runs

ROUTERS = (code.router, runs.router)
