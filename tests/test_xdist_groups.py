"""``make test``'s processes (pytest-xdist, ``--dist loadgroup``) each take whole modules
(testkit/xdist_groups.py): a module's tests on several processes at once build its
module-scoped fixtures once per process, side by side (tests/test_hostile.py's battery then
ran its fixed job ids three times at once, and the runs removed each other's sandboxes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from testkit.processes import ROOT

#: "[gw1] [ 40%] PASSED tests/test_settings.py::test_x" (pytest -v under xdist)
RESULT = re.compile(r"^\[(gw\d+)\] .*?(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+?\.py)::")


def _run(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, set]]:
    """``pytest -n 2 --dist loadgroup -v args`` in ``cwd``; its result and each module's
    processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v"]
        + ["--no-loadscope-reorder", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    where: dict[str, set] = defaultdict(set)
    for line in out.stdout.splitlines():
        if m := RESULT.match(line):
            where[m.group(2)].add(m.group(1))
    return out, where


def test_each_module_of_the_suite_runs_on_one_process() -> None:
    modules = ["tests/test_rerun_decision.py", "tests/test_settings.py"]
    out, where = _run(modules, ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert sorted(where) == modules, out.stdout[-3000:]
    assert all(len(procs) == 1 for procs in where.values()), dict(where)


def test_a_group_a_module_names_never_runs_on_two_processes_at_once(tmp_path: Path) -> None:
    """Two modules that name one group: on one process, or (a pytest-xdist that cannot pass
    the group on) each of their tests failed before its fixtures, saying why."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["testkit.xdist_groups"]\n')
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import pytest\n\npytestmark = pytest.mark.xdist_group('together')\n\n"
            "@pytest.mark.parametrize('i', range(6))\ndef test_one(i):\n    pass\n"
        )
    out, where = _run([], tmp_path)
    assert sorted(where) == ["test_a.py", "test_b.py"], out.stdout[-3000:] + out.stderr[-2000:]
    if len(set().union(*where.values())) > 1:
        said = out.stdout.count("names the xdist group 'together'")
        assert out.returncode != 0 and said >= 12, out.stdout[-3000:]
