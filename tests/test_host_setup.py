"""scripts/host-setup.sh's argument handling and ``--tune`` (docs/operations.md, "Host
tuning"), on a file of the test's own standing for /sys/kernel/rcu_expedited
(STUDIO_HOST_RCU_EXPEDITED): the machine's setting is never read for a change, never written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from testkit.processes import ROOT

SCRIPT = ROOT / "scripts" / "host-setup.sh"
MACHINE = Path("/sys/kernel/rcu_expedited")


def run(*args: str, knob: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUDIO_HOST_SETUP": "0"}  # the setup itself never runs here
    if knob is not None:
        env["STUDIO_HOST_RCU_EXPEDITED"] = str(knob)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30
    )


def test_unknown_arguments_are_refused_before_anything_is_done(tmp_path: Path) -> None:
    knob = tmp_path / "rcu_expedited"
    knob.write_text("0\n")
    for args in (["--bogus"], ["--dry-run"], ["--tune", "--bogus"]):
        p = run(*args, knob=knob)
        assert p.returncode == 2, (args, p.stderr)
        assert "usage:" in p.stderr, (args, p.stderr)
    assert knob.read_text() == "0\n"


def test_tune_sets_the_setting_says_so_and_how_to_undo_it(tmp_path: Path) -> None:
    knob = tmp_path / "rcu_expedited"
    knob.write_text("0\n")
    before = MACHINE.read_text() if MACHINE.exists() else None
    dry = run("--tune", "--dry-run", knob=knob)
    assert dry.returncode == 0 and "would set" in dry.stderr and "0 -> 1" in dry.stderr, dry
    assert knob.read_text() == "0\n", "a dry run changed it"
    done = run("--tune", knob=knob)
    assert done.returncode == 0, done.stderr
    assert knob.read_text().strip() == "1"
    assert "0 -> 1" in done.stderr and f"undo: echo 0 | sudo tee {knob}" in done.stderr, done
    again = run("--tune", knob=knob)
    assert again.returncode == 0 and "1 already: nothing changed" in again.stderr, again
    gone = run("--tune", knob=tmp_path / "missing")
    assert gone.returncode == 0 and "nothing changed" in gone.stderr, gone
    if before is not None:
        assert MACHINE.read_text() == before, "the machine's own setting was changed"


def test_without_tune_nothing_is_tuned(tmp_path: Path) -> None:
    knob = tmp_path / "rcu_expedited"
    knob.write_text("0\n")
    p = run(knob=knob)  # STUDIO_HOST_SETUP=0: the plain setup skipped, and no tuning
    assert p.returncode == 0, p.stderr
    assert knob.read_text() == "0\n"
