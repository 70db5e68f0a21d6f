"""What Python code in the sandbox image can import, for the save-time check.

The image records it at build time in ``/usr/share/studio-code/modules.json``
(docker/studio-code/record_modules.py): the image's standard library, each listed package's
top-level modules, and every installed top-level module. The executor copies that file out
of the image (a container created, never started, then removed) once per image id and
process, so a save costs nothing after the first. That container is made in the sandboxes'
own shape (``sandbox_policy``, labelled, with a deadline any reaper honours), so the socket
guard (executor/runtimes/sockguard.py) passes its create and the read of this one file.

No file (an image built before this), no Docker, or the subprocess runtime: ``None``, and
the check of imports is skipped (readiness still imports every listed package).
"""

from __future__ import annotations

import ast
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("studio_code.executor")

MODULES_PATH = "/usr/share/studio-code/modules.json"


@dataclass(frozen=True)
class ImageModules:
    """What one image's Python can import."""

    image: str
    stdlib: frozenset[str]
    packages: dict[str, list[str]]  # listed package -> its top-level modules
    modules: frozenset[str]  # every installed top-level module

    def allows(self, module: str) -> bool:
        return module in self.stdlib or module in self.modules


_cache: dict[str, ImageModules | None] = {}
_lock = threading.Lock()
_client: Any = None


def _docker() -> Any:
    global _client
    if _client is None:
        import docker

        _client = docker.from_env(timeout=15).api
    return _client


def read_image_modules(image: str) -> ImageModules | None:
    """The modules file of ``image``, cached per image id; None when it cannot be read."""
    try:
        api = _docker()
        image_id = api.inspect_image(image)["Id"]
    except Exception as e:  # noqa: BLE001 - no Docker or no image: readiness says why
        log.debug("image modules of %s unknown: %s", image, e)
        return None
    with _lock:
        if image_id in _cache:
            return _cache[image_id]
    import io
    import tarfile

    found: ImageModules | None = None
    try:
        cid = api.create_container(**_never_started(api, image))["Id"]
        try:
            stream, _ = api.get_archive(cid, MODULES_PATH)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                member = tar.extractfile(tar.getmembers()[0])
                assert member is not None
                data = json.loads(member.read())
            found = ImageModules(
                image=image,
                stdlib=frozenset(data["stdlib"]),
                packages={k: list(v) for k, v in data["packages"].items()},
                modules=frozenset(data["modules"]),
            )
        finally:
            api.remove_container(cid, force=True)
    except Exception as e:  # noqa: BLE001 - an image built before the file existed
        log.info("no %s in %s (%s): imports are not checked at save time", MODULES_PATH, image, e)
    with _lock:
        _cache[image_id] = found
    return found


def _never_started(api: Any, image: str) -> dict[str, Any]:
    """The create arguments of the container the file is copied out of: a sandbox's (no
    network, no mounts, every control of ``sandbox_policy``) running ``true``, never started."""
    import uuid

    from executor.languages import get_language
    from executor.models import CodeJob, Limits
    from executor.runtimes.base import owner_id
    from executor.runtimes.docker import sandbox_policy
    from executor.settings import load_settings

    settings = load_settings()
    limits = Limits(
        memory_bytes=settings.memory_bytes,
        cpus=settings.code_cpus,
        pids=settings.code_pids,
        timeout_s=1,
        log_max_bytes=1,
        output_max_bytes=1,
    )
    job = CodeJob(job_id=f"modules-{uuid.uuid4().hex[:12]}", code="")
    policy = sandbox_policy(settings, get_language("python"), job, limits, owner_id())
    return {
        **policy,
        "name": f"studio-code-{job.job_id}",
        "image": image,
        "command": ["true"],
        "host_config": api.create_host_config(**policy["host_config"]),
    }


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _guarded(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    if t is None:
        return True
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return any(isinstance(n, ast.Name) and n.id in _IMPORT_ERRORS for n in names)


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) of each absolute import, except those inside a ``try``
    that handles ImportError (optional imports with a fallback)."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Try | ast.TryStar):
            inner = guarded or any(_guarded(h) for h in node.handlers)
            for stmt in node.body:
                visit(stmt, inner)
            rest: list[ast.AST] = [*node.handlers, *node.orelse, *node.finalbody]
            for other in rest:
                visit(other, guarded)
            return
        if not guarded:
            if isinstance(node, ast.Import):
                out.extend((node.lineno, a.name.split(".")[0]) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((node.lineno, node.module.split(".")[0]))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return out
