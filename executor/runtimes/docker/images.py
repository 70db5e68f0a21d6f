"""What an image says it has, read by the docker runtime: its image facts
(``DockerImageFacts``, ``DockerRuntime.image_facts``), which the save-time check of imports
and the package lists (editor, meta, readiness) get as data.

* **The modules file** (``MODULES_PATH``: what the image's Python can import) is copied out
  of the image once per image id, and kept in the process and under
  STUDIO_DATA_DIR/image-modules/, so a save costs nothing after the first, nor does a later
  process's.
* **The packages label** (``studio.packages``) is read from the image's inspect.

Reading one file out of an image: a container is created from the image in the sandboxes'
own shape (``sandbox_policy``: no network, no mounts, every control, labelled, with a
deadline any reaper honours) running ``true``; it is never started. The file is copied out
of it (``GET .../archive``) and the container removed. The socket guard (``sockguard/``)
passes that create and the read of the one file it allows (``MODULES_PATH``).

The settings are the caller's (the executor's own), not re-read from the environment: the
container has the limits the executor's sandboxes have.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import threading
import uuid
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from executor.languages import get_language
from executor.languages.base import ImageFacts
from executor.languages.python_modules import MODULES_PATH, ImageModules
from executor.models import CodeJob
from executor.packages import PACKAGES_LABEL, ImagePackages, parse_image_packages
from executor.runtimes.base import owner_id
from executor.runtimes.docker.client import shared_api
from executor.runtimes.docker.policy import sandbox_policy, shape_limits
from executor.runtimes.docker.sandbox import create
from executor.sandbox_names import container_name

if TYPE_CHECKING:
    from executor.languages.base import Language
    from executor.settings import Settings

log = logging.getLogger("studio_code.executor")


class DockerImageFacts(ImageFacts):
    """The facts of ``language``'s image (``Language.image``) under ``settings``, each read
    on its first ask and kept by this object (a caller asks again for a fresh read: a
    rebuilt image is a new image id). Python's packages are its modules file's (names and
    versions); another language's are its ``studio.packages`` label's."""

    def __init__(self, settings: Settings, language: Language) -> None:
        self.settings = settings
        self.language = language.name
        self.image = language.image(settings)

    @cached_property
    def _modules(self) -> ImageModules | None:
        return read_image_modules(
            self.image, self.settings, self.settings.data_dir / "image-modules"
        )

    def modules(self) -> ImageModules | None:
        return self._modules

    @cached_property
    def _packages(self) -> ImagePackages | None:
        if self.language == "python":
            found = self.modules()
            if found is None:
                return None
            versions = {name: found.versions.get(name, "") for name in found.packages}
            return ImagePackages(self.image, MappingProxyType(versions))
        try:
            labels = shared_api().inspect_image(self.image)["Config"].get("Labels") or {}
        except Exception as e:  # noqa: BLE001 - no engine or no image: readiness says why
            log.debug("the packages of %s are unknown: %s", self.image, e)
            return None
        if PACKAGES_LABEL not in labels:
            return None
        versions = parse_image_packages(labels[PACKAGES_LABEL], self.language)
        return ImagePackages(self.image, MappingProxyType(versions))

    def packages(self) -> ImagePackages | None:
        return self._packages


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
    """The image's modules file, read out of the image (``read_file``); None for an image
    built before the file existed."""
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


def read_file(api: Any, settings: Settings, image: str, path: str) -> bytes:
    """The bytes of the file at ``path`` in ``image``; raises what the engine raises (no such
    image or file, an engine that refuses) after removing the container it made."""
    name, policy = _never_started(api, settings, image)
    box = create(api, settings, policy, name, measured=False)
    try:
        stream, _ = api.get_archive(box.cid, path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.extractfile(tar.getmembers()[0])
            if member is None:
                raise FileNotFoundError(f"{path} in {image} is not a file")
            return member.read()
    finally:
        api.remove_container(box.cid, force=True)


def _never_started(api: Any, settings: Settings, image: str) -> tuple[str, dict[str, Any]]:
    """The name and create arguments of the container a file is copied out of: a
    sandbox's, running ``true``, never started (so not measured)."""
    limits = shape_limits(settings.memory_bytes, settings.code_cpus, settings.code_pids)
    job = CodeJob(job_id=f"modules-{uuid.uuid4().hex[:12]}", code="")
    policy = sandbox_policy(settings, get_language("python"), job, limits, owner_id(), api=api)
    return container_name(job.job_id), {**policy, "image": image, "command": ["true"]}
