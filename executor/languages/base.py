"""A language is a small object: how to start its runner, what to check at save time, and a
test program that proves it is ready (DMOJ's executors, piston's package tests)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: a save-time check loads none of them
    from executor.languages.python_modules import ImageModules
    from executor.models import CodeErrorInfo, CodeJob, Limits, RawRun
    from executor.packages import ImagePackages
    from executor.settings import Settings


@dataclass(frozen=True)
class Problem:
    """A reason the code may not be saved, at a 1-based line of the user's code (0: none)."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


class ImageFacts:
    """What the image a language runs from says it has, as the runtime that runs it reads it
    (``Runtime.image_facts``) and hands it to the language as data: the modules its Python
    can import (the image's modules file) and the packages it lists at their versions (its
    ``studio.packages`` label; Python's from the modules file). Each is read on its first
    ask, so a check of code that imports nothing reads nothing. This base knows none (a
    runtime without images): None to each, as when a runtime cannot tell (no engine, no
    image, an image built before it recorded them)."""

    def modules(self) -> ImageModules | None:
        """What the image's Python can import, or None (unknown: imports are not checked)."""
        return None

    def packages(self) -> ImagePackages | None:
        """The packages the image lists at their versions, or None (unknown)."""
        return None


#: the facts of no image (a runtime without images, or none at all)
NO_FACTS = ImageFacts()


class AskedLater(ImageFacts):
    """Facts got from ``source`` on the first ask, for a caller that has no runtime of its
    own (``studio-code validate``): a check that asks nothing loads no runtime."""

    def __init__(self, source: Callable[[], ImageFacts]) -> None:
        self._source = source

    @cached_property
    def _facts(self) -> ImageFacts:
        return self._source()

    def modules(self) -> ImageModules | None:
        return self._facts.modules()

    def packages(self) -> ImagePackages | None:
        return self._facts.packages()


class Language(ABC):
    """One language of Code nodes."""

    name: str
    #: a program whose main returns TEST_OUTPUT; readiness means it really ran
    test_program: str
    TEST_OUTPUT = {"ready": True}

    @abstractmethod
    def image(self, settings: Settings) -> str:
        """The sandbox image of this language in the docker runtime."""

    @abstractmethod
    def command(self, settings: Settings, limits: Limits, *, in_container: bool) -> list[str]:
        """argv that starts the runner (the runner's source travels in argv, not in a file)."""

    @abstractmethod
    def environment(self, settings: Settings, *, in_container: bool) -> dict[str, str]:
        """The sandbox's whole environment: nothing of the server's is inherited."""

    def preimport(self, settings: Settings) -> dict[str, str]:
        """What a pre-started sandbox adds to its environment so its runner imports modules
        while it waits for its job (STUDIO_CODE_PREIMPORT); none by default."""
        return {}

    def preimport_modules(self, settings: Settings) -> list[str]:
        """What a pre-started sandbox imports while it waits, as STUDIO_CODE_PREIMPORT
        names it (meta, the workers' heartbeats); none by default."""
        return []

    @abstractmethod
    def check(self, code: str, settings: Settings, facts: ImageFacts) -> list[Problem]:
        """Save-time problems of ``code``; empty when it may be saved. ``facts``: what the
        language's image has, as the runtime read it (``NO_FACTS``: not known)."""

    @abstractmethod
    def packages(self, settings: Settings, facts: ImageFacts) -> list[str]:
        """Packages the editor shows for this language (``facts``: as for ``check``)."""

    def crash_error(self, raw: RawRun) -> CodeErrorInfo | None:
        """A language-specific reading of a sandbox that died without a result (e.g. V8's
        fatal out-of-memory); None to let the executor say what the exit status means."""
        return None

    def result_bytes(self, job: CodeJob, raw: RawRun) -> bytes:
        """The runner's result JSON out of what the sandbox wrote to stdout: all of it by
        default; a runner that frames its result (TypeScript) cuts the frame out."""
        return raw.stdout

    def stdin_payload(self, job: CodeJob, *, end_mark: str = "") -> bytes:
        """Header line with the code (as data), then the state JSON, untouched. With
        ``end_mark`` the runner writes it to stderr once its result is written (the
        result and the logs are complete: see executor/runtimes/docker/pool.py)."""
        head: dict[str, str] = {"code": job.code}
        if end_mark:
            head["end"] = end_mark
        header = json.dumps(head, ensure_ascii=False).encode("utf-8")
        return header + b"\n" + job.state_json.encode("utf-8")
