"""All STUDIO_* settings in one pydantic-settings class, validated at start-up.

A malformed value stops start-up with a sentence naming the variable, the value and what
is allowed (``load_settings`` raises ``SettingsError``). One exception, asked for by the
specification: an UNKNOWN ``STUDIO_CODE_RUNTIME`` does not stop anything, it turns Code
nodes off, and validation and meta say why.
"""

from __future__ import annotations

import os
import re
import sys
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from executor.errors import SettingsError
from executor.languages.ts_imports import DEFAULT_TS_PACKAGES, PackageSpec, parse_packages

KNOWN_RUNTIMES = ("docker", "subprocess")
KNOWN_LANGUAGES = ("python", "typescript")
NOBODY = 65534  # uid/gid a sandbox gets when the server runs as root: no sandbox runs as root

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmg]?)b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(value: str) -> int:
    """'256m' -> 268435456, Docker's units (b, k, m, g; powers of 1024)."""
    m = _SIZE.match(value)
    if not m:
        raise ValueError("not a size")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class Settings(BaseSettings):
    """The executor's configuration; every field is a STUDIO_* environment variable."""

    model_config = SettingsConfigDict(env_prefix="STUDIO_", extra="ignore", frozen=True)

    enable_code_nodes: bool = Field(
        False, description="Turns Code nodes on (1). While off, a workflow with one fails."
    )
    code_runtime: str = Field(
        "docker",
        description="docker (a new locked-down container per call) or subprocess (a child of "
        "the server: NOT a sandbox). Any other value turns Code nodes off.",
    )
    code_image: str = Field("studio-code:1", description="The Python sandbox image.")
    code_packages: str = Field(
        "pydantic,python-dateutil",
        description="Comma-separated packages of STUDIO_CODE_IMAGE, shown in the editor.",
    )
    code_memory: str = Field("256m", description="Memory per call (swap equal to memory).")
    code_cpus: float = Field(0.5, gt=0, le=64, description="CPU share per call.")
    code_pids: int = Field(64, ge=8, le=4096, description="Processes per call.")
    code_max_seconds: float = Field(30, gt=0, le=3600, description="Cap on a node's timeout.")
    code_concurrency: int = Field(4, ge=1, le=256, description="Sandboxes at once per process.")
    code_test_per_minute: int = Field(
        20, ge=1, le=10000, description="Editor test calls per user per minute."
    )
    code_languages: str = Field(
        "python,typescript", description="Languages the editor offers, comma-separated."
    )
    code_ts_image: str = Field("studio-code-ts:1", description="The Deno sandbox image.")
    code_ts_packages: str = Field(
        DEFAULT_TS_PACKAGES,
        description="The only packages TypeScript may import, each npm:name@major; keep it "
        "equal to docker/studio-code-ts/deps.ts.",
    )
    python: str = Field(
        "",
        description="The Python interpreter for subprocess mode. Empty: the server's own, or "
        "/usr/bin/python3 when the server runs as root (the child runs as nobody, who must "
        "be able to execute it).",
    )
    deno: str = Field("deno", description="The Deno binary for subprocess mode.")
    code_ts_deno_dir: str = Field(
        "", description="A Deno cache holding the allowed packages, for subprocess mode."
    )
    code_log_max_bytes: int = Field(
        64 * 1024, ge=1024, description="What a call may print that is kept as logs."
    )
    code_output_max_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest JSON result a call may return."
    )
    code_state_max_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest state JSON a call may be given."
    )
    data_dir: Path = Field(Path("data"), description="Where the embedded SQLite run store lives.")
    database_url: str = Field(
        "", description="Run store URL (SQLAlchemy). Empty: a SQLite file in STUDIO_DATA_DIR."
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for the queue.")
    queue_visibility_timeout_s: float = Field(
        0, ge=0, le=7 * 86400,
        description="Seconds a worker may hold a job's queue message before Redis gives it to "
        "another worker (a dead worker's jobs come back after this). Must be longer than "
        "STUDIO_CODE_MAX_SECONDS plus the kill grace. 0: 2 x STUDIO_CODE_MAX_SECONDS + 120.",
    )
    queue_test_slots: int = Field(
        1, ge=0, le=64,
        description="Worker processes kept for editor test calls (queue code.test) on top of "
        "the STUDIO_CODE_CONCURRENCY slots of workflow runs, so a test never waits behind runs.",
    )
    queue_reap_interval_s: float = Field(
        30, gt=0, le=3600,
        description="Seconds between a worker's sweeps for sandboxes of dead workers and jobs "
        "stuck running.",
    )
    queue_probe_interval_s: float = Field(
        5, gt=0, le=600,
        description="Seconds between a worker's checks that its run store takes writes and its "
        "runtime can run nodes (every second while it is paused for either).",
    )
    queue_pending_ttl_s: int = Field(
        7 * 86400, ge=60,
        description="Seconds a result computed while the run store was down is kept in Redis "
        "(studio:pending:<job id>) to be written when the store is back: store outages shorter "
        "than this lose no result.",
    )

    @field_validator("code_memory")
    @classmethod
    def _memory(cls, v: str) -> str:
        try:
            size = parse_size(v)
        except ValueError:
            raise ValueError("a size such as 256m (a number with b, k, m or g)") from None
        if size < 16 * 1024**2:
            raise ValueError("at least 16m (Deno and Python need more to start)")
        return v

    @field_validator("code_languages")
    @classmethod
    def _languages(cls, v: str) -> str:
        langs = [x.strip() for x in v.split(",") if x.strip()]
        bad = [x for x in langs if x not in KNOWN_LANGUAGES]
        if bad:
            raise ValueError(f"a comma-separated list of {', '.join(KNOWN_LANGUAGES)}")
        return ",".join(langs)

    @field_validator("code_ts_packages")
    @classmethod
    def _ts_packages(cls, v: str) -> str:
        parse_packages(v)  # its ValueError already names the entry and the form to use
        return v

    # --- derived values -------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.code_memory)

    @property
    def runtime_known(self) -> bool:
        return self.code_runtime in KNOWN_RUNTIMES

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(x for x in self.code_languages.split(",") if x)

    @property
    def python_packages(self) -> tuple[str, ...]:
        return tuple(x.strip() for x in self.code_packages.split(",") if x.strip())

    @cached_property
    def ts_packages(self) -> tuple[PackageSpec, ...]:
        """Allowed TypeScript packages. In subprocess mode with neither
        STUDIO_CODE_TS_DENO_DIR nor STUDIO_CODE_TS_PACKAGES set, none is allowed: there is
        no image cache, so nothing could be imported anyway."""
        if (
            self.code_runtime == "subprocess"
            and not self.code_ts_deno_dir
            and "code_ts_packages" not in self.model_fields_set
        ):
            return ()
        return parse_packages(self.code_ts_packages)

    @property
    def python_interpreter(self) -> str:
        if self.python:
            return self.python
        if os.getuid() == 0 and os.path.exists("/usr/bin/python3"):
            return "/usr/bin/python3"
        return sys.executable

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'studio-code.db').resolve()}"


def sandbox_ids() -> tuple[int, int]:
    """The uid:gid sandboxes run as: the server's own, or nobody when the server is root."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        return NOBODY, NOBODY
    return uid, gid


def _env_name(loc: tuple[Any, ...]) -> str:
    return "STUDIO_" + str(loc[0]).upper() if loc else "STUDIO_*"


def load_settings(**overrides: Any) -> Settings:
    """Read STUDIO_* from the environment (overrides win); raise SettingsError on a bad value."""
    try:
        return Settings(**overrides)
    except ValidationError as e:
        sentences = []
        for err in e.errors():
            name = _env_name(err["loc"])
            value = err.get("input")
            custom = str(err.get("ctx", {}).get("error", ""))
            if custom:
                sentences.append(f"{name}={value!r} is not valid: use {custom}.")
            else:
                field = Settings.model_fields.get(str(err["loc"][0])) if err["loc"] else None
                meaning = f" ({field.description})" if field and field.description else ""
                sentences.append(f"{name}={value!r} is not valid: {err['msg'].lower()}{meaning}.")
        raise SettingsError(" ".join(sentences)) from e
