"""The unit of work of ``make test`` under pytest-xdist (``--dist loadgroup``): a test module,
or the group a module names (``pytestmark = pytest.mark.xdist_group("name")``), kept on one
process. A pytest plugin (tests/conftest.py registers it).

pytest-xdist 3.8 tells its controller an item's group by appending ``@group`` to the item's
node id in the worker (``item._nodeid``); pytest 9.2 builds the node id from a structured id
and ignores that attribute (pytest-xdist#1386), so no group reached the controller and each
TEST became a unit of its own: a module's tests ran on every process at once, each process
building the module's fixtures. Seen: tests/test_hostile.py's battery ran on three processes
at once with the same job ids, and each process's create, answered 409 on the name, removed
the sandbox another process was running (``DockerRuntime._create``, a redelivery's rule):
"sandbox_vanished", or a start answered 409 "marked for removal" (57 such removals in one
``-n 3`` run of the module, traced).

Here the controller's scheduler makes a node id without a group its module's unit, which
needs nothing from the worker; a group a module names still needs xdist's suffix, so a test
whose node id lost it fails before its fixtures, saying why, rather than run beside the
group's other modules."""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadGroupScheduling


class ModuleScheduling(LoadGroupScheduling):
    """``--dist loadgroup``, where a test with no group suffix goes with its module."""

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        return nodeid.split("::", 1)[0] if scope == nodeid else scope


@pytest.hookimpl(optionalhook=True)  # a run without xdist has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadGroupScheduling | None:
    if config.getvalue("dist") != "loadgroup":
        return None
    return ModuleScheduling(config, log)  # type: ignore[arg-type]


def _named_group(item: pytest.Item) -> str | None:
    """The group ``item``'s module names, if not its own path (the default group)."""
    module = item.nodeid.split("::", 1)[0]
    for mark in item.iter_markers("xdist_group"):
        name = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        if name != module:
            return name
    return None


@pytest.hookimpl(tryfirst=True)  # before any fixture of the test
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In a worker of ``--dist loadgroup``: a test of a named group whose suffix did not make
    it into its node id fails, before its fixtures (the group's modules would run at once)."""
    if not getattr(item.config.option, "loadgroup", False):  # set in xdist's workers
        return
    name = _named_group(item)
    if name is not None and not item.nodeid.endswith(f"@{name}"):
        pytest.fail(
            f"{item.nodeid} names the xdist group {name!r}, which this pytest-xdist cannot "
            "pass on with this pytest (pytest-xdist#1386): its modules would run at the same "
            "time on several processes. Run without -n, or drop the group.",
            pytrace=False,
        )
