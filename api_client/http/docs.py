"""API docs that work on an air-gapped site, and an OpenAPI that says what the API does.

* ``/docs`` (Swagger UI) and ``/redoc`` load their scripts and styles from
  ``/docs-assets/``, files shipped in the fastapi-offline package: the page fetches
  nothing from another host (no CDN, no Google fonts, a local favicon).
* The schema is corrected once, when first generated (``truthful_openapi``):
  - the caller headers are security schemes (``studioUser`` = X-Studio-User, required by
    every route but the runtime meta; ``studioAdmin`` = X-Studio-Admin: 1), not optional
    parameters; a bearer token scheme is declared when the settings have a token;
  - each route lists only the errors it can answer (404 only where an id is read, 409
    only on cancel, 400 only where code is checked, 429 only on the editor test call),
    each with an example body;
  - every 429 declares its ``Retry-After`` header;
  - operation ids are the route functions' names (``list_runs``, ``submit_run``...);
  - request bodies carry examples.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from api_client.http.metrics import api_routes

ASSETS_URL = "/docs-assets"
USER_HEADER = "X-Studio-User"
ADMIN_HEADER = "X-Studio-Admin"

ERROR_EXAMPLES: dict[str, dict[str, Any]] = {
    "400": {
        "code": "CODE_INVALID",
        "message": "line 1: no main(state) function: define def main(state): ...",
    },
    "401": {
        "code": "UNAUTHENTICATED",
        "message": "No X-Studio-User header: the studio's API must say which user calls.",
    },
    "403": {
        "code": "FORBIDDEN",
        "message": "Only an admin may list another user's runs: drop ``user``.",
    },
    "404": {"code": "NOT_FOUND", "message": "No run 'abc' that you can see."},
    "409": {
        "code": "CONFLICT",
        "message": "Run abc already finished (succeeded); nothing to cancel.",
    },
    "422": {
        "code": "REQUEST_INVALID",
        "message": "The request is not valid: code: Field required.",
    },
    "429": {
        "code": "RATE_LIMITED",
        "retry_after_s": 12,
        "message": "User 'u1' made 20 editor test calls in the last minute (the limit, "
        "STUDIO_CODE_TEST_PER_MINUTE=20): try again in 12 s.",
    },
    "503": {
        "code": "RUNTIME_UNAVAILABLE",
        "message": "Docker is not reachable: start the Docker engine.",
    },
}

#: the routes that check code (or the language) and may answer 400 CODE_INVALID
CHECKS_CODE = {
    ("post", "/api/code/validate"),
    ("post", "/api/code/nodes/check"),
    ("post", "/api/code/test"),
    ("post", "/api/runs"),
}

BODY_EXAMPLE = {
    "code": "def main(state):\n    return {'double': state.get('n', 0) * 2}\n",
    "language": "python",
    "state": {"n": 21},
    "timeout_s": 10,
}


def _static_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def install_docs(app: FastAPI, *, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve Swagger UI and ReDoc from this app alone (create the app with
    ``docs_url=None, redoc_url=None``), and make its OpenAPI truthful."""
    app.mount(ASSETS_URL, StaticFiles(directory=_static_dir()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _same_host_only(
            get_swagger_ui_html(
                openapi_url=f"{root}{openapi_url}",
                title=f"{app.title} - Swagger UI",
                swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
                swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
                swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
                oauth2_redirect_url=None,
                # validatorUrl: the badge would ask validator.swagger.io to check the schema
                swagger_ui_parameters={
                    "persistAuthorization": True,
                    "displayOperationId": True,
                    "validatorUrl": None,
                },
            )
        )

    @app.get(redoc_url, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _same_host_only(
            get_redoc_html(
                openapi_url=f"{root}{openapi_url}",
                title=f"{app.title} - ReDoc",
                redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
                redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
                with_google_fonts=False,
            )
        )

    truthful_openapi(app)


#: the docs pages may load only from this host: ReDoc's bundle shows its vendor's logo from
#: cdn.redoc.ly (no option turns it off), which the policy stops before any request leaves
#: the browser. Inline scripts and styles are the pages' own; ReDoc searches in a blob worker.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; "
    "worker-src 'self' blob:; connect-src 'self'"
)


def _same_host_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = DOCS_CSP
    return page


def _has_token_setting() -> bool:
    from executor.settings import Settings

    return any("token" in name for name in Settings.model_fields)


def truthful_openapi(app: FastAPI) -> None:
    """Wrap ``app.openapi`` so the generated schema is corrected once (see module doc)."""
    original: Callable[[], dict[str, Any]] = app.openapi
    done: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "schema" in done:
            return done["schema"]  # type: ignore[no-any-return]
        for route in api_routes(app.routes):
            if route.operation_id is None:
                route.operation_id = route.name
        app.openapi_schema = None
        schema = copy.deepcopy(original())
        rewrite(schema, token=_has_token_setting())
        app.openapi_schema = done["schema"] = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def rewrite(schema: dict[str, Any], *, token: bool = False) -> None:
    """The corrections of the module doc, applied to a generated schema in place."""
    components = schema.setdefault("components", {})
    schemes = components.setdefault("securitySchemes", {})
    schemes["studioUser"] = {
        "type": "apiKey",
        "in": "header",
        "name": USER_HEADER,
        "description": "The studio user id. Set by the studio's API or proxy only (stripped "
        "from client requests); without it a route answers 401.",
    }
    schemes["studioAdmin"] = {
        "type": "apiKey",
        "in": "header",
        "name": ADMIN_HEADER,
        "description": "1 when the user is an admin (sees every run). Set by the studio's "
        "API or proxy only.",
    }
    user_security: list[dict[str, list[str]]] = [
        {"studioUser": []},
        {"studioUser": [], "studioAdmin": []},
    ]
    if token:
        schemes["studioToken"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "The API token the studio's API sends when the service is "
            "configured with one (docs/operations.md).",
        }
        user_security = [{**s, "studioToken": []} for s in user_security]
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            params = op.get("parameters", [])
            headers = {p.get("name") for p in params if p.get("in") == "header"}
            op["parameters"] = [
                p
                for p in params
                if not (p.get("in") == "header" and p.get("name") in (USER_HEADER, ADMIN_HEADER))
            ]
            if not op["parameters"]:
                del op["parameters"]
            if USER_HEADER in headers:
                op["security"] = user_security
            else:
                op["security"] = [{"studioToken": []}] if token else []
            responses = op["responses"]
            if "{job_id}" not in path:
                responses.pop("404", None)
            if not path.endswith("/cancel"):
                responses.pop("409", None)
            if (method, path) not in CHECKS_CODE:
                responses.pop("400", None)
            if path != "/api/code/test":  # the only rate-limited route
                responses.pop("429", None)
            if USER_HEADER not in headers:
                responses.pop("401", None)
            for status, response in responses.items():
                example = ERROR_EXAMPLES.get(status)
                content = response.get("content", {}).get("application/json")
                if example is not None and content is not None and status >= "400":
                    content["example"] = {"error": example}
                if status == "429":
                    response.setdefault("headers", {})["Retry-After"] = {
                        "description": "Seconds to wait before calling again.",
                        "schema": {"type": "integer", "minimum": 1},
                    }
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None and path in ("/api/runs", "/api/code/test"):
                body["example"] = BODY_EXAMPLE
            elif body is not None and path == "/api/code/validate":
                body["example"] = {k: BODY_EXAMPLE[k] for k in ("code", "language")}
            elif body is not None and path == "/api/code/nodes/check":
                body["example"] = {"language": "python"}
