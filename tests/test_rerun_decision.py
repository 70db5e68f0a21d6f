"""The job path's one re-run decision (worker.job.rerun.decide), read from the result's typed
facts: finish or hand back. The runs themselves are tests/test_infra_lost.py (a sandbox lost
on a real engine, handed back and run again by a real worker), test_faults.py (a worker
without Docker steps aside) and test_limits.py (a sandbox the engine refused)."""

from __future__ import annotations

from typing import Any

import pytest

from executor.errors import ErrorCode
from executor.models import CodeResult, Status
from worker.job.rerun import decide
from worker.protocol import MAX_ATTEMPTS


def failed(**sandbox: Any) -> CodeResult:
    r = CodeResult.ended(
        "j1", "python", Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE, "Lost.", runtime="docker"
    )
    return r.with_sandbox(**sandbox)


def never_down() -> str | None:
    raise AssertionError("the runtime was asked why it is down, for no reason")


def test_a_lost_sandbox_is_handed_back_while_attempts_are_left_and_its_rerun_harmless() -> None:
    d = decide(
        failed(lost="engine_stopping"), claims=1, rerun_safe=True, why_down=never_down, lost=[]
    )
    assert (d.action, d.cause) == ("hand back", "engine_stopping"), d
    assert d.report == "a sandbox was lost to the infrastructure (engine_stopping)"
    assert "attempt 1 of" in d.note


def test_a_lost_sandbox_on_the_last_attempt_finishes_naming_every_cause() -> None:
    earlier = [{"attempt": 1, "cause": "engine_stopping", "worker": "w@h"}]
    r = failed(lost="sandbox_vanished")
    d = decide(r, claims=MAX_ATTEMPTS, rerun_safe=True, why_down=never_down, lost=earlier)
    assert (d.action, d.report) == ("finish", None), d
    assert d.result.error is not None
    assert f"It was attempt {MAX_ATTEMPTS}, the last" in d.result.error.message
    assert "attempt 1 on w@h: engine_stopping" in d.result.error.message


def test_a_lost_sandbox_of_a_runtime_whose_rerun_is_not_harmless_finishes_as_it_is() -> None:
    r = failed(lost="sandbox_vanished")
    d = decide(r, claims=1, rerun_safe=False, why_down=never_down, lost=[])
    assert (d.action, d.result, d.report) == ("finish", r, None), d


def test_a_sandbox_the_engine_refused_finishes_and_tells_the_gate() -> None:
    d = decide(failed(refused="engine"), claims=1, rerun_safe=True, why_down=never_down, lost=[])
    assert (d.action, d.report) == ("finish", "the engine refused the sandbox of job j1"), d
    own = CodeResult.ended(
        "j1", "python", Status.INVALID, ErrorCode.CODE_INVALID, "Refused.", runtime="docker"
    ).with_sandbox(refused="limits")  # the node's own limits: its outcome, nothing to tell
    d = decide(own, claims=1, rerun_safe=True, why_down=never_down, lost=[])
    assert (d.action, d.report) == ("finish", None), d


@pytest.mark.parametrize(
    ("started", "claims", "down", "action"),
    [
        (False, 1, "Docker is not reachable", "hand back"),
        (False, 1, None, "finish"),  # the runtime can run it here: its own failure
        (True, 1, "Docker is not reachable", "finish"),  # the code ran: not before its start
        (False, MAX_ATTEMPTS, "Docker is not reachable", "finish"),  # the last attempt
    ],
)
def test_a_runtime_down_before_the_code_started_hands_back_while_attempts_are_left(
    started: bool, claims: int, down: str | None, action: str
) -> None:
    d = decide(
        failed(started=started), claims=claims, rerun_safe=True, why_down=lambda: down, lost=[]
    )
    assert d.action == action, d
    if action == "hand back":
        assert (d.report, d.cause) == (down, None), d


def test_a_code_outcome_finishes() -> None:
    r = CodeResult.ended(
        "j1", "python", Status.FAILED, ErrorCode.CODE_ERROR, "boom", runtime="docker"
    ).with_sandbox(started=True)
    assert decide(r, claims=1, rerun_safe=True, why_down=never_down, lost=[]).action == "finish"
