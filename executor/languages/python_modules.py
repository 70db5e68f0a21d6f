"""What Python code in the sandbox image can import, for the save-time check.

The image records it at build time in ``/usr/share/studio-code/modules.json``
(docker/studio-code/record_modules.py): the image's standard library, each listed package's
top-level modules, and every installed top-level module. The executor copies that file out
of the image (a container created, never started, then removed) once per image id, and
keeps it in the process and under STUDIO_DATA_DIR/image-modules/, so a save costs nothing
after the first, nor does a later process's. Reading the file is the docker runtime's
operation (executor/runtimes/docker/images.py, with the caller's settings): a container in
the sandboxes' own shape, so the socket guard passes its create and the read of this file.

No file (an image built before this), no Docker, or the subprocess runtime: ``None``, and
the check of imports is skipped (readiness still imports every listed package).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from executor import sandbox_names

if TYPE_CHECKING:
    from executor.settings import Settings

log = logging.getLogger("studio_code.executor")

MODULES_PATH = sandbox_names.MODULES_PATH


@dataclass(frozen=True)
class ImageModules:
    """What one image's Python can import."""

    image: str
    stdlib: frozenset[str]
    packages: dict[str, list[str]]  # listed package -> its top-level modules
    modules: frozenset[str]  # every installed top-level module
    # listed package -> its version; empty for an image built before versions were recorded
    versions: dict[str, str] = field(default_factory=dict)

    def allows(self, module: str) -> bool:
        return module in self.stdlib or module in self.modules


_cache: dict[str, ImageModules | None] = {}
_lock = threading.Lock()


def read_image_modules(
    image: str, settings: Settings, cache_dir: Path | None = None
) -> ImageModules | None:
    """The modules file of ``image``, cached per image id in this process and, with
    ``cache_dir``, in a file there (an image id names its content, so the file never goes
    stale): a one-shot process (``studio-code run``) then creates no container to read it.
    ``settings``: the caller's, for the container the file is read from. None when it
    cannot be read."""
    try:
        from executor.runtimes.docker.client import shared_api

        api = shared_api()
        image_id = api.inspect_image(image)["Id"]
    except Exception as e:  # noqa: BLE001 - no Docker or no image: readiness says why
        log.debug("image modules of %s unknown: %s", image, e)
        return None
    with _lock:
        if image_id in _cache:
            return _cache[image_id]
    saved = cache_dir / f"{image_id.replace(':', '-')}.json" if cache_dir else None
    data = _read_saved(saved) if saved else None
    if data is None:
        data = _copy_out(api, settings, image)
        if data is not None and saved is not None:
            _save(saved, data)
    found = None
    if data is not None:
        found = ImageModules(
            image=image,
            stdlib=frozenset(data["stdlib"]),
            packages={k: list(v) for k, v in data["packages"].items()},
            modules=frozenset(data["modules"]),
            versions={str(k): str(v) for k, v in (data.get("versions") or {}).items()},
        )
    with _lock:
        _cache[image_id] = found
    return found


def _copy_out(api: Any, settings: Settings, image: str) -> dict[str, Any] | None:
    """The image's modules file, read out of the image by the docker runtime
    (``images.read_file``); None for an image built before the file existed."""
    from executor.runtimes.docker.images import read_file

    try:
        data = json.loads(read_file(api, settings, image, MODULES_PATH))
        _ = data["stdlib"], data["packages"], data["modules"]
        return data  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001 - an image built before the file existed
        log.info("no %s in %s (%s): imports are not checked at save time", MODULES_PATH, image, e)
        return None


def _read_saved(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        _ = data["stdlib"], data["packages"], data["modules"]
        return data  # type: ignore[no-any-return]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # not saved yet, or unreadable: copied out again


def _save(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all (a rename); a folder that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        log.debug("image modules not saved in %s: %s", path.parent, e)


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
