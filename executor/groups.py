"""Worker groups: which workers a job goes to (issue 42).

A worker serves one group (STUDIO_WORKER_GROUP, ``studio-code worker --group``) and says what
one of its slots holds: its STUDIO_CODE_MAX_MEMORY and STUDIO_CODE_MAX_CPUS, the caps its
guard enforces. The API knows the groups beyond ``default`` from STUDIO_WORKER_GROUPS
(``NAME:MEMORY:CPUS``, comma-separated); the default group holds what the API's own caps
say. A job goes to the group its caller names, else by size (``choose``): the default group
when it holds the job, else the smallest group that does. Each group has its own queues
(worker.protocol.group_queues): the default group keeps code.run and code.test.

No I/O here: the rule and its sentences only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from executor.errors import CodeInvalid
from executor.floors import MIN_CPUS, MIN_MEMORY_BYTES
from executor.sizes import parse_size, size_text


class GroupSettings(Protocol):
    """What ``groups_of`` reads of the settings (executor.settings.Settings is one; the
    settings import this module to check their own values, so it names no Settings)."""

    @property
    def max_memory_bytes(self) -> int: ...

    @property
    def max_cpus(self) -> float: ...

    @property
    def worker_groups(self) -> str: ...


DEFAULT_GROUP = "default"
#: the most groups STUDIO_WORKER_GROUPS may declare (each is a metrics label value)
MAX_GROUPS = 8
NAME_SHAPE = re.compile(r"[a-z][a-z0-9-]{0,31}")
_NAME_RULE = (
    "a lowercase letter, then up to 31 lowercase letters, digits or '-' (e.g. big), or "
    f"{DEFAULT_GROUP}"
)


@dataclass(frozen=True)
class Group:
    """A worker group and what one of its slots holds."""

    name: str
    memory_bytes: int
    cpus: float

    def holds(self, memory_bytes: int, cpus: float) -> bool:
        return memory_bytes <= self.memory_bytes and cpus <= self.cpus + 1e-9

    def describe(self) -> str:
        return f"{self.name} ({size_text(self.memory_bytes)}, {self.cpus:g} CPU per slot)"

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "memory_bytes": self.memory_bytes, "cpus": self.cpus}


def check_name(name: str) -> str:
    """``name`` when it may name a group; ValueError saying the rule otherwise."""
    if not NAME_SHAPE.fullmatch(name):
        raise ValueError(f"{name!r} is not a group name: give {_NAME_RULE}")
    return name


def parse_groups(text: str) -> tuple[Group, ...]:
    """STUDIO_WORKER_GROUPS as groups (ValueError with the rule for a bad one)."""

    out: list[Group] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        parts = [p.strip() for p in item.split(":")]
        rule = "each group NAME:MEMORY:CPUS, e.g. big:4g:4"
        if len(parts) != 3:
            raise ValueError(f"{item!r} is not a group: give {rule}")
        name = check_name(parts[0])
        if name == DEFAULT_GROUP:
            raise ValueError(
                f"{item!r}: the default group holds STUDIO_CODE_MAX_MEMORY / _MAX_CPUS; "
                "give only the other groups here"
            )
        if any(g.name == name for g in out):
            raise ValueError(f"group {name!r} is given twice: give each group once")
        try:
            memory = parse_size(parts[1])
            cpus = float(parts[2])
        except ValueError:
            raise ValueError(f"{item!r} is not a group: give {rule}") from None
        if memory < MIN_MEMORY_BYTES or not MIN_CPUS <= cpus <= 64:
            raise ValueError(
                f"{item!r}: a slot must hold at least {MIN_MEMORY_BYTES // 1024**2}m and "
                f"{MIN_CPUS:g} to 64 CPUs"
            )
        out.append(Group(name, memory, cpus))
    if len(out) > MAX_GROUPS:
        raise ValueError(f"{len(out)} groups given: give at most {MAX_GROUPS}")
    return tuple(out)


def groups_of(settings: GroupSettings) -> tuple[Group, ...]:
    """Every group the API sends jobs to, the default group first (what this process's
    caps hold), then STUDIO_WORKER_GROUPS."""
    default = Group(DEFAULT_GROUP, settings.max_memory_bytes, settings.max_cpus)
    return (default, *parse_groups(settings.worker_groups))


def widest(groups: tuple[Group, ...]) -> tuple[int, float]:
    """The most memory and the most CPU any group's slot holds (the API's caps)."""
    return max(g.memory_bytes for g in groups), max(g.cpus for g in groups)


def _asks(memory_bytes: int, cpus: float) -> str:
    return f"{size_text(memory_bytes)} of memory and {cpus:g} CPU"


def choose(
    groups: tuple[Group, ...], memory_bytes: int, cpus: float, asked: str | None = None
) -> Group:
    """The group a job asking ``memory_bytes`` and ``cpus`` goes to: ``asked`` (the
    caller's) when given, else the default group (``groups[0]``) when it holds the job,
    else the smallest group that holds it. Raises CodeInvalid naming the groups when the
    asked group is unknown or too small, or no group holds the job."""
    known = ", ".join(g.describe() for g in groups)
    if asked:
        found = next((g for g in groups if g.name == asked), None)
        if found is None:
            raise CodeInvalid(
                f"group={asked!r} is not a worker group here: give one of {known} "
                "(STUDIO_WORKER_GROUPS), or none to choose by size."
            )
        if not found.holds(memory_bytes, cpus):
            raise CodeInvalid(
                f"The node asks {_asks(memory_bytes, cpus)}, more than a slot of group "
                f"{found.describe()} holds: ask less, or give a group that holds it "
                f"({known}), or none to choose by size."
            )
        return found
    if groups[0].holds(memory_bytes, cpus):
        return groups[0]
    fits = [g for g in groups if g.holds(memory_bytes, cpus)]
    if not fits:
        raise CodeInvalid(
            f"The node asks {_asks(memory_bytes, cpus)}, more than a slot of any worker "
            f"group holds ({known}): ask less, or ask an admin for a group that holds it "
            "(STUDIO_WORKER_GROUPS)."
        )
    return min(fits, key=lambda g: (g.memory_bytes, g.cpus, g.name))


def asks_text(memory_bytes: int, cpus: float) -> str:
    """What a job asks, as a refusal names it."""
    return _asks(memory_bytes, cpus)
