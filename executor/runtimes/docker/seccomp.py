"""The sandbox's own seccomp profile: ``seccomp.json`` beside this file, derived from Docker's
default profile by ``docker/seccomp/derive.py`` (docs/security.md lists what it removes and
why). The docker runtime passes it with every container (``sandbox_policy``); runtime meta
shows its sha256 so an operator can check which profile the sandboxes run under."""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

PROFILE_PATH = Path(__file__).with_name("seccomp.json")


@cache
def profile_bytes() -> bytes:
    """The profile file as shipped (what the sha256 is of)."""
    return PROFILE_PATH.read_bytes()


@cache
def profile_json() -> str:
    """The profile as compact JSON text, for ``security_opt: ["seccomp=<text>"]`` (the
    daemon takes the profile's text, not a path: the docker CLI reads the file itself)."""
    return json.dumps(json.loads(profile_bytes()), separators=(",", ":"))


@cache
def profile_sha256() -> str:
    return hashlib.sha256(profile_bytes()).hexdigest()
