"""Heavy imports before the job (issue 34): a pre-started sandbox imports STUDIO_CODE_PREIMPORT
(``image``: the packages the image lists) while it waits, inside the same fresh container its
one job then uses; a cold run imports nothing ahead; nothing carries from one job to the
next. What each sandbox had imported is reported from inside it, by the node's own code
(which imports nothing itself). Real Docker, the real image (STUDIO_CODE_IMAGE)."""

from __future__ import annotations

from typing import Any

import pytest

from executor.models import CodeJob, Status
from tests import test_pool

#: the fixture of tests/test_pool.py: executors with a filled pool (Python), closed at the end
pooled = test_pool.pooled

SEEN = (
    "import os, sys\n"
    "def main(state):\n"
    "    mark = getattr(sys.modules.get('dateutil'), 'LEFT_BY_A_JOB', None)\n"
    "    if state.get('leave'):\n"
    "        import dateutil\n"
    "        dateutil.LEFT_BY_A_JOB = 1\n"
    "    return {'imported': sorted(m for m in ('pydantic', 'dateutil', 'no_such_module_i34')\n"
    "                                if m in sys.modules),\n"
    "            'env': os.environ.get('STUDIO_PREIMPORT'), 'mark': mark}\n"
)


def _run(ex: Any, state: str = "{}") -> tuple[dict[str, Any], str]:
    """The node's report from inside its sandbox, and where the sandbox came from."""
    r = ex.run(CodeJob(code=SEEN, state_json=state, timeout_s=20))
    assert r.status is Status.SUCCEEDED, r.error
    start = next(t.detail for t in r.trace if t.step == "sandbox.start")
    return r.output, start


def test_a_prestarted_sandbox_has_the_image_packages_imported_before_its_job(
    pooled: Any,
) -> None:
    ex = pooled(code_preimport="image")
    seen, start = _run(ex)
    assert start == "pool"
    assert seen == {"imported": ["dateutil", "pydantic"], "env": None, "mark": None}
    # the next job: a fresh container, pre-imported again, nothing of the first job's left
    assert ex.runtime.pool.wait_ready(60)
    first, _ = _run(ex, '{"leave": true}')
    assert ex.runtime.pool.wait_ready(60)
    second, start = _run(ex)
    assert start == "pool" and first["mark"] is None and second["mark"] is None
    assert second["imported"] == ["dateutil", "pydantic"]


def test_a_named_list_is_imported_and_a_missing_module_left_to_the_job(pooled: Any) -> None:
    ex = pooled(code_preimport="dateutil,no_such_module_i34")
    seen, start = _run(ex)
    assert start == "pool" and seen["imported"] == ["dateutil"]


def test_without_the_setting_and_cold_nothing_is_imported_ahead(
    pooled: Any, make_settings: Any, python_image: str
) -> None:
    from executor.service import Executor

    seen, start = _run(pooled())
    assert start == "pool" and seen["imported"] == []
    cold = Executor(
        make_settings(code_runtime="docker", code_image=python_image, code_preimport="image")
    )
    seen, start = _run(cold)
    assert start != "pool" and seen["imported"] == []


def test_meta_shows_the_setting(make_settings: Any) -> None:
    from executor.meta import runtime_meta
    from executor.service import Executor

    ex = Executor(make_settings(code_runtime="subprocess", code_preimport=" pandas, numpy ,pandas"))
    assert runtime_meta(ex)["pool"]["preimport"] == "pandas,numpy"


@pytest.mark.parametrize("value", ["pandas,numpy-x", "image,pandas", "../etc"])
def test_a_bad_preimport_setting_is_refused_naming_the_entry(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from executor.settings import load_settings

    monkeypatch.setenv("STUDIO_CODE_PREIMPORT", value)
    with pytest.raises(
        Exception, match="STUDIO_CODE_PREIMPORT entry '(numpy-x|image|../etc)' (is not|stands)"
    ):
        load_settings()
