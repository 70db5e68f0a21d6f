"""What a fresh interpreter loads: the modules (``sys.modules``) after a script, so a test can
say a command or an import loads no heavy dependency (tests/test_imports.py,
tests/test_tracing.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from testkit.processes import ROOT


def loaded_after(script: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules (top-level names and dotted names) a fresh interpreter holds after
    running ``script``, which may print to stdout (it is set aside)."""
    probe = textwrap.dedent(script) + textwrap.dedent("""
        import sys as _sys, json as _json
        _sys.__stdout__.write("\\n@@MODULES@@" + _json.dumps(sorted(_sys.modules)) + "\\n")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = json.loads(proc.stdout.rsplit("@@MODULES@@", 1)[1])
    return set(names) | {n.split(".")[0] for n in names}


def loaded_of(modules: set[str], wanted: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m in wanted)
